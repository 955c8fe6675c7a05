"""``shard_map`` wrappers of the kernels' forward and backward halves, for codegen.

Codegen replaces a matched forward region and its backward region separately (the traced step
holds them as separate ops), so it calls each half on its own, with the residuals the forward
returned handed to the backward. ``sharded`` wraps the differentiable kernels; this module wraps
the halves with the same per-shard specs (``Axes``: a mesh axis, a tuple of axes, or ``None``):

  half            splits                         residuals (spec)          collectives inside
  attention_fwd   batch, seq, heads (masks: rows lse (batch, heads, seq)   seq: all-gather k, v
                  like q, keys whole)
  attention_bwd   batch, seq, heads              -                         seq: all-gather k, v,
                                                                           reduce-scatter dk, dv
  norm_fwd        rows (one per leading dim)     h, mean, rstd (rows)      none
  norm_bwd        rows                           -                         psum dscale, dbias
                                                                           over the row axes
  xent_fwd        rows, vocab                    lse (rows)                pmax + psum (vocab)
  xent_bwd        rows, vocab                    -                         psum dloss (vocab),
                                                                           dh (vocab), dw (rows)

Arguments and results have their global shapes, laid out as the specs say. The backward of a
vocabulary-parallel cross-entropy sees ``dloss`` whole on every vocabulary shard (it is not
the transpose of a ``shard_map``, where it would arrive split), so it is divided by the
number of shards before the kernel's own all-reduce.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar.kernels import cross_entropy as xent_mod
from autopar.kernels import flash_attention as attn_mod
from autopar.kernels import norms as norm_mod
from autopar.kernels.sharded import (
    Axes,
    _check_axes,
    _check_divisible,
    _names,
    gather_kv,
    lead_axes,
    smap,
)


def _size(mesh: Mesh, axes: Axes) -> int:
    return math.prod(mesh.shape[a] for a in _names(axes))


def _row_axes(rows: Sequence[Axes]) -> tuple[str, ...]:
    return tuple(a for r in rows for a in _names(r))


# ---- attention --------------------------------------------------------------------------------
def _attn_check(mesh, q, k, batch, heads, seq):
    _check_axes(mesh, {"batch": batch, "heads": heads, "seq": seq})
    for name, x in (("q", q), ("k", k)):
        _check_divisible(mesh, name, x.shape, (batch, seq, heads, None))


def _mask_args(masks: attn_mod.Masks, q, k, batch: Axes, heads: Axes, seq: Axes):
    """The masks' arrays, their sequence dims broadcast, and their specs: rows split like the
    queries, keys whole, a broadcast batch or head dim whole."""
    arrays, specs = [], []
    for x in (masks.bias, masks.keep):
        if x is None:
            continue
        arrays.append(jnp.broadcast_to(x, x.shape[:2] + (q.shape[1], k.shape[1])))
        specs.append(P(batch if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None,
                       seq, None))
    return arrays, specs


def _masks_of(masks: attn_mod.Masks, arrays) -> attn_mod.Masks:
    """``masks`` with the per-shard arrays in place of the global ones."""
    it = iter(arrays)
    return attn_mod.Masks(next(it) if masks.bias is not None else None,
                          next(it) if masks.keep is not None else None, masks.fill)


def attention_fwd_sharded(q, k, v, *, mesh: Mesh, batch: Axes = None, heads: Axes = None,
                          seq: Axes = None, causal: bool = True, scale: float | None = None,
                          blocks: attn_mod.AttentionBlocks = attn_mod.DEFAULT_BLOCKS,
                          backend: str | None = None,
                          masks: attn_mod.Masks = attn_mod.NO_MASKS):
    """``attention_fwd`` on ``mesh``: ``(out, lse)``; q ``(B, S, Hq, D)``, k, v ``(B, S, Hkv,
    D)``, masks ``(1 or B, 1 or Hq, Sq, Sk)``."""
    _attn_check(mesh, q, k, batch, heads, seq)
    spec = P(batch, seq, heads, None)
    arrays, m_specs = _mask_args(masks, q, k, batch, heads, seq)

    def body(q_, k_, v_, *m_):
        k_, v_, offset = gather_kv(k_, v_, seq, q_.shape[1])
        return attn_mod.attention_fwd(q_, k_, v_, causal=causal, scale=scale, q_offset=offset,
                                      blocks=blocks, backend=backend, masks=_masks_of(masks, m_))

    return smap(body, mesh, (spec,) * 3 + tuple(m_specs), (spec, P(batch, heads, seq)))(
        q, k, v, *arrays)


def attention_bwd_sharded(q, k, v, out, lse, dout, *, mesh: Mesh, batch: Axes = None,
                          heads: Axes = None, seq: Axes = None, causal: bool = True,
                          scale: float | None = None,
                          blocks: attn_mod.AttentionBlocks = attn_mod.DEFAULT_BLOCKS,
                          backend: str | None = None,
                          masks: attn_mod.Masks = attn_mod.NO_MASKS):
    """``attention_bwd`` on ``mesh``: ``(dq, dk, dv)`` laid out like ``q, k, v``."""
    _attn_check(mesh, q, k, batch, heads, seq)
    spec = P(batch, seq, heads, None)
    arrays, m_specs = _mask_args(masks, q, k, batch, heads, seq)

    def body(q_, k_, v_, o_, l_, do_, *m_):
        kf, vf, offset = gather_kv(k_, v_, seq, q_.shape[1])
        dq, dk, dv = attn_mod.attention_bwd(q_, kf, vf, o_, l_, do_, causal=causal, scale=scale,
                                            q_offset=offset, blocks=blocks, backend=backend,
                                            masks=_masks_of(masks, m_))
        if seq is not None:   # every query shard adds to every key: sum, keep this shard's keys
            dk = lax.psum_scatter(dk, seq, scatter_dimension=1, tiled=True)
            dv = lax.psum_scatter(dv, seq, scatter_dimension=1, tiled=True)
        return dq, dk, dv

    in_specs = (spec,) * 4 + (P(batch, heads, seq), spec) + tuple(m_specs)
    return smap(body, mesh, in_specs, (spec,) * 3)(q, k, v, out, lse, dout, *arrays)


# ---- norms ------------------------------------------------------------------------------------
def norm_fwd_sharded(kind: str, x, scale, bias=None, residual=None, *, mesh: Mesh,
                     rows: Sequence[Axes] = (), eps: float = 1e-6, backend: str | None = None):
    """``norm_fwd`` on ``mesh``: ``(y, h, mean, rstd)``, the leading dims of ``x`` split by
    ``rows`` (the normalised width whole)."""
    lead = lead_axes(rows, x.ndim - 1)
    _check_axes(mesh, dict(enumerate(lead)))
    _check_divisible(mesh, "x", x.shape, lead + (None,))
    act, stat, vec = P(*lead, None), P(*lead), P(None)

    def body(x_, s_, b_, r_):
        return norm_mod.norm_fwd(kind, x_, s_, b_, r_, eps=eps, backend=backend)

    in_specs = (act, vec, None if bias is None else vec, None if residual is None else act)
    return smap(body, mesh, in_specs, (act, act, stat, stat))(x, scale, bias, residual)


def norm_bwd_sharded(kind: str, h, scale, mean, rstd, dy, dh=None, *, mesh: Mesh,
                     rows: Sequence[Axes] = (), bias: bool = False, eps: float = 1e-6,
                     backend: str | None = None):
    """``norm_bwd`` on ``mesh``: ``(dx, dscale, dbias)``; the parameter gradients are summed
    over the row axes (``dbias`` is ``None`` without a bias)."""
    lead = lead_axes(rows, h.ndim - 1)
    _check_axes(mesh, dict(enumerate(lead)))
    act, stat, vec = P(*lead, None), P(*lead), P(None)
    axes = _row_axes(rows)

    def body(h_, s_, m_, r_, dy_, dh_):
        dx, ds, db = norm_mod.norm_bwd(kind, h_, s_, m_, r_, dy_, dh_, bias=bias, eps=eps,
                                       backend=backend)
        if axes:
            ds = lax.psum(ds, axes)
            db = lax.psum(db, axes) if bias else None
        return dx, ds, db

    in_specs = (act, vec, stat, stat, act, None if dh is None else act)
    out_specs = (act, vec, vec if bias else None)
    return smap(body, mesh, in_specs, out_specs)(h, scale, mean, rstd, dy, dh)


# ---- LM-head cross-entropy --------------------------------------------------------------------
def xent_fwd_sharded(h, w, targets, *, mesh: Mesh, rows: Sequence[Axes] = (), vocab: Axes = None,
                     blocks: xent_mod.XentBlocks = xent_mod.DEFAULT_BLOCKS,
                     backend: str | None = None):
    """``xent_fwd`` on ``mesh``: ``(loss, lse)`` per token, the vocabulary-parallel form when
    ``vocab`` splits the head's columns."""
    lead = lead_axes(rows, targets.ndim)
    _check_axes(mesh, {**dict(enumerate(lead)), "vocab": vocab})
    _check_divisible(mesh, "h", h.shape, lead + (None,))
    _check_divisible(mesh, "w", w.shape, (None, vocab))

    def body(h_, w_, t_):
        return xent_mod.xent_fwd(h_, w_, t_, vocab_axis=vocab, blocks=blocks, backend=backend)

    tok = P(*lead)
    return smap(body, mesh, (P(*lead, None), P(None, vocab), tok), (tok, tok))(h, w, targets)


def xent_bwd_sharded(h, w, targets, lse, dloss, *, mesh: Mesh, rows: Sequence[Axes] = (),
                     vocab: Axes = None, blocks: xent_mod.XentBlocks = xent_mod.DEFAULT_BLOCKS,
                     backend: str | None = None):
    """``xent_bwd`` on ``mesh``: ``(dh, dw)`` laid out like ``h`` and ``w``."""
    lead = lead_axes(rows, targets.ndim)
    _check_axes(mesh, {**dict(enumerate(lead)), "vocab": vocab})
    shards, axes = _size(mesh, vocab), _row_axes(rows)

    def body(h_, w_, t_, l_, dl_):
        dl_ = dl_ / shards if vocab is not None else dl_
        dh, dw = xent_mod.xent_bwd(h_, w_, t_, l_, dl_, vocab_axis=vocab, blocks=blocks,
                                   backend=backend)
        if vocab is not None:
            dh = lax.psum(dh, vocab)
        return dh, lax.psum(dw, axes) if axes else dw

    tok = P(*lead)
    in_specs = (P(*lead, None), P(None, vocab), tok, tok, tok)
    return smap(body, mesh, in_specs, (P(*lead, None), P(None, vocab)))(h, w, targets, lse,
                                                                          dloss)
