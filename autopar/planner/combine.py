"""XLA's all-reduce combiner, as the plan's predicted step time sees it.

XLA merges all-reduces over the same device group that do not depend on each other into one
all-reduce of a tuple (``AllReduceCombiner``; on CPU devices the all-gathers and reduce-scatters
stay separate, as the compiled HLO shows). The step then pays one collective launch for the
merged call instead of one per all-reduce: a data-parallel step's dozens of gradient all-reduces
cost one launch. The bytes still all move.

Model: an op's *level* is the largest number of all-reduces on any path from the step's inputs
to it. All-reduces at one level over one group are mutually independent (were one an ancestor
of another its level would be lower), so the combiner can merge them: each such set pays one
``collective_launch_s``, and the others' launches are refunded (``launch_refund_s``). All-reduces
inside loop bodies (executed ``count`` times) are left alone. The ILP prices each collective's
launch on its own; only the assembled plan's figures see the refund. GPU profiles have
``collective_launch_s = 0`` (NCCL's per-step latency carries the whole alpha term), so the refund
is zero on them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ir.graph import Graph


def levels(graph: Graph, reduces_after: set[int]) -> dict[int, int]:
    """Top-level op id -> how many all-reduces lie on the longest path from the inputs to it
    (an op in ``reduces_after`` adds one for the ops that read its results)."""
    out_level: dict[int, int] = {}   # value id -> level of the data it carries
    level: dict[int, int] = {}
    for op in graph.ops:
        lv = max((out_level.get(v, 0) for v in op.ins), default=0)
        level[op.id] = lv
        for v in op.outs:
            out_level[v] = lv + (op.id in reduces_after)
    return level


def launch_refund_s(graph: Graph, reduces: Iterable[tuple[int, tuple[str, ...]]],
                    launch_s: float) -> float:
    """Seconds of collective launches the combiner saves.

    Args:
      graph: the traced step.
      reduces: ``(op id, group axes)`` of every all-reduce the plan issues at top level (once
        per step), the op being the one that issues it or that reads its result.
      launch_s: the hardware's ``collective_launch_s``.
    """
    reduces = list(reduces)
    if launch_s <= 0 or len(reduces) < 2:
        return 0.0
    lv = levels(graph, {op for op, _ in reduces})
    sets = Counter((lv.get(op, 0), tuple(sorted(axes))) for op, axes in reduces)
    return launch_s * sum(k - 1 for k in sets.values())


def launch_terms(prob, choice, launch_s: float) -> dict[int, list[tuple[int, frozenset]]]:
    """The combiner's refund as the ILP can price it: per root group (``Problem.root``), per
    strategy, ``(n, keys)``: how many top-level all-reduces its groups' ops issue under it, and
    the merge sets ``(level, axes)`` they join. The ILP charges each such all-reduce without its
    launch and each non-empty set one launch, which is what the assembled plan pays.

    Levels are read off ``choice`` (the solve's start): an all-reduce that another plan would
    add or remove shifts the levels after it, which this approximates by the start's; the
    assembled plan's figures (``launch_refund_s``) use the plan's own. Edge transitions'
    all-reduces keep their launch in the ILP (an over-estimate the assembled cost corrects).
    Empty when ``launch_s`` is 0 (GPU profiles)."""
    if launch_s <= 0:
        return {}
    sites = _sites(prob)
    issued = {op_id for g, r, op_id, axes in sites if axes[choice[g]]}
    lv = levels(prob.graph, issued)
    out: dict[int, list] = {}
    for _g, r, op_id, axes in sites:
        per = out.setdefault(r, [(0, frozenset())] * len(axes))
        level = lv.get(op_id, 0)
        out[r] = [(n + len(a), keys | {(level, x) for x in a}) if a else (n, keys)
                  for (n, keys), a in zip(per, axes)]
    return out


def _sites(prob) -> list[tuple[int, int, int, tuple]]:
    """(group, root, op id, per strategy: the axes of each all-reduce it issues) of every
    top-level op issuing an all-reduce over more than one device under some strategy (memoised
    on the problem: the same for every start)."""
    key = ("_launch_sites", tuple(sorted(prob.ties.items())))
    hit = prob.__dict__.get("_launch_sites")
    if hit is not None and hit[0] == key:
        return hit[1]
    top = {op.id for op in prob.graph.ops}
    memo: dict[int, list] = {}          # id(per-op strategies) -> per strategy: reduce axes
    out = []
    for g in prob.groups:
        for op_id, per_i in g.members.items():
            if op_id not in top or g.mults.get(op_id, 1.0) != 1.0:
                continue
            axes = memo.get(id(per_i))
            if axes is None:
                axes = memo[id(per_i)] = [tuple(
                    tuple(sorted(c.axes)) for c in st.comms if c.kind == "all-reduce"
                    and _group(c.axes, prob.mesh) > 1) for st in per_i]
            if any(axes):
                out.append((g.id, prob.root(g.id), op_id, axes))
    prob.__dict__["_launch_sites"] = (key, out)
    return out


def _group(axes, mesh) -> int:
    n = 1
    for a in axes:
        n *= mesh.get(a, 1)
    return n
