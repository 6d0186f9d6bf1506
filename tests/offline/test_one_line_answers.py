"""A completion template's answer is one line: generation stops at the first line break.

A base model prompted with ``qa_completion`` answers on the line after ``Answer:`` and then
runs on (a blank line, the documents again, the next "Question:") until ``max_new_tokens``.
The answer metrics read the first line only, so the rest cost decode steps and, in ``lore``
and ``self_consistency``, made votes compare run-on text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from offline.evaluation.metrics import score_answer
from service.backends.base import Generation, GenerationRequest
from service.backends.engines.transformers_backend import TransformersBackend
from service.backends.fakes.fake import FakeBackend
from service.backends.tokenizers.byte_tokenizer import END_OF_TURN_ID, ByteTokenizer
from service.backends.tokenizers.hf_tokenizer import HFPromptTokenizer
from service.config.settings import Settings
from service.passage import Passage
from service.prompting.answers import first_line
from service.state.profile_store import ProfileStore
from service.strategies.work import Work, _answer
from tests.support.committed import COMMITTED, committed_lines
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]

PASSAGES = [
    Passage(text="Paris is the capital and largest city of France.", title="Paris"),
    Passage(text="Berlin is the capital of Germany.", title="Berlin"),
]
QUERY = "what is the capital of france"


def _work(backend: FakeBackend | TransformersBackend, template: str, tmp_path: Path) -> Work:
    return Work(backend, Settings(cache_dir=tmp_path), "r", template, ProfileStore(tmp_path))


def test_answer_drops_the_stop_token_and_cuts_a_line_break_answer_at_its_newline() -> None:
    # Ids are characters here: 10 is "\n", 11 a token that decodes to ".\n", 99 end of turn.
    table = {10: "\n", 11: ".\n", 99: "<eot>"} | {i: chr(i) for i in range(97, 123)}

    def decode(ids: object) -> str:
        assert isinstance(ids, list)
        return "".join(table[i] for i in ids)

    def gen(ids: list[int], reason: str = "stop") -> Generation:
        return Generation("g", tuple(ids), tuple(-0.1 * (k + 1) for k in range(len(ids))), reason)

    eos, breaks = frozenset({99}), frozenset({10, 11})
    ab = [ord("a"), ord("b")]
    # A line break ends it: not part of the text or the probability.
    one = _answer(gen([*ab, 10]), eos, breaks, decode)
    assert (one.text, one.token_ids, one.logprobs) == ("ab", tuple(ab), (-0.1, -0.2))
    # A line-break token with text before its newline keeps that text.
    dot = _answer(gen([*ab, 11]), eos, breaks, decode)
    assert (dot.text, dot.token_ids) == ("ab.", tuple(ab))
    # End of turn as before; newlines inside a chat answer stay (no line-break stops given).
    chat = _answer(gen([*ab, 10, *ab, 99]), eos, frozenset(), decode)
    assert (chat.text, len(chat.token_ids)) == ("ab\nab", 5)
    # Cut at max_new_tokens: nothing to drop.
    assert _answer(gen(ab, "length"), eos, breaks, decode).token_ids == tuple(ab)


def test_byte_tokenizer_line_break_is_the_newline_byte() -> None:
    tok = ByteTokenizer()
    assert tok.line_break_ids == frozenset(tok.encode("\n").ids) == {10}


def test_hf_line_break_ids_are_every_id_whose_text_has_a_newline(smollm2_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = HFPromptTokenizer(hf).line_break_ids
    assert all("\n" in hf.decode([i]) for i in ids)
    # byte-level BPE: "\n" is "Ċ", "\n\n" "ĊĊ"; both single tokens, both found by decoding.
    for text in ("\n", "\n\n", "\n   "):
        (one,) = hf(text, add_special_tokens=False)["input_ids"]
        assert one in ids
    others = [i for i in range(len(hf)) if i not in ids][:2000]
    assert not any("\n" in hf.decode([i]) for i in others)


async def test_completion_answer_stops_at_the_first_line_chat_answer_does_not(
    tmp_path: Path,
) -> None:
    run_on = "Paris\nQuestion: what is the capital of germany"
    truth = {p.text: 1.0 - k for k, p in enumerate(PASSAGES)}
    backend = FakeBackend(truth, answers={PASSAGES[0].text: run_on})
    for template, text, tokens in (
        ("qa_completion", "Paris", len("Paris\n")),
        ("qa_default", run_on, len(run_on) + 1),  # + the end-of-turn token
    ):
        work = _work(backend, template, tmp_path)
        prompts = await work.generation_prompts(QUERY, PASSAGES, [[0, 1]])
        (answer,) = await work.generate(prompts, max_new_tokens=64)
        assert answer is not None
        assert (answer.text, answer.finish_reason) == (text, "stop")
        assert work.usage().generated_tokens == tokens  # the stop token was generated
        assert END_OF_TURN_ID not in answer.token_ids and 10 not in answer.token_ids[-1:]
        assert math.isclose(answer.mean_probability, 1 / (1 + math.exp(-1.0)))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> TransformersBackend:
    return TransformersBackend.load(smollm2_dir, model_id="smollm2", device="cpu")


async def test_real_model_one_line_answer_is_the_first_line_of_the_run_on(
    smollm2: TransformersBackend, tmp_path: Path
) -> None:
    work = _work(smollm2, "qa_completion", tmp_path)
    prompts = await work.generation_prompts(QUERY, PASSAGES, [[0, 1], [1, 0]])
    run_on = await smollm2.generate(
        [GenerationRequest(f"r{k}", p.token_ids, 32) for k, p in enumerate(prompts)]
    )
    answers = await work.generate(prompts, max_new_tokens=32)
    for full, answer in zip(run_on, answers, strict=True):
        assert isinstance(full, Generation) and answer is not None
        text = smollm2.tokenizer.decode(full.token_ids)
        assert "\n" in text  # SmolLM2 runs on past the answer line
        assert answer.text == first_line(text).strip() == "Paris is the capital of France."
        # Greedy: the same tokens up to the line break, then it stops.
        n = len(answer.token_ids)
        assert answer.token_ids == full.token_ids[:n]
        assert full.token_ids[n] in smollm2.tokenizer.line_break_ids
        assert n + 1 < len(full.token_ids)
    # 2 answers of 7 tokens and a line break each, instead of 32 and 31 tokens.
    assert work.usage().generated_tokens == 2 * 8


def _record(generator: str, answer: str, golds: tuple[str, ...], **extra: object) -> dict:
    key = {
        "question_id": "q1",
        "variant": "shuffle",
        "scorer": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "generator": generator,
        "template": "qa_default",
        "generator_template": None,
    }
    return {
        "key": key,
        "kind": "strategy",
        "answer": answer,
        **score_answer(answer, golds).as_dict(),
        **extra,
    }


def test_one_line_migration_rewrites_completion_generators_only(tmp_path: Path) -> None:
    migration = load_script(ROOT / "eval" / "one_line_answers.py", "one_line_answers")
    golds = {"q1": ("Paris",)}
    run_on = "Paris\nQuestion: what is the capital of germany\nAnswer: Berlin"
    gemma = _record("google/gemma-3-270m", run_on, golds["q1"], cost={"generated_tokens": 32})
    chat = _record("HuggingFaceTB/SmolLM2-135M-Instruct", run_on, golds["q1"])
    positional = {"key": {"question_id": "q1", "variant": "positional"}, "kind": "positional"}
    # ROUGE-L of the run-on against "Paris": LCS 1 of 10 prediction tokens and 1 reference.
    assert math.isclose(gemma["rouge_l"], 2 * (1 / 10) * 1 / (1 / 10 + 1))
    cache = tmp_path / "cache.jsonl"
    lines = [json.dumps(r) for r in (gemma, chat, positional)]
    cache.write_text("".join(line + "\n" for line in lines))

    assert migration.migrate(tmp_path, golds) == (1, 3)
    first = json.loads(cache.read_text().splitlines()[0])
    assert first["answer"] == "Paris" and first["rouge_l"] == 1.0
    assert (first["accuracy"], first["em"], first["f1"]) == (1.0, 1.0, 1.0)  # as before
    assert first["cost"] == {"generated_tokens": 32}  # what it really cost stays
    assert cache.read_text().splitlines()[1:] == lines[1:]  # chat and positional untouched
    before = cache.read_text()
    assert migration.migrate(tmp_path, golds) == (0, 3)  # idempotent
    assert cache.read_text() == before


def test_one_line_migration_refuses_a_record_whose_first_line_metric_would_change(
    tmp_path: Path,
) -> None:
    migration = load_script(ROOT / "eval" / "one_line_answers.py", "one_line_answers")
    # Stored accuracy 1.0 for an answer whose first line does not contain the gold answer:
    # not a record this generator wrote, so the migration stops instead of "fixing" it.
    bad = _record("google/gemma-3-270m", "Berlin\nParis", ("Paris",))
    bad["accuracy"] = 1.0
    (tmp_path / "cache.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"accuracy would change from 1\.0 to 0\.0"):
        migration.migrate(tmp_path, {"q1": ("Paris",)})


@pytest.mark.parametrize("folder", COMMITTED)
def test_every_committed_answer_of_a_completion_generator_is_one_line(folder: str) -> None:
    migration = load_script(ROOT / "eval" / "one_line_answers.py", "one_line_answers")
    lines = committed_lines(folder)
    for line in lines:
        record = json.loads(line)
        key = record.get("key", {})
        if record.get("kind") != "strategy" or record.get("answer") is None:
            continue
        if migration.is_completion(key["generator"], key.get("generator_template")):
            assert record["answer"] == first_line(record["answer"]).strip(), key
