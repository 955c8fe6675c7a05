"""The models users bring, as their libraries teach them (issue 27, items 1-4).

* Flax NNX: the Flax docs' step (``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)``,
  ``train_step(model, optimizer, metrics, batch)`` updating in place, written for ``nnx.jit``),
  changed only by its decorator, trains on the 2x4 mesh exactly as under ``nnx.jit``: loss,
  parameters, optimizer state and step, RNG state, batch statistics and metrics after 3 steps.
* Equinox: a module with function, int, float and bool leaves, passed whole, trains as under
  ``eqx.filter_jit``; its non-array leaves are static and part of the plan's key.
* Plain ``PartitionSpec``s wherever a plan shows specs; ``lower``/``compile``/``verify`` take what
  the step takes.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import AutoparError

eqx = pytest.importorskip("equinox")

LR = 1e-3


# ---- Flax NNX ------------------------------------------------------------------------------------
class Model(nnx.Module):
    """Dense, batch norm, dropout, dense: parameters, batch statistics and an RNG stream."""

    def __init__(self, rngs: nnx.Rngs, d_in=16, hidden=64, classes=8):
        # no bias before batch norm: its gradient is 0 but for rounding, which Adam would blow
        # up to +-lr in either program (see _assert_same_objects)
        self.l1 = nnx.Linear(d_in, hidden, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):                                       # (B, I)
        h = self.dropout(nnx.relu(self.bn(self.l1(x))))          # (B, H)
        return self.l2(h)                                        # (B, C)


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


def train_step(model, optimizer, metrics, batch):
    """The Flax docs' step, as written for ``@nnx.jit``: it returns nothing it updates."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)
    return loss


def _objects(seed=0):
    model = Model(nnx.Rngs(seed, dropout=seed + 1))
    optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def _batch(seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"x": jax.random.normal(k1, (16, 16)), "y": jax.random.randint(k2, (16,), 0, 8)}


def _assert_same_objects(got, want):
    """Every piece of state equal: integers and RNG keys exactly; floats to rounding (a sharded
    sum adds in another order), parameters to a fraction of the learning rate (Adam's step turns
    the rounding of a near-zero gradient into up to lr; 3 steps)."""
    flat_got = jax.tree_util.tree_flatten_with_path(nnx.state(got))[0]
    flat_want = jax.tree_util.tree_leaves(nnx.state(want))
    assert len(flat_got) == len(flat_want)
    for (path, a), b in zip(flat_got, flat_want):
        where = jax.tree_util.keystr(path)
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b), where)
        elif not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), where)
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=0.1 * LR,
                                       err_msg=where)


@pytest.mark.parametrize("strategy,donate", [("auto", ()), ("zero3", (0, 1, 2))])
def test_nnx_docs_step_trains_as_under_nnx_jit(mesh_2x4, strategy, donate):
    want, got = _objects(), _objects()
    reference = nnx.jit(train_step)
    step = autopar.autoparallel(train_step, mesh=mesh_2x4, strategy=strategy,
                                donate_argnums=donate, time_limit_s=5)
    for i in range(3):
        batch = _batch(i)
        np.testing.assert_allclose(float(step(*got, batch)), float(reference(*want, batch)),
                                   rtol=1e-5)
    assert int(got[1].step[...]) == 3 and int(got[0].dropout.rngs.count[...]) == 3
    for g, w in zip(got, want):
        _assert_same_objects(g, w)
    assert got[2].compute()["accuracy"] == pytest.approx(float(want[2].compute()["accuracy"]))
    assert len(step._executables) == 1          # one plan for the graph structure
    # state the step never changes (the RNG key) moved onto the mesh once, into the caller's
    assert len(got[0].dropout.rngs.key[...].sharding.device_set) == 8
    if donate:   # a donated argument's buffers are gone: every leaf came back, changed or not
        for obj in got:
            assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(nnx.state(obj)))
    if strategy == "zero3":   # the state is split: written back across layouts
        assert step.plan.spec_of("[0]['l1']['kernel']") != P()
        return
    for m in (want[0], got[0]):
        m.eval()                 # a static attribute: dropout off, running statistics used
    np.testing.assert_allclose(float(step(*got, _batch(3))), float(reference(*want, _batch(3))),
                               rtol=1e-5)
    assert len(step._executables) == 2          # another graph structure, another plan


def test_wrapping_an_nnx_jit_step_trains_the_same(mesh_2x4):
    want, got = _objects(), _objects()
    step = autopar.autoparallel(nnx.jit(train_step), mesh=mesh_2x4, time_limit_s=5)
    for i in range(2):
        np.testing.assert_allclose(float(step(*got, _batch(i))),
                                   float(nnx.jit(train_step)(*want, _batch(i))), rtol=1e-5)
    assert int(got[1].step[...]) == 2
    _assert_same_objects(got[0], want[0])


def test_shared_references_stay_shared_and_returned_objects_are_the_callers(mesh_2x4):
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Linear(8, 8, rngs=rngs)
            self.head = self.embed                   # the same layer twice

        def __call__(self, x):
            return self.head(jnp.tanh(self.embed(x)))

    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        opt.update(model, grads)
        return model.head, loss

    want = Tied(nnx.Rngs(0))
    got = Tied(nnx.Rngs(0))
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (want, got)]
    x = jnp.ones((4, 8))
    head, _ = autopar.autoparallel(step, mesh=mesh_2x4, time_limit_s=5)(got, opts[1], x)
    nnx.jit(step)(want, opts[0], x)
    assert got.head is got.embed and head is got.embed
    np.testing.assert_allclose(got.embed.kernel[...], want.embed.kernel[...], rtol=1e-5)

    def count(counter, x):           # an nnx.Variable passed whole is an NNX object too
        counter[...] += x.sum()

    counter = nnx.Variable(jnp.zeros(()))
    autopar.autoparallel(count, mesh=mesh_2x4)(counter, x)
    assert float(counter[...]) == 32


def test_added_variables_come_back_and_a_changed_static_attribute_is_an_error(mesh_2x4):
    def adds(m, x):
        m.seen = nnx.BatchStat(x.sum(0))          # a new attribute: the structure changes
        return m(x).sum()

    want, got = (nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(2))
    x = jnp.ones((8, 4))
    np.testing.assert_allclose(float(autopar.autoparallel(adds, mesh=mesh_2x4)(got, x)),
                               float(nnx.jit(adds)(want, x)), rtol=1e-6)
    np.testing.assert_array_equal(got.seen[...], want.seen[...])

    def flips(m, x):
        m.use_bias = False
        return x.sum()

    with pytest.raises(AutoparError, match=r"changed a static attribute .* model\.eval\(\)"):
        autopar.autoparallel(flips, mesh=mesh_2x4)(got, x)


def test_updates_the_caller_could_never_see_are_errors(mesh_2x4):
    model, optimizer, metrics = _objects()

    def closes_over(batch):
        return train_step(model, optimizer, metrics, batch)

    with pytest.raises(AutoparError, match=r"did not receive as an argument .* Pass the object "
                                           r"to the step: step\(model, optimizer, batch\)"):
        autopar.autoparallel(closes_over, mesh=mesh_2x4)(_batch())

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    def merges_and_drops(state, batch):
        m = nnx.merge(graphdef, state)
        m.l1.kernel[...] = m.l1.kernel[...] * 2
        return loss_fn(m, batch)[0]

    # batch norm's running mean is the first leaf the step changed
    with pytest.raises(AutoparError, match=r"changed argument \[0\]\['bn'\]\['mean'\]\.value "
                                           r"in place.* Return the new value"):
        autopar.autoparallel(merges_and_drops, mesh=mesh_2x4)(state, _batch())

    def counts(state, x):            # jax.jit style: changed in place and returned, so seen
        state["n"] = state["n"] + 1
        return state, x.sum()

    new, _ = autopar.autoparallel(counts, mesh=mesh_2x4)({"n": jnp.zeros(())}, jnp.ones(8))
    assert float(new["n"]) == 1


# ---- plain PartitionSpecs ------------------------------------------------------------------------
def _leaves_are_specs(tree) -> bool:
    return all(isinstance(x, P) for x in jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, P)))


def test_nnx_specs_are_plain_and_usable_as_jit_in_shardings(mesh_2x4):
    model, optimizer, metrics = _objects()
    plan = autopar.plan(train_step, model, optimizer, metrics, _batch(), mesh=mesh_2x4,
                        strategy="zero3", time_limit_s=5)
    specs = plan.input_specs
    assert isinstance(specs[0], nnx.State) and _leaves_are_specs(specs)
    assert specs[0]["l1"]["kernel"] == plan.spec_of("[0]['l1']['kernel']") != P()
    assert "Param" not in repr(specs) and "Param" not in plan.summary()
    assert all(isinstance(s, list) for s in json.loads(plan.to_json())["input_shardings"])
    # the split state of the model goes into a plain jax.jit with the plan's specs
    _, state = nnx.split(model)
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh_2x4, s), specs[0])
    out = jax.jit(lambda s: s, in_shardings=(shardings,))(state)
    assert out["l1"]["kernel"][...].sharding.spec == specs[0]["l1"]["kernel"]


def test_flax_partitioned_boxes_give_plain_specs():
    import flax.linen as nn

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            return x @ self.param("kernel", init, (x.shape[-1], 32))

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    params = jax.eval_shape(lambda: Dense().init(jax.random.PRNGKey(0), jnp.ones((8, 16))))
    assert isinstance(params["params"]["kernel"], nn.Partitioned)

    def loss(params, x):
        return (Dense().apply(params, x) ** 2).sum()

    plan = autopar.plan(jax.grad(loss), params, x, mesh={"data": 2, "model": 4},
                        time_limit_s=2)
    specs = plan.input_specs
    assert isinstance(specs[0]["params"]["kernel"], P) and _leaves_are_specs(specs)
    assert isinstance(plan.output_specs["params"]["kernel"], P)


# ---- Equinox -------------------------------------------------------------------------------------
class Block(eqx.Module):
    """Leaves of every kind Equinox allows: arrays, a function, an int, a float and a bool."""

    proj: eqx.nn.Linear
    mlp: eqx.nn.MLP
    heads: int                 # used in a reshape: must stay a Python int
    scale: float
    residual: bool
    act: object

    def __init__(self, d, heads, key, scale=0.5):
        k1, k2 = jax.random.split(key)
        self.proj = eqx.nn.Linear(d, d, key=k1)
        self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, activation=jax.nn.gelu, key=k2)
        self.heads, self.scale, self.residual, self.act = heads, scale, True, jax.nn.gelu

    def __call__(self, x):                                           # (B, D)
        h = jax.vmap(self.proj)(x).reshape(x.shape[0], self.heads, -1)  # (B, heads, D/heads)
        h = jax.vmap(self.mlp)(self.act(h * self.scale).reshape(x.shape))
        return x + h if self.residual else h


optim = optax.adamw(LR)


def eqx_step(model, opt_state, x, y):
    """Equinox's own idiom (written for ``@eqx.filter_jit``)."""
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state


def _eqx_args(scale=0.5):
    model = Block(32, 4, jax.random.PRNGKey(0), scale)
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))
    return model, optim.init(eqx.filter(model, eqx.is_array)), x, jnp.sin(x)


def test_equinox_module_trains_as_under_filter_jit_static_leaves_keyed(mesh_2x4):
    model, opt_state, x, y = _eqx_args()
    step = autopar.autoparallel(eqx_step, mesh=mesh_2x4, strategy="zero3", time_limit_s=5)
    got = want = (model, opt_state)
    for _ in range(3):
        loss, *got = step(*got, x, y)
        ref, *want = eqx.filter_jit(eqx_step)(*want, x, y)
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    assert got[0].act is jax.nn.gelu and got[0].heads == 4 and got[0].residual is True
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    arrays = [jax.tree_util.tree_leaves(eqx.filter(t, eqx.is_array)) for t in (got, want)]
    for a, b in zip(*arrays):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=0.1 * LR)
    assert len(step._executables) == 1
    specs = step.plan.input_specs[0]
    assert isinstance(specs, Block) and isinstance(specs.proj.weight, P) and specs.act is None
    assert step.plan.spec_of("[0].proj.weight") != P()
    # the static leaves key the plan: another float leaf is another program
    loss, *_ = step(*_eqx_args(0.25))
    assert len(step._executables) == 2
    np.testing.assert_allclose(float(loss), float(eqx.filter_jit(eqx_step)(*_eqx_args(0.25))[0]),
                               rtol=1e-5)


def test_an_unhashable_static_leaf_names_the_filtering_fix(mesh_2x4):
    model, opt_state, x, y = _eqx_args()
    model = eqx.tree_at(lambda m: m.act, model, bytearray(b"gelu"))
    with pytest.raises(AutoparError, match=r"argument \[0\]\.act is bytearray .* nor hashable.* "
                                           r"eqx\.partition\(model, eqx\.is_array\)"):
        autopar.autoparallel(eqx_step, mesh=mesh_2x4)(model, opt_state, x, y)


# ---- lower, compile, verify ----------------------------------------------------------------------
def test_lower_compile_verify_take_what_the_step_takes(mesh_2x4):
    model, optimizer, metrics = _objects()
    batch = jax.device_put(_batch(), NamedSharding(mesh_2x4, P("model")))   # another layout
    step = autopar.autoparallel(train_step, mesh=mesh_2x4, time_limit_s=5)
    compiled = step.lower(model, optimizer, metrics, batch).compile()
    assert "all-reduce" in compiled.as_text() or compiled.memory_analysis() is not None
    want = _objects()
    np.testing.assert_allclose(float(compiled(model, optimizer, metrics, batch)),
                               float(nnx.jit(train_step)(*want, _batch())), rtol=1e-5)
    assert int(optimizer.step[...]) == 1                   # ran as the step runs: written back
    assert step.compile(model, optimizer, metrics, batch).jax is compiled.jax   # one executable
    report = step.verify(model, optimizer, metrics, batch)
    assert report.checks and report.memory
    with pytest.raises(AutoparError, match=r"compiled for other arguments: argument "
                                           r"\[3\]\['x'\] was float32\[16, 16\], is now "
                                           r"float32\[8, 16\]"):
        compiled(model, optimizer, metrics, {"x": jnp.ones((8, 16)), "y": jnp.ones(8, int)})


def test_plan_and_compare_take_what_autoparallel_takes(mesh_2x4):
    model, optimizer, metrics = _objects()
    plan = autopar.plan(train_step, model, optimizer, metrics, _batch(), mesh=mesh_2x4,
                        time_limit_s=5)
    step = autopar.autoparallel(train_step, mesh=mesh_2x4, plan=plan)
    step(model, optimizer, metrics, _batch())           # the saved plan applies as it is
    assert step.plan.graph_fingerprint == plan.graph_fingerprint
    cmp = autopar.compare(train_step, model, optimizer, metrics, _batch(), mesh=mesh_2x4,
                          strategies=("dp",), runs=1, time_limit_s=2, progress=False)
    assert all(r.ok and r.measured_step_s for r in cmp.rows), cmp
    assert int(optimizer.step[...]) == 1        # compare's runs wrote nothing back
