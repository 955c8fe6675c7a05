"""Alpha-beta ring models of the collectives, as pure functions.

Variables: ``n`` devices in the group, ``B`` bytes/s a device sends per direction on the link
(already scaled by efficiencies), ``a`` seconds of latency per ring step, ``S`` = ``nbytes``.

  all-reduce          2(n-1)/n * S/B + 2(n-1) a    S: the per-device buffer (in = out)
  all-gather            (n-1)/n * S/B +  (n-1) a    S: the per-device OUTPUT (gathered) bytes
  reduce-scatter        (n-1)/n * S/B +  (n-1) a    S: the per-device INPUT bytes
  all-to-all            (n-1)/n * S/B +  (n-1) a    S: the per-device buffer
  collective-permute            S/B +        a      S: the bytes each device sends

A group of one device costs 0. ``COLLECTIVE_RULES[kind]`` maps a kind to its formula and
``COLLECTIVE_TERMS[kind]`` to its (latency steps, bandwidth factor) pair, which the profiler
uses as regressors when it fits ``a`` and ``B``.
"""
from __future__ import annotations

from collections.abc import Callable

CollectiveFn = Callable[[float, int, float, float], float]

KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


def all_reduce_terms(n: int) -> tuple[float, float]:
    return 2.0 * (n - 1), 2.0 * (n - 1) / n


def gather_scatter_terms(n: int) -> tuple[float, float]:
    return float(n - 1), (n - 1) / n


def permute_terms(n: int) -> tuple[float, float]:
    return 1.0, 1.0


COLLECTIVE_TERMS: dict[str, Callable[[int], tuple[float, float]]] = {
    "all-reduce": all_reduce_terms,
    "all-gather": gather_scatter_terms,
    "reduce-scatter": gather_scatter_terms,
    "all-to-all": gather_scatter_terms,
    "collective-permute": permute_terms,
}


def ring_time_s(
    kind: str, nbytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Time of one collective of ``kind`` over ``n`` devices (formulas in the module docstring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps, factor = COLLECTIVE_TERMS[kind](n)
    return steps * latency_s + factor * nbytes / bandwidth_bytes_per_s


def all_reduce_time_s(nbytes: float, n: int, bw: float, latency_s: float) -> float:
    return ring_time_s("all-reduce", nbytes, n, bw, latency_s)


def all_gather_time_s(nbytes: float, n: int, bw: float, latency_s: float) -> float:
    return ring_time_s("all-gather", nbytes, n, bw, latency_s)


def reduce_scatter_time_s(nbytes: float, n: int, bw: float, latency_s: float) -> float:
    return ring_time_s("reduce-scatter", nbytes, n, bw, latency_s)


def all_to_all_time_s(nbytes: float, n: int, bw: float, latency_s: float) -> float:
    return ring_time_s("all-to-all", nbytes, n, bw, latency_s)


def collective_permute_time_s(nbytes: float, n: int, bw: float, latency_s: float) -> float:
    return ring_time_s("collective-permute", nbytes, n, bw, latency_s)


COLLECTIVE_RULES: dict[str, CollectiveFn] = {
    "all-reduce": all_reduce_time_s,
    "all-gather": all_gather_time_s,
    "reduce-scatter": reduce_scatter_time_s,
    "all-to-all": all_to_all_time_s,
    "collective-permute": collective_permute_time_s,
}


def hbm_bytes(kind: str, nbytes: float, n: int, major: bool = True) -> float:
    """Bytes a collective and the copies XLA puts around it read and write on one device.

    ``nbytes`` follows the module's conventions. Measured on XLA:CPU (``cost_analysis()``, jax
    0.10; the transposes are the layout changes any backend needs to move contiguous chunks):

      all-reduce          in + out                       = 2 S
      reduce-scatter      all-reduce + local slice       = 2 S + 2 S/n
      all-gather          in + out (gathered dim major)  = S/n + S, three times that when the
                          gathered dim is not the outermost (a transpose before and after)
      all-to-all          (5 + n) S: the exchange and the transposes that make the split and
                          concatenated dims outermost
      collective-permute  in + out                       = 2 S
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all-reduce" or kind == "collective-permute":
        return 2.0 * nbytes
    if kind == "reduce-scatter":
        return 2.0 * nbytes + 2.0 * nbytes / n
    if kind == "all-gather":
        return (nbytes / n + nbytes) * (1.0 if major else 3.0)
    if kind == "all-to-all":
        return (5.0 + n) * nbytes
    raise ValueError(f"collective kind {kind!r} is unknown; use one of {list(KINDS)}")
