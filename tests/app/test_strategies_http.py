"""Every strategy through the HTTP routes: same response shape, same limits, same metrics.

Once on the fake backend (fast, every field checked) and once on a tiny real model behind the
real SmolLM2 tokenizer (``slow``), through ``/v1/reorder`` and ``/v1/rerank``, after the
positional profiles were measured by the ``rag-reorder calibrate-positions`` command itself;
each response is checked against its strategy's rule, recomputed here. The random tiny model's
positional profiles are flat, so the two positional strategies run once more on SmolLM2, whose
measured profiles tell slots apart.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np
import pytest

from service.state.profile_store import ProfileStore, StoredProfile
from service.strategies import strategy_names
from tests.app.conftest import (
    PASSAGES,
    QUERY,
    TRUTH,
    Harness,
    TrackingBackend,
    serving,
    wait_until,
)
from tests.support.positional import Topic, calibrate_positions, write_qa_file

STRATEGIES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "strategies.md"

POSITIONAL = {"max_relevance", "min_distraction"}
ANSWERING = {"lore", "self_consistency"}
MODEL_FREE = {"retriever", "inverse", "shuffle", "litm", "max_relevance", "bm25", "dense"}


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
    # auto runs MoI until it trusts a profile (a fresh server here), and says so.
    assert (body["auto"] is not None) == (name == "auto")
    ran_moi = name == "moi" or (name == "auto" and body["auto"]["path"] in ("moi", "explore"))
    assert (body["position_bias"] is not None) == ran_moi
    assert (body["positional_profile"] is not None) == (name in POSITIONAL)
    if name == "min_distraction":
        assert all(0.0 <= p["distracting_effect"] <= 1.0 for p in body["passages"])


async def _calibrate_positions(harness: Any, texts: list[str] = PASSAGES) -> None:
    """Measure and store the positional profiles the two positional strategies need."""
    from offline.positions import calibrate_positions
    from service.batch.dataset import Example
    from service.passage import Passage
    from service.pipeline import Reorderer

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
                "strategy": "shuffle",
                "placement": "bias_matched",
            },
        )
        assert r.status_code == 422 and r.json()["error"]["param"] == "placement"
        assert "query_generation" in r.json()["error"]["message"]  # names the rankers
        # An option's value the strategy cannot use, on both routes.
        bad = {"strategy": "lore", "rankings": [[0, 9]]}
        r = await h.client.post("/v1/reorder", json={"query": QUERY, "passages": PASSAGES, **bad})
        assert r.status_code == 422 and r.json()["error"]["param"] == "rankings[0]"
        rr = await h.client.post(
            "/v1/rerank", json={"query": QUERY, "documents": PASSAGES, "reorder": bad}
        )
        assert rr.status_code == 422 and rr.json()["error"]["param"] == "reorder.rankings[0]"
        assert h.backend.started == warmup  # refused before any model call
        assert h.backend.stats.generate_calls == 0


async def test_the_prompt_limit_applies_to_every_strategy(tmp_path: Path) -> None:
    async with serving(tmp_path, max_prompts_per_request=10) as h:
        warmup = h.backend.started
        # N^2 = 16 > 10; K = 11 > 10; the default K = 30 > 10, whatever N: the param names
        # the knob that sets the count.
        for name, extra, param, value in (
            ("convex_score", {}, "passages", 16),
            ("self_consistency", {"samples": 11}, "samples", 11),
            ("self_consistency", {}, "samples", 30),
        ):
            r = await h.client.post(
                "/v1/reorder",
                json={"query": QUERY, "passages": PASSAGES, "strategy": name, **extra},
            )
            assert r.status_code == 422, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == "limit_exceeded" and err["limit"] == 10
            assert (err["param"], err["value"]) == (param, value)
        assert h.backend.started == warmup  # refused before any model call
        assert h.backend.stats.generate_calls == 0


async def test_the_prompt_token_limit_applies_to_generated_answers(tmp_path: Path) -> None:
    # 3 generation prompts of one passage each are under 700 byte tokens; 30 prompts of all
    # 4 passages are far more. The limit covers generating prompts as it covers scored ones.
    async with serving(tmp_path, max_prompt_tokens_x_prompts=1000) as h:
        ok = await h.client.post(
            "/v1/reorder",
            json={"query": QUERY, "passages": PASSAGES[:3], "strategy": "lore"},
        )
        assert ok.status_code == 200, ok.text
        assert 0 < ok.json()["usage"]["prompt_tokens"] <= 1000
        calls = h.backend.stats.generate_calls
        r = await h.client.post(
            "/v1/reorder",
            json={"query": QUERY, "passages": PASSAGES, "strategy": "self_consistency"},
        )
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_tokens_x_prompts" and err["limit"] == 1000
        assert err["value"] > 1000
        assert h.backend.stats.generate_calls == calls  # refused before generating


async def test_the_documented_strategy_examples_are_accepted(served: Harness) -> None:
    section = STRATEGIES_PAGE.read_text(encoding="utf-8")
    examples = re.findall(
        r"curl -s localhost:8000(\S+) -H 'content-type: application/json' (?:\\\n\s*)?-d '(.*?)'",
        section,
        re.S,
    )
    assert examples, "no curl example in docs/strategies.md"
    for path, body in examples:
        assert json.loads(body).get("strategy", "moi") != "moi"
        r = await served.client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200, (path, r.text)
    # Every strategy has a row in the table, and every row is a strategy.
    rows = re.findall(r"^\| `(\w+)`", section, re.M)
    assert sorted(rows) == sorted(["strategy", *strategy_names()])  # the header, then one each


# Questions SmolLM2 answers right in some gold slots only (measured: slots 1 and 3 for the
# first, 2 and 3 for the second), so its accuracy profile is not flat: [0.5, 0.5, 1.0].
POSITION_DEPENDENT_TOPICS: list[Topic] = [
    ("How many moons does the planet Quell have?", "seven", "The planet Quell has seven moons."),
    ("What is the name of Tom's dog?", "Biscuit", "Tom has a dog named Biscuit."),
]


def _slots(values: list[float], *, best: str) -> list[int]:
    """Slots best first (ties: the earlier slot), written out here rather than imported."""
    sign = -1.0 if best == "high" else 1.0
    return sorted(range(len(values)), key=lambda j: (sign * values[j], j))


def _check_rules(body: dict[str, Any], name: str, query: str, profiles: dict[str, Any]) -> None:
    """Each strategy's documented rule, recomputed from the response (3 passages whose
    retriever order is the input order: scores 3, 2, 1)."""
    order, ranking = body["order"], body["ranking"]
    by_index = {p["index"]: p for p in body["passages"]}
    details = body["diagnostics"]["details"]
    usage, planned = body["usage"], body["diagnostics"]["prompts"]
    if name == "retriever":
        assert order == ranking == [0, 1, 2]
    elif name == "inverse":
        assert order == [2, 1, 0] and ranking == [0, 1, 2]
    elif name == "litm":
        assert order == [0, 2, 1]  # best first, second best last
    elif name == "shuffle":
        # Settings.seed 0 mixed with the query's CRC-32.
        expected = np.random.default_rng([0, zlib.crc32(query.encode())]).permutation(3)
        assert order == ranking == expected.tolist()
    elif name in ("moi", "auto"):
        # auto: three passages are too few to learn a profile from, so it runs MoI.
        assert name == "moi" or body["auto"]["path"] == "moi"
        assert math.isclose(sum(body["position_bias"]["coefficients"]), 1.0, abs_tol=1e-9)
        assert planned == usage["prompts_scored"] == 6  # pruned_random: 2N prompts
    elif name == "query_likelihood":
        assert order == ranking and planned == usage["prompts_scored"] == 3
        assert details["loglik_min"] <= details["loglik_mean"] <= details["loglik_chosen"] < 0
    elif name == "convex_score":
        top = ranking[0]
        assert order == [top, *(i for i in (0, 1, 2) if i != top)]  # the tail keeps retriever order
        assert planned == 9 and details["top"] == top
        scores = [by_index[i]["score"] for i in ranking]
        assert scores == sorted(scores, reverse=True)
    elif name in ("query_generation", "bayes_saliency", "longllmlingua"):
        assert order == ranking and planned == usage["prompts_scored"] == 3
        scores = [by_index[i]["score"] for i in ranking]
        assert all(s is not None for s in scores) and scores == sorted(scores, reverse=True)
    elif name == "lore":
        assert details["context_rank"] == [1, 2, 3]  # one input ranking: the retriever's
        for i, p in by_index.items():
            lor = 0.8 * details["mean_probability"][i] + 0.2 / (i + 1)
            assert p["score"] == pytest.approx(lor, abs=1e-12) and p["answer"] is not None
        assert order == ranking and body["answer"]["passage"] == ranking[0]
        assert body["answer"]["text"] == by_index[ranking[0]]["answer"]
        assert usage["generations"] == 3 and 0 < usage["generated_tokens"] <= 3 * 4
    elif name == "self_consistency":
        answer = body["answer"]
        assert answer["samples"] == 3 and 1 <= answer["votes"] <= 3 and planned == 3
        assert order == ranking and 1 <= usage["generations"] <= 3
        assert 0 < usage["generated_tokens"] <= 3 * 4
    elif name == "max_relevance":
        accuracy = profiles["accuracy"]["values"]
        assert body["positional_profile"]["values"] == accuracy
        expected = [-1] * 3
        for passage, slot in zip(ranking, _slots(accuracy, best="high"), strict=True):
            expected[slot] = passage
        assert order == expected and planned == 0
    elif name == "min_distraction":
        de_profile = profiles["distracting_effect"]["values"]
        assert body["positional_profile"]["values"] == de_profile
        de = [by_index[i]["distracting_effect"] for i in range(3)]
        most_distracting = sorted(range(3), key=lambda i: (-de[i], i))
        expected = [-1] * 3
        for passage, slot in zip(most_distracting, _slots(de_profile, best="low"), strict=True):
            expected[slot] = passage
        assert order == expected and ranking == [0, 1, 2]
        assert planned == usage["prompts_scored"] == 3 and usage["scored_tokens"] > 0
    elif name in ("bm25", "dense"):
        # Model-free scorers: no model call; scores descend along the ranking.
        assert order == ranking and planned == usage["prompts_scored"] == 0
        scores = [by_index[i]["score"] for i in ranking]
        assert all(s is not None for s in scores) and scores == sorted(scores, reverse=True)
    else:
        raise AssertionError(f"no rule checked for strategy {name!r}")


@pytest.mark.slow
async def test_every_strategy_runs_on_a_tiny_real_model(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from service.backends.engines.transformers_backend import TransformersBackend
    from service.config.settings import Settings

    # The positional profiles come from the command an operator runs, into the cache the
    # server reads (settings_for gives the server cache_dir = tmp_path).
    monkeypatch.setenv("RAG_REORDER_CACHE_DIR", str(tmp_path))
    data = write_qa_file(tmp_path / "qa.jsonl")
    profiles, _ = await calibrate_positions(tiny_model_dir, data, capsys)
    assert profiles["slots"] == 3 and profiles["questions"] == 2

    query = "who wrote the lord of the rings"
    passages = [
        {"title": "Tolkien", "text": "J. R. R. Tolkien wrote The Lord of the Rings.", "score": 3.0},
        {"title": "Narnia", "text": "C. S. Lewis wrote The Chronicles of Narnia.", "score": 2.0},
        {"text": "The Hobbit was published in 1937.", "score": 1.0},
    ]
    settings = Settings(
        model=str(tiny_model_dir), backend="transformers", device="cpu", cache_dir=tmp_path
    )
    real = await anyio.to_thread.run_sync(lambda: TransformersBackend.from_settings(settings))
    async with serving(tmp_path, backend=real) as h:  # type: ignore[arg-type]
        for name in strategy_names():
            options = _options(name)
            if name in ANSWERING:
                options["max_answer_tokens"] = 4
            r = await h.client.post(
                "/v1/reorder",
                json={"query": query, "passages": passages, "strategy": name, **options},
            )
            assert r.status_code == 200, (name, r.text)
            native = r.json()
            assert native["model"] == str(tiny_model_dir)
            _check_shape(native, name, len(passages))
            _check_rules(native, name, query, profiles)

            rr = await h.client.post(
                "/v1/rerank",
                json={
                    "query": query,
                    "documents": [p["text"] for p in passages],
                    "reorder": {"strategy": name, **options},
                },
            )
            assert rr.status_code == 200, (name, rr.text)
            rerank = rr.json()
            meta = rerank["meta"]["reorder"]
            _check_shape(meta, name, len(passages))
            _check_rules(meta, name, query, profiles)
            assert [x["index"] for x in rerank["results"]] == meta["ranking"]
            scores = [x["relevance_score"] for x in rerank["results"]]
            assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
            assert rerank["usage"]["total_tokens"] == meta["usage"]["prompt_tokens"]
            assert h.metric("rag_reorder_strategy_requests_total", {"strategy": name}) == 2


@pytest.mark.slow
async def test_positional_strategies_follow_profiles_measured_on_smollm2(
    tmp_path: Path,
    smollm2_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The tiny random model never answers right and never abstains, so its profiles are flat
    (accuracy 0, DE 1.0 in every slot) and any slot rule gives the retriever order. SmolLM2's
    measured values differ across slots and passages, so here a wrong slot rule changes the
    placement."""
    from service.backends.engines.transformers_backend import TransformersBackend
    from service.config.settings import Settings

    monkeypatch.setenv("RAG_REORDER_BIAS_PROFILE_DIR", str(tmp_path / "profiles"))
    data = write_qa_file(tmp_path / "qa.jsonl", POSITION_DEPENDENT_TOPICS)
    profiles, _ = await calibrate_positions(smollm2_dir, data, capsys, "--limit", "2")
    # Profiles that tell slots apart: a wrong slot direction would change the placement.
    assert len(set(profiles["accuracy"]["values"])) > 1, profiles["accuracy"]
    assert len(set(profiles["distracting_effect"]["values"])) == 3, profiles

    query = "who wrote the lord of the rings"
    passages = [
        {"title": "Tolkien", "text": "J. R. R. Tolkien wrote The Lord of the Rings.", "score": 3.0},
        {"title": "Narnia", "text": "C. S. Lewis wrote The Chronicles of Narnia.", "score": 2.0},
        {"text": "The Hobbit was published in 1937.", "score": 1.0},
    ]
    settings = Settings(
        model=str(smollm2_dir),
        backend="transformers",
        device="cpu",
        cache_dir=tmp_path,
        bias_profile_dir=tmp_path / "profiles",
    )
    real = await anyio.to_thread.run_sync(lambda: TransformersBackend.from_settings(settings))
    async with serving(tmp_path, backend=real, bias_profile_dir=tmp_path / "profiles") as h:  # type: ignore[arg-type]
        for name in sorted(POSITIONAL):
            r = await h.client.post(
                "/v1/reorder", json={"query": query, "passages": passages, "strategy": name}
            )
            assert r.status_code == 200, (name, r.text)
            body = r.json()
            _check_shape(body, name, len(passages))
            _check_rules(body, name, query, profiles)
            if name == "min_distraction":
                de = [p["distracting_effect"] for p in body["passages"]]
                assert len(set(de)) == 3, de


def _recency_profile(folder: Path, template: str) -> StoredProfile:
    """A generator's 4-slot profile that rises towards the question, stored in ``folder``."""
    return ProfileStore(folder).put(
        model="big/generator",
        template=template,
        coefficients=[0.1, 0.2, 0.3, 0.4],
        identification="full",
        runs=1,
        prompts=4,
        r2=1.0,
        source="test",
    )


async def test_placement_for_every_ranker_over_http(tmp_path: Path) -> None:
    """`bm25` placed three ways on both routes, by hand: query "real answer" matches passage 1
    on both terms and passage 2 on "answer"; 0 and 3 tie at 0 (input order): ranking
    [1, 2, 0, 3]."""
    async with serving(tmp_path) as h:
        info = (await h.client.get("/info")).json()
        assert {"bm25", "dense", "query_generation", "moi"} <= set(info["ranking_strategies"])
        assert "shuffle" not in info["ranking_strategies"] and "litm" in info["placements"]
        assert info["placement_profile"] is None
        body = {"query": "real answer", "passages": PASSAGES, "strategy": "bm25"}
        r = (await h.client.post("/v1/reorder", json=body)).json()
        assert r["ranking"] == r["order"] == [1, 2, 0, 3]
        r = (await h.client.post("/v1/reorder", json={**body, "placement": "litm"})).json()
        assert r["order"] == [1, 0, 3, 2] and r["diagnostics"]["placement"] == "litm"
        # The generator's profile (a recency bias) stored beside the scorer's: reversed.
        prof = _recency_profile(h.ctx.settings.profiles_path, h.ctx.settings.chat_template)
        # Stored as by another replica: requests see it once the folder is read again
        # (state_refresh_s), not by a file read per request.
        await wait_until(lambda: h.ctx.engine.profiles.by_id(prof.id) is not None)
        placed = {**body, "placement": "bias_matched", "bias_profile": prof.id}
        r = (await h.client.post("/v1/reorder", json=placed)).json()
        assert r["order"] == [3, 0, 2, 1]
        assert r["diagnostics"]["details"]["placement_profile"] == prof.id
        rerank = {
            "query": "real answer",
            "documents": PASSAGES,
            "reorder": {
                "strategy": "bm25",
                "placement": "bias_matched",
                "bias_profile": prof.id,
                "results_order": "placement",
            },
        }
        r = (await h.client.post("/v1/rerank", json=rerank)).json()
        assert [x["index"] for x in r["results"]] == [3, 0, 2, 1]
        # Errors: the parameter, the known values.
        bad = await h.client.post("/v1/reorder", json={**placed, "bias_profile": "nope"})
        err = bad.json()["error"]
        assert bad.status_code == 422 and err["param"] == "bias_profile"
        assert prof.id in err["message"]
        bad = await h.client.post(
            "/v1/reorder", json={**body, "strategy": "shuffle", "placement": "litm"}
        )
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "placement"
        assert "bm25" in bad.json()["error"]["message"]


async def test_server_default_strategy_and_its_placement(tmp_path: Path) -> None:
    """`RAG_REORDER_STRATEGY=bm25` with the generator's profile as `RAG_REORDER_PLACEMENT_PROFILE`:
    a request (or a rerank client) that names no strategy gets `bm25` placed `bias_matched`
    by that profile, no model call; one that names `bm25` keeps BM25's own order, one that
    names `moi` gets MoI. Hand-computed as in the test above: ranking [1, 2, 0, 3], placed by
    the recency profile [0.1, 0.2, 0.3, 0.4] as [3, 0, 2, 1]."""
    prof = _recency_profile(tmp_path / "profiles", "qa_default")
    backend = TrackingBackend(TRUTH)
    async with serving(
        tmp_path,
        backend=backend,
        bias_profile_dir=tmp_path / "profiles",
        strategy="bm25",
        placement_profile=prof.id,
    ) as h:
        info = (await h.client.get("/info")).json()
        assert (info["default_strategy"], info["default_placement"]) == ("bm25", "bias_matched")
        calls = backend.started
        body = {"query": "real answer", "passages": PASSAGES}
        r = (await h.client.post("/v1/reorder", json=body)).json()
        assert (r["strategy"], r["ranking"], r["order"]) == ("bm25", [1, 2, 0, 3], [3, 0, 2, 1])
        assert r["diagnostics"]["placement"] == "bias_matched"
        assert r["diagnostics"]["details"]["placement_profile"] == prof.id
        rerank = {"query": "real answer", "documents": PASSAGES, "top_n": 4}
        r = (await h.client.post("/v1/rerank", json=rerank)).json()
        assert [x["index"] for x in r["results"]] == [1, 2, 0, 3]  # best first, as clients expect
        assert r["meta"]["reorder"]["order"] == [3, 0, 2, 1]
        assert backend.started == calls  # BM25 calls no model
        # A request that names a strategy gets that strategy's own defaults.
        r = (await h.client.post("/v1/reorder", json={**body, "strategy": "bm25"})).json()
        assert r["order"] == [1, 2, 0, 3] and r["diagnostics"]["placement"] is None
        r = (await h.client.post("/v1/reorder", json={**body, "strategy": "moi"})).json()
        assert r["strategy"] == "moi" and backend.started > calls
        # A request's own placement wins over the server's.
        r = (await h.client.post("/v1/reorder", json={**body, "placement": "litm"})).json()
        assert r["order"] == [1, 0, 3, 2]


def test_with_defaults_resolves_strategy_and_placement_as_documented() -> None:
    from app.schemas.reorder import with_defaults
    from service.config.settings import Settings

    auto, bm25 = Settings(), Settings(strategy="bm25", placement="litm")
    assert with_defaults(None, None, auto) == ("auto", None)  # auto places by itself
    assert with_defaults(None, "bias_matched", auto) == ("auto", "bias_matched")
    # What only MoI reads asks for MoI when the default is auto.
    assert with_defaults(None, "litm", auto) == ("moi", "litm")
    assert with_defaults(None, None, auto, moi_options=True) == ("moi", None)
    assert with_defaults(None, None, Settings(strategy="moi")) == ("moi", None)
    assert with_defaults(None, None, bm25) == ("bm25", "litm")
    assert with_defaults(None, "descending_utility", bm25) == ("bm25", "descending_utility")
    assert with_defaults("bm25", None, bm25) == ("bm25", None)  # named: its own order
    assert with_defaults("dense", None, bm25) == ("dense", None)
    # A default that does not rank takes no placement (it places by its own rule).
    assert with_defaults(None, None, Settings(strategy="shuffle")) == ("shuffle", None)
