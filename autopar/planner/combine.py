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
