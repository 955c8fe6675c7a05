"""Forward recogniser of softmax attention, anchored at the softmax's ``exp``. See
``ir.patterns`` for the roles.

Walking up from ``exp(s - max s)`` to the scores matmul ``s = dot_general(q, k)`` (batch dims
B and H, contracting D), the chain may hold, in this order from the matmul: scalar scales
(``mul``/``div`` by a constant), an additive ``bias`` (an ``add`` of a tensor: transformers
turns its masks into 0 / -big biases), a boolean mask (``select_n`` of the scores and a scalar
fill, as flax's ``dot_product_attention_weights`` masks), dtype converts and transposes. After
the softmax's ``exp / sum(exp)``, ``out = dot_general(probs, v)`` and its transposes to
``(B, Sq, H, D)``.

* Grouped- and multi-query attention: k and v repeated over the heads by ``jnp.repeat``
  (transformers' Llama, Mistral, Gemma) are taken before the repeat, so the match's k, v are
  ``(B, S, Hkv, D)`` and the repeat (and the sum its backward does) is the kernel's business
  (attr ``kv_repeat``: the group size; attr ``k_dot``: the value the scores matmul reads).
* Rotary embeddings, and a scale applied to q before the matmul, stay outside: q and k are the
  matmul's operands.
* Masks (attr ``mask``): ``"none"``; ``"causal"`` when every mask is a constant (iotas,
  literals, slices and compares of them) that keeps key j for query i iff j <= i: the kernel
  rebuilds it, so its ops are replaced; otherwise ``"data"``: the mask is built from the batch
  (an ``attention_mask``), or is a constant of another shape (a sliding window). The kernel
  reads it as an input (roles ``bias`` and ``keep``): attrs ``bias_dims`` / ``keep_dims``
  name each mask dim (``B``, ``H``, ``G`` of grouped queries, ``Sq``, ``Sk``;
  ``mask_order`` sorts them into ``B, H[, G], Sq, Sk``); ``bias_scale`` is
  the scale applied after the bias, ``fill`` what the boolean mask writes (scaled likewise),
  ``keep_true`` the mask value that keeps a score. The kernel computes ``where(keep, s * scale
  + bias * bias_scale, fill)``; a boolean mask applied before the bias is not that (rejected
  with ``mask`` ``"unsupported"``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ir.consteval import NotConstant
from ir.dataflow import (
    OUTPUT_LAYOUT,
    consumers,
    contracting,
    free_dims,
    is_constant,
    producer,
    role_inputs,
    shifted_softmax_input,
    split_literal,
    strip,
    sum_of,
)
from ir.graph import Op
from ir.patterns import Index, Match, cone, make_match

_CONVERT = frozenset({"convert_element_type"})
_CHAIN = frozenset({"transpose", "convert_element_type", "reduce_precision", "mul", "div", "add",
                    "select_n"})
MASKED_BIAS = -1e4   # a bias at or below this hides a score (exp underflows to 0 in float32)
CAUSAL_GRID = 8      # a constant mask counts as causal if it agrees on a grid this wide


@dataclasses.dataclass(frozen=True)
class _Mask:
    """A mask met on the way up: ``kind`` "bias" (added) or "keep" (``where(value ==
    keep_true, s, fill)``); ``to_x`` maps its dims to the softmax input's; ``factor`` is the
    scale applied after it (for "keep", already times the fill); ``shape`` the scores' there."""

    kind: str
    value: int
    to_x: tuple[int, ...]
    factor: float
    shape: tuple[int, ...]
    keep_true: bool = True


@dataclasses.dataclass(frozen=True)
class _Chain:
    dot: Op
    to_x: tuple[int, ...]     # the scores matmul's output dims -> the softmax input's
    scale: float
    scale_v: int | None
    masks: tuple[_Mask, ...]  # in the order met walking up (the last applied first)


def find_attention(index: Index, exp: Op) -> Match | None:
    """``softmax(scale * q k^T + bias [masked]) v`` anchored at the softmax's ``exp``."""
    shifted = shifted_softmax_input(index, exp)
    if shifted is None:
        return None
    x, axis, _ = shifted
    probs = _normalised(index, exp, axis)
    values = _values_dot(index, probs, axis, exp) if probs is not None else None
    chain = _score_chain(index, x, exp) if values is not None else None
    if chain is None or not chain.dot.param("dimension_numbers")[1][0]:
        return None     # no batch/head dims: a softmax over x @ W (a router, a classifier)
    scores = chain.dot
    dot_axis = chain.to_x.index(axis)
    k_side = 1 if dot_axis >= len(index.shape(scores.outs[0])) - len(
        free_dims(scores, 1, len(index.shape(scores.ins[1])))) else 0
    q, k_dot = scores.ins[1 - k_side], scores.ins[k_side]
    vd, p_side = values
    k, v, repeat = _unrepeated(index, k_dot, vd.ins[1 - p_side], exp)
    out = _out(index, vd.outs[0], q, k, exp)
    kind = _mask_kind(index, chain, axis)
    data = [m.value for m in chain.masks] if kind in ("data", "unsupported") else []
    ops = _own_cone(index, out, [q, k, v], data, exp)
    named = {q: "q", k: "k", v: "v"}
    for m in chain.masks:   # a constant mask hoisted out of a scan body is an input too
        named.setdefault(m.value, m.kind if m.value in data else "mask")
    if chain.scale_v is not None:
        named.setdefault(chain.scale_v, "scale")
    inputs = role_inputs(index, ops, named)
    if inputs is None:
        return None
    attrs = {"causal": kind == "causal", "mask": kind, "scale": chain.scale,
             "softmax_axis": dot_axis, "q_is_lhs": k_side == 1,
             "score_dims": scores.param("dimension_numbers"),
             "value_dims": vd.param("dimension_numbers"), "p_is_lhs": p_side == 0,
             "kv_repeat": repeat, "k_dot": k_dot}
    if kind == "data":
        attrs.update(_mask_attrs(index, chain, k_side == 1))
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


def _own_cone(index: Index, out: int, qkv: list[int], data: list[int], anchor: Op) -> set[int]:
    """The match's ops: ``out``'s cone back to q, k, v and the masks read as data, less the
    constant work (a causal mask's iotas) that something else also reads: a mask built once
    and read by every layer (transformers' ``attention_mask`` of ones) stays outside, an
    input of each layer's match."""
    stops = set(qkv) | set(data)
    while True:
        ops = cone(index, [out], stops, anchor)
        live, shared = set(qkv), []
        for i in sorted(ops, key=index.order.__getitem__):
            op = index.ops[index.order[i]]
            if live.intersection(op.ins):
                live.update(op.outs)
            elif any(c.id not in ops for v in op.outs for c in index.consumers.get(v, ())):
                shared.extend(op.outs)
        if not shared:
            return ops
        stops.update(shared)


# ---- from the softmax up to the scores --------------------------------------------------------
def _score_chain(index: Index, x: int, anchor: Op) -> _Chain | None:
    """Walks from the softmax input up to the score matmul (see the module docstring)."""
    scale, scale_v, masks, v = 1.0, None, [], x
    to_x = tuple(range(len(index.shape(x))))
    for _ in range(32):
        p = index.local_producer(v, anchor)
        if p is None:
            return None
        if p.prim == "dot_general":
            return _Chain(p, to_x, scale, scale_v, tuple(masks))
        if p.prim == "transpose":
            to_x = _through_transpose(to_x, p.param("permutation"))
        elif p.prim in ("div", "mul") and (lit := split_literal(index, p)) is not None:
            scale = scale / lit[1] if p.prim == "div" else scale * lit[1]
            scale_v, v = next(i for i in p.ins if i != lit[0]), lit[0]
            continue
        elif p.prim in ("select_n", "add"):
            found = (_keep_mask(index, p, to_x, scale) if p.prim == "select_n"
                     else _bias(index, p, to_x, scale, anchor))
            if found is None:
                return None
            masks.append(found[0])
            v = found[1]
            continue
        elif p.prim not in ("convert_element_type", "reduce_precision"):
            return None
        v = p.ins[0]
    return None


def _through_transpose(to_x: tuple[int, ...], perm: Sequence[int]) -> tuple[int, ...]:
    """The dims map of a transpose's operand, given its result's (result dim i is operand dim
    ``perm[i]``)."""
    out = [0] * len(perm)
    for i, src in enumerate(perm):
        out[src] = to_x[i]
    return tuple(out)


def _keep_mask(index: Index, sel: Op, to_x, scale: float) -> tuple[_Mask, int] | None:
    """``select_n(pred, fill, s)`` or ``select_n(pred, s, fill)`` with a scalar constant fill:
    (the mask, ``s``)."""
    pred, a, b = sel.ins
    const_a, const_b = is_constant(index, a), is_constant(index, b)
    if const_a == const_b or len(index.shape(pred)) != len(to_x):
        return None
    fill = index.eval.scalar(a if const_a else b)
    if fill is None:
        return None
    data = b if const_a else a                   # select_n: case 0 when false, 1 when true
    shape = index.shape(sel.outs[0])
    return _Mask("keep", pred, to_x, fill * scale, shape, keep_true=data == b), data


def _bias(index: Index, add: Op, to_x, scale: float, anchor: Op) -> tuple[_Mask, int] | None:
    """``s + bias`` with a tensor bias of the scores' rank: (the mask, ``s``)."""
    out = index.shape(add.outs[0])
    for data, bias in (add.ins, add.ins[::-1]):
        if index.shape(data) == out and len(index.shape(bias)) == len(out) \
                and bias not in index.literals and _reaches_dot(index, data, anchor):
            return _Mask("bias", bias, to_x, scale, out), data
    return None


def _reaches_dot(index: Index, v: int, anchor: Op, depth: int = 8) -> bool:
    """Whether ``v`` is a matmul's output through at most ``depth`` chain ops (which side of an
    ``add`` the scores are on)."""
    frontier = [v]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            p = index.local_producer(u, anchor)
            if p is not None and p.prim == "dot_general":
                return True
            if p is not None and p.prim in _CHAIN:
                nxt.extend(i for i in p.ins if i not in index.literals)
        frontier = nxt
    return False


# ---- masks ------------------------------------------------------------------------------------
def _mask_kind(index: Index, chain: _Chain, axis: int) -> str:
    """``"none"``, ``"causal"`` (constant; keeps key j for query i iff j <= i), ``"data"`` or
    ``"unsupported"`` (a boolean mask applied before a bias, two of a kind)."""
    kinds = [m.kind for m in chain.masks]
    if not kinds:
        return "none"
    if kinds not in (["bias"], ["keep"], ["keep", "bias"]):
        return "unsupported"
    n = chain.masks[0].shape[chain.masks[0].to_x.index(axis)]
    pairs = _sample_pairs(n)
    shape = chain.masks[0].shape
    for q_dim in (d for d in range(len(shape)) if chain.masks[0].to_x[d] != axis
                  and shape[d] == n):
        q_x = chain.masks[0].to_x[q_dim]
        try:
            if all(_hidden(index, chain.masks, q_x, axis, i, j, corner) == (j > i)
                   for i, j in pairs for corner in (False, True)):
                return "causal"
        except (NotConstant, IndexError, ValueError, _Neither):
            return "data"
    return "data"


def _sample_pairs(n: int) -> list[tuple[int, int]]:
    """(query, key) pairs a causal mask must agree on: next to the diagonal, and a grid of
    8 x 8 positions (a sliding window or a block mask differs far from the diagonal)."""
    grid = {round(t * (n - 1) / (CAUSAL_GRID - 1)) for t in range(CAUSAL_GRID)}
    near = {(0, 0), (0, 1), (1, 0), (n - 1, n - 1), (n - 1, n - 2), (n - 2, n - 1),
            (n // 2, n // 2 + 1), (n // 2 + 1, n // 2)}
    pairs = near | {(i, j) for i in grid for j in grid}
    return sorted((i, j) for i, j in pairs if 0 <= i < n and 0 <= j < n)


class _Neither(Exception):
    """A bias that neither keeps (0) nor hides (very negative) a score."""


def _hidden(index: Index, masks: Sequence[_Mask], q_x: int, k_x: int, i: int, j: int,
            corner: bool) -> bool:
    """Whether the masks hide key ``j`` from query ``i`` (at the first or, with ``corner``, the
    last index of every other dim)."""
    hidden = False
    for m in masks:
        shape = index.shape(m.value)
        idx = []
        for d, x_dim in enumerate(m.to_x):
            at = i if x_dim == q_x else j if x_dim == k_x else (m.shape[d] - 1 if corner else 0)
            idx.append(min(at, shape[d] - 1))
        got = index.eval.element(m.value, tuple(idx))
        if m.kind == "keep":
            hidden |= bool(got) != m.keep_true
        elif got <= MASKED_BIAS:
            hidden = True
        elif got != 0:
            raise _Neither
    return hidden


def _mask_attrs(index: Index, chain: _Chain, q_is_lhs: bool) -> dict:
    """The attrs of a mask read as data: each mask dim's name among the scores' dims."""
    names = _score_dim_names(index, chain.dot, 0 if q_is_lhs else 1)
    dot_of_x = {x_dim: d for d, x_dim in enumerate(chain.to_x)}
    attrs: dict = {}
    for m in chain.masks:
        attrs[f"{m.kind}_dims"] = tuple(names[dot_of_x[x]] for x in m.to_x)
        if m.kind == "bias":
            attrs["bias_scale"] = m.factor
        else:
            attrs.update(fill=m.factor, keep_true=m.keep_true)
    return attrs


def _score_dim_names(index: Index, dot: Op, q_side: int) -> tuple[str, ...]:
    """Names of the scores matmul's output dims (batch dims, then the left operand's free
    dims, then the right's), for q ``(B, Sq, H, D)`` or grouped ``(B, Sq, H, G, D)`` and k
    ``(B, Sk, H, D)``: ``B``, ``H``, ``G``, ``Sq``, ``Sk`` (``?`` for any other layout, which
    the kernel's rule rejects)."""
    q_names = {4: ("B", "Sq", "H", "D"), 5: ("B", "Sq", "H", "G", "D")}
    operand_names = [q_names.get(len(index.shape(dot.ins[q_side])), ()), ("B", "Sk", "H", "D")]
    if q_side == 1:
        operand_names.reverse()
    lhs, rhs = operand_names

    def name(names, d):
        return names[d] if d < len(names) else "?"

    free_l = free_dims(dot, 0, len(index.shape(dot.ins[0])))
    free_r = free_dims(dot, 1, len(index.shape(dot.ins[1])))
    batch = dot.param("dimension_numbers")[1][0]
    return tuple([name(lhs, d) for d in batch] + [name(lhs, d) for d in free_l]
                 + [name(rhs, d) for d in free_r])


SCORE_ORDER = ("B", "H", "G", "Sq", "Sk")


def mask_order(dims: Sequence[str]) -> tuple[int, ...] | None:
    """The permutation that brings a mask with dims named ``dims`` (attrs ``bias_dims``,
    ``keep_dims``) to the order ``B, H[, G], Sq, Sk``; ``None`` when they are not those."""
    want = [d for d in SCORE_ORDER if d in dims]
    if sorted(dims) != sorted(want) or len(want) != len(dims) or \
            not {"B", "H", "Sq", "Sk"} <= set(dims):
        return None
    return tuple(dims.index(d) for d in want)


# ---- k, v and the output ----------------------------------------------------------------------
def _unrepeated(index: Index, k: int, v: int, anchor: Op) -> tuple[int, int, int]:
    """``(k, v, group)``: k and v before ``jnp.repeat(x, group, axis=2)`` when both are repeated
    alike (grouped-query attention), else as the matmuls read them and group 1."""
    rk, rv = _repeat_of(index, k, anchor), _repeat_of(index, v, anchor)
    if rk is None or rv is None or rk[1] != rv[1]:
        return k, v, 1
    return rk[0], rv[0], rk[1]


def _repeat_of(index: Index, v: int, anchor: Op) -> tuple[int, int] | None:
    """``(x, group)`` when ``v (B, S, H, D)`` is ``reshape(broadcast_in_dim(x (B, S, Hkv, D)))``
    to ``(B, S, Hkv, group, D)``: each of x's heads repeated ``group`` times in a row."""
    r = producer(index, v, anchor, "reshape")
    b = producer(index, r.ins[0], anchor, "broadcast_in_dim") if r is not None else None
    if b is None or b.param("broadcast_dimensions") != (0, 1, 2, 4):
        return None
    x = b.ins[0]
    xs, bs = index.shape(x), index.shape(b.outs[0])
    if len(xs) != 4 or bs != xs[:3] + (bs[3],) + xs[3:] or \
            index.shape(v) != (xs[0], xs[1], xs[2] * bs[3], xs[3]):
        return None
    return x, bs[3]


def _out(index: Index, v: int, q: int, k: int, anchor: Op) -> int:
    """The value matmul's output through the transposes/reshapes that are its only use, up to
    the first one shaped ``(B, Sq, Hq, D)`` (a later merge of the heads is the model's)."""
    qs, ks = index.shape(q), index.shape(k)
    want = (ks[0], qs[1], math.prod(qs[2:-1]), ks[-1]) if len(qs) >= 4 and len(ks) == 4 else None
    while index.shape(v) != want and len(users := index.consumers.get(v, ())) == 1 \
            and users[0].prim in OUTPUT_LAYOUT and index.scope[users[0].id] == \
            index.scope[anchor.id]:
        v = users[0].outs[0]
    return v
