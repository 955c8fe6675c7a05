"""Pipelining unrolled models (autopar's GPT with scan=False, HF's Flax GPT-2): their numbered
layers found and stacked, and the pipelined step equal to the user's own unsharded step."""
import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from numerics import assert_params, assert_scaled

import autopar
from autopar import strategies
from autopar.errors import AutoparError
from autopar.models import gpt
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S
from autopar.pipeline import unrolled as U

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=False)
LR = 1e-3
MESH_A = {"stage": 2, "data": 2, "model": 2}
MESH_B = {"stage": 4, "data": 2}


def _gpt():
    step, init = PM.gpt_train_step(CFG, LR)
    return step, init(jax.random.PRNGKey(0), 8), gpt.make_batch(CFG, 8)


def _hf_config():
    pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")
    from autopar.models import hf

    return hf.tiny("gpt2", layers=4, width=32)          # 4 heads of 8, MLP 64 wide


def _hf_gpt2():
    from autopar.models import hf
    from autopar.pipeline import hf as PH

    config = _hf_config()
    step, init = PH.gpt2_train_step(config, LR)
    return step, init(jax.random.PRNGKey(0)), hf.make_batch("gpt2", config, 8, seq=8)


MAKERS = {"gpt": _gpt, "hf_gpt2": _hf_gpt2}


@pytest.fixture(scope="module")
def models():
    """Per model: the step, its state and batch (the user's layout) and the unsharded step's
    new state and loss, made on first use."""
    made = {}

    def get(name):
        if name not in made:
            step, state, batch = MAKERS[name]()
            made[name] = (step, state, batch, *jax.jit(step)(state, batch))
        return made[name]

    return get


def _mesh(shape: dict):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(*shape.values()), tuple(shape))


# ---- the layers found and stacked -------------------------------------------------------------
@pytest.mark.parametrize("name,want", [
    ("gpt", U.Stacking((), "layer_", 4, "layer", False)),
    ("hf_gpt2", U.Stacking(("transformer", "h"), "", 4, "layers", True, (
        ("attn/c_attn/kernel", (96, 32), (3, 4, 8, 32)), ("attn/c_attn/bias", (96,), (3, 4, 8)),
        ("attn/c_proj/kernel", (32, 32), (32, 4, 8)))))])
def test_layers_are_found_and_stack_back_exactly(models, name, want):
    step, state, *_ = models(name)
    sm = PM.staged_model_of(step)
    assert sm.stacking == want and sm.num_layers == 4
    stacked = sm.stacking.stack_state(state)
    layers, rest = sm.split(stacked["params"])
    assert all(x.shape[0] == 4 for x in jax.tree_util.tree_leaves(layers))
    for path, own, view in want.views:      # row-major reshapes of each layer's leaf
        keys = path.split("/")
        got = functools.reduce(operator.getitem, keys, layers)[1]
        user = functools.reduce(operator.getitem, keys, state["params"]["transformer"]["h"]["1"])
        assert got.shape == view and user.shape == own
        np.testing.assert_array_equal(got.reshape(own), user)
    n = len(jax.tree_util.tree_leaves(state["params"]))      # 4 layers' leaves and the rest's
    assert n == 4 * len(jax.tree_util.tree_leaves(layers)) + len(jax.tree_util.tree_leaves(rest))
    adam = stacked["opt_state"][0]        # Adam's moments stacked like the parameters
    assert jax.tree_util.tree_structure(adam.mu) == jax.tree_util.tree_structure(stacked["params"])
    assert_scaled(sm.stacking.unstack_state(stacked), state, rel=0, atol=0)


def test_layer_finding_errors_name_what_was_found():
    params = {"wte": jnp.zeros((8, 4)), "block_0": {"w": jnp.zeros((4, 4))},
              "block_1": {"w": jnp.zeros((4, 5))}}
    with pytest.raises(AutoparError, match="block_1 differs in shapes"):
        U.find(params)
    with pytest.raises(AutoparError, match="found no numbered layers.*'wte'"):
        U.find({"wte": jnp.zeros((8, 4)), "layers": {"w": jnp.zeros((2, 4, 4))}})
    two = {"enc": {"0": {"w": jnp.zeros(3)}, "1": {"w": jnp.zeros(3)}},
           "dec": {"0": {"w": jnp.zeros(2)}, "1": {"w": jnp.zeros(2)}}}
    with pytest.raises(AutoparError, match="2 stacks of numbered layers.*where="):
        U.find(two)
    assert U.find(two, where="dec").parent == ("dec",)
    model = PM.gpt_staged(dataclasses.replace(CFG, scan=True))
    with pytest.raises(AutoparError, match=r"view of w has shape \(2, 3\).*parameter: \(3,\)"):
        U.unrolled(model, two, where="enc", views={"w": (2, 3)})
    with pytest.raises(AutoparError, match=r"view of v .*no such leaf.*\['w'\]"):
        U.unrolled(model, two, where="enc", views={"v": (3,)})


# ---- numerics ---------------------------------------------------------------------------------
# Every schedule on {stage: 2, data: 2, model: 2} (gpipe, 1f1b, eager_1f1b, and with 2 virtual
# stages interleaved 1f1b and circular gpipe), two on {stage: 4, data: 2}, shared between the two
# models (each compile costs ~10 s of CPU): HF GPT-2's 1f1b on the first mesh runs through
# autopar.plan and @autoparallel below.
CASES = [("gpt", MESH_A, "gpipe", 1), ("gpt", MESH_A, "1f1b", 2), ("gpt", MESH_A, "eager_1f1b", 1),
         ("gpt", MESH_B, "1f1b", 1), ("hf_gpt2", MESH_A, "gpipe", 2),
         ("hf_gpt2", MESH_B, "gpipe", 1)]


@pytest.mark.parametrize("name,shape,schedule,virtual", CASES)
def test_step_equals_the_users_unsharded_step(models, name, shape, schedule, virtual):
    """Loss, gradients (Adam's moments) and updated parameters, in the user's own layout."""
    step, state, batch, ref_state, ref_loss = models(name)
    sm = PM.staged_model_of(step)
    run = R.build_step(sm, _mesh(shape), S.build(schedule, shape["stage"], virtual, 4))
    stacked = run.stack_state(state)
    kernel = [x for p, x in jax.tree_util.tree_flatten_with_path(stacked["params"])[0]
              if ("fc" in jax.tree_util.keystr(p) or "attn" in jax.tree_util.keystr(p))
              and x.ndim >= 3]
    assert len(kernel) == 4 and all(k.sharding.spec[0] == "stage" for k in kernel)
    if "model" in shape:                # the MLP and the attention split inside a stage
        assert all("model" in tuple(k.sharding.spec) for k in kernel)
    new, loss = run(stacked, batch)
    new = run.unstack_state(new)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    adam, ref_adam = new["opt_state"][0], ref_state["opt_state"][0]
    assert_scaled(adam.mu, ref_adam.mu, rel=1e-5)
    assert_scaled(adam.nu, ref_adam.nu, rel=2e-5)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_adam.mu)


def test_hf_gpt2_stage_runs_megatron_with_all_reduces_only(models):
    """Inside the tick loop, the only collectives of HF GPT-2 on {stage: 2, data: 2, model: 2}
    are the stage ppermutes (activations on, cotangents back) and all-reduces over the model
    axis: per layer, one after each row-split projection (attention's and the MLP's c_proj) in
    a forward, and in a backward those two again (the chunk is recomputed under vjp) plus one
    for the input gradient of each column-split one (c_attn, c_fc); two action places per
    tick. No collective-permute realigns q, k, v: each device holds whole heads."""
    from autopar import hlo

    step, state, batch, *_ = models("hf_gpt2")
    sch = S.build("gpipe", 2, 1, 4)
    run = R.build_step(PM.staged_model_of(step), _mesh(MESH_A), sch)
    stacked = run.stack_state(state)
    module = hlo.parse(run.jitted(stacked, batch).lower(stacked, batch).compile().as_text())
    attrs = {i.name: i.attrs for body in module.computations.values() for i in body}
    ticks, per_chunk = len(sch.ticks), 2
    looped = [c for c in hlo.collectives(module) if c.count > 1]
    permutes = [c for c in looped if c.kind == "collective-permute"]
    assert [c.count for c in permutes] == [ticks, ticks]
    reduced = [c for c in looped if c.kind != "collective-permute"]
    assert {(c.kind, c.group_size, c.count) for c in reduced} == {
        ("all-reduce", 2, ticks * per_chunk)}           # in the chunk's loop over its layers
    assert len(reduced) == 2 * (2 + 2 + 2)
    # groups of 2 consecutive devices: the model axis (the mesh's minor one), not data's
    assert all("replica_groups=[4,2]<=[8]" in attrs[c.name] for c in reduced)


def test_heads_the_tensor_axis_does_not_divide_stay_whole():
    """3 heads on model=2: attention whole on each device of a stage, the MLP (48 wide) split;
    megatron_3d's plan states the layouts the runtime places (no raw jax error on an uneven
    split), and so does the auto plan, whose layouts are the ILP's."""
    from transformers import GPT2Config

    from autopar.models import hf
    from autopar.pipeline import hf as PH

    config = GPT2Config(vocab_size=64, n_layer=2, n_embd=24, n_head=3, n_positions=16,
                        n_inner=48)
    step, init = PH.gpt2_train_step(config, LR)
    state = jax.eval_shape(init, jax.random.PRNGKey(0))
    batch = jax.eval_shape(lambda: hf.make_batch("gpt2", config, 8, seq=8))
    sm = PM.staged_model_of(step)
    run = R.build_step(sm, _mesh(MESH_A), S.build("gpipe", 2, 1, 2))
    stacked = jax.eval_shape(sm.stacking.stack_state, state)
    h = run.in_shardings_of(stacked, batch)[0]["params"]["transformer"]["h"]
    assert h["attn"]["c_attn"]["kernel"].spec == P("stage", None, None, None, None)
    assert h["mlp"]["c_fc"]["kernel"].spec == P("stage", "model", None)
    plan = strategies.get("megatron_3d", microbatches=2, schedule="gpipe").plan(
        step, state, batch, mesh=MESH_A, hardware="cpu")
    h = "['params']['transformer']['h']"
    assert tuple(plan.spec_of(f"{h}['attn']['c_attn']['kernel']")) == ("stage",)
    assert tuple(plan.spec_of(f"{h}['mlp']['c_fc']['kernel']")) == ("stage", "model")
    auto = autopar.plan(step, state, batch, mesh=MESH_A, hardware="cpu",
                        pipeline={"schedule": "gpipe", "microbatches": 2})
    for p in (plan, auto):
        placed = PL.executable(p, step, _mesh(MESH_A)).in_shardings_of(stacked, batch)[0]
        for name, leaf in jax.tree_util.tree_leaves_with_path(placed["params"]):
            want = p.spec_of("['params']" + "".join(f"['{k.key}']" for k in name))
            assert _trim(leaf.spec) == _trim(want), name


def _trim(spec) -> tuple:
    dims = list(spec)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def test_hf_gpt2_staged_layer_is_hf_block(models):
    """The staged layer on the stacked (head-major) layout computes HF's FlaxGPT2Block."""
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

    step, state, *_ = models("hf_gpt2")
    sm = PM.staged_model_of(step)
    layers, _ = sm.split(sm.stacking.stack(state["params"]))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))
    got = sm.layer(jax.tree_util.tree_map(lambda a: a[2], layers), x)
    own = state["params"]["transformer"]["h"]["2"]
    want = FlaxGPT2Block(_hf_config()).apply({"params": own}, x,
                                             attention_mask=jnp.ones((2, 8), "i4"))[0]
    assert_scaled(got, want, rel=0, atol=1e-6)


def test_the_users_layout_is_refused_with_the_conversion(models):
    step, state, batch, *_ = models("gpt")
    run = R.build_step(PM.staged_model_of(step), _mesh(MESH_B), S.build("1f1b", 4, 1, 4))
    with pytest.raises(AutoparError, match=r"step.stack_state\(state\)"):
        run(state, batch)
    bad = {**state, "params": {k: v for k, v in state["params"].items() if k != "layer_3"}}
    with pytest.raises(AutoparError, match="neither the model's layout"):
        run(bad, batch)


def test_autoparallel_pipelines_hf_gpt2(models):
    """``autopar.plan`` takes the user's layout (shapes converted), ``@autoparallel`` runs the
    stacked one; the result, unstacked, equals HF's own unsharded step."""
    step, state, batch, ref_state, ref_loss = models("hf_gpt2")
    pins = {"schedule": "1f1b", "microbatches": 4, "runtime": "lockstep"}     # lowered below
    plan = autopar.plan(step, state, batch, mesh=MESH_A, hardware="cpu", pipeline=pins)
    assert plan.pipeline.layer_ranges == ((0, 2), (2, 4))
    run = autopar.autoparallel(step, mesh=_mesh(MESH_A), plan=plan)
    new, loss = run(state, batch)       # the user's layout, converted on the way in
    again, _ = run(run.stack_state(state), batch)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(new)
    # the stacked layers run on their stages in the layouts the stage costs priced
    layouts = dict(plan.pipeline.layer_layouts)
    for name in ("mlp/c_fc/kernel", "attn/c_attn/kernel"):
        keys = "".join(f"['{k}']" for k in name.split("/"))
        spec = _trim(plan.spec_of(f"['params']['transformer']['h']{keys}"))
        assert spec == _trim(("stage", *(d[0] if d else None for d in layouts[name])))
        leaf = functools.reduce(operator.getitem, ["transformer", "h", *name.split("/")],
                                new["params"])
        assert _trim(leaf.sharding.spec) == spec
    new = run.unstack_state(new)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_scaled(new["opt_state"][0].mu, ref_state["opt_state"][0].mu, rel=1e-5)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_state["opt_state"][0].mu)
    assert run.plan.pipeline.schedule == "1f1b"
    # lowering (autopar.compare's path) takes the user's layout's shapes: lowered stacked
    lowered = run.lower(*jax.eval_shape(lambda: (state, batch)))
    h = lowered.args_info[0][0]["params"]["transformer"]["h"]
    assert {a.shape[0] for a in jax.tree_util.tree_leaves(h)} == {4}


def test_scanned_and_unrolled_gpt_compute_the_same_loss(models):
    step, state, batch, _, ref_loss = models("gpt")
    scanned = PM.gpt_staged(dataclasses.replace(CFG, scan=True))
    stacked = PM.staged_model_of(step).stacking.stack(state["params"])
    params = {**{k: v for k, v in stacked.items() if k != "layer"}, "layers": stacked["layer"]}
    np.testing.assert_allclose(float(scanned.loss(params, batch)), float(ref_loss), rtol=1e-6)


def test_compare_measures_an_unrolled_pipelined_model(models):
    """``autopar.compare`` plans megatron_3d on the user's unrolled layout and measures it on
    the stacked layout the pipelined step runs on (converted from the given arrays)."""
    step, state, batch, *_ = models("gpt")
    cmp = autopar.compare(step, state, batch, mesh=MESH_A, hardware="cpu",
                          strategies=("megatron_3d",), runs=1, progress=False,
                          time_limit_s=5.0)
    row = cmp["megatron_3d"]
    assert row.ok, row.error
    assert row.plan.pipeline is not None and row.measured_step_s is not None
    assert row.measured_peak_bytes is not None
