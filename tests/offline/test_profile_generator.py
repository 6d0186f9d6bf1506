"""``rag-reorder profile-generator``: a generator's position profile from its answers.

A scripted OpenAI-compatible generator (an httpx transport) whose accuracy depends only on the
gold passage's slot checks the measurement, the budget, the resume, the refusals and the stored
profile; the real vLLM OpenAI server on SmolLM2 checks the same run end to end."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from offline.answer_profile import (
    ANSWERS_FILE,
    PLOT_FILE,
    REPORT_FILE,
    ProfileJob,
    plan_trials,
    run_profile,
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
    """Questions whose answer is in passage 0 only; four distractors each."""
    out = []
    for q in range(n):
        passages = (
            Passage(text=f"The secret word of question {q} is zebra{q}.", title=f"Gold {q}"),
            *(Passage(text=f"Filler text number {k} about nothing.") for k in range(4)),
        )
        out.append(Example(f"q{q}", f"What is secret word {q}?", (f"zebra{q}",), passages, (0,)))
    return out


class Generator:
    """Answers right when the gold passage sits in one of ``good`` slots (0-based)."""

    def __init__(self, good: set[int], status: int = 200) -> None:
        self.good = good
        self.status = status
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "invalid api key"}})
        body = json.loads(request.content)
        assert request.url.path == "/v1/chat/completions"
        assert body["temperature"] == 0.0 and body["logprobs"] is True
        text = body["messages"][-1]["content"]
        docs = re.split(r"Document \[\d+\]", text)[1:]
        slot = next(k for k, d in enumerate(docs) if "secret word of question" in d)
        word = re.search(r"zebra\d+", docs[slot])
        answer = word.group(0) if slot in self.good and word else "I do not know."
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "message": {"role": "assistant", "content": answer},
                        "logprobs": {"content": [{"token": answer, "logprob": -0.5}]},
                    }
                ],
                "usage": {"prompt_tokens": 100, "completion_tokens": 3},
            },
        )


def job(tmp_path: Path, n: int = 24, **kw: Any) -> ProfileJob:
    base: dict[str, Any] = {
        "endpoint": GeneratorEndpoint(
            base_url="http://generator.test/v1", model="acme-7b", api_key="k", retries=0
        ),
        "examples": examples(n),
        "data_name": "secrets.jsonl",
        "slots": SLOTS,
        "template": get_template("qa_default"),
        "out": tmp_path / "out",
        "progress": False,
        "resamples": 300,
    }
    base.update(kw)
    return ProfileJob(**base)


def test_each_question_moves_only_its_gold_passage() -> None:
    trials, skipped = plan_trials(examples(2), SLOTS, get_template("qa_default"), seed=3)
    assert skipped == 0 and len(trials) == 2 * SLOTS
    first = [t.order for t in trials if t.question_id == "q0"]
    assert [o.index(0) for o in first] == list(range(SLOTS))
    # The distractors keep one arrangement: removing the gold passage leaves the same order.
    assert len({tuple(i for i in o if i != 0) for o in first}) == 1
    short = Example("s", "q?", ("a",), examples(1)[0].passages[:2], (0,))
    assert plan_trials([short], SLOTS, get_template("qa_default"), seed=0)[1] == 1


async def test_a_u_shaped_generator_is_measured_stored_and_placed_at_the_ends(
    tmp_path: Path,
) -> None:
    gen = Generator(good={0, SLOTS - 1})
    store = ProfileStore(tmp_path / "profiles")
    seen: list[Any] = []
    out = await run_profile(
        job(tmp_path), store, on_estimate=seen.append, transport=httpx.MockTransport(gen)
    )
    (est,) = seen
    assert (est.questions, est.calls, est.todo, est.done) == (24, 24 * SLOTS, 96, 0)
    assert est.approx_prompt_tokens > 0 and gen.calls == 96 == out.calls_made
    fit = out.fit
    assert fit is not None and fit.accuracy == pytest.approx((1.0, 0.0, 0.0, 1.0))
    assert fit.distinguishable and out.refused is None
    stored = out.stored
    assert stored is not None and stored == store.by_id(stored.id)
    assert (stored.model, stored.template, stored.slots) == ("acme-7b", "qa_default", SLOTS)
    assert stored.identification == "answers" and stored.oriented_by == "data"
    assert stored.runs == 24 and stored.prompts == 96 and "9600 prompt tokens" in stored.source
    ends = stored.coefficients[0] + stored.coefficients[-1]
    assert ends > 0.9 and sum(stored.coefficients) == pytest.approx(1.0)
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert report["stored"] == stored.id and report["calls"] == 96
    assert (tmp_path / "out" / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
    record = json.loads((tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()[0])
    assert record["answer_logprob"] == -0.5 and record["prompt_tokens"] == 100


async def test_the_budget_stops_a_run_and_the_next_one_continues(tmp_path: Path) -> None:
    gen = Generator(good={0})
    store = ProfileStore(tmp_path / "profiles")
    transport = httpx.MockTransport(gen)
    first = await run_profile(job(tmp_path, max_calls=30), store, transport=transport)
    assert first.calls_made == 30 == gen.calls and first.complete_questions == 30 // SLOTS
    lines = (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()
    assert len(lines) == 30
    # A torn last line (killed mid-write) is asked again, nothing else.
    with (tmp_path / "out" / ANSWERS_FILE).open("a") as fh:
        fh.write('{"question_id": "q9", "sl')
    seen: list[Any] = []
    second = await run_profile(job(tmp_path), store, on_estimate=seen.append, transport=transport)
    assert seen[0].done == 30 and seen[0].todo == 66
    assert second.calls_made == 66 and gen.calls == 96 and second.complete_questions == 24
    assert second.fit is not None and second.fit.accuracy[0] == 1.0


async def test_a_flat_curve_is_not_stored_unless_forced(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profiles")
    transport = httpx.MockTransport(Generator(good=set(range(SLOTS))))
    out = await run_profile(job(tmp_path), store, transport=transport)
    assert out.stored is None and out.refused is not None
    assert "not distinguishable from flat" in out.refused and "--force" in out.refused
    assert store.list() == []
    forced = await run_profile(job(tmp_path, force=True), store, transport=transport)
    assert forced.stored is not None and "forced" in forced.stored.source


async def test_a_refused_key_stops_at_once_with_a_clear_error(tmp_path: Path) -> None:
    gen = Generator(good={0}, status=401)
    with pytest.raises(InvalidRequest, match="refused the API key") as err:
        await run_profile(
            job(
                tmp_path,
                endpoint=GeneratorEndpoint(
                    base_url="http://generator.test/v1", model="acme-7b", retries=0, concurrency=1
                ),
            ),
            ProfileStore(tmp_path / "profiles"),
            transport=httpx.MockTransport(gen),
        )
    assert "401" in err.value.message and gen.calls == 1


async def test_retries_count_against_max_calls(tmp_path: Path) -> None:
    # Every other call is first refused with a 429 (no work done, retried): the budget of 8
    # counts those attempts too, so fewer than 8 answers come back and 8 requests were sent.
    gen = Generator(good={0})
    sent: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        if len(sent) % 2:
            return httpx.Response(429, headers={"Retry-After": "0"})
        return gen(request)

    endpoint = GeneratorEndpoint(
        base_url="http://generator.test/v1", model="acme-7b", retries=3, concurrency=1
    )
    out = await run_profile(
        job(tmp_path, endpoint=endpoint, max_calls=8, force=True),
        ProfileStore(tmp_path / "profiles"),
        transport=httpx.MockTransport(flaky),
    )
    assert out.attempts == len(sent) == 8 and out.calls_made == 4
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert report["attempts_this_run"] == 8 and report["calls_this_run"] == 4


async def test_a_folder_of_another_measurement_is_refused(tmp_path: Path) -> None:
    transport = httpx.MockTransport(Generator(good={0}))
    store = ProfileStore(tmp_path / "profiles")
    await run_profile(job(tmp_path, n=2, force=True), store, transport=transport)
    with pytest.raises(InvalidRequest, match="differs in slots"):
        await run_profile(job(tmp_path, n=2, slots=3), store, transport=transport)


# --- the real vLLM OpenAI server --------------------------------------------------------


@pytest.mark.slow
async def test_against_vllms_openai_server(vllm_server: str, tmp_path: Path) -> None:
    from service.batch.dataset import load_examples
    from tests.app.processes import ROOT, free_port

    data = load_examples(ROOT.parent / "shared" / "data" / "nq_open_dev.jsonl", limit=3)
    store = ProfileStore(tmp_path / "profiles")
    endpoint = GeneratorEndpoint(base_url=f"{vllm_server}/v1", model=EMBEDDED_MODEL, retries=1)
    real = job(tmp_path, endpoint=endpoint, examples=data, data_name="nq_open_dev.jsonl", slots=3)

    # The budget stops the first run; the second finishes the rest and stores (forced: three
    # questions cannot tell a curve from flat).
    first = await run_profile(real, store)
    assert first.calls_made == 9 and first.complete_questions == 3
    assert first.fit is not None and len(first.fit.accuracy) == 3
    records = [
        json.loads(line) for line in (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()
    ]
    assert all(isinstance(r["answer"], str) and r["answer_logprob"] < 0 for r in records)
    assert all(r["prompt_tokens"] > 100 for r in records)
    again = await run_profile(dataclasses.replace(real, force=True), store)
    assert again.calls_made == 0 and again.stored is not None
    assert again.stored.identification == "answers" and again.stored.slots == 3

    budget = dataclasses.replace(real, out=tmp_path / "budget", max_calls=4)
    assert (await run_profile(budget, store)).calls_made == 4
    rest = await run_profile(dataclasses.replace(budget, max_calls=None), store)
    assert rest.calls_made == 5 and rest.complete_questions == 3

    # A model the server does not serve, and no server at all: clear errors.
    wrong = GeneratorEndpoint(base_url=f"{vllm_server}/v1", model="no-such-model", retries=0)
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        await run_profile(dataclasses.replace(real, endpoint=wrong, out=tmp_path / "w"), store)
    gone = GeneratorEndpoint(
        base_url=f"http://127.0.0.1:{free_port()}/v1", model=EMBEDDED_MODEL, retries=0
    )
    with pytest.raises(EngineUnavailable):
        await run_profile(dataclasses.replace(real, endpoint=gone, out=tmp_path / "g"), store)
