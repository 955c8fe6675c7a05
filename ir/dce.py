"""Dead-op elimination: drop ops whose results nothing uses, as XLA does on import.

``jax.make_jaxpr`` keeps dead equations (``_ = mul a 3.0``, unused jvp residuals); XLA drops them
before it counts or runs anything, so the planner must not pay for them either. Ops with side
effects (listed in ``keep``) always stay. Region bodies are cleaned relative to their outputs;
a loop's own outputs are never dropped from its body (the loop carries them).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ir.graph import Graph, Op, Region


def eliminate_dead_ops(graph: Graph, keep: frozenset[int] = frozenset()) -> Graph:
    """Returns ``graph`` without ops that feed no output; ``keep`` lists op ids to keep anyway."""
    ops = _sweep(graph.ops, set(graph.outputs), keep)
    return dataclasses.replace(graph, ops=ops)


def _sweep(ops: tuple[Op, ...], live: set[int], keep: frozenset[int]) -> tuple[Op, ...]:
    """Backward pass over ``ops``; ``live`` holds the value ids needed after them (updated)."""
    kept: list[Op] = []
    for op in reversed(ops):
        if op.id not in keep and not any(v in live for v in op.outs):
            continue
        if op.regions:
            op = dataclasses.replace(op, regions=tuple(_clean(r, keep) for r in op.regions))
        live.update(op.ins)
        kept.append(op)
    return tuple(reversed(kept))


def _clean(region: Region, keep: frozenset[int]) -> Region:
    return dataclasses.replace(region, ops=_sweep(region.ops, set(region.outputs), keep))


def effectful(ops: Iterable[Op], effect_ids: Iterable[int]) -> frozenset[int]:
    """Op ids to keep: those with effects and the region ops that contain them."""
    ids = set(effect_ids)
    if not ids:
        return frozenset()
    return frozenset(op.id for op in ops if op.id in ids or _contains(op, ids))


def _contains(op: Op, ids: set[int]) -> bool:
    return any(o.id in ids or _contains(o, ids) for r in op.regions for o in r.ops)
