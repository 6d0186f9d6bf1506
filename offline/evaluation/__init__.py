"""``rag-reorder eval``: does a reordering strategy help the generator?

``variants`` names what runs; ``runner`` orders each question's passages with every strategy
variant and measures the generator's answer (task metrics, gold-answer log-likelihood), the
gold passages' slots and the cost, resuming from the per-question cache of ``records``;
``metrics`` scores answers; ``stats`` gives paired bootstrap intervals and Wilcoxon p-values;
``report`` writes ``results.json`` and ``summary.md``; ``plots`` the PNGs.
"""

from offline.evaluation.runner import EvalConfig, EvalOutcome, Evaluator, run_evaluation
from offline.evaluation.variants import Variant, all_variants, select_variants

__all__ = [
    "EvalConfig",
    "EvalOutcome",
    "Evaluator",
    "Variant",
    "all_variants",
    "run_evaluation",
    "select_variants",
]
