"""Pipeline stages derived from a loss function (``autopar.pipeline.derive``): no hand-written
``StagedModel``. The derived embedding, layer and head replay the loss's own equations; the
pipelined step of a derived model equals the user's unsharded step; what cannot be cut is
refused with the cause and its source line."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import assert_params, assert_scaled

import autopar
from autopar.errors import AutoparError
from autopar.models import gpt
from autopar.pipeline import derive as D
from autopar.pipeline import model as PM
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

LR = 1e-3
MESH_A = {"stage": 2, "data": 2, "model": 2}
MESH_B = {"stage": 4, "data": 2}


def _mesh(shape: dict):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(*shape.values()), tuple(shape))


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def _hf(name: str, width: int = 32):
    pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")
    from autopar.models import hf

    cfg = hf.tiny(name, layers=4, width=width)
    model = hf.build(name, cfg)

    def loss_fn(params, batch):
        return _xent(model(**batch["inputs"], params=params, train=False).logits,
                     batch["labels"])

    params = model.init_weights(jax.random.PRNGKey(0), model.input_shape)
    return loss_fn, params, hf.make_batch(name, cfg, 8, seq=8)


CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=False)


def _gpt(scan: bool = False):
    model = gpt.GPT(dataclasses.replace(CFG, scan=scan))

    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["tokens"]), batch["targets"])

    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, CFG.seq), jnp.int32))["params"]
    return loss_fn, params, gpt.make_batch(CFG, 8)


def _loop(layer=lambda p, x, mask: x + jnp.tanh(x @ p["w"] + p["b"]), read_mask=False,
          layers: int = 4, width: int = 16):
    """A user's own model: an embedding, a Python loop over numbered blocks, a head."""
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = {"emb": jax.random.normal(keys[0], (32, width)) * 0.1,
              "head": jax.random.normal(keys[1], (width, 32)) * 0.1,
              **{f"block_{i}": {"w": jax.random.normal(keys[2 + i], (width, width)) * 0.2,
                                "b": jnp.zeros(width)} for i in range(layers)}}

    def loss_fn(params, batch):
        x = params["emb"][batch["tokens"]]
        mask = (batch["tokens"] > 0)[..., None] if read_mask else None
        for i in range(layers):
            x = layer(params[f"block_{i}"], x, mask)
        return _xent(x @ params["head"], batch["targets"])

    tok = jax.random.randint(jax.random.PRNGKey(1), (8, 8), 0, 32)
    return loss_fn, params, {"tokens": tok, "targets": jnp.roll(tok, -1, axis=1)}


def _scanned(read_mask: bool = False, layers: int = 4, width: int = 16):
    """A user's own scanned model: the blocks stacked, one ``lax.scan`` over them."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"emb": jax.random.normal(keys[0], (32, width)) * 0.1,
              "head": jax.random.normal(keys[1], (width, 32)) * 0.1,
              "blocks": {"w": jax.random.normal(keys[2], (layers, width, width)) * 0.2,
                         "b": jnp.zeros((layers, width))}}

    def loss_fn(params, batch):
        x = params["emb"][batch["tokens"]]
        mask = (batch["tokens"] > 0)[..., None] if read_mask else 1.0

        def block(x, p):
            return x + jnp.tanh(x @ p["w"] + p["b"]) * mask, None

        x, _ = jax.lax.scan(block, x, params["blocks"])
        return _xent(x @ params["head"], batch["targets"])

    tok = jax.random.randint(jax.random.PRNGKey(1), (8, 8), 0, 32)
    return loss_fn, params, {"tokens": tok, "targets": jnp.roll(tok, -1, axis=1)}


MAKERS = {"gpt": _gpt, "gpt_scan": lambda: _gpt(scan=True), "loop": _loop, "scan": _scanned,
          "llama": lambda: _hf("llama"), "bert": lambda: _hf("bert"), "vit": lambda: _hf("vit")}


@pytest.mark.parametrize("name", list(MAKERS))
def test_derived_stages_compute_the_users_loss(name):
    """Embedding, the layer scanned over the stacked layers, and the head: the loss itself, on
    two batch sizes (a microbatch is traced at its own shapes)."""
    loss_fn, params, batch = MAKERS[name]()
    sm = D.staged(loss_fn, optax.sgd(LR), params)
    assert sm.num_layers == 4
    assert (sm.stacking is None) == name.startswith(("gpt_scan", "scan"))   # already stacked
    stacked = params if sm.stacking is None else sm.stacking.stack(params)
    for rows in (8, 2):
        part = jax.tree_util.tree_map(lambda x, r=rows: x[:r], batch)
        np.testing.assert_allclose(float(jax.jit(sm.loss)(stacked, part)),
                                   float(jax.jit(loss_fn)(params, part)), rtol=1e-6)


@pytest.mark.parametrize("scan", [False, True])
def test_derived_gpt_layer_is_the_hand_written_one(scan):
    """On autopar's GPT, unrolled (the cut falls where the hand-written StagedModel's does) or
    scanned (the scan's body is the layer), the derived embedding, layer and head compute
    what ``gpt_staged``'s do."""
    loss_fn, params, batch = _gpt(scan)
    got = D.staged(loss_fn, optax.sgd(LR), params)
    want = PM.gpt_staged(dataclasses.replace(CFG, scan=scan))
    stacked = params if scan else want.stacking.stack(params)
    layers, rest = want.split(stacked)
    x = want.embed(rest, batch)
    np.testing.assert_allclose(got.embed(rest, batch), x, rtol=1e-6)
    p2 = jax.tree_util.tree_map(lambda a: a[2], layers)
    np.testing.assert_allclose(got.layer(p2, x), want.layer(p2, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(got.head_loss(rest, x, batch)),
                               float(want.head_loss(rest, x, batch)), rtol=1e-6)


def _same_step(new, loss, ref_state, ref_loss):
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_scaled(new["opt_state"][0].mu, ref_state["opt_state"][0].mu, rel=1e-5)
    assert_params(new["params"], ref_state["params"], LR, grads=ref_state["opt_state"][0].mu)


def test_hf_llama_pipelines_from_its_loss_alone():
    """HF's Flax Llama (128 wide, so the ILP splits its MLP over ``model`` inside a stage),
    planned and run by ``autopar.plan`` / ``@autoparallel`` on {stage 2, data 2, model 2}, 1F1B:
    loss, Adam's first moment and the updated parameters equal the unsharded step's."""
    loss_fn, params, batch = _hf("llama", width=128)
    tx = optax.adamw(LR, weight_decay=0.01)
    step = D.train_step(loss_fn, tx, params)
    state = {"params": params, "opt_state": tx.init(params)}
    ref_state, ref_loss = jax.jit(step)(state, batch)
    plan = autopar.plan(step, state, batch, mesh=MESH_A, hardware="cpu",
                        pipeline={"schedule": "1f1b", "microbatches": 4})
    assert plan.pipeline.layer_ranges == ((0, 2), (2, 4))
    layouts = dict(plan.pipeline.layer_layouts)
    assert any("model" in (d[0] if d else ()) for d in layouts["mlp/up_proj/kernel"])
    run = autopar.autoparallel(step, mesh=_mesh(MESH_A), plan=plan)
    new, loss = run(run.stack_state(state), batch)
    up = new["params"]["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert up.sharding.spec[0] == "stage" and "model" in tuple(up.sharding.spec)
    _same_step(run.unstack_state(new), loss, ref_state, ref_loss)


def test_a_users_loop_pipelines_over_four_stages():
    """A model written as a plain Python loop over ``block_i`` dicts, GPipe over {stage 4,
    data 2}: equal to its unsharded step."""
    loss_fn, params, batch = _loop()
    tx = optax.adam(LR)
    step = D.train_step(loss_fn, tx, params)
    state = {"params": params, "opt_state": tx.init(params)}
    ref_state, ref_loss = jax.jit(step)(state, batch)
    run = R.build_step(PM.staged_model_of(step), _mesh(MESH_B), S.build("gpipe", 4, 1, 4))
    new, loss = run(run.stack_state(state), batch)
    _same_step(run.unstack_state(new), loss, ref_state, ref_loss)


def test_a_scanned_model_pipelines_from_its_loss_alone():
    """autopar's scanned GPT through its plain loss (no gpt_train_step), 1F1B over {stage 4,
    data 2}: equal to its unsharded step; the state needs no conversion."""
    loss_fn, params, batch = _gpt(scan=True)
    tx = optax.adam(LR)
    step = D.train_step(loss_fn, tx, params)
    state = {"params": params, "opt_state": tx.init(params)}
    ref_state, ref_loss = jax.jit(step)(state, batch)
    run = R.build_step(PM.staged_model_of(step), _mesh(MESH_B), S.build("1f1b", 4, 1, 4))
    new, loss = run(state, batch)
    assert new["params"]["layers"]["mlp"]["fc1"]["kernel"].sharding.spec[0] == "stage"
    _same_step(new, loss, ref_state, ref_loss)


def test_what_cannot_be_cut_is_refused_with_its_cause():
    batch_mask = _loop(lambda p, x, mask: x + jnp.tanh(x @ p["w"]) * mask, read_mask=True)
    with pytest.raises(AutoparError, match=r"layer 0 reads 2 values computed before it from "
                                           r"the batch.*bool\[8,8,1\]: .*test_pipeline_derived"):
        D.staged(batch_mask[0], None, batch_mask[1]).loss(
            D.find(batch_mask[1]).stack(batch_mask[1]), batch_mask[2])
    calls = []

    def alternating(p, x, mask):
        calls.append(0)
        act = jnp.tanh if len(calls) % 2 else jax.nn.relu
        return x + act(x @ p["w"] + p["b"])

    loss_fn, params, batch = _loop(alternating)
    with pytest.raises(AutoparError, match=r"layer 1 differs from layer 0 here: "
                                           r"(custom_jvp_call|max|jit).*test_pipeline_derived"):
        D.staged(loss_fn, None, params).embed({}, batch)
    tied_fn, tied, tb = _loop(lambda p, x, mask: x + jnp.tanh(x @ p["w"] + p["b"]))

    def reads_head(params, batch):          # every layer also reads the head's matrix
        x = params["emb"][batch["tokens"]]
        for i in range(4):
            x = x + jnp.tanh(x @ params[f"block_{i}"]["w"]) @ params["head"][:, :16]
        return _xent(x @ params["head"], batch["targets"])

    with pytest.raises(AutoparError, match="reads the parameter head, which is not one of"):
        D.staged(reads_head, None, tied).embed({}, tb)
    masked_fn, masked, mb = _scanned(read_mask=True)
    with pytest.raises(AutoparError, match=r"scan over blocks.*its body reads a value computed "
                                           r"from the batch.*scan \(.*test_pipeline_derived"):
        D.staged(masked_fn, None, masked).embed({}, mb)
    pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")
    from autopar.models import hf

    t5 = hf.build("t5", hf.tiny("t5"))
    with pytest.raises(AutoparError, match="block/\\*: 1 differs in shapes"):
        D.staged(lambda p, b: 0.0, None, t5.init_weights(jax.random.PRNGKey(0), (1, 8)))


def test_a_step_without_layers_names_the_derivation():
    with pytest.raises(AutoparError, match=r"autopar.pipeline.derive.train_step\(loss_fn"):
        PM.staged_model_of(lambda state, batch: (state, 0.0))


def test_collective_permutes_inside_the_stage_branches_are_refused_on_cpu():
    """HF GPT-2 derived from its loss keeps ``c_attn``'s fused q, k, v on one dim; split
    contiguously over the tensor axis, GSPMD realigns q, k and v with collective-permutes inside
    the per-stage branches, where XLA:CPU would wait forever for the other stage's devices. The
    step refuses to run it and names the op and the user's line; the Megatron-style split of
    the MLP alone runs."""
    from autopar import hlo

    loss_fn, params, batch = _hf("gpt2")
    tx = optax.sgd(LR)
    sm = PM.staged_model_of(D.train_step(loss_fn, tx, params))
    state = {"params": params, "opt_state": tx.init(params)}
    fused = ({"attn/c_attn/kernel": ((), ("model",)), "attn/c_attn/bias": (("model",),)}, {})
    run = R.build_step(sm, _mesh(MESH_A), S.build("gpipe", 2, 1, 2), layouts=fused)
    stacked = run.stack_state(state)
    with pytest.raises(AutoparError, match=r"collective-permute\(s\) inside the per-stage "
                                           r"branches.*attn/split \(modeling_flax_gpt2.py:\d+"):
        run(stacked, batch)
    mlp = ({"mlp/c_fc/kernel": ((), ("model",)), "mlp/c_proj/kernel": (("model",), ())}, {})
    run = R.build_step(sm, _mesh(MESH_A), S.build("gpipe", 2, 1, 2), layouts=mlp)
    new, loss = run(stacked, batch)
    compiled = run._compiled(run.jitted(stacked, batch), stacked, batch)
    assert not hlo.in_branches(hlo.parse(compiled.as_text()))
    np.testing.assert_allclose(float(loss), float(jax.jit(loss_fn)(params, batch)), rtol=1e-6)
