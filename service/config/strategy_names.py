"""The strategies' names, apart from their implementations: the settings name a default
strategy, and ``service.strategies`` imports the settings."""

from __future__ import annotations

from typing import Literal

StrategyName = Literal[
    "moi",
    "auto",
    "query_likelihood",
    "convex_score",
    "lore",
    "min_distraction",
    "max_relevance",
    "retriever",
    "inverse",
    "shuffle",
    "litm",
    "bayes_saliency",
    "query_generation",
    "longllmlingua",
    "self_consistency",
    "bm25",
    "dense",
]
