"""Placement for every strategy that ranks: ``descending_utility``, ``litm``, ``bias_matched``.

A ranking says which passages matter; where they go decides what the generator reads. MoI
places by the bias it fits; every other ranker (pointwise scores, BM25, embeddings, the
retriever) has no bias of its own, so ``bias_matched`` takes the *generator's* calibrated
profile from the profile store: named by the request (``bias_profile``, a ``StoredProfile.id``)
or the setting ``RAG_REORDER_PLACEMENT_PROFILE``, else the profile stored for the scoring model
and template (this slot count, else its data-oriented one). Naming the generator's profile is
what a small scorer for a larger generator needs: utilities from the scorer, bias from the
generator.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

import solver
from service.errors import InvalidRequest, UnidentifiableRequest
from service.runtime import tracing
from service.state.profile_store import StoredProfile
from service.strategies.request import Outcome, ReorderRequest
from service.strategies.work import Work


def named_profile(work: Work, request: ReorderRequest) -> StoredProfile | None:
    """The profile named by the request's ``bias_profile``, else by the setting; ``None`` if
    neither names one.

    Raises:
        InvalidRequest: no stored profile has that id (the message lists the known ids).
    """
    name = request.bias_profile or work.settings.placement_profile
    if name is None:
        return None
    found = work.profiles.by_id(name)
    if found is None:
        known = ", ".join(p.id for p in work.profiles.list()) or "none stored"
        source = "bias_profile" if request.bias_profile else "RAG_REORDER_PLACEMENT_PROFILE"
        raise InvalidRequest(
            f"unknown bias profile {name!r} (from {source}); known: {known}",
            param="bias_profile",
        )
    return found


def generator_profile(work: Work, request: ReorderRequest, slots: int) -> StoredProfile:
    """The bias ``bias_matched`` places a non-MoI ranking by (module docstring).

    Raises:
        InvalidRequest: an unknown named profile.
        UnidentifiableRequest: none named and none stored for the scoring model.
    """
    named = named_profile(work, request)
    if named is not None:
        return named
    stored = work.profiles.for_slots(work.model_id, work.template, slots)
    if stored is None:
        raise UnidentifiableRequest(
            f"placement 'bias_matched' for strategy {request.strategy!r} needs the generator's "
            f"position-bias profile: name one with bias_profile (ids at GET /v1/bias-profiles) "
            f"or calibrate model {work.model_id!r}, template {work.template!r}",
            param="bias_profile",
        )
    return stored


def apply_placement(work: Work, request: ReorderRequest, outcome: Outcome) -> Outcome:
    """Re-place a non-MoI strategy's ranking by ``request.placement`` (unchanged if unset).

    Raises:
        InvalidRequest, UnidentifiableRequest: as ``generator_profile``.
    """
    how = request.placement
    if how is None:
        if request.bias_profile is not None:
            raise InvalidRequest(
                "bias_profile applies with placement 'bias_matched'", param="bias_profile"
            )
        return outcome
    if how != "bias_matched":
        if request.bias_profile is not None:
            raise InvalidRequest(
                f"bias_profile applies with placement 'bias_matched', not {how!r}",
                param="bias_profile",
            )
        with tracing.span("rag_reorder.placement", {"rag_reorder.placement": how}):
            order = solver.place_ranking(outcome.ranking, how)
        return replace(outcome, order=order, placement=how)
    profile = generator_profile(work, request, len(outcome.ranking))
    return placed_by(outcome, outcome.ranking, profile)


def placed_by(outcome: Outcome, ranking: list[int], profile: StoredProfile) -> Outcome:
    """``outcome`` with ``ranking`` placed ``bias_matched`` by ``profile``; the profile's id
    goes to ``details["placement_profile"]``."""
    with tracing.span(
        "rag_reorder.placement",
        {"rag_reorder.placement": "bias_matched", "rag_reorder.profile": profile.id},
    ):
        order = solver.place_ranking(ranking, "bias_matched", np.asarray(profile.coefficients))
    warnings = outcome.warnings
    if profile.oriented_by == "prior":
        warnings = (
            *warnings,
            f"bias profile {profile.id!r} takes its direction from the generic primacy prior; "
            "for a recency-biased generator its placement is reversed",
        )
    details = {**outcome.details, "placement_profile": profile.id}
    return replace(
        outcome, order=order, placement="bias_matched", details=details, warnings=warnings
    )
