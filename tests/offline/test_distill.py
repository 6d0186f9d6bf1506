"""Preference distillation: the KL objective, training on a tiny random model, the adapter
round trip, and the teacher's preference set (resumable)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from offline.distill.command import split
from offline.distill.preferences import (
    build_preferences,
    read_preferences,
    sample_orders,
)
from offline.distill.train import (
    DistillConfig,
    StudentScorer,
    agreement,
    load_student,
    preference_kl,
    train_steps,
    with_lora,
)
from service.backends.engines.transformers_backend import TransformersBackend
from service.backends.fakes.fake import FakeBackend
from service.batch.dataset import Example
from service.config.settings import Settings
from service.errors import BackendUnavailable, InvalidRequest
from service.model_assets.adapter import (
    adapted_model_id,
    configured_adapter,
    read_manifest,
)
from service.model_assets.merge import merged_model
from tests.support.distill import PASSAGES, PREFS, distill_tiny
from tests.support.pipeline import reorderer_in


def test_kl_matches_a_hand_computed_example() -> None:
    # teacher softmax [1/2, 1/2], student softmax [1/4, 3/4]:
    # KL = 1/2 ln(2) + 1/2 ln(2/3) = 1/2 ln(4/3).
    teacher = torch.tensor([0.0, 0.0])
    student = torch.tensor([0.0, math.log(3.0)])
    assert float(preference_kl(student, teacher)) == pytest.approx(0.5 * math.log(4 / 3))
    # Only differences within a question matter (the query's absolute likelihood does not).
    assert float(preference_kl(student - 7.0, teacher + 2.0)) == pytest.approx(
        0.5 * math.log(4 / 3)
    )
    assert float(preference_kl(teacher, teacher)) == pytest.approx(0.0, abs=1e-7)
    # Batched: the mean over questions.
    both = preference_kl(torch.stack([student, teacher]), torch.stack([teacher, teacher]))
    assert float(both) == pytest.approx(0.25 * math.log(4 / 3))


def test_sample_orders_are_distinct_seeded_and_cover_small_sets() -> None:
    orders = sample_orders(5, 30, "q", 0)
    assert len(set(orders)) == 30 and all(sorted(o) == list(range(5)) for o in orders)
    assert orders == sample_orders(5, 30, "q", 0) != sample_orders(5, 30, "r", 0)
    assert sorted(sample_orders(3, 30, "q", 0)) == sorted(itertools.permutations(range(3)))


def test_tiny_student_moves_towards_a_fixed_teacher(tiny_model_dir: Path) -> None:
    config = DistillConfig(
        learning_rate=1e-2, lora_dropout=0.0, epochs=6, batch_questions=1, permutations_per_step=4
    )
    base, tokenizer, _ = load_student(tiny_model_dir, config)
    model = with_lora(base, config)
    scorer = StudentScorer(model, tokenizer, "qa_default")
    before = agreement(scorer, PREFS)
    result = train_steps(model, scorer, PREFS, config)
    after = agreement(scorer, PREFS)
    assert result.steps == 12 and result.prompt_tokens > 0
    assert after.kl < 0.5 * before.kl
    assert after.kendall_tau > before.kendall_tau


def test_packed_student_scores_equal_one_prompt_per_forward(tiny_model_dir: Path) -> None:
    config = DistillConfig()
    base, tokenizer, _ = load_student(tiny_model_dir, config)
    model = with_lora(base, config)
    model.train(False)
    # Prompts of different lengths (one, two or all passages), so rows are left-padded.
    maker = StudentScorer(model, tokenizer, "qa_default")
    prompts = [
        p
        for pref in PREFS
        for p in maker.prompts(pref, [pref.orders[0][:1], pref.orders[1][:2], pref.orders[2]])
    ]
    assert len({p.query_span[1] for p in prompts}) > 1
    packed = StudentScorer(model, tokenizer, "qa_default", batch_tokens=1 << 20)
    alone = StudentScorer(model, tokenizer, "qa_default", batch_tokens=1)
    with torch.inference_mode():
        a, b = packed.scores(prompts), alone.scores(prompts)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert packed.prompt_tokens == alone.prompt_tokens == sum(p.query_span[1] for p in prompts)
    # Gradients flow through a packed forward (the training path).
    model.train(True)
    packed.scores(prompts[:3]).sum().backward()  # type: ignore[no-untyped-call]
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_adapter_round_trip_and_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = DistillConfig(learning_rate=1e-2, epochs=2, batch_questions=1)
    out = tmp_path / "tiny-distilled"
    manifest = distill_tiny(tiny_model_dir, out, config=config)
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert read_manifest(out) == manifest
    assert manifest.name == "tiny-distilled" and manifest.teacher == "teacher/fixed"
    assert (manifest.lora_r, manifest.lora_alpha, manifest.lora_dropout) == (8, 32, 0.1)
    assert manifest.steps == 2 and manifest.before.questions == 1

    # The served (merged) model scores exactly as the trained (unmerged) adapter does.
    from peft import PeftModel

    base, tokenizer, _ = load_student(tiny_model_dir, config)
    trained = StudentScorer(PeftModel.from_pretrained(base, str(out)), tokenizer, "qa_default")
    trained.model.train(False)
    prompts = trained.prompts(PREFS[1], PREFS[1].orders)
    with torch.inference_mode():
        expected = trained.scores(prompts).tolist()
    settings = Settings(model=str(tiny_model_dir), adapter=out, cache_dir=tmp_path)
    backend = TransformersBackend.from_settings(settings)
    assert backend.model_id == f"{tiny_model_dir}+tiny-distilled"
    rows = anyio.run(backend.score, [p.span_request(f"r{i}") for i, p in enumerate(prompts)])
    served = [p.totals(r.logprobs)[0] for p, r in zip(prompts, rows, strict=True)]  # type: ignore[union-attr]
    assert served == pytest.approx(expected, abs=1e-3)
    raw = TransformersBackend.load(tiny_model_dir)
    raw_rows = anyio.run(raw.score, [p.span_request(f"r{i}") for i, p in enumerate(prompts)])
    assert [p.totals(r.logprobs)[0] for p, r in zip(prompts, raw_rows, strict=True)] != (  # type: ignore[union-attr]
        pytest.approx(served, abs=1e-3)
    )

    # The vLLM backend's form of the same adapter: folded into a cached copy of the base
    # weights, which scores as the in-memory merge does, is made once, and is made anew when
    # the adapter changes.
    folder = merged_model(tiny_model_dir, out, tmp_path)
    assert merged_model(tiny_model_dir, out, tmp_path) == folder
    copy = TransformersBackend.load(folder)
    copy_rows = anyio.run(copy.score, [p.span_request(f"r{i}") for i, p in enumerate(prompts)])
    assert [p.totals(r.logprobs)[0] for p, r in zip(prompts, copy_rows, strict=True)] == (  # type: ignore[union-attr]
        pytest.approx(served, abs=1e-4)
    )
    config = out / "adapter_config.json"
    config.write_text(config.read_text() + "\n")
    assert merged_model(tiny_model_dir, out, tmp_path) != folder

    # An adapter only serves the base model and template it was trained for.
    with pytest.raises(BackendUnavailable, match="distilled onto"):
        configured_adapter(Settings(adapter=out, cache_dir=tmp_path))
    with pytest.raises(BackendUnavailable, match="template"):
        configured_adapter(
            Settings(model=str(tiny_model_dir), adapter=out, chat_template="qa_completion")
        )
    with pytest.raises(BackendUnavailable, match="no readable"):
        configured_adapter(Settings(model=str(tiny_model_dir), adapter=tmp_path))
    assert adapted_model_id("m", None) == "m"
    # The adapter stays with its model: `eval --generator other` does not carry it over.
    assert settings.for_model(str(tiny_model_dir)).adapter == out
    assert settings.for_model("HuggingFaceTB/SmolLM2-135M-Instruct").adapter is None


def test_the_adapter_names_the_student_model_and_has_a_model_card(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "named"
    distill_tiny(tiny_model_dir, out, student_id="org/tiny-student")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/tiny-student"
    # The model card is the manifest's, not peft's empty template.
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-student\n")
    assert "distilled from teacher/fixed" in card and "More Information Needed" not in card
    assert "RAG_REORDER_MODEL=org/tiny-student" in card
    assert str(tiny_model_dir) not in "".join(
        p.read_text() for p in out.glob("*.*") if p.suffix != ".safetensors"
    )


def examples(n: int) -> list[Example]:
    return [
        Example(f"e{i}", f"question {i}?", ("a",), PASSAGES + PASSAGES[:1], (0,)) for i in range(n)
    ]


def test_preference_set_is_built_with_the_serving_scores_and_resumes(tmp_path: Path) -> None:
    backend = FakeBackend({p.text: float(i) for i, p in enumerate(PASSAGES)})
    teacher = reorderer_in(tmp_path, backend)
    out = tmp_path / "prefs.jsonl"

    async def build(n: int, **kw: int) -> tuple[int, int]:
        report = await build_preferences(
            teacher, examples(n), out, passages=kw.get("passages", 3), permutations=4
        )
        return report.scored, len(report.preferences)

    assert anyio.run(build, 2) == (2, 2)
    # A cut last line (an interrupted run) is dropped and that question scored again.
    out.write_text(out.read_text(encoding="utf-8") + '{"id": "e2", "quest', encoding="utf-8")
    assert anyio.run(build, 3) == (1, 3)
    meta, prefs = read_preferences(out)
    assert meta.teacher == backend.model_id and meta.permutations == 4
    assert all(len(p.orders) == len(p.scores) == 4 and len(p.passages) == 3 for p in prefs)
    assert all(np.isfinite(p.scores).all() and p.prompt_tokens > 0 for p in prefs)
    with pytest.raises(InvalidRequest, match="built with"):
        anyio.run(lambda: build(3, passages=4))
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 4 and "meta" in json.loads(lines[0])


def test_concurrent_preference_set_equals_the_sequential_one(tmp_path: Path) -> None:
    backend = FakeBackend({p.text: float(i) for i, p in enumerate(PASSAGES)})
    teacher = reorderer_in(tmp_path, backend)

    async def build(name: str, concurrency: int) -> list[object]:
        report = await build_preferences(
            teacher,
            examples(6),
            tmp_path / name,
            passages=3,
            permutations=4,
            concurrency=concurrency,
        )
        return [(p.id, p.orders, p.scores) for p in report.preferences]

    sequential = anyio.run(build, "one.jsonl", 1)
    assert anyio.run(build, "many.jsonl", 4) == sequential  # in the examples' order
    assert len(read_preferences(tmp_path / "many.jsonl")[1]) == 6
    with pytest.raises(InvalidRequest, match="concurrency"):
        anyio.run(build, "bad.jsonl", 0)


def test_split_holds_back_a_seeded_subset() -> None:
    prefs = [replace(PREFS[0], id=f"q{i}") for i in range(10)]
    train, held = split(prefs, 3, seed=0)
    assert len(train) == 7 and len(held) == 3 and not {p.id for p in train} & {p.id for p in held}
    assert split(prefs, 3, seed=0) == (train, held)
    with pytest.raises(InvalidRequest, match="too few"):
        split(prefs[:3], 3, seed=0)


def test_distill_eval_measures_agreement_quality_and_cost_and_resumes(tmp_path: Path) -> None:
    from offline.distill.measure import MeasureConfig, measure
    from service.batch.dataset import load_examples
    from tests.support.positional import FILLERS, TOPICS, write_qa_file

    qa = load_examples(write_qa_file(tmp_path / "qa.jsonl"))
    truth = {t[2]: 2.0 for t in TOPICS} | {f: float(-i) for i, f in enumerate(FILLERS)}
    teacher = reorderer_in(tmp_path, FakeBackend(truth, answers={t[2]: t[1] for t in TOPICS}))
    same = reorderer_in(tmp_path, FakeBackend(truth, model_id="fake/student"))
    reversed_ = reorderer_in(
        tmp_path, FakeBackend({k: -v for k, v in truth.items()}, model_id="fake/reversed")
    )
    scorers = {"teacher": teacher, "student": reversed_, "distilled": same}
    config = MeasureConfig(out=tmp_path / "out", passages=4, num_prompts=8, resamples=200)
    summary = anyio.run(lambda: measure(qa, scorers, teacher, config))
    assert summary["questions"] == 2
    # Questions measured at once give the same orders and answers.
    at_once = replace(config, out=tmp_path / "at-once", concurrency=2)
    concurrent = anyio.run(lambda: measure(qa, scorers, teacher, at_once))
    for key in ("agreement_with_teacher", "quality", "comparisons"):
        assert concurrent[key] == summary[key]
    agreement = summary["agreement_with_teacher"]
    assert isinstance(agreement, dict)
    assert agreement["distilled"]["kendall_tau"]["mean"] == pytest.approx(1.0)
    assert agreement["distilled"]["same_top"]["mean"] == 1.0
    assert agreement["student"]["kendall_tau"]["mean"] < 0
    cost = summary["cost_per_question"]
    assert isinstance(cost, dict) and cost["teacher"]["prompts"] == 8
    lines = (tmp_path / "out" / "records.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 * (3 + 4)  # per question: 3 scorers' orders, 4 orders answered
    # Resumed: nothing is scored or generated again.
    anyio.run(lambda: measure(qa, scorers, teacher, config))
    assert (tmp_path / "out" / "records.jsonl").read_text(encoding="utf-8").splitlines() == lines
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["questions"] == 2
    from offline.evaluation.plots import write_distill_plot

    assert write_distill_plot(tmp_path / "out", summary).stat().st_size > 0
