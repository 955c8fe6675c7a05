"""XLA's all-reduce combiner, as the plan's predicted step time sees it.

XLA merges all-reduces over the same device group that do not depend on each other into one
all-reduce of a tuple (``AllReduceCombiner``; on CPU devices the all-gathers and reduce-scatters
stay separate, as the compiled HLO shows). The step then pays one collective launch for the
merged call instead of one per all-reduce: a data-parallel step's dozens of gradient all-reduces
cost one launch. The bytes still all move. The pass runs on every computation, loop bodies
included: a gradient-accumulation scan's per-microbatch all-reduces merge into one per iteration
(checked on XLA:CPU, jax 0.10.2).

Model: the step's top level and each scan body are *regions*; a region runs ``count`` times per
step (1 at the top, the product of the enclosing scans' trip counts in a body). An op's *level* is
the largest number of all-reduces on any path from its region's inputs to it. All-reduces at one
level of one region over one group are mutually independent (were one an ancestor of another its
level would be lower), so the combiner can merge them: each such set pays one
``collective_launch_s`` per execution, and the others' launches are refunded
(``launch_refund_s``). The ILP prices the same sets (``launch_terms``), with levels read off its
start. GPU profiles have ``collective_launch_s = 0`` (NCCL's per-step latency carries the whole
alpha term), so the refund is zero on them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ir.graph import Graph


def regions(graph: Graph) -> dict[int, tuple[int, int]]:
    """Op id -> (region, how often the region runs per step): region 0 is the top level, each
    scan body its own (other bodies, whose trip count the graph does not know, are left out)."""
    out: dict[int, tuple[int, int]] = {}
    count = [0]

    def walk(ops, region: int, runs: int) -> None:
        for op in ops:
            out[op.id] = (region, runs)
            if op.prim == "scan" and op.regions:
                count[0] += 1
                walk(op.regions[0].ops, count[0], runs * max(op.trip_count, 1))

    walk(graph.ops, 0, 1)
    return out


def levels(graph: Graph, reduces_after: set[int]) -> dict[int, int]:
    """Op id (top level and scan bodies) -> how many all-reduces lie on the longest path from
    its region's inputs to it (an op in ``reduces_after`` adds one for the ops that read its
    results)."""
    level: dict[int, int] = {}

    def walk(ops) -> None:
        out_level: dict[int, int] = {}   # value id -> level of the data it carries
        for op in ops:
            lv = max((out_level.get(v, 0) for v in op.ins), default=0)
            level[op.id] = lv
            for v in op.outs:
                out_level[v] = lv + (op.id in reduces_after)
            if op.prim == "scan" and op.regions:
                walk(op.regions[0].ops)

    walk(graph.ops)
    return level


def launch_refund_s(graph: Graph, reduces: Iterable[tuple[int, tuple[str, ...], float]],
                    launch_s: float) -> float:
    """Seconds of collective launches the combiner saves.

    Args:
      graph: the traced step.
      reduces: ``(op id, group axes, executions per step)`` of every all-reduce the plan
        issues, the op being the one that issues it or that reads its result. One whose count
        is not its region's (a folded layer's, which stands for several) is left alone.
      launch_s: the hardware's ``collective_launch_s``.
    """
    reduces = list(reduces)
    if launch_s <= 0 or len(reduces) < 2:
        return 0.0
    where = regions(graph)
    lv = levels(graph, {op for op, _, _ in reduces})
    sets: Counter = Counter()
    for op, axes, count in reduces:
        region, runs = where.get(op, (None, 0))
        if region is not None and count == runs:
            sets[(region, lv.get(op, 0), tuple(sorted(axes)), runs)] += 1
    return launch_s * sum(runs * (k - 1) for (_, _, _, runs), k in sets.items())


def launch_terms(prob, choice, launch_s: float) -> dict[int, list[tuple[int, frozenset]]]:
    """The combiner's refund as the ILP can price it: per root group (``Problem.root``), per
    strategy, ``(n, keys)``: how many all-reduce executions per step its groups' ops issue under
    it, and the merge sets ``(region, level, axes, runs)`` they join. The ILP charges each such
    all-reduce without its launch and each non-empty set ``runs`` launches, which is what the
    assembled plan pays.

    Levels are read off ``choice`` (the solve's start): an all-reduce that another plan would
    add or remove shifts the levels after it, which this approximates by the start's; the
    assembled plan's figures (``launch_refund_s``) use the plan's own. Edge transitions'
    all-reduces keep their launch in the ILP (an over-estimate the assembled cost corrects).
    Empty when ``launch_s`` is 0 (GPU profiles)."""
    if launch_s <= 0:
        return {}
    sites = _sites(prob)
    issued = {op_id for g, r, op_id, axes, _ in sites if axes[choice[g]]}
    lv = levels(prob.graph, issued)
    out: dict[int, list] = {}
    for _g, r, op_id, axes, (region, runs) in sites:
        per = out.setdefault(r, [(0, frozenset())] * len(axes))
        level = lv.get(op_id, 0)
        out[r] = [(n + runs * len(a), keys | {(region, level, x, runs) for x in a}) if a
                  else (n, keys) for (n, keys), a in zip(per, axes)]
    return out


def _sites(prob) -> list[tuple]:
    """(group, root, op id, per strategy: the axes of each all-reduce it issues, (region, runs))
    of every op issuing an all-reduce over more than one device under some strategy, top level
    and scan bodies (memoised on the problem: the same for every start)."""
    key = tuple(sorted(prob.ties.items()))
    hit = prob.memo.launch_sites
    if hit is not None and hit[0] == key:
        return hit[1]
    where = regions(prob.graph)
    memo: dict[int, list] = {}          # id(per-op strategies) -> per strategy: reduce axes
    out = []
    for g in prob.groups:
        for op_id, per_i in g.members.items():
            region = where.get(op_id)
            if region is None or g.mults.get(op_id, 1.0) != region[1]:
                continue
            axes = memo.get(id(per_i))
            if axes is None:
                axes = memo[id(per_i)] = [tuple(
                    tuple(sorted(c.axes)) for c in st.comms if c.kind == "all-reduce"
                    and _group(c.axes, prob.mesh) > 1) for st in per_i]
            if any(axes):
                out.append((g.id, prob.root(g.id), op_id, axes, region))
    prob.memo.launch_sites = (key, out)
    return out


def _group(axes, mesh) -> int:
    n = 1
    for a in axes:
        n *= mesh.get(a, 1)
    return n
