"""Near-duplicate passages merged before scoring: each is scored once, placed once, reported.

Retrievers over overlapping chunks, or over several copies of one page, hand over passages that
say the same thing; each costs MoI prompts and the generator context slots. Two passages are
near-duplicates when the Jaccard similarity of their word 5-shingle sets (lower-cased, runs of
letters and digits) is at least the threshold (default 0.8: the same text with different
whitespace, punctuation or a changed sentence; two chunks that overlap by half score about 0.33
and are kept apart, since each carries text the other lacks). A passage merges into the first
earlier passage it matches (the retriever's better-ranked copy), never into one that itself
merged, so every merge is into a kept passage. Pairs whose set sizes alone rule out the
threshold are never compared (prefix filtering, ``merge_duplicates``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from service.passage import Passage

SHINGLE_WORDS = 5
DEFAULT_THRESHOLD = 0.8

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def shingles(text: str, k: int = SHINGLE_WORDS) -> frozenset[tuple[str, ...]]:
    """The word ``k``-shingles of ``text`` (a text of fewer words is one shingle)."""
    words = _WORD.findall(text.lower())
    if len(words) < k:
        return frozenset({tuple(words)})
    return frozenset(tuple(words[i : i + k]) for i in range(len(words) - k + 1))


def jaccard(a: frozenset[tuple[str, ...]], b: frozenset[tuple[str, ...]]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


@dataclass(frozen=True, slots=True)
class Merge:
    index: int
    """The duplicate's index in the request."""
    into: int
    """The kept passage it merged into (request index)."""
    similarity: float


@dataclass(frozen=True, slots=True)
class DedupPlan:
    kept: tuple[int, ...]
    """Request indices of the passages that are scored, in request order; scored index ``k``
    is request index ``kept[k]``."""
    merges: tuple[Merge, ...]


def merge_duplicates(passages: Sequence[Passage], threshold: float | None) -> DedupPlan:
    """The passages to score and the merges (``threshold`` None: none merged).

    Exact, with prefix filtering (Bayardo et al., "Scaling up all pairs similarity search"):
    with every set's shingles in one global order, two sets with Jaccard >= t share an
    element among the first ``|S| - ceil(t |S|) + 1`` of each, so only passages that share a
    prefix shingle are compared. Near-disjoint passages (the usual case) cost one lookup
    each, not a comparison with every earlier one: 4096 passages stay well under a second.
    """
    n = len(passages)
    if threshold is None or n < 2:
        return DedupPlan(tuple(range(n)), ())
    sets = [shingles(p.text) for p in passages]
    # One global order: rare shingles first makes the prefixes (and candidate lists) short.
    freq: dict[tuple[str, ...], int] = {}
    for st in sets:
        for g in st:
            freq[g] = freq.get(g, 0) + 1
    index: dict[tuple[str, ...], list[int]] = {}
    kept: list[int] = []
    merges: list[Merge] = []
    for j in range(n):
        sj = sets[j]
        ordered = sorted(sj, key=lambda g: (freq[g], g))
        prefix = ordered[: len(ordered) - math.ceil(threshold * len(ordered) - 1e-9) + 1]
        candidates = sorted({i for g in prefix for i in index.get(g, ())})
        match: Merge | None = None
        for i in candidates:
            si = sets[i]
            small, large = sorted((len(si), len(sj)))
            if large and small / large < threshold:
                continue
            sim = jaccard(si, sj)
            if sim >= threshold:
                match = Merge(j, i, sim)
                break
        if match is None:
            kept.append(j)
            for g in prefix:
                index.setdefault(g, []).append(j)
        else:
            merges.append(match)
    return DedupPlan(tuple(kept), tuple(merges))
