"""A fixed teacher's preference set over three short passages, for the distillation tests."""

from __future__ import annotations

from pathlib import Path

from offline.distill.preferences import Preference, PreferenceMeta, sample_orders
from offline.distill.train import DistillConfig, distill
from service.model_assets.adapter import AdapterManifest, Agreement
from service.passage import Passage

PASSAGES = (
    Passage(text="Paris is the capital of France.", title="Paris"),
    Passage(text="The Loire is a long river.", title="Loire"),
    Passage(text="Bread is baked in ovens.", title="Bread"),
)
META = PreferenceMeta(
    teacher="teacher/fixed",
    template="qa_default",
    data="synthetic",
    passages=3,
    permutations=6,
    seed=0,
)


def fixed_teacher(question: str, qid: str) -> Preference:
    """Every order of three passages; the teacher likes passage 0 early (3 nats a slot)."""
    orders = tuple(sample_orders(3, 6, qid, 0))
    scores = tuple(-3.0 * order.index(0) for order in orders)
    return Preference(qid, question, PASSAGES, orders, scores, prompt_tokens=0, seconds=0.0)


PREFS = [
    fixed_teacher("What is the capital of France?", "q0"),
    fixed_teacher("Which city is France's capital?", "q1"),
]


def manifest(base: Path, name: str, lora_r: int = 8) -> AdapterManifest:
    """What ``rag-reorder distill`` would have written for an adapter on ``base`` (the service
    checks the base model and the template against its settings)."""
    agreement = Agreement(questions=1, kendall_tau=0.0, top1=0.0, kl=0.0)
    return AdapterManifest(
        name=name,
        base_model=str(base),
        template="qa_default",
        teacher="teacher/fixed",
        teacher_template="qa_default",
        data="none",
        passages=4,
        permutations=6,
        permutations_per_step=3,
        lora_r=lora_r,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=("q_proj", "v_proj"),
        learning_rate=1e-3,
        weight_decay=0.01,
        epochs=1,
        batch_questions=1,
        train_questions=1,
        steps=0,
        train_seconds=0.0,
        train_prompt_tokens=0,
        device="cpu",
        before=agreement,
        after=agreement,
        created_at="2026-11-25T00:00:00Z",
    )


def distill_tiny(
    model_dir: Path,
    out: Path,
    *,
    student_id: str | None = None,
    config: DistillConfig | None = None,
) -> AdapterManifest:
    """Distil the fixed teacher's first question onto ``model_dir``, its second held back
    (one step at the defaults); ``student_id`` is the folder's path unless given."""
    return distill(
        model_dir,
        student_id=str(model_dir) if student_id is None else student_id,
        student_template="qa_default",
        meta=META,
        train=PREFS[:1],
        held_back=PREFS[1:],
        out=out,
        config=config or DistillConfig(epochs=1, batch_questions=1),
    )
