"""``max_relevance`` and ``min_distraction`` (paper 004 (iv), (v)) on hand-made profiles.

DE expectations come from the fake's scoring rule: a single passage of utility ``u`` has
P(NO-RESPONSE) = exp(fake.expected_score([text], 11)) (11 byte tokens of NO-RESPONSE).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from service.backends.fakes.fake import FakeBackend
from service.config.settings import Settings
from service.errors import InvalidRequest, LimitExceeded, ScoringFailed, UnidentifiableRequest
from service.passage import Passage
from service.pipeline import Reorderer, ReorderRequest, StrategyOptions
from service.state.positional_store import CorruptPositionalProfile, PositionalStore
from service.state.profile_store import ProfileStore
from service.strategies.distraction import fill_slots, slot_preference
from tests.service.test_distraction import make_record
from tests.support.positional import calibrate_positions, write_qa_file

LAM = -0.01
TEXTS = ["alpha passage", "bravo passage", "charlie passage", "delta passage", "echo passage"]
# 004 Table 1, first row (Qwen 2.5 7B, gold passage among weak distractors): footnote 7's
# order 5, 1, 4, 3, 2.
TABLE1_ACCURACY = (0.8080, 0.7900, 0.7920, 0.7993, 0.8273)
# A DE profile whose increasing order is footnote 8's 3, 2, 4, 1, 5.
FOOTNOTE8_DE = (0.40, 0.32, 0.28, 0.34, 0.44)


def _setup(
    tmp_path: Path, utilities: list[float], **fake: object
) -> tuple[Reorderer, FakeBackend, PositionalStore]:
    backend = FakeBackend(
        dict(zip(TEXTS, utilities, strict=False)),
        query_logprob_per_token=LAM,
        **fake,  # type: ignore[arg-type]
    )
    profiles = ProfileStore(tmp_path / "profiles")
    r = Reorderer(backend, Settings(cache_dir=tmp_path), profiles)
    return r, backend, PositionalStore.beside(profiles)


def _store(store: PositionalStore, **kw: object) -> None:
    store.put(make_record(model="fake/known-truth", **kw))  # type: ignore[arg-type]


def _request(strategy: str, scores: list[float] | None = None, n: int = 5) -> ReorderRequest:
    passages = [
        Passage(text=t, score=None if scores is None else scores[i])
        for i, t in enumerate(TEXTS[:n])
    ]
    return ReorderRequest("who is it?", passages, strategy=strategy)  # type: ignore[arg-type]


def test_slot_rules() -> None:
    assert slot_preference(TABLE1_ACCURACY, best="high") == [4, 0, 3, 2, 1]  # footnote 7
    assert slot_preference(FOOTNOTE8_DE, best="low") == [2, 1, 3, 0, 4]  # footnote 8
    # Ties keep the earlier slot first, whichever direction is best.
    assert slot_preference([0.5, 0.7, 0.5, 0.7], best="high") == [1, 3, 0, 2]
    assert slot_preference([0.5, 0.7, 0.5, 0.7], best="low") == [0, 2, 1, 3]
    assert fill_slots([7, 8, 9], [2, 0, 1]) == [8, 9, 7]


# --- max_relevance ----------------------------------------------------------------------------


async def test_max_relevance_places_by_footnote_7(tmp_path: Path) -> None:
    r, backend, store = _setup(tmp_path, [0.0] * 5)
    _store(store, accuracy=TABLE1_ACCURACY, effect=FOOTNOTE8_DE)
    res = await r.reorder(_request("max_relevance"))
    # Retriever rank r (input order here) into the r-th best slot: 5, 1, 4, 3, 2.
    # Slot 5 <- rank 0, slot 1 <- rank 1, slot 4 <- rank 2, slot 3 <- rank 3, slot 2 <- rank 4.
    assert res.order == [1, 4, 3, 2, 0]
    assert res.ranking == [0, 1, 2, 3, 4] and res.scores is None
    assert res.details["slot_preference"] == [4, 0, 3, 2, 1]
    pp = res.positional_profile
    assert pp is not None and pp.kind == "accuracy" and pp.values == TABLE1_ACCURACY
    assert (pp.model, pp.template, pp.slots, pp.questions) == (
        "fake/known-truth",
        "qa_default",
        5,
        3,
    )
    # No model call at all.
    assert res.usage.prompts == res.usage.prompts_scored == res.usage.generations == 0
    assert backend.stats.score_calls == backend.stats.generate_calls == 0
    assert res.distracting_effect is None


async def test_max_relevance_follows_retriever_scores_and_ties(tmp_path: Path) -> None:
    r, _, store = _setup(tmp_path, [0.0] * 5)
    _store(store, accuracy=TABLE1_ACCURACY, effect=FOOTNOTE8_DE)
    # Retriever ranking by score: 2, 4, 0, 3, 1.
    res = await r.reorder(_request("max_relevance", [0.5, 0.1, 0.9, 0.2, 0.7]))
    assert res.ranking == [2, 4, 0, 3, 1]
    assert res.order == [4, 1, 3, 0, 2]
    # A flat profile (a small model's accuracy): every slot ties, the retriever order stays.
    _store(store, accuracy=(0.0,) * 5, effect=FOOTNOTE8_DE)
    res = await r.reorder(_request("max_relevance", [0.5, 0.1, 0.9, 0.2, 0.7]))
    assert res.order == [2, 4, 0, 3, 1]


# --- min_distraction --------------------------------------------------------------------------


async def test_min_distraction_measures_de_and_places_by_footnote_8(tmp_path: Path) -> None:
    utilities = [0.5, -1.0, 2.0, 0.0, 1.0]
    r, backend, store = _setup(tmp_path, utilities)
    _store(store, accuracy=TABLE1_ACCURACY, effect=FOOTNOTE8_DE)
    res = await r.reorder(_request("min_distraction"))
    de = res.distracting_effect
    assert de is not None
    expected = [1 - math.exp(backend.expected_score([t], 11)) for t in TEXTS]
    assert list(de) == pytest.approx(expected, abs=1e-12)
    # By hand: s = LAM * 11 - max(0, top u = 2) + u, so DE falls as u rises.
    assert de[1] == pytest.approx(1 - math.exp(-0.11 - 2 - 1.0), abs=1e-12)
    # Decreasing DE = increasing utility: 1, 3, 0, 4, 2; into slots 3, 2, 4, 1, 5.
    assert res.details["distraction_ranking"] == [1, 3, 0, 4, 2]
    assert res.details["slot_preference"] == [2, 1, 3, 0, 4]
    assert res.order == [4, 3, 1, 0, 2]
    # The ranking is the retriever's; DE is reported, not turned into a score.
    assert res.ranking == [0, 1, 2, 3, 4] and res.scores is None and res.score_name is None
    pp = res.positional_profile
    assert pp is not None and pp.kind == "distracting_effect" and pp.values == FOOTNOTE8_DE
    # Cost: one single-passage prompt per passage, the 11 tokens of NO-RESPONSE scored each.
    assert res.usage.prompts == res.usage.prompts_scored == 5
    assert res.usage.scored_tokens == 5 * 11 and res.usage.generations == 0
    assert res.usage.prompts_failed == 0 and not res.warnings


async def test_min_distraction_ties_follow_the_retriever(tmp_path: Path) -> None:
    r, _, store = _setup(tmp_path, [0.0, 1.0, 0.0, 1.0, 0.0])
    _store(store, accuracy=TABLE1_ACCURACY, effect=(0.1, 0.2, 0.3, 0.4, 0.5))
    # Retriever order 4, 3, 2, 1, 0; equal DE keeps it: 4, 2, 0 (u = 0), then 3, 1.
    res = await r.reorder(_request("min_distraction", [1.0, 2.0, 3.0, 4.0, 5.0]))
    assert res.details["distraction_ranking"] == [4, 2, 0, 3, 1]
    assert res.order == [4, 2, 0, 3, 1]  # increasing positional DE is slot order here


async def test_without_a_profile_both_refuse_before_any_model_call(tmp_path: Path) -> None:
    r, backend, store = _setup(tmp_path, [0.0] * 5)
    _store(store)  # 3 slots: not the 5 the request needs
    for name in ("max_relevance", "min_distraction"):
        with pytest.raises(UnidentifiableRequest) as info:
            await r.reorder(_request(name))
        msg = info.value.message
        assert "rag-reorder calibrate-positions" in msg and "--max-passages 5" in msg
        assert "'fake/known-truth'" in msg and "qa_default" in msg
    assert backend.stats.score_calls == backend.stats.generate_calls == 0
    # Another template's profile does not count either.
    _store(store, template="qa_plain", accuracy=TABLE1_ACCURACY, effect=FOOTNOTE8_DE)
    with pytest.raises(UnidentifiableRequest, match="template 'qa_default'"):
        await r.reorder(_request("min_distraction"))


async def test_one_passage_needs_no_profile(tmp_path: Path) -> None:
    r, _, _ = _setup(tmp_path, [0.0])
    for name in ("max_relevance", "min_distraction"):
        res = await r.reorder(_request(name, n=1))
        assert res.order == res.ranking == [0] and res.positional_profile is None
    res = await r.reorder(_request("min_distraction", n=1))
    assert res.distracting_effect is not None and res.usage.prompts_scored == 1


async def test_a_failed_de_prompt_degrades_and_all_failed_raises(tmp_path: Path) -> None:
    utilities = [0.5, -1.0, 2.0, 0.0, 1.0]
    r, backend, store = _setup(
        tmp_path, utilities, fail_rule=lambda p: p.passages == ("bravo passage",)
    )
    _store(store, accuracy=TABLE1_ACCURACY, effect=FOOTNOTE8_DE)
    res = await r.reorder(_request("min_distraction"))
    de = res.distracting_effect
    assert de is not None and np.isnan(de[1]) and np.isfinite(np.delete(de, 1)).all()
    # The unmeasured passage 1 goes after the measured ones: 3, 0, 4, 2, 1.
    assert res.details["distraction_ranking"] == [3, 0, 4, 2, 1]
    assert res.order == [2, 0, 3, 4, 1]
    assert res.usage.prompts_failed == 1 and "1 distracting-effect prompt" in res.warnings[0]
    backend.fail_rule = lambda p: True
    with pytest.raises(ScoringFailed, match="all 5 distracting-effect prompts failed"):
        await r.reorder(_request("min_distraction"))


async def test_a_corrupt_profile_is_a_server_error(tmp_path: Path) -> None:
    r, backend, store = _setup(tmp_path, [0.0] * 5)
    _store(store, accuracy=TABLE1_ACCURACY, effect=FOOTNOTE8_DE)
    store.path("fake/known-truth", "qa_default", 5).write_text("{")
    with pytest.raises(CorruptPositionalProfile, match="calibrate-positions"):
        await r.reorder(_request("min_distraction"))
    assert backend.stats.score_calls == 0


async def test_limits_and_options(tmp_path: Path) -> None:
    backend = FakeBackend(dict.fromkeys(TEXTS, 0.0))
    s = Settings(cache_dir=tmp_path, max_prompts_per_request=4)
    r = Reorderer(backend, s, ProfileStore(tmp_path / "profiles"))
    assert r.planned_prompts(_request("min_distraction")) == 5
    assert r.planned_prompts(_request("max_relevance")) == 0
    with pytest.raises(LimitExceeded):
        await r.reorder(_request("min_distraction"))
    req = ReorderRequest(
        "q?", [Passage(t) for t in TEXTS], strategy="max_relevance", options=StrategyOptions(seed=1)
    )
    with pytest.raises(InvalidRequest, match="seed"):
        await r.reorder(req)


# --- a tiny real model ------------------------------------------------------------------------


async def test_calibrate_positions_cli_then_min_distraction_on_a_tiny_model(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import anyio.to_thread

    from service.backends.engines.transformers_backend import TransformersBackend

    monkeypatch.setenv("RAG_REORDER_CACHE_DIR", str(tmp_path))
    data = write_qa_file(tmp_path / "qa.jsonl")
    printed, err = await calibrate_positions(tiny_model_dir, data, capsys)
    assert "calibrating positions: 2/2 questions" in err
    assert printed["slots"] == 3 and printed["questions"] == 2 and printed["source"] == "qa.jsonl"
    # Per question: 4 single-passage DEs, 3 answers (each scoring the gold answer from its
    # own prefill), 3 set DEs.
    assert printed["prompts"] == 2 * (4 + 3 + 3)
    for name, lo, hi in (("accuracy", 0, 1), ("distracting_effect", 0, 1)):
        assert all(lo <= v <= hi for v in printed[name]["values"])
    assert all(v <= 0 for v in printed["answer_logprob"]["values"])

    settings = Settings(
        model=str(tiny_model_dir), backend="transformers", device="cpu", cache_dir=tmp_path
    )
    backend = await anyio.to_thread.run_sync(lambda: TransformersBackend.from_settings(settings))
    try:
        r = Reorderer(backend, settings)
        passages = [
            Passage(title="Tolkien", text="J. R. R. Tolkien wrote The Lord of the Rings."),
            Passage(title="Narnia", text="C. S. Lewis wrote The Chronicles of Narnia."),
            Passage(text="The Hobbit was published in 1937."),
        ]
        req = ReorderRequest(
            "who wrote the lord of the rings", passages, strategy="min_distraction"
        )
        res = await r.reorder(req)
    finally:
        await backend.aclose()
    de = res.distracting_effect
    assert de is not None and np.all((de >= 0) & (de <= 1))
    assert sorted(res.order) == [0, 1, 2] and res.usage.prompts_scored == 3
    pp = res.positional_profile
    assert pp is not None and pp.values == tuple(printed["distracting_effect"]["values"])
