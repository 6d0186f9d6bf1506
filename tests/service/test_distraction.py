"""Distracting effect, positional-profile calibration and the positional store (paper 004).

Expected numbers come from the fake backend's documented scoring rule: a continuation span of
``n`` byte tokens after a prompt showing passages ``p_1..p_L`` has log-prob
``fake.expected_score([p_1..p_L], n)``, so P(NO-RESPONSE) = exp(expected_score(..., 11)).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from offline.positions import calibrate_positions, rotations
from service.backends.fakes.fake import FakeBackend
from service.batch.dataset import Example
from service.errors import InvalidRequest
from service.passage import Passage
from service.prompting.prompts import build_generation_prompt
from service.state.positional_store import (
    CorruptPositionalProfile,
    PositionalRecord,
    PositionalStore,
    SlotMeans,
)
from service.state.profile_store import ProfileStore
from service.strategies.distraction import (
    ABSTAIN_TEMPLATE,
    NO_RESPONSE,
    distracting_effect,
    passage_effects,
    set_effects,
)
from tests.support.pipeline import reorderer_in

LAM = -0.01  # per-token log-prob of non-passage span tokens: keeps P(NO-RESPONSE) readable
N_NO_RESPONSE = len(NO_RESPONSE.encode())  # byte tokens of the continuation: 11


def _p_no_response(fake: FakeBackend, texts: list[str]) -> float:
    return math.exp(fake.expected_score(texts, N_NO_RESPONSE))


# --- DE ---------------------------------------------------------------------------------------


def test_distracting_effect_of_log_probs() -> None:
    assert distracting_effect([math.log(0.25), math.log(0.5)]) == pytest.approx(1 - 0.125)
    assert distracting_effect([0.0, 0.0]) == 0.0
    assert math.isnan(distracting_effect(None))


async def test_single_passage_de_is_one_minus_p_no_response(tmp_path: Path) -> None:
    truth = {"alpha passage": 1.0, "bravo passage": -1.0, "charlie passage": 0.0}
    fake = FakeBackend(truth, query_logprob_per_token=LAM)
    work = reorderer_in(tmp_path, fake).work("t")
    passages = [Passage(t) for t in truth]
    de = await passage_effects(work, "who is it?", passages)
    # By hand: s = LAM * 11 - max(0, top u = 1) + u_p (one slot, weight 1).
    by_hand = [1 - math.exp(LAM * 11 - 1 + u) for u in (1.0, -1.0, 0.0)]
    assert list(de) == pytest.approx(by_hand, abs=1e-12)
    assert list(de) == pytest.approx([1 - _p_no_response(fake, [t]) for t in truth], abs=1e-12)
    # One short prompt per passage; the 11 tokens of NO-RESPONSE are the scored span.
    usage = work.usage()
    assert usage.prompts_scored == 3 and usage.scored_tokens == 3 * N_NO_RESPONSE
    assert usage.generations == 0


async def test_de_prompts_use_the_abstain_template_and_end_in_the_assistant_turn(
    tmp_path: Path,
) -> None:
    seen: list[str] = []

    def rule(prompt: object) -> bool:
        seen.append(prompt.text)  # type: ignore[attr-defined]
        return False

    fake = FakeBackend({"alpha passage": 0.0}, fail_rule=rule)
    work = reorderer_in(tmp_path, fake).work("t", "qa_plain")
    await passage_effects(work, "who?", [Passage("alpha passage")])
    built = build_generation_prompt(
        fake.tokenizer, ABSTAIN_TEMPLATE, "who?", [Passage("alpha passage")], [0]
    )
    # The scored text is the abstain prompt (not the request's template) + NO-RESPONSE.
    assert seen == [built.text + NO_RESPONSE]
    assert "reply NO-RESPONSE" in seen[0]


async def test_set_de_follows_the_slot_weights(tmp_path: Path) -> None:
    truth = {"alpha passage": 1.0, "bravo passage": -1.0, "charlie passage": 0.0}
    fake = FakeBackend(truth, query_logprob_per_token=LAM)
    work = reorderer_in(tmp_path, fake).work("t")
    passages = [Passage(t) for t in truth]
    de = await set_effects(work, "who?", passages, [(1, 0, 2), (0, 2, 1)])
    # Primacy weights for 3 slots: 3/6, 2/6, 1/6.
    s1 = LAM * 11 - 1 + (3 * -1.0 + 2 * 1.0 + 1 * 0.0) / 6
    s2 = LAM * 11 - 1 + (3 * 1.0 + 2 * 0.0 + 1 * -1.0) / 6
    assert list(de) == pytest.approx([1 - math.exp(s1), 1 - math.exp(s2)], abs=1e-12)


async def test_a_failed_de_prompt_is_nan(tmp_path: Path) -> None:
    fake = FakeBackend(
        {"alpha passage": 0.0, "bravo passage": 1.0},
        fail_rule=lambda p: p.passages == ("bravo passage",),
    )
    work = reorderer_in(tmp_path, fake).work("t")
    de = await passage_effects(work, "q?", [Passage("alpha passage"), Passage("bravo passage")])
    assert math.isfinite(de[0]) and math.isnan(de[1])
    assert work.usage().prompts_failed == 1


def test_rotations_move_one_passage_through_every_slot() -> None:
    assert rotations([7, 8], 3) == [(3, 7, 8), (7, 3, 8), (7, 8, 3)]
    assert rotations([], 3) == [(3,)]


# --- calibration ------------------------------------------------------------------------------

# Global top utility is 2.0 (the fake's baseline uses the largest utility of its truth), so a
# single passage of utility u has DE = 1 - exp(LAM * 11 - 2 + u).
Q1 = {
    "q1 mid weak": 1.85,  # DE 0.229: among the 3 lowest, but not < 0.2
    "q1 gold passage": 2.0,
    "q1 weakest": 1.95,  # DE 0.148
    "q1 hardest": -1.0,  # DE 0.955 > 0.8: a hard distractor
    "q1 weaker": 1.9,  # DE 0.189
    "q1 middling": 0.0,  # DE 0.879
}
Q2 = {
    "q2 gold passage": 1.0,
    "q2 hardest": 1.2,  # DE 0.597: no distractor reaches 0.8
    "q2 weak one": 1.99,
    "q2 weak two": 1.98,
    "q2 weak three": 1.97,
    "q2 harder": 1.5,
}
Q3 = {"q3 gold passage": 1.0, "q3 a": 0.0, "q3 b": 0.0, "q3 c": 0.0}  # 3 non-gold < k = 4
Q4 = {"q4 a": 0.0, "q4 b": 0.0, "q4 c": 0.0, "q4 d": 0.0, "q4 e": 0.0}  # no gold passage


def _examples() -> list[Example]:
    def ex(i: int, texts: dict[str, float], gold: tuple[int, ...]) -> Example:
        return Example(
            id=f"q{i}",
            question=f"question number {i}?",
            answers=("Paris",),
            passages=tuple(Passage(t) for t in texts),
            gold=gold,
        )

    return [ex(1, Q1, (1,)), ex(2, Q2, (0,)), ex(3, Q3, (0,)), ex(4, Q4, ())]


def _fake(**kw: object) -> FakeBackend:
    # The fake answers "Paris" from q1's gold passage (the best one in its prompts); q2's
    # prompts are answered from its weak distractors, which beat its gold passage.
    return FakeBackend(
        {**Q1, **Q2, **Q3, **Q4},
        query_logprob_per_token=LAM,
        answers={"q1 gold passage": "Paris"},
        **kw,  # type: ignore[arg-type]
    )


async def test_calibration_measures_both_profiles_by_hand(tmp_path: Path) -> None:
    fake = _fake()
    r = reorderer_in(tmp_path, fake)
    progress: list[tuple[int, int]] = []
    report = await calibrate_positions(
        r,
        _examples(),
        max_passages=4,
        source="synthetic.jsonl",
        progress=lambda d, t: progress.append((d, t)),
    )
    rec = report.record
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert (rec.model, rec.template, rec.slots) == ("fake/known-truth", "qa_default", 4)
    assert rec.questions == 2 and rec.skipped == 2
    assert rec.hard_distractors == 1  # q1 only
    assert rec.weak_distractors == 1  # q2 only (q1's third weakest has DE 0.229)
    assert rec.de_template == "qa_abstain" and rec.source == "synthetic.jsonl"
    assert rec.created.endswith("+00:00") and rec.max_answer_tokens == 32
    assert any("no gold passage" in w for w in rec.warnings)
    assert any("fewer than 4 non-gold passages" in w for w in rec.warnings)

    # Weak distractors in input order, the gold / hard passage rotated through them.
    w1 = ["q1 mid weak", "q1 weakest", "q1 weaker"]
    w2 = ["q2 weak one", "q2 weak two", "q2 weak three"]

    def rotate(fixed: list[str], moving: str) -> list[list[str]]:
        return [[*fixed[:j], moving, *fixed[j:]] for j in range(4)]

    # Accuracy: q1 always answers Paris (its gold passage is the best), q2 never.
    assert rec.accuracy.values == (0.5, 0.5, 0.5, 0.5)
    assert rec.accuracy.stderr == pytest.approx((0.5,) * 4)  # sd([1, 0]) / sqrt(2)
    # Gold answer "Paris" (5 byte tokens), mean per-token log-likelihood, per gold slot.
    ll = [
        (
            fake.expected_score(rotate(w1, "q1 gold passage")[j], 5) / 5
            + fake.expected_score(rotate(w2, "q2 gold passage")[j], 5) / 5
        )
        / 2
        for j in range(4)
    ]
    assert rec.answer_logprob.values == pytest.approx(ll, abs=1e-12)
    # Not flat, although accuracy is: the fake's primacy bias moves the likelihood.
    assert len(set(rec.answer_logprob.values)) == 4
    # DE of the whole set with the hard distractor in each slot.
    de = [
        (
            (1 - _p_no_response(fake, rotate(w1, "q1 hardest")[j]))
            + (1 - _p_no_response(fake, rotate(w2, "q2 hardest")[j]))
        )
        / 2
        for j in range(4)
    ]
    assert rec.distracting_effect.values == pytest.approx(de, abs=1e-12)
    assert all(0 <= v <= 1 for v in rec.distracting_effect.values)
    for m in (rec.accuracy, rec.answer_logprob, rec.distracting_effect):
        assert m.questions == 2 and len(m.values) == len(m.stderr) == 4

    # Cost per used question: 5 single-passage DEs, 4 answers (each scoring the gold answer
    # from its own prefill, so no separate gold prompts), 4 set DEs.
    assert report.prompts == 2 * (5 + 4 + 4)
    assert report.prompts_failed == 0 and report.generated_tokens > 0
    # Stored where the strategies look, and read back equal.
    stored = PositionalStore(tmp_path / "profiles" / "positional").get(
        "fake/known-truth", "qa_default", 4
    )
    assert stored == rec


async def test_calibration_leaves_failed_questions_out_of_that_profile_only(
    tmp_path: Path,
) -> None:
    # q2's set-DE prompts (4 passages, the abstain instruction) fail.
    fake = _fake(
        fail_rule=lambda p: (
            "q2 hardest" in p.passages and len(p.passages) == 4 and "reply NO-RESPONSE" in p.text
        )
    )
    report = await calibrate_positions(reorderer_in(tmp_path, fake), _examples(), max_passages=4)
    rec = report.record
    assert rec.questions == 2 and rec.accuracy.questions == 2
    assert rec.distracting_effect.questions == 1
    assert rec.distracting_effect.stderr == (None,) * 4  # one question: no standard error
    assert any("left out of distracting_effect" in w for w in rec.warnings)
    assert report.prompts_failed == 4


async def test_calibration_without_a_usable_question_is_refused(tmp_path: Path) -> None:
    r = reorderer_in(tmp_path, _fake())
    with pytest.raises(InvalidRequest, match="at least 6 non-gold passages"):
        await calibrate_positions(r, _examples(), max_passages=6)
    assert not (tmp_path / "profiles" / "positional").exists()


# --- the store --------------------------------------------------------------------------------


def make_record(
    *,
    model: str = "m/1",
    template: str = "qa_default",
    accuracy: tuple[float, ...] = (0.5, 0.4, 0.6),
    effect: tuple[float, ...] = (0.3, 0.2, 0.4),
    questions: int = 3,
) -> PositionalRecord:
    k = len(accuracy)
    return PositionalRecord(
        model=model,
        template=template,
        slots=k,
        accuracy=SlotMeans(accuracy, (0.1,) * k, questions),
        answer_logprob=SlotMeans((-1.0,) * k, (0.05,) * k, questions),
        distracting_effect=SlotMeans(effect, (0.02,) * k, questions),
        de_template="qa_abstain",
        source="dev.jsonl",
        questions=questions,
        skipped=1,
        hard_distractors=1,
        weak_distractors=2,
        max_answer_tokens=32,
        created_at=1.0,
        created="1970-01-01T00:00:01+00:00",
        warnings=("w",),
    )


def test_store_round_trip(tmp_path: Path) -> None:
    profiles = ProfileStore(tmp_path / "profiles")
    store = PositionalStore.beside(profiles)
    assert store.get("m/1", "qa_default", 3) is None and store.list() == []
    rec = store.put(make_record())
    assert store.path("m/1", "qa_default", 3).parent == tmp_path / "profiles" / "positional"
    assert store.get("m/1", "qa_default", 3) == rec
    store.put(make_record(template="qa_plain", accuracy=(1.0, 0.0), effect=(0.0, 1.0)))
    assert [(r.template, r.slots) for r in store.list()] == [("qa_default", 3), ("qa_plain", 2)]
    # The MoI bias profiles beside it never list these files; no temporary file is left.
    assert profiles.list() == []
    assert sorted(p.name for p in store.root.iterdir()) == [
        "m_1__qa_default__L3.json",
        "m_1__qa_plain__L2.json",
    ]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: "{not json", "unreadable"),
        (lambda d: {**d, "schema": 99}, "schema"),
        (lambda d: {k: v for k, v in d.items() if k != "source"}, "source"),
        (lambda d: {**d, "accuracy": {**d["accuracy"], "values": [0.5, 0.4]}}, "2 values"),
        (lambda d: {**d, "accuracy": {**d["accuracy"], "values": [0.5, 0.4, 1.5]}}, "accuracy"),
        (
            lambda d: {
                **d,
                "distracting_effect": {**d["distracting_effect"], "values": [0.1, None, 0.2]},
            },
            "bad field",
        ),
        (lambda d: {**d, "slots": "3"}, "bad field"),
        (lambda d: {**d, "hard_distractors": 9}, "hard_distractors"),
    ],
)
def test_a_corrupt_file_is_a_clear_error(tmp_path: Path, edit: object, why: str) -> None:
    store = PositionalStore(tmp_path)
    store.put(make_record())
    path = store.path("m/1", "qa_default", 3)
    data = json.loads(path.read_text())
    new = edit(data)  # type: ignore[operator]
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(CorruptPositionalProfile, match=why) as info:
        store.get("m/1", "qa_default", 3)
    assert "m_1__qa_default__L3.json" in info.value.message
    assert "calibrate-positions" in info.value.message
    assert str(tmp_path) not in info.value.message  # no paths in messages


def test_a_file_of_another_key_is_not_read_as_this_one(tmp_path: Path) -> None:
    store = PositionalStore(tmp_path)
    store.put(make_record(model="m/1"))
    # "m_1" sanitises to the same file name as "m/1".
    with pytest.raises(CorruptPositionalProfile, match="holds"):
        store.get("m_1", "qa_default", 3)


def test_put_refuses_an_invalid_record(tmp_path: Path) -> None:
    store = PositionalStore(tmp_path)
    with pytest.raises(InvalidRequest, match="distracting_effect"):
        store.put(make_record(effect=(0.1, math.nan, 0.2)))
    bad = dataclasses.replace(make_record(), accuracy=SlotMeans((0.5,) * 3, (None,) * 3, 3))
    with pytest.raises(InvalidRequest, match="standard errors"):
        store.put(bad)
    assert list(tmp_path.iterdir()) == []
