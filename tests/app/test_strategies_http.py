"""Every strategy through the HTTP routes: same response shape, same limits, same metrics.

Once on the fake backend (fast, every field checked) and once on a tiny real model behind the
real SmolLM2 tokenizer (``slow``), where positional profiles are first measured by the same
calibration the ``calibrate-positions`` command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.strategies import strategy_names
from tests.app.conftest import PASSAGES, QUERY, TRUTH, TrackingBackend, serving

POSITIONAL = {"max_relevance", "min_distraction"}
ANSWERING = {"lore", "self_consistency"}
MODEL_FREE = {"retriever", "inverse", "shuffle", "litm", "max_relevance"}


def _options(name: str) -> dict[str, Any]:
    # Small K keeps the test fast; the defaults are exercised in the service tests.
    if name in ("query_likelihood", "self_consistency"):
        return {"samples": 3}
    return {}


def _check_shape(body: dict[str, Any], name: str, n: int) -> None:
    assert body["strategy"] == body["diagnostics"]["strategy"] == name
    assert sorted(body["order"]) == sorted(body["ranking"]) == list(range(n))
    assert [p["index"] for p in body["passages"]] == body["ranking"]
    usage = body["usage"]
    assert set(usage) == {
        "prompt_tokens",
        "scored_tokens",
        "prompts_scored",
        "generations",
        "generated_tokens",
    }
    if name in MODEL_FREE:
        assert usage["prompts_scored"] == usage["generations"] == usage["prompt_tokens"] == 0
    else:
        assert usage["prompts_scored"] + usage["generations"] > 0 and usage["prompt_tokens"] > 0
    if name in ANSWERING:
        assert body["answer"]["text"] and usage["generations"] > 0
        assert usage["generated_tokens"] > 0
    else:
        assert body["answer"] is None
    assert (body["position_bias"] is not None) == (name == "moi")
    assert (body["positional_profile"] is not None) == (name in POSITIONAL)
    if name == "min_distraction":
        assert all(0.0 <= p["distracting_effect"] <= 1.0 for p in body["passages"])


async def _calibrate_positions(harness: Any, texts: list[str] = PASSAGES) -> None:
    """Measure and store the positional profiles the two positional strategies need."""
    from service.dataset import Example
    from service.distraction import calibrate_positions
    from service.pipeline import Reorderer
    from service.prompts import Passage

    ctx = harness.ctx
    examples = [
        Example(
            id=f"q{k}",
            question=f"{QUERY} ({k})",
            answers=("answer",),
            passages=tuple(Passage(text=t) for t in [*texts, "An extra filler passage."]),
            gold=(1,),
        )
        for k in range(2)
    ]
    reorderer = Reorderer(ctx.engine.require(), ctx.settings, ctx.engine.profiles)
    await calibrate_positions(reorderer, examples, max_passages=len(texts))


async def test_every_strategy_answers_in_the_same_shape_on_both_routes(tmp_path: Path) -> None:
    backend = TrackingBackend(TRUTH)
    async with serving(tmp_path, backend=backend) as h:
        await _calibrate_positions(h)
        for name in strategy_names():
            body = {"query": QUERY, "passages": PASSAGES, "strategy": name, **_options(name)}
            r = await h.client.post("/v1/reorder", json=body)
            assert r.status_code == 200, (name, r.text)
            native = r.json()
            _check_shape(native, name, len(PASSAGES))
            rr = await h.client.post(
                "/v1/rerank",
                json={
                    "query": QUERY,
                    "documents": PASSAGES,
                    "reorder": {"strategy": name, **_options(name)},
                },
            )
            assert rr.status_code == 200, (name, rr.text)
            rerank = rr.json()
            # Results follow the strategy's ranking, scores descending in [0, 1].
            assert [x["index"] for x in rerank["results"]] == native["ranking"]
            scores = [x["relevance_score"] for x in rerank["results"]]
            assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
            assert rerank["meta"]["reorder"]["strategy"] == name
            assert h.metric("rag_reorder_strategy_requests_total", {"strategy": name}) == 2
        # The retriever order is the input order here: it never counts as changed.
        assert h.metric("rag_reorder_order_changed_total", {"strategy": "retriever"}) == 0
        assert h.metric("rag_reorder_order_changed_total", {"strategy": "moi"}) == 2
        assert h.metric("rag_reorder_generated_tokens_total") > 0


async def test_an_option_for_another_strategy_is_a_422_naming_it(tmp_path: Path) -> None:
    async with serving(tmp_path) as h:
        warmup = h.backend.started
        r = await h.client.post(
            "/v1/reorder",
            json={"query": QUERY, "passages": PASSAGES, "strategy": "retriever", "samples": 4},
        )
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["param"] == "samples" and "query_likelihood" in err["message"]
        r = await h.client.post(
            "/v1/reorder",
            json={
                "query": QUERY,
                "passages": PASSAGES,
                "strategy": "lore",
                "placement": "bias_matched",
            },
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "placement"
        assert h.backend.started == warmup  # refused before any model call


async def test_the_prompt_limit_applies_to_every_strategy(tmp_path: Path) -> None:
    async with serving(tmp_path, max_prompts_per_request=10) as h:
        warmup = h.backend.started
        for name, extra in (("convex_score", {}), ("self_consistency", {"samples": 11})):
            r = await h.client.post(
                "/v1/reorder",
                json={"query": QUERY, "passages": PASSAGES, "strategy": name, **extra},
            )
            assert r.status_code == 422, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == "limit_exceeded" and err["limit"] == 10
        assert h.backend.started == warmup  # refused before any model call


@pytest.mark.slow
async def test_every_strategy_runs_on_a_tiny_real_model(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    passages = [
        {"title": "Tolkien", "text": "J. R. R. Tolkien wrote The Lord of the Rings.", "score": 3.0},
        {"title": "Narnia", "text": "C. S. Lewis wrote The Chronicles of Narnia.", "score": 2.0},
        {"text": "The Hobbit was published in 1937.", "score": 1.0},
    ]
    from service.backends.transformers_backend import TransformersBackend
    from service.settings import Settings

    real = TransformersBackend.from_settings(
        Settings(model=str(tiny_model_dir), backend="transformers", device="cpu")
    )
    async with serving(tmp_path, backend=real) as h:  # type: ignore[arg-type]
        await _calibrate_positions(h, [p["text"] for p in passages])
        for name in strategy_names():
            body = {
                "query": "who wrote the lord of the rings",
                "passages": passages,
                "strategy": name,
                **_options(name),
            }
            if name in ANSWERING:
                body["max_answer_tokens"] = 4
            r = await h.client.post("/v1/reorder", json=body)
            assert r.status_code == 200, (name, r.text)
            _check_shape(r.json(), name, len(passages))
