"""Moving a tensor from one sharding to another, in steps XLA's partitioner performs directly.

XLA's SPMD partitioner reshards efficiently only in a few shapes of step: a *gather* (drop the
minor-most axes of a dim: all-gather), a *slice* (append minor-most axes to dims: a local
dynamic-slice, free) and an *all-to-all* that moves one axis from the minor end of one dim to the
minor end of another. Any other transition it implements by replicating the tensor and slicing it
again ("Involuntary full rematerialization"). So a transition ``src -> dst`` is planned, costed
and emitted by codegen as a chain of such steps (``reshard_steps``):

  1. per dim, the longest prefix of its axes that already sits where ``dst`` wants it is kept;
  2. of the axes that leave a dim, the major-most one moves by all-to-all when ``dst`` wants it on
     another dim right after that dim's kept prefix; the others are all-gathered, one all-gather
     per dim (XLA emits one per dim), dims with smaller groups first;
  3. the all-to-alls run one axis at a time (a swap of two dims, which could deadlock, gathers
     the smaller axis instead);
  4. a final slice appends the axes ``dst`` adds.

Costs (``reshard_s``): an all-gather is charged on its per-device output bytes, an all-to-all on
its per-device buffer (the ``cost_models`` conventions, which are also how HLO sizes them).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from autopar.sharding import Sharding
from ir import TensorType


@dataclasses.dataclass(frozen=True)
class Step:
    """One resharding step: its collective (``"slice"`` is local), the axes it runs over and the
    layout the tensor has afterwards."""

    kind: str
    axes: tuple[str, ...]
    layout: Sharding


def _wanted(dst: Sharding) -> dict[str, tuple[int, tuple[str, ...]]]:
    """axis -> (dim it sits on in ``dst``, the axes before it there)."""
    return {a: (d, tuple(axes[:k])) for d, axes in enumerate(dst) for k, a in enumerate(axes)}


def _split(src: Sharding, want) -> tuple[list[list[str]], list[list[str]]]:
    """Per dim: the kept prefix and the axes that leave."""
    kept, leaving = [], []
    for d, axes in enumerate(src):
        k = 0
        while k < len(axes) and want.get(axes[k]) == (d, tuple(axes[:k])):
            k += 1
        kept.append(list(axes[:k]))
        leaving.append(list(axes[k:]))
    return kept, leaving


def _moves(kept, leaving, want, gather_extra: set[str]):
    """Simulate the all-to-alls. Returns (candidates moved in order, stuck candidate or None)."""
    cand = {}
    for d, axes in enumerate(leaving):
        if axes and axes[0] not in gather_extra and axes[0] in want and want[axes[0]][0] != d:
            cand[axes[0]] = d
    state = [list(k) + ([leaving[d][0]] if leaving[d] and leaving[d][0] in cand else [])
             for d, k in enumerate(kept)]
    order = []
    pending = dict(cand)
    while pending:
        ready = [a for a, d in pending.items()
                 if tuple(state[want[a][0]]) == want[a][1] and state[d][-1] == a]
        if not ready:
            return order, next(iter(pending))
        a = ready[0]
        state[pending.pop(a)].pop()
        state[want[a][0]].append(a)
        order.append(a)
    return order, None


def reshard_steps(src: Sharding, dst: Sharding, mesh: Mapping[str, int]) -> tuple[Step, ...]:
    """The steps that take a tensor from ``src`` to ``dst`` (empty when they are equal)."""
    if src == dst:
        return ()
    want = _wanted(dst)
    kept, leaving = _split(src, want)
    extra: set[str] = set()
    while True:
        order, stuck = _moves(kept, leaving, want, extra)
        if stuck is None:
            break
        extra.add(stuck)
    moved = set(order)
    steps: list[Step] = []
    state = [list(axes) for axes in src]
    gathers = [(d, [a for a in axes if a not in moved]) for d, axes in enumerate(leaving)]
    gathers = [(d, g) for d, g in gathers if g]
    for d, g in sorted(gathers, key=lambda t: (math.prod(mesh[a] for a in t[1]), t[0])):
        state[d] = [a for a in state[d] if a not in g]
        steps.append(Step("all-gather", tuple(g), _freeze(state)))
    for a in order:
        d = next(i for i, axes in enumerate(state) if a in axes)
        state[d].remove(a)
        state[want[a][0]].append(a)
        steps.append(Step("all-to-all", (a,), _freeze(state)))
    if _freeze(state) != tuple(tuple(x) for x in dst):
        steps.append(Step("slice", (), tuple(tuple(x) for x in dst)))
    return tuple(steps)


def _freeze(state) -> Sharding:
    return tuple(tuple(x) for x in state)


def reshard_plan(src: Sharding, dst: Sharding,
                 mesh: Mapping[str, int] | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes all-gathered, axes moved by all-to-all) on the way from ``src`` to ``dst``."""
    sizes = mesh or {a: 2 for s in (src, dst) for d in s for a in d}
    steps = reshard_steps(src, dst, sizes)
    gather = tuple(a for s in steps if s.kind == "all-gather" for a in s.axes)
    a2a = tuple(a for s in steps if s.kind == "all-to-all" for a in s.axes)
    return gather, a2a


def step_bytes(t: TensorType, step: Step, mesh: Mapping[str, int]) -> float:
    """Per-device bytes of one step as HLO sizes it: an all-gather's output, an all-to-all's
    buffer (the tensor's shard after the step; an all-to-all keeps the shard size)."""
    div = math.prod(mesh[a] for d in step.layout for a in d)
    return t.nbytes / div


def reshard_s(cost_model, t: TensorType, src: Sharding, dst: Sharding,
              mesh: Mapping[str, int]) -> float:
    """Seconds to take ``t`` from ``src`` to ``dst`` along ``reshard_steps``."""
    time = 0.0
    for step in reshard_steps(src, dst, mesh):
        if step.kind != "slice":
            time += cost_model.collective_time_s(step.kind, step_bytes(t, step, mesh), step.axes)
    return time
