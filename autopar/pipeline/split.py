"""A layer's backward in two halves, for zero-bubble schedules: the input gradient now, the
weight gradient later.

Zero-bubble pipelines (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) run a layer's
backward as two actions: ``B``, the gradient with respect to its input, which the previous stage
waits for, and ``W``, the gradient with respect to its weights, which nothing downstream reads and
a stage may run whenever it would otherwise idle. This module cuts any layer function's backward
at that line, from its jaxpr, with no knowledge of the layer:

  * ``forward(p, h) -> (y, saved)``: the layer and what ``jax.vjp`` keeps for its backward
    (``saved``), without the parameters it keeps by reference (the backward reads them from
    ``p`` again, so a stage does not copy its weights per microbatch);
  * ``input_grad(p, saved, dy) -> (dh, frontier)``: the equations of the backward that the input
    gradient needs, and the values the other equations read from them (the *frontier*: the
    cotangents at each weight's matmul and the activations they multiply);
  * ``weight_grad(p, frontier) -> dp``: the remaining equations.

A stage holds a microbatch's frontier from its ``B`` to its ``W``; ``frontier`` gives its arrays'
shapes, and ``flops`` the dot FLOPs of the forward and of each half (the planner splits a priced
backward by them). An equation both halves need goes to ``B``. A user's remat and nested jits
are opened first (their bodies inlined), so a remat'd layer splits too: its ``B`` recomputes the
layer and its frontier is what ``W`` reads of the recomputed values. A call the split does not
open (a custom VJP, a jit closing over constants) stays whole in the half that needs it: the
split is then coarser, never wrong.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.extend import core as jcore


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    forward: Callable        # (p, h) -> (y, saved)
    input_grad: Callable     # (p, saved, dy) -> (dh, frontier)
    weight_grad: Callable    # (p, frontier) -> dp
    frontier: tuple          # ShapeDtypeStructs of one microbatch's frontier
    flops: tuple             # dot FLOPs of (forward, input half, weight half)

    @property
    def frontier_bytes(self) -> float:
        return float(sum(math.prod(a.shape) * a.dtype.itemsize for a in self.frontier))

    @property
    def weight_fraction(self) -> float:
        """The weight half's share of a recomputing backward's FLOPs (forward + both halves)."""
        total = sum(self.flops)
        return self.flops[2] / total if total else 0.0


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def split_layer(layer_fn: Callable, p, h) -> LayerSplit:
    """``layer_fn(p, h) -> y``'s backward cut into its input and weight halves (module
    docstring), traced at the shapes of ``p`` and ``h`` (arrays or ``ShapeDtypeStruct``s)."""
    p, h = _abstract(p), _abstract(h)
    p_tree = jax.tree_util.tree_structure(p)
    seen: dict = {}

    def fwd(p, h):
        y, vjp = jax.vjp(layer_fn, p, h)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        mine = jax.tree_util.tree_leaves(p)
        where = tuple(next((j for j, q in enumerate(mine) if q is r), None) for r in leaves)
        seen.update(tree=tree, where=where)
        return y, [r for r, j in zip(leaves, where) if j is None]

    fwd_closed, (y, saved) = jax.make_jaxpr(fwd, return_shape=True)(p, h)
    tree, where = seen["tree"], seen["where"]

    def bwd(p, saved, dy):
        mine, rest = jax.tree_util.tree_leaves(p), iter(saved)
        leaves = [next(rest) if j is None else mine[j] for j in where]
        dp, dh = jax.tree_util.tree_unflatten(tree, leaves)(dy)
        return dh, dp

    closed = jax.make_jaxpr(bwd)(p, saved, y)
    jaxpr = _opened(closed.jaxpr)
    n_p, n_dh = p_tree.num_leaves, len(jax.tree_util.tree_leaves(h))
    b_eqns = _slice(jaxpr.eqns, jaxpr.outvars[:n_dh], frozenset())
    w_eqns = _slice(jaxpr.eqns, jaxpr.outvars[n_dh:], frozenset(map(id, b_eqns)))
    made_in_w = {v for e in w_eqns for v in e.outvars}
    p_vars = set(jaxpr.invars[:n_p]) | set(jaxpr.constvars)
    frontier = []
    for v in [x for e in w_eqns for x in e.invars] + list(jaxpr.outvars[n_dh:]):
        if isinstance(v, jcore.Var) and v not in made_in_w and v not in p_vars \
                and v not in frontier:
            frontier.append(v)
    b_ins, b_outs = jaxpr.invars, [*jaxpr.outvars[:n_dh], *frontier]
    w_ins, w_outs = [*jaxpr.invars[:n_p], *frontier], jaxpr.outvars[n_dh:]
    b_jaxpr = jcore.Jaxpr(jaxpr.constvars, b_ins, b_outs, b_eqns, jaxpr.effects,
                          debug_info=_info(jaxpr, "input", len(b_ins), len(b_outs)))
    w_jaxpr = jcore.Jaxpr(jaxpr.constvars, w_ins, w_outs, w_eqns, jaxpr.effects,
                          debug_info=_info(jaxpr, "weight", len(w_ins), len(w_outs)))
    b_fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(b_jaxpr, closed.consts))
    w_fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(w_jaxpr, closed.consts))
    f_fn = jcore.jaxpr_as_fun(fwd_closed)
    y_tree = jax.tree_util.tree_structure(y)
    h_tree = jax.tree_util.tree_structure(h)

    def forward(p, h):
        outs = f_fn(*jax.tree_util.tree_leaves(p), *jax.tree_util.tree_leaves(h))
        n_y = y_tree.num_leaves
        return jax.tree_util.tree_unflatten(y_tree, outs[:n_y]), list(outs[n_y:])

    def input_grad(p, saved, dy):
        outs = b_fn(*jax.tree_util.tree_leaves(p), *saved, *jax.tree_util.tree_leaves(dy))
        return jax.tree_util.tree_unflatten(h_tree, outs[:n_dh]), list(outs[n_dh:])

    def weight_grad(p, front):
        return jax.tree_util.tree_unflatten(p_tree, w_fn(*jax.tree_util.tree_leaves(p), *front))

    shapes = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in frontier)
    flops = (_flops(fwd_closed.jaxpr.eqns), _flops(b_eqns), _flops(w_eqns))
    return LayerSplit(forward, input_grad, weight_grad, shapes, flops)


# calls whose body the split opens: a user's remat (its transposed body holds the layer's whole
# backward) and nested jits (jax.nn's helpers, a user's own), when they close over no constants
_OPEN = ("remat2", "checkpoint", "jit", "pjit", "closed_call")


def _opened(jaxpr):
    """``jaxpr`` with the calls of ``_OPEN`` inlined (recursively), so the split sees their
    equations. Same values: a remat's only effect inside one backward is on XLA's buffers."""
    sub: dict = {}
    eqns: list = []

    def read(v):
        while isinstance(v, jcore.Var) and v in sub:
            v = sub[v]
        return v

    def body(e):
        inner = e.params.get("jaxpr")
        if isinstance(inner, jcore.ClosedJaxpr) and not inner.consts:
            inner = inner.jaxpr
        if e.primitive.name in _OPEN and isinstance(inner, jcore.Jaxpr) \
                and not inner.constvars:
            return inner
        return None

    def walk(items):
        for e in items:
            inner = body(e)
            if inner is None:
                eqns.append(e.replace(invars=[read(v) for v in e.invars]))
                continue
            for iv, ov in zip(inner.invars, e.invars):
                sub[iv] = read(ov)
            walk(inner.eqns)
            for iv, ov in zip(inner.outvars, e.outvars):
                sub[ov] = read(iv)

    walk(jaxpr.eqns)
    return jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, [read(v) for v in jaxpr.outvars], eqns,
                       jaxpr.effects, debug_info=jaxpr.debug_info)


def _info(jaxpr, half: str, n_in: int, n_out: int):
    """The backward's debug info renamed for one half, with names for its own inputs and
    outputs (another jax's DebugInfo: None)."""
    info = jaxpr.debug_info
    try:
        return info._replace(arg_names=tuple(f"{half} half input {i}" for i in range(n_in)),
                             result_paths=tuple(f"{half} half output {i}"
                                                for i in range(n_out)))
    except (AttributeError, TypeError):
        return None


def _slice(eqns, outvars, taken: frozenset) -> list:
    """The equations ``outvars`` need, in order, except those whose id is in ``taken``."""
    need = {v for v in outvars if isinstance(v, jcore.Var)}
    keep = []
    for e in reversed(eqns):
        if id(e) in taken or not any(v in need for v in e.outvars):
            continue
        keep.append(e)
        need.update(v for v in e.invars if isinstance(v, jcore.Var))
    return keep[::-1]


def _flops(eqns, times: float = 1.0) -> float:
    """Dot FLOPs of ``eqns``, inside nested jaxprs too (a scan's body times its length)."""
    total = 0.0
    for e in eqns:
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            a = e.invars[0].aval
            total += 2.0 * math.prod(e.outvars[0].aval.shape) * math.prod(
                a.shape[d] for d in lc) * times
            continue
        n = e.params.get("length", 1) if e.primitive.name == "scan" else 1
        for sub in _subjaxprs(e.params):
            total += _flops(sub.eqns, times * n)
    return total


def _subjaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x
