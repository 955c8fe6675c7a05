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

from autopar.planner.problem import Problem, value_bytes
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
    held = list(g.inputs) + list(g.consts) + _results(prob)
    resident = sum(nbytes(v) for v in dict.fromkeys(held))
    live = np.zeros(len(g.ops) + 1)
    for v, a, b in _temporaries(prob):
        live[a: b + 1] += nbytes(v)
    for t, ids in _body_peaks(prob).items():
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


def _temporaries(prob: Problem) -> list[tuple[int, int, int]]:
    """(value, first, last position) of each top-level temporary a kernel writes."""
    g, fusion = prob.graph, prob.fusion
    resident = set(g.inputs) | set(g.outputs)
    pos, last = {}, {}
    for t, op in enumerate(g.ops):
        for v in op.outs:
            if v in fusion.materialized and v not in resident and v not in fusion.constants:
                pos[v] = t
        for v in op.ins:
            last[v] = t
    return [(v, a, last.get(v, a)) for v, a in pos.items()]


def _results(prob: Problem) -> list[int]:
    g = prob.graph
    aliased = {g.outputs[j] for j, k in prob.output_pairs.items() if g.donated[k]}
    return [v for v in g.outputs if v not in aliased]


def _body_peaks(prob: Problem) -> dict[int, list[int]]:
    from autopar.planner.problem import _body_peak

    return {t: _body_peak(prob.graph, op, prob.fusion)[0]
            for t, op in enumerate(prob.graph.ops) if op.regions}


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
