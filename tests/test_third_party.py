"""Third-party models: HF transformers Flax models, as a user brings them.

Each family (tiny config, random weights, no downloads) trains one adamw step: traced, planned on
the 2x4 mesh, run under ``@autopar.autoparallel`` with loss, gradients (Adam's first moment after
one step is 0.1 x the gradient) and updated parameters equal to the unsharded step, and planned
with every hand-written strategy. Role-finding is checked where it matters most: Megatron puts
every attention and MLP kernel of GPT-2 and Llama on the model axis.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _steps import assert_same_update
from jax.sharding import PartitionSpec as P

import autopar
import ir
from autopar import strategies
from autopar.api import plan_graph
from autopar.models import adamw_step, hf
from autopar.strategies.roles import path_keys

pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")

MESH = {"data": 2, "model": 4}
MODELS = ("gpt2", "llama", "bert", "t5", "vit", "bart", "whisper")
HAND_WRITTEN = ("dp", "zero1", "zero2", "zero3", "megatron", "megatron_sp", "fsdp_tp", "ep")
KERNEL_ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out")


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


@functools.cache
def _concrete(name: str):
    return hf.concrete(name, hf.tiny(name), batch_size=8)


@functools.cache
def _graph(name: str) -> ir.Graph:
    step, state, batch = _concrete(name)
    return ir.trace(step, state, batch)


@functools.cache
def _reference(name: str):
    """The unsharded step's new state and loss, and its gradient: Adam's first moment after one
    step from zero is exactly (1 - b1) x the gradient, b1 = 0.9."""
    step, state, batch = _concrete(name)
    new_state, loss = jax.jit(step)(state, batch)
    grads = jax.tree_util.tree_map(lambda m: m / 0.1, new_state["opt_state"][0].mu)
    return new_state, loss, grads


@functools.cache
def _run(name: str, strategy: str = "auto"):
    step, state, batch = _concrete(name)
    sharded = autopar.autoparallel(step, mesh=_mesh(), strategy=strategy, time_limit_s=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # notes are checked on their own
        new_state, loss = sharded(state, batch)
    return sharded.plan, new_state, loss


def _assert_same_step(name: str, strategy: str) -> None:
    plan, new_state, loss = _run(name, strategy)
    _, state, _ = _concrete(name)
    ref_state, ref_loss, grads = _reference(name)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    mu = new_state["opt_state"][0].mu
    for got, want in zip(jax.tree_util.tree_leaves(mu),
                         jax.tree_util.tree_leaves(ref_state["opt_state"][0].mu)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)
    for old, got, want, g in zip(*(jax.tree_util.tree_leaves(t) for t in (
            state["params"], new_state["params"], ref_state["params"], grads))):
        assert_same_update(*(np.asarray(x) for x in (old, got, want, g)))


# ---- numerics -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_autoparallel_matches_unsharded_step(name):
    _assert_same_step(name, "auto")
    plan = _run(name, "auto")[0]          # the cached run above: the same arguments
    assert not plan.solver.status.endswith("(time limit)"), plan.solver.status


@pytest.mark.parametrize("name", ("gpt2", "llama"))
def test_megatron_matches_unsharded_step(name):
    _assert_same_step(name, "megatron")


# ---- roles and hand-written strategies ------------------------------------------------------
@pytest.mark.parametrize("name", ("gpt2", "llama"))
def test_megatron_puts_every_attention_and_mlp_kernel_on_the_model_axis(name):
    g = _graph(name)
    info = strategies.annotate(g)
    layouts = strategies.get("megatron").fix_inputs(g, MESH)
    kernels = [k for k, a in enumerate(info) if a.kind == "param" and a.role in KERNEL_ROLES]
    per_layer = 4 if name == "gpt2" else 7          # c_attn, c_proj, c_fc, c_proj / q,k,v,o,3 mlp
    assert len(kernels) == 2 * per_layer, [g.input_paths[k] for k in kernels]
    for k in kernels:
        assert any("model" in dim for dim in layouts[k]), (g.input_paths[k], layouts[k])
    plan = _run(name, "megatron")[0]
    for k in kernels:
        assert any("model" in dim for dim in plan.input_shardings[k]), g.input_paths[k]


def test_gpt2_fused_conv1d_roles():
    """GPT-2 stores Conv1D kernels output-major and fuses q, k and v: found from the graph."""
    g = _graph("gpt2")
    by_path = {p: a for p, a in zip(g.input_paths, strategies.annotate(g))}
    h0 = "[0]['params']['transformer']['h']['0']"
    assert by_path[f"{h0}['attn']['c_attn']['kernel']"].names == ("heads", "embed")
    assert by_path[f"{h0}['attn']['c_proj']['kernel']"].names == ("embed", "heads")
    assert by_path[f"{h0}['mlp']['c_fc']['kernel']"].names == ("mlp", "embed")
    assert by_path[f"{h0}['mlp']['c_proj']['kernel']"].names == ("embed", "mlp")
    assert by_path[f"{h0}['attn']['c_attn']['bias']"].names == ("heads",)
    assert by_path["[0]['params']['transformer']['wte']['embedding']"].role == "embedding"
    assert by_path["[0]['params']['transformer']['wpe']['embedding']"].role == "position"


def test_llama_gated_mlp_roles():
    g = _graph("llama")
    roles = {path_keys(p)[-2]: a.role for p, a in zip(g.input_paths, strategies.annotate(g))
             if a.kind == "param" and "['0']" in p}
    assert roles["q_proj"] == roles["k_proj"] == roles["v_proj"] == "attn_in"
    assert roles["o_proj"] == "attn_out"
    assert roles["gate_proj"] == roles["up_proj"] == "mlp_in" and roles["down_proj"] == "mlp_out"


@pytest.mark.parametrize("name", ("gpt2", "llama", "bert", "t5", "vit"))
@pytest.mark.parametrize("strategy", HAND_WRITTEN)
def test_every_hand_written_strategy_plans(name, strategy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_graph(_graph(name), MESH, hardware="h100", strategy=strategy,
                          time_limit_s=1)
    assert plan.strategy == strategy and plan.cost.step_time_s > 0
    said = [str(w.message) for w in caught if "cannot place" in str(w.message)]
    assert bool(said) == bool(plan.notes)
    if strategy == "ep":    # no HF model here has experts: the plan says so
        assert any("no expert parameters" in n for n in plan.notes)
        assert "no expert parameters" in plan.summary()
    if strategy in ("megatron", "megatron_sp", "fsdp_tp"):
        kernels = [k for k, a in enumerate(strategies.annotate(_graph(name)))
                   if a.role in KERNEL_ROLES]
        assert all(any("model" in d for d in plan.input_shardings[k]) for k in kernels)


def test_vit_notes_name_what_megatron_cannot_split():
    g = _graph("vit")
    notes = strategies.get("megatron").bind(g, MESH).notes
    assert any("classifier" in n and "not divisible" in n for n in notes), notes
    assert any("patch_embeddings" in n and "conv" in n for n in notes), notes


# ---- a model that is a plain dict of arrays -------------------------------------------------
def _plain_step():
    def loss_fn(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])        # (B, H)
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    tx = optax.adamw(1e-2)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.1, "b1": jnp.zeros((32,)),
              "w2": jax.random.normal(k2, (32, 8)) * 0.1}
    # the step's state is a tuple, not a dict with a 'params' key
    step = adamw_step(loss_fn, tx)
    state = {"weights": params, "opt": tx.init(params)}

    def tuple_step(st, batch):
        new, loss = step({"params": st["weights"], "opt_state": st["opt"]}, batch)
        return {"weights": new["params"], "opt": new["opt_state"]}, loss

    batch = {"x": jax.random.normal(k3, (16, 16)), "y": jnp.ones((16, 8))}
    return tuple_step, state, batch


def test_dp_keeps_plain_dict_parameters_replicated():
    step, state, batch = _plain_step()
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="cpu", strategy="dp",
                        time_limit_s=1)
    for path, spec in zip(plan.input_paths, plan.input_shardings):
        if "['weights']" in path or ".mu" in path or ".nu" in path:
            assert all(not d for d in spec), (path, spec)
    assert plan.spec_of("['x']") == P("data")
    kinds = {p: a.kind for p, a in zip(plan.input_paths, strategies.annotate(
        ir.trace(step, state, batch)))}
    assert kinds["[0]['weights']['w1']"] == "param"
    assert kinds["[0]['opt'][0].mu['w1']"] == "opt_state" and kinds["[1]['x']"] == "batch"


def test_megatron_on_plain_dict_splits_the_hidden_layer():
    step, state, batch = _plain_step()
    g = ir.trace(step, state, batch)
    layouts = strategies.get("megatron").fix_inputs(g, MESH)
    spec = {p: layouts[k] for k, p in enumerate(g.input_paths)}
    assert spec["[0]['weights']['w1']"] == ((), ("model",))
    assert spec["[0]['weights']['b1']"] == (("model",),)
    assert spec["[0]['weights']['w2']"] == (("model",), ())
