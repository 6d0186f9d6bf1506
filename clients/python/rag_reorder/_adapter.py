"""What the framework adapters share: the metadata each reordered document carries."""

from __future__ import annotations

from typing import Final

from rag_reorder.types import Reordering

METADATA_PREFIX: Final = "rag_reorder_"
"""Every key the adapters add starts with it, so none clobbers a retriever's own metadata."""
METADATA_KEYS: Final = tuple(
    METADATA_PREFIX + k
    for k in (
        "slot",
        "rank",
        "utility",
        "stderr",
        "confidence_above_next",
        "score",
        "position_bias",
        "placement",
        "strategy",
        "request_id",
    )
)

MetadataValue = int | float | str | list[float] | None


def placed(result: Reordering) -> list[tuple[int, dict[str, MetadataValue]]]:
    """``(input index, metadata)`` for each passage of ``result.order``, in prompt order.

    ``slot`` is the position in the prompt (0 first), ``rank`` the position in the ranking
    (0 best); ``position_bias`` is the fitted weight of each slot of the scoring prompts
    (fewer slots than passages with a pruned design), the same list on every document.
    """
    bias = list(result.position_bias.coefficients) if result.position_bias else None
    scored = {p.index: p for p in result.passages}
    rank = {index: k for k, index in enumerate(result.ranking)}
    out: list[tuple[int, dict[str, MetadataValue]]] = []
    for slot, index in enumerate(result.order):
        p = scored[index]
        meta: dict[str, MetadataValue] = {
            "slot": slot,
            "rank": rank[index],
            "utility": p.utility,
            "stderr": p.stderr,
            "confidence_above_next": p.confidence_above_next,
            "score": p.score,
            "position_bias": list(bias) if bias is not None else None,
            "placement": result.placement,
            "strategy": result.strategy,
            "request_id": result.id,
        }
        out.append((index, {METADATA_PREFIX + k: v for k, v in meta.items()}))
    return out
