"""Flash attention: causal, grouped-query and masked, online softmax, backward recomputed from
the LSE.

Shapes: B batch, Sq/Sk query/key sequence, Hq query heads, Hkv key/value heads (G = Hq/Hkv
query heads share one key/value head), D head width; bq/bk query/key block rows.
Layout: ``q (B, Sq, Hq, D)``, ``k, v (B, Sk, Hkv, D)``, ``out (B, Sq, Hq, D)``,
``lse (B, Hq, Sq)`` float32 (the log-sum-exp of each query row's scaled scores).

Forward (one program per (b, h, query block), FlashAttention-2's loop order): the query block
stays on chip while the loop streams key/value blocks, keeping the running row max ``m``, the
running sum ``l`` of ``exp(s - m)`` and the unnormalised output; each new block rescales them by
``exp(m_old - m_new)``. Causal programs stop at the diagonal block, so they do about half the
work. Output: ``acc / l`` and ``lse = m + log l``.

Backward (two kernels, nothing of size Sq x Sk is stored): ``delta = rowsum(out * dout) - dlse``
is computed by XLA, then ``P = exp(s - lse)`` is recomputed block by block:
  * dq kernel, one program per (b, h, query block): ``dq = scale * sum_j (P * (dout v^T -
    delta)) k``.
  * dk/dv kernel, one program per (b, kv head, key block), looping over the G query heads of the
    group and the query blocks at or after the diagonal: ``dv = sum P^T dout``,
    ``dk = scale * sum (P * (dout v^T - delta))^T q``; the group sum happens on chip, so
    grouped-query attention needs no repeated k/v and no extra reduction.

``q_offset`` is the position of the first query row relative to the first key row (a traced
scalar): a query shard of a sequence-split attention sees keys up to its own global position.

Masks (``Masks``), for models whose mask is data (a padding ``attention_mask`` from the batch,
a sliding window): an additive ``bias`` and a boolean ``keep``, each ``(Bm, Hm, Sq, Sk)`` with
``Bm`` 1 or B and ``Hm`` 1 or Hq (size-1 Sq or Sk broadcast), give the scores
``where(keep, scale q k^T + bias, fill)``, as flax's ``dot_product_attention_weights`` and
transformers' bias masks compute them; the backward passes no gradient through a hidden
score (``ds = 0`` where ``keep`` is false) and none to the masks themselves, which are
constants to the kernel. With masks, a score is at least ``FLOOR`` (-1e4): beside any real
score its weight underflows to 0 as a ``finfo.min`` one does, and a query row that sees no
key at all (a left-padded row) gets uniform weights over its keys, as XLA's softmax of a row
of equal ``finfo.min`` scores does, where the exact LSE of such a row would round away the
row's sum (the backward then recomputes its weights to 1e-3, not to 1 ulp). Keys past the end
and above the causal diagonal are ``-inf``; the running max is taken as 0 while a row has
seen no finite score.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from autopar.errors import AutoparError
from autopar.kernels import _pallas as kp

_INF = float("inf")
FLOOR = -1e4     # with masks, the least score (see the module docstring)


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes (powers of two; clamped to the sequence) and Triton launch parameters."""

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2


DEFAULT_BLOCKS = AttentionBlocks()


@dataclasses.dataclass(frozen=True)
class Masks:
    """Score masks read as data (see the module docstring): ``bias`` added to the scaled
    scores, ``keep`` (boolean) hiding the scores where it is false behind ``fill``. Either may
    be ``None``. Not differentiated: they are constants to the kernel."""

    bias: jax.Array | None = None
    keep: jax.Array | None = None
    fill: float = -_INF

    def __bool__(self) -> bool:
        return self.bias is not None or self.keep is not None


NO_MASKS = Masks()


@dataclasses.dataclass(frozen=True)
class _Cfg:
    causal: bool
    scale: float
    seq_k: int          # unpadded key length: keys at or past it are masked
    bq: int
    bk: int
    bq_bwd: int
    bk_bwd: int
    backend: str
    num_warps: int | None
    num_stages: int
    bias: tuple[bool, bool] | None = None   # a bias: (one per batch row, one per head)
    keep: tuple[bool, bool] | None = None   # a keep-mask: likewise
    fill: float = -_INF


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              scale: float | None = None, q_offset: jax.Array | int = 0,
              blocks: AttentionBlocks = DEFAULT_BLOCKS, backend: str | None = None,
              masks: Masks = NO_MASKS) -> jax.Array:
    """Softmax attention ``softmax(where(keep, scale * q k^T + bias, fill)) v`` as one Pallas
    kernel.

    Args:
      q: ``(B, Sq, Hq, D)``.
      k, v: ``(B, Sk, Hkv, D)``; ``Hq`` a multiple of ``Hkv`` (grouped-query attention).
      causal: query ``i`` sees keys ``j <= i + q_offset``.
      scale: multiplies the scores; default ``1/sqrt(D)``.
      q_offset: global position of query row 0 minus that of key row 0 (int, or traced scalar).
      blocks: tile sizes.
      backend: ``"interpret"`` or ``"triton"``; default by platform (see ``_pallas``).
      masks: a bias and/or boolean mask (``Masks``), each ``(1 or B, 1 or Hq, Sq, Sk)``.

    Returns:
      ``(B, Sq, Hq, D)`` in ``q``'s dtype. Differentiable in ``q``, ``k``, ``v``.
    """
    return attention_with_lse(q, k, v, causal=causal, scale=scale, q_offset=q_offset,
                              blocks=blocks, backend=backend, masks=masks)[0]


def attention_with_lse(q, k, v, *, causal=True, scale=None, q_offset=0,
                       blocks: AttentionBlocks = DEFAULT_BLOCKS, backend=None,
                       masks: Masks = NO_MASKS):
    """``attention`` that also returns ``lse (B, Hq, Sq)`` (float32), differentiable too."""
    static = _Static(bool(causal), scale, blocks, backend, masks.fill)
    return _flash(q, k, v, jnp.asarray(q_offset, jnp.int32), masks.bias, masks.keep, static)


def attention_fwd(q, k, v, *, causal: bool = True, scale: float | None = None,
                  q_offset: jax.Array | int = 0, blocks: AttentionBlocks = DEFAULT_BLOCKS,
                  backend: str | None = None, masks: Masks = NO_MASKS):
    """The forward kernel alone: ``(out, lse)``, the residuals ``attention_bwd`` reads."""
    _check(q, k, v)
    cfg = _config(q, k, causal, scale, blocks, backend, masks)
    sq, d = q.shape[1], q.shape[3]
    qp, kp_, vp = _padded(cfg, q, k, v)
    out, lse = _forward(qp, kp_, vp, _mask_arrays(masks, q, k, qp, kp_),
                        kp.scalar_array(q_offset), cfg)
    return out[:, :sq, :, :d], lse[:, :, :sq]


def attention_bwd(q, k, v, out, lse, dout, dlse=None, *, causal: bool = True,
                  scale: float | None = None, q_offset: jax.Array | int = 0,
                  blocks: AttentionBlocks = DEFAULT_BLOCKS, backend: str | None = None,
                  masks: Masks = NO_MASKS):
    """The backward kernels alone: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse`` and
    the cotangents ``dout`` (and ``dlse``, if the LSE was used)."""
    _check(q, k, v)
    cfg = _config(q, k, causal, scale, blocks, backend, masks)
    sq, d = q.shape[1], q.shape[3]
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse                                  # (B, Hq, Sq)
    qp, kp_, vp, dop = _padded(cfg, q, k, v, dout.astype(q.dtype))
    m = _mask_arrays(masks, q, k, qp, kp_)
    rows = (lambda a: kp.pad_to(a, 2, qp.shape[1]))
    offset = kp.scalar_array(q_offset)
    dq = _dq(qp, kp_, vp, dop, rows(lse), rows(delta), m, offset, cfg)
    dk, dv = _dkdv(qp, kp_, vp, dop, rows(lse), rows(delta), m, offset, cfg)
    sk = k.shape[1]
    return dq[:, :sq, :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d]


def _config(q, k, causal, scale, blocks: AttentionBlocks, backend, masks: Masks) -> _Cfg:
    sq, d, sk = q.shape[1], q.shape[3], k.shape[1]

    def per(x):     # (one per batch row, one per head) of a mask array
        return None if x is None else (x.shape[0] > 1, x.shape[1] > 1)

    return _Cfg(bool(causal), float(1 / math.sqrt(d) if scale is None else scale), sk,
                kp.block(sq, blocks.block_q), kp.block(sk, blocks.block_k),
                kp.block(sq, blocks.block_q_bwd), kp.block(sk, blocks.block_k_bwd),
                kp.resolve_backend(backend), blocks.num_warps, blocks.num_stages,
                per(masks.bias), per(masks.keep), float(masks.fill))


def _padded(cfg: _Cfg, q, k, v, *more_q):
    """Pads the sequences to the blocks and the head width to a power of two."""
    dp = kp.next_pow2(q.shape[3])
    sq_p = kp.round_up(q.shape[1], max(cfg.bq, cfg.bq_bwd))
    sk_p = kp.round_up(k.shape[1], max(cfg.bk, cfg.bk_bwd))
    qs = [kp.pad_to(kp.pad_to(x, 1, sq_p), 3, dp) for x in (q, *more_q)]   # (B, Sq', H, D')
    ks = [kp.pad_to(kp.pad_to(x, 1, sk_p), 3, dp) for x in (k, v)]          # (B, Sk', Hkv, D')
    return (qs[0], *ks, *qs[1:])


def _mask_arrays(masks: Masks, q, k, qp, kp_) -> tuple:
    """The bias (float32) and keep-mask (int8) the kernels read, ``(Bm, Hm, Sq', Sk')``:
    size-1 sequence dims broadcast, then padded like q and k (padded keys are masked by the
    kernels' key count)."""
    out = []
    for x, pad, dtype in ((masks.bias, 0, jnp.float32), (masks.keep, 1, jnp.int8)):
        if x is None:
            continue
        _check_mask(x, q, k)
        x = jnp.broadcast_to(x, x.shape[:2] + (q.shape[1], k.shape[1])).astype(dtype)
        out.append(kp.pad_to(kp.pad_to(x, 2, qp.shape[1], pad), 3, kp_.shape[1], pad))
    return tuple(out)


def _check_mask(x, q, k) -> None:
    b, sq, hq, _ = q.shape
    ok = x.ndim == 4 and x.shape[0] in (1, b) and x.shape[1] in (1, hq) and \
        x.shape[2] in (1, sq) and x.shape[3] in (1, k.shape[1])
    if not ok:
        raise AutoparError(
            f"attention mask of shape {tuple(x.shape)} for q{tuple(q.shape)}, k"
            f"{tuple(k.shape)}: a bias or keep-mask is (1 or B, 1 or Hq, Sq, Sk) = "
            f"({b}, {hq}, {sq}, {k.shape[1]}) in the scores' order; transpose or broadcast it")


def _check(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise AutoparError(
            f"attention takes q (B, Sq, Hq, D) and k, v (B, Sk, Hkv, D) of equal shape; got "
            f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}: reshape to that layout")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise AutoparError(
            f"attention: q{tuple(q.shape)} and k{tuple(k.shape)} must agree in batch and head "
            f"width, and query heads ({q.shape[2]}) must be a multiple of key/value heads "
            f"({k.shape[2]}); repeat or regroup the heads so that they are")
    if not (q.dtype == k.dtype == v.dtype):
        raise AutoparError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, "
                           f"{v.dtype}); cast them to one dtype first")


# ---- the custom VJP: the two halves above ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    causal: bool
    scale: float | None
    blocks: AttentionBlocks
    backend: str | None
    fill: float = -_INF

    def kwargs(self, offset, bias, keep) -> dict:
        return {"causal": self.causal, "scale": self.scale, "q_offset": offset,
                "blocks": self.blocks, "backend": self.backend,
                "masks": Masks(bias, keep, self.fill)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, offset, bias, keep, static: _Static):
    return attention_fwd(q, k, v, **static.kwargs(offset, bias, keep))


def _flash_fwd(q, k, v, offset, bias, keep, static: _Static):
    out, lse = attention_fwd(q, k, v, **static.kwargs(offset, bias, keep))
    return (out, lse), (q, k, v, offset, bias, keep, out, lse)


def _flash_bwd(static: _Static, res, cts):
    q, k, v, offset, bias, keep, out, lse = res
    dq, dk, dv = attention_bwd(q, k, v, out, lse, cts[0], cts[1],
                               **static.kwargs(offset, bias, keep))
    none = (lambda x: None if x is None else jnp.zeros_like(x))   # masks are constants
    return dq, dk, dv, None, none(bias), none(keep)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- kernels ----------------------------------------------------------------------------------
def _visible(q_pos, k_pos, causal: bool, seq_k: int):
    ok = k_pos < seq_k
    return jnp.logical_and(ok, k_pos <= q_pos) if causal else ok


def _positions(q_start, k_start, bq: int, bk: int):
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    return q_pos, k_pos


def _scores(q, k, bias, keep, visible, cfg: _Cfg):
    """``where(visible, max(where(keep, scale q k^T + bias, fill), FLOOR), -inf)`` of one
    block (no ``FLOOR`` without masks)."""
    s = kp.mm(q, k, trans_b=True) * cfg.scale                 # (bq, bk)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = jnp.where(keep != 0, s, cfg.fill)
    if bias is not None or keep is not None:
        s = jnp.maximum(s, FLOOR)
    return jnp.where(visible, s, -_INF)


def _mask_specs(cfg: _Cfg, block_of, index_of) -> list:
    """Block specs of the bias and keep-mask (``(Bm, Hm, Sq', Sk')``): ``block_of(per_head)``
    gives the block shape (``None`` squeezes a dim), ``index_of(*grid)`` the ``(b, h, row
    block, col block)`` it reads; a dim the mask broadcasts reads its one entry."""
    specs = []
    for per in (cfg.bias, cfg.keep):
        if per is None:
            continue

        def idx(*grid, per=per):
            b, h, i, j = index_of(*grid)
            return (b if per[0] else 0, h if per[1] else 0, i, j)

        specs.append(pl.BlockSpec(block_of(per[1]), idx))
    return specs


def _split_masks(cfg: _Cfg, refs):
    """``(bias_ref | None, keep_ref | None, rest)`` from a kernel's refs after q, k, v(, do)."""
    it = iter(refs)
    bias = next(it) if cfg.bias is not None else None
    keep = next(it) if cfg.keep is not None else None
    return bias, keep, list(it)


def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
    bias_ref, keep_ref, (o_ref, lse_ref) = _split_masks(cfg, refs)
    bq, bk = cfg.bq, cfg.bk
    q_start = off_ref[0] + pl.program_id(2) * bq
    q = q_ref[...]                                            # (bq, D)

    def body(j, carry):
        acc, m, ssum = carry
        cols = pl.ds(j * bk, bk)
        k, v = k_ref[cols, :], v_ref[cols, :]                 # (bk, D)
        q_pos, k_pos = _positions(q_start, j * bk, bq, bk)
        s = _scores(q, k, None if bias_ref is None else bias_ref[:, cols],
                    None if keep_ref is None else keep_ref[:, cols],
                    _visible(q_pos, k_pos, cfg.causal, cfg.seq_k), cfg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -_INF, 0., m_new)         # no finite score yet: exp(-inf) = 0
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - shift[:, None])
        acc = alpha[:, None] * acc + kp.mm(p.astype(v.dtype), v)
        return acc, m_new, alpha * ssum + jnp.sum(p, axis=1)

    n_k = k_ref.shape[0] // bk
    hi = lax.min(n_k, lax.div(q_start + bq + bk - 1, bk)) if cfg.causal else n_k
    init = (jnp.zeros((bq, q.shape[1]), jnp.float32), jnp.full((bq,), -_INF, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, ssum = lax.fori_loop(0, hi, body, init)
    o_ref[...] = (acc / ssum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(ssum)


def _forward(q, k, v, masks, offset, cfg: _Cfg):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    grid = (b, hq, sq // cfg.bq)
    q_spec = pl.BlockSpec((None, cfg.bq, None, d), lambda b_, h, i: (b_, i, h, 0))
    kv_spec = pl.BlockSpec((None, sk, None, d), lambda b_, h, i: (b_, 0, h // group, 0))
    m_specs = _mask_specs(cfg, lambda _: (None, None, cfg.bq, sk),
                          lambda b_, h, i: (b_, h, i, 0))
    return kp.call(
        functools.partial(_fwd_kernel, cfg=cfg), backend=cfg.backend, name="autopar_attn_fwd",
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)),
        grid=grid, in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), q_spec, kv_spec, kv_spec]
        + m_specs,
        out_specs=(q_spec, pl.BlockSpec((None, None, cfg.bq), lambda b_, h, i: (b_, h, i))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)(offset, q, k, v, *masks)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg):
    bias_ref, keep_ref, (dq_ref,) = _split_masks(cfg, refs)
    bq, bk = cfg.bq_bwd, cfg.bk_bwd
    q_start = off_ref[0] + pl.program_id(2) * bq
    q, do = q_ref[...], do_ref[...]                           # (bq, D)
    lse, delta = lse_ref[...], delta_ref[...]                 # (bq,)

    def body(j, dq):
        cols = pl.ds(j * bk, bk)
        k, v = k_ref[cols, :], v_ref[cols, :]
        keep = None if keep_ref is None else keep_ref[:, cols]
        q_pos, k_pos = _positions(q_start, j * bk, bq, bk)
        visible = _visible(q_pos, k_pos, cfg.causal, cfg.seq_k)
        s = _scores(q, k, None if bias_ref is None else bias_ref[:, cols], keep, visible, cfg)
        p = jnp.where(visible, jnp.exp(s - lse[:, None]), 0.)
        ds = _hidden_zero(p * (kp.mm(do, v, trans_b=True) - delta[:, None]), keep)
        return dq + kp.mm(ds.astype(k.dtype), k)

    n_k = k_ref.shape[0] // bk
    hi = lax.min(n_k, lax.div(q_start + bq + bk - 1, bk)) if cfg.causal else n_k
    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _hidden_zero(ds, keep):
    """No gradient reaches a score the keep-mask replaced by its fill."""
    return ds if keep is None else jnp.where(keep != 0, ds, 0.)


def _dq(q, k, v, dout, lse, delta, masks, offset, cfg: _Cfg):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    q_spec = pl.BlockSpec((None, cfg.bq_bwd, None, d), lambda b_, h, i: (b_, i, h, 0))
    kv_spec = pl.BlockSpec((None, sk, None, d), lambda b_, h, i: (b_, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, cfg.bq_bwd), lambda b_, h, i: (b_, h, i))
    m_specs = _mask_specs(cfg, lambda _: (None, None, cfg.bq_bwd, sk),
                          lambda b_, h, i: (b_, h, i, 0))
    return kp.call(
        functools.partial(_dq_kernel, cfg=cfg), backend=cfg.backend, name="autopar_attn_dq",
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, hq, sq // cfg.bq_bwd),
        in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), q_spec, kv_spec, kv_spec, q_spec,
                  row_spec, row_spec] + m_specs,
        out_specs=q_spec, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )(offset, q, k, v, dout, lse, delta, *masks)


def _dkdv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg,
                 group: int):
    bias_ref, keep_ref, (dk_ref, dv_ref) = _split_masks(cfg, refs)
    bq, bk = cfg.bq_bwd, cfg.bk_bwd
    off = off_ref[0]
    k_start = pl.program_id(2) * bk
    k, v = k_ref[...], v_ref[...]                             # (bk, D)
    n_q = q_ref.shape[0] // bq
    # Causal: query blocks that end before this key block see none of it.
    lo = lax.min(n_q, lax.div(lax.max(k_start - off, 0), bq)) if cfg.causal else 0

    def mask_block(ref, per, g, rows):            # (bq, bk) of head g of the group
        return None if ref is None else ref[g if per[1] else 0, rows, :]

    def query_block(g, i, dk, dv):
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]         # (bq, D)
        lse, delta = lse_ref[g, rows], delta_ref[g, rows]     # (bq,)
        keep = mask_block(keep_ref, cfg.keep, g, rows)
        q_pos, k_pos = _positions(off + i * bq, k_start, bq, bk)
        visible = _visible(q_pos, k_pos, cfg.causal, cfg.seq_k)
        s = _scores(q, k, mask_block(bias_ref, cfg.bias, g, rows), keep, visible, cfg)
        p = jnp.where(visible, jnp.exp(s - lse[:, None]), 0.)
        dv = dv + kp.mm(p.astype(do.dtype), do, trans_a=True)
        ds = _hidden_zero(p * (kp.mm(do, v, trans_b=True) - delta[:, None]), keep)
        return dk + kp.mm(ds.astype(q.dtype), q, trans_a=True), dv

    def head(g, carry):
        return lax.fori_loop(lo, n_q, lambda i, c: query_block(g, i, *c), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkdv(q, k, v, dout, lse, delta, masks, offset, cfg: _Cfg):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    q_spec = pl.BlockSpec((None, sq, group, d), lambda b_, h, j: (b_, 0, h, 0))
    row_spec = pl.BlockSpec((None, group, sq), lambda b_, h, j: (b_, h, 0))
    kv_spec = pl.BlockSpec((None, cfg.bk_bwd, None, d), lambda b_, h, j: (b_, j, h, 0))
    # A mask's heads are query heads: the group's G of them (or its single broadcast head).
    m_specs = _mask_specs(cfg, lambda per_head: (None, group if per_head else 1, sq, cfg.bk_bwd),
                          lambda b_, h, j: (b_, h, 0, j))
    return kp.call(
        functools.partial(_dkdv_kernel, cfg=cfg, group=group), backend=cfg.backend,
        name="autopar_attn_dkdv",
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(b, hkv, sk // cfg.bk_bwd),
        in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), q_spec, kv_spec, kv_spec, q_spec,
                  row_spec, row_spec] + m_specs,
        out_specs=(kv_spec, kv_spec), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )(offset, q, k, v, dout, lse, delta, *masks)


# ---- reference --------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None,
                        q_offset: jax.Array | int = 0, return_lse: bool = False,
                        masks: Masks = NO_MASKS):
    """The same attention in plain jnp (scores materialised), float32 softmax."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(b, sq, hkv, hq // hkv, d)                                  # (B, Sq, Hkv, G, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    grouped = (lambda m: jnp.broadcast_to(m, (m.shape[0], hq) + m.shape[2:]).reshape(
        m.shape[0], hkv, hq // hkv, *m.shape[2:]))                           # (B, Hkv, G, ...)
    if masks.bias is not None:
        s = s + grouped(masks.bias).astype(jnp.float32)
    if masks.keep is not None:
        s = jnp.where(grouped(masks.keep), s, masks.fill)
    if causal:
        q_pos = jnp.arange(sq)[:, None] + q_offset
        s = jnp.where(jnp.arange(sk)[None, :] <= q_pos, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)                                        # (B, Hkv, G, Sq)
    p = jax.nn.softmax(s, axis=-1)        # as models compute it: exact on rows of equal scores
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32).reshape(b, sq, hq, d).astype(q.dtype)
    return (out, lse.reshape(b, hq, sq)) if return_lse else out
