"""``rag-reorder eval --generator-url``: the user's data checked, the user's generator called
with a budget, resumed, refused, and the verdict in words.

The fast tests answer through an httpx transport standing in for the generator's API, with the
orders from the in-process pipeline on the fake backend (the product's own fake); the last test
runs it for real: vLLM's OpenAI server answering, a rag-reorder server process ordering.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from offline.convert import convert_litm
from offline.evaluation.deployed import ANSWERS_FILE, DeployedJob, run_deployed
from offline.evaluation.orderers import InProcessOrderer, ServerOrderer, Target, targets
from offline.evaluation.stats import (
    SIGN_TEST,
    WILCOXON_EXACT,
    WILCOXON_NORMAL,
    paired_test,
    wilcoxon_p,
)
from offline.evaluation.verdict import REPORT_JSON, questions_needed, verdict
from offline.generator_api import GeneratorEndpoint, api_key
from service.backends.fakes.fake import FakeBackend
from service.batch.dataset import Example, load_examples
from service.config.settings import Settings
from service.errors import InvalidRequest
from service.passage import Passage
from service.pipeline import Reorderer
from service.prompting.templates import get_template
from service.state.profile_store import ProfileStore

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "data" / "litm_sample.jsonl"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


# -- the user's data ---------------------------------------------------------------------


GOOD = {"id": "q1", "question": "who?", "answers": ["Ada"], "passages": [{"text": "Ada did."}]}


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"question": ""}, "question: expected a non-empty string"),
        ({"passages": []}, "passages: expected a non-empty list"),
        ({"passages": [{"title": "t"}]}, "passages[0].text: expected a non-empty string"),
        ({"passages": [{"text": "a", "score": "high"}]}, "passages[0].score: expected a finite"),
        ({"passages": [{"text": "a", "is_gold": "yes"}]}, "passages[0].is_gold: expected true"),
        ({"answers": "Ada"}, "answers: expected a list of strings"),
        ({"gold_position": 3}, "gold_position: expected indices in [0, 0], got 3"),
        ({"id": ""}, "id: expected a non-empty string"),
    ],
)
def test_a_bad_record_names_its_line_and_field(
    tmp_path: Path, change: dict[str, Any], where: str
) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(GOOD | {"id": "q0"}) + "\n\n" + json.dumps(GOOD | change) + "\n")
    with pytest.raises(InvalidRequest) as err:
        load_examples(path)
    assert err.value.message.startswith(f"mine.jsonl:3: {where}"), err.value.message


def test_optional_fields_and_duplicate_ids(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    rows = [
        {"question": "q?", "answers": ["a"], "passages": ["plain text", {"text": "t", "score": 2}]},
        {"id": 7, "question": "q?", "passages": [{"text": "x"}, {"text": "y"}], "gold_position": 1},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = load_examples(path)
    assert first.id == "line-1" and first.passages[1].score == 2.0 and first.gold == ()
    assert second.id == "7" and second.gold == (1,) and second.answers == ()
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(InvalidRequest, match=r"mine\.jsonl:2: id: 'q1' is already the id of l"):
        load_examples(path)


def test_the_lost_in_the_middle_format_converts(tmp_path: Path) -> None:
    out = tmp_path / "mine.jsonl"
    assert convert_litm(SAMPLE, out) == 3
    examples = load_examples(out)
    raw = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    for ex, rec in zip(examples, raw, strict=True):
        assert ex.question == rec["question"] and list(ex.answers) == rec["answers"]
        assert [p.text for p in ex.passages] == [c["text"] for c in rec["ctxs"]]
        assert list(ex.gold) == [i for i, c in enumerate(rec["ctxs"]) if c["isgold"]]
        assert [p.score for p in ex.passages] == [float(c["score"]) for c in rec["ctxs"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answers": ["a"], "ctxs": []}) + "\n")
    with pytest.raises(InvalidRequest, match=r"bad.jsonl:1: ctxs: expected a non-empty list"):
        convert_litm(bad, tmp_path / "never.jsonl")
    assert not (tmp_path / "never.jsonl").exists()


# -- variants and the verdict ------------------------------------------------------------


def test_variants_always_hold_the_baselines() -> None:
    assert [(t.label, t.body) for t in targets(None)] == [
        ("default", {}),
        ("retriever", {"strategy": "retriever"}),
        ("shuffle", {"strategy": "shuffle"}),
    ]
    labels = [t.label for t in targets(["moi:pruned_random:bias_matched", "dense:litm", "shuffle"])]
    assert labels == ["moi:pruned_random:bias_matched", "dense:litm", "shuffle", "retriever"]
    moi = targets(["moi:pruned_random:bias_matched"])[0].body
    assert moi == {
        "strategy": "moi",
        "design": {"kind": "pruned_random"},
        "placement": "bias_matched",
    }
    with pytest.raises(InvalidRequest, match="unknown strategy or variant 'nope'"):
        targets(["nope"])


def test_the_verdict_in_words() -> None:
    helps = [(1.0, 0.0)] * 30 + [(1.0, 1.0)] * 70
    v = verdict("default", "retriever", helps, resamples=2000)
    assert v.diff == pytest.approx(0.3) and v.low > 0 and v.questions_needed is None
    assert v.sentence.startswith(
        "On these 100 questions, `default` changed accuracy by +0.300 ["
    ) and v.sentence.endswith(
        "against your retriever's order: it helps your generator on this data (30 wins, "
        "0 losses; exact sign test (McNemar) p = 1.9e-09)."
    )
    hurts = [(0.0, 1.0)] * 30 + [(1.0, 1.0)] * 70
    assert "it hurts" in verdict("x", "shuffle", hurts, resamples=2000).sentence
    # One win and one loss in 20: the interval holds 0. Differences +1, -1 and 18 zeros:
    # m2 = 2/20; n = (1.959964 sqrt(0.1) + 0.841621 sqrt(0.1 - 0.0025))^2 / 0.05^2 = 311.6.
    close = [(1.0, 0.0), (0.0, 1.0)] + [(0.0, 0.0)] * 18
    v = verdict("auto", "retriever", close, resamples=2000)
    assert v.questions_needed == 312 == questions_needed([1, -1] + [0] * 18)
    assert "too close to tell (1 wins, 1 losses; exact sign test (McNemar) p = 1)" in v.sentence
    assert "about 312 questions would show a difference of 0.05" in v.sentence
    assert v.short == "cannot tell (~312 questions for 0.05)"
    same = verdict("auto", "retriever", [(1.0, 1.0)] * 5, resamples=200)
    assert "nothing to tell apart" in same.sentence and same.questions_needed is None


def test_four_wins_of_200_are_not_evidence_that_it_helps() -> None:
    # The bootstrap interval excludes 0 ([+0.005, +0.040]); the signed-rank test on all-tied
    # differences falls back to its normal approximation (0.046); the exact sign test: 2/16.
    pairs = [(1.0, 0.0)] * 4 + [(1.0, 1.0)] * 196
    v = verdict("default", "retriever", pairs, resamples=2000)
    assert v.low > 0 and wilcoxon_p([1] * 4 + [0] * 196) == pytest.approx(0.0455, abs=1e-4)
    assert (v.p_value, v.test, v.wins, v.losses) == (0.125, SIGN_TEST, 4, 0)
    assert v.short == "probably below 0.05" and v.questions_needed is None
    assert "the interval excludes 0 but the exact sign test (McNemar) does not" in v.sentence
    # m2 = 4/200: n = (1.96 sqrt(0.02) + 0.8416 sqrt(0.0175))^2 / 0.0025 = 60.4.
    assert "61 questions would show a difference of 0.05" in v.sentence
    assert "probably below 0.05" in v.sentence and "helps" not in v.sentence


def test_questions_needed_is_never_fewer_than_answered() -> None:
    # 10 wins, 8 losses of 400: the variance at the observed effect asked for 142 questions
    # "more" after 400 were answered; at the planning effect 139 would do, so the difference
    # is probably below 0.05 and no count is asked for.
    pairs = [(1.0, 0.0)] * 10 + [(0.0, 1.0)] * 8 + [(1.0, 1.0)] * 382
    v = verdict("default", "retriever", pairs, resamples=2000)
    assert v.questions_needed is None and v.short == "probably below 0.05"
    assert "139 questions would show a difference of 0.05" in v.sentence
    small = verdict("default", "retriever", pairs[:9] + pairs[10:12], resamples=2000)
    assert small.questions_needed is not None and small.questions_needed > small.n


def test_the_test_names_itself() -> None:
    assert paired_test([1, 1, 1, 0]) == (pytest.approx(0.25), SIGN_TEST)  # 2 / 2^3
    assert paired_test([0.5, -0.5, 0.5]) == (pytest.approx(1.0), SIGN_TEST)
    assert paired_test([1, 2, 3, 4, 5]) == (pytest.approx(0.0625), WILCOXON_EXACT)
    # Tied sizes (F1 steps): the signed-rank test's normal approximation, and it says so.
    p, test = paired_test([0.5, 0.5, 1.0, -0.5, 0.5, 1.0, 0.25, 0.5])
    assert test == WILCOXON_NORMAL and 0 < p < 1
    assert paired_test([0.0, 0.0]) == (1.0, SIGN_TEST)


# -- the run: budget, resume, refusals ---------------------------------------------------


K = 4


def _examples(n: int) -> list[Example]:
    out = []
    for q in range(n):
        passages = tuple(Passage(text=f"Note {q}.{i}: the word is w{q}x{i}.") for i in range(K))
        out.append(Example(f"q{q}", f"What is word {q}?", (f"w{q}x0",), passages, (0,), q + 1))
    return out


class Generator:
    """The generator's API: answers the word of the passage it sees first; ``fail`` maps a
    call number (1-based) to the status answered instead."""

    def __init__(self, fail: dict[int, int] | None = None) -> None:
        self.calls = 0
        self.fail = fail or {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls in self.fail:
            status = self.fail[self.calls]
            return httpx.Response(status, headers={"Retry-After": "0"}, json={"error": "no"})
        body = json.loads(request.content)
        content = body["messages"][-1]["content"]
        first = content.split("the word is ", 1)[1].split(".", 1)[0]
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": first}}],
                "usage": {"prompt_tokens": len(content) // 4, "completion_tokens": 2},
            },
        )


def _job(tmp_path: Path, **kw: Any) -> DeployedJob:
    fields: dict[str, Any] = {
        "endpoint": GeneratorEndpoint("http://generator/v1", "mine", retries=2, concurrency=2),
        "template": get_template("qa_default"),
        "examples": _examples(6),
        "data_name": "mine.jsonl",
        "targets": tuple(targets(["inverse"])),
        "out": tmp_path / "out",
        "resamples": 500,
        "progress": False,
    }
    return DeployedJob(**(fields | kw))


def _orderer(tmp_path: Path) -> InProcessOrderer:
    backend = FakeBackend({})
    return InProcessOrderer(
        Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "profiles"))
    )


async def test_answers_scores_and_reports(tmp_path: Path) -> None:
    gen = Generator()
    seen: list[Any] = []
    out = await run_deployed(
        _job(tmp_path),
        _orderer(tmp_path),
        on_estimate=seen.append,
        transport=httpx.MockTransport(gen),
    )
    (est,) = seen
    assert (est.questions, est.variants, est.todo, est.max_generator_calls) == (6, 3, 18, 18)
    # inverse puts the gold passage (index 0) last, the retriever first; the shuffle differs
    # per question. Identical orders within a question are answered once.
    records = [json.loads(x) for x in (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()]
    by = {(r["question_id"], r["variant"]): r for r in records}
    assert len(records) == 18
    assert all(by[(f"q{q}", "retriever")]["accuracy"] == 1.0 for q in range(6))
    assert all(by[(f"q{q}", "inverse")]["accuracy"] == 0.0 for q in range(6))
    assert all(by[(f"q{q}", "inverse")]["gold_slots"] == [K] for q in range(6))
    shared = sum(1 for r in records if r.get("shared"))
    assert gen.calls == 18 - shared == out.generator_calls
    report = json.loads((tmp_path / "out" / REPORT_JSON).read_text())
    acc = {v["variant"]: v["accuracy"]["mean"] for v in report["variants"]}
    assert acc["retriever"] == 1.0 and acc["inverse"] == 0.0
    assert report["verdict"].startswith(
        "On these 6 questions, `inverse` changed accuracy by -1.000"
    )
    assert "it hurts" in report["verdict"]
    assert (tmp_path / "out" / "report.md").read_text().count("| `") >= 3
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 0


async def test_the_budget_stops_and_a_rerun_continues(tmp_path: Path) -> None:
    gen = Generator()
    first = await run_deployed(
        _job(tmp_path, max_calls=5), _orderer(tmp_path), transport=httpx.MockTransport(gen)
    )
    assert first.attempts == 5 == gen.calls
    again = Generator()
    await run_deployed(_job(tmp_path), _orderer(tmp_path), transport=httpx.MockTransport(again))
    lines = (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()
    keys = [(json.loads(x)["question_id"], json.loads(x)["variant"]) for x in lines]
    assert len(keys) == len(set(keys)) == 18
    # Another generator in the same folder is refused, before any call.
    never = Generator()
    other = _job(tmp_path, endpoint=GeneratorEndpoint("http://elsewhere/v1", "theirs"))
    with pytest.raises(InvalidRequest, match="differs in generator_url, generator_model"):
        await run_deployed(other, _orderer(tmp_path), transport=httpx.MockTransport(never))
    assert never.calls == 0
    # A dry run estimates and calls nothing.
    dry = await run_deployed(
        _job(tmp_path, out=tmp_path / "dry"),
        _orderer(tmp_path),
        dry_run=True,
        transport=httpx.MockTransport(never),
    )
    assert dry.estimate.todo == 18 and never.calls == 0


async def test_a_refusal_stops_at_once_and_429_is_retried(tmp_path: Path) -> None:
    refused = Generator(fail={1: 401})
    with pytest.raises(InvalidRequest, match=r"refused the API key.*HTTP 401"):
        await run_deployed(
            _job(tmp_path, endpoint=GeneratorEndpoint("http://g/v1", "mine", concurrency=1)),
            _orderer(tmp_path),
            transport=httpx.MockTransport(refused),
        )
    assert refused.calls == 1
    busy = Generator(fail={1: 429, 3: 503})
    out = await run_deployed(
        _job(tmp_path, out=tmp_path / "busy"),
        _orderer(tmp_path),
        transport=httpx.MockTransport(busy),
    )
    assert out.attempts == busy.calls == out.generator_calls + 2


async def test_data_without_answers_is_refused_before_any_call(tmp_path: Path) -> None:
    unanswered = [*_examples(2), Example("z", "q?", (), _examples(1)[0].passages, (0,), 9)]
    never = Generator()
    with pytest.raises(InvalidRequest, match=r"mine\.jsonl:9: answers: expected at least one"):
        await run_deployed(
            _job(tmp_path, examples=unanswered),
            _orderer(tmp_path),
            transport=httpx.MockTransport(never),
        )
    assert never.calls == 0


# -- for real: vLLM's OpenAI server answers, a rag-reorder server orders -------------------


@pytest.mark.slow
async def test_against_a_real_generator_and_server(vllm_server: str, tmp_path: Path) -> None:
    from tests.app.processes import server_process

    data = tmp_path / "mine.jsonl"
    convert_litm(SAMPLE, data)
    # Each passage cut to its first 12 words (the sample's are about 100): every variant's
    # order and answer still go through the server and the generator, at a fraction of the
    # prompt tokens (vLLM's CPU server is this test's bottleneck).
    examples = [
        dataclasses.replace(
            ex,
            passages=tuple(
                dataclasses.replace(p, text=" ".join(p.text.split()[:12])) for p in ex.passages
            ),
        )
        for ex in load_examples(data, limit=2)
    ]
    env = {
        "RAG_REORDER_API_KEY": "eval-key",
        "RAG_REORDER_BIAS_PROFILE_DIR": str(tmp_path / "profiles"),
        "HF_HUB_OFFLINE": "1",
    }
    args = ["-m", "entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    job = _job(
        tmp_path,
        endpoint=GeneratorEndpoint(f"{vllm_server}/v1", SMOLLM2, retries=1, concurrency=2),
        examples=examples,
        data_name=data.name,
        targets=tuple(targets(["default", "bm25:litm", "dense:bias_matched"])),
        max_passages=3,
    )
    with server_process(args, tmp_path / "server.log", env, python=sys.executable) as server:
        server.wait_ready(180)

        def orderer(key: str | None) -> ServerOrderer:
            return ServerOrderer(
                server.base_url, api_key=key, timeout_s=300, retries=1, concurrency=2
            )

        with pytest.raises(InvalidRequest, match=r"refused the API key.*HTTP 401"):
            await run_deployed(job, orderer(None))
        out = await run_deployed(job, orderer("eval-key"))
    report = out.report
    variants = {v["variant"]: v for v in report["variants"]}
    assert set(variants) == {"default", "bm25:litm", "dense:bias_matched", "retriever", "shuffle"}
    # The cold server's default is auto on its MoI path; dense:bias_matched has no profile
    # of this generator to place by: refused, recorded, left out of the comparisons.
    assert variants["default"]["answered"] == 2 and variants["default"]["auto_paths"] == {"moi": 2}
    assert variants["default"]["model_prompts_mean"] > 0
    assert variants["dense:bias_matched"]["errors"] == 2
    assert "HTTP 422" in variants["dense:bias_matched"]["error_example"]
    assert variants["retriever"]["model_prompts_mean"] == 0
    records = [json.loads(x) for x in (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()]
    answered = [r for r in records if r.get("answer") is not None]
    assert all(isinstance(r["answer"], str) and r["generator_prompt_tokens"] > 50 for r in answered)
    assert {c["variant"] for c in report["comparisons"]} == {"default", "bm25:litm", "retriever"}
    assert report["verdict"].startswith("On these 2 questions, `default` changed accuracy by")
    assert os.path.getsize(tmp_path / "out" / "accuracy.png") > 0
    # Target is the type every variant is.
    assert all(isinstance(t, Target) for t in job.targets)


async def test_a_variant_the_orderer_refuses_is_recorded_and_asked_again(tmp_path: Path) -> None:
    # max_relevance needs a measured positional profile, which this machine has none of.
    job = _job(tmp_path, targets=tuple(targets(["max_relevance"])), examples=_examples(2))
    gen = Generator()
    out = await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(gen))
    (refused,) = [v for v in out.report["variants"] if v["variant"] == "max_relevance"]
    assert refused["answered"] == 0 and refused["errors"] == 2
    assert "positional" in refused["error_example"]
    assert {c["variant"] for c in out.report["comparisons"]} == {"retriever"}
    assert gen.calls == out.generator_calls <= 4  # the baselines' orders, none for the refused
    again = await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(gen))
    assert again.estimate.todo == 2 and again.estimate.done == 4


# -- credentials (issue 71, item 14) -----------------------------------------------------


async def test_credentials_in_the_urls_reach_no_file_and_no_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = "http://user:s3cret-pass@generator/v1?api-key=s3cret-query"
    job = _job(tmp_path, endpoint=GeneratorEndpoint(url, "mine", retries=0, concurrency=2))
    gen = Generator()
    await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(gen))
    assert gen.calls > 0
    out = tmp_path / "out"
    for name in ("deployed-run.json", REPORT_JSON, "report.md"):
        text = (out / name).read_text()
        assert "s3cret" not in text and "http://***@generator/v1?api-key=%2A%2A%2A" in text, name
    # A refusal's message names the generator without its credentials.
    refused = Generator(fail={1: 404})
    with pytest.raises(InvalidRequest) as err:
        await run_deployed(
            _job(tmp_path, out=tmp_path / "o2", endpoint=job.endpoint),
            _orderer(tmp_path),
            transport=httpx.MockTransport(refused),
        )
    assert "s3cret" not in err.value.message and "***@generator" in err.value.message
    orderer = ServerOrderer(
        "http://eval:tok3n@rag-reorder:8000", api_key=None, timeout_s=1, retries=0, concurrency=1
    )
    assert orderer.describe == "server http://***@rag-reorder:8000"
    await orderer.aclose()
    assert "s3cret" not in caplog.text and "tok3n" not in caplog.text


def test_the_default_key_goes_to_https_only() -> None:
    env = {"OPENAI_API_KEY": "sk-default", "MINE": "sk-mine"}
    assert api_key("http://vllm:8000/v1", None, env) is None
    assert api_key("https://api.openai.com/v1", None, env) == "sk-default"
    assert api_key("HTTPS://api.openai.com/v1", None, {}) is None
    # A variable the user named is sent where they point it, http included.
    assert api_key("http://vllm:8000/v1", "MINE", env) == "sk-mine"
    assert api_key("http://vllm:8000/v1", "OPENAI_API_KEY", env) == "sk-default"
    assert api_key("https://x/v1", "UNSET", env) is None


# -- resume (issue 71, item 15) ----------------------------------------------------------


def _keys(out: Path) -> list[tuple[str, str]]:
    from offline import run_folder

    return [
        (r["question_id"], r["variant"])
        for r in run_folder.records(out / ANSWERS_FILE)
        if r.get("error") is None
    ]


async def test_a_torn_last_record_is_asked_again_and_never_glues_the_next(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path, targets=tuple(targets(["inverse"])), examples=_examples(3))
    await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(Generator()))
    path = tmp_path / "out" / ANSWERS_FILE
    lines = path.read_text().splitlines()
    assert len(lines) == 9
    torn = next(i for i, x in enumerate(lines) if not json.loads(x).get("shared"))
    # Killed mid-write: the record half written, then a complete one without its newline
    # (killed between the two): the first is asked again, the second kept, nothing glued.
    complete = lines[torn + 1]
    kept = [x for i, x in enumerate(lines) if i not in (torn, torn + 1)]
    path.write_text("\n".join(kept) + "\n" + lines[torn][:40] + "\n" + complete)
    again = Generator()
    second = await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(again))
    assert second.estimate.todo == 1 and again.calls == 1
    keys = _keys(tmp_path / "out")
    assert len(keys) == len(set(keys)) == 9
    # A third run has nothing left to ask.
    third = Generator()
    last = await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(third))
    assert last.estimate.todo == 0 and third.calls == 0


async def test_a_torn_run_file_does_not_fail_the_rerun(tmp_path: Path) -> None:
    job = _job(tmp_path, examples=_examples(2))
    await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(Generator()))
    run_file = tmp_path / "out" / "deployed-run.json"
    run_file.write_text(run_file.read_text()[:25])
    again = Generator()
    out = await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(again))
    assert out.estimate.todo == 0 and again.calls == 0
    assert json.loads(run_file.read_text())["generator_model"] == "mine"


async def test_the_settings_check_holds_the_data_and_the_in_process_strategy(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path, examples=_examples(2))
    await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(Generator()))
    never = Generator()
    other = [dataclasses.replace(ex, question="Another question?") for ex in _examples(2)]
    with pytest.raises(InvalidRequest, match=r"differs in data_sha256\)"):
        await run_deployed(
            _job(tmp_path, examples=other), _orderer(tmp_path), transport=httpx.MockTransport(never)
        )
    moi = InProcessOrderer(
        Reorderer(
            FakeBackend({}),
            Settings(cache_dir=tmp_path, strategy="moi"),
            ProfileStore(tmp_path / "profiles"),
        )
    )
    with pytest.raises(InvalidRequest, match=r"differs in strategy\)"):
        await run_deployed(job, moi, transport=httpx.MockTransport(never))
    assert never.calls == 0


async def test_max_calls_is_a_hard_bound_with_retries_in_flight(tmp_path: Path) -> None:
    # Every call answered 503: two calls in flight, each retried twice, would send 6.
    busy = Generator(fail={k: 503 for k in range(1, 100)})
    job = _job(tmp_path, max_calls=3)  # 2 in flight, 2 retries each
    out = await run_deployed(job, _orderer(tmp_path), transport=httpx.MockTransport(busy))
    assert busy.calls == 3 == out.attempts and out.generator_calls == 0


# -- a slow or failing orderer (issue 78) ------------------------------------------------


async def test_reorder_faults_fail_questions_not_the_run_and_a_rerun_fills_them(
    tmp_path: Path,
) -> None:
    """A real rag-reorder server process (the fake backend, cold auto as its default) behind a
    fault proxy that answers some reorder calls 504 and 503; a fake generator answers."""
    from tests.app.processes import free_port, server_process
    from tests.support.fault_proxy import FaultProxy

    env = {"RAG_REORDER_BIAS_PROFILE_DIR": str(tmp_path / "profiles")}
    args = ["-m", "tests.app.fake_server", "--port", "{port}"]
    job = _job(tmp_path, targets=tuple(targets(None)), examples=_examples(3))
    reorder = b"POST /v1/reorder"
    with server_process(args, tmp_path / "server.log", env) as server:
        server.wait_ready(60)
        proxy = FaultProxy(int(server.base_url.rsplit(":", 1)[1]), free_port())
        try:
            proxy.set("pass")

            def orderer() -> ServerOrderer:
                return ServerOrderer(
                    f"http://127.0.0.1:{proxy.port}",
                    api_key=None,
                    timeout_s=30,
                    retries=1,
                    concurrency=2,
                    backoff_s=0.01,
                )

            # The first reorder call (a cold auto's, alone) meets 504 twice: failed after its
            # one retry; the next meets 503 and is served on its retry.
            proxy.answer_next(reorder, 504, 504, 503)
            gen = Generator()
            first = await run_deployed(job, orderer(), transport=httpx.MockTransport(gen))
            assert proxy.scripted == 3
            report = first.report
            by = {v["variant"]: v for v in report["variants"]}
            assert (by["default"]["answered"], by["default"]["failed"]) == (2, 1)
            assert by["default"]["refused"] == 0 and by["retriever"]["answered"] == 3
            assert (
                "HTTP 504: deadline_exceeded: the request did not finish in 600 s"
                in (by["default"]["failure_example"])
            )
            assert "(after 1 retries)" in by["default"]["failure_example"]
            assert report["compared_on"] == 2 and report["left_out"]["questions"] == 1
            assert report["left_out"]["why"] == {"default": {"failed": 1}}
            assert report["verdict"].startswith("On these 2 questions")
            assert report["verdict"].endswith(
                "1 of 3 questions are left out of the comparisons (`default` failed on 1): a "
                "rerun asks them again."
            )
            assert all(c["n"] == 2 for c in report["comparisons"])
            assert "one at a time until it trusts a profile" in report["orders_bound"]
            md = (tmp_path / "out" / "report.md").read_text()
            assert "| 2 (1 failed) |" in md and "`default` failed 1 times, e.g. HTTP 504" in md
            # The rerun asks the failed one again, and only it: no generator call paid twice.
            again = Generator()
            second = await run_deployed(job, orderer(), transport=httpx.MockTransport(again))
        finally:
            proxy.close()
    assert second.estimate.todo == 1 and again.calls <= 1
    by = {v["variant"]: v for v in second.report["variants"]}
    assert (by["default"]["answered"], by["default"]["failed"]) == (3, 0)
    assert second.report["compared_on"] == 3 and second.report["left_out"]["questions"] == 0
    keys = _keys(tmp_path / "out")
    assert len(keys) == len(set(keys)) == 9


async def test_the_orderer_retries_what_is_safe_and_holds_a_cold_auto_to_one_call() -> None:
    import asyncio

    from offline.evaluation.orderers import OrderFailed, OrderRefused
    from offline.evaluation.runner import prepare

    state = {"in_flight": 0, "most_cold": 0, "most_warm": 0, "served": 0}
    script: dict[str, list[Any]] = {}
    seen: dict[str, int] = {}

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/info":
            limits = {"max_concurrent_requests": 3}
            return httpx.Response(200, json={"default_strategy": "auto", "limits": limits})
        rid = request.headers["X-Request-Id"]
        seen[rid] = seen.get(rid, 0) + 1
        todo = script.get(rid)
        if todo:
            fault = todo.pop(0)
            if isinstance(fault, Exception):
                raise fault
            return httpx.Response(fault, headers={"Retry-After": "0"}, json={"error": "busy"})
        state["in_flight"] += 1
        cold = state["served"] < 3  # trusted from the fourth answer on
        key = "most_cold" if cold else "most_warm"
        state[key] = max(state[key], state["in_flight"])
        await asyncio.sleep(0.02)
        state["in_flight"] -= 1
        state["served"] += 1
        n = len(json.loads(request.content)["passages"])
        return httpx.Response(
            200,
            json={
                "order": list(range(n)),
                "strategy": "auto",
                "auto": {"path": "moi" if cold else "profile"},
                "usage": {"prompts_scored": 1, "generations": 0, "prompt_tokens": 9},
            },
        )

    orderer = ServerOrderer(
        "http://rr",
        api_key=None,
        timeout_s=5,
        retries=3,
        concurrency=4,
        transport=httpx.MockTransport(handle),
        backoff_s=0.001,
    )
    questions = [prepare(ex, None) for ex in _examples(12)]
    default = targets(None)[0]
    script["eval-q0-default"] = [httpx.RemoteProtocolError("dropped"), 503, 504]
    script["eval-q1-default"] = [502] * 4
    script["eval-q2-default"] = [500]
    script["eval-q3-default"] = [422]
    script["eval-q4-default"] = [httpx.ReadTimeout("slow")]
    got = await asyncio.gather(
        *(orderer.order(q, default) for q in questions), return_exceptions=True
    )
    await orderer.aclose()
    assert not isinstance(got[0], BaseException) and seen["eval-q0-default"] == 4
    assert isinstance(got[1], OrderFailed) and seen["eval-q1-default"] == 4
    assert "HTTP 502: busy (after 3 retries)" in str(got[1])
    assert isinstance(got[2], OrderFailed) and seen["eval-q2-default"] == 1  # not retried
    assert type(got[3]) is OrderRefused and got[3].kind == "refused"
    assert isinstance(got[4], OrderFailed) and seen["eval-q4-default"] == 1  # still running
    assert all(not isinstance(g, BaseException) for g in got[5:])
    # One at a time until auto trusted a profile, then up to what /info admits (3 of 4).
    assert state["most_cold"] == 1 and 1 < state["most_warm"] <= 3
    assert orderer.bound.startswith("at most 3 reorder calls in flight")


async def test_a_failed_generator_call_is_recorded_not_retried_and_three_in_a_row_stop(
    tmp_path: Path,
) -> None:
    from service.errors import EngineUnavailable

    one = _job(tmp_path, endpoint=GeneratorEndpoint("http://g/v1", "mine", concurrency=1))
    gen = Generator(fail={2: 504})  # may have run: never sent again in this run
    out = await run_deployed(one, _orderer(tmp_path), transport=httpx.MockTransport(gen))
    failed = [v for v in out.report["variants"] if v["failed"]]
    assert [v["failed"] for v in failed] == [1] and gen.calls == out.attempts
    assert failed[0]["failure_example"].startswith("the generator: the engine failed")
    assert out.report["left_out"]["questions"] == 1
    again = Generator()
    rerun = await run_deployed(one, _orderer(tmp_path), transport=httpx.MockTransport(again))
    assert rerun.estimate.todo == 1 and again.calls == 1 and rerun.report["compared_on"] == 6
    down = Generator(fail={2: 504, 3: 504, 4: 502})
    with pytest.raises(EngineUnavailable):
        await run_deployed(
            _job(tmp_path, out=tmp_path / "down", endpoint=one.endpoint),
            _orderer(tmp_path),
            transport=httpx.MockTransport(down),
        )
    assert down.calls == 4


async def test_without_info_the_gate_holds_until_the_default_shows_it_is_not_auto() -> None:
    import asyncio

    from offline.evaluation.runner import prepare

    state = {"in_flight": 0, "most": 0, "served": 0}

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/info":
            return httpx.Response(404, json={"error": "no"})
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        await asyncio.sleep(0.02)
        state["in_flight"] -= 1
        state["served"] += 1
        usage = {"prompts_scored": 0, "generations": 0, "prompt_tokens": 0}
        return httpx.Response(200, json={"order": [0, 1, 2, 3], "strategy": "bm25", "usage": usage})

    orderer = ServerOrderer(
        "http://rr",
        api_key=None,
        timeout_s=5,
        retries=0,
        concurrency=4,
        transport=httpx.MockTransport(handle),
    )
    questions = [prepare(ex, None) for ex in _examples(9)]
    default = targets(None)[0]
    await orderer.order(questions[0], default)  # alone: a cold auto, as far as it knows
    assert state["most"] == 1
    await asyncio.gather(*(orderer.order(q, default) for q in questions[1:]))
    await orderer.aclose()
    assert state["served"] == 9 and state["most"] == 4
