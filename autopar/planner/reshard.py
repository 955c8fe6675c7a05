"""The cost of moving a tensor from one sharding to another.

Per mesh axis ``a`` with source dim ``d_s(a)`` and destination dim ``d_t(a)`` (or none):
  * kept in place (same dim, same position) — free;
  * only in the destination — a local slice, free;
  * only in the source — all-gather over ``a``;
  * on another dim — all-to-all over ``a``.
An axis whose position inside a multi-axis dim changes is gathered and sliced again. Gathers are
costed on the bytes after gathering, all-to-alls on the per-device buffer.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from autopar.sharding import Sharding
from ir import TensorType


def _placement(s: Sharding) -> dict[str, tuple[int, tuple[str, ...]]]:
    """axis -> (dim, the axes before it on that dim)."""
    out = {}
    for d, axes in enumerate(s):
        for k, a in enumerate(axes):
            out[a] = (d, axes[:k])
    return out


def reshard_plan(src: Sharding, dst: Sharding) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes to all-gather, axes to all-to-all) to go from ``src`` to ``dst``."""
    ps, pt = _placement(src), _placement(dst)
    gather, a2a = [], []
    for a, (d, before) in ps.items():
        if a not in pt:
            gather.append(a)
        elif pt[a] != (d, before):
            (a2a if pt[a][0] != d and not before and not pt[a][1] else gather).append(a)
    return tuple(gather), tuple(a2a)


def reshard_s(cost_model, t: TensorType, src: Sharding, dst: Sharding,
              mesh: Mapping[str, int]) -> float:
    if src == dst:
        return 0.0
    gather, a2a = reshard_plan(src, dst)
    src_div = math.prod(mesh[a] for d in src for a in d)
    time = 0.0
    if a2a:
        time += cost_model.collective_time_s("all-to-all", t.nbytes / src_div, a2a)
    if gather:
        after = src_div // math.prod(mesh[a] for a in gather)
        time += cost_model.collective_time_s("all-gather", t.nbytes / after, gather)
    return time
