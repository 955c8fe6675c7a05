"""ir.fusion: which values reach memory, in closed form and against XLA's bytes accessed."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import ir
import ir.fusion
from autopar.models import gpt, mlp, moe
from autopar.planner import problem

F32 = 4


def fused(fn, *args):
    graph = ir.trace(fn, *args)
    return graph, ir.fusion.fuse(graph)


def xla_bytes(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["bytes accessed"]


def test_elementwise_chain_is_one_kernel_reading_its_input_once():
    x = jnp.ones((64, 32))
    graph, fusion = fused(lambda x: jnp.sin(x * 2.0 + 1.0) * 3.0, x)
    assert fusion.kernels() == 1
    # one read of x, one write of the result: nothing in between reaches memory
    assert fusion.hbm_bytes(graph) == 2 * x.size * F32


def test_matmul_reads_its_operands_and_epilogue_fuses_into_the_consumer():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    graph, fusion = fused(lambda x, w: jnp.tanh(x @ w).sum(), x, w)
    # the dot is its own kernel (reads x, w; writes 16x8); tanh + sum read it once, write a scalar
    expected = (x.size + w.size + 2 * 16 * 8 + 1) * F32
    assert fusion.kernels() == 2
    assert fusion.hbm_bytes(graph) == expected


def test_expensive_producer_with_two_consumer_kernels_is_written_once():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 32))

    def f(x, w):
        e = jnp.exp(x)          # expensive: not recomputed in both consumers
        return (e @ w).sum() + e.sum()

    graph, fusion = fused(f, x, w)
    exp_ops = [op for op in graph.ops if op.prim == "exp"]
    assert len(exp_ops) == 1
    assert fusion.writes[exp_ops[0].id] == exp_ops[0].outs


def _residual_net(x, ws):
    h = x
    for w in ws:                 # an unrolled residual stream, pre-norm: every reader of h_l
        h = h + jnp.tanh((h - h.mean(-1, keepdims=True)) @ w)     # fuses (sub, mean, add)
    return h.sum() + (h * h).sum()


def test_residual_adds_are_written_once_not_re_added_in_every_later_kernel():
    x, ws = jnp.ones((16, 32)), [jnp.ones((32, 32))] * 6
    graph, fusion = fused(_residual_net, x, ws)
    adds = [op for op in graph.ops if op.prim == "add" and graph.values[op.outs[0]].shape
            == x.shape]
    assert len(adds) == 6
    # every add but the last feeds the next layer's matmul and the next add, which also reads
    # a value that passed through that matmul: XLA will not duplicate it, so it is written
    for op in adds[:-1]:
        assert fusion.writes[op.id] == op.outs and len(fusion.reads[op.id]) <= 2
    # so the bytes grow linearly with depth, as XLA's do: three more layers add what the
    # first three did
    by_depth = [fused(_residual_net, x, ws[:n]) for n in (2, 4, 6)]
    b2, b4, b6 = (f.hbm_bytes(g) for g, f in by_depth)
    assert b6 - b4 == pytest.approx(b4 - b2, rel=1e-9)
    # and agree with XLA's count (1.07 here; the rule's absence over-counted 1.66x)
    assert b6 == pytest.approx(xla_bytes(_residual_net, x, ws), rel=0.2)


def test_a_binary_producer_still_duplicates_into_independent_reductions():
    x, y = jnp.ones((16, 32)), jnp.ones((16, 32))

    def f(x, y):
        a = x + y
        return a.sum(0).sum() * a.max(1).sum()

    graph, fusion = fused(f, x, y)
    add = next(op for op in graph.ops if op.prim == "add")
    # no unfusible op between its readers: recomputed in both reductions' kernels, never written
    assert add.id not in fusion.writes and fusion.reads[add.id] == 2 * add.ins


def _prenorm_block(w, x):
    h = x + jnp.tanh(x @ w)                    # a residual add: two full operands
    c = h - h.mean(-1, keepdims=True)          # centred: one full operand and a row statistic
    y = c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5)
    return jnp.tanh(y @ w).sum()


def test_layer_norm_recomputes_its_centred_input_and_keeps_the_residual():
    """XLA duplicates an effectively unary producer (``x - mean``) into every kernel that
    reads it, in the backward pass too, and keeps the residual it reads (a two-operand add whose
    readers are also reached through the mean's reduction) in memory until the last copy runs."""
    w, x = jnp.ones((32, 32)), jnp.ones((16, 32))
    graph, fusion = fused(jax.grad(_prenorm_block), w, x)
    residual = next(op for op in graph.ops if op.prim == "add"
                    and graph.values[op.outs[0]].shape == x.shape)
    centred = next(op for op in graph.ops if op.prim == "sub"
                   and graph.values[op.ins[1]].shape == (16, 1))
    assert centred.id not in fusion.writes and len(fusion.duplicated[centred.id]) >= 2
    assert fusion.writes[residual.id] == residual.outs
    where = {op.id: t for t, op in enumerate(graph.ops)}
    span = {v: (a, b) for v, a, b in problem.temporaries(graph, fusion)}
    assert span[residual.outs[0]][1] == max(where[k] for k in fusion.duplicated[centred.id])
    assert fusion.hbm_bytes(graph) == pytest.approx(
        xla_bytes(jax.grad(_prenorm_block), w, x), rel=0.1)


def test_constants_cost_nothing():
    x = jnp.ones((8, 8))
    graph, fusion = fused(lambda x: x + jnp.arange(8.0) * 2.0, x)
    assert fusion.constants
    assert fusion.hbm_bytes(graph) == 2 * x.size * F32


@pytest.mark.parametrize("make, low, high", [
    (lambda: mlp.abstract(64, 256, 2, 32), 0.9, 1.1),
    (lambda: gpt.abstract(gpt.GPTConfig(layers=2, d_model=64, heads=4, d_ff=128, seq=16,
                                        vocab=128), 8), 0.85, 1.1),
    (lambda: moe.abstract(moe.MoEConfig(), 8), 0.85, 1.1),
], ids=["mlp", "gpt", "moe"])
def test_step_bytes_match_xla_within_the_published_band(make, low, high):
    """Unsharded training steps: the fused byte count against XLA:CPU's ``bytes accessed``.
    (Measured ratios: MLP 0.996, GPT 0.975, MoE 0.923; the conv net is 0.50, as XLA:CPU expands
    pooling gradients into scatters the model does not know: see the README. GPT is 0.895 since
    a layer norm's ``x - mean`` is recomputed in its readers, as XLA does: the write that no
    longer counts had stood in for the broadcast buffers' traffic, which ``hbm_bytes`` leaves
    out.)"""
    step, state, batch = make()
    graph, fusion = fused(step, state, batch)
    ratio = fusion.hbm_bytes(graph) / xla_bytes(step, state, batch)
    assert low <= ratio <= high, ratio
