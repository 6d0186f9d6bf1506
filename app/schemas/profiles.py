"""The bias-profile routes' wire models: calibration requests, stored profiles with
their trust, the traffic sample and the positional profiles.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from app.schemas.base import (
    MAX_CALIBRATION_QUERIES,
    MAX_NUM_PROMPTS,
    MAX_PASSAGES,
    MAX_SEED,
    PassageItem,
    QueryText,
    _Model,
    _Strict,
)


class CalibrationQueryIn(_Strict):
    """One query of a calibration set with its passages (in any order: the design permutes
    them)."""

    query: QueryText
    passages: list[PassageItem] = Field(min_length=2, max_length=MAX_PASSAGES)


class CalibrateBody(_Strict):
    """`POST /v1/bias-profiles/calibrate`: fit one bias profile shared by these queries."""

    queries: list[CalibrationQueryIn] | None = Field(
        default=None, min_length=1, max_length=MAX_CALIBRATION_QUERIES
    )
    """Every query must have the same number of passages N: the profile is for that slot
    count (`random`) or for `prompt_passages` slots (`pruned_random`). Either `queries` or
    `from_traffic`."""
    from_traffic: bool = False
    """Calibrate from the live MoI runs this replica sampled (`traffic_sample_rate`; with
    `traffic_sample_dir`, every replica's) instead of scoring queries: no model calls. Needs
    `slots`; `design` picks the sampled runs (`random`: random and hybrid designs of `slots`
    passages, oriented by the stored data profile; `pruned_random`: pruned-random prompts of
    `slots` passages)."""
    slots: int | None = Field(default=None, ge=2, le=MAX_PASSAGES)
    """`from_traffic` only: the slot count of the profile."""
    design: Literal["random", "pruned_random"] = "random"
    """`random`: an N-slot profile for cyclic designs at N, oriented by a pruned-random
    profile measured on the same queries (both are stored); `pruned_random`: an L-slot
    profile for `pruned_cyclic` at L."""
    prompt_passages: int | None = Field(default=None, ge=1, le=MAX_PASSAGES)
    """L, passages per pruned prompt (default ceil(N/2))."""
    num_prompts: int | None = Field(default=None, ge=1, le=MAX_NUM_PROMPTS)
    """Prompts per query of `design` (default: the design's)."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Base seed; query k uses seed + k (default: the configured seed)."""
    template: str | None = Field(default=None, min_length=1, max_length=64)
    """Scoring prompt template the profile is for (default: the configured `chat_template`)."""
    source: str | None = Field(default=None, min_length=1, max_length=256)
    """Provenance stored with the profile (default: the query count and design)."""


class TrustOut(_Model):
    """How far a profile can be trusted: the figures of its assessment (docs/operations.md,
    "The profile-first strategy")."""

    verdict: Literal["shaped", "flat", "undecided"]
    """`shaped`: distinguishable from flat with a stable placement; `flat`: shown flat;
    `undecided`: neither yet. The first two are trusted."""
    reason: str
    runs: int
    """MoI runs it was assessed on."""
    flat_p: float
    """p-value of the test against a flat profile (bootstrap Wald)."""
    spread: float
    """`L (max a - min a)`: how much more the strongest slot weighs than the weakest, as a
    share of the mean slot's weight."""
    spread_upper: float
    """Its bootstrap upper bound (1 - alpha)."""
    stability: float
    """Share of bootstrap refits that place the same two strongest slots first."""
    top_slots: list[int]
    """The strongest slots (0-based), strongest first, when placing `placement_slots`."""
    placement_slots: int
    resamples: int
    source: Literal["traffic", "calibration", "generator_online"]
    """`traffic`: learned by `auto` from live MoI runs; `calibration`: a calibration;
    `generator_online`: learned by `auto` from the generator's own answers to sampled
    requests (`RAG_REORDER_GENERATOR_URL`)."""
    assessed_at: float
    """Unix time of the assessment."""
    trusted_since: float | None
    """Unix time this key's profile became trusted (null while not trusted)."""


class ProfileOut(_Model):
    id: str
    """`<model>__<template>__L<slots>`, characters outside `[A-Za-z0-9._-]` as `_`: the key
    of `GET /v1/bias-profiles/{id}`."""
    model: str
    template: str
    slots: int
    coefficients: list[float]
    identification: str
    runs: int
    prompts: int
    r2: float | None
    source: str
    created_at: float
    """Unix time it was stored."""
    oriented_by: Literal["data", "profile", "prior"]
    """Where its direction came from: `data` (a pruned fit), `profile` (a full-length fit
    oriented by a data profile) or `prior` (the generic primacy shape; can be backwards)."""
    trust: TrustOut | None = None
    """Whether `auto` may place by it without measuring, and why (null: stored without the
    figures, e.g. a full-length calibration: not trusted by `auto`)."""


class TrafficSampleOut(_Model):
    model: str
    template: str
    design: Literal["random", "pruned_random"]
    """`random`: random and hybrid designs (N slots); `pruned_random`: L slots."""
    slots: int
    runs: int


class ProfileList(_Model):
    """`GET /v1/bias-profiles`."""

    object: Literal["list"] = "list"
    data: list[ProfileOut]
    traffic_samples: list[TrafficSampleOut]
    """Live MoI runs a `from_traffic` calibration would pool: this replica's, or with
    `traffic_sample_dir` the latest of every replica's (empty unless `traffic_sample_rate` >
    0)."""


class PositionalProfileOut(_Model):
    """A measured positional profile (Cuconasu et al., 2025) used by `max_relevance` /
    `min_distraction`."""

    kind: Literal["accuracy", "distracting_effect"]
    model: str
    template: str
    slots: int
    values: list[float]
    """One value per prompt slot, first slot first."""
    questions: int
    """Questions the calibration averaged over."""


class CalibrationOut(_Model):
    """`POST /v1/bias-profiles/calibrate`: the stored profile and what it cost."""

    id: str
    profile: ProfileOut
    """The profile now stored (it replaced any earlier one with the same id)."""
    orienting_profile: ProfileOut | None
    """`random` only: the pruned-random profile that gave the direction (also stored)."""
    queries: int
    """Queries scored (or sampled live runs pooled, `from_traffic`)."""
    prompts: int
    """Prompts planned over all queries (or held in the sampled runs)."""
    prompts_failed: int
    prompt_tokens: int
    warnings: list[str]
    total_s: float
