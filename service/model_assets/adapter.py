"""A distilled scorer's folder: a LoRA adapter (peft's files) and its manifest.

``rag-reorder distill`` writes it (``offline.distill``); ``RAG_REORDER_ADAPTER`` names
it, and both backends serve the base model with the adapter applied. The manifest says what the
adapter was distilled from and how well it agreed with its teacher on held-back questions; the
service checks it against its settings before loading any weight (an adapter trained on another
base model or prompt template would score prompts it never learned).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from service.config.settings import Settings
from service.errors import BackendUnavailable

MANIFEST = "distill.json"
"""The manifest's file name inside the adapter folder, beside peft's ``adapter_config.json``."""


@dataclass(frozen=True)
class Agreement:
    """How the student's preferences match the teacher's on held-back questions."""

    questions: int
    kendall_tau: float
    """Mean over questions of Kendall's tau between the two models' permutation scores."""
    top1: float
    """Share of questions where both models prefer the same permutation."""
    kl: float
    """Mean KL(teacher || student) of the softmax over the question's permutations (nats)."""


@dataclass(frozen=True)
class AdapterManifest:
    name: str
    """Reported in the model id (``<base>+<name>``)."""
    base_model: str
    """The student: the model the adapter applies to (``RAG_REORDER_MODEL`` must name it)."""
    template: str
    """The student's scoring template the adapter was trained with."""
    teacher: str
    teacher_template: str
    data: str
    passages: int
    """N: passages per training question."""
    permutations: int
    """K: teacher-scored permutations per question."""
    permutations_per_step: int
    """K': permutations sampled per question per step."""
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: tuple[str, ...]
    learning_rate: float
    weight_decay: float
    epochs: int
    batch_questions: int
    """Questions per optimiser step (gradient accumulation)."""
    train_questions: int
    steps: int
    train_seconds: float
    train_prompt_tokens: int
    """Student prompt tokens forwarded (and back-propagated) in training."""
    device: str
    before: Agreement
    """Held-back agreement of the raw student."""
    after: Agreement
    """Held-back agreement of the distilled student."""
    created_at: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> AdapterManifest:
        fields = dict(raw)
        for key in ("before", "after"):
            value = fields[key]
            if not isinstance(value, dict):
                raise TypeError(f"{key} must be an object")
            fields[key] = Agreement(**value)
        targets = fields["target_modules"]
        if not isinstance(targets, list | tuple):
            raise TypeError("target_modules must be a list")
        fields["target_modules"] = tuple(str(t) for t in targets)
        return cls(**fields)  # type: ignore[arg-type]


def write_manifest(folder: Path, manifest: AdapterManifest) -> Path:
    """Write ``folder/distill.json``; returns its path."""
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    return path


CARD = "README.md"
"""The adapter folder's model card, written from the manifest in place of peft's template."""


def model_card(m: AdapterManifest) -> str:
    """A model card that says what the adapter is, how to serve it and how well it agreed with
    its teacher: the folder is what gets shared (a hub, a release asset), and peft's own card
    is an empty template."""
    a, b = m.before, m.after
    return f"""---
base_model: {m.base_model}
library_name: peft
tags:
- lora
- rag-reorder
- preference-distillation
---

# {m.name}: {m.base_model} distilled from {m.teacher}

A LoRA adapter for rag-reorder's scorer (the MoI paper's preference
distillation): on `{m.data}`, {m.base_model} (template `{m.template}`) was trained so that
the softmax of its query log-likelihoods over {m.permutations_per_step} sampled orders of
{m.passages} passages matches that of the teacher, {m.teacher} (template
`{m.teacher_template}`), over {m.permutations} scored orders per question.

Serve it with `RAG_REORDER_MODEL={m.base_model} RAG_REORDER_ADAPTER=<this folder>`; the
service checks `distill.json` (the manifest) against its settings before loading.

| held-back questions: {a.questions} | Kendall tau | same preferred order | KL(teacher ‖ student) |
|---|---:|---:|---:|
| before | {a.kendall_tau:.3f} | {a.top1:.2f} | {a.kl:.3f} |
| after | {b.kendall_tau:.3f} | {b.top1:.2f} | {b.kl:.3f} |

Training: {m.train_questions} questions, {m.epochs} epochs, {m.steps} steps of
{m.batch_questions} questions, lr {m.learning_rate:g}, weight decay {m.weight_decay:g}, LoRA
r {m.lora_r} / alpha {m.lora_alpha} / dropout {m.lora_dropout:g} on
{", ".join(m.target_modules) or "peft's defaults"}; {m.train_prompt_tokens:,} prompt tokens
in {m.train_seconds:g} s on {m.device}, {m.created_at}.
"""


def read_manifest(folder: Path) -> AdapterManifest:
    """The manifest of an adapter folder.

    Raises:
        BackendUnavailable: no readable manifest (the message names the folder's last part
            only: paths stay out of client-facing errors).
    """
    try:
        raw = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        return AdapterManifest.from_json(raw)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise BackendUnavailable(
            f"adapter {folder.name!r}: no readable {MANIFEST} ({type(exc).__name__})"
        ) from exc


def configured_adapter(settings: Settings) -> AdapterManifest | None:
    """The manifest of ``settings.adapter``, checked against the settings; ``None`` if unset.

    Raises:
        BackendUnavailable: unreadable, or distilled for another base model or template.
    """
    if settings.adapter is None:
        return None
    manifest = read_manifest(settings.adapter)
    if manifest.base_model != settings.model:
        raise BackendUnavailable(
            f"adapter {manifest.name!r} was distilled onto {manifest.base_model!r}, "
            f"not the configured model {settings.model!r}"
        )
    if manifest.template != settings.chat_template:
        raise BackendUnavailable(
            f"adapter {manifest.name!r} was trained with template {manifest.template!r}, "
            f"not the configured {settings.chat_template!r}"
        )
    return manifest


def adapted_model_id(model: str, manifest: AdapterManifest | None) -> str:
    """The id a backend reports: the base model, plus ``+<adapter>`` when one is applied (so
    bias profiles and cached results of the raw and the distilled model never mix)."""
    return model if manifest is None else f"{model}+{manifest.name}"
