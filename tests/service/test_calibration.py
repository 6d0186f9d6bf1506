from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import kendalltau

from service.backends.fakes.fake import FakeBackend
from service.batch.calibration import calibrate_profile
from service.batch.dataset import Example, load_examples
from service.config.settings import Settings
from service.errors import InvalidRequest
from service.passage import Passage
from service.pipeline import DesignSpec, Reorderer, ReorderRequest
from service.state.profile_store import ProfileStore

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


def _recency(L: int) -> list[float]:
    a = np.sqrt(np.arange(1, L + 1))
    return list(a / a.sum())


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


async def test_random_calibration_takes_its_direction_from_the_data(tmp_path: Path) -> None:
    # A recency-biased model: the generic primacy prior would orient the full-length profile
    # backwards (cos -1 with the truth); the pruned runs measured beside it fix the direction.
    examples, truth = _examples(12, 8)
    backend = FakeBackend(truth, bias=_recency, noise=0.01)
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    report = await calibrate_profile(r, examples, max_passages=8, design="random")
    prof, orienting = report.profile, report.orienting
    assert orienting is not None and orienting.slots == 4 and orienting.oriented_by == "data"
    assert prof.slots == 8 and prof.oriented_by == "profile"
    assert _cos(np.asarray(prof.coefficients), np.asarray(_recency(8))) > 0.98
    np.testing.assert_allclose(orienting.coefficients, _recency(4), atol=0.02)
    # Both are stored; 3N random prompts plus 2N pruned ones per query.
    template = r.settings.chat_template
    assert r.profiles.get(backend.model_id, template, 4) == orienting
    assert r.profiles.get(backend.model_id, template, 8) == prof
    assert report.prompts == 12 * (24 + 16)


async def test_full_length_designs_are_oriented_by_a_data_profile_of_any_length(
    tmp_path: Path,
) -> None:
    examples, _ = _examples(10, 8)
    # The held-out question has 10 passages; the fake indexes its truth when built.
    held, truth = _examples(11, 10)
    backend = FakeBackend(truth, bias=_recency, noise=0.001)
    r = Reorderer(backend, Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    u_true = [truth[p.text] for p in held[10].passages]
    request = ReorderRequest(held[10].question, held[10].passages, design=DesignSpec(kind="random"))
    # Without any profile the generic primacy prior orients the fit: exactly backwards here.
    res = await r.reorder(request)
    assert res.fit is not None and res.fit.orientation == "default_reference"
    assert kendalltau(res.fit.utilities, u_true)[0] < -0.9
    assert any("generic primacy prior" in w for w in res.warnings)
    await calibrate_profile(r, examples, max_passages=8, design="pruned_random")
    for kind in ("random", "hybrid"):
        # No 10-slot profile exists: the 4-slot data profile, resampled, orients the fit.
        res = await r.reorder(replace(request, design=DesignSpec(kind=kind)))  # type: ignore[arg-type]
        assert res.fit is not None and res.fit.orientation == "reference"
        assert res.profile is not None and res.profile.slots == 4
        assert kendalltau(res.fit.utilities, u_true)[0] > 0.95, kind
        assert not any("generic primacy prior" in w for w in res.warnings)


def test_profiles_stored_before_the_orientation_field_still_load(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    for slots, ident in ((4, "full"), (8, "up_to_scale")):
        coef = [1.0 / slots] * (slots - 1) + [0.0]
        coef = [c / sum(coef) for c in coef]
        store.root.mkdir(exist_ok=True)
        store.path("m", "t", slots).write_text(
            json.dumps(
                {
                    "model": "m",
                    "template": "t",
                    "slots": slots,
                    "coefficients": coef,
                    "identification": ident,
                    "runs": 1,
                    "prompts": 8,
                    "r2": 0.9,
                    "source": "old",
                    "created_at": 0.0,
                }
            )
        )
    assert store.get("m", "t", 4).oriented_by == "data"  # type: ignore[union-attr]
    assert store.get("m", "t", 8).oriented_by == "prior"  # type: ignore[union-attr]
    orienting = store.orienting("m", "t")
    assert orienting is not None and orienting.slots == 4
    assert store.orienting("m", "other") is None


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
    bad.write_text('{"id": 1, "question": "q", "passages": ["p"]}\n{"nope": 1}\n')
    with pytest.raises(InvalidRequest, match=r"bad\.jsonl:2"):
        load_examples(bad)


async def test_traffic_runs_with_nothing_to_fit_are_a_client_error(tmp_path: Path) -> None:
    from service.batch.calibration import calibrate_from_traffic
    from service.state.traffic import TrafficSampler

    r = Reorderer(FakeBackend({}), Settings(cache_dir=tmp_path), ProfileStore(tmp_path / "p"))
    sampler = TrafficSampler(1.0, 10)
    perms = np.array([[0, 1], [1, 2], [2, 0], [1, 0], [0, 2], [2, 1]])
    for _ in range(3):  # identifiable design, but every score equal: nothing to fit
        sampler.offer(
            model=r.backend.model_id,
            template="qa_default",
            kind="pruned_random",
            perms=perms,
            scores=np.full(6, -3.0),
        )
    with pytest.raises(InvalidRequest, match="cannot give a bias profile"):
        await calibrate_from_traffic(r, sampler, design="pruned_random", slots=2)
    assert r.profiles.list() == []


def test_the_store_lists_only_profile_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # eval/run.sh keeps `calibrate`'s report (calibrate-random.json: a profile plus report
    # fields) in the profile folder; listing, and so every lookup by id, must not trip on it.
    store = ProfileStore(tmp_path)
    kept = store.put(
        model="m/1",
        template="qa_default",
        coefficients=[0.5, 0.5],
        identification="full",
        runs=1,
        prompts=2,
        r2=1.0,
        source="test",
    )
    (tmp_path / "calibrate-random.json").write_text(json.dumps({"queries": 3, "model": "m/1"}))
    (tmp_path / "m_2__qa_default__L3.json").write_text("{not json")
    assert [p.id for p in store.list()] == [kept.id] == ["m_1__qa_default__L2"]
    assert store.by_id(kept.id) == kept
    assert (
        "skipping unreadable bias profile" in caplog.text and "m_2__qa_default__L3" in caplog.text
    )


async def test_calibration_judges_trust_by_the_operators_auto_settings(tmp_path: Path) -> None:
    # Six queries are enough runs for the default `auto_min_runs` (5), not for an operator's
    # 10: the stored trust must say the operator's rule, as auto's own assessment would.
    examples, truth = _examples(6, 8)
    trusts = []
    for min_runs in (5, 10):
        backend = FakeBackend(truth, bias=_bias, noise=0.01)
        settings = Settings(cache_dir=tmp_path / str(min_runs), auto_min_runs=min_runs)
        r = Reorderer(backend, settings, ProfileStore(tmp_path / str(min_runs) / "p"))
        report = await calibrate_profile(r, examples, max_passages=8, design="pruned_random")
        assert report.profile.trust is not None
        trusts.append(report.profile.trust)
    assert trusts[0].trusted
    assert not trusts[1].trusted and "fewer than 10" in trusts[1].reason
