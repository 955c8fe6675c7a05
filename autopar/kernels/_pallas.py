"""Shared plumbing of the kernels: backend choice, ``pallas_call``, block sizes, padding, matmul.

Backends (``backend=`` of every kernel):
  * ``"interpret"``: Pallas' interpreter, runs anywhere (tests on CPU); the default on CPU.
  * ``"triton"``: Pallas' Triton lowering on NVIDIA and AMD GPUs; the default on GPU. jax 0.11
    deprecates it in favour of Mosaic GPU, but the grid/BlockSpec kernels written here (dynamic
    ``pl.ds`` loads in ``fori_loop``s, 2-D ``dot_general``s) are in Triton's programming model;
    Mosaic GPU needs warpgroup-level rewrites (``plgpu`` TMA copies, barriers, WGMMA) that have
    not been written yet.

Every kernel takes its block sizes as keywords and clamps them to the problem; Triton needs
power-of-two block dimensions, which the callers guarantee by padding (``pad_to``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from autopar.errors import AutoparError

BACKENDS = ("interpret", "triton")
NEG_INF = -1e30  # a finite "minus infinity": masked scores stay NaN-free in exp and max


def resolve_backend(backend: str | None) -> str:
    """``None`` picks ``"interpret"`` on CPU and ``"triton"`` on GPU."""
    if backend is None:
        return "interpret" if jax.default_backend() not in ("gpu", "cuda", "rocm") else "triton"
    if backend not in BACKENDS:
        raise AutoparError(f"kernel backend={backend!r} is not one of {BACKENDS}; pass "
                           f"backend='interpret' to run anywhere or 'triton' on a GPU")
    return backend


def call(kernel: Callable, *, out_shape: Any, grid: tuple[int, ...], in_specs: Sequence,
         out_specs: Any, backend: str, name: str, num_warps: int | None = None,
         num_stages: int | None = None) -> Callable:
    """``pl.pallas_call`` with the backend's compiler parameters."""
    params = None
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=list(in_specs),
                          out_specs=out_specs, interpret=backend == "interpret",
                          compiler_params=params, name=name)


def block(size: int, preferred: int) -> int:
    """The block along a dim of ``size``: ``preferred`` (a power of two), or less if it is small."""
    return min(preferred, next_pow2(size))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_to(x: jax.Array, axis: int, size: int, value: float = 0) -> jax.Array:
    """``x`` padded with ``value`` at the end of ``axis`` up to ``size``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def mm(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """2-D matmul with float32 accumulation: ``a @ b`` with either side transposed."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def scalar_array(x: Any, dtype: Any = jnp.int32) -> jax.Array:
    """A traced or static scalar as a ``(1,)`` array, the form kernels read scalars in."""
    return jnp.reshape(jnp.asarray(x, dtype), (1,))
