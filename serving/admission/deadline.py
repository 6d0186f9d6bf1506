"""A request's deadline as one value, made once when its work starts and passed to every check
that prices work against it: admission's estimates, a refusal's ``Retry-After``, the parts of a
long call, and the 504."""

from __future__ import annotations

import time
from dataclasses import dataclass

from service.config.settings import Settings


@dataclass(frozen=True)
class Deadline:
    """When a request must be answered, how long it had, and which setting said so."""

    at: float
    """``time.monotonic()`` by which the request must be answered."""
    length_s: float
    """Its whole length: what the request's own work may take on an idle engine, and what a
    retry gets afresh (a refusal's ``Retry-After`` is priced against it)."""
    setting: str
    """The setting it comes from, named in refusals and in the 504 so that the caller knows
    what to raise."""

    @classmethod
    def starting_now(cls, length_s: float, setting: str) -> Deadline:
        """``length_s`` from now, set by ``setting``."""
        return cls(time.monotonic() + length_s, length_s, setting)

    @classmethod
    def of_request(cls, settings: Settings) -> Deadline:
        """A reorder or rerank request's (each item of a batch's too): ``request_timeout_s``
        from now."""
        return cls.starting_now(settings.request_timeout_s, "request_timeout_s")

    @classmethod
    def of_calibration(cls, settings: Settings) -> Deadline:
        """A calibration's: ``calibration_timeout_s`` from now."""
        return cls.starting_now(settings.calibration_timeout_s, "calibration_timeout_s")

    def left_s(self, now: float) -> float:
        """Seconds left at monotonic time ``now`` (negative once passed)."""
        return self.at - now

    @property
    def named(self) -> str:
        """``request_timeout_s = 120 s``: what a message names."""
        return f"{self.setting} = {self.length_s:g} s"
