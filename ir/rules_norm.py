"""Forward recogniser of LayerNorm/RMSNorm with the residual add before it, anchored at the
``rsqrt`` of the variance (flax) or its ``sqrt`` that the rows are divided by (transformers'
Llama, Mistral, Gemma: ``x / sqrt(mean(x^2) + eps) * w``). A scale applied as ``(1 + w)``
(Gemma) is role ``scale`` with attr ``scale_offset`` 1. See ``ir.patterns`` for the roles."""
from __future__ import annotations

from collections.abc import Iterable

from ir.dataflow import (
    LAYOUT,
    is_constant,
    mean_arg,
    producer,
    role_inputs,
    split_literal,
    square_arg,
    strip,
)
from ir.graph import Op
from ir.patterns import Index, Match, cone, externals, make_match

_CONVERT = frozenset({"convert_element_type"})


# ---- norms ------------------------------------------------------------------------------------
def find_norm(index: Index, rsqrt: Op) -> Match | None:
    """LayerNorm / RMSNorm (flax's fast and two-pass variance) anchored at ``rsqrt``, with the
    residual add that produces its input when there is one. The input is taken before any
    dtype conversion (flax computes bf16 norms' statistics in float32)."""
    add = producer(index, strip(index, rsqrt.ins[0], rsqrt), rsqrt, "add")
    eps = split_literal(index, add) if add is not None else None
    stats = _norm_input(index, eps[0], rsqrt) if eps is not None else None
    if stats is None:
        return None
    x_stats, kind = stats
    x = strip(index, x_stats, rsqrt, _CONVERT)
    y = _norm_output(index, rsqrt, x, x_stats)
    res = producer(index, x, rsqrt, "add")
    residual = res is not None and index.shape(res.ins[0]) == index.shape(res.ins[1]) == \
        index.shape(x) and not any(i in index.literals for i in res.ins)
    stops = list(res.ins) if residual else [x]
    ops = cone(index, [y], stops, rsqrt) if y is not None else set()
    if y is None or (residual and res.id not in ops):
        return None
    named = dict(zip(stops, ("x", "residual"))) if residual else {x: "x"}
    params, offset = _norm_params(index, ops, stops)
    named.update(params)
    inputs = role_inputs(index, ops, named)
    if inputs is None:
        return None
    outputs = [("y", y)] + ([("h", x)] if residual else [])
    attrs = {"kind": kind, "eps": eps[1], "residual": residual, "width": index.shape(x)[-1],
             "scale_offset": offset}
    return make_match(index, "norm_fwd", ops, inputs, outputs, attrs)


def _norm_input(index: Index, var: int, anchor: Op) -> tuple[int, str] | None:
    """``(x, kind)`` from a norm's variance: ``max(0, E[x^2] - E[x]^2)`` (layer), ``E[(x -
    E[x])^2]`` (layer), ``E[x^2]`` (rms)."""
    p = index.local_producer(strip(index, var, anchor), anchor)
    if p is not None and p.prim == "max" and (lit := split_literal(index, p)) is not None:
        p = index.local_producer(strip(index, lit[0], anchor), anchor)
    if p is not None and p.prim == "sub":
        m1 = square_arg(index, p.ins[1], anchor)
        x = mean_arg(index, m1, anchor) if m1 is not None else None
        x2 = mean_arg(index, p.ins[0], anchor)
        if x is not None and x2 is not None and square_arg(index, x2, anchor) == x:
            return x, "layer"
        return None
    u = mean_arg(index, var, anchor)
    u = square_arg(index, u, anchor) if u is not None else None
    if u is None:
        return None
    centred = producer(index, u, anchor, "sub")
    if centred is not None and mean_arg(index, centred.ins[1], anchor) == centred.ins[0]:
        return centred.ins[0], "layer"
    return u, "rms"


_NORM_PRIMS = frozenset({"mul", "add", "sub", "div", "max", "square", "integer_pow", "rsqrt",
                         "neg", "convert_element_type", "broadcast_in_dim", "reshape",
                         "reduce_sum", "squeeze", "select_n", "eq"})


def _norm_output(index: Index, rsqrt: Op, x: int, x_stats: int) -> int | None:
    """The normalised output: the last ``x``-shaped value that depends on ``rsqrt`` among the
    values computed from ``x`` (or its float32 copy ``x_stats``) by elementwise ops whose other
    operands are parameters or constants (which keeps the backward's cotangents out)."""
    local, after_rsqrt = {x, x_stats}, set(rsqrt.outs)
    frontier, best = [x, x_stats], None
    while frontier:
        for c in index.consumers.get(frontier.pop(), ()):
            if (c.prim not in _NORM_PRIMS and c.id != rsqrt.id) or c.outs[0] in local \
                    or index.scope[c.id] != index.scope[rsqrt.id]:
                continue
            if not all(i in local or i in index.literals or _param_like(index, i, c)
                       or is_constant(index, i) for i in c.ins):
                continue
            local.update(c.outs)
            frontier.extend(c.outs)
            if c.id == rsqrt.id or after_rsqrt.intersection(c.ins):
                after_rsqrt.update(c.outs)
                if c.id != rsqrt.id and index.shape(c.outs[0]) == index.shape(x) and (
                        best is None or index.order[c.id] > index.order[index.producer[best].id]):
                    best = c.outs[0]
    return best


def _param_like(index: Index, v: int, anchor: Op) -> bool:
    """A parameter, up to layout ops and a constant added to it (Gemma's ``1 + w``)."""
    v = strip(index, v, anchor)
    p = index.local_producer(v, anchor)
    if p is not None and p.prim == "add" and (lit := split_literal(index, p)) is not None:
        v = strip(index, lit[0], anchor)
    return index.is_param(v)


def _norm_params(index: Index, ops: set[int], stops: Iterable[int]) -> tuple[dict, float]:
    """``scale`` / ``bias`` for the parameters the norm multiplies / adds, and the constant
    added to the scale before it multiplies (Gemma's ``(1 + w)``; else 0)."""
    named, offset = {}, 0.0
    for v in externals(index, ops):
        if v in stops or not index.is_param(v):
            continue
        use = _first_use(index, v, ops)
        if use is not None and use.prim == "add" and (lit := split_literal(index, use)):
            named[v], offset = "scale", lit[1]
        else:
            named[v] = "bias" if use is not None and use.prim == "add" else "scale"
    return named, offset


def _first_use(index: Index, v: int, ops: set[int]) -> Op | None:
    while True:
        users = [c for c in index.consumers.get(v, ()) if c.id in ops]
        if not users:
            return None
        if users[0].prim not in LAYOUT:
            return users[0]
        v = users[0].outs[0]
