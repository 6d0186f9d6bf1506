from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import kendalltau

from service.backends.fake import FakeBackend
from service.calibration import calibrate_profile
from service.dataset import Example, load_examples
from service.errors import InvalidRequest
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.profile_store import ProfileStore
from service.prompts import Passage
from service.settings import Settings

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def _examples(count: int, n: int) -> tuple[list[Example], dict[str, float]]:
    rng = np.random.default_rng(0)
    truth: dict[str, float] = {}
    out = []
    for k in range(count):
        passages = tuple(Passage(text=f"query {k} passage {i} text") for i in range(n))
        truth.update({p.text: float(rng.standard_normal()) for p in passages})
        out.append(Example(f"q{k}", f"question {k}?", ("a",), passages, (0,)))
    return out, truth


def _bias(L: int) -> list[float]:
    a = 1.0 / np.sqrt(np.arange(1, L + 1))
    return list(a / a.sum())


@pytest.mark.parametrize(("design", "slots"), [("random", 8), ("pruned_random", 4)])
async def test_calibrated_profile_matches_the_backend_bias(
    design: str, slots: int, tmp_path: Path
) -> None:
    examples, truth = _examples(12, 8)
    backend = FakeBackend(truth, bias=_bias, noise=0.01)
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    report = await calibrate_profile(r, examples, max_passages=8, design=design)  # type: ignore[arg-type]
    prof = report.profile
    assert prof.slots == slots and report.queries == 12
    coef = np.asarray(prof.coefficients)
    want = np.asarray(_bias(slots))
    if design == "pruned_random":
        np.testing.assert_allclose(coef, want, atol=0.02)
    else:  # full-length runs identify the shape up to scale
        c, w = coef - coef.mean(), want - want.mean()
        assert float(c @ w / np.linalg.norm(c) / np.linalg.norm(w)) > 0.98
    assert r.profiles.get(backend.model_id, r.settings.chat_template, slots) == prof
    # The stored profile makes the matching cyclic design servable.
    kind = "cyclic" if design == "random" else "pruned_cyclic"
    q, new_truth = _examples(1, 8)
    backend.truth.update(new_truth)
    res = await r.reorder(
        ReorderRequest(
            q[0].question,
            q[0].passages,
            design=DesignSpec(kind=kind, prompt_passages=None if kind == "cyclic" else 4),  # type: ignore[arg-type]
        )
    )
    u_true = [new_truth[p.text] for p in q[0].passages]
    assert res.profile == prof
    assert kendalltau(res.fit.utilities, u_true)[0] > 0.85


async def test_calibration_needs_enough_passages(tmp_path: Path) -> None:
    examples, truth = _examples(2, 4)
    r = Reorderer(FakeBackend(truth), Settings(cache_dir=tmp_path), ProfileStore(tmp_path))
    with pytest.raises(InvalidRequest, match=r"no example has 10 passages"):
        await calibrate_profile(r, examples, max_passages=10)


def test_dataset_loader_reads_the_dev_sets_without_leaking_labels() -> None:
    nq = load_examples(DATA / "nq_open_dev.jsonl", limit=5)
    assert len(nq) == 5 and all(len(e.passages) == 20 and len(e.gold) == 1 for e in nq)
    rec = json.loads((DATA / "nq_open_dev.jsonl").read_text().splitlines()[0])
    assert nq[0].gold == (rec["gold_position"],)
    assert not hasattr(nq[0].passages[0], "is_gold")
    hp = load_examples(DATA / "hotpot_dev.jsonl")
    assert len(hp) == 51 and all(len(e.gold) == 2 for e in hp)


def test_dataset_loader_names_the_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "question": "q", "passages": []}\n{"nope": 1}\n')
    with pytest.raises(InvalidRequest, match=r"bad\.jsonl:2"):
        load_examples(bad)
