"""Evaluate one element of a value computed from literals only (iota, compares, selects, ...).

Pattern matching asks questions such as "is this mask causal?" or "what does this scale
divide by?" without running anything: ``element(v, idx)`` walks the producers of ``v`` back to
literals and iotas, one index at a time, through broadcasts, reshapes and transposes. Arrays
are never built, so a (8192 x 8192) mask costs as much as a (16 x 16) one.

Values that depend on a graph input (or on a closed-over constant, whose data the graph does
not keep) raise ``NotConstant``. ``origin`` maps a loop body's input to the value outside the
loop that feeds it, so a mask hoisted out of a ``scan`` is still found.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ir.graph import Op


class NotConstant(Exception):
    """The value depends on something other than literals."""


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "max": max, "min": min,
    "div": lambda a, b: a / b if isinstance(a, float) or isinstance(b, float) else a // b,
    "pow": operator.pow, "ge": operator.ge, "gt": operator.gt, "le": operator.le,
    "lt": operator.lt, "eq": operator.eq, "ne": operator.ne,
    "and": lambda a, b: a & b if not isinstance(a, bool) else a and b,
    "or": lambda a, b: a | b if not isinstance(a, bool) else a or b,
}
_UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": operator.neg, "sqrt": math.sqrt, "rsqrt": lambda a: 1 / math.sqrt(a), "exp": math.exp,
    "log": math.log, "not": lambda a: not a if isinstance(a, bool) else ~a,
    "stop_gradient": lambda a: a, "copy": lambda a: a, "copy_p": lambda a: a,
}


class Evaluator:
    """Element-wise evaluation over one graph; results are memoised per (value, index)."""

    def __init__(self, producer: Mapping[int, Op], literals: Mapping[int, Any],
                 shapes: Callable[[int], tuple[int, ...]], origin: Callable[[int], int]):
        self._producer = producer
        self._literals = literals
        self._shape = shapes
        self._origin = origin
        self._memo: dict[tuple[int, tuple[int, ...]], Any] = {}

    def element(self, v: int, idx: tuple[int, ...] = ()) -> Any:
        """The element of value ``v`` at ``idx`` (a python scalar)."""
        key = (v, idx)
        if key not in self._memo:
            self._memo[key] = self._compute(v, idx)
        return self._memo[key]

    def scalar(self, v: int) -> float | None:
        """``v``'s value if it is a constant with one distinct element, else ``None``."""
        shape = self._shape(v)
        try:
            first = self.element(v, (0,) * len(shape))
            last = self.element(v, tuple(d - 1 for d in shape))
        except NotConstant:
            return None
        return float(first) if first == last else None

    def _compute(self, v: int, idx: tuple[int, ...]) -> Any:
        if v in self._literals:
            lit = self._literals[v]
            return lit if not isinstance(lit, tuple) else lit[_flat(idx, self._shape(v))]
        outer = self._origin(v)
        op = self._producer.get(outer)
        if op is None:
            raise NotConstant(v)
        return _RULES.get(op.prim, _elementwise)(self, op, idx)


def _flat(idx: tuple[int, ...], shape: tuple[int, ...]) -> int:
    return int(np.ravel_multi_index(idx, shape)) if shape else 0


def _elementwise(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    args = [ev.element(v, _broadcast_idx(idx, ev._shape(v))) for v in op.ins]
    if op.prim in _BINARY and len(args) == 2:
        return _BINARY[op.prim](*args)
    if op.prim in _UNARY and len(args) == 1:
        return _UNARY[op.prim](args[0])
    if op.prim == "select_n":
        return args[1 + int(args[0])]
    if op.prim == "integer_pow":
        return args[0] ** op.param("y")
    raise NotConstant(op.id)


def _broadcast_idx(idx: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Scalars (shape ``()``) read element ``()``; same-rank operands read ``idx``."""
    return () if not shape else tuple(i if d != 1 else 0 for i, d in zip(idx, shape))


def _iota(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    value = idx[op.param("dimension")]
    return float(value) if "float" in str(op.param("dtype")) else value


def _broadcast_in_dim(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    operand = op.ins[0]
    shape = ev._shape(operand)
    dims = op.param("broadcast_dimensions")
    return ev.element(operand, tuple(0 if shape[k] == 1 else idx[d] for k, d in enumerate(dims)))


def _reshape(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    operand = op.ins[0]
    flat = _flat(idx, ev._shape(op.outs[0]))
    shape = ev._shape(operand)
    return ev.element(operand, tuple(int(i) for i in np.unravel_index(flat, shape)) if shape
                      else ())


def _transpose(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    perm = op.param("permutation")
    inner = [0] * len(perm)
    for out_dim, in_dim in enumerate(perm):
        inner[in_dim] = idx[out_dim]
    return ev.element(op.ins[0], tuple(inner))


def _convert(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    value = ev.element(op.ins[0], idx)
    dtype = str(op.param("new_dtype"))
    if dtype == "bool":
        return bool(value)
    return float(value) if "float" in dtype else int(value)


def _squeeze(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    dims = set(op.param("dimensions"))
    inner, it = [], iter(idx)
    for d in range(len(ev._shape(op.ins[0]))):
        inner.append(0 if d in dims else next(it))
    return ev.element(op.ins[0], tuple(inner))


def _slice(ev: Evaluator, op: Op, idx: tuple[int, ...]) -> Any:
    starts = op.param("start_indices")
    strides = op.param("strides") or (1,) * len(idx)
    return ev.element(op.ins[0], tuple(s + i * k for s, i, k in zip(starts, idx, strides)))


_RULES: dict[str, Callable[[Evaluator, Op, tuple[int, ...]], Any]] = {
    "iota": _iota, "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape,
    "transpose": _transpose, "convert_element_type": _convert, "squeeze": _squeeze,
    "slice": _slice,
}
