"""The request's `context` (issue 93) between the routes and ``service.context``: merge
near-duplicates before scoring, build the context window from the result, and write the
response in the request's indices (docs/context.md).

The pipeline scores the merged list (``scored``); everything it returns is indexed by it. The
response refers to the passages as sent, so ``apply`` maps each index back, once, here.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.schemas.context import ContextIn, ContextOut, DroppedOut, MergedOut
from app.schemas.reorder import ReorderMeta
from service.backends.base import PromptTokenizer
from service.config.settings import Settings
from service.context.counting import budget_tokenizer
from service.context.dedup import DedupPlan, merge_duplicates
from service.context.window import ContextWindow, build_window
from service.passage import Passage
from service.pipeline import ReorderResult
from service.prompting.templates import get_template


class ContextPlan:
    """One request's context: its options, its merges, and (after scoring) its window."""

    def __init__(self, spec: ContextIn | None, passages: Sequence[Passage]) -> None:
        self.spec = spec
        self.options = spec.options() if spec is not None else None
        threshold = self.options.dedup_threshold if self.options is not None else None
        self.dedup: DedupPlan = merge_duplicates(passages, threshold)
        self.scored: list[Passage] = [passages[i] for i in self.dedup.kept]
        self.window: ContextWindow | None = None

    @property
    def active(self) -> bool:
        return self.options is not None

    def request_index(self, k: int) -> int:
        return self.dedup.kept[k]

    def build(
        self,
        result: ReorderResult,
        settings: Settings,
        scorer: PromptTokenizer,
        top_n: int | None,
        *,
        param_prefix: str = "context",
    ) -> None:
        """The window for ``result`` (over ``scored``), kept for ``apply``.

        Raises:
            ContextBudgetTooSmall: the budget is below the best passage's tokens (422).
            BackendUnavailable: the configured generator tokenizer cannot be loaded.
        """
        if self.options is None:
            return
        tokenizer, name, is_generator = budget_tokenizer(settings, scorer, result.model)
        self.window = build_window(
            order=result.order,
            ranking=result.ranking,
            fit=result.fit,
            passages=self.scored,
            options=self.options,
            tokenizer=tokenizer,
            tokenizer_name=name,
            tokenizer_is_generator=is_generator,
            template=get_template(result.template),
            top_n=top_n,
            budget_param=f"{param_prefix}.max_context_tokens",
        )

    def kept(self) -> list[int]:
        """The kept passages in prompt order, as request indices."""
        assert self.window is not None
        return [self.request_index(k) for k in self.window.order]

    def apply(self, meta: ReorderMeta) -> None:
        """Write the window into ``meta`` (built over ``scored``) in request indices."""
        if self.window is None:
            return
        m = self.request_index
        meta.ranking = [m(k) for k in meta.ranking]
        for p in meta.passages:
            p.index = m(p.index)
        for c in meta.truncated:
            c.index = m(c.index)
        meta.order = self.kept()
        w = self.window
        dropped = [
            DroppedOut(
                index=g.index,
                reason="duplicate",
                detail=f"near-duplicate of passage {g.into} (Jaccard {g.similarity:.3f}); "
                "scored and placed as it",
                into=g.into,
            )
            for g in self.dedup.merges
        ]
        dropped += [
            DroppedOut(
                index=m(d.index),
                reason=d.reason,
                detail=d.detail,
                tokens=d.tokens,
                probability=d.probability,
            )
            for d in w.dropped
        ]
        meta.context = ContextOut(
            order=list(meta.order),
            tokens_used=w.tokens_used,
            budget=w.budget,
            tokenizer=w.tokenizer,
            tokenizer_is_generator=w.tokenizer_is_generator,
            counted=w.counted,
            dropped=sorted(dropped, key=lambda d: d.index),
            merged=[
                MergedOut(index=g.index, into=g.into, similarity=g.similarity)
                for g in self.dedup.merges
            ],
            distractor_rule=w.distractor_rule,
        )
        meta.diagnostics.warnings.extend(w.warnings)
