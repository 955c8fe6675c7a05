"""Per-primitive sharding rules: what shardings an op can run under, and what each one costs.

A rule sees one ``ir.Op`` and the mesh and returns one of two answers:

* ``Choices(strategies)`` — the op is a *decision*: the ILP picks one of its strategies
  (dot_general, convolution, gather/scatter, graph inputs, the replicate-only fallback).
* ``Follow(operand, derive)`` — the op has no choice of its own: given the sharding of input
  ``operand`` it runs one way, ``derive(sharding) -> Strategy`` (elementwise ops, reductions,
  reshape/transpose/broadcast, slices...). The planner merges it into its operand's decision, so
  it costs no ILP variable ("graph simplification").

A ``Strategy`` lists the sharding it needs of each input (``None``: any, for literals), the
sharding of each output, the factor its compute is divided by, and the collectives the op itself
issues (a sharded contraction's all-reduce, a reduction over a sharded dim...). Resharding between
ops is costed on edges, in ``problem.py``.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from autopar.plan import FALLBACK
from autopar.planner.budget import SEARCH_BEFORE
from autopar.sharding import (
    Sharding,
    divides,
    enumerate_shardings,
    fmt,
    replicated,
    shard_factor,
)
from ir import Op, TensorType


@dataclasses.dataclass(frozen=True)
class Comm:
    """A collective an op issues: kind, bytes (see cost_models conventions) and mesh axes."""

    kind: str
    nbytes: float
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    ins: tuple[Sharding | None, ...]
    outs: tuple[Sharding, ...]
    compute_div: int = 1
    comms: tuple[Comm, ...] = ()


@dataclasses.dataclass(frozen=True)
class Choices:
    strategies: tuple[Strategy, ...]


@dataclasses.dataclass(frozen=True)
class Follow:
    operand: int
    derive: Callable[[Sharding], Strategy]


Rule = Callable[[Op, "RuleContext"], "Choices | Follow"]
RULES: dict[str, Rule] = {}


@dataclasses.dataclass(frozen=True)
class RuleContext:
    types: Sequence[TensorType]          # graph.values
    literals: frozenset[int]             # value ids that are literal constants
    producers: Mapping[int, str]         # value id -> producing primitive (absent for inputs)
    mesh: Mapping[str, int]
    max_strategies: int = 96
    clock: object = None                 # planner.budget.Clock: enumeration stops when spent
    sums_by_dim: bool = False            # XLA all-reduces a sum dim by dim (``_all_reduces``)

    def t(self, v: int) -> TensorType:
        return self.types[v]

    def per_device_bytes(self, v: int, s: Sharding) -> float:
        return self.types[v].nbytes / shard_factor(s, self.mesh)


def strategy_rule(*prims: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for p in prims:
            RULES[p] = fn
        return fn

    return register


def rule_for(op: Op, ctx: RuleContext) -> Choices | Follow:
    rule = RULES.get(op.prim)
    if rule is None:
        return fallback_rule(op, ctx, NO_RULE)
    return rule(op, ctx)


# ---------------------------------------------------------------------------------------------
# Decisions without structure
# ---------------------------------------------------------------------------------------------
# The replicate-only strategy's name says why an op got nothing better; ``Plan.
# replicated_fallbacks`` lists the ops whose strategy name starts with ``FALLBACK``.
NO_RULE = FALLBACK + "no sharding rule"
OPAQUE = FALLBACK + "loop/branch body not planned"
LATE = FALLBACK + "time limit"


def fallback_rule(op: Op, ctx: RuleContext, name: str = "replicated") -> Choices:
    """Run ``op`` replicated: every input gathered, every output whole. ``name`` is the strategy's
    name: plain ``"replicated"`` where a rule chose it (random bits, a scalar result), one of
    the ``FALLBACK`` names where no rule could be applied."""
    ins = tuple(None if v in ctx.literals else replicated(len(ctx.t(v).shape)) for v in op.ins)
    outs = tuple(replicated(len(ctx.t(v).shape)) for v in op.outs)
    return Choices((Strategy(name, ins, outs),))


def source_choices(op: Op, ctx: RuleContext) -> Choices:
    """Ops that make a value from nothing sharded (iota, a broadcast scalar): any layout, no
    communication."""
    out_t = ctx.t(op.outs[0])
    ins = tuple(None if v in ctx.literals or not ctx.t(v).shape else replicated(len(ctx.t(v).shape))
                for v in op.ins)
    strategies = []
    for s in enumerate_shardings(out_t.shape, ctx.mesh):
        outs = tuple(s if ctx.t(v).shape == out_t.shape else replicated(len(ctx.t(v).shape))
                     for v in op.outs)
        strategies.append(Strategy(fmt(s), ins, outs, shard_factor(s, ctx.mesh)))
    return Choices(tuple(strategies))


strategy_rule("iota", "random_bits", "random_seed", "random_wrap", "random_unwrap",
              "threefry2x32", "rng_bit_generator", "rng_uniform")(fallback_rule)
strategy_rule("iota")(source_choices)


def input_choices(shape: Sequence[int], mesh: Mapping[str, int]) -> tuple[Strategy, ...]:
    """A graph input may arrive in any layout that divides its shape."""
    return tuple(Strategy(fmt(s), (), (s,), 1) for s in enumerate_shardings(shape, mesh))


# ---------------------------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------------------------
ELEMENTWISE = (
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "exp", "exp2", "log", "log1p",
    "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "abs", "sign", "integer_pow", "square",
    "select_n", "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "is_finite", "stop_gradient", "add_any", "erf", "erfc", "erf_inv", "sin", "cos", "tan",
    "atan2", "floor", "ceil", "round", "clamp", "nextafter", "copy", "copy_p", "real", "imag",
    "reduce_precision", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    "lgamma", "digamma", "igamma", "bessel_i0e", "bessel_i1e", "conj", "optimization_barrier",
    "device_put",   # a move between memory spaces (ir.offload): the value keeps its layout
    # the user's own ``with_sharding_constraint``: the value as it is, in the layout the plan
    # chooses; codegen enforces the plan's (the "user" strategy pins the user's: the
    # ``user_spec`` that ``ir`` read off the equation)
    "sharding_constraint",
)
_WEAK_PRODUCERS = {"broadcast_in_dim", "iota", None}


def _broadcast_need(s: Sharding, shape, out_shape) -> Sharding:
    """The layout an operand needs when the op's result is laid out ``s``: elementwise ops
    broadcast size-1 dims (``(B, H, S, S) * (B, H, S, 1)``), which stay whole; a scalar or a
    lower-rank operand is needed whole."""
    if len(shape) != len(out_shape):
        return replicated(len(shape))
    return tuple(d if n == m else () for d, n, m in zip(s, shape, out_shape))


@strategy_rule(*ELEMENTWISE)
def elementwise_rule(op: Op, ctx: RuleContext) -> Choices | Follow:
    out_shape = ctx.t(op.outs[0]).shape
    full = [i for i, v in enumerate(op.ins)
            if v not in ctx.literals and ctx.t(v).shape == out_shape]
    if not out_shape:
        return fallback_rule(op, ctx)

    def derive(s: Sharding) -> Strategy:
        ins = tuple(None if v in ctx.literals else _broadcast_need(s, ctx.t(v).shape, out_shape)
                    for v in op.ins)
        outs = tuple(s if ctx.t(v).shape == out_shape else replicated(len(ctx.t(v).shape))
                     for v in op.outs)
        return Strategy(fmt(s), ins, outs, shard_factor(s, ctx.mesh))

    if not full:
        # None of the operands has the result's shape: operands of the result's rank broadcast
        # their size-1 dims against each other (flax's norms: ``rsqrt(var)`` of shape (B, S, 1)
        # times ``scale`` of shape (1, 1, D)). Each layout of the result is a choice and each
        # operand needs its own dims of it (a rank-0 operand is needed whole), so a batch-split
        # ``rsqrt`` stays split. Operands of another rank make it a source: every operand whole.
        ranks = {len(ctx.t(v).shape) for v in op.ins if v not in ctx.literals}
        if not ranks <= {0, len(out_shape)}:
            return source_choices(op, ctx)
        return Choices(tuple(derive(s) for s in enumerate_shardings(out_shape, ctx.mesh)))
    # Follow a "real" operand: not a broadcast of something smaller, nor a graph input, when there
    # is a choice, so a bias add follows the activation, not the bias.
    strong = [i for i in full if ctx.producers.get(op.ins[i]) not in _WEAK_PRODUCERS]
    lead = (strong or full)[0]
    return Follow(lead, derive)


# ---------------------------------------------------------------------------------------------
# Layout ops
# ---------------------------------------------------------------------------------------------
def _gathered(op: Op, ctx: RuleContext, s_in: Sharding, keep: Sharding, outs: tuple[Sharding, ...],
              name: str, extra_ins: tuple[Sharding | None, ...] = ()) -> Strategy:
    """A follower that needs ``keep`` of its input: axes of ``s_in`` missing from ``keep`` are
    gathered."""
    comms = _gather_comms(ctx, op.ins[0], s_in, keep)
    return Strategy(name, (s_in,) + extra_ins, outs, shard_factor(keep, ctx.mesh), comms)


def _gather_comms(ctx: RuleContext, v: int, s_in: Sharding, keep: Sharding) -> tuple[Comm, ...]:
    """The all-gather that takes value ``v`` from ``s_in`` to ``keep`` (a subset of it)."""
    lost = tuple(a for d_in, d_keep in zip(s_in, keep) for a in d_in if a not in d_keep)
    return (Comm("all-gather", ctx.per_device_bytes(v, keep), lost),) if lost else ()


def _unsharded_dims(s: Sharding, dims: Sequence[int]) -> Sharding:
    return tuple(() if i in dims else d for i, d in enumerate(s))


# A broadcast that makes its operand this many times larger is a decision of its own: splitting
# the new dims is free (each device makes only its slice), and following the small operand would
# leave a huge value replicated (e.g. a causal mask broadcast to (B, H, S, S)).
_EXPANDING = 4


def _expanding_broadcast(op: Op, ctx: RuleContext, in_shape, out_shape, bdims) -> Choices:
    strategies = []
    for out in enumerate_shardings(out_shape, ctx.mesh):
        need = tuple(out[bdims[i]] if in_shape[i] == out_shape[bdims[i]] else ()
                     for i in range(len(in_shape)))
        ins = (need,) + tuple(None for _ in op.ins[1:])
        strategies.append(Strategy(fmt(out), ins, (out,), shard_factor(out, ctx.mesh)))
    return Choices(tuple(strategies))


@strategy_rule("broadcast_in_dim")
def broadcast_rule(op: Op, ctx: RuleContext) -> Choices | Follow:
    src = op.ins[0]
    if src in ctx.literals or not ctx.t(src).shape:
        return source_choices(op, ctx)
    out_shape = ctx.t(op.outs[0]).shape
    bdims = tuple(op.param("broadcast_dimensions"))
    in_shape = ctx.t(src).shape
    if ctx.t(op.outs[0]).size >= _EXPANDING * ctx.t(src).size:
        return _expanding_broadcast(op, ctx, in_shape, out_shape, bdims)

    def derive(s: Sharding) -> Strategy:
        keep = tuple(d if in_shape[i] == out_shape[bdims[i]] else () for i, d in enumerate(s))
        out = [() for _ in out_shape]
        for i, d in enumerate(keep):
            out[bdims[i]] = d
        extra = tuple(None for _ in op.ins[1:])
        return _gathered(op, ctx, s, keep, (tuple(out),), fmt(tuple(out)), extra)

    return Follow(0, derive)


@strategy_rule("transpose")
def transpose_rule(op: Op, ctx: RuleContext) -> Follow:
    perm = tuple(op.param("permutation"))

    def derive(s: Sharding) -> Strategy:
        out = tuple(s[p] for p in perm)
        return Strategy(fmt(out), (s,), (out,), shard_factor(s, ctx.mesh))

    return Follow(0, derive)


def reshape_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split old and new dims into consecutive runs whose sizes multiply to the same number."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(old) or j < len(new):
        gi, gj, po, pn = [], [], 1, 1
        if i < len(old):
            gi.append(i); po *= old[i]; i += 1
        if j < len(new):
            gj.append(j); pn *= new[j]; j += 1
        while po != pn:
            if po < pn and i < len(old):
                gi.append(i); po *= old[i]; i += 1
            elif pn < po and j < len(new):
                gj.append(j); pn *= new[j]; j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def reshape_map(s: Sharding, old: Sequence[int], new: Sequence[int],
                mesh: Mapping[str, int]) -> tuple[Sharding, Sharding]:
    """(kept input sharding, output sharding): a group keeps only its major non-1 dim's axes."""
    keep = [() for _ in old]
    out = [() for _ in new]
    for gi, gj in reshape_groups(old, new):
        major_in = next((i for i in gi if old[i] != 1), None)
        major_out = next((j for j in gj if new[j] != 1), None)
        if major_in is None or major_out is None or not s[major_in]:
            continue
        if new[major_out] % math.prod(mesh[a] for a in s[major_in]) == 0:
            keep[major_in] = s[major_in]
            out[major_out] = s[major_in]
    return tuple(keep), tuple(out)


@strategy_rule("reshape")
def reshape_rule(op: Op, ctx: RuleContext) -> Follow:
    old, new = ctx.t(op.ins[0]).shape, ctx.t(op.outs[0]).shape

    def derive(s: Sharding) -> Strategy:
        keep, out = reshape_map(s, old, new, ctx.mesh)
        extra = tuple(None for _ in op.ins[1:])
        return _gathered(op, ctx, s, keep, (out,), fmt(out), extra)

    return Follow(0, derive)


@strategy_rule("squeeze")
def squeeze_rule(op: Op, ctx: RuleContext) -> Follow:
    dims = set(d % max(len(ctx.t(op.ins[0]).shape), 1) for d in op.param("dimensions", ()))

    def derive(s: Sharding) -> Strategy:
        out = tuple(d for i, d in enumerate(s) if i not in dims)
        return Strategy(fmt(out), (s,), (out,), shard_factor(s, ctx.mesh))

    return Follow(0, derive)


@strategy_rule("expand_dims")
def expand_dims_rule(op: Op, ctx: RuleContext) -> Follow:
    out_rank = len(ctx.t(op.outs[0]).shape)
    dims = set(d % out_rank for d in op.param("dimensions", ()))

    def derive(s: Sharding) -> Strategy:
        it = iter(s)
        out = tuple(() if i in dims else next(it) for i in range(out_rank))
        return Strategy(fmt(out), (s,), (out,), shard_factor(s, ctx.mesh))

    return Follow(0, derive)


def _changed_dims(op: Op, ctx: RuleContext) -> tuple[int, ...]:
    a, b = ctx.t(op.ins[0]).shape, ctx.t(op.outs[0]).shape
    if len(a) != len(b):
        return tuple(range(len(a)))
    return tuple(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def _axis_params(op: Op, rank: int) -> tuple[int, ...]:
    for key in ("axis", "dimension"):
        v = op.param(key)
        if v is not None:
            return (v % rank,)
    return ()


@strategy_rule("slice", "pad", "dynamic_slice", "dynamic_update_slice", "rev", "concatenate",
               "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
               "split")
def passthrough_rule(op: Op, ctx: RuleContext) -> Follow:
    """Dims the op reshapes or scans along must be whole; the others pass through."""
    rank = len(ctx.t(op.ins[0]).shape)
    fixed = set(_changed_dims(op, ctx)) | set(_axis_params(op, rank))
    if op.prim in ("rev",):
        fixed |= set(op.param("dimensions", ()))

    def derive(s: Sharding) -> Strategy:
        keep = _unsharded_dims(s, fixed)
        # other same-rank operands (concatenated pieces, an update) share the kept layout
        ins = tuple(None if v in ctx.literals or len(ctx.t(v).shape) != rank else keep
                    for v in op.ins)
        outs = tuple(keep if len(ctx.t(v).shape) == rank else replicated(len(ctx.t(v).shape))
                     for v in op.outs)
        st = _gathered(op, ctx, s, keep, outs, fmt(keep), ins[1:])
        return st

    return Follow(0, derive)


@strategy_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
               "argmax", "argmin", "reduce_xor")
def reduce_rule(op: Op, ctx: RuleContext) -> Follow:
    axes = set(op.param("axes", ()))

    def derive(s: Sharding) -> Strategy:
        reduced = tuple(a for i, d in enumerate(s) if i in axes for a in d)
        out = tuple(d for i, d in enumerate(s) if i not in axes)
        comms = ()
        if reduced:
            comms = _all_reduces(ctx, ctx.per_device_bytes(op.outs[0], out), reduced,
                                 tuple(d for i, d in enumerate(s) if i in axes))
        return Strategy(fmt(out), (s,) + (None,) * (len(op.ins) - 1), (out,) * len(op.outs),
                        shard_factor(s, ctx.mesh), comms)

    return Follow(0, derive)


# ---------------------------------------------------------------------------------------------
# Pooling: reduce_window (max/avg pooling) and the max-pool gradient
# ---------------------------------------------------------------------------------------------
def _windowed_dims(op: Op, rank: int) -> set[int]:
    """Dims a window op slides along: a window, stride, padding or dilation other than the
    identity. Each output element of such a dim reads a neighbourhood of input elements, so the
    dim stays whole; the others (batch, channels) map element to element and may stay split."""
    ones, zeros = (1,) * rank, ((0, 0),) * rank
    per_dim = zip(op.param("window_dimensions", ones), op.param("window_strides", ones),
                  op.param("base_dilation", ones), op.param("window_dilation", ones))
    padding = op.param("padding", zeros)
    return {d for d, sizes in enumerate(per_dim)
            if sizes != (1, 1, 1, 1) or tuple(padding[d]) != (0, 0)}


def _pooling_rule(lead: int) -> Rule:
    """Follow operand ``lead``; every operand and result of its rank (the pooled and unpooled
    tensors) takes its layout with the windowed dims gathered; scalar init values stay whole."""

    def rule(op: Op, ctx: RuleContext) -> Follow:
        rank = len(ctx.t(op.ins[lead]).shape)
        windowed = _windowed_dims(op, rank)

        def derive(s: Sharding) -> Strategy:
            keep = _unsharded_dims(s, windowed)
            ins = tuple(s if k == lead else None if v in ctx.literals
                        else keep if len(ctx.t(v).shape) == rank
                        else replicated(len(ctx.t(v).shape)) for k, v in enumerate(op.ins))
            outs = tuple(keep if len(ctx.t(v).shape) == rank else replicated(len(ctx.t(v).shape))
                         for v in op.outs)
            return Strategy(fmt(keep), ins, outs, shard_factor(keep, ctx.mesh),
                            _gather_comms(ctx, op.ins[lead], s, keep))

        return Follow(lead, derive)

    return rule


# reduce_window's operands are (arrays..., init values...); select_and_gather_add's are
# (tangent, operand), both unpooled; select_and_scatter_add's are (pooled cotangent, operand):
# it follows the unpooled operand, whose shape its result has.
strategy_rule("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
              "select_and_gather_add")(_pooling_rule(0))
strategy_rule("select_and_scatter_add")(_pooling_rule(1))


# ---------------------------------------------------------------------------------------------
# Contractions
# ---------------------------------------------------------------------------------------------
def _assignments(n_classes: int, mesh: Mapping[str, int]):
    """Every map of mesh axes (of size > 1) to a class index, an axis mapped to none omitted."""
    axes = [a for a, n in mesh.items() if n > 1]
    for choice in itertools.product(range(-1, n_classes), repeat=len(axes)):
        yield {a: c for a, c in zip(axes, choice) if c >= 0}


def _with_partial(op: Op, ctx: RuleContext, name: str, ins, out: Sharding, partial: tuple[str, ...],
                  div: int, summed: tuple[tuple[str, ...], ...] = ()) -> list[Strategy]:
    """A contraction whose output is partial over ``partial``: all-reduce, or reduce-scatter
    onto one output dim (see ``_scatter``). ``summed``: ``partial`` by the dim it sums over,
    where several dims do (``_all_reduces``)."""
    if not partial:
        return [Strategy(name, ins, (out,), div)]
    out_v = op.outs[0]
    shape = ctx.t(out_v).shape
    res = [Strategy(name + "|AR", ins, (out,), div,
                    _all_reduces(ctx, ctx.per_device_bytes(out_v, out), partial, summed))]
    for d in range(len(shape)):
        scattered = tuple(tuple(x) + (partial if i == d else ()) for i, x in enumerate(out))
        if divides(scattered, shape, ctx.mesh):
            res.append(_scatter(op, ctx, f"{name}|RS{d}", ins, out, scattered, partial, div))
    return res


def _all_reduces(ctx: RuleContext, nbytes: float, partial: tuple[str, ...],
                 summed: tuple[tuple[str, ...], ...] = ()) -> tuple[Comm, ...]:
    """The all-reduces of a result partial over ``partial``: one over all of it, but where
    ``summed`` names more than one dim summed over on its own axes (a contraction over heads
    split on 'model' and head_dim on 'data'; a reduce_sum over two dims split on two axes),
    XLA's partitioner all-reduces the whole result once per such dim, in turn. XLA:CPU keeps
    them (measured on jax 0.10: two all-reduces of the full result in either axis order, one
    over the 8 devices where one dim is split on both axes): ``ctx.sums_by_dim``. XLA:GPU's
    collective pipeline folds such a chain into one all-reduce (``AllReduceFolder``; read in
    XLA's source, not measured here), as is assumed for TPU."""
    if ctx.sums_by_dim and len([grp for grp in summed if grp]) > 1:
        return tuple(Comm("all-reduce", nbytes, tuple(grp)) for grp in summed if grp)
    return (Comm("all-reduce", nbytes, partial),)


def _scatter(op: Op, ctx: RuleContext, name: str, ins, out: Sharding, scattered: Sharding,
             partial: tuple[str, ...], div: int) -> Strategy:
    """A partial output reduce-scattered onto one dim, as XLA's partitioner implements it.

    When the scattered result stays replicated over mesh axes ``Q`` with ``|Q| >= |partial|``,
    XLA computes only one output tile per device (its row block chosen by the replicated axes),
    all-reduces that tile over ``partial`` and moves tiles to their owners with a
    collective-permute; otherwise it reduce-scatters the whole partial result (measured on
    XLA's SPMD partitioner, jax 0.10; ``autopar.verify`` checks it on every plan)."""
    out_v = op.outs[0]
    used = {a for dim in scattered for a in dim}
    spare = tuple(a for a, n in ctx.mesh.items() if a not in used and n > 1)
    group = math.prod(ctx.mesh[a] for a in partial)
    if op.prim in _CONTRACTION_PRIMS and math.prod(ctx.mesh[a] for a in spare) >= group:
        tile = ctx.per_device_bytes(out_v, scattered)
        # the permute moves tiles between devices that differ along the partial and spare axes
        return Strategy(name, ins, (scattered,), div * group,
                        (Comm("all-reduce", tile, partial),
                         Comm("collective-permute", tile, partial + spare)))
    return Strategy(name, ins, (scattered,), div,
                    (Comm("reduce-scatter", ctx.per_device_bytes(out_v, out), partial),))


_CONTRACTION_PRIMS = ("dot_general", "conv_general_dilated")


def _prune(strategies: list[Strategy], ctx: RuleContext, op: Op) -> tuple[Strategy, ...]:
    """Keep at most ``max_strategies``, the ones that shard most and communicate least.

    Pruning is a heuristic for meshes with three or more axes; small meshes never reach the cap.
    """
    if len(strategies) <= ctx.max_strategies:
        return tuple(strategies)
    def score(s: Strategy) -> tuple:
        comm = sum(c.nbytes for c in s.comms)
        return (-s.compute_div, comm)
    keep = sorted(strategies, key=score)[: ctx.max_strategies]
    return tuple(keep)


def _contract(op: Op, ctx: RuleContext, classes, label: str) -> Choices:
    """A contraction's strategies from its classes (lhs dim, rhs dim, out dim, partial)."""
    shapes = [ctx.t(v).shape for v in (op.ins[0], op.ins[1], op.outs[0])]
    strategies: list[Strategy] = []
    for (ls, rs, os_), partial in _indexed_layouts(classes, shapes, ctx):
        name = f"{fmt(ls)} {label} {fmt(rs)} -> {fmt(os_)}"
        summed = tuple(ls[c[0]] for c in classes if c[-1])   # per contracting dim: its axes
        strategies += _with_partial(op, ctx, name, (ls, rs), os_, partial, _work_div(ls, rs, ctx),
                                    summed)
    return Choices(_prune(strategies, ctx, op))


def _work_div(ls: Sharding, rs: Sharding, ctx: RuleContext) -> int:
    """Devices sharing a contraction's work: every mesh axis that splits either operand."""
    return math.prod(ctx.mesh[a] for a in set(a for s in (ls, rs) for d in s for a in d))


@strategy_rule("dot_general")
def dot_general_rule(op: Op, ctx: RuleContext) -> Choices:
    """Batch pairs, free dims of either side, or contracting pairs (a partial sum)."""
    (lc, rc), (lb, rb) = op.param("dimension_numbers")
    lrank, rrank = len(ctx.t(op.ins[0]).shape), len(ctx.t(op.ins[1]).shape)
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]
    classes = ([(lb[k], rb[k], k, False) for k in range(len(lb))]            # batch
               + [(d, None, len(lb) + i, False) for i, d in enumerate(lfree)]  # lhs free
               + [(None, d, len(lb) + len(lfree) + i, False) for i, d in enumerate(rfree)]
               + [(lc[k], rc[k], None, True) for k in range(len(lc))])      # contracting
    return _contract(op, ctx, classes, "@")


@strategy_rule("conv_general_dilated")
def conv_rule(op: Op, ctx: RuleContext) -> Choices:
    """Batch and output-feature dims may be split; input features are a contraction."""
    lhs_spec, rhs_spec, out_spec = op.param("dimension_numbers")
    groups = op.param("feature_group_count", 1) * op.param("batch_group_count", 1)
    classes = [(lhs_spec[0], None, out_spec[0], False),      # batch
               (None, rhs_spec[0], out_spec[1], False)]      # output features
    if groups == 1:
        classes.append((lhs_spec[1], rhs_spec[1], None, True))  # input features
    return _contract(op, ctx, classes, "*")


# ---------------------------------------------------------------------------------------------
# Gather / scatter (embedding lookups, take_along_axis, their gradients)
# ---------------------------------------------------------------------------------------------
def _dn(op: Op) -> dict:
    return dict(op.param("dimension_numbers", ()))


def _gather_classes(op: Op, ctx: RuleContext):
    """(class, operand dim, indices dim, output dim, partial) for each way one axis may split."""
    dn = _dn(op)
    o_shape, i_shape = ctx.t(op.ins[0]).shape, ctx.t(op.ins[1]).shape
    out_rank = len(ctx.t(op.outs[0]).shape)
    offset = list(dn["offset_dims"])
    batch_out = [d for d in range(out_rank) if d not in offset]
    obatch, ibatch = list(dn["operand_batching_dims"]), list(dn["start_indices_batching_dims"])
    window = [d for d in range(len(o_shape)) if d not in dn["collapsed_slice_dims"]
              and d not in obatch]
    sizes = op.param("slice_sizes")
    out = []
    for j in range(len(i_shape) - 1):
        od = obatch[ibatch.index(j)] if j in ibatch else None
        out.append((od, j, batch_out[j], False))
    for k, d in enumerate(window):
        if sizes[d] == o_shape[d]:
            out.append((d, None, offset[k], False))
    for d in dn["start_index_map"]:
        if d in dn["collapsed_slice_dims"] and sizes[d] == 1:
            out.append((d, None, None, True))
    return out


def _indexed_layouts(classes, shapes, ctx: RuleContext):
    """Each valid way to place the mesh axes on ``classes`` (tuples of one dim per tensor, or
    None, plus a partial flag): (a layout per tensor in ``shapes``, the partial-sum axes).
    On many-axis meshes there are (classes + 1) ** axes ways: past the plan call's time limit
    (``ctx.clock``) the enumeration stops with the ways found so far."""
    for n, assign in enumerate(_assignments(len(classes), ctx.mesh)):
        if ctx.clock is not None and n % 4096 == 4095 and ctx.clock.spent(SEARCH_BEFORE):
            return
        dims = [[[] for _ in shape] for shape in shapes]
        partial = []
        for axis, ci in assign.items():
            *where, is_partial = classes[ci]
            for tensor, d in enumerate(where):
                if d is not None:
                    dims[tensor][d].append(axis)
            if is_partial:
                partial.append(axis)
        layouts = tuple(tuple(map(tuple, x)) for x in dims)
        if all(divides(s, shape, ctx.mesh) for s, shape in zip(layouts, shapes)):
            yield layouts, tuple(partial)


@strategy_rule("gather")
def gather_rule(op: Op, ctx: RuleContext) -> Choices:
    """Indices split along their batch dims, operand along whole-slice dims, or operand along the
    indexed dim (each device looks up what it holds; the partial result is all-reduced)."""
    shapes = [ctx.t(v).shape for v in (op.ins[0], op.ins[1], op.outs[0])]
    strategies = []
    for (os_, is_, rs), partial in _indexed_layouts(_gather_classes(op, ctx), shapes, ctx):
        ins = (os_, is_) + (None,) * (len(op.ins) - 2)
        strategies += _with_partial(op, ctx, f"gather {fmt(os_)}[{fmt(is_)}]", ins, rs,
                                    partial, shard_factor(rs, ctx.mesh) or 1)[:1]
    return Choices(_prune(strategies, ctx, op))


def _scatter_classes(op: Op, ctx: RuleContext):
    """(operand dim, indices dim, updates dim, partial) per way one axis may split."""
    dn = _dn(op)
    o_shape, i_shape, u_shape = (ctx.t(v).shape for v in op.ins[:3])
    uwin = list(dn["update_window_dims"])
    u_scatter = [d for d in range(len(u_shape)) if d not in uwin]
    obatch, ibatch = list(dn["operand_batching_dims"]), list(dn["scatter_indices_batching_dims"])
    window = [d for d in range(len(o_shape)) if d not in dn["inserted_window_dims"]
              and d not in obatch]
    out = []
    for j in range(len(i_shape) - 1):
        if j in ibatch:
            out.append((obatch[ibatch.index(j)], j, u_scatter[j], False))
        else:
            out.append((None, j, u_scatter[j], True))
    for k, d in enumerate(window):
        if u_shape[uwin[k]] == o_shape[d]:
            out.append((d, None, uwin[k], False))
    for d in dn["scatter_dims_to_operand_dims"]:
        if d in dn["inserted_window_dims"]:
            out.append((d, None, None, False))
    return out


@strategy_rule("scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul",
               "scatter-min", "scatter-max")
def scatter_rule(op: Op, ctx: RuleContext) -> Choices:
    """Updates split with their indices (a partial sum, all-reduced, unless the indices are
    batched with the operand), along whole windows, or the operand along the scattered dim
    (each device applies the updates that land in its slice)."""
    if len(op.ins) < 3:
        return fallback_rule(op, ctx)
    shapes = [ctx.t(v).shape for v in op.ins[:3]]
    strategies = []
    for (os_, is_, us), partial in _indexed_layouts(_scatter_classes(op, ctx), shapes, ctx):
        if partial and op.prim not in ("scatter-add", "scatter_add"):
            continue   # only a sum can be completed by an all-reduce
        ins = (os_, is_, us) + (None,) * (len(op.ins) - 3)
        strategies += _with_partial(op, ctx, f"scatter {fmt(os_)}<-{fmt(us)}", ins, os_,
                                    partial, max(shard_factor(us, ctx.mesh), 1))[:1]
    return Choices(_prune(strategies, ctx, op))
