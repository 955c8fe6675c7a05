"""Forward recognisers of the step's head and tail: the LM-head matmul with softmax
cross-entropy (``log`` anchor) and optax's AdamW update of one parameter (``sqrt`` anchor). See
``ir.patterns`` for the roles."""
from __future__ import annotations

from ir.dataflow import (
    LAYOUT,
    consumers,
    free_dims,
    layout_tail,
    producer,
    role_inputs,
    shifted_softmax_input,
    split_literal,
    square_arg,
    strip,
    sum_of,
)
from ir.graph import Op
from ir.patterns import Index, Match, cone, make_match


# ---- LM-head cross-entropy --------------------------------------------------------------------
def find_xent(index: Index, log: Op) -> Match | None:
    """``-log_softmax(h @ w)[target]`` (flax/jax form) or ``logsumexp(h @ w) - (h @ w)[target]``
    (optax form), anchored at the ``log`` of the log-sum-exp."""
    s = sum_of(index, strip(index, log.ins[0], log, LAYOUT | {"abs"}), log)
    exp = producer(index, strip(index, s.ins[0], log, frozenset({"convert_element_type"})), log,
                   "exp") if s is not None else None
    shifted = shifted_softmax_input(index, exp) if exp is not None else None
    if shifted is None:
        return None
    x, axis, (sub, _) = shifted
    pick = _pick_log_softmax(index, sub, log) or _pick_logsumexp(index, x, log)
    dot = producer(index, strip(index, x, log, frozenset({"convert_element_type"})), log,
                   "dot_general")
    if pick is None or dot is None:
        return None
    loss, indices, sign = pick
    w_side = 1 if axis >= len(index.shape(dot.outs[0])) - len(
        free_dims(dot, 1, len(index.shape(dot.ins[1])))) else 0
    h, w = dot.ins[1 - w_side], dot.ins[w_side]
    targets = _index_root(index, indices, log)
    ops = cone(index, [loss], [h, w, targets], log)
    inputs = role_inputs(index, ops, {h: "h", w: "w", targets: "targets"})
    if inputs is None:
        return None
    attrs = {"vocab": index.shape(x)[axis], "width": index.shape(h)[-1], "vocab_axis": axis,
             "w_is_rhs": w_side == 1, "loss_sign": sign}
    return make_match(index, "xent_fwd", ops, inputs, [("loss", loss)], attrs)


def _pick_log_softmax(index: Index, shifted: Op, log: Op) -> tuple[int, int] | None:
    """``-gather(shifted - log(sum exp(shifted)), targets)``: (loss, gather indices)."""
    for c in consumers(index, shifted.outs[0], "sub", log):
        if strip(index, c.ins[1], log) == log.outs[0]:
            return _pick(index, c.outs[0], log)
    return None


def _pick_logsumexp(index: Index, x: int, log: Op) -> tuple[int, int, float] | None:
    """``(log(sum exp(x - m)) + m) - gather(x, targets)``: (loss, gather indices, 1)."""
    for add in consumers(index, log.outs[0], "add", log):
        for sub in consumers(index, add.outs[0], "sub", log):
            v = sub.ins[1]
            while (p := index.local_producer(v, log)) is not None and p.prim in (
                    LAYOUT | {"gather"}):
                if p.prim == "gather" and p.ins[0] == x:
                    return (sub.outs[0], p.ins[1], 1.0) if sub.ins[0] == add.outs[0] \
                        else None
                v = p.ins[0]
    return None


def _pick(index: Index, logp: int, anchor: Op) -> tuple[int, int, float] | None:
    """``(per-token value, gather indices, sign)`` of ``gather(logp, targets)``: the loss
    ``-gather(...)`` (sign 1) when a ``neg`` follows it per token, else the picked
    log-probability itself (sign -1: the mean and the minus come later, as in
    ``-take_along_axis(logp, t).mean()``)."""
    for g in consumers(index, logp, "gather", anchor):
        if g.ins[0] != logp:
            continue
        v = g.outs[0]
        while len(users := index.consumers.get(v, ())) == 1 and users[0].prim in LAYOUT:
            v = users[0].outs[0]
        neg = [c for c in index.consumers.get(v, ()) if c.prim == "neg"]
        return (neg[0].outs[0], g.ins[1], 1.0) if neg else (g.outs[0], g.ins[1], -1.0)
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
    out = layout_tail(index, final[0].outs[0], anchor)
    return {"param": p, "param_out": out, "wd": wd, "lr_v": lr_v,
            "lr": -lr_lit[1] if lr_lit is not None else None}
