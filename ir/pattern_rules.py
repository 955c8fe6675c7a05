"""The forward recognisers of ``ir.patterns`` (one per anchor primitive) and the role naming of
backward matches. See ``ir.patterns`` for what each pattern's roles mean.

Each recogniser takes the shared ``Index`` and an anchor op and returns a ``Match`` or
``None``; it never raises on graphs it does not recognise.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from ir.consteval import NotConstant
from ir.graph import Op
from ir.patterns import (
    Index,
    Match,
    backward_inputs,
    backward_outputs,
    cone,
    externals,
    make_match,
)

LAYOUT = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "squeeze",
                    "expand_dims", "stop_gradient"})
OUTPUT_LAYOUT = frozenset({"transpose", "reshape", "convert_element_type"})
CAUSAL_SAMPLES = 8  # index pairs on which a mask must agree with tril(ones) to count as causal


# ---- small dataflow helpers -------------------------------------------------------------------
def strip(index: Index, v: int, anchor: Op, prims: frozenset[str] = LAYOUT) -> int:
    """Follows ``v`` up through single-operand ops in ``prims`` (same region)."""
    while (p := index.local_producer(v, anchor)) is not None and p.prim in prims:
        v = p.ins[0]
    return v


def producer(index: Index, v: int, anchor: Op, prim: str) -> Op | None:
    p = index.local_producer(v, anchor)
    return p if p is not None and p.prim == prim else None


def split_literal(index: Index, op: Op) -> tuple[int, float] | None:
    """``(other operand, literal)`` of a binary op with one scalar-constant operand."""
    for i in (0, 1):
        c = index.eval.scalar(op.ins[i]) if not index.shape(op.ins[i]) else None
        if c is not None:
            return op.ins[1 - i], c
    return None


def consumers(index: Index, v: int, prim: str, anchor: Op) -> list[Op]:
    return [c for c in index.consumers.get(v, ()) if c.prim == prim
            and index.scope[c.id] == index.scope[anchor.id]]


def reduce_max_of(index: Index, v: int, anchor: Op) -> Op | None:
    """The ``reduce_max`` under a softmax's max-subtraction (through broadcasts, stop_gradient,
    and ``max(-inf, .)``)."""
    while True:
        v = strip(index, v, anchor, LAYOUT | {"transpose"})
        p = index.local_producer(v, anchor)
        if p is None:
            return None
        if p.prim == "reduce_max":
            return p
        if p.prim == "select_n" and len(p.ins) == 3:      # where(isfinite(m), m, 0)
            live = [i for i in p.ins[1:] if not is_constant(index, i)]
            if len(live) != 1:
                return None
            v = live[0]
            continue
        if p.prim != "max" or (lit := split_literal(index, p)) is None:
            return None
        v = lit[0]


def shifted_softmax_input(index: Index, exp: Op) -> tuple[int, int, list[Op]] | None:
    """For ``exp(x - max(x))``: ``(x, reduced axis in x's layout, [sub, reduce_max])``; ``x``
    may be a transpose of what the max reduced (``jax.nn.dot_product_attention`` does that)."""
    sub = producer(index, exp.ins[0], exp, "sub")
    if sub is None:
        return None
    rmax = reduce_max_of(index, sub.ins[1], exp)
    axes = rmax.param("axes") if rmax is not None else None
    if axes is None or len(axes) != 1:
        return None
    axis = axes[0]
    if rmax.ins[0] != sub.ins[0]:
        t = producer(index, sub.ins[0], exp, "transpose")
        if t is None or t.ins[0] != rmax.ins[0]:
            return None
        axis = t.param("permutation").index(axis)
    return sub.ins[0], axis, [sub, rmax]


def sum_of(index: Index, v: int, anchor: Op) -> Op | None:
    """The ``reduce_sum`` that ``v`` is (up to broadcasts and reshapes)."""
    return producer(index, strip(index, v, anchor), anchor, "reduce_sum")


def mean_arg(index: Index, v: int, anchor: Op) -> int | None:
    """``u`` when ``v`` is ``sum(u) / n`` (or ``sum(u) * (1/n)``) up to broadcasts."""
    p = index.local_producer(strip(index, v, anchor), anchor)
    if p is None or p.prim not in ("div", "mul") or (lit := split_literal(index, p)) is None:
        return None
    s = sum_of(index, lit[0], anchor)
    return s.ins[0] if s is not None else None


def square_arg(index: Index, v: int, anchor: Op) -> int | None:
    p = index.local_producer(strip(index, v, anchor), anchor)
    if p is None:
        return None
    if p.prim == "square" or (p.prim == "integer_pow" and p.param("y") == 2):
        return p.ins[0]
    if p.prim == "mul" and p.ins[0] == p.ins[1]:
        return p.ins[0]
    return None


def contracting(dot: Op, operand: int) -> tuple[int, ...]:
    (lc, rc), _ = dot.param("dimension_numbers")
    return tuple(lc if operand == 0 else rc)


def free_dims(dot: Op, operand: int, rank: int) -> list[int]:
    (lc, rc), (lb, rb) = dot.param("dimension_numbers")
    taken = set(lc) | set(lb) if operand == 0 else set(rc) | set(rb)
    return [d for d in range(rank) if d not in taken]


def role_inputs(index: Index, ops: set[int], named: dict[int, str], other: str = "const",
                allow: Callable[[int], bool] | None = None) -> list[tuple[str, int]] | None:
    """Roles of the match's inputs: ``named`` ones by name, the rest ``other`` if ``allow``s
    them (default: constants); ``None`` when an unexpected value feeds the match."""
    roles = []
    for v in externals(index, ops):
        if v in named:
            roles.append((named[v], v))
        elif (allow or (lambda x: is_constant(index, x)))(v):
            roles.append((other, v))
        else:
            return None
    return roles


def is_constant(index: Index, v: int) -> bool:
    try:
        index.eval.element(v, (0,) * len(index.shape(v)))
    except (NotConstant, ArithmeticError, IndexError, KeyError, TypeError, ValueError):
        return False
    return True


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
    out = _layout_tail(index, vd.outs[0], exp)
    ops = cone(index, [out], [q, k, v], exp)
    named = {q: "q", k: "k", v: "v"}
    if mask is not None and mask[0] not in ops:
        named.setdefault(mask[0], "mask")
    if scale[1] is not None:
        named.setdefault(scale[1], "scale")
    inputs = role_inputs(index, ops, named)
    if inputs is None:
        return None
    attrs = {"causal": _mask_kind(index, mask, axis) == "causal",
             "mask": _mask_kind(index, mask, axis), "scale": scale[0], "softmax_axis": axis,
             "q_is_lhs": k_side == 1, "score_dims": scores.param("dimension_numbers"),
             "value_dims": vd.param("dimension_numbers"), "p_is_lhs": p_side == 0}
    return make_match(index, "attention_fwd", ops, inputs, [("out", out)], attrs)


def _normalised(index: Index, exp: Op, axis: int) -> int | None:
    """``exp / sum(exp)`` over ``axis``."""
    u = exp.outs[0]
    for div in consumers(index, u, "div", exp):
        s = sum_of(index, div.ins[1], exp)
        if div.ins[0] == u and s is not None and s.ins[0] == u and s.param("axes") == (axis,):
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


def _layout_tail(index: Index, v: int, anchor: Op) -> int:
    """Extends an output through transposes/reshapes that are its only use."""
    while len(users := index.consumers.get(v, ())) == 1 and users[0].prim in OUTPUT_LAYOUT \
            and index.scope[users[0].id] == index.scope[anchor.id]:
        v = users[0].outs[0]
    return v


# ---- norms ------------------------------------------------------------------------------------
def find_norm(index: Index, rsqrt: Op) -> Match | None:
    """LayerNorm / RMSNorm (flax's fast and two-pass variance) anchored at ``rsqrt``, with the
    residual add that produces its input when there is one."""
    add = producer(index, strip(index, rsqrt.ins[0], rsqrt), rsqrt, "add")
    eps = split_literal(index, add) if add is not None else None
    stats = _norm_input(index, eps[0], rsqrt) if eps is not None else None
    if stats is None:
        return None
    x, kind = stats
    y = _norm_output(index, rsqrt, x)
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


def _norm_output(index: Index, rsqrt: Op, x: int) -> int | None:
    """The normalised output: the last ``x``-shaped value that depends on ``rsqrt`` among the
    values computed from ``x`` by elementwise ops whose other operands are parameters or
    constants (which keeps the backward's cotangents out)."""
    local, after_rsqrt = {x}, set(rsqrt.outs)
    frontier, best = [x], None
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


# ---- LM-head cross-entropy --------------------------------------------------------------------
def find_xent(index: Index, log: Op) -> Match | None:
    """``-log_softmax(h @ w)[target]`` (flax/jax form) or ``logsumexp(h @ w) - (h @ w)[target]``
    (optax form), anchored at the ``log`` of the log-sum-exp."""
    s = sum_of(index, strip(index, log.ins[0], log, LAYOUT | {"abs"}), log)
    exp = producer(index, s.ins[0], log, "exp") if s is not None else None
    shifted = shifted_softmax_input(index, exp) if exp is not None else None
    if shifted is None:
        return None
    x, axis, (sub, _) = shifted
    pick = _pick_log_softmax(index, sub, log) or _pick_logsumexp(index, x, log)
    dot = producer(index, strip(index, x, log, frozenset({"convert_element_type"})), log,
                   "dot_general")
    if pick is None or dot is None:
        return None
    loss, indices = pick
    w_side = 1 if axis >= len(index.shape(dot.outs[0])) - len(
        free_dims(dot, 1, len(index.shape(dot.ins[1])))) else 0
    h, w = dot.ins[1 - w_side], dot.ins[w_side]
    targets = _index_root(index, indices, log)
    ops = cone(index, [loss], [h, w, targets], log)
    inputs = role_inputs(index, ops, {h: "h", w: "w", targets: "targets"})
    if inputs is None:
        return None
    attrs = {"vocab": index.shape(x)[axis], "width": index.shape(h)[-1], "vocab_axis": axis,
             "w_is_rhs": w_side == 1}
    return make_match(index, "xent_fwd", ops, inputs, [("loss", loss)], attrs)


def _pick_log_softmax(index: Index, shifted: Op, log: Op) -> tuple[int, int] | None:
    """``-gather(shifted - log(sum exp(shifted)), targets)``: (loss, gather indices)."""
    for c in consumers(index, shifted.outs[0], "sub", log):
        if strip(index, c.ins[1], log) == log.outs[0]:
            return _pick(index, c.outs[0], log)
    return None


def _pick_logsumexp(index: Index, x: int, log: Op) -> tuple[int, int] | None:
    """``(log(sum exp(x - m)) + m) - gather(x, targets)``: (loss, gather indices)."""
    for add in consumers(index, log.outs[0], "add", log):
        for sub in consumers(index, add.outs[0], "sub", log):
            v = sub.ins[1]
            while (p := index.local_producer(v, log)) is not None and p.prim in (
                    LAYOUT | {"gather"}):
                if p.prim == "gather" and p.ins[0] == x:
                    return (sub.outs[0], p.ins[1]) if sub.ins[0] == add.outs[0] else None
                v = p.ins[0]
    return None


def _pick(index: Index, logp: int, anchor: Op) -> tuple[int, int] | None:
    """``(per-token loss, gather indices)`` of ``-gather(logp, targets)``."""
    for g in consumers(index, logp, "gather", anchor):
        v = g.outs[0]
        while len(users := index.consumers.get(v, ())) == 1 and users[0].prim in LAYOUT:
            v = users[0].outs[0]
        neg = [c for c in index.consumers.get(v, ()) if c.prim == "neg"]
        if g.ins[0] == logp and neg:
            return neg[0].outs[0], g.ins[1]
    return None


def _index_root(index: Index, v: int, anchor: Op) -> int:
    """The integer value the gather indices are computed from (through the negative-index wrap
    ``select_n(t < 0, t, t + V)``, broadcasts and reshapes)."""
    for _ in range(16):
        p = index.local_producer(v, anchor)
        if p is None:
            return v
        if p.prim in LAYOUT or p.prim in ("add", "lt", "clamp"):
            v = next((i for i in p.ins if i not in index.literals), p.ins[0])
        elif p.prim == "select_n":
            v = p.ins[1]
        else:
            return v
    return v


# ---- adamw ------------------------------------------------------------------------------------
def find_adamw(index: Index, sqrt: Op) -> Match | None:
    """optax.adamw's update of one parameter, anchored at ``sqrt(nu_hat + eps_root)``."""
    inner = index.local_producer(sqrt.ins[0], sqrt)
    eps_root = 0.0
    if inner is not None and inner.prim == "add" and (lit := split_literal(index, inner)):
        nhat, eps_root = lit
    else:
        nhat = sqrt.ins[0]
    nu = _hat(index, nhat, sqrt, order=2)
    den = next((c for c in consumers(index, sqrt.outs[0], "add", sqrt)
                if split_literal(index, c) is not None), None)
    div = consumers(index, den.outs[0], "div", sqrt) if den is not None else []
    mu = _hat(index, div[0].ins[0], sqrt, order=1) if len(div) == 1 else None
    if nu is None or mu is None or mu["grad"] != nu["grad"]:
        return None
    tail = _apply(index, div[0].outs[0], sqrt)
    if tail is None:
        return None
    ops = cone(index, [tail["param_out"], mu["out"], nu["out"]],
               [tail["param"], mu["grad"], mu["state"], nu["state"], mu["bc"], nu["bc"]]
               + ([tail["lr_v"]] if tail["lr_v"] is not None else []), sqrt)
    named = {tail["param"]: "param", mu["grad"]: "grad", mu["state"]: "mu", nu["state"]: "nu",
             mu["bc"]: "bc1", nu["bc"]: "bc2"}
    if tail["lr_v"] is not None:
        named[tail["lr_v"]] = "lr"
    inputs = role_inputs(index, ops, named)
    if inputs is None:
        return None
    attrs = {"b1": mu["decay"], "b2": nu["decay"], "eps": split_literal(index, den)[1],
             "eps_root": eps_root, "weight_decay": tail["wd"], "lr": tail["lr"]}
    outputs = [("param", tail["param_out"]), ("mu", mu["out"]), ("nu", nu["out"])]
    return make_match(index, "adamw", ops, inputs, outputs, attrs)


def _hat(index: Index, v: int, anchor: Op, order: int) -> dict | None:
    """``moment / bc`` where ``moment = decay * state + (1 - decay) * grad^order``."""
    div = producer(index, v, anchor, "div")
    add = producer(index, div.ins[0], anchor, "add") if div is not None else None
    if add is None:
        return None
    terms = [producer(index, i, anchor, "mul") for i in add.ins]
    if any(t is None or split_literal(index, t) is None for t in terms):
        return None
    (a, ca), (b, cb) = (split_literal(index, t) for t in terms)
    ga, gb = _power_of(index, a, anchor, order), _power_of(index, b, anchor, order)
    if (ga is None) == (gb is None):
        return None
    grad, state, decay = (ga, b, cb) if ga is not None else (gb, a, ca)
    return {"out": add.outs[0], "grad": grad, "state": state, "decay": decay, "bc": div.ins[1]}


def _power_of(index: Index, v: int, anchor: Op, order: int) -> int | None:
    p = index.local_producer(v, anchor)
    if p is None:
        return None
    if p.prim == "integer_pow" and p.param("y") == order:
        return p.ins[0]
    if order == 2:
        return square_arg(index, v, anchor)
    return None


def _apply(index: Index, u: int, anchor: Op) -> dict | None:
    """``p - lr (u + wd p)``: returns the parameter, its new value, ``wd`` and ``lr``."""
    wd, param, v = 0.0, None, u
    add = consumers(index, v, "add", anchor)
    if len(add) == 1:
        other = next(i for i in add[0].ins if i != v)
        decay = producer(index, other, anchor, "mul")
        if decay is not None and (lit := split_literal(index, decay)) is not None:
            param, wd, v = lit[0], lit[1], add[0].outs[0]
    scaled = consumers(index, v, "mul", anchor)
    if len(scaled) != 1:
        return None
    lr_lit = split_literal(index, scaled[0])
    lr_v = None if lr_lit is not None else next(i for i in scaled[0].ins if i != v)
    final = consumers(index, scaled[0].outs[0], "add", anchor)
    if len(final) != 1:
        return None
    p = next(i for i in final[0].ins if i != scaled[0].outs[0])
    if param is not None and p != param:
        return None
    out = _layout_tail(index, final[0].outs[0], anchor)
    return {"param": p, "param_out": out, "wd": wd, "lr_v": lr_v,
            "lr": -lr_lit[1] if lr_lit is not None else None}


def _marking_recompute(rule: Callable[[Index, Op], Match | None]):
    """Adds ``recompute=True`` to matches whose ops a ``jax.checkpoint`` (remat) re-runs in
    the backward pass."""
    def apply(index: Index, op: Op) -> Match | None:
        m = rule(index, op)
        if m is None or not all("remat2" in index.ops[index.order[i]].scope for i in m.op_ids):
            return m
        return dataclasses.replace(m, attrs=m.attrs + (("recompute", True),))
    return apply


FORWARD_RULES: dict[str, Callable[[Index, Op], Match | None]] = {
    prim: _marking_recompute(rule) for prim, rule in
    (("exp", find_attention), ("rsqrt", find_norm), ("log", find_xent), ("sqrt", find_adamw))}


# ---- backward roles ---------------------------------------------------------------------------
def _grad_dot_operand(index: Index, v: int, ops: set[int]) -> list[int]:
    """The operands of the matmul that produces ``v`` (through layout ops), inside ``ops``."""
    while (p := index.producer.get(v)) is not None and p.id in ops:
        if p.prim == "dot_general":
            return [index.origin(i) for i in p.ins]
        if p.prim not in OUTPUT_LAYOUT | LAYOUT:
            return []
        v = p.ins[0]
    return []


def _attention_roles(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    inputs = [("dout" if r == "cotangent" else r, v)
              for r, v in backward_inputs(index, fwd, ops, touched)]
    q, k = index.origin(fwd.input("q")), index.origin(fwd.input("k"))

    def name(v: int) -> str:
        operands = _grad_dot_operand(index, v, ops)
        return "dq" if k in operands else "dk" if q in operands else "dv" if operands else "other"

    return inputs, backward_outputs(index, ops, name)


def _norm_roles(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    inputs = []
    for r, v in backward_inputs(index, fwd, ops, touched):
        if r == "cotangent":
            accumulates = any(c.prim == "add_any" and c.id in ops
                              for c in index.consumers.get(v, ()))
            r = "dh" if accumulates else "dy"
        inputs.append((r, v))
    cotangents = {v for r, v in inputs if r in ("dy", "dh")}
    x_shape = index.shape(fwd.output("y"))

    def name(v: int) -> str:
        if index.shape(v) == x_shape:
            return "dx"
        s = sum_of(index, v, index.producer[v])
        return "dbias" if s is not None and strip(index, s.ins[0], s) in cotangents else "dscale"

    return inputs, backward_outputs(index, ops, name)


def _xent_roles(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    inputs = [("dloss" if r == "cotangent" else r, v)
              for r, v in backward_inputs(index, fwd, ops, touched)]
    h_shape, w_shape = index.shape(fwd.input("h")), index.shape(fwd.input("w"))

    def name(v: int) -> str:
        shape = index.shape(v)
        return "dh" if shape == h_shape else "dw" if sorted(shape) == sorted(w_shape) else "other"

    return inputs, backward_outputs(index, ops, name)


BACKWARD_ROLES = {"attention_bwd": _attention_roles, "norm_bwd": _norm_roles,
                  "xent_bwd": _xent_roles}
