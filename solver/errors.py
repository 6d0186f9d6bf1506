"""Errors the solver raises. All are ``ValueError`` subclasses: they describe bad input data."""

from __future__ import annotations


class SolverError(ValueError):
    """Base class of every solver error."""


class DesignError(SolverError):
    """The permutation array is malformed: bad shape, index out of range, repeated passage."""


class UnidentifiableDesign(SolverError):
    """The design cannot identify what the fit needs (e.g. cyclic without a calibrated profile)."""


class InvalidReference(SolverError):
    """A reference bias profile is unusable: wrong length, negative, non-finite or uniform."""
