"""Shardings of tensors over a named device mesh.

A ``Sharding`` is a tuple with one entry per tensor dimension; each entry is the tuple of mesh
axis names that dimension is split over (major to minor), ``()`` when it is not split. A mesh axis
appears at most once in a sharding. ``("data",), (), ("model",)`` is ``P("data", None, "model")``.
Partial sums are never a value's sharding: the op that makes one reduces it at once (all-reduce or
reduce-scatter), and that collective is part of the op's strategy.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from autopar.errors import ShardingError

Sharding = tuple[tuple[str, ...], ...]


def replicated(rank: int) -> Sharding:
    return ((),) * rank


def used_axes(s: Sharding) -> tuple[str, ...]:
    return tuple(a for dim in s for a in dim)


def shard_factor(s: Sharding, mesh: Mapping[str, int]) -> int:
    return math.prod(mesh[a] for a in used_axes(s))


def divides(s: Sharding, shape: Sequence[int], mesh: Mapping[str, int]) -> bool:
    return all(size % math.prod(mesh[a] for a in dim) == 0 for dim, size in zip(s, shape))


def to_spec(s: Sharding) -> PartitionSpec:
    entries = [None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in s]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def fmt(s: Sharding) -> str:
    """Compact text: ``S(data)xRxS(model)``; ``R`` for a replicated dim, ``-`` for a scalar."""
    if not s:
        return "-"
    return "x".join("R" if not d else "S(" + ",".join(d) + ")" for d in s)


def enumerate_shardings(shape: Sequence[int], mesh: Mapping[str, int],
                        max_axes_per_dim: int = 2) -> list[Sharding]:
    """Every sharding of ``shape``: each mesh axis of size > 1 goes to one dim or none.

    Axes keep mesh order inside a dim. Only shardings whose dims divide evenly are kept.
    """
    axes = [a for a, n in mesh.items() if n > 1]
    out: list[Sharding] = []
    for choice in itertools.product(range(-1, len(shape)), repeat=len(axes)):
        dims: list[list[str]] = [[] for _ in shape]
        for axis, d in zip(axes, choice):
            if d >= 0:
                dims[d].append(axis)
        if any(len(d) > max_axes_per_dim for d in dims):
            continue
        s = tuple(tuple(d) for d in dims)
        if divides(s, shape, mesh):
            out.append(s)
    return out


# ---- layouts given as data (a plan's JSON, a strategy's pins), checked ------------------------
def layout(value: Any, mesh: Mapping[str, int], where: str, error=ShardingError) -> tuple:
    """A layout (one tuple of mesh-axis names per dim), each axis in ``mesh`` and used once."""
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, (tuple, list))
                                                       for d in value):
        raise error(f"{where}: layout {value!r} must give one list of mesh-axis names per dim, "
                    f"e.g. [['data'], []]")
    seen: set[str] = set()
    for d in value:
        for a in d:
            if not isinstance(a, str) or a not in mesh:
                raise error(f"{where}: layout {value!r} names mesh axis {a!r}, but the mesh has "
                            f"axes {dict(mesh)}")
            if a in seen:
                raise error(f"{where}: layout {value!r} uses mesh axis {a!r} twice; an axis "
                            f"splits at most one dim")
            seen.add(a)
    return tuple(tuple(d) for d in value)


def layout_for(value: Any, shape: Sequence[int], mesh: Mapping[str, int], where: str,
               error=ShardingError) -> tuple:
    """A layout that also fits ``shape``: one entry per dim, each dim divisible by its axes."""
    s = layout(value, mesh, where, error)
    if len(s) != len(shape):
        raise error(f"{where}: layout {value!r} has {len(s)} dims but the shape {tuple(shape)} "
                    f"has {len(shape)}")
    for d, (axes, size) in enumerate(zip(s, shape)):
        n = math.prod(mesh[a] for a in axes)
        if size % n:
            raise error(f"{where}: dim {d} of size {size} is split over {axes} ({n} devices), "
                        f"which does not divide it; leave that dim whole or pick axes whose "
                        f"sizes divide {size}")
    return s
