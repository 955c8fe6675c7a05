"""Per-primitive FLOP rules that mirror XLA's ``HloCostAnalysis`` on the lowered HLO.

A rule is ``fn(ins, outs, params) -> Cost`` with ``ins``/``outs`` the ``TensorType``s of the op
and ``params`` its plain params as a dict. XLA counts, per output element, 1 flop for a plain
elementwise op and 1 *transcendental* (not a flop) for exp/log/tanh/sqrt/rsqrt/pow/...; a
reduction costs (input - output elements) applications of its reducer; a dot 2*M*N*K*batch;
data movement (broadcast, reshape, transpose, slice, gather, ...) 0. Where jax lowers one
primitive to several HLO ops (integer_pow, logistic, erf, argmax, ...) the rule counts those.

Unknown primitives are not in ``FLOP_RULES``: the tracer gives them 0 flops, costs them by bytes
and marks them with a ``("fallback", True)`` param (see ``ir.from_jaxpr``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ir.graph import TensorType


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    transcendentals: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.transcendentals + other.transcendentals)

    def scale(self, k: float) -> Cost:
        return Cost(self.flops * k, self.transcendentals * k)


Types = Sequence[TensorType]
Rule = Callable[[Types, Types, Mapping[str, Any]], Cost]
ZERO = Cost()


def _out_elems(outs: Types) -> int:
    return outs[0].size if outs else 0


def elementwise(k: float = 1.0, trans: float = 0.0) -> Rule:
    """k flops and ``trans`` transcendentals per output element."""
    return lambda ins, outs, p: Cost(k * _out_elems(outs), trans * _out_elems(outs))


def _zero(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    return ZERO


def _reduce(k: float = 1.0) -> Rule:
    """XLA: (input elements - output elements) reducer calls of ``k`` flops each."""
    return lambda ins, outs, p: Cost(k * max(ins[0].size - outs[0].size, 0))


def _dot_general(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    (lhs_contract, _), _ = p["dimension_numbers"]
    k = math.prod(ins[0].shape[d] for d in lhs_contract)
    return Cost(2.0 * outs[0].size * k)


def _valid_positions(in_size: int, out_size: int, win: int, stride: int, pad_lo: int,
                     lhs_dil: int, rhs_dil: int) -> int:
    """Window/output index pairs that land on a real (non-padding, non-hole) input element."""
    count = 0
    for o in range(out_size):
        for w in range(win):
            u = o * stride - pad_lo + w * rhs_dil
            if u % lhs_dil == 0 and 0 <= u // lhs_dil < in_size:
                count += 1
    return count


def _conv(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """XLA counts only multiply-adds that touch real input (padding excluded).

    Without padding or dilation this is 2*out_elems*(in_features/groups)*prod(kernel spatial).
    """
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    lhs, rhs, out = ins[0].shape, ins[1].shape, outs[0].shape
    nsp = len(lhs_spec) - 2
    strides = p.get("window_strides") or (1,) * nsp
    lhs_dil = p.get("lhs_dilation") or (1,) * nsp
    rhs_dil = p.get("rhs_dilation") or (1,) * nsp
    pairs = 1
    for i in range(nsp):
        pairs *= _valid_positions(lhs[lhs_spec[2 + i]], out[out_spec[2 + i]], rhs[rhs_spec[2 + i]],
                                  strides[i], p["padding"][i][0], lhs_dil[i], rhs_dil[i])
    in_feat = rhs[rhs_spec[1]]  # kernel input features = in_features / feature_group_count
    batch = out[out_spec[0]]
    return Cost(2.0 * pairs * in_feat * rhs[rhs_spec[0]] * batch)


def _integer_pow(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """jax lowers x**y by binary exponentiation, plus one divide when y < 0."""
    y = abs(int(p["y"]))
    muls = max(y.bit_length() - 1, 0) + max(bin(y).count("1") - 1, 0)
    return Cost(float((muls + (p["y"] < 0)) * _out_elems(outs)))


def _arg_reduce(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """argmax/argmin reduce (value, index) pairs; the comparator is 9 ops (7 for ints)."""
    per_call = 9.0 if ins[0].dtype.startswith(("float", "bfloat")) else 7.0
    return Cost(per_call * max(ins[0].size - outs[0].size, 0))


def _cumulative(k: float, trans: float = 0.0) -> Rule:
    """Lowered to a reduce_window of size n over the axis: n-1 reducer calls per output."""
    def rule(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
        n = ins[0].shape[p["axis"]] if ins[0].shape else 1
        return Cost(outs[0].size * (n - 1) * k, outs[0].size * (n - 1) * trans)
    return rule


def _reduce_window(k: float = 1.0) -> Rule:
    """XLA: (window elements - 1) reducer calls per output element."""
    def rule(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
        window = math.prod(p.get("window_dimensions") or (1,))
        return Cost(k * outs[0].size * (window - 1))
    return rule


def _select_and_scatter(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """XLA: per source element, (window - 1) selects and one scatter combine."""
    window = math.prod(p.get("window_dimensions") or (1,))
    return Cost(float(ins[0].size * window))


def _index_mask(indices: TensorType, p: Mapping[str, Any]) -> float:
    """FILL_OR_DROP bounds mask: ge, le, and per index, and-reduced over the index vector."""
    if p.get("mode") != "FILL_OR_DROP" or not indices.shape:
        return 0.0
    vectors = indices.size // max(indices.shape[-1], 1)
    return 3.0 * indices.size + (indices.size - vectors)


def _gather(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """Data movement, plus the out-of-bounds mask and fill select of FILL_OR_DROP mode."""
    if p.get("mode") != "FILL_OR_DROP":
        return ZERO
    return Cost(_index_mask(ins[1], p) + outs[0].size)


def _scatter(combine: float) -> Rule:
    """One combiner call per update element (out-of-bounds updates are dropped for free)."""
    return lambda ins, outs, p: Cost(combine * ins[2].size)


def _sort(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """XLA: elements * (ceil(log2 n) + 2) for a sort of n along the sorted dimension."""
    n = ins[0].shape[p["dimension"]] if ins[0].shape else 1
    return Cost(float(ins[0].size * (math.ceil(math.log2(max(n, 1))) + 2)))


def _convert(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """A convert to the same dtype is dropped by jax's lowering."""
    return ZERO if ins[0].dtype == outs[0].dtype else Cost(float(outs[0].size))


def _pow(ins: Types, outs: Types, p: Mapping[str, Any]) -> Cost:
    """One transcendental; an integer exponent is converted first (1 flop)."""
    n = float(outs[0].size)
    return Cost(n if ins[1].dtype != ins[0].dtype else 0.0, n)

_ELEMENTWISE_1 = (
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil",
    "round", "nextafter", "and", "or", "xor", "not", "eq", "ne", "lt", "le", "gt", "ge",
    "is_finite", "shift_left", "shift_right_logical", "shift_right_arithmetic", "add_any",
    "select_n", "clamp", "square", "population_count", "clz",
    "real", "imag", "conj", "complex",
)
_TRANSCENDENTAL = (
    "exp", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "sin", "cos",
    "tan", "atan2", "erf",
)
_ZERO_FLOP = (
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "concatenate", "pad",
    "slice", "dynamic_slice", "dynamic_update_slice", "iota", "copy",
    "copy_p", "stop_gradient", "rev", "split", "bitcast_convert_type", "reduce_precision",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
    "random_split", "threefry2x32", "device_put", "optimization_barrier", "sharding_constraint",
    "mesh_cast", "reshard", "pvary", "full_like", "zeros_like", "empty",
)

FLOP_RULES: dict[str, Rule] = {
    **{p: elementwise(1.0) for p in _ELEMENTWISE_1},
    **{p: elementwise(0.0, 1.0) for p in _TRANSCENDENTAL},
    **{p: _zero for p in _ZERO_FLOP},
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "integer_pow": _integer_pow,
    "convert_element_type": _convert,
    "pow": _pow,
    "logistic": elementwise(3.0, 1.0),
    "exp2": elementwise(1.0, 1.0),
    "gather": _gather,
    "scatter": _scatter(0.0),
    "reduce_sum": _reduce(), "reduce_max": _reduce(), "reduce_min": _reduce(),
    "reduce_prod": _reduce(), "reduce_and": _reduce(), "reduce_or": _reduce(),
    "reduce_xor": _reduce(), "argmax": _arg_reduce, "argmin": _arg_reduce,
    "cumsum": _cumulative(1.0), "cumprod": _cumulative(1.0), "cummax": _cumulative(1.0),
    "cummin": _cumulative(1.0), "cumlogsumexp": _cumulative(8.0, 2.0),
    "scatter-add": _scatter(1.0), "scatter_add": _scatter(1.0),
    "scatter-mul": _scatter(1.0), "scatter_mul": _scatter(1.0),
    "scatter-min": _scatter(1.0), "scatter_min": _scatter(1.0),
    "scatter-max": _scatter(1.0), "scatter_max": _scatter(1.0),
    "sort": _sort,
    "reduce_window_sum": _reduce_window(), "reduce_window_max": _reduce_window(),
    "reduce_window_min": _reduce_window(), "reduce_window": _reduce_window(),
    "select_and_scatter_add": _select_and_scatter,
}


def op_cost(prim: str, ins: Types, outs: Types, params: Mapping[str, Any]) -> Cost | None:
    """The op's cost per ``FLOP_RULES``, or ``None`` for a primitive without a rule."""
    rule = FLOP_RULES.get(prim)
    return None if rule is None else rule(ins, outs, params)


# ---- constant folding done by the lowering ------------------------------------------------------
class _NotConst:
    def __repr__(self) -> str:
        return "NOT_CONST"


NOT_CONST: Any = _NotConst()
UNKNOWN_CONST: Any = object()  # a splat constant whose value we do not track
_SHAPE_OPS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                        "convert_element_type"})
_FOLDABLE = frozenset(_ELEMENTWISE_1) | frozenset(_TRANSCENDENTAL) | _SHAPE_OPS | {"integer_pow"}
_IDENTITY = {"add": (0, 1), "add_any": (0, 1), "sub": (1,)}  # operand positions where 0 is identity


def fold(prim: str, splats: Sequence[Any]) -> tuple[bool, Any]:
    """Whether the lowering folds this op away (0 flops), and its output's splat constant.

    ``splats[i]`` is the scalar value of input i when it is a splat constant (a literal,
    possibly broadcast/reshaped/converted), ``UNKNOWN_CONST`` for another constant, else
    ``NOT_CONST``. XLA's HLO import folds ops on constants and ``x + 0``, ``x - 0``, ``x * 1``.
    """
    if splats and prim in _FOLDABLE and all(s is not NOT_CONST for s in splats):
        return True, splats[0] if prim in _SHAPE_OPS else UNKNOWN_CONST
    for i in _IDENTITY.get(prim, ()):
        if _is_value(splats[i], 0):
            return True, NOT_CONST
    if prim == "mul" and any(_is_value(s, 1) for s in splats):
        return True, NOT_CONST
    return False, NOT_CONST


def _is_value(s: Any, target: float) -> bool:
    return s is not NOT_CONST and s is not UNKNOWN_CONST and isinstance(s, (int, float)) \
        and not isinstance(s, bool) and s == target
