"""Synthetic truth for solver tests: known utilities and bias, controlled noise."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray


def bias_shape(name: str, slots: int) -> NDArray[np.float64]:
    x = np.linspace(-1.0, 1.0, slots) if slots > 1 else np.zeros(1)
    shapes = {
        "primacy": 1.0 / np.arange(1, slots + 1),
        "U": 0.5 + x**2,
        "recency": (1.0 / np.arange(1, slots + 1))[::-1],
    }
    a = np.asarray(shapes[name], dtype=np.float64)
    return a / a.sum()


def synthesize(
    perms: NDArray[np.int64],
    utilities: NDArray[np.float64],
    bias: NDArray[np.float64],
    noise: float,
    rng: np.random.Generator,
    offset: float = -30.0,
) -> NDArray[np.float64]:
    """s_i = offset + sum_j a_j u[pi_i(j)] + noise * std(signal) * N(0, 1)."""
    n = utilities.shape[0]
    u_ext = np.append(utilities, 0.0)
    signal = u_ext[np.where(perms >= 0, perms, n)] @ bias[: perms.shape[1]]
    return offset + signal + noise * signal.std() * rng.standard_normal(signal.shape[0])


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
