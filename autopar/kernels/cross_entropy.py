"""Softmax cross-entropy fused with the LM-head matmul: the (tokens x vocabulary) logits are
never stored whole.

Shapes: N tokens (leading dims flattened), D model width, V vocabulary (V_local on a vocabulary
shard), bn/bv/bd the row, vocabulary and width blocks, C the backward's vocabulary chunk.
``h (N, D)``, ``w (D, V)``, ``targets (N,)`` int; the result is each token's loss
``lse_i - logit_i[target_i]`` in float32 (reduce it as the step does, e.g. ``.mean()``).

Forward, one Pallas kernel, one program per row block: it walks the vocabulary in ``bv``
columns, computes each logits tile ``h_blk @ w[:, cols]`` on chip (a K loop over ``bd``-wide
slices of ``D``), and keeps the running max ``m``, the running ``s = sum exp(logit - m)`` and the
target's logit. Memory: O(N) instead of O(N V).

Vocabulary-parallel form (``vocab_axis``, inside ``shard_map`` over a vocabulary-split head):
each shard runs the kernel on its ``V_local`` columns (targets offset by the shard's first
column), then two all-reduces combine them: ``M = pmax(m)``, then one ``psum`` of the pair
``(s exp(m - M), target logit)``; ``lse = M + log(sum)``.

Backward, chunked over the vocabulary (chunks of ``C`` columns, so at most N x C logit
gradients exist at a time): a Pallas kernel recomputes each chunk's logits tile by tile and
writes ``g = (exp(logit - lse) - onehot(target)) * dloss`` in the input dtype; XLA's matmuls
then add ``g @ w_c^T`` into ``dh`` and write ``h^T @ g`` into ``dw[:, c]``. Cost: one extra
logits matmul (recompute) over the unfused step, O(N C) memory. On a vocabulary shard ``dloss``
is all-reduced first (it arrives split across shards by ``shard_map``'s transpose convention),
``dh`` is left partial for ``shard_map`` to sum over the vocabulary axis, ``dw`` is local.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from autopar.errors import AutoparError
from autopar.kernels import _pallas as kp


@dataclasses.dataclass(frozen=True)
class XentBlocks:
    """Tile sizes (powers of two, clamped to the problem) and the backward's vocabulary chunk."""

    block_rows: int = 64
    block_vocab: int = 128
    block_width: int = 128
    chunk_vocab: int = 8192
    num_warps: int | None = None
    num_stages: int = 2


DEFAULT_BLOCKS = XentBlocks()


@dataclasses.dataclass(frozen=True)
class _Cfg:
    vocab: int            # unpadded columns of w (this shard's)
    bn: int
    bv: int
    bd: int
    chunk: int            # backward chunk, a multiple of bv
    axis: str | tuple[str, ...] | None
    backend: str
    num_warps: int | None
    num_stages: int


def lm_head_cross_entropy(h, w, targets, *, vocab_axis: str | tuple[str, ...] | None = None,
                          blocks: XentBlocks = DEFAULT_BLOCKS, backend: str | None = None):
    """Per-token softmax cross-entropy of the logits ``h @ w`` without materialising them.

    Args:
      h: ``(..., D)`` hidden states.
      w: ``(D, V)`` LM-head weight (``(D, V_local)`` when ``vocab_axis`` is given).
      targets: ``(...)`` integer ids in ``[0, V)`` (global ids on a vocabulary shard).
      vocab_axis: mesh axis (or axes) the vocabulary is split over; only inside
        ``shard_map(..., check_vma=False)`` (see ``autopar.kernels.sharded``).
      blocks: tile sizes.
      backend: see ``autopar.kernels._pallas``.

    Returns:
      ``(...)`` float32 losses. Differentiable in ``h`` and ``w``.
    """
    _check(h, w, targets)
    return _xent(h, w, targets, _Static(vocab_axis, blocks, backend))


def xent_fwd(h, w, targets, *, vocab_axis: str | tuple[str, ...] | None = None,
             blocks: XentBlocks = DEFAULT_BLOCKS, backend: str | None = None):
    """The forward kernel (and, on a vocabulary shard, the two all-reduces) alone:
    ``(loss, lse)``, both shaped like ``targets``; ``lse`` is what ``xent_bwd`` reads."""
    _check(h, w, targets)
    cfg, hp, wp, tp = _layout(h, w, targets, vocab_axis, blocks, backend)
    loss, lse = _loss_and_lse(hp, wp, tp, cfg)
    n = targets.size
    return loss[:n].reshape(targets.shape), lse[:n].reshape(targets.shape)


def xent_bwd(h, w, targets, lse, dloss, *, vocab_axis: str | tuple[str, ...] | None = None,
             blocks: XentBlocks = DEFAULT_BLOCKS, backend: str | None = None):
    """The backward alone: ``(dh, dw)`` from the forward's ``lse`` and the per-token cotangent
    ``dloss``. On a vocabulary shard ``dh`` is this shard's partial sum (see the module
    docstring for who sums it)."""
    cfg, hp, wp, tp = _layout(h, w, targets, vocab_axis, blocks, backend)
    n, (d, v) = targets.size, w.shape
    rows = (lambda a: kp.pad_to(a.reshape(n).astype(jnp.float32), 0, hp.shape[0]))
    dh, dw = _backward(hp, wp, tp, rows(lse), rows(dloss), cfg)
    return dh[:n, :d].reshape(h.shape), dw[:d, :v]


def _layout(h, w, targets, vocab_axis, blocks: XentBlocks, backend):
    """The kernel config and the padded ``(N', D')``, ``(D', V')``, ``(N',)`` operands."""
    d, v = w.shape
    n = targets.size
    bn, bv, bd = (kp.block(n, blocks.block_rows), kp.block(v, blocks.block_vocab),
                  kp.block(d, blocks.block_width))
    chunk = kp.round_up(min(blocks.chunk_vocab, kp.round_up(v, bv)), bv)
    cfg = _Cfg(v, bn, bv, bd, chunk, vocab_axis, kp.resolve_backend(backend), blocks.num_warps,
               blocks.num_stages)
    n_p, d_p, v_p = kp.round_up(n, bn), kp.round_up(d, bd), kp.round_up(v, bv)
    hp = kp.pad_to(kp.pad_to(h.reshape(n, d), 0, n_p), 1, d_p)          # (N', D')
    wp = kp.pad_to(kp.pad_to(w, 0, d_p), 1, v_p)                          # (D', V')
    tp = kp.pad_to(targets.reshape(n).astype(jnp.int32), 0, n_p, value=-1)
    return cfg, hp, wp, tp


def _check(h, w, targets) -> None:
    if w.ndim != 2 or h.ndim < 1 or h.shape[-1] != w.shape[0] or h.shape[:-1] != targets.shape:
        raise AutoparError(
            f"lm_head_cross_entropy takes h (..., D), w (D, V) and targets (...); got "
            f"h{tuple(h.shape)}, w{tuple(w.shape)}, targets{tuple(targets.shape)}: the last dim "
            f"of h must equal w's first and targets must have h's leading shape")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise AutoparError(f"lm_head_cross_entropy: targets have dtype {targets.dtype}; pass "
                           f"integer token ids")


def _offset(cfg: _Cfg):
    """First global vocabulary id of this shard (0 when the vocabulary is whole)."""
    if cfg.axis is None:
        return kp.scalar_array(0)
    return kp.scalar_array(lax.axis_index(cfg.axis) * cfg.vocab)


def _loss_and_lse(h, w, targets, cfg: _Cfg):
    m, s, tgt = _stats(h, w, targets, _offset(cfg), cfg)
    if cfg.axis is not None:                                  # the two all-reduces
        m_all = lax.pmax(m, cfg.axis)
        s, tgt = lax.psum(jnp.stack([s * jnp.exp(m - m_all), tgt]), cfg.axis)
        m = m_all
    lse = m + jnp.log(s)
    return lse - tgt, lse


def _backward(h, w, targets, lse, dloss, cfg: _Cfg):
    """Padded operands in, padded ``(dh, dw)`` out; see the module docstring."""
    if cfg.axis is not None:
        dloss = lax.psum(dloss, cfg.axis)
    offset = _offset(cfg)
    dh = jnp.zeros(h.shape, jnp.float32)
    dws = []
    for start in range(0, w.shape[1], cfg.chunk):             # static chunks: bounded memory
        w_c = w[:, start:start + cfg.chunk]                   # (D', C)
        g = _grad_logits(h, w_c, targets, lse, dloss, offset + start, start, cfg)  # (N', C)
        dh = dh + kp.mm(g, w_c, trans_b=True)
        dws.append(kp.mm(h, g, trans_a=True).astype(w.dtype))
    return dh.astype(h.dtype), jnp.concatenate(dws, axis=1)


# ---- the custom VJP: the two halves above ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    vocab_axis: str | tuple[str, ...] | None
    blocks: XentBlocks
    backend: str | None

    def kwargs(self) -> dict:
        return {"vocab_axis": self.vocab_axis, "blocks": self.blocks, "backend": self.backend}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _xent(h, w, targets, static: _Static):
    return xent_fwd(h, w, targets, **static.kwargs())[0]


def _xent_fwd(h, w, targets, static: _Static):
    loss, lse = xent_fwd(h, w, targets, **static.kwargs())
    return loss, (h, w, targets, lse)


def _xent_bwd(static: _Static, res, dloss):
    h, w, targets, lse = res
    dh, dw = xent_bwd(h, w, targets, lse, dloss, **static.kwargs())
    return dh, dw, None


_xent.defvjp(_xent_fwd, _xent_bwd)


# ---- kernels ----------------------------------------------------------------------------------
def _logits_tile(h_ref, w_ref, col0, cfg: _Cfg):
    """``h_blk @ w[:, col0:col0+bv]`` in float32, a K loop over ``bd`` slices of the width."""
    def k_step(kk, acc):
        hk = h_ref[:, pl.ds(kk * cfg.bd, cfg.bd)]                     # (bn, bd)
        wk = w_ref[pl.ds(kk * cfg.bd, cfg.bd), pl.ds(col0, cfg.bv)]   # (bd, bv)
        return acc + kp.mm(hk, wk)

    n_k = h_ref.shape[1] // cfg.bd
    return lax.fori_loop(0, n_k, k_step, jnp.zeros((cfg.bn, cfg.bv), jnp.float32))


def _stats_kernel(off_ref, h_ref, w_ref, t_ref, m_ref, s_ref, tgt_ref, *, cfg: _Cfg):
    local = t_ref[...] - off_ref[0]                           # (bn,) target column here

    def vocab_block(c, carry):
        m, s, tgt = carry
        cols = c * cfg.bv + lax.broadcasted_iota(jnp.int32, (cfg.bn, cfg.bv), 1)
        logits = jnp.where(cols < cfg.vocab, _logits_tile(h_ref, w_ref, c * cfg.bv, cfg),
                           kp.NEG_INF)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols == local[:, None], logits, 0.), axis=1)
        return m_new, s, tgt

    zeros = jnp.zeros((cfg.bn,), jnp.float32)
    m, s, tgt = lax.fori_loop(0, w_ref.shape[1] // cfg.bv, vocab_block,
                              (zeros + kp.NEG_INF, zeros, zeros))
    m_ref[...], s_ref[...], tgt_ref[...] = m, s, tgt


def _stats(h, w, targets, offset, cfg: _Cfg):
    n, d = h.shape
    row = pl.BlockSpec((cfg.bn,), lambda i: (i,))
    out = jax.ShapeDtypeStruct((n,), jnp.float32)
    return kp.call(
        functools.partial(_stats_kernel, cfg=cfg), backend=cfg.backend, name="autopar_xent_fwd",
        grid=(n // cfg.bn,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((cfg.bn, d), lambda i: (i, 0)),
                  pl.BlockSpec(w.shape, lambda i: (0, 0)), row],
        out_specs=(row, row, row), out_shape=(out, out, out), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)(offset, h, w, targets)


def _grad_kernel(off_ref, h_ref, w_ref, t_ref, lse_ref, dl_ref, g_ref, *, cfg: _Cfg, start: int):
    cols = pl.program_id(1) * cfg.bv + lax.broadcasted_iota(jnp.int32, (cfg.bn, cfg.bv), 1)
    p = jnp.exp(_logits_tile(h_ref, w_ref, 0, cfg) - lse_ref[...][:, None])    # (bn, bv)
    onehot = jnp.where(cols == (t_ref[...] - off_ref[0])[:, None], 1., 0.)
    g = (p - onehot) * dl_ref[...][:, None]
    # Padded columns (past this shard's vocabulary) must not leak probability mass.
    g_ref[...] = jnp.where(start + cols < cfg.vocab, g, 0.).astype(g_ref.dtype)


def _grad_logits(h, w_c, targets, lse, dloss, offset, start: int, cfg: _Cfg):
    n, d = h.shape
    c = w_c.shape[1]
    row = pl.BlockSpec((cfg.bn,), lambda i, j: (i,))
    return kp.call(
        functools.partial(_grad_kernel, cfg=cfg, start=start), backend=cfg.backend,
        name="autopar_xent_bwd",
        grid=(n // cfg.bn, c // cfg.bv),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                  pl.BlockSpec((cfg.bn, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((d, cfg.bv), lambda i, j: (0, j)), row, row, row],
        out_specs=pl.BlockSpec((cfg.bn, cfg.bv), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, c), h.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)(offset, h, w_c, targets, lse, dloss)


# ---- reference --------------------------------------------------------------------------------
def cross_entropy_reference(h, w, targets):
    """Unfused: full float32 logits, ``logsumexp - target logit`` per token."""
    logits = jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
