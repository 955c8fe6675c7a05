"""Kernel cost entries: hand-derived closed forms, and the FLOPs of the unfused references as
``ir`` counts them (XLA's rules), so that kernel and XLA costs are on one scale."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import cost_models
import ir
from autopar.kernels import (
    AttentionBlocks,
    XentBlocks,
    attention_reference,
    cross_entropy_reference,
)
from autopar.kernels import costs as kc


def _dot_flops(fn, *args) -> float:
    g = ir.trace(fn, *args)
    return sum(op.flops for op in g.all_ops() if op.prim == "dot_general")


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_attention_flops_match_unfused_matmuls():
    b, s, h, d = 2, 256, 4, 64
    cost = kc.attention_fwd_cost(b, s, s, h, h, d, causal=False)
    assert cost.matmul_flops == 4 * b * h * s * s * d
    q = _sds((b, s, h, d))
    assert cost.matmul_flops == _dot_flops(
        lambda q, k, v: attention_reference(q, k, v, causal=False), q, q, q)
    # The unfused backward has 4 score-sized matmuls; the kernels recompute s (twice) and dP
    # (twice) from the LSE: 7 per block pair in all.
    bwd = kc.attention_bwd_cost(b, s, s, h, h, d, causal=False)
    assert bwd.matmul_flops == 14 * b * h * s * s * d
    assert bwd.launches == 3 and cost.launches == 1


@pytest.mark.parametrize("block, pairs", [(256, 1), (64, 10), (32, 36)])
def test_causal_attention_counts_visited_blocks(block, pairs):
    blocks = AttentionBlocks(block, block, block, block)
    assert kc.visited_blocks(256, 256, block, block, True) == pairs
    assert kc.visited_blocks(256, 256, block, block, True, by_key=True) == pairs
    full = kc.attention_fwd_cost(1, 256, 256, 1, 1, 64, causal=False, blocks=blocks)
    causal = kc.attention_fwd_cost(1, 256, 256, 1, 1, 64, causal=True, blocks=blocks)
    n = 256 // block
    assert causal.matmul_flops == pytest.approx(full.matmul_flops * pairs / (n * n))


def test_visited_blocks_with_unequal_blocks():
    # query blocks of 64 over key blocks of 32: block i sees 2 (i + 1) key blocks
    assert kc.visited_blocks(128, 128, 64, 32, True) == 2 + 4
    # key block j is seen by query blocks j*32//64 .. 1
    assert kc.visited_blocks(128, 128, 64, 32, True, by_key=True) == 2 + 2 + 1 + 1


def test_xent_flops_and_collectives():
    n, d, v = 64, 32, 1000
    fwd = kc.xent_fwd_cost(n, d, v)
    assert fwd.matmul_flops == 2 * n * d * v == _dot_flops(
        lambda h, w: cross_entropy_reference(h, w, jnp.zeros((n,), jnp.int32)),
        _sds((n, d)), _sds((d, v)))
    bwd = kc.xent_bwd_cost(n, d, v, blocks=XentBlocks(chunk_vocab=256))
    assert bwd.matmul_flops == 6 * n * d * v        # recompute + dh + dw
    assert bwd.launches == 3 * 4                    # 4 chunks of at most 256 columns
    assert fwd.collectives == () and bwd.collectives == ()
    sharded = kc.xent_fwd_cost(n, d, v // 4, vocab_shards=4)
    assert sharded.collectives == (("all-reduce", 4.0 * n), ("all-reduce", 8.0 * n))
    assert [k for k, _ in kc.xent_bwd_cost(n, d, v // 4, vocab_shards=4).collectives] == \
        ["all-reduce", "all-reduce"]


def test_norm_and_adamw_bytes():
    rows, width = 1024, 512
    fwd = kc.norm_fwd_cost(rows, width, itemsize=2, kind="layer", residual=True)
    # read x and r, write y and h (bf16), the two params, 8 bytes of statistics per row
    assert fwd.hbm_bytes == 4 * rows * width * 2 + 2 * width * 2 + rows * 8
    rms = kc.norm_fwd_cost(rows, width, itemsize=2, kind="rms", residual=False)
    assert rms.hbm_bytes == 2 * rows * width * 2 + width * 2 + rows * 8
    opt = kc.adamw_cost(1000)
    assert opt.hbm_bytes == 1000 * 4 * 7 and opt.launches == 1


def test_time_is_the_roofline_of_the_profile():
    hw = cost_models.hardware("h100")
    cost = kc.attention_fwd_cost(8, 2048, 2048, 16, 16, 128)      # GPT-1.3B-like, causal
    mm = cost.matmul_flops / (hw.peak_flops_per_s("bfloat16") * hw.matmul_efficiency)
    vec = cost.vector_flops / (hw.peak_flops_per_s("float32") * hw.matmul_efficiency)
    mem = cost.hbm_bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency)
    assert cost.time_s(hw) == pytest.approx(max(mm + vec, mem) + hw.kernel_launch_s)
    # Fusion's point: all the kernel's traffic is below one float32 write of the scores.
    assert cost.hbm_bytes < 8 * 16 * 2048 * 2048 * 4
    norm = kc.norm_fwd_cost(8 * 2048, 2048)
    assert norm.time_s(hw) == pytest.approx(
        norm.hbm_bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency) + hw.kernel_launch_s)
    total = cost + norm
    assert total.launches == 2 and total.hbm_bytes == cost.hbm_bytes + norm.hbm_bytes
