"""Lower a JAX function to an ``ir.Graph`` without running or allocating anything.

``trace(fn, *args)`` calls ``jax.make_jaxpr`` on abstract (or concrete) args, then walks the
jaxpr once (linear in the number of equations, nested ones included):

  * ``jit`` is inlined; ``remat2``/``checkpoint``, ``custom_jvp_call`` and ``custom_vjp_call`` are
    inlined with their name pushed on the inlined ops' ``scope``.
  * ``scan`` stays one op with its body as a ``Region`` (cost = body x ``length``); ``while``
    keeps ``(body, cond)`` regions; ``cond`` keeps one region per branch (cost = max branch).
  * every other primitive becomes one ``Op``; FLOPs come from ``ir.flops.FLOP_RULES``. A primitive
    without a rule gets 0 flops, is costed by its bytes and carries ``("fallback", True)`` in
    its params (listed in ``Graph.fallbacks``). A primitive with sub-jaxprs that the tracer does
    not know raises ``UnsupportedPrimitiveError``.

Before/after, for ``f(x, w) = jnp.tanh(x @ w)`` with ``x: f32[8,16]``, ``w: f32[16,4]``::

    { lambda ; a:f32[8,16] b:f32[16,4]. let           %2 = dot_general(%0, %1) f32[8,4] flops=1024
        c:f32[8,4] = dot_general[...] a b              %3 = tanh(%2) f32[8,4] flops=0
        d:f32[8,4] = tanh c in (d,) }
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from ir import collector
from ir.dce import effectful, eliminate_dead_ops
from ir.errors import UnsupportedPrimitiveError
from ir.flops import FLOP_RULES, NOT_CONST, Cost, fold, op_cost
from ir.graph import Graph, Op, Region, TensorType
from ir.layers import find_layers
from ir.params import CONSTRAINT, constraint_spec, reduce_params

# primitive -> param holding the jaxpr to inline, and the scope marker (None: no marker).
INLINE_RULES: dict[str, tuple[str, str | None]] = {
    "jit": ("jaxpr", None),
    "pjit": ("jaxpr", None),
    "closed_call": ("call_jaxpr", None),
    "core_call": ("call_jaxpr", None),
    "remat2": ("jaxpr", "remat2"),
    "checkpoint": ("jaxpr", "remat2"),
    "custom_jvp_call": ("call_jaxpr", "custom_jvp_call"),
    "custom_vjp_call": ("call_jaxpr", "custom_vjp_call"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "custom_vjp_call"),
}
# primitive -> params holding its region jaxprs, in ``Op.regions`` order.
REGION_RULES: dict[str, tuple[str, ...]] = {
    "scan": ("jaxpr",),
    "while": ("body_jaxpr", "cond_jaxpr"),
    "cond": ("branches",),
}


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """Where an equation sits: origin prefix, inlined scopes, name-stack prefix."""

    origin: tuple[int, ...] = ()
    scope: tuple[str, ...] = ()
    name: str = ""
    source: str = ""  # the enclosing call's location, for inlined eqns that have none
    site: str = ""    # likewise, its site (``Op.site``)


class _Builder:
    """Mutable state of one ``trace`` call (ids, values, literals); never shared."""

    def __init__(self) -> None:
        self.values: list[TensorType] = []
        self.literals: list[tuple[int, Any]] = []
        self.consts: list[int] = []
        self.splats: dict[int, Any] = {}  # value id -> scalar of a splat constant (see flops.fold)
        self.nbytes: list[int] = []  # per value id, cached: 45k-op graphs ask for it often
        self.n_ops = 0
        self.effects: list[int] = []  # op ids of equations with side effects (never dropped)
        self._types: dict[tuple[Any, Any], TensorType] = {}

    def new_value(self, aval: Any) -> int:
        key = (getattr(aval, "shape", ()), getattr(aval, "dtype", None))
        t = self._types.get(key)
        if t is None:
            t = self._types[key] = tensor_type(aval)
        self.values.append(t)
        self.nbytes.append(t.nbytes)
        return len(self.values) - 1

    def new_op_id(self) -> int:
        self.n_ops += 1
        return self.n_ops - 1

    def read(self, env: dict[Any, int], atom: Any) -> int:
        if isinstance(atom, jcore.Literal):
            vid = self.new_value(atom.aval)
            self.literals.append((vid, _literal_value(atom.val)))
            self.splats[vid] = self.literals[-1][1]
            return vid
        return env[atom]

    def bind_consts(self, env: dict[Any, int], closed: Any) -> None:
        """Gives a ClosedJaxpr's constvars ids, recorded as graph consts."""
        for var in closed.jaxpr.constvars:
            env[var] = self.new_value(var.aval)
            self.consts.append(env[var])


def tensor_type(aval: Any) -> TensorType:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return TensorType(shape, "token" if dtype is None else str(dtype))


def _literal_value(val: Any) -> Any:
    arr = np.asarray(val)
    return arr.item() if arr.size == 1 else tuple(arr.ravel().tolist())


# ---- source locations -------------------------------------------------------------------------
@functools.cache
def _is_library_file(filename: str) -> bool:
    """Frames to skip when a user frame exists: jax internals, installed packages, stdlib."""
    if "site-packages" in filename or "dist-packages" in filename:
        return True
    try:  # private, but it knows jax's own exclusions (tests, registered paths)
        from jax._src import source_info_util as siu

        return not siu.is_user_filename(filename)
    except (ImportError, AttributeError):
        return "/jax/" in filename or filename.startswith("<")


def source_of(source_info: Any) -> str:
    """``"file.py:LINE (function)"`` of the innermost user frame (basename only), or ``""``."""
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return ""
    try:
        codes, lastis = tb.raw_frames()
    except Exception:  # noqa: BLE001 - private API; a missing location is not an error
        return ""
    for code, lasti in zip(codes, lastis):
        if not _is_library_file(code.co_filename):
            return _location(code, lasti)
    return ""


def site_of(source_info: Any) -> str:
    """``"file.py:LINE"`` of the innermost frame outside jax's own package (a flax,
    transformers or user line), or ``""``."""
    tb = getattr(source_info, "traceback", None)
    try:
        codes, lastis = tb.raw_frames()
    except Exception:  # noqa: BLE001 - private API (and no traceback): no site
        return ""
    for code, lasti in zip(codes, lastis):
        if not _is_jax_file(code.co_filename):
            return _site(code, lasti)
    return ""


@functools.cache
def _is_jax_file(filename: str) -> bool:
    return filename.startswith(_jax_dirs()) or filename.startswith("<")


@functools.cache
def _jax_dirs() -> tuple[str, ...]:
    import jaxlib

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib))


@functools.lru_cache(maxsize=4096)
def _site(code: Any, lasti: int) -> str:
    return f"{os.path.basename(code.co_filename)}:{_line_of(code, lasti)}"


@functools.lru_cache(maxsize=4096)
def _location(code: Any, lasti: int) -> str:
    line = _line_of(code, lasti)
    return f"{os.path.basename(code.co_filename)}:{line} ({code.co_qualname})"


def _line_of(code: Any, lasti: int) -> int:
    try:
        from jax._src.lib import xla_client

        return int(xla_client.Traceback.code_addr2line(code, lasti))
    except (ImportError, AttributeError):
        return int(code.co_firstlineno)


def _join_name(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix and name else prefix or name


# ---- the walk ---------------------------------------------------------------------------------
def lower_eqns(b: _Builder, jaxpr: Any, env: dict[Any, int], ctx: _Ctx) -> list[Op]:
    """Lowers a jaxpr's equations in order; ``env`` maps its vars to value ids (updated)."""
    ops: list[Op] = []
    for i, eqn in enumerate(jaxpr.eqns):
        prim = eqn.primitive.name
        here = _Ctx(ctx.origin + (i,), ctx.scope, ctx.name, ctx.source, ctx.site)
        if prim in INLINE_RULES:
            ops.extend(_inline(b, eqn, env, here))
        elif prim == "custom_linear_solve":
            ops.extend(_linear_solve(b, eqn, env, here))
        elif prim in REGION_RULES:
            ops.append(_region_op(b, eqn, env, here))
        else:
            if prim not in FLOP_RULES:  # known prims may carry combiner jaxprs (scatter-add)
                _check_no_subjaxpr(eqn, here)
            ops.append(_plain_op(b, eqn, env, here))
    return ops


def _eqn_ids(b: _Builder, eqn: Any, env: dict[Any, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ins = tuple(b.read(env, a) for a in eqn.invars)
    outs = []
    for var in eqn.outvars:
        vid = b.new_value(var.aval)
        if not isinstance(var, jcore.DropVar):
            env[var] = vid
        outs.append(vid)
    return ins, tuple(outs)


def _plain_op(b: _Builder, eqn: Any, env: dict[Any, int], ctx: _Ctx) -> Op:
    ins, outs = _eqn_ids(b, eqn, env)
    params = reduce_params(eqn.params)
    if eqn.primitive.name == "sharding_constraint":     # the user's layout, read for the planner
        params += ((CONSTRAINT, constraint_spec(eqn.params, len(eqn.invars[0].aval.shape))),)
    in_t = [b.values[v] for v in ins]
    out_t = [b.values[v] for v in outs]
    folded, splat = fold(eqn.primitive.name, [b.splats.get(v, NOT_CONST) for v in ins])
    if splat is not NOT_CONST:
        b.splats.update((v, splat) for v in outs)
    cost = Cost() if folded else op_cost(eqn.primitive.name, in_t, out_t, dict(params))
    if cost is None:  # conservative fallback: no flops, costed by the bytes it moves
        params, cost = params + (("fallback", True),), Cost()
    nbytes = float(sum(b.nbytes[v] for v in ins) + sum(b.nbytes[v] for v in outs))
    return _make_op(b, eqn, ctx, ins, outs, params, cost, nbytes)


def _make_op(b: _Builder, eqn: Any, ctx: _Ctx, ins: tuple[int, ...], outs: tuple[int, ...],
             params: tuple, cost: Cost, nbytes: float, regions: tuple[Region, ...] = (),
             trip_count: int = 1, op_id: int | None = None) -> Op:
    op_id = b.new_op_id() if op_id is None else op_id
    if eqn.effects:
        b.effects.append(op_id)
    return Op(id=op_id, prim=eqn.primitive.name, ins=ins, outs=outs, params=params,
              flops=cost.flops, transcendentals=cost.transcendentals, bytes_accessed=nbytes,
              source=source_of(eqn.source_info) or ctx.source,
              site=site_of(eqn.source_info) or ctx.site,
              name=_join_name(ctx.name, str(eqn.source_info.name_stack)),
              scope=ctx.scope, origin=ctx.origin, regions=regions, trip_count=trip_count)


def _inline(b: _Builder, eqn: Any, env: dict[Any, int], ctx: _Ctx) -> list[Op]:
    """Inlines a call: its jaxpr's invars alias the call's inputs, its outvars its outputs."""
    key, marker = INLINE_RULES[eqn.primitive.name]
    sub = eqn.params.get(key)
    if sub is None:
        raise _unsupported(eqn, f"has no '{key}' param to inline", ctx)
    inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
    return _inline_jaxpr(b, eqn, sub, eqn.invars[len(eqn.invars) - len(inner.invars):], env,
                         ctx, marker)


def _linear_solve(b: _Builder, eqn: Any, env: dict[Any, int], ctx: _Ctx) -> list[Op]:
    """``custom_linear_solve`` (``jnp.linalg.solve``/``inv``, ``cho_solve``) computes
    ``solve(matvec, b)``: inline its ``solve`` jaxpr on the solve's constants and ``b``. Its
    other jaxprs serve differentiation, which the traced step has already done."""
    lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
    start = lengths.matvec + lengths.vecmat
    consts = eqn.invars[start:start + lengths.solve]
    rhs = eqn.invars[sum(lengths):]
    return _inline_jaxpr(b, eqn, jaxprs.solve, list(consts) + list(rhs), env, ctx, None)


def _inline_jaxpr(b: _Builder, eqn: Any, sub: Any, atoms, env: dict[Any, int], ctx: _Ctx,
                  marker: str | None) -> list[Op]:
    """Lowers ``sub`` (a jaxpr called by ``eqn``) on ``atoms``; ``eqn``'s outvars alias its
    outvars."""
    inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
    inner_env: dict[Any, int] = {}
    if isinstance(sub, jcore.ClosedJaxpr):
        b.bind_consts(inner_env, sub)
    for var, atom in zip(inner.invars, atoms):
        inner_env[var] = b.read(env, atom)
    inner_ctx = _Ctx(ctx.origin, ctx.scope + ((marker,) if marker else ()),
                     _join_name(ctx.name, str(eqn.source_info.name_stack)),
                     source_of(eqn.source_info) or ctx.source,
                     site_of(eqn.source_info) or ctx.site)
    ops = lower_eqns(b, inner, inner_env, inner_ctx)
    for var, atom in zip(eqn.outvars, inner.outvars):
        if not isinstance(var, jcore.DropVar):
            env[var] = b.read(inner_env, atom)
    return ops


def _region(b: _Builder, closed: Any, ctx: _Ctx) -> tuple[Region, Cost, float]:
    """A nested body with fresh ids; returns it with its total cost and bytes."""
    jaxpr = closed.jaxpr if isinstance(closed, jcore.ClosedJaxpr) else closed
    env: dict[Any, int] = {}
    if isinstance(closed, jcore.ClosedJaxpr):
        b.bind_consts(env, closed)
    for var in jaxpr.invars:
        env[var] = b.new_value(var.aval)
    inputs = tuple(env[v] for v in jaxpr.invars)
    ops = lower_eqns(b, jaxpr, env, ctx)
    outputs = tuple(b.read(env, a) for a in jaxpr.outvars)
    cost = sum((Cost(op.flops, op.transcendentals) for op in ops), Cost())
    return Region(tuple(ops), inputs, outputs), cost, sum(op.bytes_accessed for op in ops)


def _region_op(b: _Builder, eqn: Any, env: dict[Any, int], ctx: _Ctx) -> Op:
    prim = eqn.primitive.name
    op_id = b.new_op_id()  # before the body's ops, so that ids follow the pre-order walk
    subs = [eqn.params[k] for k in REGION_RULES[prim]]
    if prim == "cond":
        subs = list(subs[0])
    inner_ctx = _Ctx(ctx.origin, ctx.scope, _join_name(ctx.name, str(eqn.source_info.name_stack)),
                     source_of(eqn.source_info) or ctx.source,
                     site_of(eqn.source_info) or ctx.site)
    # a region's ops extend the origin with the region's index: (eqn, region, eqn in region, ...)
    built = [_region(b, s, dataclasses.replace(inner_ctx, origin=inner_ctx.origin + (r,)))
             for r, s in enumerate(subs)]
    ins, outs = _eqn_ids(b, eqn, env)
    trip = int(eqn.params.get("length", 1)) if prim == "scan" else 1
    regions = tuple(r for r, _, _ in built)
    if prim == "cond":  # one branch runs: the most expensive one bounds the cost
        cost = max((c for _, c, _ in built), key=lambda c: (c.flops, c.transcendentals))
        nbytes = max(n for _, _, n in built)
    else:
        cost = sum((c for _, c, _ in built), Cost()).scale(trip)
        nbytes = sum(n for _, _, n in built) * trip
    return _make_op(b, eqn, ctx, ins, outs, reduce_params(eqn.params), cost, nbytes,
                    regions, trip, op_id)


def _check_no_subjaxpr(eqn: Any, ctx: _Ctx) -> None:
    for key, v in eqn.params.items():
        items = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr)) for x in items):
            raise _unsupported(eqn, f"carries a sub-jaxpr in param '{key}' of unknown structure",
                               ctx)


def _unsupported(eqn: Any, why: str, ctx: _Ctx | None = None) -> UnsupportedPrimitiveError:
    where = source_of(eqn.source_info) or (ctx.source if ctx else "") or "unknown source"
    name = str(eqn.source_info.name_stack) or (ctx.name if ctx else "")
    return UnsupportedPrimitiveError(
        f"primitive '{eqn.primitive.name}' at {where}{f' ({name})' if name else ''} {why}, so "
        f"autopar cannot plan through it. Compute it outside the step and pass its result in, "
        f"or write it with other jax operations; if it is a jax primitive, report it to autopar "
        f"(ir.from_jaxpr's INLINE_RULES or REGION_RULES would take it).")


# ---- entry point ------------------------------------------------------------------------------
def trace(fn: Callable[..., Any], *args: Any, donate_argnums: int | Sequence[int] = (),
          dce: bool = True, **kwargs: Any) -> Graph:
    """Traces ``fn(*args, **kwargs)`` into an ``ir.Graph``; nothing is allocated or run.

    Args:
      fn: the function, e.g. a training step ``step(state, batch)``.
      *args: pytrees of arrays or ``jax.ShapeDtypeStruct``s (flax params, optax states, ...).
      donate_argnums: positional args whose buffers the caller donates (``Graph.donated``).
      dce: drop ops whose results are unused (``ir.dce``), as XLA does; ``origin`` still points
        into the untouched ``Graph.jaxpr``.
      **kwargs: keyword arguments bound into ``fn`` before tracing (arrays become graph consts).

    Returns:
      The graph; ``input_paths`` are ``jax.tree_util.keystr`` of each leaf with the args wrapped
      in a tuple, e.g. ``"[0]['params']['wte']['embedding']"``.
    """
    with collector.paused():   # see ir.collector: a quarter of a deep trace went to collections
        return _trace(fn, args, donate_argnums, dce, kwargs)


def _trace(fn, args, donate_argnums, dce: bool, kwargs) -> Graph:
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    closed, out_shape = jax.make_jaxpr(bound, return_shape=True)(*args)
    donate = {donate_argnums} if isinstance(donate_argnums, int) else set(donate_argnums)
    in_paths, in_tree = jax.tree_util.tree_flatten_with_path(tuple(args))
    out_paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    return _graph(closed, in_tree, out_tree,
                  tuple(jax.tree_util.keystr(p) for p, _ in in_paths),
                  tuple(jax.tree_util.keystr(p) for p, _ in out_paths),
                  tuple(isinstance(p[0], jax.tree_util.SequenceKey) and p[0].idx in donate
                        for p, _ in in_paths), dce)


def graph_of(closed, like: Graph, dce: bool = True) -> Graph:
    """The graph of ``closed``, a jaxpr of the same function as ``like``'s (same inputs and
    outputs, e.g. rewritten by ``ir.recompute``): its trees, paths and donations are ``like``'s."""
    return _graph(closed, like.in_tree, like.out_tree, like.input_paths, like.output_paths,
                  like.donated, dce)


def _graph(closed, in_tree, out_tree, input_paths, output_paths, donated, dce: bool) -> Graph:
    b = _Builder()
    env: dict[Any, int] = {}
    b.bind_consts(env, closed)
    inputs = tuple(b.new_value(v.aval) for v in closed.jaxpr.invars)
    env.update(zip(closed.jaxpr.invars, inputs))
    ops = lower_eqns(b, closed.jaxpr, env, _Ctx())
    outputs = tuple(b.read(env, a) for a in closed.jaxpr.outvars)
    graph = Graph(
        ops=tuple(ops), values=tuple(b.values), inputs=inputs, outputs=outputs,
        input_paths=input_paths, output_paths=output_paths, donated=donated,
        literals=tuple(b.literals), consts=tuple(b.consts), jaxpr=closed, in_tree=in_tree,
        out_tree=out_tree)
    if dce:
        graph = eliminate_dead_ops(graph, effectful(graph.all_ops(), b.effects))
    return find_layers(graph)
