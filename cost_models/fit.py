"""Least-squares fits of the cost model's parameters to measurements.

All fits are linear in the unknowns, ``t_i ~ sum_j X_ij c_j`` with ``c >= 0``, and minimise the
*relative* error: row ``i`` is divided by the measured ``t_i``, so a 10 us and a 10 ms benchmark
weigh alike (the planner cares about ratios). Solved by non-negative least squares.

  compute:     t = L + F / P_dtype          (matmul rows)   -> kernel_launch_s, P per dtype
               t = L + M / W                (memory rows)   -> hbm_bytes_per_s
  collectives: t = C + s_k a + f_k S / B_k  (ring terms s_k, f_k of ``COLLECTIVE_TERMS``)
                                                            -> collective_launch_s, latency_s,
                                                               bandwidth B_k per kind

``fit_compute`` and ``fit_collectives`` implement the two systems.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from cost_models.collectives import COLLECTIVE_TERMS
from cost_models.measure import Measurement

# Rates fitted as 1/rate; a zero coefficient (no signal) becomes this huge rate, not a division
# by zero.
_TINY = 1e-30


@dataclasses.dataclass(frozen=True)
class ComputeFit:
    kernel_launch_s: float
    peak_flops_by_dtype: tuple[tuple[str, float], ...]
    hbm_bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class CollectiveFit:
    collective_launch_s: float
    latency_s: float
    bandwidth_by_kind: tuple[tuple[str, float], ...]


def relative_nnls(design: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """Non-negative ``c`` minimising ``sum((design @ c - t)^2 / t^2)``."""
    weights = 1.0 / times_s
    scale = np.maximum(np.abs(design).max(axis=0), _TINY)  # column scaling for conditioning
    coef, _ = nnls(design * weights[:, None] / scale, np.ones_like(times_s))
    return coef / scale


def fit_compute(samples: Sequence[Measurement]) -> ComputeFit:
    """Fits the launch floor, each dtype's matmul rate and the memory bandwidth jointly."""
    dtypes = sorted({s.dtype for s in samples if s.kind == "matmul"})
    cols = ["launch"] + [f"matmul:{d}" for d in dtypes] + ["memory"]
    design = np.zeros((len(samples), len(cols)))
    for i, s in enumerate(samples):
        design[i, 0] = 1.0
        if s.kind == "matmul":
            design[i, cols.index(f"matmul:{s.dtype}")] = s.flops
        else:
            design[i, cols.index("memory")] = s.nbytes
    coef = relative_nnls(design, np.array([s.time_s for s in samples]))
    peaks = tuple((d, 1.0 / max(coef[1 + j], _TINY)) for j, d in enumerate(dtypes))
    return ComputeFit(float(coef[0]), peaks, 1.0 / max(coef[-1], _TINY))


def fit_collectives(samples: Sequence[Measurement]) -> CollectiveFit:
    """Fits a shared fixed cost and per-step latency, and one bandwidth per collective kind."""
    kinds = sorted({s.kind for s in samples})
    design = np.zeros((len(samples), 2 + len(kinds)))
    for i, s in enumerate(samples):
        steps, factor = COLLECTIVE_TERMS[s.kind](s.group_size)
        design[i, 0] = 1.0
        design[i, 1] = steps
        design[i, 2 + kinds.index(s.kind)] = factor * s.nbytes
    coef = relative_nnls(design, np.array([s.time_s for s in samples]))
    bandwidths = tuple((k, 1.0 / max(coef[2 + j], _TINY)) for j, k in enumerate(kinds))
    return CollectiveFit(float(coef[0]), float(coef[1]), bandwidths)
