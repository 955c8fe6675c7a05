"""LayerNorm and RMSNorm fused with the residual add, forward and backward, one pass each.

Shapes: N rows (every leading dim flattened: batch x sequence), D the normalised width,
br rows per program. With a residual ``r`` the kernel computes ``h = x + r`` (in ``x``'s dtype,
as the unfused step rounds it) and ``y = norm(h)``, and returns both: ``h`` is the residual
stream the next block adds to, ``y`` feeds the next matmul. Without one, ``h = x`` and only
``y`` is returned.

  LayerNorm: ``y = (h - mean) * rstd * scale + bias``, ``rstd = 1/sqrt(var + eps)``.
  RMSNorm:   ``y = h * rstd * scale``, ``rstd = 1/sqrt(mean(h^2) + eps)``.

Forward saves ``mean`` and ``rstd`` per row (float32). Backward, with ``xhat = (h - mean)
rstd`` and ``g = dy * scale``: ``dh_total = dh + rstd (g - mean(g) - xhat mean(g xhat))``
(RMSNorm drops the ``mean(g)`` term); both ``x`` and ``r`` receive ``dh_total``. The parameter
gradients ``sum_rows(dy xhat)`` and ``sum_rows(dy)`` come out as one partial row per program,
summed by XLA. A width that is not a power of two is padded and masked.
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

KINDS = ("layer", "rms")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    kind: str
    eps: float
    width: int          # unpadded D
    block_rows: int
    has_residual: bool
    has_bias: bool
    backend: str
    num_warps: int | None


def layer_norm(x, scale, bias=None, residual=None, *, eps: float = 1e-6, block_rows: int = 16,
               backend: str | None = None):
    """LayerNorm over the last dim, fused with ``h = x + residual`` when one is given.

    Args:
      x: ``(..., D)``.
      scale, bias: ``(D,)``; ``bias`` may be ``None``.
      residual: ``None`` or the same shape as ``x``.
      eps: added to the variance.
      block_rows: rows per program (a power of two).
      backend: see ``autopar.kernels._pallas``.

    Returns:
      ``y`` (``x``'s shape and dtype), or ``(y, h)`` when ``residual`` is given.
    """
    return _apply("layer", x, scale, bias, residual, eps, block_rows, backend)


def rms_norm(x, scale, residual=None, *, eps: float = 1e-6, block_rows: int = 16,
             backend: str | None = None):
    """RMSNorm over the last dim (no mean, no bias), fused with the residual add; see
    ``layer_norm``."""
    return _apply("rms", x, scale, None, residual, eps, block_rows, backend)


def _apply(kind, x, scale, bias, residual, eps, block_rows, backend):
    static = _Static(kind, float(eps), block_rows, backend, bias is not None,
                     residual is not None)
    y, h = _norm(x, residual, scale, bias, static)
    return y if residual is None else (y, h)


def norm_fwd(kind: str, x, scale, bias=None, residual=None, *, eps: float = 1e-6,
             block_rows: int = 16, backend: str | None = None):
    """The forward kernel alone: ``(y, h, mean, rstd)``; ``h = x + residual`` (``x`` without
    one), ``mean`` and ``rstd`` of shape ``x.shape[:-1]`` (float32, ``mean`` zero for RMSNorm):
    the residuals ``norm_bwd`` reads."""
    _check(kind, x, scale, bias, residual)
    cfg, rows, vec, unrows = _layout(kind, x, eps, block_rows, backend, residual is not None,
                                     bias is not None)
    y, h, mean, rstd = _forward(rows(x), None if residual is None else rows(residual),
                                vec(scale), vec(bias), cfg)
    lead, n = x.shape[:-1], x.size // x.shape[-1]
    h = x if residual is None else unrows(h)
    return unrows(y), h, mean[:n].reshape(lead), rstd[:n].reshape(lead)


def norm_bwd(kind: str, h, scale, mean, rstd, dy, dh=None, *, bias: bool = False,
             eps: float = 1e-6, block_rows: int = 16, backend: str | None = None):
    """The backward kernel alone: ``(dx, dscale, dbias)`` (``dbias`` ``None`` without a bias)
    from the forward's ``h``, ``mean``, ``rstd`` and the cotangents ``dy`` of ``y`` and ``dh``
    of ``h`` (the residual stream's, if any); ``dx`` is also the residual's gradient."""
    cfg, rows, vec, unrows = _layout(kind, h, eps, block_rows, backend, dh is not None, bias)
    n = h.size // h.shape[-1]
    stat = (lambda a: kp.pad_to(a.reshape(n), 0, kp.round_up(n, cfg.block_rows)))
    dx, dscale, dbias = _backward(rows(h), vec(scale), stat(mean), stat(rstd), rows(dy),
                                  None if dh is None else rows(dh), cfg)
    d = h.shape[-1]
    return (unrows(dx), dscale[0, :d].astype(scale.dtype),
            dbias[0, :d].astype(scale.dtype) if bias else None)


def _layout(kind, x, eps, block_rows, backend, residual: bool, bias: bool):
    """The kernel config and the (..., D) <-> padded (N', D') conversions."""
    d = x.shape[-1]
    n = x.size // d
    cfg = _Cfg(kind, float(eps), d, kp.block(n, block_rows), residual, bias,
               kp.resolve_backend(backend), None)
    n_p, d_p = kp.round_up(n, cfg.block_rows), kp.next_pow2(d)

    def rows(a):                                               # (..., D) -> (N', D')
        return kp.pad_to(kp.pad_to(a.reshape(n, d), 0, n_p), 1, d_p)

    def vec(a):                                                # (D,) -> (1, D')
        return None if a is None else kp.pad_to(a.reshape(1, d), 1, d_p)

    def unrows(a):
        return a[:n, :d].reshape(x.shape)

    return cfg, rows, vec, unrows


def _check(kind, x, scale, bias, residual) -> None:
    d = x.shape[-1] if x.ndim else 0
    if kind not in KINDS:
        raise AutoparError(f"norm kind={kind!r} is not one of {KINDS}")
    if x.ndim < 1 or scale.shape != (d,) or (bias is not None and bias.shape != (d,)):
        raise AutoparError(
            f"{kind}_norm normalises the last dim of x{tuple(x.shape)}: scale and bias must have "
            f"shape ({d},); got scale{tuple(scale.shape)}"
            + ("" if bias is None else f", bias{tuple(bias.shape)}"))
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise AutoparError(
            f"{kind}_norm: residual {residual.dtype}{tuple(residual.shape)} must match x "
            f"{x.dtype}{tuple(x.shape)}; cast or broadcast it first")


# ---- the custom VJP: the two halves above ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    kind: str
    eps: float
    block_rows: int
    backend: str | None
    bias: bool
    residual: bool

    def kwargs(self) -> dict:
        return {"eps": self.eps, "block_rows": self.block_rows, "backend": self.backend}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm(x, r, scale, bias, static: _Static):
    y, h, _, _ = norm_fwd(static.kind, x, scale, bias, r, **static.kwargs())
    return y, h


def _norm_fwd(x, r, scale, bias, static: _Static):
    y, h, mean, rstd = norm_fwd(static.kind, x, scale, bias, r, **static.kwargs())
    return (y, h), (h, scale, mean, rstd)


def _norm_bwd(static: _Static, res, cts):
    h, scale, mean, rstd = res
    dy, dh = cts
    dx, dscale, dbias = norm_bwd(static.kind, h, scale, mean, rstd, dy,
                                 dh if static.residual else None, bias=static.bias,
                                 **static.kwargs())
    return dx, dx if static.residual else None, dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)


# ---- kernels ----------------------------------------------------------------------------------
def _stats(h, cfg: _Cfg):
    """``(xhat, mean, rstd)`` of float32 rows ``h`` (padded columns masked)."""
    cols = lax.broadcasted_iota(jnp.int32, h.shape, 1)
    valid = cols < cfg.width
    mean = jnp.sum(h, axis=1) / cfg.width if cfg.kind == "layer" else jnp.zeros(h.shape[:1])
    centred = jnp.where(valid, h - mean[:, None], 0.)
    rstd = lax.rsqrt(jnp.sum(centred * centred, axis=1) / cfg.width + cfg.eps)
    return centred * rstd[:, None], mean, rstd


def _fwd_kernel(*refs, cfg: _Cfg):
    it = iter(refs)
    x_ref = next(it)
    r_ref = next(it) if cfg.has_residual else None
    s_ref = next(it)
    b_ref = next(it) if cfg.has_bias else None
    y_ref = next(it)
    h_ref = next(it) if cfg.has_residual else None
    mean_ref, rstd_ref = it
    h = x_ref[...]
    if r_ref is not None:
        h = h + r_ref[...]                                    # rounded like the unfused add
        h_ref[...] = h
    xhat, mean, rstd = _stats(h.astype(jnp.float32), cfg)
    y = xhat * s_ref[...].astype(jnp.float32)
    if b_ref is not None:
        y = y + b_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _forward(x, r, scale, bias, cfg: _Cfg):
    n, d = x.shape
    br = cfg.block_rows
    row = pl.BlockSpec((br, d), lambda i: (i, 0))
    vec = pl.BlockSpec((1, d), lambda i: (0, 0))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    args = [a for a in (x, r, scale, bias) if a is not None]
    specs = [row] + [row] * cfg.has_residual + [vec] + [vec] * cfg.has_bias
    act = jax.ShapeDtypeStruct(x.shape, x.dtype)
    stat_shape = jax.ShapeDtypeStruct((n,), jnp.float32)
    outs = kp.call(
        functools.partial(_fwd_kernel, cfg=cfg), backend=cfg.backend,
        name=f"autopar_{cfg.kind}_norm_fwd", grid=(n // br,), in_specs=specs,
        out_specs=(row,) * (1 + cfg.has_residual) + (stat, stat),
        out_shape=(act,) * (1 + cfg.has_residual) + (stat_shape, stat_shape),
        num_warps=cfg.num_warps)(*args)
    y, h = outs[0], outs[1] if cfg.has_residual else x
    return y, h, outs[-2], outs[-1]


def _bwd_kernel(*refs, cfg: _Cfg):
    it = iter(refs)
    h_ref, s_ref, mean_ref, rstd_ref, dy_ref = (next(it) for _ in range(5))
    dh_ref = next(it) if cfg.has_residual else None
    dx_ref, ds_ref, db_ref = it
    h = h_ref[...].astype(jnp.float32)
    valid = lax.broadcasted_iota(jnp.int32, h.shape, 1) < cfg.width
    mean, rstd = mean_ref[...], rstd_ref[...]
    xhat = jnp.where(valid, (h - mean[:, None]) * rstd[:, None], 0.)
    dy = dy_ref[...].astype(jnp.float32)
    g = dy * s_ref[...].astype(jnp.float32)
    inner = g - xhat * (jnp.sum(g * xhat, axis=1) / cfg.width)[:, None]
    if cfg.kind == "layer":
        inner = inner - (jnp.sum(g, axis=1) / cfg.width)[:, None]
    dx = jnp.where(valid, inner * rstd[:, None], 0.)
    if dh_ref is not None:
        dx = dx + dh_ref[...].astype(jnp.float32)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    ds_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=True)
    db_ref[...] = jnp.sum(dy, axis=0, keepdims=True)


def _backward(h, scale, mean, rstd, dy, dh, cfg: _Cfg):
    n, d = h.shape
    br = cfg.block_rows
    row = pl.BlockSpec((br, d), lambda i: (i, 0))
    vec = pl.BlockSpec((1, d), lambda i: (0, 0))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    part = pl.BlockSpec((1, d), lambda i: (i, 0))
    args = [h, scale, mean, rstd, dy.astype(h.dtype)] + ([dh.astype(h.dtype)] if dh is not None
                                                         else [])
    nb = n // br
    dx, ds, db = kp.call(
        functools.partial(_bwd_kernel, cfg=cfg), backend=cfg.backend,
        name=f"autopar_{cfg.kind}_norm_bwd", grid=(nb,),
        in_specs=[row, vec, stat, stat, row] + [row] * (dh is not None),
        out_specs=(row, part, part),
        out_shape=(jax.ShapeDtypeStruct(h.shape, h.dtype),
                   jax.ShapeDtypeStruct((nb, d), jnp.float32),
                   jax.ShapeDtypeStruct((nb, d), jnp.float32)),
        num_warps=cfg.num_warps)(*args)
    return dx, jnp.sum(ds, axis=0, keepdims=True), jnp.sum(db, axis=0, keepdims=True)


# ---- reference --------------------------------------------------------------------------------
def norm_reference(kind: str, x, scale, bias=None, residual=None, *, eps: float = 1e-6):
    """The same computation in plain jnp: ``y`` or ``(y, h)``, float32 statistics."""
    h = x if residual is None else x + residual
    hf = h.astype(jnp.float32)
    mean = jnp.mean(hf, axis=-1, keepdims=True) if kind == "layer" else 0.
    var = jnp.mean(jnp.square(hf - mean), axis=-1, keepdims=True)
    y = (hf - mean) * lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = y.astype(x.dtype)
    return y if residual is None else (y, h)
