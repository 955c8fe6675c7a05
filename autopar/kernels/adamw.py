"""The AdamW update of one parameter as one elementwise kernel (optax.adamw's arithmetic).

For a parameter ``p``, its gradient ``g`` and moments ``mu``, ``nu`` (all the same shape), with
``bc1 = 1 - b1^t`` and ``bc2 = 1 - b2^t`` at step ``t`` (counting from 1):

    mu' = b1 mu + (1 - b1) g                nu' = b2 nu + (1 - b2) g^2
    u   = (mu'/bc1) / (sqrt(nu'/bc2 + eps_root) + eps) + weight_decay p
    p'  = p - lr u

XLA fuses this per leaf too, but as several loops that each read and write the full tensors
when the moments and the parameter are separate outputs; the kernel reads ``p, g, mu, nu`` once
and writes ``p', mu', nu'`` once (7 tensor passes). ``lr``, ``bc1`` and ``bc2`` are traced
scalars (schedules work), read from a small array.

Backward (a second kernel): the VJP of the three outputs with respect to ``p, g, mu, nu`` and
the scalars ``lr``, ``bc1``, ``bc2`` (a learning-rate hypergradient, for instance); the scalar
cotangents come out as one partial sum per program, summed by XLA.
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

_LANES = 128  # partial-sum row width of the backward (lanes 0..2: lr, bc1, bc2)


@dataclasses.dataclass(frozen=True)
class AdamWHyper:
    """optax.adamw's constants (the learning rate is a traced argument instead)."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 1e-4


DEFAULT_HYPER = AdamWHyper()


@dataclasses.dataclass(frozen=True)
class _Cfg:
    hyper: AdamWHyper
    size: int            # unpadded element count
    block: int
    backend: str


def adamw_update(p, g, mu, nu, *, lr, bc1, bc2, hyper: AdamWHyper = AdamWHyper(),
                 block: int = 1024, backend: str | None = None):
    """One AdamW step of one parameter.

    Args:
      p, g, mu, nu: equal shapes; ``p'`` keeps ``p``'s dtype, the moments theirs.
      lr: learning rate (scalar, may be traced).
      bc1, bc2: bias corrections ``1 - b1^t`` and ``1 - b2^t`` (scalars, may be traced).
      hyper: the other constants.
      block: elements per program (a power of two).
      backend: see ``autopar.kernels._pallas``.

    Returns:
      ``(p', mu', nu')``. Differentiable in every array and scalar argument.
    """
    if not (p.shape == g.shape == mu.shape == nu.shape):
        raise AutoparError(f"adamw_update: p{tuple(p.shape)}, g{tuple(g.shape)}, "
                           f"mu{tuple(mu.shape)}, nu{tuple(nu.shape)} must have one shape: pass "
                           f"the moments of this parameter")
    n = p.size
    cfg = _Cfg(hyper, n, kp.block(n, block), kp.resolve_backend(backend))
    n_p = kp.round_up(n, cfg.block)

    def flat(a):
        return kp.pad_to(a.reshape(n), 0, n_p)

    scalars = jnp.stack([jnp.asarray(x, jnp.float32) for x in (lr, bc1, bc2)])
    p2, mu2, nu2 = _adamw(flat(p), flat(g), flat(mu), flat(nu), scalars, cfg)
    return p2[:n].reshape(p.shape), mu2[:n].reshape(mu.shape), nu2[:n].reshape(nu.shape)


def adamw_tree_update(params, grads, opt_state, *, lr, hyper: AdamWHyper = AdamWHyper(),
                      backend: str | None = None):
    """``optax.adamw`` (no mask, no nesterov) on whole pytrees, one kernel per leaf.

    ``opt_state`` is optax.adamw's own state (``(ScaleByAdamState(count, mu, nu), ...)``);
    returns ``(new_params, new_opt_state)`` with the same structure, count incremented.
    """
    adam = opt_state[0]
    count = adam.count + 1                        # optax bias-corrects with the new count
    t = count.astype(jnp.float32)
    bc1, bc2 = 1 - hyper.b1 ** t, 1 - hyper.b2 ** t
    step = functools.partial(adamw_update, lr=lr, bc1=bc1, bc2=bc2, hyper=hyper, backend=backend)
    out = jax.tree.map(step, params, grads, adam.mu, adam.nu)
    is_triple = (lambda x: isinstance(x, tuple) and len(x) == 3)
    pick = (lambda i: jax.tree.map(lambda trip: trip[i], out, is_leaf=is_triple))
    new_adam = adam._replace(count=count, mu=pick(1), nu=pick(2))
    return pick(0), (new_adam,) + tuple(opt_state[1:])


# ---- the custom VJP ---------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _adamw(p, g, mu, nu, scalars, cfg: _Cfg):
    return _forward(p, g, mu, nu, scalars, cfg)


def _adamw_fwd(p, g, mu, nu, scalars, cfg: _Cfg):
    return _forward(p, g, mu, nu, scalars, cfg), (p, g, mu, nu, scalars)


def _adamw_bwd(cfg: _Cfg, res, cts):
    p, g, mu, nu, scalars = res
    dp, dg, dmu, dnu, parts = _backward(p, g, mu, nu, scalars, *cts, cfg)
    return dp, dg, dmu, dnu, jnp.sum(parts, axis=0)[:3]


_adamw.defvjp(_adamw_fwd, _adamw_bwd)


# ---- kernels ----------------------------------------------------------------------------------
def _moments(g, mu, nu, h: AdamWHyper):
    return h.b1 * mu + (1 - h.b1) * g, h.b2 * nu + (1 - h.b2) * g * g


def _fwd_kernel(s_ref, p_ref, g_ref, mu_ref, nu_ref, p_out, mu_out, nu_out, *, cfg: _Cfg):
    h = cfg.hyper
    lr, bc1, bc2 = s_ref[0], s_ref[1], s_ref[2]
    p = p_ref[...].astype(jnp.float32)
    mu, nu = _moments(g_ref[...].astype(jnp.float32), mu_ref[...].astype(jnp.float32),
                      nu_ref[...].astype(jnp.float32), h)
    u = (mu / bc1) / (jnp.sqrt(nu / bc2 + h.eps_root) + h.eps) + h.weight_decay * p
    p_out[...] = (p - lr * u).astype(p_out.dtype)
    mu_out[...] = mu.astype(mu_out.dtype)
    nu_out[...] = nu.astype(nu_out.dtype)


def _specs(cfg: _Cfg, n_arrays: int):
    return [pl.BlockSpec((4,), lambda i: (0,))] + [pl.BlockSpec((cfg.block,), lambda i: (i,))] * \
        n_arrays


def _forward(p, g, mu, nu, scalars, cfg: _Cfg):
    arr = pl.BlockSpec((cfg.block,), lambda i: (i,))
    return kp.call(
        functools.partial(_fwd_kernel, cfg=cfg), backend=cfg.backend, name="autopar_adamw",
        grid=(p.shape[0] // cfg.block,), in_specs=_specs(cfg, 4), out_specs=(arr, arr, arr),
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (p, mu, nu)),
    )(kp.pad_to(scalars, 0, 4), p, g, mu, nu)


def _bwd_kernel(s_ref, p_ref, g_ref, mu_ref, nu_ref, cp_ref, cmu_ref, cnu_ref,
                dp_ref, dg_ref, dmu_ref, dnu_ref, part_ref, *, cfg: _Cfg):
    # Long because it is one chain rule; splitting it would pass a dozen tensors around.
    h = cfg.hyper
    lr, bc1, bc2 = s_ref[0], s_ref[1], s_ref[2]
    p, g = p_ref[...].astype(jnp.float32), g_ref[...].astype(jnp.float32)
    mu, nu = _moments(g, mu_ref[...].astype(jnp.float32), nu_ref[...].astype(jnp.float32), h)
    mhat, nhat = mu / bc1, nu / bc2
    root = jnp.sqrt(nhat + h.eps_root)
    den = root + h.eps
    u = mhat / den + h.weight_decay * p
    cp = cp_ref[...].astype(jnp.float32)
    du = -lr * cp
    dmhat = du / den
    dnhat = jnp.where(root > 0, -du * mhat / (den * den) / (2 * jnp.maximum(root, 1e-30)), 0.)
    dmu_total = cmu_ref[...].astype(jnp.float32) + dmhat / bc1
    dnu_total = cnu_ref[...].astype(jnp.float32) + dnhat / bc2
    dp_ref[...] = (cp * (1 - lr * h.weight_decay)).astype(dp_ref.dtype)
    dg_ref[...] = ((1 - h.b1) * dmu_total + 2 * (1 - h.b2) * g * dnu_total).astype(dg_ref.dtype)
    dmu_ref[...] = (h.b1 * dmu_total).astype(dmu_ref.dtype)
    dnu_ref[...] = (h.b2 * dnu_total).astype(dnu_ref.dtype)
    valid = (pl.program_id(0) * cfg.block + lax.broadcasted_iota(jnp.int32, p.shape, 0)) < cfg.size
    sums = [jnp.sum(jnp.where(valid, x, 0.)) for x in
            (-cp * u, -dmhat * mhat / bc1, -dnhat * nhat / bc2)]
    lane = lax.broadcasted_iota(jnp.int32, (1, _LANES), 1)
    part_ref[...] = jnp.where(lane == 0, sums[0], jnp.where(lane == 1, sums[1],
                                                            jnp.where(lane == 2, sums[2], 0.)))


def _backward(p, g, mu, nu, scalars, cp, cmu, cnu, cfg: _Cfg):
    arr = pl.BlockSpec((cfg.block,), lambda i: (i,))
    nb = p.shape[0] // cfg.block
    return kp.call(
        functools.partial(_bwd_kernel, cfg=cfg), backend=cfg.backend, name="autopar_adamw_bwd",
        grid=(nb,), in_specs=_specs(cfg, 7),
        out_specs=(arr, arr, arr, arr, pl.BlockSpec((1, _LANES), lambda i: (i, 0))),
        out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (p, g, mu, nu))
        + (jax.ShapeDtypeStruct((nb, _LANES), jnp.float32),),
    )(kp.pad_to(scalars, 0, 4), p, g, mu, nu, cp.astype(p.dtype), cmu.astype(mu.dtype),
      cnu.astype(nu.dtype))


# ---- reference --------------------------------------------------------------------------------
def adamw_reference(p, g, mu, nu, *, lr, bc1, bc2, hyper: AdamWHyper = AdamWHyper()):
    """The same update in plain jnp."""
    h = hyper
    mu2 = h.b1 * mu + (1 - h.b1) * g
    nu2 = h.b2 * nu + (1 - h.b2) * jnp.square(g)
    u = (mu2 / bc1) / (jnp.sqrt(nu2 / bc2 + h.eps_root) + h.eps) + h.weight_decay * p
    return (p - lr * u).astype(p.dtype), mu2.astype(mu.dtype), nu2.astype(nu.dtype)
