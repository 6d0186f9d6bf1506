"""``rag-reorder profile-generator --no-labels``: a generator's position profile from its
answers to unlabelled questions, attributed to the passages that hold them.

A scripted OpenAI-compatible generator (an httpx transport) that answers from the passage in a
favourite slot checks the estimate, the stored profile and its trust, the budget and resume,
and that no answer text is kept; the real vLLM OpenAI server on SmolLM2 checks the same run
end to end, and the command line refuses a bad threshold before any call."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from offline.blind_profile import (
    ANSWERS_FILE,
    IDENTIFICATION,
    REPORT_FILE,
    BlindJob,
    plan_calls,
    run_blind_profile,
)
from offline.generator_api import GeneratorEndpoint
from service.batch.dataset import Example
from service.config.settings import EMBEDDED_MODEL
from service.errors import EngineUnavailable, InvalidRequest
from service.passage import Passage
from service.prompting.templates import get_template
from service.state.profile_store import ProfileStore

SLOTS = 4


def examples(n: int) -> list[Example]:
    """Unlabelled questions (no answers, no gold): passage p of question q names ``wq_p``."""
    return [
        Example(
            f"q{q}",
            f"Which word does question {q} want?",
            (),
            tuple(Passage(text=f"Filler {p}: the word here is w{q}_{p}.") for p in range(SLOTS)),
            (),
        )
        for q in range(n)
    ]


class Generator:
    """Answers with the word of the passage in slot 3 (three questions in four) or slot 0 (the
    fourth), alone (even questions) or in a sentence; every fifth question "I do not know."."""

    def __init__(self) -> None:
        self.calls = 0

    def slot(self, q: int) -> int:
        return 0 if q % 4 == 0 else 3

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        text = json.loads(request.content)["messages"][-1]["content"]
        q = int(re.search(r"question (\d+) want", text).group(1))  # type: ignore[union-attr]
        docs = re.split(r"Document \[\d+\]", text)[1:]
        slot = self.slot(q)
        word = re.search(r"w\d+_\d+", docs[slot]).group(0)  # type: ignore[union-attr]
        answer = word if q % 2 == 0 else f"It is {word}."
        if q % 5 == 4:
            answer = "I do not know."
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"role": "assistant", "content": answer}}],
                "usage": {"prompt_tokens": 80, "completion_tokens": 4},
            },
        )


def job(tmp_path: Path, n: int = 60, **kw: Any) -> BlindJob:
    base: dict[str, Any] = {
        "endpoint": GeneratorEndpoint(
            base_url="http://generator.test/v1", model="acme-7b", api_key="k", retries=0
        ),
        "examples": examples(n),
        "data_name": "questions.jsonl",
        "slots": SLOTS,
        "template": get_template("qa_default"),
        "out": tmp_path / "out",
        "progress": False,
    }
    base.update(kw)
    return BlindJob(**base)


def test_each_question_is_shown_once_in_a_seeded_random_order() -> None:
    calls, skipped = plan_calls(examples(40), SLOTS, get_template("qa_default"), seed=0)
    assert skipped == 0 and len(calls) == 40
    assert all(sorted(c.order) == list(range(SLOTS)) for c in calls)
    # Random, not a rotation: several orders, and the same ones for the same seed.
    assert len({c.order for c in calls}) > 10
    again, _ = plan_calls(examples(40), SLOTS, get_template("qa_default"), seed=0)
    assert [c.order for c in again] == [c.order for c in calls]
    short, skipped = plan_calls(examples(3), SLOTS + 1, get_template("qa_default"), seed=0)
    assert short == [] and skipped == 3


async def test_a_generator_reading_its_last_slot_is_learned_and_stored_without_labels(
    tmp_path: Path,
) -> None:
    gen = Generator()
    store = ProfileStore(tmp_path / "profiles")
    outcome = await run_blind_profile(job(tmp_path), store, transport=httpx.MockTransport(gen))
    assert gen.calls == 60 and outcome.calls_made == 60
    fit = outcome.fit
    assert fit is not None and fit.verdict == "shaped", fit and fit.reason
    assert fit.top_slots == (3, 0) and fit.share[3] > 0.6
    assert fit.attributed == 48 and fit.single == 48  # every fifth answer: no weight
    stored = outcome.stored
    assert stored is not None and stored.model == "acme-7b" and stored.slots == SLOTS
    assert stored.identification == IDENTIFICATION and stored.trust is not None
    assert stored.trust.verdict == "shaped" and stored.trust.source == "calibration"
    again = store.get("acme-7b", "qa_default", SLOTS)
    assert again is not None and again.coefficients == stored.coefficients == fit.coefficients
    assert again.trust == stored.trust
    # GET /v1/bias-profiles lists it as any stored profile (no fitted R^2: null).
    from app.conversions import profile_out

    listed = profile_out(again)
    assert listed.identification == IDENTIFICATION and listed.r2 is None
    assert listed.trust is not None and listed.trust.verdict == "shaped"
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert report["attributed_none"] == 12
    assert report["attributed_contained"] == 24 and report["attributed_overlap"] == 24
    # No answer text is kept: only the order shown and the attribution.
    raw = (tmp_path / "out" / ANSWERS_FILE).read_text()
    assert "It is" not in raw and "do not know" not in raw
    assert set(json.loads(raw.splitlines()[0])) >= {"question_id", "order", "attributed"}


async def test_the_budget_stops_a_run_the_next_continues_and_few_answers_are_not_stored(
    tmp_path: Path,
) -> None:
    gen = Generator()
    store = ProfileStore(tmp_path / "profiles")
    seen: list[Any] = []
    first = await run_blind_profile(
        job(tmp_path, max_calls=6),
        store,
        on_estimate=seen.append,
        transport=httpx.MockTransport(gen),
    )
    assert seen[0].todo == 6 and seen[0].calls == 60 and seen[0].approx_prompt_tokens > 0
    assert first.calls_made == 6 and gen.calls == 6
    assert first.stored is None and first.refused is not None
    assert first.refused.startswith("cannot tell yet")
    rest = await run_blind_profile(job(tmp_path), store, transport=httpx.MockTransport(gen))
    assert rest.estimate.done == 6 and rest.calls_made == 54 and gen.calls == 60
    assert rest.stored is not None
    # Another measurement's folder (another template) is refused before any call.
    with pytest.raises(InvalidRequest, match="another measurement"):
        await run_blind_profile(
            job(tmp_path, template=get_template("qa_plain")),
            store,
            transport=httpx.MockTransport(gen),
        )
    assert gen.calls == 60


class OneSlotGenerator(Generator):
    """Slot 3 in three questions of four; the fourth slot 0 or slot 1 in turn: one clear
    slot, and no runner-up among the rest."""

    def slot(self, q: int) -> int:
        return 3 if q % 4 else (q // 4) % 2


async def test_one_clear_slot_is_trusted_on_its_best_slot_alone_when_asked(
    tmp_path: Path,
) -> None:
    """The rule asks for the same two strongest slots (``TrustRules.top_slots``, auto's); a
    generator whose runner-up is a tie never gives them, however many answers; with
    ``top_slots=1`` (``--top-slots 1``, ``generator_top_slots``) its best slot is enough."""
    from solver.trust import TrustRules

    verdicts = {}
    for k in (2, 1):
        out = await run_blind_profile(
            job(tmp_path / str(k), n=120, rules=TrustRules(top_slots=k)),
            ProfileStore(tmp_path / str(k) / "profiles"),
            transport=httpx.MockTransport(OneSlotGenerator()),
        )
        assert out.fit is not None and out.fit.top_slots[0] == 3
        verdicts[k] = (out.fit.verdict, out.fit.reason, out.stored is not None)
    assert verdicts[2][0] == "undecided" and "same top 2" in verdicts[2][1], verdicts
    assert not verdicts[2][2]
    assert verdicts[1][0] == "shaped" and verdicts[1][2], verdicts


def test_the_command_refuses_a_bad_threshold_before_any_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from entrypoints.cli import main

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "q?", "passages": [{"text": "a"}, {"text": "b"}]}))
    argv = ["profile-generator", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
    argv += ["--no-labels", "--data", str(data), "--slots", "2", "--out", str(tmp_path / "p")]
    assert main([*argv, "--threshold", "1.5"]) == 2
    assert "--threshold must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main([*argv, "--top-slots", "3"]) == 2
    assert "--top-slots must be 1 or 2, got 3" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


# --- the real vLLM OpenAI server --------------------------------------------------------


@pytest.mark.slow
async def test_no_labels_against_vllms_openai_server(vllm_server: str, tmp_path: Path) -> None:
    from service.batch.dataset import load_examples
    from tests.app.processes import ROOT, free_port

    # Labels dropped: the command reads none of them.
    data = [
        dataclasses.replace(ex, answers=(), gold=())
        for ex in load_examples(ROOT.parent / "shared" / "data" / "nq_open_dev.jsonl", limit=4)
    ]
    store = ProfileStore(tmp_path / "profiles")
    endpoint = GeneratorEndpoint(
        base_url=f"{vllm_server}/v1", model=EMBEDDED_MODEL, retries=1, max_tokens=12
    )
    real = job(tmp_path, endpoint=endpoint, examples=data, data_name="nq_open_dev.jsonl", slots=3)

    first = await run_blind_profile(dataclasses.replace(real, max_calls=2), store)
    assert first.calls_made == 2 and first.fit is not None and first.fit.questions == 2
    rest = await run_blind_profile(real, store)
    assert rest.calls_made == 2 and rest.fit is not None and rest.fit.questions == 4
    records = [json.loads(x) for x in (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()]
    assert all(r["prompt_tokens"] > 100 and "answer" not in r for r in records)
    assert all(set(r["attributed"]) <= set(r["order"]) for r in records)
    # Four questions cannot decide anything: an honest "cannot tell yet", nothing stored.
    assert rest.stored is None and rest.refused is not None
    assert rest.refused.startswith("cannot tell yet")

    gone = GeneratorEndpoint(
        base_url=f"http://127.0.0.1:{free_port()}/v1", model=EMBEDDED_MODEL, retries=0
    )
    with pytest.raises(EngineUnavailable):
        await run_blind_profile(dataclasses.replace(real, endpoint=gone, out=tmp_path / "g"), store)


async def test_a_tie_goes_to_the_passage_the_scorer_finds_the_answer_likeliest_under(
    tmp_path: Path,
) -> None:
    """``BlindJob.likelihood`` (``--tie-break``): passage 1 repeats passage 0's word, so every
    answer from passage 0 is held by both; the scorer's pick takes its whole weight, and the
    record and the report say a tie was broken."""
    tied = [
        dataclasses.replace(
            ex,
            passages=(
                ex.passages[0],
                Passage(text=f"Also here: w{q}_0 and w{q}_1."),
                *ex.passages[2:],
            ),
        )
        for q, ex in enumerate(examples(12))
    ]

    class FromPassageZero(Generator):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            text = json.loads(request.content)["messages"][-1]["content"]
            docs = re.split(r"Document \[\d+\]", text)[1:]
            self.slot = lambda q: next(i for i, d in enumerate(docs) if "Filler 0" in d)  # type: ignore[method-assign]
            return super().__call__(request)

    asked: list[list[str]] = []

    async def prefers_filler(question: str, shown: Sequence[str], answer: str) -> list[float]:
        asked.append(list(shown))
        return [-1.0 if "Filler 0" in s else -5.0 for s in shown]

    out = await run_blind_profile(
        job(tmp_path, n=12, examples=tied, likelihood=prefers_filler, force=True),
        ProfileStore(tmp_path / "profiles"),
        transport=httpx.MockTransport(FromPassageZero()),
    )
    records = [json.loads(x) for x in (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()]
    held = [r for r in records if r["kind"] != "none"]  # contained, or by overlap
    assert len(held) == 10 and len(asked) == len(held)  # every fifth: "I do not know."
    for r in held:
        assert r["tied"] == 2 and len(r["attributed"]) == 1
        assert r["attributed"] == [0]  # passage 0 (the records index passages, not slots)
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert report["ties_broken"] == len(held)
    assert out.calls_made == 12


def test_the_command_breaks_ties_with_the_scoring_model(
    tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tie-break`` loads the configured scorer (the embedded SmolLM2) in the command's
    process; a real HTTP generator answers with a sentence two passages hold, and the answer
    goes to one of them, the record saying a tie of two was broken."""
    from entrypoints.cli import main
    from tests.support.canned_generator import canned_generator

    data = tmp_path / "q.jsonl"
    passages = [{"text": "Mary Shelley wrote it."}, {"text": "Mary Shelley wrote it. In 1818."}]
    data.write_text(json.dumps({"question": "Who wrote Frankenstein?", "passages": passages}))
    with canned_generator(lambda call: 0) as gen:
        argv = ["profile-generator", "--base-url", gen.url, "--model", "m", "--no-labels"]
        argv += ["--data", str(data), "--slots", "2", "--out", str(tmp_path / "p")]
        assert main([*argv, "--tie-break", "--no-progress"]) == 3  # one answer: not stored
    assert len(gen.calls) == 1
    (rec,) = [json.loads(x) for x in (tmp_path / "p" / ANSWERS_FILE).read_text().splitlines()]
    assert rec["kind"] == "contained" and rec["tied"] == 2 and len(rec["attributed"]) == 1
    assert json.loads((tmp_path / "p" / REPORT_FILE).read_text())["ties_broken"] == 1
    capsys.readouterr()
