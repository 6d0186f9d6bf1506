"""``rag-reorder eval`` on the fake backend: metrics, statistics, records, resume, report files.

Expected numbers come from the fake's documented rules (``FakeBackend.expected_score``) and
from hand computation, never from re-running the code under test.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from offline.evaluation import EvalConfig, all_variants, run_evaluation, select_variants
from offline.evaluation.metrics import gold_ranks, rouge_l, score_answer
from offline.evaluation.records import CACHE_FILE, AnyRecord, PositionalRecord, Record
from offline.evaluation.report import build_summary, markdown
from offline.evaluation.runner import prepare
from offline.evaluation.stats import (
    bootstrap_mean_band,
    bootstrap_mean_ci,
    paired_comparison,
    wilcoxon_p,
)
from service.backends.base import GenerateResult, GenerationRequest
from service.backends.fakes.fake import FakeBackend
from service.backends.tokenizers.byte_tokenizer import ByteTokenizer
from service.batch.dataset import Example, load_examples
from service.config.settings import Settings
from service.errors import InvalidRequest
from service.passage import Passage
from service.pipeline import Reorderer
from service.prompting.prompts import build_generation_prompt
from service.state.profile_store import ProfileStore

K = 5  # passages per question
QUESTIONS = 3
FAST = (
    "retriever",
    "shuffle",
    "inverse",
    "moi:pruned_random",
    "moi:cyclic",
    "moi:adaptive:bias_matched",
    "max_relevance",
)


# --- metrics --------------------------------------------------------------------------------


def test_answer_metrics_by_hand() -> None:
    s = score_answer("The Eiffel Tower.\nIt is in Paris, built in 1889.", ["Eiffel Tower"])
    assert s.accuracy == 1.0  # substring of the normalised first line
    assert s.em == 1.0  # first line "the eiffel tower." normalises to "eiffel tower"
    assert s.f1 == 1.0
    s = score_answer("big red apple", ["red apple pie", "pear"])
    assert s.accuracy == 0.0 and s.em == 0.0
    assert s.f1 == pytest.approx(2 / 3)  # 2 common tokens: P = R = 2/3
    # ROUGE-L: LCS("the cat sat", "cat sat on mat") = 2; P = 2/3, R = 2/4 -> F = 4/7.
    assert rouge_l("the cat sat", ["cat sat on mat"]) == pytest.approx(4 / 7)
    assert rouge_l("the cat sat", ["dog", "cat sat on mat"]) == pytest.approx(4 / 7)
    assert rouge_l("anything", []) == 0.0


def test_gold_ranks_are_one_based_best_and_mean() -> None:
    assert gold_ranks([2, 0, 1], [0, 1]) == (2, 2.5)
    assert gold_ranks([2, 0, 1], [2]) == (1, 1.0)
    assert gold_ranks([0, 1], []) == (None, None)


def test_prepare_keeps_gold_at_its_scaled_slot_and_strips_labels() -> None:
    passages = tuple(Passage(text=f"p{i}", title=f"t{i}", id=f"id{i}") for i in range(20))
    q = prepare(Example("q", "question?", ("a",), passages, (13,)), 10)
    # floor(13 * 10 / 20) = 6; the first nine others fill the rest in retriever order.
    assert [p.text for p in q.passages] == [f"p{i}" for i in (0, 1, 2, 3, 4, 5, 13, 6, 7, 8)]
    assert q.gold == (6,)
    assert all(p.id is None and p.score is None for p in q.passages)
    # Two golds that scale onto one slot are kept distinct and in order.
    q2 = prepare(Example("h", "q?", ("a",), passages[:10], (8, 9)), 4)
    assert q2.gold == (2, 3)
    assert [p.text for p in q2.passages] == ["p0", "p1", "p8", "p9"]
    # No cut: everything as given, labels still off the passages.
    q3 = prepare(Example("q", "q?", ("a",), passages[:3], (1,)), None)
    assert q3.gold == (1,) and [p.id for p in q3.passages] == [None] * 3


def test_variants_cover_every_strategy_and_moi_design_placement() -> None:
    labels = [v.label for v in all_variants()]
    assert "moi:pruned_random:bias_matched" in labels and "moi:cyclic:descending_utility" in labels
    assert {"retriever", "shuffle", "max_relevance", "self_consistency"} <= set(labels)
    chosen = [v.label for v in select_variants(["moi:hybrid", "shuffle"])]
    assert chosen == ["moi:hybrid:descending_utility", "moi:hybrid:bias_matched", "shuffle"]
    with pytest.raises(Exception, match="unknown strategy or variant"):
        select_variants(["nope"])
    # The cheap rankers: alone, after lost-in-the-middle, and by the generator's bias.
    assert [v.label for v in select_variants(["bm25"])] == [
        "bm25",
        "bm25:litm",
        "bm25:bias_matched",
    ]
    placed = select_variants(["query_generation:bias_matched", "dense:litm"])
    assert [(v.strategy, v.placement) for v in placed] == [
        ("query_generation", "bias_matched"),
        ("dense", "litm"),
    ]
    # A ranker's own order alone, without its placed variants.
    alone = select_variants(["query_generation:descending_utility", "moi:random"])
    assert [v.label for v in alone] == [
        "query_generation",
        "moi:random:descending_utility",
        "moi:random:bias_matched",
    ]
    assert alone[0].placement is None
    with pytest.raises(Exception, match="unknown strategy or variant"):
        select_variants(["shuffle:descending_utility"])


# --- statistics -----------------------------------------------------------------------------


def test_bootstrap_interval_known_cases() -> None:
    c = bootstrap_mean_ci([0.25] * 7)
    assert (c.mean, c.low, c.high) == (0.25, 0.25, 0.25)
    # Resampled mean of [0, 0, 0, 1] is Binomial(4, 1/4) / 4: P(0) = 0.316 > 2.5%, so the
    # low end is 0; P(X >= 3) = 0.051 > 2.5% > P(X = 4) = 0.004, so the high end is 3/4.
    c = bootstrap_mean_ci([0.0, 0.0, 0.0, 1.0], resamples=10_000, seed=3)
    assert c.mean == 0.25 and c.low == 0.0 and c.high == 0.75
    assert bootstrap_mean_ci([1.0, 2.0, 5.0], seed=1) == bootstrap_mean_ci([1.0, 2.0, 5.0], seed=1)
    assert math.isnan(bootstrap_mean_ci([]).mean)
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_mean_ci([1.0, math.nan])
    mean, low, high = bootstrap_mean_band(np.array([[1.0, 0.0], [1.0, 2.0]]), seed=0)
    assert list(mean) == [1.0, 1.0] and list(low) == [1.0, 0.0] and list(high) == [1.0, 2.0]


def test_wilcoxon_p_hand_cases() -> None:
    # Exact null distribution of W+ over 2^5 sign patterns: P(W+ = 15) = 1/32, two-sided 2/32.
    assert wilcoxon_p([1, 2, 3, 4, 5]) == pytest.approx(0.0625)
    # One negative difference of rank 1: P(W- <= 1) = 2/32, two-sided 4/32.
    assert wilcoxon_p([-1, 2, 3, 4, 5]) == pytest.approx(0.125)
    assert wilcoxon_p([0.0, 0.0, 0.0]) == 1.0  # documented: no non-zero difference
    assert wilcoxon_p([]) == 1.0
    comp = paired_comparison("accuracy", "v", "b", [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0)])
    assert (comp.n, comp.wins, comp.losses) == (3, 1, 1) and comp.mean_diff == 0.0


# --- the runner on the fake backend ---------------------------------------------------------


def _world(tmp_path: Path) -> tuple[Path, dict[str, float], dict[str, str]]:
    rng = np.random.default_rng(0)
    truth: dict[str, float] = {}
    answers: dict[str, str] = {}
    lines = []
    for k in range(QUESTIONS):
        gold = (k * 2 + 1) % K
        passages = []
        for i in range(K):
            text = f"question {k} passage {i} on topic {i * 7}"
            truth[text] = 3.0 if i == gold else float(rng.uniform(-1, 1))
            if i == gold:
                answers[text] = f"answer {k}"
            passages.append(
                {"id": f"{k}-{i}", "title": f"T{i}", "text": text, "is_gold": i == gold}
            )
        rec = {"id": f"q{k}", "question": f"what is {k}?", "answers": [f"answer {k}", "alt"]}
        lines.append(json.dumps({**rec, "gold_position": gold, "passages": passages}))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data, truth, answers


def _setup(tmp_path: Path, **settings: object) -> tuple[list[Example], FakeBackend, Reorderer]:
    data, truth, answers = _world(tmp_path)
    backend = FakeBackend(truth, answers=answers)
    reorderer = Reorderer(
        backend, Settings(cache_dir=tmp_path, **settings), ProfileStore(tmp_path / "profiles")
    )
    return load_examples(data), backend, reorderer


def _config(tmp_path: Path, **kw: object) -> EvalConfig:
    base: dict[str, object] = {
        "out_dir": tmp_path / "out",
        "variants": tuple(select_variants(FAST)),
        "resamples": 500,
        "progress": False,
        "positional_limit": 2,
    }
    base.update(kw)
    return EvalConfig(**base)  # type: ignore[arg-type]


def _per_token(backend: FakeBackend, texts: list[str], continuation: str) -> float:
    n = len(ByteTokenizer().encode(continuation).ids)
    return backend.expected_score(texts, n) / n


async def test_records_measure_order_answer_likelihood_rank_and_cost(tmp_path: Path) -> None:
    examples, backend, reorderer = _setup(tmp_path)
    out = await run_evaluation(examples, reorderer, _config(tmp_path))
    recs = {(r.question_id, r.variant): r for r in out.records}
    assert len(out.records) == QUESTIONS * len(select_variants(FAST))
    for ex in examples:
        texts = [p.text for p in ex.passages]
        r = recs[(ex.id, "retriever")]
        assert r.status == "ok" and r.order == tuple(range(K))
        assert r.gold_rank_best == r.gold_rank_mean == ex.gold[0] + 1
        # The fake answers with the best passage's answer: the gold one.
        assert r.answer == ex.answers[0] and r.accuracy == r.em == r.f1 == r.rouge_l == 1.0
        assert r.gold_tokens == len(ex.answers[0])  # one byte, one token
        assert r.gold_logprob_per_token == pytest.approx(_per_token(backend, texts, ex.answers[0]))
        assert r.cost is not None and r.cost.prompts == r.cost.scored_tokens == 0
        inv = recs[(ex.id, "inverse")]
        assert inv.order == tuple(reversed(range(K))) and inv.gold_rank_best == K - ex.gold[0]
        moi = recs[(ex.id, "moi:pruned_random:descending_utility")]
        assert moi.order is not None and moi.order[0] == ex.gold[0]  # the best passage leads
        assert moi.cost is not None and moi.cost.prompts_scored == 2 * K
        assert moi.cost.scored_tokens > 0 and moi.cost.wall_s > 0
        assert moi.position_bias is not None and len(moi.position_bias) == math.ceil(K / 2)
        bm = recs[(ex.id, "moi:pruned_random:bias_matched")]
        assert bm.cost == moi.cost  # one MoI run per design, both placements applied to it
        assert moi.ranking is not None and moi.ranking[0] == ex.gold[0] and moi.adaptive is None
        ad = recs[(ex.id, "moi:adaptive:bias_matched")]
        # Five passages and no profile: too few to adapt, the default design in one round.
        assert ad.adaptive is not None and ad.adaptive["stopped"] == "small_request"
        assert ad.cost is not None and ad.cost.prompts_scored == ad.adaptive["prompts"] == 2 * K
        for label in ("moi:cyclic:descending_utility", "max_relevance"):
            assert recs[(ex.id, label)].status == "skipped"
            assert "profile" in (recs[(ex.id, label)].error or "")
    # Skipped variants cost nothing and are not cached; the others are, once each.
    cached = (tmp_path / "out" / CACHE_FILE).read_text().splitlines()
    ok = [r for r in out.records if r.status == "ok"]
    assert len(cached) == len(ok) + len(out.positional)


async def test_positional_runs_rotate_the_gold_passage(tmp_path: Path) -> None:
    examples, backend, reorderer = _setup(tmp_path)
    out = await run_evaluation(
        examples, reorderer, _config(tmp_path, variants=tuple(select_variants(["retriever"])))
    )
    assert len(out.positional) == 2  # positional_limit
    for rec in out.positional:
        ex = next(e for e in examples if e.id == rec.question_id)
        gold = ex.gold[0]
        rest = [i for i in range(K) if i != gold]
        assert rec.status == "ok" and [s.slot for s in rec.slots] == list(range(1, K + 1))
        for s in rec.slots:
            order = [*rest[: s.slot - 1], gold, *rest[s.slot - 1 :]]
            texts = [ex.passages[i].text for i in order]
            assert s.accuracy == 1.0
            assert s.gold_logprob_per_token == pytest.approx(
                _per_token(backend, texts, ex.answers[0])
            )
            assert s.question_logprob_per_token == pytest.approx(
                _per_token(backend, texts, ex.question)
            )
        # Primacy bias: the gold passage is worth most in the first slot.
        lls = [s.gold_logprob_per_token for s in rec.slots]
        assert lls == sorted(lls, key=lambda v: -(v or 0.0))


async def test_client_error_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    # MoI's 2N = 10 prompts are over this limit: LimitExceeded, a client error.
    examples, _, reorderer = _setup(tmp_path, max_prompts_per_request=5)
    out = await run_evaluation(
        examples,
        reorderer,
        _config(tmp_path, variants=tuple(select_variants(["moi:pruned_random", "retriever"]))),
    )
    for r in out.records:
        if r.strategy == "moi":
            assert r.status == "error" and r.error_code == "limit_exceeded" and r.answer is None
        else:
            assert r.status == "ok"
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "3 error(s): design.num_prompts is 10, over the limit of 5" in text


async def test_separate_generator_answers_and_scorer_orders(tmp_path: Path) -> None:
    examples, scorer_backend, scorer = _setup(tmp_path)
    gen_backend = FakeBackend(scorer_backend.truth, answers={}, model_id="fake/generator")
    generator = Reorderer(gen_backend, Settings(cache_dir=tmp_path))
    out = await run_evaluation(
        examples,
        scorer,
        _config(tmp_path, variants=tuple(select_variants(["moi:pruned_random"]))),
        generator=generator,
    )
    assert scorer_backend.stats.generate_calls == 0
    # One generator batch per question for its strategies, one per positional question.
    assert gen_backend.stats.generate_calls == QUESTIONS + 2
    r = out.records[0]
    assert r.key.scorer == "fake/known-truth" and r.key.generator == "fake/generator"
    # This generator has no answer table: it answers with the gold passage's first 3 words.
    assert r.answer == "question 0 passage" and r.accuracy == 0.0
    assert r.generator_cost is not None and r.generator_cost.generations == 1
    assert r.generator_cost.scored_tokens == r.gold_tokens == len("answer 0")


async def test_the_generator_prefills_each_order_once_with_its_gold_answer(
    tmp_path: Path,
) -> None:
    # The answer and the gold answer's log-probs come from one generation call per order (the
    # gold answer teacher-forced after the prompt), and the generator cost says so: one prompt
    # of the prompt's tokens plus the gold answer's, not two forwards of the prompt.
    examples, scorer_backend, scorer = _setup(tmp_path)
    gen_backend = FakeBackend(scorer_backend.truth, answers={}, model_id="fake/generator")
    generator = Reorderer(gen_backend, Settings(cache_dir=tmp_path))
    config = _config(tmp_path, variants=tuple(select_variants(["retriever", "inverse"])))
    out = await run_evaluation(examples, scorer, config, generator=generator)
    # No scoring call on the generator, the positional runs' included: one batch per
    # question for its two orders, one per positional question for its K rotations.
    assert gen_backend.stats.score_calls == 0
    assert gen_backend.stats.generate_calls == QUESTIONS + 2
    assert gen_backend.stats.prompts_scored == QUESTIONS * 2 + 2 * K
    tok = ByteTokenizer()
    for r in out.records:
        ex = next(e for e in examples if e.id == r.question_id)
        assert r.order is not None and r.generator_cost is not None
        prompt = build_generation_prompt(
            tok, "qa_default", ex.question, prepare(ex, None).passages, r.order
        )
        gold = len(tok.encode(ex.answers[0]).ids)
        assert r.gold_tokens == gold
        assert r.gold_logprob_per_token == pytest.approx(
            _per_token(gen_backend, [ex.passages[i].text for i in r.order], ex.answers[0])
        )
        cost = r.generator_cost
        assert (cost.prompts, cost.prompts_scored, cost.generations) == (1, 1, 1)
        assert cost.prompt_tokens == len(prompt.token_ids) + gold
        assert cost.scored_tokens == gold


async def test_a_failed_generation_is_not_cached_and_runs_again(tmp_path: Path) -> None:
    # A generator forward that fails on its own (out of memory on a crowded GPU) must not
    # become a finished record: the next run computes it again.
    examples, scorer_backend, scorer = _setup(tmp_path)
    gen_backend = FakeBackend(scorer_backend.truth, answers={}, model_id="fake/generator")
    generator = Reorderer(gen_backend, Settings(cache_dir=tmp_path))
    config = _config(tmp_path, variants=tuple(select_variants(["retriever"])), positional=False)
    gen_backend.fail_rule = lambda prompt: True
    failed = await run_evaluation(examples, scorer, config, generator=generator)
    assert [r.generator_error for r in failed.records] == ["generation failed"] * QUESTIONS
    assert all(r.retryable and r.accuracy is None for r in failed.records)
    assert (
        not (tmp_path / "out" / CACHE_FILE).exists()
        or not (tmp_path / "out" / CACHE_FILE).read_text()
    )

    # Generation works, the gold answer's scoring fails (a non-finite log-prob in the gold
    # answer's row, the answer's own fine): also incomplete, also not kept.
    calls = 0

    def after_the_first(prompt: object) -> bool:
        nonlocal calls
        calls += 1
        return calls > 1  # the fake checks the answer's prompt, then the gold answer's

    gen_backend.fail_rule = None
    gen_backend.nan_rule = after_the_first
    config1 = _config(tmp_path, variants=tuple(select_variants(["retriever"])), positional=False)
    partial = await run_evaluation(examples[:1], scorer, config1, generator=generator)
    assert partial.records[0].answer is not None
    assert partial.records[0].generator_error == "gold answer scoring failed"
    assert partial.records[0].gold_logprob is None and partial.records[0].retryable
    gen_backend.nan_rule = None

    # The gold answer is scored from the answer's own prefill: when the backend fails that
    # scoring, the prompt fails whole, a failed generation (retried like the others).
    calls = 0
    gen_backend.fail_rule = after_the_first
    whole = await run_evaluation(examples[:1], scorer, config1, generator=generator)
    assert whole.records[0].answer is None and whole.records[0].gold_logprob is None
    assert whole.records[0].generator_error == "generation failed" and whole.records[0].retryable

    gen_backend.fail_rule = None
    fixed = await run_evaluation(examples, scorer, config, generator=generator)
    assert all(r.generator_error is None and r.gold_logprob is not None for r in fixed.records)
    cached = (tmp_path / "out" / CACHE_FILE).read_text().splitlines()
    assert len(cached) == QUESTIONS

    # A cache written before this rule (a failed record stored as finished) is recomputed.
    stale = json.loads(cached[0])
    stale.update(generator_error="generation failed", answer=None, accuracy=None)
    (tmp_path / "out" / CACHE_FILE).write_text(json.dumps(stale) + "\n" + "\n".join(cached[1:]))
    before = gen_backend.stats.generate_calls
    again = await run_evaluation(examples, scorer, config, generator=generator)
    assert gen_backend.stats.generate_calls == before + 1  # only the stale question
    assert again.records[0].generator_error is None and again.records[0].answer is not None


async def test_a_base_generator_answers_from_its_own_template(tmp_path: Path) -> None:
    # A generator whose model has no chat template (Gemma): its settings name qa_completion,
    # the scorer keeps qa_default, and the cache key records the difference.
    examples, scorer_backend, scorer = _setup(tmp_path)
    gen_backend = FakeBackend(scorer_backend.truth, answers={}, model_id="fake/base-generator")
    seen: list[str] = []
    generate = gen_backend.generate

    async def recording(requests: Sequence[GenerationRequest]) -> list[GenerateResult]:
        seen.extend(gen_backend.tokenizer.decode(r.token_ids) for r in requests)
        return await generate(requests)

    gen_backend.generate = recording  # type: ignore[method-assign]
    generator = Reorderer(gen_backend, Settings(cache_dir=tmp_path, chat_template="qa_completion"))
    out = await run_evaluation(
        examples,
        scorer,
        _config(tmp_path, variants=tuple(select_variants(["retriever"])), positional=False),
        generator=generator,
    )
    assert seen and all(t.startswith("<|bos|>Answer the question") for t in seen)
    assert all(t.endswith("\nAnswer:\n") and "<|assistant|>" not in t for t in seen)
    assert {r.key.template for r in out.records} == {"qa_default"}
    assert {r.key.generator_template for r in out.records} == {"qa_completion"}
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "templates `qa_default` (scorer) and `qa_completion` (generator)" in summary
    assert all(r.status == "ok" for r in out.records)
    # One model for both: one template, and the key keeps its old form (no generator_template).
    same = await run_evaluation(
        examples,
        scorer,
        _config(tmp_path / "same", variants=tuple(select_variants(["retriever"]))),
    )
    assert {r.key.generator_template for r in same.records} == {None}


async def test_a_scorer_for_another_generator_places_by_the_generators_profile(
    tmp_path: Path,
) -> None:
    # SmolLM2 scoring for Gemma, in small: the scorer's utilities, the generator's bias.
    examples, scorer_backend, scorer = _setup(tmp_path)
    gen_backend = FakeBackend(scorer_backend.truth, answers={}, model_id="fake/base-generator")
    generator = Reorderer(gen_backend, Settings(cache_dir=tmp_path, chat_template="qa_completion"))
    chosen = ("moi:pruned_random", "bm25")
    variants = tuple(select_variants(chosen, cross_model=True))
    assert [v.label for v in variants] == [
        "moi:pruned_random:descending_utility",
        "moi:pruned_random:bias_matched",
        "moi:pruned_random:generator_bias",
        "bm25",
        "bm25:litm",
        "bm25:bias_matched",
    ]
    with pytest.raises(Exception, match="needs a generator other than the scorer"):
        select_variants(["moi:pruned_random:generator_bias"])
    profile = {
        "identification": "up_to_scale",
        "runs": 1,
        "prompts": 1,
        "r2": 1.0,
        "source": "test",
        "oriented_by": "profile",
    }
    # Stored for the scorer, and for the generator under the *scorer's* template: neither is
    # the generator's bias, so the variants that need it are skipped, not placed by them.
    scorer.profiles.put(
        model="fake/known-truth", template="qa_default", coefficients=[0.2] * K, **profile
    )
    scorer.profiles.put(
        model="fake/base-generator", template="qa_default", coefficients=[0.2] * K, **profile
    )
    config = _config(tmp_path, variants=variants, positional=False)
    out = await run_evaluation(examples, scorer, config, generator=generator)
    by = {(r.key.question_id, r.variant): r for r in out.records}
    skipped = [r for r in out.records if r.status == "skipped"]
    assert {r.variant for r in skipped} == {
        "moi:pruned_random:generator_bias",
        "bm25:bias_matched",
    }
    assert all(
        "no bias profile stored for generator 'fake/base-generator', template "
        "'qa_completion'" in (r.error or "")
        for r in skipped
    )
    assert all(r.status == "ok" for r in out.records if r not in skipped)
    # The generator's profile under its own template: recency, strictly rising towards the
    # question, so the k-th best passage takes the k-th slot from the end: each order is its
    # ranking reversed (MoI: the fit's ranking, its descending_utility order; BM25: its own).
    rising = [0.1, 0.15, 0.2, 0.25, 0.3]
    scorer.profiles.put(
        model="fake/base-generator", template="qa_completion", coefficients=rising, **profile
    )
    again = await run_evaluation(examples, scorer, config, generator=generator)
    assert all(r.status == "ok" for r in again.records)
    for r in again.records:
        if r.variant == "moi:pruned_random:generator_bias":
            ranking = by[(r.key.question_id, "moi:pruned_random:descending_utility")].order
        elif r.variant == "bm25:bias_matched":
            ranking = by[(r.key.question_id, "bm25")].order
        else:
            assert r.order == by[(r.key.question_id, r.variant)].order  # from the cache
            continue
        assert ranking is not None and r.order == tuple(reversed(ranking))
    # That run found the fit's own placements cached, so the MoI variant ran alone with the
    # profile in its request; a fresh run places all three from one fit, the same orders.
    fresh = await run_evaluation(
        examples,
        scorer,
        _config(tmp_path, out_dir=tmp_path / "fresh", variants=variants, positional=False),
        generator=generator,
    )
    assert [r.order for r in fresh.records] == [r.order for r in again.records]
    # The report pairs it against both placements of the fit's own bias.
    summary = (tmp_path / "fresh" / "summary.md").read_text()
    section = summary.split("## MoI placed by the generator's bias")[1].split("\n## ")[0]
    assert f"| pruned_random against `descending_utility` | {QUESTIONS} | " in section
    assert f"| pruned_random against `bias_matched` | {QUESTIONS} | " in section


async def test_interrupted_run_resumes_from_the_cache(tmp_path: Path) -> None:
    examples, backend, reorderer = _setup(tmp_path)
    config = _config(tmp_path, positional_limit=1)
    seen: list[AnyRecord] = []

    def crash_after_four(rec: AnyRecord) -> None:
        seen.append(rec)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await run_evaluation(examples, reorderer, config, on_record=crash_after_four)
    assert len((tmp_path / "out" / CACHE_FILE).read_text().splitlines()) == 4
    assert not (tmp_path / "out" / "results.json").exists()
    # A torn last line (killed mid-write) is ignored and recomputed.
    with (tmp_path / "out" / CACHE_FILE).open("a") as fh:
        fh.write('{"kind": "strategy", "key": {"question_')

    new: list[AnyRecord] = []
    resumed = await run_evaluation(examples, reorderer, config, on_record=new.append)
    first_keys = {r.key for r in seen}
    assert not first_keys & {r.key for r in new}  # nothing finished is recomputed
    assert len(seen) + len(new) == sum(r.status == "ok" for r in resumed.records) + 1

    # The resumed run's records equal a fresh uninterrupted run's (but for wall time).
    fresh_dir = tmp_path / "fresh"
    examples2, _, reorderer2 = _setup(tmp_path)
    fresh = await run_evaluation(
        examples2, reorderer2, _config(tmp_path, out_dir=fresh_dir, positional_limit=1)
    )

    def strip(r: Record) -> tuple[object, ...]:
        return (r.key, r.status, r.order, r.answer, r.accuracy, r.gold_logprob, r.position_bias)

    assert [strip(r) for r in resumed.records] == [strip(r) for r in fresh.records]
    assert isinstance(resumed.positional[0], PositionalRecord)
    assert resumed.positional[0].slots == fresh.positional[0].slots
    # A third run computes nothing.
    again: list[AnyRecord] = []
    calls = backend.stats.score_calls + backend.stats.generate_calls
    await run_evaluation(examples, reorderer, config, on_record=again.append)
    assert again == [] and backend.stats.score_calls + backend.stats.generate_calls == calls


async def test_cached_only_reports_the_finished_questions_and_computes_nothing(
    tmp_path: Path,
) -> None:
    examples, backend, reorderer = _setup(tmp_path)
    config = _config(tmp_path, variants=tuple(select_variants(["retriever", "moi:pruned_random"])))
    # Questions 0 and 2 finish; question 1 has one variant, question 3 none.
    await run_evaluation([examples[0], examples[2]], reorderer, config)
    partial = _config(tmp_path, variants=tuple(select_variants(["retriever"])), positional=False)
    await run_evaluation([examples[1]], reorderer, partial)
    calls = backend.stats.score_calls + backend.stats.generate_calls
    report = await run_evaluation(
        examples[:4], reorderer, _config(tmp_path, variants=config.variants, cached_only=True)
    )
    assert backend.stats.score_calls + backend.stats.generate_calls == calls
    assert sorted({r.question_id for r in report.records}) == [examples[0].id, examples[2].id]
    assert len(report.records) == 2 * len(config.variants)
    # The positional runs of the first run (positional_limit 2: questions 0 and 2) are kept.
    assert [p.question_id for p in report.positional] == [examples[0].id, examples[2].id]
    meta = json.loads((tmp_path / "out" / "results.json").read_text())["meta"]
    assert meta["questions"] == 2 and meta["cached_only"] is True


async def test_report_files_summary_table_and_plots(tmp_path: Path) -> None:
    examples, _, reorderer = _setup(tmp_path)
    out = await run_evaluation(examples, reorderer, _config(tmp_path))
    names = sorted(p.name for p in out.files)
    assert names == [
        "bias_by_slot.png",
        "positional_by_slot.png",
        "quality_vs_tokens.png",
        "results.json",
        "run.json",
        "summary.md",
    ]
    for p in out.files:
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(doc["records"]) == len(out.records)
    assert len(doc["positional_records"]) == 2
    assert doc["meta"]["metric"] == "accuracy" and doc["meta"]["questions"] == QUESTIONS
    comps = doc["summary"]["comparisons"]
    ret_vs_shuffle = [
        c for c in comps if c["variant"] == "retriever" and c["baseline"] == "shuffle"
    ]
    assert {c["metric"] for c in ret_vs_shuffle} >= {"accuracy", "gold_logprob_per_token"}
    acc = next(c for c in ret_vs_shuffle if c["metric"] == "accuracy")
    assert acc["mean_diff"] == 0.0 and acc["p_value"] == 1.0 and acc["n"] == QUESTIONS
    # Skipped variants are never compared (no pairs).
    assert not [c for c in comps if c["variant"] == "max_relevance"]
    # Each MoI design's two placements of one fit, paired (cyclic has no profile: skipped).
    placed = doc["summary"]["placements"]
    assert {(c["variant"], c["baseline"]) for c in placed} == {
        ("moi:pruned_random:bias_matched", "moi:pruned_random:descending_utility")
    }
    assert {c["metric"] for c in placed} >= {"accuracy", "gold_rank_best"}
    assert all(c["n"] == QUESTIONS for c in placed)

    md = (tmp_path / "out" / "summary.md").read_text()
    summary = build_summary(out.records, out.positional, out.metric, resamples=500)
    assert md == markdown(doc["meta"], summary)
    header = next(line for line in md.splitlines() if line.startswith("| variant | ok |"))
    assert header.startswith("| variant | ok | accuracy | EM | F1 | ROUGE-L | gold LL/token |")
    row = next(line for line in md.splitlines() if line.startswith("| retriever | 3/3 |"))
    assert row.split(" | ")[2:4] == ["1.000", "1.000"]
    assert "| max_relevance | 0/3 |" in md and "skipped: no profile" in md
    assert "## Paired against `shuffle`" in md and "## Paired against `retriever`" in md
    assert "## Gold passage rotated through every slot" in md
    assert "## MoI placement: `bias_matched` against `descending_utility`" in md
    placement_section = md.split("## MoI placement")[1].split("\n## ")[0]
    assert "| pruned_random | 3 | " in placement_section
    assert "| pruned_random | 3 | 3 |" in md  # the MoI bias profile: 3 slots, 3 questions


def test_cli_eval_on_the_fake_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from entrypoints.cli import main

    data, truth, answers = _world(tmp_path)
    created: list[FakeBackend] = []

    def fake_backend(settings: Settings) -> FakeBackend:
        created.append(FakeBackend(truth, answers=answers, model_id=settings.model))
        return created[-1]

    monkeypatch.setattr("service.backends.factory.create_backend", fake_backend)
    monkeypatch.setenv("RAG_REORDER_CACHE_DIR", str(tmp_path / "cache"))
    argv = [
        "eval",
        "--data",
        str(data),
        "--limit",
        "2",
        "--max-passages",
        "4",
        "--strategies",
        "retriever,shuffle,moi:pruned_random",
        "--scorer",
        "fake/scorer",
        "--generator",
        "fake/generator",
        "--positional-limit",
        "1",
        "--resamples",
        "200",
        "--no-progress",
        "--out",
        str(tmp_path / "cli"),
    ]
    assert main(argv) == 0
    assert [b.model_id for b in created] == ["fake/scorer", "fake/generator"]
    assert all(b.closed for b in created)
    doc = json.loads((tmp_path / "cli" / "results.json").read_text())
    # Another generator: moi:pruned_random has a third variant, placed by the generator's
    # profile, skipped here (none is calibrated) with the reason.
    assert doc["meta"]["max_passages"] == 4 and len(doc["records"]) == 2 * 5
    placed = [r for r in doc["records"] if r["key"]["variant"].endswith(":generator_bias")]
    assert len(placed) == 2 and all(r["status"] == "skipped" for r in placed)
    assert {r["key"]["generator"] for r in doc["records"]} == {"fake/generator"}
    assert main([*argv[:-2], "--limit", "0", "--out", str(tmp_path / "x")]) == 2


async def test_a_resume_says_how_much_and_a_folder_of_another_run_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    examples, _, reorderer = _setup(tmp_path)
    variants = tuple(select_variants(["retriever"]))
    config = _config(tmp_path, variants=variants, positional=False)
    await run_evaluation(examples[:2], reorderer, config)
    with caplog.at_level("INFO", logger="offline.evaluation.runner"):
        await run_evaluation(examples[:3], reorderer, config)
    cache = tmp_path / "out" / CACHE_FILE
    assert f"resuming 2 of 3 questions from {cache}" in caplog.text

    # Another passage count (or model, template, seed) in the same folder: refused, named.
    other = _config(tmp_path, variants=variants, positional=False, max_passages=2)
    with pytest.raises(InvalidRequest) as err:
        await run_evaluation(examples[:3], reorderer, other)
    assert err.value.param == "out"
    assert "max_passages None there, 2 here" in err.value.message
    assert "--fresh" in err.value.message
    lines = cache.read_text().splitlines()

    # --fresh: the old records move aside (nothing deleted) and the run starts afresh.
    fresh = _config(tmp_path, variants=variants, positional=False, max_passages=2, fresh=True)
    await run_evaluation(examples[:3], reorderer, fresh)
    (aside,) = (tmp_path / "out").glob("cache.replaced-*.jsonl")
    assert aside.name.startswith("cache.replaced-") and aside.name.endswith("Z.jsonl")
    assert aside.read_text().splitlines() == lines
    assert len(cache.read_text().splitlines()) == 3  # the 3 questions, computed anew


async def test_the_report_rebuilds_from_its_records_alone_and_packed_records_resume(
    tmp_path: Path,
) -> None:
    from offline.evaluation.rebuild import MANIFEST_FILE, rebuild_report

    examples, backend, reorderer = _setup(tmp_path)
    config = _config(tmp_path, positional_limit=1)
    await run_evaluation(examples, reorderer, config)
    out = tmp_path / "out"
    assert (out / MANIFEST_FILE).is_file()
    rebuilt = ("results.json", "summary.md", "bias_by_slot.png", "quality_vs_tokens.png")
    before = {name: (out / name).read_bytes() for name in rebuilt}
    for name in rebuilt:
        (out / name).unlink()

    rebuild_report(out, pack=True)  # no model: the manifest and the records only
    assert {name: (out / name).read_bytes() for name in rebuilt} == before
    assert not (out / CACHE_FILE).exists() and (out / "cache.jsonl.gz").is_file()
    packed = (out / "cache.jsonl.gz").read_bytes()
    rebuild_report(out, pack=True)
    assert (out / "cache.jsonl.gz").read_bytes() == packed  # deterministic bytes

    # A run over the packed records resumes from them: nothing is computed again.
    calls = backend.stats.score_calls + backend.stats.generate_calls
    again: list[AnyRecord] = []
    await run_evaluation(examples, reorderer, config, on_record=again.append)
    assert again == [] and backend.stats.score_calls + backend.stats.generate_calls == calls

    # A manifest naming a record the cache lacks is a clear error, not a shorter report.
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["records"].append(["no-such-question", ["retriever"]])
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(InvalidRequest, match="'no-such-question', variant 'retriever'"):
        rebuild_report(out)
    with pytest.raises(InvalidRequest, match=r"no run\.json"):
        rebuild_report(tmp_path / "elsewhere")
