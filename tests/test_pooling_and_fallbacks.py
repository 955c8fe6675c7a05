"""Pooling has sharding rules; ops run replicated for want of one are named; auto can be planned
without a hand-written seed.

* ``reduce_window*`` / ``select_and_scatter_add`` keep batch and channel dims split and gather
  only the dims their window slides along (the rule, then the conv net planned and run on 2x4:
  same loss, gradients and updated parameters as the unsharded step).
* ``Plan.replicated_fallbacks`` / ``plan.summary()`` list every op without a sharding rule with
  its primitive and source line.
* ``autopar.compare(..., seed_auto=False)`` plans auto as ``autopar.plan`` does.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import autopar
import cost_models
import ir
from autopar.models import convnet, mlp
from autopar.planner import rules
from autopar.planner.problem import _Builder, pool_gradient_bytes
from autopar.planner.rules import Strategy
from cost_models.measure import _pool_gradient

POOLING = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
           "select_and_scatter_add")
MESH = {"data": 2, "model": 4}
CFG = convnet.ConvConfig()          # side 16, channels (8, 16): two conv + max-pool stages


def _mesh_2x4():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


# ---- the rule ---------------------------------------------------------------------------------
def _pools(x):
    """Max pool, average pool with SAME padding, a product pool (generic ``reduce_window``) and a
    window of 1 that pads dim 1 (which must then stay whole too)."""
    a = nn.max_pool(x, (2, 2), strides=(2, 2))
    b = nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME")
    c = jax.lax.reduce_window(jax.lax.stop_gradient(x), 1.0, jax.lax.mul, (1, 2, 2, 1),
                              (1, 2, 2, 1), "VALID")     # no derivative rule: forward only
    d = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, 1, 1), (1, 1, 1, 1),
                              ((0, 0), (1, 1), (0, 0), (0, 0)))
    return a.sum() + b.sum() + c.sum() + d.sum()


@functools.cache
def _pool_problem():
    """The traced graph and the context the planner's rules see."""
    x = jax.ShapeDtypeStruct((8, 16, 16, 4), jnp.float32)
    graph = ir.trace(jax.value_and_grad(_pools), x)
    ctx = rules.RuleContext(graph.values, frozenset(v for v, _ in graph.literals),
                            {v: op.prim for op in graph.all_ops() for v in op.outs}, MESH)
    return graph, ctx


def test_pooling_rules_keep_batch_and_channels_and_gather_windowed_dims():
    graph, ctx = _pool_problem()
    ops = [op for op in graph.all_ops() if op.prim in POOLING]
    assert {op.prim for op in ops} >= {"reduce_window_max", "reduce_window_sum", "reduce_window",
                                       "select_and_scatter_add"}
    split = (("data",), ("model",), (), ())          # batch over data, height over model
    for op in ops:
        rule = rules.rule_for(op, ctx)
        assert isinstance(rule, rules.Follow), op.prim
        st = rule.derive(split)
        if _identity_window(op):   # the transpose of the padded window-1 sum: nothing slides
            assert st.outs == (split,) and not st.comms and st.compute_div == 8
        else:                      # height is windowed (or padded): gathered
            assert st.outs == ((("data",), (), (), ()),) * len(op.outs), (op.prim, st.outs)
            assert [(c.kind, c.axes) for c in st.comms] == [("all-gather", ("model",))], op.prim
            assert st.compute_div == 2
        channels = rule.derive(((), (), (), ("model",)))   # channels: nothing to gather
        assert channels.outs[0] == ((), (), (), ("model",)) and not channels.comms


def _identity_window(op) -> bool:
    return (op.param("window_dimensions") == (1, 1, 1, 1)
            and all(tuple(p) == (0, 0) for p in op.param("padding")))


def test_window_dims_only_are_whole():
    graph, _ = _pool_problem()
    (pad_one,) = [op for op in graph.all_ops() if op.prim == "reduce_window_sum"
                  and op.param("window_dimensions") == (1, 1, 1, 1) and not _identity_window(op)]
    assert rules._windowed_dims(pad_one, 4) == {1}     # window 1, but padded
    (maxpool,) = [op for op in graph.all_ops() if op.prim == "reduce_window_max"]
    assert rules._windowed_dims(maxpool, 4) == {1, 2}


# ---- XLA:CPU's max-pool gradient: its bytes and its measured floor ------------------------------
@functools.cache
def _pool_gradient_graph(shape=(4, 16, 16, 16)):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    src = jax.ShapeDtypeStruct((shape[0], shape[1] // 2, shape[2] // 2, shape[3]), jnp.float32)
    graph = ir.trace(_pool_gradient, x, src)
    (op,) = [op for op in graph.all_ops() if op.prim == "select_and_scatter_add"]
    return graph, op, x, src


def test_pool_gradient_bytes_are_what_xla_cpu_counts():
    """The expansion's bytes (iotas, argmax, indices, zero fill, scatter) against the compiled
    pool gradient's ``cost_analysis()``: 68 bytes per float32 operand element, not the 9 of a
    select-and-scatter kernel; split 8 ways, an eighth."""
    graph, op, x, src = _pool_gradient_graph()
    cost = jax.jit(_pool_gradient).lower(x, src).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    whole = Strategy("replicated", (None, None), ((),) * 4)
    assert pool_gradient_bytes(graph, MESH, op, whole) == 68 * 16384
    assert cost["bytes accessed"] == pytest.approx(68 * 16384, abs=16)   # + the init scalars
    split = ((("data", "model"),), (("data", "model"),))
    assert pool_gradient_bytes(graph, MESH, op, Strategy("dp", split, split, 8)) == 68 * 2048


def _pool_gradient_cost(hw):
    graph, op, _, _ = _pool_gradient_graph()
    builder = _Builder(graph, MESH, cost_models.CostModel(hw, MESH), 8)
    split = ((("data", "model"),), (("data", "model"),))
    planned = builder.planned(op, [Strategy("dp", split, split, 8)], None)
    return float(planned.compute_s[0]), float(planned.hbm_bytes[0])


def test_pool_gradient_priced_at_its_measured_floor_on_cpu():
    """``select_scatter_s`` / ``select_scatter_fixed_s`` floor the op's time (2048 operand
    elements per device here); the expansion's bytes count only where XLA:CPU compiles."""
    cpu = dataclasses.replace(cost_models.hardware("cpu"), kernel_floor_s=0.0,
                              select_scatter_s=0.0, select_scatter_fixed_s=0.0)
    base_s, base_bytes = _pool_gradient_cost(cpu)
    assert base_bytes == 68 * 2048
    timed = dataclasses.replace(cpu, select_scatter_s=50e-9, select_scatter_fixed_s=20e-6)
    t, _ = _pool_gradient_cost(timed)
    assert t == pytest.approx(20e-6 + 2048 * 50e-9 + cpu.kernel_launch_s)
    assert t > base_s
    gpu_s, gpu_bytes = _pool_gradient_cost(cost_models.hardware("h100"))
    assert gpu_bytes < 68 * 2048 / 4      # operand, source and result only


# ---- the conv net: sharded pooling, same numbers ----------------------------------------------
@pytest.fixture(scope="module")
def conv():
    step, state, batch = convnet.concrete(CFG, 8)
    return step, state, batch, jax.jit(step)(state, batch)


def _pool_layouts(plan, graph) -> dict[str, list]:
    """Primitive -> the layout the plan pins on each pooling op's result."""
    where = {tuple(op.origin): op.prim for op in graph.all_ops() if op.prim in POOLING}
    out: dict[str, list] = {}
    for pin in plan.pins:
        if pin.slot == "out" and pin.path in where:
            out.setdefault(where[pin.path], []).append(pin.chain[-1])
    return out


def _assert_pools_split(layouts) -> None:
    """Every pool runs on a slice: batch or channels split, height and width whole."""
    assert set(layouts) == {"reduce_window_max", "select_and_scatter_add"}, layouts
    for prim, lays in layouts.items():
        for lay in lays:
            assert lay[1] == () and lay[2] == () and (lay[0] or lay[3]), (prim, lay)


def test_conv_net_plan_matches_unsharded_step(conv):
    """Data parallel on 2x4 (the tiny net's auto plan replicates everything: too small to
    split): the pools and their gradients run on batch slices, the numbers are the same."""
    step, state, batch, ref = conv
    s = autopar.autoparallel(step, mesh=_mesh_2x4(), hardware="h100", time_limit_s=2,
                             strategy="dp")
    out = s(state, batch)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert s.plan.replicated_fallbacks == ()
    layouts = _pool_layouts(s.plan, ir.trace(step, state, batch))
    _assert_pools_split(layouts)
    assert all(lay[0] == ("data",) for lays in layouts.values() for lay in lays), layouts


def test_conv_net_gradients_match_unsharded(conv):
    """The max-pool gradient (select_and_scatter_add) under a split plan."""
    _, state, batch, _ = conv
    model = convnet.ConvNet(CFG)

    def grads(params, batch_stats, batch):
        def loss(p):
            logits, _ = model.apply({"params": p, "batch_stats": batch_stats}, batch["image"],
                                    mutable=["batch_stats"])
            labels = jax.nn.one_hot(batch["label"], CFG.classes)
            return optax.softmax_cross_entropy(logits, labels).mean()
        return jax.grad(loss)(params)

    args = (state["params"], state["batch_stats"], batch)
    s = autopar.autoparallel(grads, mesh=_mesh_2x4(), hardware="h100", time_limit_s=2,
                             strategy="dp")
    got, want = s(*args), jax.jit(grads)(*args)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))
    _assert_pools_split(_pool_layouts(s.plan, ir.trace(grads, *args)))


def test_auto_shards_the_pools_of_a_larger_conv_net():
    """Planned from abstract inputs: a conv net big enough that splitting pays."""
    cfg = convnet.ConvConfig(side=32, channels=(64, 128))
    step, state, batch = convnet.abstract(cfg, 64)
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="h100", time_limit_s=2)
    _assert_pools_split(_pool_layouts(plan, ir.trace(step, state, batch)))
    assert plan.replicated_fallbacks == ()


# ---- ops without a rule are named ------------------------------------------------------------
def _spectral(x):
    y = jnp.fft.fft(x).real        # fft has no sharding rule
    return (y * x).sum()


def test_op_without_a_rule_is_listed_with_its_source_line():
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    plan = autopar.plan(_spectral, x, mesh={"data": 8}, hardware="h100", time_limit_s=2)
    ((op_id, prim, src, reason),) = plan.replicated_fallbacks
    assert prim == "fft" and reason == "no sharding rule"
    assert src.startswith("test_pooling_and_fallbacks.py:") and "_spectral" in src
    line = int(src.split(":")[1].split()[0])
    assert "jnp.fft.fft" in open(__file__).read().splitlines()[line - 1]
    text = plan.summary()
    assert "1 ops run replicated for want of a sharding" in text
    assert any(row.split()[:2] == ["fft", "1"] and src in row for row in text.splitlines())
    again = autopar.Plan.from_json(plan.to_json())
    assert again.replicated_fallbacks == plan.replicated_fallbacks


def test_while_loop_is_listed_as_opaque():
    def f(x):
        return jax.lax.while_loop(lambda y: y.sum() < 1e3, lambda y: y * 2.0, x).sum()

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    plan = autopar.plan(f, x, mesh={"data": 8}, hardware="h100", time_limit_s=2)
    assert [(p, r) for _, p, _, r in plan.replicated_fallbacks] == [
        ("while", "loop/branch body not planned")]


# ---- compare(seed_auto=False) ----------------------------------------------------------------
def test_compare_seeds_auto_with_its_rows_and_unseeded_plans_as_autopar_plan(monkeypatch):
    """Seeded, compare hands its hand-written plans to auto (which does not solve them again);
    unseeded, auto is planned as ``autopar.plan(strategy="auto")`` plans it, with its own
    hand-written starts. Both are held against dp and are never predicted slower."""
    request = importlib.import_module("autopar.request")     # where every plan call goes
    seen = []
    real = request.make_plan

    def spy(req, **kw):
        seen.append(req.options)
        return real(req, **kw)

    monkeypatch.setattr(request, "make_plan", spy)
    step, state, batch = mlp.abstract(64, 256, 2, 64)
    kw = dict(mesh={"data": 8}, hardware="h100", measure=False, progress=False, time_limit_s=2)
    seeded = autopar.compare(step, state, batch, strategies=("dp", "auto"), **kw)
    assert [p.strategy for p in seen[-1].seed_plans] == ["dp"] and seen[-1].starts
    seen.clear()
    alone = autopar.compare(step, state, batch, strategies=("dp", "auto"), seed_auto=False, **kw)
    assert seen[-1].seed_plans == () and seen[-1].starts
    assert alone["dp"].predicted_step_s == seeded["dp"].predicted_step_s
    for cmp in (seeded, alone):
        assert cmp["auto"].predicted_step_s <= cmp["dp"].predicted_step_s
    assert seeded["auto"].predicted_step_s <= alone["auto"].predicted_step_s


def test_auto_keeps_the_cpu_convolutions_wide():
    """On the CPU profile a convolution narrower than ``conv_min_features`` channels per device
    runs far slower per FLOP (XLA:CPU: 8-in, 2-out ~30x slower than 8-in, 16-out), so auto
    splits the batch of the tiny conv net on 8 devices. Without the rule it split the first
    conv's 8 output channels one per device over a replicated batch, which measured 1.4x
    slower than data parallel (benchmarks/results/cpu_measured.md at 50605d3: 21.1 vs 14.9 ms)."""
    step, state, batch = convnet.abstract(CFG, 32)
    cpu = cost_models.hardware("cpu")
    assert cpu.conv_min_features > 1

    def image_spec(hw):
        plan = autopar.plan(step, state, batch, mesh={"data": 8}, hardware=hw, time_limit_s=2,
                            deterministic=True)
        return plan.spec_of("image")

    assert image_spec(cpu) == P("data")
    assert image_spec(dataclasses.replace(cpu, conv_min_features=1.0)) == P()


def test_reduce_scattering_a_convolution_onto_its_features_does_not_narrow_it():
    """A strategy that reduce-scatters a convolution's partial result (``|RS<d>``) computes every
    output feature of its kernel shard and splits only the sum: the narrow-convolution rule
    prices it as wide as the all-reduce strategy with the same operands. Priced by the scattered
    result (2 of 8 channels a device on 2x4 for ``|RS3``) it cost 10x the all-reduce's compute,
    so the conv net's auto plan all-reduced conv_1's input gradient and sliced it for the
    max-pool gradient, which XLA runs as a reduce-scatter (``autopar.verify``: all-reduce
    32 KiB predicted, reduce-scatter 32 KiB measured)."""
    from autopar.planner import problem

    train_step, state, batch = convnet.concrete(CFG, 16)
    graph = ir.trace(train_step, state, batch)
    prob = problem.build(graph, MESH,
                         cost_models.CostModel(cost_models.hardware("cpu"), MESH))
    onto_features = 0
    for op in graph.ops:
        if op.prim != "conv_general_dilated":
            continue
        strategies = prob.groups[prob.group_of_op[op.id]].members[op.id]
        by_name = {st.name: st for st in strategies}
        feature_dim = op.param("dimension_numbers")[2][1]
        for st in strategies:
            base, _, comm = st.name.partition("|")
            if comm.startswith("RS") and [c.kind for c in st.comms] == ["reduce-scatter"]:
                wide = problem.conv_features(graph, MESH, op, by_name[base + "|AR"])
                assert problem.conv_features(graph, MESH, op, st) == wide, st.name
                onto_features += comm == f"RS{feature_dim}"
    assert onto_features >= 4
