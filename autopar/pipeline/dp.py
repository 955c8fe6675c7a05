"""Layer ranges of pipeline stages: a dynamic program in the manner of Alpa's inter-op pass.

Notation: ``L`` layers, ``S`` stages, ``M`` microbatches. Stage ``k`` runs the contiguous range
``[i_k, i_{k+1})`` (``i_0 = 0``, ``i_S = L``, every range non-empty). ``t(i, j)``: seconds one
microbatch's forward and backward spend in layers ``[i, j)`` on a stage (the embedding counts at
``i = 0``, the head at ``j = L``); ``m_k(i, j)``: bytes per device of stage ``k`` holding them
under its schedule; ``h_k``: seconds one microbatch's activation and cotangent take over the link
between stages ``k`` and ``k + 1``. The objective is Alpa's pipeline latency

    F = sum_k t_k + sum_k h_k + (M - 1) max_k t_k        subject to m_k <= budget

(the first microbatch crosses every stage and link, the other ``M - 1`` follow at the pace of the
slowest stage). Alpa's algorithm: for a cap ``c`` on the slowest stage, the DP

    f_S(L) = 0,   f_k(i) = min_{j > i, t(i, j) <= c, m_k(i, j) <= budget} t(i, j) + f_{k+1}(j)

gives the least ``sum_k t_k`` of any split whose stages all take at most ``c``; then
``F* = min_c f_0(0) + sum h + (M - 1) c`` over the caps ``c`` in ``{t(i, j)}``. It is exact: the
optimal split's own slowest stage is one of the caps. Feasibility grows with ``c``, so the
smallest feasible cap is found by bisection, and larger caps are tried until
``(M - 1) c + min sum`` cannot beat the best ``F``; with additive stage times ``sum_k t_k`` is the
same for every split and the first feasible cap wins.

``allowed`` restricts the ranges to those a runtime can run (``equal_lengths``). Stage times here
come from ``autopar.pipeline.planning`` (the intra-op plans of one layer, the embedding and the
head); ``planning`` re-prices the chosen split on the schedule's exact lockstep timeline.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    """``time[i, j]`` = ``t(i, j)`` and ``memory[k, i, j]`` = ``m_k(i, j)`` for ``0 <= i < j <=
    layers`` (other entries ignored); ``hop_s[k]``: the link after stage ``k``."""

    layers: int
    stages: int
    microbatches: int
    time: np.ndarray                 # (L + 1, L + 1) seconds
    memory: np.ndarray               # (S, L + 1, L + 1) bytes per device
    budget: float = math.inf
    hop_s: tuple[float, ...] = ()
    allowed: np.ndarray | None = None   # (L + 1, L + 1) bool: ranges the runtime can run


@dataclasses.dataclass(frozen=True)
class Split:
    ranges: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    objective_s: float               # F above


def build(layers: int, stages: int, microbatches: int, time_of: Callable, memory_of: Callable,
          budget: float = math.inf, hop_s: Sequence[float] = (),
          allowed: Callable | None = None) -> Problem:
    """A ``Problem`` from ``time_of(i, j)``, ``memory_of(k, i, j)`` and ``allowed(i, j)``, each
    called once on broadcast integer arrays (numpy operators, no ``if``)."""
    n = layers + 1
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    upper = j > i
    time = np.where(upper, np.broadcast_to(time_of(i, j), (n, n)), np.inf)
    k = np.arange(stages)[:, None, None]
    memory = np.where(upper[None], np.broadcast_to(memory_of(k, i[None], j[None]),
                                                   (stages, n, n)), np.inf)
    ok = upper & (True if allowed is None else np.broadcast_to(allowed(i, j), (n, n)))
    hops = tuple(float(h) for h in hop_s) or (0.0,) * (stages - 1)
    if len(hops) != stages - 1:
        raise ValueError(f"hop_s needs one entry per boundary ({stages - 1}), got {len(hops)}")
    return Problem(layers, stages, microbatches, time.astype(float), memory.astype(float),
                   budget, hops, ok)


def equal_lengths(layers: int, stages: int) -> Callable:
    """Only ``layers / stages`` consecutive layers per stage (what the runtime runs)."""
    return lambda i, j: (j - i == layers // stages) & (layers % stages == 0)


def objective(p: Problem, ranges: Sequence[tuple[int, int]]) -> float:
    ts = [float(p.time[i, j]) for i, j in ranges]
    return sum(ts) + sum(p.hop_s) + (p.microbatches - 1) * max(ts)


def _usable(p: Problem, cap: float) -> np.ndarray:
    """(S, L + 1, L + 1): stage ``k`` may run ``[i, j)`` under ``cap``."""
    upper = np.triu(np.ones((p.layers + 1,) * 2, bool), 1)
    ok = upper & (p.time <= cap) & (p.allowed if p.allowed is not None else True)
    return ok[None] & (p.memory <= p.budget)


def _min_sum(p: Problem, cap: float) -> tuple[float, list[tuple[int, int]] | None]:
    """``f_0(0)`` under ``cap`` and its split (``None``: no split fits)."""
    use = _usable(p, cap)
    t = np.where(use, p.time[None], np.inf)                # (S, L + 1, L + 1)
    f = np.full(p.layers + 1, np.inf)
    f[p.layers] = 0.0
    choice = np.zeros((p.stages, p.layers + 1), int)
    for k in range(p.stages - 1, -1, -1):
        total = t[k] + f[None, :]                           # (i, j)
        choice[k] = np.argmin(total, axis=1)
        f = total[np.arange(p.layers + 1), choice[k]]
    if not np.isfinite(f[0]):
        return math.inf, None
    ranges, i = [], 0
    for k in range(p.stages):
        j = int(choice[k, i])
        ranges.append((i, j))
        i = j
    return float(f[0]), ranges


def solve(p: Problem) -> Split | None:
    """The split of least ``F`` under the budget (``None``: no split fits)."""
    caps = np.unique(p.time[np.isfinite(p.time)])
    lo, hi = 0, len(caps) - 1
    if p.stages > p.layers or _min_sum(p, caps[hi])[1] is None:
        return None
    while lo < hi:                                          # smallest feasible cap
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _min_sum(p, caps[mid])[1] is not None else (mid + 1, hi)
    floor_sum = _min_sum(p, caps[-1])[0]
    best: tuple[float, list] | None = None
    for cap in caps[lo:]:
        if best is not None and (p.microbatches - 1) * cap + floor_sum >= best[0]:
            break
        _, ranges = _min_sum(p, cap)
        if ranges is not None:
            f = objective(p, ranges)
            if best is None or f < best[0]:
                best = (f, ranges)
    assert best is not None
    return _split(p, best[1])


def _split(p: Problem, ranges) -> Split:
    ranges = tuple((int(i), int(j)) for i, j in ranges)
    return Split(ranges, tuple(float(p.time[i, j]) for i, j in ranges),
                 tuple(float(p.memory[k, i, j]) for k, (i, j) in enumerate(ranges)),
                 objective(p, ranges))


def brute_force(p: Problem) -> Split | None:
    """Every split tried (for tests): the least ``F`` under the budget."""
    best = None
    for cuts in itertools.combinations(range(1, p.layers), p.stages - 1):
        bounds = (0, *cuts, p.layers)
        ranges = list(zip(bounds[:-1], bounds[1:]))
        if any(p.memory[k, i, j] > p.budget or (p.allowed is not None and not p.allowed[i, j])
               for k, (i, j) in enumerate(ranges)):
            continue
        f = objective(p, ranges)
        if best is None or f < best[0]:
            best = (f, ranges)
    return None if best is None else _split(p, best[1])
