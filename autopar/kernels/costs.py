"""Cost-model entries of the kernels, for the planner to price a kernel against XLA's own ops.

Every entry is a plain function of per-shard sizes (what one device's kernel sees after the
layout's splits) returning a frozen ``KernelCost``:

  * ``matmul_flops``: FLOPs on the matrix units (2 M N K per tile product actually computed:
    causal attention skips the blocks above the diagonal, so it counts about half);
  * ``vector_flops``: elementwise/reduction FLOPs; ``transcendentals``: exp/log/rsqrt/sqrt;
  * ``hbm_bytes``: compulsory HBM traffic: each input read once per program that needs it, as
    the kernel streams it, each output written once. Tiles that several programs read (the
    key/value blocks of one head, the LM-head columns) are counted once per reading program:
    an upper bound where L2 serves repeats;
  * ``launches``: kernels and XLA fusions launched (the per-launch floor of the roofline);
  * ``collectives``: ``(kind, bytes per device)`` the kernel's sharded form adds (the planner
    prices them with its collective model; the axis is the layout's).

``time_s(hw, dtype)`` applies the roofline of ``cost_models.compute``:
``max(matmul/(P_dtype e_f) + vector/(P_f32 e_f), bytes/(W e_m)) + launches L``.
Shapes: B batch, S sequence, H heads (Hkv key/value heads), D head or model width, N rows
(tokens), V vocabulary, E elements.
"""
from __future__ import annotations

import dataclasses
import math

from autopar.kernels import cross_entropy as xent_mod
from autopar.kernels import flash_attention as attn_mod
from autopar.kernels._pallas import block


@dataclasses.dataclass(frozen=True)
class KernelCost:
    matmul_flops: float = 0.0
    vector_flops: float = 0.0
    transcendentals: float = 0.0
    hbm_bytes: float = 0.0
    launches: int = 0
    collectives: tuple[tuple[str, float], ...] = ()

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.vector_flops

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(self.matmul_flops + other.matmul_flops,
                          self.vector_flops + other.vector_flops,
                          self.transcendentals + other.transcendentals,
                          self.hbm_bytes + other.hbm_bytes, self.launches + other.launches,
                          self.collectives + other.collectives)

    def time_s(self, hw, dtype: str = "bfloat16") -> float:
        """Roofline time on a ``cost_models.Hardware`` (collectives excluded)."""
        from cost_models.compute import compute_bound_time_s, memory_bound_time_s

        body = max(compute_bound_time_s(self.matmul_flops, hw, dtype, True)
                   + compute_bound_time_s(self.vector_flops, hw, dtype, False),
                   memory_bound_time_s(self.hbm_bytes, hw))
        return body + self.launches * hw.kernel_launch_s


# ---- attention --------------------------------------------------------------------------------
def visited_blocks(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool,
                   by_key: bool = False) -> int:
    """(query block, key block) pairs a kernel computes, as its loop bounds say: the forward and
    dq kernels loop over key blocks up to the diagonal, the dk/dv kernel (``by_key``) over
    query blocks from the diagonal on."""
    n_q, n_k = -(-seq_q // block_q), -(-seq_k // block_k)
    if not causal:
        return n_q * n_k
    if by_key:
        return sum(n_q - min(n_q, j * block_k // block_q) for j in range(n_k))
    return sum(min(n_k, -(-((i + 1) * block_q) // block_k)) for i in range(n_q))


def _blocks(seq_q, seq_k, bq, bk):
    return block(seq_q, bq), block(seq_k, bk)


def attention_fwd_cost(batch: int, seq_q: int, seq_k: int, heads: int, kv_heads: int,
                       head_dim: int, itemsize: int = 2, causal: bool = True,
                       blocks: attn_mod.AttentionBlocks = attn_mod.DEFAULT_BLOCKS) -> KernelCost:
    """Forward kernel: ``q k^T`` and ``p v`` per visited block pair; q, out, lse once."""
    bq, bk = _blocks(seq_q, seq_k, blocks.block_q, blocks.block_k)
    pairs = batch * heads * visited_blocks(seq_q, seq_k, bq, bk, causal)
    tile = bq * bk
    act = batch * seq_q * heads * head_dim * itemsize
    kv_reads = pairs * bk * head_dim * itemsize * 2
    return KernelCost(matmul_flops=4.0 * pairs * tile * head_dim, vector_flops=6.0 * pairs * tile,
                      transcendentals=float(pairs * tile),
                      hbm_bytes=2 * act + kv_reads + batch * heads * seq_q * 4, launches=1)


def attention_bwd_cost(batch: int, seq_q: int, seq_k: int, heads: int, kv_heads: int,
                       head_dim: int, itemsize: int = 2, causal: bool = True,
                       blocks: attn_mod.AttentionBlocks = attn_mod.DEFAULT_BLOCKS) -> KernelCost:
    """``delta`` (one XLA fusion), the dq kernel (3 tile products per visited pair) and the
    dk/dv kernel (4), each recomputing ``P`` from the saved LSE."""
    bq, bk = _blocks(seq_q, seq_k, blocks.block_q_bwd, blocks.block_k_bwd)
    pairs = batch * heads * visited_blocks(seq_q, seq_k, bq, bk, causal)
    pairs_k = batch * heads * visited_blocks(seq_q, seq_k, bq, bk, causal, by_key=True)
    tile = bq * bk
    act = batch * seq_q * heads * head_dim * itemsize
    kv = batch * seq_k * kv_heads * head_dim * itemsize
    rows = batch * heads * seq_q * 4
    delta = KernelCost(vector_flops=2.0 * act / itemsize, hbm_bytes=2 * act + rows, launches=1)
    dq = KernelCost(matmul_flops=6.0 * pairs * tile * head_dim, vector_flops=5.0 * pairs * tile,
                    transcendentals=float(pairs * tile),
                    hbm_bytes=3 * act + 2 * rows + pairs * bk * head_dim * itemsize * 2,
                    launches=1)
    dkdv = KernelCost(matmul_flops=8.0 * pairs_k * tile * head_dim,
                      vector_flops=5.0 * pairs_k * tile, transcendentals=float(pairs_k * tile),
                      hbm_bytes=4 * kv + pairs_k * bq * (2 * head_dim * itemsize + 8), launches=1)
    return delta + dq + dkdv


# ---- norms ------------------------------------------------------------------------------------
_NORM_FLOPS = {"layer": 8.0, "rms": 6.0}   # per element: stats, centre, scale, shift


def norm_fwd_cost(rows: int, width: int, itemsize: int = 2, kind: str = "layer",
                  residual: bool = True) -> KernelCost:
    """One pass: read x (and r), write y (and h) and the row statistics."""
    elems = rows * width
    acts = (2 if residual else 1) * 2
    params = width * itemsize * (2 if kind == "layer" else 1)
    return KernelCost(vector_flops=(_NORM_FLOPS[kind] + residual) * elems,
                      transcendentals=float(rows),
                      hbm_bytes=acts * elems * itemsize + params + rows * 8, launches=1)


def norm_bwd_cost(rows: int, width: int, itemsize: int = 2, kind: str = "layer",
                  residual: bool = True, block_rows: int = 16) -> KernelCost:
    """Backward kernel (read h, dy, dh, stats; write dx, partial parameter sums) plus the XLA
    reduction of the partial sums."""
    elems = rows * width
    parts = -(-rows // block_rows) * width * 4 * 2
    kernel = KernelCost(vector_flops=10.0 * elems,
                        hbm_bytes=(3 + residual) * elems * itemsize + rows * 8 + parts,
                        launches=1)
    reduce = KernelCost(vector_flops=parts / 4, hbm_bytes=parts + 2 * width * itemsize,
                        launches=1)
    return kernel + reduce


# ---- LM-head cross-entropy --------------------------------------------------------------------
def xent_fwd_cost(rows: int, width: int, vocab: int, itemsize: int = 2, vocab_shards: int = 1,
                  blocks: xent_mod.XentBlocks = xent_mod.DEFAULT_BLOCKS) -> KernelCost:
    """Forward kernel on one shard (``vocab`` = this shard's columns): the logits matmul, the
    online log-sum-exp; every row block streams the whole local head. Vocabulary-parallel: a
    max all-reduce and one sum all-reduce of two floats per row."""
    bn = block(rows, blocks.block_rows)
    logits = rows * vocab
    head_reads = -(-rows // bn) * width * vocab * itemsize
    comm = (("all-reduce", 4.0 * rows), ("all-reduce", 8.0 * rows)) if vocab_shards > 1 else ()
    return KernelCost(matmul_flops=2.0 * logits * width, vector_flops=5.0 * logits,
                      transcendentals=float(logits),
                      hbm_bytes=rows * width * itemsize + head_reads + rows * 16, launches=1,
                      collectives=comm)


def xent_bwd_cost(rows: int, width: int, vocab: int, itemsize: int = 2, vocab_shards: int = 1,
                  blocks: xent_mod.XentBlocks = xent_mod.DEFAULT_BLOCKS) -> KernelCost:
    """Per vocabulary chunk: the gradient kernel (recomputes the logits), then XLA's
    ``dh += g w_c^T`` and ``dw_c = h^T g``. Vocabulary-parallel: an all-reduce of ``dloss``
    and of the partial ``dh``."""
    chunks = math.ceil(vocab / max(1, min(blocks.chunk_vocab, vocab)))
    logits = rows * vocab
    grads = KernelCost(matmul_flops=2.0 * logits * width, vector_flops=4.0 * logits,
                       transcendentals=float(logits),
                       hbm_bytes=(chunks * rows * width + width * vocab + logits) * itemsize
                       + rows * 12 * chunks, launches=chunks)
    gemms = KernelCost(matmul_flops=4.0 * logits * width,
                       hbm_bytes=2 * logits * itemsize + 2 * width * vocab * itemsize
                       + chunks * rows * width * (itemsize + 8), launches=2 * chunks)
    comm = ((("all-reduce", 4.0 * rows), ("all-reduce", float(rows * width * itemsize)))
            if vocab_shards > 1 else ())
    return grads + gemms + KernelCost(collectives=comm)


# ---- adamw ------------------------------------------------------------------------------------
def adamw_cost(elements: int, param_itemsize: int = 4, grad_itemsize: int = 4,
               moment_itemsize: int = 4) -> KernelCost:
    """One leaf: read p, g, mu, nu; write p, mu, nu."""
    e = elements
    return KernelCost(vector_flops=16.0 * e, transcendentals=float(e),
                      hbm_bytes=e * (2 * param_itemsize + grad_itemsize + 4 * moment_itemsize),
                      launches=1)


def adamw_bwd_cost(elements: int, param_itemsize: int = 4, grad_itemsize: int = 4,
                   moment_itemsize: int = 4, block: int = 1024) -> KernelCost:
    """The VJP kernel: read p, g, mu, nu and three cotangents, write four gradients."""
    e = elements
    per = 2 * param_itemsize + 2 * grad_itemsize + 6 * moment_itemsize + param_itemsize
    return KernelCost(vector_flops=40.0 * e, transcendentals=float(e),
                      hbm_bytes=e * per + -(-e // block) * 512, launches=2)
