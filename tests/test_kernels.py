"""Kernel numerics on the 8 CPU devices (Pallas interpret mode): each kernel against its plain
jnp reference, values and gradients, unsharded and through its shard_map wrapper on 1x8, 2x4
and 2x2x2 meshes. Shapes are tiny but chosen so that every loop runs more than once, causal
blocks are skipped, and padding (a non-power-of-two width, ragged rows/vocabulary) is exercised.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from autopar import AutoparError, ShardingError
from autopar.kernels import (
    AdamWHyper,
    AttentionBlocks,
    Masks,
    XentBlocks,
    adamw_reference,
    adamw_tree_update,
    adamw_update,
    attention,
    attention_bwd,
    attention_fwd,
    attention_reference,
    attention_with_lse,
    cross_entropy_reference,
    layer_norm,
    lm_head_cross_entropy,
    norm_bwd,
    norm_fwd,
    norm_reference,
    rms_norm,
)
from autopar.kernels import sharded as ks

ATTN_BLOCKS = AttentionBlocks(block_q=8, block_k=8, block_q_bwd=8, block_k_bwd=4)
XENT_BLOCKS = XentBlocks(block_rows=8, block_vocab=8, block_width=8, chunk_vocab=16)


@functools.cache
def mesh(shape: tuple[int, ...]) -> Mesh:
    names = {(8,): ("x",), (2, 4): ("data", "model"), (2, 2, 2): ("a", "b", "c")}[shape]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _randn(seed, shape, scale=1.0, dtype=jnp.float32):
    """Host-side random data: no jax program to compile per array."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), dtype)


def _randint(seed, shape, high):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


# Interpret-mode kernels are large while loops; XLA's cheaper CPU pipeline halves their compile
# time and changes no result beyond rounding.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def assert_same_value_and_grads(fn, ref, args, argnums, atol=2e-5, rtol=2e-5):
    """``fn`` and ``ref`` agree in a weighted sum of their outputs and in its gradients."""
    outs = jax.eval_shape(ref, *args)
    weights = [_randn(100 + i, o.shape) for i, o in enumerate(jax.tree.leaves(outs))]

    def loss(f):
        def scalar(*a):
            return sum(jnp.sum(o.astype(jnp.float32) * w)
                       for o, w in zip(jax.tree.leaves(f(*a)), weights))
        return jax.jit(jax.value_and_grad(scalar, argnums=argnums), compiler_options=FAST_COMPILE)

    got, want = loss(fn)(*args), loss(ref)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=atol, rtol=rtol)


# ---- attention --------------------------------------------------------------------------------
def _qkv(b, s, hq, hkv, d, dtype=jnp.float32, sk=None):
    sk = s if sk is None else sk
    return (_randn(1, (b, s, hq, d), dtype=dtype), _randn(2, (b, sk, hkv, d), dtype=dtype),
            _randn(3, (b, sk, hkv, d), dtype=dtype))


@pytest.mark.parametrize("b, s, hq, hkv, d, causal", [
    (2, 32, 4, 2, 16, True),       # grouped-query, 4 query blocks, causal skipping
    (1, 20, 2, 2, 12, True),       # ragged sequence, head width padded to 16
    (1, 16, 4, 1, 8, False),       # multi-query, not causal
])
def test_attention_matches_reference(b, s, hq, hkv, d, causal):
    fn = functools.partial(attention_with_lse, causal=causal, blocks=ATTN_BLOCKS)
    ref = functools.partial(attention_reference, causal=causal, return_lse=True)
    assert_same_value_and_grads(fn, ref, _qkv(b, s, hq, hkv, d), (0, 1, 2))


def _padding_bias(b, s):
    """transformers' (B, 1, S, S) bias: 0 where a causal, unpadded key is seen, else
    finfo.min; batch row 1 is left-padded, so its first query rows see nothing."""
    pad = np.ones((b, s), bool)
    pad[1, :5] = False
    seen = np.tril(np.ones((s, s), bool))[None] & pad[:, None, :]
    return jnp.asarray(np.where(seen, 0.0, np.finfo(np.float32).min)[:, None], jnp.float32)


@pytest.mark.parametrize("case", ["padding_bias", "keep_and_bias"])
def test_attention_masks_match_reference(case):
    """Masks read as data: a batch's padding bias (rows that see no key at all included), and
    a per-head boolean mask over a per-batch bias with the causal mask, grouped-query."""
    b, s, hq, hkv = 2, 20, 4, 2
    if case == "padding_bias":
        masks, causal = Masks(bias=_padding_bias(b, s)), False
    else:
        keep = jnp.asarray(np.random.default_rng(8).random((1, hq, s, s)) > 0.3)
        masks, causal = Masks(_randn(9, (b, 1, s, 1)), keep, -1e9), True
    fn = functools.partial(attention, causal=causal, blocks=ATTN_BLOCKS, masks=masks)
    ref = functools.partial(attention_reference, causal=causal, masks=masks)
    # Rows that see no key: their weights are recomputed to 1e-3 in the backward (FLOOR).
    tol = 2e-3 if case == "padding_bias" else 2e-5
    assert_same_value_and_grads(fn, ref, _qkv(b, s, hq, hkv, 12), (0, 1, 2), atol=tol, rtol=tol)


def test_attention_query_offset_and_bf16():
    q, k, v = _qkv(1, 8, 2, 1, 16, sk=24)      # the last 8 queries of a 24-token sequence
    fn = functools.partial(attention, q_offset=16, blocks=ATTN_BLOCKS)
    assert_same_value_and_grads(fn, functools.partial(attention_reference, q_offset=16),
                                (q, k, v), (0, 1, 2))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in _qkv(1, 16, 2, 2, 16))
    got = attention(qb, kb, vb, blocks=ATTN_BLOCKS)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(attention_reference(qb, kb, vb), np.float32), atol=3e-2)


def test_forward_and_backward_halves():
    """The halves codegen substitutes for matched ops: the backward from the forward's
    residuals equals the reference's VJP; a norm's ``dh`` is added to ``dx``."""
    q, k, v = _qkv(1, 16, 4, 2, 8)
    jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    out, lse = jit(functools.partial(attention_fwd, blocks=ATTN_BLOCKS))(q, k, v)
    dout = _randn(20, out.shape)
    got = jit(functools.partial(attention_bwd, blocks=ATTN_BLOCKS))(q, k, v, out, lse, dout)
    want = jit(lambda *a: jax.vjp(attention_reference, *a)[1](dout))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5)
    x, _, scale, bias = _norm_args("layer", (4, 8), 16, False)
    y, h, mean, rstd = jit(functools.partial(norm_fwd, "layer"))(x, scale, bias)
    dy, dh = _randn(21, x.shape), _randn(22, x.shape)
    dx, dscale, dbias = jit(functools.partial(norm_bwd, "layer", bias=True))(
        h, scale, mean, rstd, dy, dh)
    want = jit(lambda *a: jax.vjp(functools.partial(norm_reference, "layer"), *a)[1](dy))(
        x, scale, bias)
    for g, w in zip((dx - dh, dscale, dbias), want):
        np.testing.assert_allclose(g, w, atol=2e-5)


@pytest.mark.parametrize("shape, specs", [
    ((8,), {"seq": "x"}),
    ((2, 4), {"batch": "data", "heads": "model"}),
    ((2, 2, 2), {"batch": "a", "heads": "b", "seq": "c"}),
])
def test_attention_sharded(shape, specs):
    args = _qkv(2, 16, 8, 4, 8)
    fn = functools.partial(ks.attention_sharded, mesh=mesh(shape), blocks=ATTN_BLOCKS, **specs)
    assert_same_value_and_grads(fn, attention_reference, args, (0, 1, 2))


# ---- norms ------------------------------------------------------------------------------------
def _norm_fn(kind, residual, fn=None):
    def apply(x, r, s, b):
        if fn is not None:
            return fn(kind, x, s, b, r)
        if kind == "layer":
            return layer_norm(x, s, b, r, block_rows=4)
        return rms_norm(x, s, r, block_rows=4)
    return apply


def _norm_args(kind, lead, width, residual):
    return (_randn(4, lead + (width,)), _randn(5, lead + (width,)) if residual else None,
            1 + _randn(6, (width,), 0.1), _randn(7, (width,), 0.1) if kind == "layer" else None)


@pytest.mark.parametrize("kind, residual, lead, width", [
    ("layer", True, (3, 5), 48),       # ragged rows, width padded to 64 and masked
    ("layer", False, (2, 8), 32),
    ("rms", True, (2, 8), 32),
    ("rms", False, (3, 5), 48),
])
def test_norm_matches_reference(kind, residual, lead, width):
    args = _norm_args(kind, lead, width, residual)
    ref = _norm_fn(kind, residual, lambda k, x, s, b, r: norm_reference(k, x, s, b, r))
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    assert_same_value_and_grads(_norm_fn(kind, residual), ref, args, argnums)


def test_norms_agree_with_flax():
    x = _randn(8, (2, 8, 32))
    for module, fn in ((nn.LayerNorm(), lambda p: layer_norm(x, p["scale"], p["bias"])),
                       (nn.RMSNorm(), lambda p: rms_norm(x, p["scale"]))):
        params = module.init(jax.random.PRNGKey(0), x)
        np.testing.assert_allclose(fn(params["params"]), module.apply(params, x), atol=1e-5)


@pytest.mark.parametrize("shape, rows, kinds", [
    ((8,), ("x",), ("layer",)),
    ((2, 4), ("data", "model"), ("rms",)),
    ((2, 2, 2), (("a", "b"), "c"), ("layer", "rms")),
])
def test_norm_sharded(shape, rows, kinds):
    for kind in kinds:
        args = _norm_args(kind, (8, 4), 16, True)
        fn = _norm_fn(kind, True, functools.partial(ks.norm_sharded, mesh=mesh(shape), rows=rows))
        ref = _norm_fn(kind, True, lambda k, x, s, b, r: norm_reference(k, x, s, b, r))
        assert_same_value_and_grads(fn, ref, args, (0, 1, 2), atol=1e-4)


# ---- LM-head cross-entropy --------------------------------------------------------------------
def _xent_args(lead, width, vocab):
    return (_randn(9, lead + (width,)), _randn(10, (width, vocab), 0.3),
            _randint(11, lead, vocab))


@pytest.mark.parametrize("lead, width, vocab", [((2, 8), 16, 64), ((3, 5), 20, 50)])
def test_xent_matches_reference(lead, width, vocab):
    h, w, t = _xent_args(lead, width, vocab)
    fn = (lambda h_, w_: lm_head_cross_entropy(h_, w_, t, blocks=XENT_BLOCKS))
    assert_same_value_and_grads(fn, lambda h_, w_: cross_entropy_reference(h_, w_, t), (h, w),
                                (0, 1))


@pytest.mark.parametrize("shape, rows, vocab", [
    ((8,), (), "x"),
    ((2, 4), ("data",), "model"),
    ((2, 2, 2), (("a", "b"),), "c"),
])
def test_xent_sharded(shape, rows, vocab):
    h, w, t = _xent_args((8, 4), 16, 64)
    fn = (lambda h_, w_: ks.lm_head_cross_entropy_sharded(
        h_, w_, t, mesh=mesh(shape), rows=rows, vocab=vocab, blocks=XENT_BLOCKS))
    assert_same_value_and_grads(fn, lambda h_, w_: cross_entropy_reference(h_, w_, t), (h, w),
                                (0, 1))


def test_xent_vocab_parallel_uses_two_all_reduces():
    h, w, t = _xent_args((8, 4), 16, 64)
    fn = jax.jit(lambda h_, w_: ks.lm_head_cross_entropy_sharded(
        h_, w_, t, mesh=mesh((2, 4)), rows=("data",), vocab="model", blocks=XENT_BLOCKS).sum())
    hlo = fn.lower(h, w).compile().as_text()
    reduces = [line for line in hlo.splitlines() if " all-reduce(" in line
               or " all-reduce-start(" in line]
    # pmax, psum of the (sumexp, target logit) pair, and the scalar loss sum of the test itself
    kinds = sorted("max" if "max" in line.split("to_apply=")[-1] else "sum" for line in reduces)
    assert kinds.count("max") == 1 and 1 <= kinds.count("sum") <= 2, reduces


# ---- adamw ------------------------------------------------------------------------------------
HYPER = AdamWHyper(weight_decay=0.01)


def _adamw_args(shape):
    return (_randn(12, shape), _randn(13, shape), _randn(14, shape, 0.1),
            jnp.abs(_randn(15, shape)) + 0.1, 1e-2, 0.19, 0.0199)


def _adamw(fn):
    return lambda p, g, mu, nu, lr, bc1, bc2: fn(p, g, mu, nu, lr=lr, bc1=bc1, bc2=bc2,
                                                 hyper=HYPER)


def test_adamw_matches_reference():
    fn = _adamw(functools.partial(adamw_update, block=64))
    assert_same_value_and_grads(fn, _adamw(adamw_reference), _adamw_args((5, 37)),
                                tuple(range(7)), atol=1e-5)


def test_adamw_tree_matches_optax():
    params = {"w": _randn(16, (4, 6)), "b": {"c": _randn(17, (6,))}}
    grads = jax.tree.map(lambda x: 0.5 * x + 0.1, params)
    tx = optax.adamw(1e-2, weight_decay=HYPER.weight_decay)
    state = tx.init(params)
    for _ in range(2):
        want, want_state = _optax_step(tx, params, grads, state)
        got, got_state = jax.jit(functools.partial(adamw_tree_update, lr=1e-2, hyper=HYPER),
                                 compiler_options=FAST_COMPILE)(params, grads, state)
        for a, b in zip(jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state))):
            np.testing.assert_allclose(a, b, atol=1e-6)
        params, state = want, want_state


@functools.partial(jax.jit, static_argnums=0)
def _optax_step(tx, params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("shape, spec", [
    ((8,), P("x")), ((2, 4), P("data", "model")), ((2, 2, 2), P(("a", "b"), "c")),
])
def test_adamw_sharded(shape, spec):
    fn = _adamw(functools.partial(ks.adamw_sharded, mesh=mesh(shape), spec=spec))
    assert_same_value_and_grads(fn, _adamw(adamw_reference), _adamw_args((8, 12)),
                                tuple(range(7)), atol=1e-5)


# ---- errors -----------------------------------------------------------------------------------
def test_errors_name_shapes_and_fixes():
    q, k, v = _qkv(2, 16, 8, 4, 8)
    with pytest.raises(ShardingError, match="dim 2 of size 4 is not divisible"):
        ks.attention_sharded(q, k[:, :, :4], v[:, :, :4], mesh=mesh((8,)), heads="x")
    with pytest.raises(ShardingError, match="names mesh axis 'y'"):
        ks.attention_sharded(q, k, v, mesh=mesh((8,)), batch="y")
    with pytest.raises(ShardingError, match="given to both"):
        ks.attention_sharded(q, k, v, mesh=mesh((2, 4)), batch="data", seq="data")
    with pytest.raises(AutoparError, match="multiple of key/value heads"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(AutoparError, match="targets must have h's leading shape"):
        lm_head_cross_entropy(_randn(0, (4, 8)), _randn(0, (8, 16)), jnp.zeros((5,), jnp.int32))
    with pytest.raises(AutoparError, match="scale and bias must have shape"):
        layer_norm(_randn(0, (4, 8)), jnp.ones((7,)), jnp.zeros((8,)))
    with pytest.raises(AutoparError, match="backend='interpret'"):
        rms_norm(_randn(0, (4, 8)), jnp.ones((8,)), backend="cuda")
