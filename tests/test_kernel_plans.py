"""Plans with fused kernels: the planner offers and chooses them, ``plan.kernels`` records them
(saved, loaded, validated, summarised), and codegen runs them in ``shard_map`` with the plan's
per-shard specs. Whole GPT and Llama-style adamw steps with kernels (Pallas interpret mode on the
8 CPU devices) equal the unfused step: loss, updated parameters and the optimizer state, whose
first moment after one step is 0.1 x the gradient, so the gradients are compared too.
"""
from __future__ import annotations

import functools
import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import autopar
from autopar.models import gpt, llama
from autopar.plan import Plan

GPT = gpt.GPTConfig(vocab=64, seq=16, d_model=32, heads=4, d_ff=64, layers=1)
LLAMA = llama.LlamaConfig(vocab=64, seq=16, d_model=32, heads=8, kv_heads=4, d_ff=48, layers=1)
MODELS = {"gpt": (gpt, GPT), "llama": (llama, LLAMA)}
BATCH = 8
PARAM_ATOL = 1e-5     # one adamw step turns rounding in a near-zero gradient into up to lr 1e-3


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    names = ("data", "model", "extra")[: len(shape)]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


@functools.cache
def model(name: str):
    """``(step, state, batch, unfused result)`` of a tiny model, made once per module run."""
    module, cfg = MODELS[name]
    step, state, batch = module.concrete(cfg, BATCH)
    return step, state, batch, jax.jit(step)(state, batch)


def _assert_same(out, ref):
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=PARAM_ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def _split_kinds(plan: Plan) -> set[tuple[str, str]]:
    """(kernel, kernel dim) pairs some mesh axis splits."""
    return {(k.kernel, dim) for k in plan.kernels for dim, axes in k.split if axes}


# (model, mesh shape) -> (strategy, solver seconds, (kernel, split dim) pairs the plan must show).
# The solver runs on its deterministic clock: the same plan on every run.
DP8 = autopar.strategies.get("dp", data_axis="model")
ROWS = {("attention", "batch"), ("norm", "rows0"), ("xent", "rows0")}
CASES = {
    ("gpt", (1, 8)): (DP8, 2, ROWS),
    # (vocabulary-parallel cross-entropy: test_planner_chooses_kernels_by_cost)
    ("gpt", (2, 4)): ("megatron", 10, {("attention", "heads"), ("norm", "rows0"),
                                       ("adamw", "dim0")}),
    ("gpt", (2, 2, 2)): ("fsdp_tp", 2, {("attention", "heads"), ("adamw", "dim0")}),
    ("llama", (1, 8)): (DP8, 2, ROWS),
    ("llama", (2, 4)): ("megatron", 2, {("attention", "heads"), ("adamw", "dim0")}),
    ("llama", (2, 2, 2)): ("fsdp_tp", 2, {("attention", "heads"), ("attention", "batch"),
                                          ("adamw", "dim0")}),
}


@pytest.mark.parametrize("name, shape", sorted(CASES))
def test_training_step_with_kernels_matches_unfused(name, shape):
    step, state, batch, ref = model(name)
    strategy, seconds, wanted = CASES[name, shape]
    s = autopar.autoparallel(step, mesh=make_mesh(shape), hardware="h100", time_limit_s=seconds,
                             strategy=strategy, kernels="always")
    _assert_same(s(state, batch), ref)
    kinds = Counter(k.kernel for k in s.plan.kernels)
    assert kinds["attention"] == 1 and kinds["adamw"] >= 1, kinds
    missing = wanted - _split_kinds(s.plan)
    assert not missing, f"{name} on {shape}: no kernel split as {missing}: {s.plan.kernels}"


def test_saved_plan_runs_its_kernels():
    """A plan with kernels survives JSON and runs the same kernels from the loaded copy."""
    step, state, batch, ref = model("gpt")
    mesh = make_mesh((1, 8))
    planned = autopar.autoparallel(step, mesh=mesh, hardware="h100", time_limit_s=2,
                                   strategy=DP8, kernels="always")
    planned.lower(state, batch)
    loaded = Plan.from_json(planned.plan.to_json())
    assert loaded == planned.plan and loaded.kernels
    _assert_same(autopar.autoparallel(step, mesh=mesh, plan=loaded)(state, batch), ref)


# ---- the planner's choice (abstract shapes, an H100 cluster that is not here) -----------------
@pytest.fixture(scope="module")
def h100_plans():
    """A one-layer bfloat16 GPT with a 32k vocabulary, Megatron layouts on 2 x 4 H100s, planned
    with and without kernels. Narrow (width 256) so that the logits, not the matmuls, dominate
    the LM head: there the fused cross-entropy saves most."""
    cfg = gpt.GPTConfig(vocab=32768, seq=512, d_model=256, heads=4, d_ff=1024, layers=1,
                        dtype=jnp.bfloat16)
    args = gpt.abstract(cfg, 16)
    return {k: autopar.plan(*args, mesh={"data": 2, "model": 4}, hardware="h100",
                            strategy="megatron", time_limit_s=3, kernels=k)
            for k in ("never", "auto")}


def test_planner_chooses_kernels_by_cost(h100_plans):
    never, auto = h100_plans["never"], h100_plans["auto"]
    assert not never.kernels
    splits = _split_kinds(auto)
    # the vocabulary-parallel fused cross-entropy wins over the sharded logits, and attention
    # runs head-parallel
    assert ("xent", "vocab") in splits and ("attention", "heads") in splits, auto.kernels
    for k in auto.kernels:
        assert 0 < k.kernel_s < k.xla_s, k          # chosen only where the cost model says so
        assert k.op_ids and k.sources and k.specs
    assert auto.cost.step_time_s < never.cost.step_time_s


def test_summary_and_json_show_kernels(h100_plans):
    auto = h100_plans["auto"]
    text = auto.summary()
    assert "vocab=model" in text and "attention" in text and "gpt.py" in text
    assert "<th>per-shard specs</th>" in auto._repr_html_()
    assert Plan.from_json(auto.to_json()) == auto


def _damaged(plan: Plan, **changes) -> str:
    d = json.loads(plan.to_json())
    d["kernels"][0].update(changes)
    return json.dumps(d)


@pytest.mark.parametrize("changes, message", [
    ({"kernel": "matmul"}, r"kernels\[0\]\.kernel is 'matmul'; a kernel is one of"),
    ({"split": [["vocab", ["tensor"]]]}, r"kernels\[0\]\.split names mesh axis 'tensor'"),
    ({"op_ids": []}, r"kernels\[0\]\.op_ids is empty"),
    ({"kernel_s": -1}, r"kernels\[0\]\.kernel_s must be a finite number"),
])
def test_damaged_kernel_entries_are_refused(h100_plans, changes, message):
    with pytest.raises(autopar.PlanError, match=message):
        Plan.from_json(_damaged(h100_plans["auto"], **changes))


def test_kernel_option_errors(h100_plans):
    step, state, batch = gpt.abstract(GPT, BATCH)
    with pytest.raises(autopar.AutoparError, match=r"kernels='sometimes' must be one of"):
        autopar.plan(step, state, batch, mesh={"data": 8}, kernels="sometimes")
    with pytest.raises(autopar.AutoparError, match=r"kernels= would be ignored"):
        autopar.autoparallel(step, mesh=make_mesh((1, 8)), kernels="auto",
                             plan=h100_plans["never"])


def test_auto_is_never_on_cpu_devices():
    import cost_models
    from autopar import validate

    h100 = cost_models.hardware("h100")
    assert validate.kernels("auto", h100, make_mesh((2, 4))) == "never"
    assert validate.kernels("auto", h100, {"data": 8}) == "auto"
    assert validate.kernels("always", h100, make_mesh((2, 4))) == "always"


@pytest.mark.parametrize("masked", [False, True])
def test_attention_halves_split_over_the_sequence(masked):
    """The halves codegen runs, with queries split over the sequence (keys and values gathered,
    their gradients reduce-scattered), equal the unsharded causal attention's VJP; masked: a
    per-batch padding bias and a per-head boolean mask, split with the query rows."""
    from autopar.kernels import AttentionBlocks, Masks, attention_reference
    from autopar.kernels import halves as kh

    blocks = AttentionBlocks(block_q=4, block_k=4, block_q_bwd=4, block_k_bwd=4)
    rng = np.random.default_rng(0)
    q, dout = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32) for _ in range(2))
    masks = Masks()
    if masked:
        bias = np.zeros((2, 1, 16, 16), np.float32)
        bias[1, :, :, 12:] = np.finfo(np.float32).min            # row 1 pads its last 4 keys
        keep = rng.random((1, 4, 16, 16)) > 0.2
        keep[..., 0] = True                                       # every query sees key 0
        masks = Masks(jnp.asarray(bias), jnp.asarray(keep), -1e9)
    mesh = make_mesh((2, 4))
    split = dict(mesh=mesh, batch="data", seq="model", blocks=blocks, masks=masks)

    @jax.jit
    def halves(q, k, v, dout):
        out, lse = kh.attention_fwd_sharded(q, k, v, **split)
        return (out,) + kh.attention_bwd_sharded(q, k, v, out, lse, dout, **split)

    ref = functools.partial(attention_reference, masks=masks)
    out, vjp = jax.vjp(ref, q, k, v)
    for got, want in zip(halves(q, k, v, dout), (out,) + vjp(dout)):
        np.testing.assert_allclose(got, want, atol=2e-5)
