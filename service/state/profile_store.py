"""Calibrated position-bias profiles on disk, one per (model, template, slot count).

A profile is what makes cyclic designs usable (docs/method.md): they cannot identify the
bias, so they take it from here. Files are small JSON documents written atomically.

Each profile records where its direction came from (``oriented_by``): ``data`` for profiles
fitted on pruned designs (an absent passage breaks the mirror symmetry, so the data fix the
direction), ``profile`` for full-length (random) calibrations oriented by such a data profile,
and ``prior`` for full-length calibrations oriented by the generic primacy shape (profiles
written before this field existed). A ``prior`` profile can be backwards: the generic prior
says nothing about a model whose bias is recency.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from service.errors import InvalidRequest
from service.state.files import write_atomic
from solver.blind_profile import BlindProfile

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
# A profile's file name (``profile_id`` + ``.json``); other files in the folder (a calibration
# report, an editor's backup) are not profiles.
_PROFILE_FILE = re.compile(r"[A-Za-z0-9._-]+__[A-Za-z0-9._-]+__L[0-9]+\.json")

logger = logging.getLogger(__name__)


TrustVerdict = Literal["shaped", "flat", "undecided"]


@dataclass(frozen=True)
class ProfileTrust:
    """Why a profile may (or may not) be placed by without measuring: ``solver.trust``'s
    figures on the runs it was fitted from, kept with the profile (docs/operations.md)."""

    verdict: TrustVerdict
    """``shaped`` (distinguishable from flat, stable placement), ``flat`` (shown flat) or
    ``undecided``; the first two are trusted."""
    reason: str
    runs: int
    flat_p: float
    """p-value of the test against a flat profile."""
    spread: float
    """``L (max a - min a)``, the relative weight difference of the strongest and weakest slot."""
    spread_upper: float
    """Its bootstrap upper bound (1 - alpha)."""
    stability: float
    """Share of bootstrap fits that place the same top slots."""
    top_slots: tuple[int, ...]
    """The strongest slots (0-based) when placing ``placement_slots`` passages."""
    placement_slots: int
    resamples: int
    covariance: tuple[tuple[float, ...], ...]
    """Bootstrap covariance of the coefficients (the drift test compares against it)."""
    assessed_at: float
    source: str
    """``traffic`` (learned by ``auto``) or ``calibration`` (``POST /v1/bias-profiles/calibrate``
    or ``rag-reorder calibrate``)."""
    learning_since: float | None = None
    """After a drift: only runs from this time (``time.time()``) on are pooled."""
    trusted_since: float | None = None
    """When the profile of this key became trusted (refits keep it; the profile's age)."""

    @property
    def trusted(self) -> bool:
        return self.verdict != "undecided"

    @classmethod
    def of_blind(
        cls, fit: BlindProfile, *, source: str, trusted_since: float | None = None
    ) -> ProfileTrust:
        """The trust of a label-free profile (``solver.blind_profile``), assessed now: the
        offline tool and the online sampler store it alike."""
        return cls(
            verdict=fit.verdict,
            reason=fit.reason,
            runs=round(fit.attributed),
            flat_p=fit.flat_p,
            spread=fit.spread,
            spread_upper=fit.spread_upper,
            stability=fit.stability,
            top_slots=fit.top_slots,
            placement_slots=fit.placement_slots,
            resamples=fit.resamples,
            covariance=fit.covariance,
            assessed_at=time.time(),
            source=source,
            trusted_since=trusted_since,
        )


def _trust_from(data: dict[str, Any]) -> ProfileTrust:
    data = dict(data)
    data["top_slots"] = tuple(int(s) for s in data["top_slots"])
    data["covariance"] = tuple(tuple(float(v) for v in row) for row in data["covariance"])
    return ProfileTrust(**data)


@dataclass(frozen=True)
class StoredProfile:
    """A calibrated profile and where it came from."""

    model: str
    template: str
    slots: int
    coefficients: tuple[float, ...]
    identification: str
    runs: int
    prompts: int
    r2: float | None
    """Share of the prompt log-probabilities the fit explains; ``None`` where there is no
    such fit (a profile learned from the generator's answers) or it was not finite. Stored
    as a JSON number or ``null``, never ``NaN``, so every JSON reader takes the file."""
    source: str
    created_at: float
    oriented_by: str = "prior"
    """``data``, ``profile`` or ``prior`` (module docstring)."""
    trust: ProfileTrust | None = None
    """How far it can be placed by without measuring; ``None`` for profiles stored without
    the figures (full-length calibrations, older files): not trusted by ``auto``."""

    @property
    def id(self) -> str:
        """Stable name of the profile's key (its file name without ``.json``)."""
        return profile_id(self.model, self.template, self.slots)


def profile_id(model: str, template: str, slots: int) -> str:
    """``<model>__<template>__L<slots>`` with every character outside ``[A-Za-z0-9._-]`` as
    ``_``: safe in a URL path segment and as a file name."""
    return f"{_SAFE.sub('_', model)}__{_SAFE.sub('_', template)}__L{slots}"


class ProfileStore:
    """Profiles as ``<root>/<model>__<template>__L<slots>.json``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, model: str, template: str, slots: int) -> Path:
        return self.root / f"{profile_id(model, template, slots)}.json"

    def get(self, model: str, template: str, slots: int) -> StoredProfile | None:
        """The profile for this key, or ``None`` when none was calibrated."""
        p = self.path(model, template, slots)
        if not p.is_file():
            return None
        return _load(p)

    def put(
        self,
        *,
        model: str,
        template: str,
        coefficients: Sequence[float],
        identification: str,
        runs: int,
        prompts: int,
        r2: float | None,
        source: str,
        oriented_by: str | None = None,
        trust: ProfileTrust | None = None,
    ) -> StoredProfile:
        """Store a profile (atomic replace). Raises ``InvalidRequest`` for a bad profile.

        ``oriented_by`` defaults to ``data`` for fully identified (pruned) fits, else ``prior``.
        """
        coef = tuple(float(c) for c in coefficients)
        if not coef or any(c < 0 for c in coef) or abs(sum(coef) - 1.0) > 1e-6:
            raise InvalidRequest("a bias profile needs non-negative coefficients summing to 1")
        prof = StoredProfile(
            model,
            template,
            len(coef),
            coef,
            identification,
            runs,
            prompts,
            finite_or_none(r2),
            source,
            time.time(),
            oriented_by or _default_orientation(identification),
            trust,
        )
        self._write(prof)
        return prof

    def _write(self, prof: StoredProfile) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path(prof.model, prof.template, prof.slots), dump_profile(prof))

    def stamp(self, model: str, template: str, slots: int) -> object:
        """A value that changes whenever this key's stored profile does (``None``: none
        stored); cheap, what ``auto`` polls to see another replica's store."""
        try:
            st = self.path(model, template, slots).stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def list(self) -> list[StoredProfile]:
        """Every stored profile, sorted by model, template and slot count: the files named
        like a profile (``<id>.json``) that load; other files are ignored, damaged ones
        skipped with a warning."""
        if not self.root.is_dir():
            return []
        out: list[StoredProfile] = []
        for path in sorted(self.root.glob("*.json")):
            if not _PROFILE_FILE.fullmatch(path.name):
                continue
            try:
                out.append(_load(path))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                # One damaged file must not take down the listing (GET /v1/bias-profiles)
                # and every lookup by id with it; the profile's own key still fails loudly.
                logger.warning("skipping unreadable bias profile %s: %s", path, exc)
        return sorted(out, key=lambda s: (s.model, s.template, s.slots))

    def by_id(self, profile_id: str) -> StoredProfile | None:
        """The stored profile with this ``id``, or ``None``. Looked up among the listed
        profiles, never by building a path from the caller's string."""
        return next((p for p in self.list() if p.id == profile_id), None)

    def for_slots(self, model: str, template: str, slots: int) -> StoredProfile | None:
        """The profile a placement over ``slots`` uses: this slot count's, else the
        data-oriented one (``orienting``, resampled by the caller); ``None`` if neither."""
        return self.get(model, template, slots) or self.orienting(model, template)

    def orienting(self, model: str, template: str) -> StoredProfile | None:
        """The data-oriented profile (``oriented_by == "data"``) of this model and template
        with the most slots, or ``None``.

        It orients full-length designs of any slot count (resampled by relative position)
        when no profile of their own slot count exists: the direction of a model's bias is
        the same at every prompt length, and a data profile is never backwards.
        """
        found = [
            p
            for p in self.list()
            if p.model == model and p.template == template and p.oriented_by == "data"
        ]
        return max(found, key=lambda p: p.slots) if found else None


class SnapshotProfileStore(ProfileStore):
    """The folder's profiles held in memory: once ``refresh`` has run, reads (``get``,
    ``list``, ``by_id``, ``orienting``, ``stamp``) are dictionary lookups, never a file
    read, a glob or a stat, so the request path does no blocking I/O on the event loop
    (``FolderState`` refreshes it every ``state_refresh_s`` on a thread of its own). Before
    the first ``refresh`` it reads the files, as ``ProfileStore`` does.

    A write goes to the file (atomic, fsynced: call it from a worker thread) and into memory
    at once, so the writer reads its own write; other replicas' writes are seen at the next
    refresh, which re-parses only the files whose time or size changed.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        # id -> (file stamp, profile, write sequence); replaced whole, never mutated, so a
        # reader holds a consistent snapshot without the lock.
        self._view: dict[str, tuple[object, StoredProfile, int]] | None = None
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._last_seq = 0
        self._bad: set[tuple[str, object]] = set()

    @property
    def loaded(self) -> bool:
        """Whether reads come from memory (``refresh`` has run)."""
        return self._view is not None

    def refresh(self) -> None:
        """Read the folder into memory (blocks: a worker thread). Parses only new or
        changed files; an unreadable one is skipped with one warning."""
        with self._lock:
            started = self._last_seq
            old = self._view or {}
        fresh: dict[str, tuple[object, StoredProfile, int]] = {}
        paths = sorted(self.root.glob("*.json")) if self.root.is_dir() else []
        for path in paths:
            if not _PROFILE_FILE.fullmatch(path.name):
                continue
            pid = path.name.removesuffix(".json")
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            prev = old.get(pid)
            if prev is not None and prev[0] == stamp:
                fresh[pid] = prev
                continue
            try:
                fresh[pid] = (stamp, _load(path), 0)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                if (pid, stamp) not in self._bad:  # once per version, not per refresh
                    self._bad.add((pid, stamp))
                    logger.warning("skipping unreadable bias profile %s: %s", path, exc)
        with self._lock:
            # A write made while this refresh read the folder is newer than what it saw.
            for pid, entry in (self._view or {}).items():
                if entry[2] > started:
                    fresh[pid] = entry
            self._view = fresh

    def get(self, model: str, template: str, slots: int) -> StoredProfile | None:
        if self._view is None:
            return super().get(model, template, slots)
        entry = self._view.get(profile_id(model, template, slots))
        return entry[1] if entry is not None else None

    def list(self) -> list[StoredProfile]:
        if self._view is None:
            return super().list()
        return sorted(
            (e[1] for e in self._view.values()), key=lambda s: (s.model, s.template, s.slots)
        )

    def stamp(self, model: str, template: str, slots: int) -> object:
        if self._view is None:
            return super().stamp(model, template, slots)
        entry = self._view.get(profile_id(model, template, slots))
        return entry[0] if entry is not None else None

    def _write(self, prof: StoredProfile) -> None:
        super()._write(prof)
        path = self.path(prof.model, prof.template, prof.slots)
        st = path.stat()
        with self._lock:
            if self._view is not None:
                seq = next(self._seq)
                self._last_seq = seq
                self._view = {**self._view, prof.id: ((st.st_mtime_ns, st.st_size), prof, seq)}


def _default_orientation(identification: str) -> str:
    return "data" if identification == "full" else "prior"


def _load(path: Path) -> StoredProfile:
    return parse_profile(path.read_text())


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN: a value the fit could not estimate is null (the stored documents and
    the API's answers alike)."""
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def dump_profile(prof: StoredProfile) -> str:
    """A profile as its stored JSON document."""
    return json.dumps(asdict(prof), indent=1)


def parse_profile(text: str) -> StoredProfile:
    """A stored JSON document as a profile. Raises ``ValueError``, ``TypeError`` or
    ``KeyError`` for one that is not."""
    data = json.loads(text)
    data["coefficients"] = tuple(float(c) for c in data["coefficients"])
    data.setdefault("oriented_by", _default_orientation(str(data.get("identification"))))
    # Files written before r2 was optional hold ``NaN`` there (Python's JSON reads it).
    data["r2"] = finite_or_none(data.get("r2"))
    if data.get("trust") is not None:
        data["trust"] = _trust_from(data["trust"])
    return StoredProfile(**data)
