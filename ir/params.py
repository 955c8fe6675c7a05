"""Reduce a jaxpr equation's params to hashable plain data (ints, floats, strs, tuples).

Sub-jaxprs and callables are dropped (bodies live in ``Op.regions``). Named tuples become
``((field, value), ...)`` so that gather/scatter dimension numbers stay readable, except the
conv ``dimension_numbers`` which the planner reads positionally as ``(lhs, rhs, out)`` specs.
"""
from __future__ import annotations

import enum
from typing import Any

import numpy as np
from jax.extend import core as jcore

_DROP = object()
_POSITIONAL_NAMEDTUPLES = frozenset({"ConvDimensionNumbers"})


def reduce_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Returns the eqn params as sorted ``(key, plain value)`` pairs, sub-jaxprs dropped."""
    out = []
    for key in sorted(params):
        value = to_plain(params[key])
        if value is not _DROP:
            out.append((key, value))
    return tuple(out)


def to_plain(v: Any) -> Any:
    """One param value as plain hashable data, or ``_DROP``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) or callable(v) and not isinstance(v, type):
        return _DROP
    if isinstance(v, np.dtype) or isinstance(v, type) and issubclass(v, np.generic):
        return str(np.dtype(v))
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return _namedtuple_plain(v)
    if isinstance(v, (tuple, list)):
        return _seq_plain(v)
    if isinstance(v, np.ndarray):
        return tuple(v.ravel().tolist()) if v.size <= 64 else f"array{v.shape}"
    if isinstance(v, (frozenset, set)):
        return tuple(sorted(str(x) for x in v))
    return _other_plain(v)


def _seq_plain(v: tuple | list) -> Any:
    items = tuple(to_plain(x) for x in v)
    return _DROP if any(x is _DROP for x in items) else items


def _namedtuple_plain(v: Any) -> Any:
    if type(v).__name__ in _POSITIONAL_NAMEDTUPLES:
        return _seq_plain(tuple(v))
    return tuple((f, to_plain(getattr(v, f))) for f in v._fields)


def _other_plain(v: Any) -> Any:
    """Dataclasses field by field; anything else (shardings, PRNG dtypes) as its str."""
    if hasattr(v, "__dataclass_fields__"):
        return tuple((f, to_plain(getattr(v, f))) for f in v.__dataclass_fields__)
    return str(v)


# A user's ``with_sharding_constraint`` (``sharding_constraint``): the layout it asks for, read
# into the planner's form (one tuple of mesh axis names per dim, None for a dim the user left
# ``UNCONSTRAINED``), under the key ``CONSTRAINT`` of the op's params.
CONSTRAINT = "user_spec"


def constraint_spec(params: dict[str, Any], rank: int) -> tuple | None:
    """The layout a ``sharding_constraint`` equation's ``params`` ask for, as
    ``((axes of dim 0), ...)`` with None for an unconstrained dim; None when it is not a named
    layout over device memory (a ``GSPMDSharding``, a move to host memory), which the planner
    then leaves as the user wrote it."""
    sharding = params.get("sharding")
    spec = getattr(sharding, "spec", None)
    if spec is None or getattr(sharding, "memory_kind", None) not in (None, "device"):
        return None
    free = set(params.get("unconstrained_dims") or ())
    dims = []
    for d in range(rank):
        entry = spec[d] if d < len(spec) else None
        if d in free or entry is type(spec).UNCONSTRAINED or str(entry) == "UNCONSTRAINED":
            dims.append(None)
        elif entry is None:
            dims.append(())
        else:
            dims.append(tuple(entry) if isinstance(entry, (tuple, list)) else (str(entry),))
    return tuple(dims)
