"""XLA's reduce-scatter creator, as the plan's figures see it.

An all-reduce whose every reader takes its result split over the reduced axes by a local slice
is turned by XLA into a reduce-scatter (``ReduceScatterCreator``): the replicated sum is never
made, each device receives its slice. The planner represents that plan as an op strategy that
all-reduces and edges that slice; the assembled plan prices and reports it as the reduce-scatter
XLA runs (``planner._collectives``) and the memory model sizes the result by its slice
(``memory.estimate``). The ILP prices it as written, all-reduce plus slices.
"""
from __future__ import annotations

from autopar.planner.problem import Problem
from autopar.planner.reshard import reshard_steps


def scattered(prob: Problem, g, op_id: int, i: int, axes, choice) -> bool:
    """Does every reader of ``op_id``'s all-reduced result (group ``g`` under strategy ``i``)
    take it split over ``axes`` by local slices alone (no reader in its own group, not a result
    of the step)?"""
    op = prob.graph.op(op_id)
    if len(op.outs) != 1:
        return False
    v = op.outs[0]
    readers = _edges_by_value(prob).get(v)
    if not readers or v in prob.graph.outputs or any(
            m != op_id and m >= 0 and v in prob.graph.op(m).ins for m in g.members):
        return False
    have = g.shard[v][i]
    for e in readers:
        need = e.need[choice[e.dst]]
        steps = reshard_steps(have, need, prob.mesh)
        if not steps or any(st.kind != "slice" for st in steps):
            return False
        added = {a for d in need for a in d} - {a for d in have for a in d}
        if not set(axes) <= added:
            return False
    return True


def last_reduce(comms):
    """The one of an op's collectives that XLA may make a reduce-scatter of: its last
    all-reduce (a sum over several split dims is all-reduced dim by dim, each all-reduce read
    only by the next: ``rules._all_reduces``), or None."""
    return next((c for c in reversed(comms) if c.kind == "all-reduce"), None)


def scattered_values(prob: Problem, choice) -> dict[int, int]:
    """Value -> the device count its all-reduce scatters it over, for every all-reduced result
    XLA makes a reduce-scatter of under ``choice``."""
    out = {}
    for v, (g, op_id) in _reduced(prob).items():
        grp = prob.groups[g]
        i = choice[g]
        c = last_reduce(grp.members[op_id][i].comms)
        if c is not None and scattered(prob, grp, op_id, i, c.axes, choice):
            n = 1
            for a in c.axes:
                n *= prob.mesh[a]
            out[v] = n
    return out


def _reduced(prob: Problem) -> dict[int, tuple[int, int]]:
    """Value -> (group, op) of every single-result op with an all-reduce among its strategies."""
    hit = prob.memo.all_reduced
    if hit is None:
        hit = prob.memo.all_reduced = {}
        for g in prob.groups:
            for op_id, per_i in g.members.items():
                if op_id < 0 or not any(c.kind == "all-reduce" for st in per_i
                                        for c in st.comms):
                    continue
                outs = prob.graph.op(op_id).outs
                if len(outs) == 1:
                    hit[outs[0]] = (g.id, op_id)
    return hit


def _edges_by_value(prob: Problem) -> dict[int, list]:
    hit = prob.memo.edges_by_value
    if hit is None:
        hit = prob.memo.edges_by_value = {}
        for e in prob.edges:
            hit.setdefault(e.value, []).append(e)
    return hit
