"""Prompt templates: the named QA layouts a prompt is rendered in (inside the model's own chat
template, or as plain text for base models), and their registry. Bias profiles are stored per
template; ``register_template`` adds one (docs/development.md, Extending).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import InvalidRequest
from service.passage import Passage


@dataclass(frozen=True, slots=True)
class PromptTemplate:
    """A named QA prompt layout (rendered inside the model's own chat template).

    The user message is ``instruction``, the documents in slot order, then ``question_prefix``
    followed by the query, each part separated by ``separator``. A passage is rendered with
    ``document`` (``{index}`` is the 1-based slot, ``{title}``, ``{text}``), or with
    ``untitled_document`` when it has no title. ``question_prefix`` should end with a newline:
    byte-level BPE merges a preceding space into the query's first word.

    A ``completion`` template is for base models, which have no chat template: the same text
    follows the model's BOS token directly, and a generation prompt appends ``answer_prefix``
    instead of opening an assistant turn.
    """

    name: str
    instruction: str
    document: str
    untitled_document: str
    question_prefix: str = "Question:\n"
    separator: str = "\n\n"
    system: str | None = None
    """If set, sent as a system message; the instruction then stays in the user message."""
    completion: bool = False
    """Plain text after the BOS token instead of the model's chat template (base models)."""
    answer_prefix: str = "\nAnswer:\n"
    """What a ``completion`` template's generation prompt ends with; the model continues it.
    The newline is part of it: after a bare ``Answer:`` Gemma-3-270m opens with a newline,
    leaving an empty first line, the line the answer metrics read."""

    def __post_init__(self) -> None:
        if self.completion and self.system is not None:
            raise ValueError(f"template {self.name!r}: a completion template has no system turn")
        for field_name in ("document", "untitled_document"):
            fmt: str = getattr(self, field_name)
            if fmt.count("{text}") != 1:
                raise ValueError(f"template {self.name!r}: {field_name} needs exactly one {{text}}")
            # Render once to catch unknown placeholders at registration, not per request.
            try:
                fmt.replace("{text}", "").format(index=1, title="t")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"template {self.name!r}: bad {field_name}: {exc!r}") from None
        if "{title}" in self.untitled_document:
            raise ValueError(f"template {self.name!r}: untitled_document cannot use {{title}}")

    def render_document(self, slot: int, passage: Passage) -> tuple[str, int]:
        """The document block for ``passage`` in 0-based ``slot``, and its text's offset in it."""
        title = passage.title
        fmt = self.document if title else self.untitled_document
        head, tail = fmt.split("{text}")
        # Format head and tail separately: the passage text is inserted verbatim, never parsed.
        head_text = head.format(index=slot + 1, title=title or "")
        tail_text = tail.format(index=slot + 1, title=title or "")
        return head_text + passage.text + tail_text, len(head_text)


_QA_INSTRUCTION = (
    "Answer the question based on the documents below. Some documents may be irrelevant. "
    "Reply with a short answer only."
)


_REGISTRY: dict[str, PromptTemplate] = {}


def register_template(template: PromptTemplate, *, replace: bool = False) -> None:
    """Add a template to the registry under ``template.name``.

    Args:
        template: the template to register.
        replace: allow overwriting an existing template of the same name.

    Raises:
        ValueError: the name is taken and ``replace`` is false.
    """
    if template.name in _REGISTRY and not replace:
        raise ValueError(f"prompt template {template.name!r} is already registered")
    _REGISTRY[template.name] = template


def template_names() -> tuple[str, ...]:
    """Names of the registered templates, sorted."""
    return tuple(sorted(_REGISTRY))


def get_template(name: str) -> PromptTemplate:
    """The registered template called ``name``.

    Raises:
        InvalidRequest: no template has that name (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(template_names())
        raise InvalidRequest(
            f"unknown prompt template {name!r}; known templates: {known}", param="template"
        ) from None


register_template(
    PromptTemplate(
        name="qa_default",
        instruction=_QA_INSTRUCTION,
        document="Document [{index}] (Title: {title})\n{text}",
        untitled_document="Document [{index}]\n{text}",
    )
)
register_template(
    PromptTemplate(
        name="qa_plain",
        instruction=_QA_INSTRUCTION,
        document="Document [{index}]\n{text}",
        untitled_document="Document [{index}]\n{text}",
    )
)
register_template(
    PromptTemplate(
        name="qa_system",
        system=_QA_INSTRUCTION,
        instruction="Documents:",
        document="Document [{index}] (Title: {title})\n{text}",
        untitled_document="Document [{index}]\n{text}",
    )
)
# For base models (no chat template, e.g. Gemma-3-270m): the qa_default layout as plain text,
# answered on the line after "Answer:"; a base model then writes the answer and usually a
# newline, where the answer metrics stop reading.
register_template(
    PromptTemplate(
        name="qa_completion",
        instruction=_QA_INSTRUCTION,
        document="Document [{index}] (Title: {title})\n{text}",
        untitled_document="Document [{index}]\n{text}",
        completion=True,
    )
)
# The distracting-effect probe (Cuconasu et al. eq. 1, after Amiraz et al. 2025): answer from the
# documents or abstain with the literal NO-RESPONSE (service.strategies.distraction reads
# P(NO-RESPONSE)).
# 004 describes that instruction but does not print it; this wording is ours, in the style of
# 004's generation prompt (its Fig. 7: "Respond directly without providing any premise or
# explanation").
register_template(
    PromptTemplate(
        name="qa_abstain",
        instruction=(
            "Answer the question using only the documents below. If they do not contain the "
            "answer, reply NO-RESPONSE. Respond directly without any premise or explanation."
        ),
        document="Document [{index}] (Title: {title})\n{text}",
        untitled_document="Document [{index}]\n{text}",
    )
)
