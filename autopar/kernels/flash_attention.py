"""Flash attention: causal and grouped-query, online softmax, backward recomputed from the LSE.

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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              scale: float | None = None, q_offset: jax.Array | int = 0,
              blocks: AttentionBlocks = DEFAULT_BLOCKS, backend: str | None = None) -> jax.Array:
    """Softmax attention ``softmax(scale * q k^T + mask) v`` as one Pallas kernel.

    Args:
      q: ``(B, Sq, Hq, D)``.
      k, v: ``(B, Sk, Hkv, D)``; ``Hq`` a multiple of ``Hkv`` (grouped-query attention).
      causal: query ``i`` sees keys ``j <= i + q_offset``.
      scale: multiplies the scores; default ``1/sqrt(D)``.
      q_offset: global position of query row 0 minus that of key row 0 (int, or traced scalar).
      blocks: tile sizes.
      backend: ``"interpret"`` or ``"triton"``; default by platform (see ``_pallas``).

    Returns:
      ``(B, Sq, Hq, D)`` in ``q``'s dtype. Differentiable in ``q``, ``k``, ``v``.
    """
    return attention_with_lse(q, k, v, causal=causal, scale=scale, q_offset=q_offset,
                              blocks=blocks, backend=backend)[0]


def attention_with_lse(q, k, v, *, causal=True, scale=None, q_offset=0,
                       blocks: AttentionBlocks = DEFAULT_BLOCKS, backend=None):
    """``attention`` that also returns ``lse (B, Hq, Sq)`` (float32), differentiable too."""
    static = _Static(bool(causal), scale, blocks, backend)
    return _flash(q, k, v, jnp.asarray(q_offset, jnp.int32), static)


def attention_fwd(q, k, v, *, causal: bool = True, scale: float | None = None,
                  q_offset: jax.Array | int = 0, blocks: AttentionBlocks = DEFAULT_BLOCKS,
                  backend: str | None = None):
    """The forward kernel alone: ``(out, lse)``, the residuals ``attention_bwd`` reads."""
    _check(q, k, v)
    cfg = _config(q, k, causal, scale, blocks, backend)
    sq, d = q.shape[1], q.shape[3]
    out, lse = _forward(*_padded(cfg, q, k, v), kp.scalar_array(q_offset), cfg)
    return out[:, :sq, :, :d], lse[:, :, :sq]


def attention_bwd(q, k, v, out, lse, dout, dlse=None, *, causal: bool = True,
                  scale: float | None = None, q_offset: jax.Array | int = 0,
                  blocks: AttentionBlocks = DEFAULT_BLOCKS, backend: str | None = None):
    """The backward kernels alone: ``(dq, dk, dv)`` from the forward's ``out`` and ``lse`` and
    the cotangents ``dout`` (and ``dlse``, if the LSE was used)."""
    _check(q, k, v)
    cfg = _config(q, k, causal, scale, blocks, backend)
    sq, d = q.shape[1], q.shape[3]
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse                                  # (B, Hq, Sq)
    qp, kp_, vp, dop = _padded(cfg, q, k, v, dout.astype(q.dtype))
    rows = (lambda a: kp.pad_to(a, 2, qp.shape[1]))
    offset = kp.scalar_array(q_offset)
    dq = _dq(qp, kp_, vp, dop, rows(lse), rows(delta), offset, cfg)
    dk, dv = _dkdv(qp, kp_, vp, dop, rows(lse), rows(delta), offset, cfg)
    sk = k.shape[1]
    return dq[:, :sq, :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d]


def _config(q, k, causal, scale, blocks: AttentionBlocks, backend) -> _Cfg:
    sq, d, sk = q.shape[1], q.shape[3], k.shape[1]
    return _Cfg(bool(causal), float(1 / math.sqrt(d) if scale is None else scale), sk,
                kp.block(sq, blocks.block_q), kp.block(sk, blocks.block_k),
                kp.block(sq, blocks.block_q_bwd), kp.block(sk, blocks.block_k_bwd),
                kp.resolve_backend(backend), blocks.num_warps, blocks.num_stages)


def _padded(cfg: _Cfg, q, k, v, *more_q):
    """Pads the sequences to the blocks and the head width to a power of two."""
    dp = kp.next_pow2(q.shape[3])
    sq_p = kp.round_up(q.shape[1], max(cfg.bq, cfg.bq_bwd))
    sk_p = kp.round_up(k.shape[1], max(cfg.bk, cfg.bk_bwd))
    qs = [kp.pad_to(kp.pad_to(x, 1, sq_p), 3, dp) for x in (q, *more_q)]   # (B, Sq', H, D')
    ks = [kp.pad_to(kp.pad_to(x, 1, sk_p), 3, dp) for x in (k, v)]          # (B, Sk', Hkv, D')
    return (qs[0], *ks, *qs[1:])


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

    def kwargs(self, offset) -> dict:
        return {"causal": self.causal, "scale": self.scale, "q_offset": offset,
                "blocks": self.blocks, "backend": self.backend}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, offset, static: _Static):
    return attention_fwd(q, k, v, **static.kwargs(offset))


def _flash_fwd(q, k, v, offset, static: _Static):
    out, lse = attention_fwd(q, k, v, **static.kwargs(offset))
    return (out, lse), (q, k, v, offset, out, lse)


def _flash_bwd(static: _Static, res, cts):
    q, k, v, offset, out, lse = res
    dq, dk, dv = attention_bwd(q, k, v, out, lse, cts[0], cts[1], **static.kwargs(offset))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- kernels ----------------------------------------------------------------------------------
def _visible(q_pos, k_pos, causal: bool, seq_k: int):
    ok = k_pos < seq_k
    return jnp.logical_and(ok, k_pos <= q_pos) if causal else ok


def _positions(q_start, k_start, bq: int, bk: int):
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    return q_pos, k_pos


def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: _Cfg):
    bq, bk = cfg.bq, cfg.bk
    q_start = off_ref[0] + pl.program_id(2) * bq
    q = q_ref[...]                                            # (bq, D)

    def body(j, carry):
        acc, m, ssum = carry
        k = k_ref[pl.ds(j * bk, bk), :]                       # (bk, D)
        v = v_ref[pl.ds(j * bk, bk), :]
        s = kp.mm(q, k, trans_b=True) * cfg.scale             # (bq, bk)
        q_pos, k_pos = _positions(q_start, j * bk, bq, bk)
        s = jnp.where(_visible(q_pos, k_pos, cfg.causal, cfg.seq_k), s, kp.NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = alpha[:, None] * acc + kp.mm(p.astype(v.dtype), v)
        return acc, m_new, alpha * ssum + jnp.sum(p, axis=1)

    n_k = k_ref.shape[0] // bk
    hi = lax.min(n_k, lax.div(q_start + bq + bk - 1, bk)) if cfg.causal else n_k
    init = (jnp.zeros((bq, q.shape[1]), jnp.float32), jnp.full((bq,), kp.NEG_INF, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, ssum = lax.fori_loop(0, hi, body, init)
    o_ref[...] = (acc / ssum[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(ssum)


def _forward(q, k, v, offset, cfg: _Cfg):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    grid = (b, hq, sq // cfg.bq)
    q_spec = pl.BlockSpec((None, cfg.bq, None, d), lambda b_, h, i: (b_, i, h, 0))
    kv_spec = pl.BlockSpec((None, sk, None, d), lambda b_, h, i: (b_, 0, h // group, 0))
    return kp.call(
        functools.partial(_fwd_kernel, cfg=cfg), backend=cfg.backend, name="autopar_attn_fwd",
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)),
        grid=grid, in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), q_spec, kv_spec, kv_spec],
        out_specs=(q_spec, pl.BlockSpec((None, None, cfg.bq), lambda b_, h, i: (b_, h, i))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)(offset, q, k, v)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Cfg):
    bq, bk = cfg.bq_bwd, cfg.bk_bwd
    q_start = off_ref[0] + pl.program_id(2) * bq
    q, do = q_ref[...], do_ref[...]                           # (bq, D)
    lse, delta = lse_ref[...], delta_ref[...]                 # (bq,)

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        q_pos, k_pos = _positions(q_start, j * bk, bq, bk)
        s = kp.mm(q, k, trans_b=True) * cfg.scale
        p = jnp.where(_visible(q_pos, k_pos, cfg.causal, cfg.seq_k), jnp.exp(s - lse[:, None]), 0.)
        ds = p * (kp.mm(do, v, trans_b=True) - delta[:, None])
        return dq + kp.mm(ds.astype(k.dtype), k)

    n_k = k_ref.shape[0] // bk
    hi = lax.min(n_k, lax.div(q_start + bq + bk - 1, bk)) if cfg.causal else n_k
    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dq(q, k, v, dout, lse, delta, offset, cfg: _Cfg):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    q_spec = pl.BlockSpec((None, cfg.bq_bwd, None, d), lambda b_, h, i: (b_, i, h, 0))
    kv_spec = pl.BlockSpec((None, sk, None, d), lambda b_, h, i: (b_, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, cfg.bq_bwd), lambda b_, h, i: (b_, h, i))
    return kp.call(
        functools.partial(_dq_kernel, cfg=cfg), backend=cfg.backend, name="autopar_attn_dq",
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, hq, sq // cfg.bq_bwd),
        in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), q_spec, kv_spec, kv_spec, q_spec,
                  row_spec, row_spec],
        out_specs=q_spec, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )(offset, q, k, v, dout, lse, delta)


def _dkdv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 cfg: _Cfg, group: int):
    bq, bk = cfg.bq_bwd, cfg.bk_bwd
    off = off_ref[0]
    k_start = pl.program_id(2) * bk
    k, v = k_ref[...], v_ref[...]                             # (bk, D)
    n_q = q_ref.shape[0] // bq
    # Causal: query blocks that end before this key block see none of it.
    lo = lax.min(n_q, lax.div(lax.max(k_start - off, 0), bq)) if cfg.causal else 0

    def query_block(g, i, dk, dv):
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]         # (bq, D)
        lse, delta = lse_ref[g, rows], delta_ref[g, rows]     # (bq,)
        q_pos, k_pos = _positions(off + i * bq, k_start, bq, bk)
        s = kp.mm(q, k, trans_b=True) * cfg.scale
        p = jnp.where(_visible(q_pos, k_pos, cfg.causal, cfg.seq_k), jnp.exp(s - lse[:, None]), 0.)
        dv = dv + kp.mm(p.astype(do.dtype), do, trans_a=True)
        ds = p * (kp.mm(do, v, trans_b=True) - delta[:, None])
        return dk + kp.mm(ds.astype(q.dtype), q, trans_a=True), dv

    def head(g, carry):
        return lax.fori_loop(lo, n_q, lambda i, c: query_block(g, i, *c), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkdv(q, k, v, dout, lse, delta, offset, cfg: _Cfg):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    q_spec = pl.BlockSpec((None, sq, group, d), lambda b_, h, j: (b_, 0, h, 0))
    row_spec = pl.BlockSpec((None, group, sq), lambda b_, h, j: (b_, h, 0))
    kv_spec = pl.BlockSpec((None, cfg.bk_bwd, None, d), lambda b_, h, j: (b_, j, h, 0))
    return kp.call(
        functools.partial(_dkdv_kernel, cfg=cfg, group=group), backend=cfg.backend,
        name="autopar_attn_dkdv",
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(b, hkv, sk // cfg.bk_bwd),
        in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), q_spec, kv_spec, kv_spec, q_spec,
                  row_spec, row_spec],
        out_specs=(kv_spec, kv_spec), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )(offset, q, k, v, dout, lse, delta)


# ---- reference --------------------------------------------------------------------------------
def attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None,
                        q_offset: jax.Array | int = 0, return_lse: bool = False):
    """The same attention in plain jnp (scores materialised), float32 softmax."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(b, sq, hkv, hq // hkv, d)                                  # (B, Sq, Hkv, G, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if causal:
        q_pos = jnp.arange(sq)[:, None] + q_offset
        s = jnp.where(jnp.arange(sk)[None, :] <= q_pos, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)                                        # (B, Hkv, G, Sq)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32).reshape(b, sq, hq, d).astype(q.dtype)
    return (out, lse.reshape(b, hq, sq)) if return_lse else out
