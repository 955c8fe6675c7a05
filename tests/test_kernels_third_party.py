"""Fused kernels on the models users bring, one layer each, on the 2x4 mesh with
``kernels="always"`` (Pallas interpret mode on the 8 CPU devices):

  * transformers' Flax Llama: grouped-query attention (k, v repeated over the heads), rotary
    embeddings, a padding ``attention_mask`` from the batch (a bias read as data), RMSNorm
    written as ``x / sqrt(mean(x^2) + eps)``;
  * Mistral: a sliding-window mask (a constant, not causal: read as data);
  * Gemma: multi-query attention, RMSNorm scaled by ``(1 + w)``, the head tied to the embedding;
  * GPT-2: fused q/k/v, LayerNorm, the tied head, planned from Megatron's layouts;
  * an NNX language model: ``nnx.MultiHeadAttention`` with grouped-query heads and the batch's
    padding mask (a boolean mask over grouped scores), ``nnx.RMSNorm``, optax's cross-entropy.

Each plan takes every kind of kernel (attention, norm, LM-head cross-entropy, AdamW) and the
step equals the unsharded step without kernels: loss, gradients, updated parameters. Where a
plan leaves a match to XLA it says why (``Plan.rejected_kernels`` and the summary): inside a
``scan`` body, under ``jax.checkpoint``.
"""
from __future__ import annotations

import functools
from collections import Counter

import jax
import numpy as np
import optax
import pytest
from _steps import assert_same_step

import autopar
from autopar.models import hf, nnx_lm
from autopar.plan import Plan

pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")

MESH = {"data": 2, "model": 4}
NNX = nnx_lm.NNXLMConfig(layers=1, kv_heads=2)


def _hf(name: str, **tiny):
    """A one-layer model of family ``name`` with random normal weights drawn on the host
    (transformers' initialisers compile a program per model: seconds, for nothing checked
    here) and the batch's padding mask for Llama."""
    def make():
        config = hf.tiny(name, layers=1, width=32, **tiny)
        step, state, batch = hf.abstract(name, config, 8, padding=name == "llama")
        rng = np.random.default_rng(0)
        params = jax.tree_util.tree_map(
            lambda x: np.asarray(0.2 * rng.standard_normal(x.shape), x.dtype),
            state["params"])
        tx = optax.adamw(1e-3, weight_decay=0.01)     # hf.make_train_step's
        return step, {"params": params, "opt_state": tx.init(params)}, hf.make_batch(
            name, config, 8, padding=name == "llama")
    return make


# name -> (make (step, state, batch), strategy)
CASES = {
    "llama": (_hf("llama", kv_heads=2), "dp"),
    "mistral": (_hf("mistral"), "dp"),
    "gemma": (_hf("gemma"), "dp"),
    "gpt2": (_hf("gpt2"), "megatron"),
    "nnx": (lambda: nnx_lm.concrete(NNX, 8), "dp"),
}


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_on_third_party_models_match_the_unsharded_step(name):
    make, strategy = CASES[name]
    step, state, batch = make()
    sharded = autopar.autoparallel(step, mesh=_mesh(), strategy=strategy, hardware="h100",
                                   time_limit_s=1, kernels="always")
    out = sharded(state, batch)
    assert_same_step(state, out, jax.jit(step)(state, batch))
    kinds = Counter(k.kernel for k in sharded.plan.kernels)
    assert set(kinds) == {"attention", "norm", "xent", "adamw"}, (kinds,
                                                                  sharded.plan.rejected_kernels)
    assert kinds["attention"] == 1 and kinds["norm"] == 3, kinds
    left = {r.kernel for r in sharded.plan.rejected_kernels}
    assert not left & {"attention", "norm", "xent"}, sharded.plan.rejected_kernels


# ---- what the plan leaves to XLA, and why (abstract shapes: nothing runs) ----------------------
@functools.cache
def _abstract_plan(which: str) -> Plan:
    args = {"nnx_scan": lambda: nnx_lm.abstract(nnx_lm.NNXLMConfig(layers=2, scan=True), 8),
            "llama_remat": lambda: hf.abstract("llama", hf.tiny("llama", layers=1, width=32),
                                               8, remat=True)}[which]()
    return autopar.plan(*args, mesh=MESH, hardware="h100", strategy="dp", time_limit_s=1,
                        kernels="always")


@pytest.mark.parametrize("which, reason", [
    ("nnx_scan", "inside a loop body"),
    ("llama_remat", "inside remat2"),
])
def test_summary_says_why_a_kernel_site_was_rejected(which, reason):
    plan = _abstract_plan(which)
    rejected = [r for r in plan.rejected_kernels if r.kernel == "attention"]
    assert rejected and all(reason in r.reason for r in rejected), plan.rejected_kernels
    assert all(r.op_ids and r.sources for r in rejected)
    text = plan.summary()
    assert "kernel sites left to XLA's ops" in text and reason in text, text
    assert "<th>left to XLA</th>" in plan._repr_html_()
    assert Plan.from_json(plan.to_json()) == plan       # saved and loaded with the plan
