"""``shard_map`` wrappers: each kernel on a mesh, with per-shard specs.

A Pallas kernel does not partition itself, so each wrapper runs it once per device inside
``jax.shard_map(..., check_vma=False)`` on the local blocks its specs name. An ``Axes`` value is
a mesh axis name, a tuple of names (split over their product, major to minor) or ``None``
(whole). Arrays are passed and returned with their global shapes, laid out as the specs say.

  kernel          accepted splits (per-shard spec)                     collectives added
  attention       batch, heads (query and key/value heads alike),      with ``seq``: all-gather of
                  seq (queries split; keys/values gathered)            k, v (reduce-scatter of
                                                                       dk, dv in the backward)
  norm            rows: one ``Axes`` per leading dim (batch, seq)      none (scale/bias grads
                                                                       summed over the row axes)
  cross-entropy   rows (per leading dim), vocab (the head's columns)   pmax + psum over vocab
                                                                       (forward), psum of dloss
  adamw           any PartitionSpec of the parameter (elementwise)     none

The normalised width, the model width and the head width are never split by these wrappers:
a kernel that needed them whole would see a slice and compute something else.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar.errors import ShardingError
from autopar.kernels import adamw as adamw_mod
from autopar.kernels import cross_entropy as xent_mod
from autopar.kernels import flash_attention as attn_mod
from autopar.kernels.norms import layer_norm, rms_norm

Axes = str | tuple[str, ...] | None


def attention_sharded(q, k, v, *, mesh: Mesh, batch: Axes = None, heads: Axes = None,
                      seq: Axes = None, causal: bool = True, scale: float | None = None,
                      blocks: attn_mod.AttentionBlocks = attn_mod.DEFAULT_BLOCKS,
                      backend: str | None = None):
    """``attention`` on ``mesh``: q ``(B, S, Hq, D)``, k/v ``(B, S, Hkv, D)`` split as named.

    With ``seq`` each device holds a slice of the queries and of the keys/values; it gathers
    the keys/values and masks causally at its slice's global position.
    """
    _check_axes(mesh, {"batch": batch, "heads": heads, "seq": seq})
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_divisible(mesh, name, x.shape, (batch, seq, heads, None))
    spec = P(batch, seq, heads, None)

    def body(q_, k_, v_):
        k_, v_, offset = gather_kv(k_, v_, seq, q_.shape[1])
        return attn_mod.attention(q_, k_, v_, causal=causal, scale=scale, q_offset=offset,
                                  blocks=blocks, backend=backend)

    return smap(body, mesh, (spec, spec, spec), spec)(q, k, v)


def norm_sharded(kind: str, x, scale, bias=None, residual=None, *, mesh: Mesh,
                 rows: Sequence[Axes] = (), eps: float = 1e-6, backend: str | None = None):
    """``layer_norm`` (``kind="layer"``) or ``rms_norm`` (``"rms"``) with the leading dims of
    ``x (..., D)`` split by ``rows`` (one entry per leading dim, missing ones whole)."""
    lead = lead_axes(rows, x.ndim - 1)
    _check_axes(mesh, dict(enumerate(lead)))
    _check_divisible(mesh, "x", x.shape, lead + (None,))
    act, vec = P(*lead, None), P(None)

    def body(x_, s_, b_, r_):
        if kind == "layer":
            return layer_norm(x_, s_, b_, r_, eps=eps, backend=backend)
        return rms_norm(x_, s_, r_, eps=eps, backend=backend)

    out = act if residual is None else (act, act)
    in_specs = (act, vec, None if bias is None else vec, None if residual is None else act)
    return smap(body, mesh, in_specs, out)(x, scale, bias, residual)


def lm_head_cross_entropy_sharded(h, w, targets, *, mesh: Mesh, rows: Sequence[Axes] = (),
                                  vocab: Axes = None,
                                  blocks: xent_mod.XentBlocks = xent_mod.DEFAULT_BLOCKS,
                                  backend: str | None = None):
    """Per-token LM-head cross-entropy with the token dims split by ``rows`` and the head's
    vocabulary columns by ``vocab`` (the vocabulary-parallel form)."""
    lead = lead_axes(rows, targets.ndim)
    _check_axes(mesh, {**dict(enumerate(lead)), "vocab": vocab})
    _check_divisible(mesh, "h", h.shape, lead + (None,))
    _check_divisible(mesh, "w", w.shape, (None, vocab))

    def body(h_, w_, t_):
        return xent_mod.lm_head_cross_entropy(h_, w_, t_, vocab_axis=vocab, blocks=blocks,
                                              backend=backend)

    in_specs = (P(*lead, None), P(None, vocab), P(*lead))
    return smap(body, mesh, in_specs, P(*lead))(h, w, targets)


def adamw_sharded(p, g, mu, nu, *, mesh: Mesh, spec: P, lr, bc1, bc2,
                  hyper: adamw_mod.AdamWHyper = adamw_mod.DEFAULT_HYPER,
                  backend: str | None = None):
    """``adamw_update`` with all four tensors laid out by ``spec`` (scalars replicated)."""
    entries = tuple(spec) + (None,) * (p.ndim - len(spec))
    _check_axes(mesh, dict(enumerate(entries)))
    _check_divisible(mesh, "p", p.shape, entries)

    def body(p_, g_, mu_, nu_, lr_, bc1_, bc2_):
        return adamw_mod.adamw_update(p_, g_, mu_, nu_, lr=lr_, bc1=bc1_, bc2=bc2_, hyper=hyper,
                                      backend=backend)

    return smap(body, mesh, (spec,) * 4 + (P(),) * 3, (spec,) * 3)(p, g, mu, nu, lr, bc1, bc2)


# ---- shared by these wrappers and ``halves`` --------------------------------------------------
def smap(body, mesh: Mesh, in_specs, out_specs):
    """``shard_map`` as every kernel wrapper runs it (Pallas calls carry no varying-axis info)."""
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def lead_axes(rows: Sequence[Axes], ndim: int) -> tuple[Axes, ...]:
    """One entry per leading dim: the given row splits, the rest whole."""
    return tuple(rows) + (None,) * (ndim - len(rows))


def gather_kv(k_, v_, seq: Axes, rows_here: int):
    """Keys/values of the whole sequence and this shard's first query position."""
    if seq is None:
        return k_, v_, 0
    k_ = lax.all_gather(k_, seq, axis=1, tiled=True)
    v_ = lax.all_gather(v_, seq, axis=1, tiled=True)
    return k_, v_, lax.axis_index(seq) * rows_here


# ---- validation -------------------------------------------------------------------------------
def _names(axes: Axes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _check_axes(mesh: Mesh, by_role: dict) -> None:
    """Every named axis is on the mesh, and no axis splits two dims."""
    seen: dict[str, object] = {}
    for role, axes in by_role.items():
        for name in _names(axes):
            if name not in mesh.shape:
                raise ShardingError(f"kernel spec {role}={axes!r} names mesh axis {name!r}, but "
                                    f"the mesh has axes {dict(mesh.shape)}; use one of those")
            if name in seen:
                raise ShardingError(f"mesh axis {name!r} is given to both {seen[name]!r} and "
                                    f"{role!r}; an axis can split only one dim")
            seen[name] = role


def _check_divisible(mesh: Mesh, arg: str, shape, entries) -> None:
    for dim, (size, axes) in enumerate(zip(shape, entries)):
        n = math.prod(mesh.shape[a] for a in _names(axes))
        if size % n:
            raise ShardingError(
                f"kernel argument {arg}{tuple(shape)}: dim {dim} of size {size} is not divisible "
                f"by mesh axes {_names(axes)} of total size {n}; pad the dim to a multiple of "
                f"{n} or split it over fewer devices")
