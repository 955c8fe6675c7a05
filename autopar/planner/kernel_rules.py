"""Per-kernel rules: which ``ir.patterns`` matches a kernel can replace, in which layouts, and
what it costs there. One ``KernelRule`` per kernel, in ``RULES``.

A rule sees a forward match (and its backward match, if any) and answers:

  * ``check``: why the kernel cannot take this match (shapes, dims, mask), or None;
  * ``slots``: the kernel dims a mesh axis may split, with their sizes (``("batch", 8),
    ("seq", 1024), ("heads", 16)`` for attention); an option assigns axes to slots;
  * ``layouts``: for one option, the layout (``autopar.sharding.Sharding``) every interface
    value must have: the values the kernel reads and writes in the layout of the plan, the
    first of them the *anchor*, whose layout alone determines the option;
  * ``cost``: the kernel's time on one device (forward + backward) from the per-shard sizes
    (``autopar.kernels.costs``) and the collectives its sharded form adds;
  * ``specs``: per-shard specs and shapes of the kernel's arguments, for ``plan.kernels``.

Values the kernel reads but whose layout it sets itself (a norm's scale, the LM head) are not
interface values: codegen moves them to the kernel's spec (``autopar.kernels.halves``).

Shapes: B batch, S sequence, H query heads, K key/value heads, D head or model width, N rows
(tokens), V vocabulary, E elements.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from autopar.kernels import costs as kc
from autopar.sharding import Sharding, shard_factor, to_spec, used_axes
from ir.graph import TensorType
from ir.patterns import Index, Match
from ir.rules_attention import mask_order

Split = tuple[tuple[str, tuple[str, ...]], ...]     # slot name -> mesh axes (major to minor)
Comm = tuple[str, float, tuple[str, ...]]           # (kind, bytes per device, axes)


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """See the module docstring. ``reads``/``cotangents`` are the forward and backward roles the
    kernel call reads (``optional`` ones may be absent); ``writes_fwd``/``writes_bwd`` the
    output roles it produces."""

    reads: tuple[str, ...]
    cotangents: tuple[str, ...]
    writes_fwd: tuple[str, ...]
    writes_bwd: tuple[str, ...]
    optional: tuple[str, ...]
    check: Callable[[Index, Match, Match | None], str | None]
    slots: Callable[[Index, Match], tuple[tuple[str, int], ...]]
    layouts: Callable[[Index, Match, Match | None, Mapping[str, tuple[str, ...]]],
                      dict[int, Sharding]]
    cost: Callable[..., tuple[kc.KernelCost, tuple[Comm, ...]]]
    specs: Callable[..., tuple[tuple[str, str, tuple[int, ...]], ...]]


def _t(index: Index, v: int) -> TensorType:
    return index.graph.values[v]


def _n(mesh: Mapping[str, int], axes: Sequence[str]) -> int:
    return math.prod(mesh[a] for a in axes)


def _spec(sharding: Sharding) -> str:
    return str(to_spec(sharding))


def _local(shape, sharding: Sharding, mesh) -> tuple[int, ...]:
    return tuple(d // _n(mesh, ax) for d, ax in zip(shape, sharding))


def _only(m: Match, role: str) -> bool:
    return sum(r == role for r, _ in m.outputs + m.inputs) == 1


# ---- attention --------------------------------------------------------------------------------
def _attn_check(index: Index, fwd: Match, bwd: Match | None) -> str | None:
    q, k, v = (_t(index, fwd.input(r)) for r in ("q", "k", "v"))
    out = _t(index, fwd.output("out"))
    if fwd.attr("mask") not in ("causal", "none", "data"):
        return ("a mask the kernel cannot apply: it computes where(keep, scale * q k^T + bias, "
                "fill), and this step masks before adding a bias, or masks twice alike")
    if len(k.shape) != 4 or v.shape != k.shape or q.dtype != k.dtype or v.dtype != k.dtype:
        return f"k {k}, v {v}, q {q} (the kernel takes k, v (B, S, K, D) of q's dtype)"
    b, sk, kv, d = k.shape
    grouped = len(q.shape) == 5 and q.shape[2] == kv and q.shape[4] == d
    if not (grouped or (len(q.shape) == 4 and q.shape[2] % kv == 0 and q.shape[3] == d)) or \
            q.shape[0] != b or out.shape != (b, q.shape[1], math.prod(q.shape[2:-1]), d):
        return f"q {q}, k {k}, out {out} (the kernel takes q (B, S, H, D) or (B, S, K, G, D))"
    if fwd.attr("causal") and q.shape[1] != sk:
        return f"a causal mask over {q.shape[1]} queries and {sk} keys"
    (qc, kc_), (qb, kb) = _sides(fwd.attr("score_dims"), fwd.attr("q_is_lhs"))
    (vc, _), (vb, _) = _sides(fwd.attr("value_dims"), not fwd.attr("p_is_lhs"))
    if (qc, kc_, qb, kb, vc, vb) != ((len(q.shape) - 1,), (3,), (0, 2), (0, 2), (1,), (0, 2)):
        return "score or value matmul dims other than (B, S, H, D) batch (0, 2)"
    if bwd is not None and not (_only(bwd, "dout") and all(_only(bwd, r) for r in
                                                           ("dq", "dk", "dv"))):
        return "a backward without one cotangent and one dq, dk, dv"
    return _mask_check(index, fwd, q.shape[:3], sk)


def _mask_check(index: Index, fwd: Match, bsh: tuple[int, ...], sk: int) -> str | None:
    """A mask read as data must broadcast to the scores ``(B, H, Sq, Sk)``."""
    for role in ("bias", "keep"):
        if role not in fwd.roles():
            continue
        shape = mask_shape(index, fwd, role)
        full = (bsh[0], math.prod(_t(index, fwd.input("q")).shape[2:-1]), bsh[1], sk)
        if shape is None:
            return (f"{role} {_t(index, fwd.input(role))} spans dims {fwd.attr(role + '_dims')} "
                    f"of the scores, not their (B, H, Sq, Sk)")
        if any(n not in (1, f) for n, f in zip(shape, full)):
            return (f"{role} {_t(index, fwd.input(role))} read as the scores' (B, H, Sq, Sk) "
                    f"= {full} has shape {shape} there, which does not broadcast")
    return None


def mask_shape(index: Index, fwd: Match, role: str) -> tuple[int, ...] | None:
    """The shape of mask ``role`` brought to the scores' ``(B, H, Sq, Sk)`` order (the heads
    of grouped queries merged: 1 if the mask broadcasts over both); ``None`` if its dims are
    not the scores'."""
    shape, dims = _t(index, fwd.input(role)).shape, fwd.attr(f"{role}_dims")
    order = mask_order(dims)
    if order is None:
        return None
    by = {dims[i]: shape[i] for i in order}
    q = _t(index, fwd.input("q")).shape
    heads = 1 if by["H"] == by.get("G", 1) == 1 else math.prod(q[2:-1])
    return by["B"], heads, by["Sq"], by["Sk"]


def _sides(dims, first_is_lhs: bool):
    """``((contract_a, contract_b), (batch_a, batch_b))`` with ``a`` the named operand."""
    (lc, rc), (lb, rb) = dims
    return ((lc, rc), (lb, rb)) if first_is_lhs else ((rc, lc), (rb, lb))


def _attn_slots(index: Index, fwd: Match):
    k = _t(index, fwd.input("k")).shape
    return (("batch", k[0]), ("seq", k[1]), ("heads", k[2]))


def _attn_layouts(index: Index, fwd: Match, bwd: Match | None, split) -> dict[int, Sharding]:
    act = (split["batch"], split["seq"], split["heads"], ())

    def layout(v: int) -> Sharding:      # (B, S, H, D), or grouped (B, S, K, G, D)
        return act + ((),) * (len(_t(index, v).shape) - 4)

    values = [fwd.input("q"), fwd.input("k"), fwd.input("v"), fwd.output("out")]
    if bwd is not None:
        values += [bwd.input("dout"), bwd.output("dq"), bwd.output("dk"), bwd.output("dv")]
    return {v: layout(v) for v in values}


def _attn_sizes(index: Index, fwd: Match, split, mesh):
    q, k = _t(index, fwd.input("q")), _t(index, fwd.input("k"))
    nb, ns, nh = (_n(mesh, split[r]) for r in ("batch", "seq", "heads"))
    b, sk, kv, d = k.shape
    heads = math.prod(q.shape[2:-1])
    return b // nb, q.shape[1] // ns, sk, heads // nh, kv // nh, d, q.itemsize


def _attn_cost(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    b, sq, sk, hq, hkv, d, it = _attn_sizes(index, fwd, split, mesh)
    # A query shard of a causal attention split over the sequence sees keys up to its own
    # position: the last shard sees them all, and it sets the step time.
    causal = bool(fwd.attr("causal")) and not split["seq"]
    cost = kc.attention_fwd_cost(b, sq, sk, hq, hkv, d, it, causal) + _mask_cost(
        index, fwd, bwd, (b, hq, sq, sk))
    kv_bytes = float(b * sk * hkv * d * it)
    comms: list[Comm] = []
    if split["seq"]:
        comms += [("all-gather", kv_bytes, split["seq"])] * 2
    if bwd is not None:
        cost = cost + kc.attention_bwd_cost(b, sq, sk, hq, hkv, d, it, causal)
        if split["seq"]:
            comms += [("all-gather", kv_bytes, split["seq"])] * 2
            comms += [("reduce-scatter", kv_bytes, split["seq"])] * 2
    return cost, tuple(comms)


def _mask_cost(index: Index, fwd: Match, bwd: Match | None, local) -> kc.KernelCost:
    """Reading the masks given as data: once forward, twice backward (dq and dk/dv)."""
    nbytes = 0.0
    for role, itemsize in (("bias", 4), ("keep", 1)):
        if role in fwd.roles():
            shape = mask_shape(index, fwd, role)
            nbytes += itemsize * math.prod(min(n, m) for n, m in zip(shape, local))
    return kc.KernelCost(hbm_bytes=nbytes * (3 if bwd is not None else 1))


def _attn_specs(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    b, sq, sk, hq, hkv, d, _ = _attn_sizes(index, fwd, split, mesh)
    act = (split["batch"], split["seq"], split["heads"], ())
    sk_local = sk // _n(mesh, split["seq"])
    return (("q", _spec(act), (b, sq, hq, d)), ("k, v", _spec(act), (b, sk_local, hkv, d)),
            ("lse", _spec(act[:1] + act[2:3] + act[1:2]), (b, hq, sq)))


# ---- norms ------------------------------------------------------------------------------------
def _norm_check(index: Index, fwd: Match, bwd: Match | None) -> str | None:
    x = _t(index, fwd.input("x"))
    width = x.shape[-1] if x.shape else 0
    if len(x.shape) < 2 or _t(index, fwd.input("scale")).shape != (width,):
        return f"x {x} with scale {_t(index, fwd.input('scale'))} (a per-feature norm of rows)"
    if "bias" in fwd.roles() and _t(index, fwd.input("bias")).shape != (width,):
        return f"bias {_t(index, fwd.input('bias'))}"
    if "residual" in fwd.roles() and _t(index, fwd.input("residual")) != x:
        return f"residual {_t(index, fwd.input('residual'))} unlike x {x}"
    if _t(index, fwd.output("y")) != x:
        return f"output {_t(index, fwd.output('y'))} unlike x {x}"
    if bwd is not None:
        wanted = ("dx", "dscale") + (("dbias",) if "bias" in fwd.roles() else ())
        if not _only(bwd, "dy") or sum(r == "dh" for r, _ in bwd.inputs) > 1 or \
                not all(_only(bwd, r) for r in wanted):
            return "a backward without one dy and one dx, dscale (, dbias)"
    return None


def _rows_slots(shape) -> tuple[tuple[str, int], ...]:
    return tuple((f"rows{i}", n) for i, n in enumerate(shape))


def _rows(split, n: int) -> tuple[tuple[str, ...], ...]:
    return tuple(split[f"rows{i}"] for i in range(n))


def _norm_slots(index: Index, fwd: Match):
    return _rows_slots(_t(index, fwd.input("x")).shape[:-1])


def _norm_layouts(index: Index, fwd: Match, bwd: Match | None, split) -> dict[int, Sharding]:
    rank = len(_t(index, fwd.input("x")).shape)
    act = _rows(split, rank - 1) + ((),)
    out = {fwd.input(r): act for r in ("x", "residual") if r in fwd.roles()}
    out.update({v: act for r, v in fwd.outputs if r in ("y", "h")})
    if bwd is not None:
        out.update({v: act for r, v in bwd.inputs if r in ("dy", "dh")})
        out[bwd.output("dx")] = act
    return out


def _norm_cost(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    x = _t(index, fwd.input("x"))
    rows = _rows(split, len(x.shape) - 1)
    n = math.prod(x.shape[:-1]) // shard_factor(rows, mesh)
    kind, res = fwd.attr("kind"), bool(fwd.attr("residual"))
    cost = kc.norm_fwd_cost(n, x.shape[-1], x.itemsize, kind, res)
    comms: tuple[Comm, ...] = ()
    if bwd is not None:
        cost = cost + kc.norm_bwd_cost(n, x.shape[-1], x.itemsize, kind, res)
        axes = used_axes(rows)
        scale = _t(index, fwd.input("scale"))
        params = 1 + ("bias" in fwd.roles())
        comms = (("all-reduce", float(params * scale.nbytes), axes),) if axes else ()
    return cost, comms


def _norm_specs(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    x = _t(index, fwd.input("x"))
    act = _rows(split, len(x.shape) - 1) + ((),)
    return (("x, y, h", _spec(act), _local(x.shape, act, mesh)),
            ("scale", "PartitionSpec(None,)", x.shape[-1:]))


# ---- LM-head cross-entropy --------------------------------------------------------------------
def logits_of(index: Index, fwd: Match) -> int | None:
    """The LM-head matmul's output (the logits) inside a cross-entropy match."""
    h, w = fwd.input("h"), fwd.input("w")
    for i in fwd.op_ids:
        op = index.ops[index.order[i]]
        if op.prim == "dot_general" and op.ins == (h, w):
            return op.outs[0]
    return None


def _xent_check(index: Index, fwd: Match, bwd: Match | None) -> str | None:
    h, w, t = (_t(index, fwd.input(r)) for r in ("h", "w", "targets"))
    loss = _t(index, fwd.output("loss"))
    logits = logits_of(index, fwd)
    if not fwd.attr("w_is_rhs") or logits is None or len(w.shape) != 2:
        return f"LM head w {w} (the kernel takes h (..., D) @ w (D, V))"
    if t.shape != h.shape[:-1] or loss.shape not in (t.shape, t.shape + (1,)) or \
            fwd.attr("vocab_axis") != len(h.shape) - 1:
        return f"h {h}, targets {t}, loss {loss} (per-token losses over the last dim)"
    if bwd is not None and not (_only(bwd, "dloss") and _only(bwd, "dh") and _only(bwd, "dw")):
        return "a backward without one dloss and one dh, dw"
    return None


def _xent_slots(index: Index, fwd: Match):
    return _rows_slots(_t(index, fwd.input("targets")).shape) + (
        ("vocab", _t(index, fwd.input("w")).shape[1]),)


def _xent_layouts(index: Index, fwd: Match, bwd: Match | None, split) -> dict[int, Sharding]:
    rank = len(_t(index, fwd.input("targets")).shape)
    rows = _rows(split, rank)
    loss_extra = ((),) * (len(_t(index, fwd.output("loss")).shape) - rank)
    out = {logits_of(index, fwd): rows + (split["vocab"],), fwd.input("h"): rows + ((),),
           fwd.input("targets"): rows, fwd.output("loss"): rows + loss_extra}
    if bwd is not None:
        out.update({bwd.input("dloss"): rows + loss_extra, bwd.output("dh"): rows + ((),)})
    return out


def _xent_sizes(index: Index, fwd: Match, split, mesh):
    h, w = _t(index, fwd.input("h")), _t(index, fwd.input("w"))
    rows = _rows(split, len(h.shape) - 1)
    n = math.prod(h.shape[:-1]) // shard_factor(rows, mesh)
    shards = _n(mesh, split["vocab"])
    return rows, n, w.shape[0], w.shape[1] // shards, shards, h.itemsize, w.itemsize


def _xent_cost(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    rows, n, d, v, shards, it, w_it = _xent_sizes(index, fwd, split, mesh)
    cost = kc.xent_fwd_cost(n, d, v, it, shards)
    if bwd is not None:
        cost = cost + kc.xent_bwd_cost(n, d, v, it, shards)
    comms = [(kind, nbytes, split["vocab"]) for kind, nbytes in cost.collectives]
    axes = used_axes(rows)
    if bwd is not None and axes:      # the head's gradient, summed over the row shards
        comms.append(("all-reduce", float(d * v * w_it), axes))
    return dataclasses.replace(cost, collectives=()), tuple(comms)


def _xent_specs(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    rows, n, d, v, _, _, _ = _xent_sizes(index, fwd, split, mesh)
    h = _t(index, fwd.input("h"))
    return (("h", _spec(rows + ((),)), _local(h.shape, rows + ((),), mesh)),
            ("w", _spec(((), split["vocab"])), (d, v)))


# ---- adamw ------------------------------------------------------------------------------------
def _adamw_check(index: Index, fwd: Match, bwd: Match | None) -> str | None:
    p = _t(index, fwd.input("param"))
    for r in ("grad", "mu", "nu"):
        if _t(index, fwd.input(r)).shape != p.shape:
            return f"{r} {_t(index, fwd.input(r))} unlike the parameter {p}"
    for r in ("bc1", "bc2") + (("lr",) if "lr" in fwd.roles() else ()):
        if _t(index, fwd.input(r)).shape:
            return f"{r} {_t(index, fwd.input(r))} is not a scalar"
    if "lr" not in fwd.roles() and fwd.attr("lr") is None:
        return "no learning rate"
    return None


def _adamw_slots(index: Index, fwd: Match):
    return tuple((f"dim{i}", n) for i, n in enumerate(_t(index, fwd.input("param")).shape))


def _adamw_layouts(index: Index, fwd: Match, bwd: Match | None, split) -> dict[int, Sharding]:
    rank = len(_t(index, fwd.input("param")).shape)
    layout = tuple(split[f"dim{i}"] for i in range(rank))
    return {fwd.input(r): layout for r in ("param", "grad", "mu", "nu")}


def _adamw_cost(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    p, g, mu = (_t(index, fwd.input(r)) for r in ("param", "grad", "mu"))
    shards = shard_factor(tuple(split.values()), mesh)
    return kc.adamw_cost(p.size // shards, p.itemsize, g.itemsize, mu.itemsize), ()


def _adamw_specs(index: Index, fwd: Match, bwd: Match | None, split, mesh):
    p = _t(index, fwd.input("param"))
    layout = tuple(split[f"dim{i}"] for i in range(len(p.shape)))
    return (("param, grad, mu, nu", _spec(layout), _local(p.shape, layout, mesh)),)


RULES: dict[str, KernelRule] = {
    "attention": KernelRule(("q", "k", "v", "bias", "keep"), ("dout",), ("out",),
                            ("dq", "dk", "dv"), ("bias", "keep"), _attn_check, _attn_slots,
                            _attn_layouts, _attn_cost, _attn_specs),
    "norm": KernelRule(("x", "residual", "scale", "bias"), ("dy", "dh"), ("y", "h"),
                       ("dx", "dscale", "dbias"), ("residual", "bias", "dh"), _norm_check,
                       _norm_slots, _norm_layouts, _norm_cost, _norm_specs),
    "xent": KernelRule(("h", "w", "targets"), ("dloss",), ("loss",), ("dh", "dw"), (),
                       _xent_check, _xent_slots, _xent_layouts, _xent_cost, _xent_specs),
    "adamw": KernelRule(("param", "grad", "mu", "nu", "bc1", "bc2", "lr"), (),
                        ("param", "mu", "nu"), (), ("lr",), _adamw_check, _adamw_slots,
                        _adamw_layouts, _adamw_cost, _adamw_specs),
}


def kernel_of(pattern: str) -> str:
    """``"attention_fwd"`` -> ``"attention"`` (the kernel a pattern's matches become)."""
    return pattern.removesuffix("_fwd").removesuffix("_bwd")
