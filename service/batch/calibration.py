"""Calibrate a position-bias profile for the serving model from a set of queries.

Each query's passages are scored under a random (or pruned-random) design; the runs are fitted
with one shared bias (``solver.calibrate``) and the profile is stored per (model, template,
slot count), where cyclic designs of that slot count will find it (docs/method.md).

Orientation. Full-length (random) runs fix the profile's shape but not its direction: the
reversed profile with reversed utilities fits them equally well (docs/method.md). Taking the
direction from a generic primacy prior is backwards for a model with recency bias (measured:
SmolLM2-135M's 10-slot profile came out decreasing towards the question while its pruned
5-slot profile and its positional accuracy both rise towards it). So a random calibration
also scores each query under a pruned-random design (L = ceil(N/2) passages a prompt, about a
third more prompt tokens), fits that data-oriented L-slot profile first, stores it too, and
orients the N-slot profile by it, resampled to N slots by relative position
(``oriented_by="profile"``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio.to_thread
import numpy as np

import solver
from service.batch.dataset import Example
from service.errors import InvalidRequest, UnidentifiableRequest
from service.learning.learner import rules_of, to_profile_trust
from service.pipeline import Reorderer
from service.prompting.templates import get_template
from service.state.profile_store import ProfileTrust, StoredProfile
from service.state.traffic import TrafficSampler
from service.strategies.moi import score_design
from service.strategies.work import Work
from solver import trust as trust_rules

log = logging.getLogger(__name__)

CalibrationDesign = Literal["random", "pruned_random"]
# Below this many sampled runs a traffic calibration says it is thin (a rule of thumb, not a
# measured threshold: eval/run.sh calibrates from 50 queries).
FEW_TRAFFIC_RUNS = 20


@dataclass(frozen=True)
class CalibrationReport:
    profile: StoredProfile
    queries: int
    prompts: int
    prompts_failed: int
    warnings: tuple[str, ...]
    orienting: StoredProfile | None = None
    """For random designs: the pruned-random profile that gave the direction (also stored)."""
    prompt_tokens: int = 0


def prompts_per_query(
    design: CalibrationDesign,
    passages: int,
    *,
    num_prompts: int | None = None,
    prompt_passages: int | None = None,
) -> int:
    """Prompts in one query's ``design`` (one score call), before any scoring.

    Raises:
        InvalidRequest: the solver cannot build that design for this many passages.
    """
    try:
        perms = solver.plan(
            design, passages, num_prompts=num_prompts, prompt_passages=prompt_passages, seed=0
        )
    except solver.SolverError as exc:
        raise InvalidRequest(str(exc), param="design") from None
    return len(perms)


async def calibrate_profile(
    reorderer: Reorderer,
    examples: Sequence[Example],
    *,
    max_passages: int,
    design: CalibrationDesign = "random",
    prompt_passages: int | None = None,
    num_prompts: int | None = None,
    seed: int = 0,
    template: str | None = None,
    source: str = "",
    request_id: str = "calibrate",
    progress: Callable[[int, int], None] | None = None,
    work_for: Callable[[str, str], Work] | None = None,
) -> CalibrationReport:
    """Score every example under ``design`` and store the shared bias profile.

    Args:
        reorderer: the serving pipeline (its backend and profile store are used).
        examples: queries with at least ``max_passages`` passages; the first ``max_passages``
            of each are used, so every run has the same slot count.
        max_passages: N, passages per query.
        design: ``random`` gives a profile for N slots (cyclic serving at N), oriented by a
            pruned-random profile for L slots measured on the same queries (both are stored);
            ``pruned_random`` one for L slots (pruned cyclic serving at L).
        prompt_passages: L for pruned runs (default ceil(N/2)).
        num_prompts: prompts per query of ``design`` (default: the design's; the orienting
            pruned runs always take their default, 2N).
        seed: base seed; query k uses ``seed + k``.
        template: prompt template (default: the configured one).
        source: provenance recorded with the profile.
        request_id: prefix of the per-query request ids (``<request_id>-<k>``).
        progress: called with (done, total) after each query.
        work_for: metered model access for query k, from (request id, template); default
            ``reorderer.work``. The HTTP route passes one that checks each query against the
            per-request limits and admits its tokens like a request of its own.

    Raises:
        InvalidRequest: no usable examples.
        UnidentifiableRequest: the runs cannot identify the bias (too few prompts).
    """
    template = template or reorderer.settings.chat_template
    usable = [e for e in examples if len(e.passages) >= max_passages]
    if not usable:
        raise InvalidRequest(f"no example has {max_passages} passages", param="max_passages")
    warnings: list[str] = []
    if len(usable) < len(examples):
        warnings.append(f"{len(examples) - len(usable)} example(s) with fewer passages skipped")
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    pruned: list[tuple[np.ndarray, np.ndarray]] = []
    prompts = failed = tokens = 0
    for k, ex in enumerate(usable):
        work = (work_for or reorderer.work)(f"{request_id}-{k}", template)
        passages = ex.passages[:max_passages]
        perms = solver.plan(
            design,
            max_passages,
            num_prompts=num_prompts,
            prompt_passages=prompt_passages,
            seed=seed + k,
        )
        runs.append((perms, await score_design(work, ex.question, passages, perms)))
        if design == "random":
            p_perms = solver.plan(
                "pruned_random", max_passages, prompt_passages=prompt_passages, seed=seed + k
            )
            pruned.append((p_perms, await score_design(work, ex.question, passages, p_perms)))
        usage = work.usage()
        prompts += usage.prompts
        failed += usage.prompts_failed
        tokens += usage.prompt_tokens
        if progress is not None:
            progress(k + 1, len(usable))
    source = source or f"{len(usable)} queries, {design} design"
    orienting: StoredProfile | None = None
    reference: np.ndarray | None = None
    if pruned:
        p_prof = await _fit(pruned)
        warnings.extend(p_prof.warnings)
        orienting = _store(
            reorderer,
            template,
            p_prof,
            f"{source} (the pruned_random runs that orient it)",
            trust=await assess_trust(pruned, max_passages, rules_of(reorderer.settings)),
        )
        reference = solver.resample(p_prof.coefficients, max_passages)
    prof, oriented = await _fit_oriented(runs, reference, warnings)
    rules = rules_of(reorderer.settings)
    trust = await assess_trust(runs, max_passages, rules) if design == "pruned_random" else None
    stored = _store(reorderer, template, prof, source, "profile" if oriented else None, trust=trust)
    log.info("stored bias profile for %s / %s / L=%d", stored.model, template, stored.slots)
    return CalibrationReport(
        stored, len(usable), prompts, failed, tuple(warnings), orienting, tokens
    )


async def calibrate_from_traffic(
    reorderer: Reorderer,
    traffic: TrafficSampler,
    *,
    design: CalibrationDesign,
    slots: int,
    template: str | None = None,
    source: str = "",
) -> CalibrationReport:
    """Fit and store a profile from the live runs ``traffic`` sampled (no new scoring).

    ``pruned_random`` pools the sampled pruned-random runs with ``slots`` passages a prompt
    (a data-oriented profile); ``random`` the sampled random and hybrid runs of ``slots``
    passages, oriented by the stored data profile of this model and template with the most
    slots (``oriented_by="profile"``), else by the primacy prior with a warning.

    Raises:
        InvalidRequest: an unknown template, or no sampled runs for this model, template,
            design and slot count.
        UnidentifiableRequest: the runs cannot identify the bias.
    """
    template = get_template(template or reorderer.settings.chat_template).name
    model = reorderer.backend.model_id
    # Blocking with a shared traffic folder (every replica's files): off the event loop.
    runs = await anyio.to_thread.run_sync(traffic.runs, model, template, design, slots)
    if not runs:
        counts = await anyio.to_thread.run_sync(traffic.pooled_counts)
        held = [
            f"{c.key.design} at {c.key.slots} slots: {c.runs}"
            for c in counts
            if c.key.model == model and c.key.template == template
        ]
        raise InvalidRequest(
            f"no sampled live {design} runs of model {model!r}, template {template!r} and "
            f"{slots} slots (held: {'; '.join(held) or 'none'}; traffic_sample_rate is "
            f"{traffic.rate:g})",
            param="slots",
        )
    warnings: list[str] = []
    if len(runs) < FEW_TRAFFIC_RUNS:
        warnings.append(
            f"only {len(runs)} sampled run(s): a profile from few queries is noisy, and it "
            "replaced any earlier one; let traffic accumulate (rag_reorder_traffic_sample_runs)"
        )
    orienting: StoredProfile | None = None
    reference: np.ndarray | None = None
    if design == "random":
        orienting = reorderer.profiles.orienting(model, template)
        if orienting is not None:
            reference = solver.resample(orienting.coefficients, slots)
        else:
            warnings.append(
                "no data-oriented profile of this model and template exists, so the primacy "
                "prior orients this one (it is backwards for a recency-biased model); "
                "calibrate a pruned_random profile first"
            )
    prof, oriented = await _fit_oriented(runs, reference, warnings)
    stored = _store(
        reorderer,
        template,
        prof,
        source or f"live traffic: {len(runs)} sampled {design} runs",
        "profile" if oriented else None,
        trust=(
            await assess_trust(runs, 2 * slots, rules_of(reorderer.settings))
            if design == "pruned_random"
            else None
        ),
    )
    log.info("stored bias profile for %s / %s / L=%d from traffic", model, template, slots)
    return CalibrationReport(
        profile=stored,
        queries=len(runs),
        prompts=sum(len(perms) for perms, _ in runs),
        prompts_failed=0,
        warnings=tuple(warnings),
        orienting=orienting if oriented else None,
    )


async def _fit_oriented(
    runs: list[tuple[np.ndarray, np.ndarray]],
    reference: np.ndarray | None,
    warnings: list[str],
) -> tuple[solver.Profile, bool]:
    """Fit oriented by ``reference`` when it can orient, else by the prior (with a warning
    appended); the fit's own warnings are appended too. Returns the profile and whether the
    reference oriented it."""
    try:
        prof = await _fit(runs, reference)
    except solver.InvalidReference as exc:
        # A flat data profile cannot orient anything; fall back to the prior, and say so.
        warnings.append(
            f"the data-oriented profile cannot orient the full-length one ({exc}); "
            "the primacy prior orients it instead"
        )
        reference = None
        prof = await _fit(runs)
    warnings.extend(prof.warnings)
    return prof, reference is not None


async def _fit(
    runs: list[tuple[np.ndarray, np.ndarray]], reference: np.ndarray | None = None
) -> solver.Profile:
    """``solver.calibrate`` off the event loop.

    Raises:
        UnidentifiableRequest: the runs cannot identify a bias (too few prompts).
        InvalidRequest: no run is usable (all of a run's scores equal).
        solver.InvalidReference: ``reference`` cannot orient the fit.
    """
    try:
        return await anyio.to_thread.run_sync(
            lambda: solver.calibrate(runs, reference_bias=reference)
        )
    except solver.UnidentifiableDesign as exc:
        raise UnidentifiableRequest(
            f"these runs cannot identify a bias profile: {exc}", param="num_prompts"
        ) from None
    except solver.InvalidReference:
        raise
    except solver.SolverError as exc:
        # E.g. every run's scores were equal (nothing to fit): the input's fault, not a 500.
        raise InvalidRequest(f"these runs cannot give a bias profile: {exc}") from None


async def assess_trust(
    runs: list[tuple[np.ndarray, np.ndarray]],
    placement_slots: int,
    rules: trust_rules.TrustRules,
) -> ProfileTrust | None:
    """``solver.trust``'s figures for pruned-random ``runs`` (what ``auto`` needs to place by
    the profile without measuring), judged by ``rules`` (the operator's ``auto_*``
    thresholds, ``learning.rules_of``), in a worker thread; ``None`` when they cannot be
    computed (ragged prompts, a failed fit): the profile is then stored without them."""
    try:
        found = await anyio.to_thread.run_sync(
            lambda: trust_rules.assess(runs, placement_slots=placement_slots, rules=rules)
        )
    except solver.SolverError as exc:
        log.info("no trust figures for this calibration: %s", exc)
        return None
    return to_profile_trust(found, "calibration")


def _store(
    reorderer: Reorderer,
    template: str,
    prof: solver.Profile,
    source: str,
    oriented_by: str | None = None,
    *,
    trust: ProfileTrust | None = None,
) -> StoredProfile:
    return reorderer.profiles.put(
        model=reorderer.backend.model_id,
        template=template,
        coefficients=[float(c) for c in prof.coefficients],
        identification=prof.identification,
        runs=prof.runs,
        prompts=prof.prompts,
        r2=prof.r2,
        source=source,
        oriented_by=oriented_by,
        trust=trust,
    )
