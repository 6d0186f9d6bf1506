"""A fixed teacher's preference set over three short passages, for the distillation tests."""

from __future__ import annotations

from service.offline.distill.preferences import Preference, PreferenceMeta, sample_orders
from service.prompts import Passage

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
