"""Forward recognisers of the transformer block's patterns: softmax attention (``exp`` anchor)
and LayerNorm/RMSNorm with the residual add before them (``rsqrt`` anchor). See
``ir.patterns`` for the roles."""
from __future__ import annotations

from collections.abc import Iterable

from ir.consteval import NotConstant
from ir.dataflow import (
    CAUSAL_SAMPLES,
    LAYOUT,
    consumers,
    contracting,
    free_dims,
    is_constant,
    layout_tail,
    mean_arg,
    producer,
    role_inputs,
    shifted_softmax_input,
    split_literal,
    square_arg,
    strip,
    sum_of,
)
from ir.graph import Op
from ir.patterns import Index, Match, cone, externals, make_match

_CONVERT = frozenset({"convert_element_type"})


# ---- attention --------------------------------------------------------------------------------
def find_attention(index: Index, exp: Op) -> Match | None:
    """``softmax(scale * q k^T [masked]) v`` anchored at the softmax's ``exp``."""
    shifted = shifted_softmax_input(index, exp)
    if shifted is None:
        return None
    x, axis, _ = shifted
    probs = _normalised(index, exp, axis)
    values = _values_dot(index, probs, axis, exp) if probs is not None else None
    chain = _score_chain(index, x, axis, exp) if values is not None else None
    if chain is None:
        return None
    scores, dot_axis, scale, mask = chain
    k_side = 1 if dot_axis >= len(index.shape(scores.outs[0])) - len(
        free_dims(scores, 1, len(index.shape(scores.ins[1])))) else 0
    q, k = scores.ins[1 - k_side], scores.ins[k_side]
    if not scores.param("dimension_numbers")[1][0]:
        return None     # no batch/head dims: a softmax over x @ W (a router, a classifier)
    vd, p_side = values
    v = vd.ins[1 - p_side]
    out = layout_tail(index, vd.outs[0], exp)
    ops = cone(index, [out], [q, k, v], exp)
    named = {q: "q", k: "k", v: "v"}
    if mask is not None and mask[0] not in ops:
        named.setdefault(mask[0], "mask")
    if scale[1] is not None:
        named.setdefault(scale[1], "scale")
    inputs = role_inputs(index, ops, named)
    if inputs is None:
        return None
    kind = _mask_kind(index, mask, axis)
    attrs = {"causal": kind == "causal", "mask": kind, "scale": scale[0], "softmax_axis": axis,
             "q_is_lhs": k_side == 1, "score_dims": scores.param("dimension_numbers"),
             "value_dims": vd.param("dimension_numbers"), "p_is_lhs": p_side == 0}
    return make_match(index, "attention_fwd", ops, inputs, [("out", out)], attrs)


def _normalised(index: Index, exp: Op, axis: int) -> int | None:
    """``exp / sum(exp)`` over ``axis``."""
    u = exp.outs[0]
    for div in consumers(index, u, "div", exp):
        s = sum_of(index, div.ins[1], exp)
        summed = strip(index, s.ins[0], exp, _CONVERT) if s is not None else None
        if div.ins[0] == u and summed == u and s.param("axes") == (axis,):   # bf16: f32 sum
            return div.outs[0]
    return None


def _values_dot(index: Index, probs: int, axis: int, anchor: Op) -> tuple[Op, int] | None:
    """The matmul that contracts the probabilities' softmax axis with the values."""
    frontier = [probs]
    while frontier:
        v = frontier.pop()
        for c in index.consumers.get(v, ()):
            if index.scope[c.id] != index.scope[anchor.id]:
                continue
            if c.prim == "convert_element_type":
                frontier.append(c.outs[0])
            elif c.prim == "dot_general":
                side = c.ins.index(v)
                if contracting(c, side) == (axis,):
                    return c, side
    return None


def _score_chain(index: Index, x: int, axis: int, anchor: Op):
    """Walks from the softmax input up to the score matmul through masks, scales, converts and
    transposes: ``(dot, its output axis for the softmax axis, (scale, scale value id),
    (mask value, keeps_when_true, axis at the mask, mask shape) | None)``."""
    scale, scale_v, mask, v = 1.0, None, None, x
    for _ in range(32):
        p = index.local_producer(v, anchor)
        if p is None:
            return None
        if p.prim == "dot_general":
            return p, axis, (scale, scale_v), mask
        if p.prim == "transpose":
            axis = p.param("permutation")[axis]
        elif p.prim == "select_n" and len(p.ins) == 3:
            data = 2 if not is_constant(index, p.ins[2]) else 1
            mask, v = (p.ins[0], data == 2, axis, index.shape(p.outs[0])), p.ins[data]
            continue
        elif p.prim in ("div", "mul"):
            lit = split_literal(index, p)
            if lit is None:
                return None
            scale = scale / lit[1] if p.prim == "div" else scale * lit[1]
            scale_v, v = next(i for i in p.ins if i != lit[0]), lit[0]
            continue
        elif p.prim not in ("convert_element_type", "reduce_precision"):
            return None
        v = p.ins[0]
    return None


def _mask_kind(index: Index, mask, axis: int) -> str:
    """``"none"``, ``"causal"`` (keeps key j for query i iff j <= i), or ``"other"``."""
    if mask is None:
        return "none"
    pred, keep_true, _, shape = mask
    n = shape[axis]
    pairs = sorted({(0, 0), (0, 1), (1, 0), (n - 1, n - 1), (n - 1, n - 2), (n - 2, n - 1),
                    (n // 2, n // 2 + 1), (n // 2 + 1, n // 2)})
    pairs = [(i, j) for i, j in pairs if 0 <= i < n and 0 <= j < n][:CAUSAL_SAMPLES]
    for q_dim in (d for d in range(len(shape)) if d != axis and shape[d] == n):
        try:
            if all(_keeps(index, pred, keep_true, shape, q_dim, axis, i, j) == (j <= i)
                   for i, j in pairs):
                return "causal"
        except (NotConstant, IndexError, ValueError):
            return "other"
    return "other"


def _keeps(index: Index, pred: int, keep_true: bool, shape, q_dim: int, k_dim: int, i: int,
           j: int) -> bool:
    idx = [0] * len(shape)
    idx[q_dim], idx[k_dim] = i, j
    pshape = index.shape(pred)
    got = bool(index.eval.element(pred, tuple(idx[len(shape) - len(pshape):])))
    return got if keep_true else not got


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
    named.update(_norm_params(index, ops, stops, rsqrt))
    inputs = role_inputs(index, ops, named)
    if inputs is None:
        return None
    outputs = [("y", y)] + ([("h", x)] if residual else [])
    attrs = {"kind": kind, "eps": eps[1], "residual": residual, "width": index.shape(x)[-1]}
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
    return index.is_param(strip(index, v, anchor))


def _norm_params(index: Index, ops: set[int], stops: Iterable[int], anchor: Op) -> dict:
    """``scale`` / ``bias`` for the parameters the norm multiplies / adds."""
    named = {}
    for v in externals(index, ops):
        if v in stops or not index.is_param(v):
            continue
        use = _first_use(index, v, ops)
        named[v] = "bias" if use is not None and use.prim == "add" else "scale"
    return named


def _first_use(index: Index, v: int, ops: set[int]) -> Op | None:
    while True:
        users = [c for c in index.consumers.get(v, ()) if c.id in ops]
        if not users:
            return None
        if users[0].prim not in LAYOUT:
            return users[0]
        v = users[0].outs[0]
