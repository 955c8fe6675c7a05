"""Per-device peak memory of a chosen plan, counted the way XLA allocates it.

XLA gives a step's arguments and results buffers of their own for the whole execution (a
result that aliases a donated argument shares its buffer) and serves every other buffer from
one pool of temporaries, whose size is the largest set of temporaries live at once. So the
footprint ``memory_analysis()`` reports is arguments + results + temporaries - aliases, and
that is what ``estimate`` predicts:

  * resident: the per-device bytes of arguments, constants and non-aliased results under the
    chosen layouts;
  * temporaries, walked over the top-level schedule: every value a kernel writes to memory
    (``ir.fusion``; fused intermediates never exist) from its producer to its last reader, in
    its chosen layout; every resharded copy a transition makes (a value moved to the layout a
    reader needs, shared by all readers that need the same layout, as XLA shares identical
    reshards) from its first to its last reader; and, at a loop's position, the values live at
    the peak of its body.

Known gaps, measured by ``autopar.verify`` (README, "verify"): XLA's buffer assignment may put a
temporary that dies before a result is written into that result's space, so data-parallel
plans, whose temporaries die early, are over-predicted (up to ~20%); XLA's scheduler and its
collectives' own buffers are not modelled, so plans with many transitions are under-predicted
(up to ~45% on the unrolled test GPT under megatron).

The ILP's memory constraint (``ilp.memory_exprs``) is the linear part of this model: it checks
the live values at the heaviest points of the schedule but cannot see resharded copies, whose
existence depends on two groups' choices at once; ``make_plan`` compares the full estimate with
the budget after solving and says so when only the copies break it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.planner.problem import Problem, body_peaks, temporaries, value_bytes
from autopar.sharding import shard_factor


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    resident: float          # arguments, constants and non-aliased results, per device
    temporaries: float       # the peak of the temporaries' pool, per device
    peak_position: int       # top-level schedule position of that peak

    @property
    def peak(self) -> float:
        return self.resident + self.temporaries


def estimate(prob: Problem, choice) -> MemoryEstimate:
    """The per-device memory of ``prob`` under ``choice`` (group id -> strategy index)."""
    g = prob.graph
    nbytes = _sizer(prob, choice)
    resident = sum(nbytes(v) for v in prob.const_values)
    temps, inner = _schedule(prob)
    live = np.zeros(len(g.ops) + 1)
    for v, a, b in temps:
        live[a: b + 1] += nbytes(v)
    for t, (ids, _) in inner.items():
        live[t] += sum(nbytes(v) for v in ids)
    for a, b, size in _reshard_copies(prob, choice):
        live[a: b + 1] += size
    t = int(live.argmax()) if len(live) else 0
    return MemoryEstimate(float(resident), float(live[t]) if len(live) else 0.0, t)


def _sizer(prob: Problem, choice):
    def nbytes(v: int) -> float:
        if v in prob.group_of_value:
            return float(value_bytes(prob, v)[choice[prob.group_of_value[v]]])
        return float(prob.graph.values[v].nbytes)
    return nbytes


def _positions(prob: Problem) -> dict[int, int]:
    """Op id -> the top-level schedule position it runs at (nested ops: their loop's)."""
    memo = prob.__dict__.get("_positions")
    if memo is None:
        memo = {}
        for t, op in enumerate(prob.graph.ops):
            stack = [op]
            while stack:
                o = stack.pop()
                memo[o.id] = t
                stack.extend(x for r in o.regions for x in r.ops)
        prob.__dict__["_positions"] = memo
    return memo


def _schedule(prob: Problem):
    """The plan-independent part: top-level temporaries and loop-body peaks (``problem.build``
    stores them; a restricted copy of the problem recomputes them once)."""
    memo = prob.__dict__.get("_schedule")
    if memo is None:
        memo = prob.__dict__["_schedule"] = (temporaries(prob.graph, prob.fusion),
                                             body_peaks(prob.graph, prob.fusion))
    return memo


def _reshard_copies(prob: Problem, choice) -> list[tuple[int, int, float]]:
    """(first, last position, per-device bytes) of each resharded copy the plan makes."""
    where = _positions(prob)
    out = []
    for es in prob.edge_sets():
        src = prob.groups[es[0].src].shard[es[0].value][choice[es[0].src]]
        readers: dict = {}
        for e in es:
            need = e.need[choice[e.dst]]
            if need != src and e.op >= 0:
                readers.setdefault(need, []).append(where[e.op])
        t = prob.graph.values[es[0].value]
        for need, at in readers.items():
            out.append((min(at), max(at), t.nbytes / shard_factor(need, prob.mesh)))
    return out
