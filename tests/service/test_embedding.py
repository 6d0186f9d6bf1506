"""The ``dense`` encoder batched across requests (``service.backends.encoders.embedding``), on
the real all-MiniLM-L6-v2: the same rankings as the one-request encoder on committed dev questions,
concurrent callers sharing forwards, the token budget, and the bounded cache."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from service.backends.encoders.embedding import EncoderConfig, MiniLMEncoder, model_dir
from service.passage import Passage
from service.strategies.retrieval import passage_text

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "dense_sample.jsonl"
TOLERANCE = 1e-5
"""Largest cosine difference allowed from the one-request encoder: padding to a forward's
longest text changes float32 sums in the last bits (measured below 1e-6 on the sample)."""


@pytest.fixture(scope="module")
def batching() -> Iterator[MiniLMEncoder]:
    # A wait, so the callers of a test meet in forwards however the threads are scheduled;
    # no cache, so every text is computed.
    yield MiniLMEncoder(model_dir(), EncoderConfig(device="cpu", wait_ms=200, cache_entries=0))


def cosine(enc: MiniLMEncoder, query: str, docs: list[str]) -> np.ndarray:
    emb = enc.encode([query, *docs])
    return np.asarray(emb[1:] @ emb[0])


def test_batched_rankings_match_the_one_request_encoder(batching: MiniLMEncoder) -> None:
    """tests/data/dense_sample.jsonl: 24 NQ-Open dev questions, 10 passages each, with the
    cosine scores of the encoder as it was before batching (scripts/dense_reference.py at
    60708b4), encoded here 8 requests at a time through shared forwards."""
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert len(rows) == 24
    before = batching.stats()["forwards"]

    def one(row: dict[str, object]) -> np.ndarray:
        docs = [passage_text(Passage(**p)) for p in row["passages"]]  # type: ignore[arg-type, attr-defined]
        return cosine(batching, str(row["question"]), docs)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, rows))
    assert batching.stats()["forwards"] - before < len(rows)  # requests shared forwards
    for row, scores in zip(rows, got, strict=True):
        ref = np.asarray(row["cosine"])
        assert np.max(np.abs(scores - ref)) < TOLERANCE
        # The ranking itself: identical wherever the reference's own gap exceeds the tolerance.
        assert np.array_equal(np.argsort(-scores, kind="stable"), np.argsort(-ref, kind="stable"))


def test_concurrent_requests_share_a_forward(batching: MiniLMEncoder) -> None:
    texts = [[f"request {r}, passage {k}: the river {k} runs by town {r}." for k in range(5)]
             for r in range(6)]  # fmt: skip
    alone = [batching.encode(t) for t in texts]  # one at a time: one forward each
    start = batching.stats()
    barrier = threading.Barrier(len(texts))

    def call(t: list[str]) -> np.ndarray:
        barrier.wait()
        return batching.encode(t)

    with ThreadPoolExecutor(len(texts)) as pool:
        together = list(pool.map(call, texts))
    end = batching.stats()
    assert end["forwards"] - start["forwards"] < len(texts)
    assert end["max_requests_per_forward"] >= 2
    assert end["rows"] - start["rows"] == sum(len(t) for t in texts)
    for a, b in zip(alone, together, strict=True):
        assert a.shape == (5, 384) and np.max(np.abs(a - b)) < TOLERANCE
        assert np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)


def test_the_token_budget_splits_a_request_across_forwards() -> None:
    enc = MiniLMEncoder(model_dir(), EncoderConfig(device="cpu", batch_tokens=256,
                                                   cache_entries=2))  # fmt: skip
    long = [" ".join(["word"] * 150) + f" {k}" for k in range(3)]  # ~150 tokens each
    rows = enc.encode(long)
    s = enc.stats()
    assert s["forwards"] == 3 and s["rows"] == 3  # one 150-token text per 256-token forward
    assert s["padded_tokens"] <= 3 * 256
    # The cache: the last two texts are kept (bounded at 2), the first is computed again.
    again = enc.encode(long)
    s = enc.stats()
    assert s["cache_hits"] == 2 and s["cache_entries"] == 2 and s["forwards"] == 4
    assert np.array_equal(rows, again)
    # A repeated text within one request is computed once.
    enc.encode(["same text", "same text"])
    assert enc.stats()["rows"] == 5
