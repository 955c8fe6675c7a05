"""Host offload as a planner decision (``ir.offload``, ``autopar.planner.offload``).

Where no layout fits the memory budget, the planner holds groups of the step's update-only state
(Adam's moments) in host memory (``memory_kind="pinned_host"``, which the 8 CPU devices have)
and streams them through the device for the update. Checked here: what may move (moments, not
parameters; one group per parameter); the rewritten step computes the same numbers; a plan under
a budget no layout meets (below the state spread over every device) fits, runs with the
unsharded step's numbers, returns its state in host memory and takes it back on the next call
and from a checkpoint, with XLA's host bytes within 10% of the prediction and its device peak
within 15% (a known gap); the decision is data (JSON, summary, HTML); hardware without a host
link is not offered it.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import autopar
import autopar.checkpoint
import cost_models
import ir
from autopar import hlo, planner
from autopar.models import gpt, mlp
from autopar.options import PlannerOptions, Request
from autopar.plan import Offload
from autopar.planner import offload
from autopar.sharding import shard_factor
from tests import numerics

# Parameters outweigh activations (8 rows of 8 tokens): the regime where the optimizer's state,
# not what the backward pass saves, is what breaks a budget. Unrolled: nothing to recompute.
CFG = gpt.GPTConfig(scan=False, layers=2, d_model=128, seq=8, d_ff=512, heads=4, vocab=512)
ROWS = 8


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: x.copy(), tree)


@pytest.fixture(scope="module")
def gpt_step():
    return gpt.concrete(CFG, ROWS)


def _make_plan(graph, budget, **options):
    sizes = dict(_mesh().shape)
    cm = cost_models.CostModel(cost_models.hardware(options.pop("hardware", "cpu")), sizes)
    return planner.make_plan(Request(graph, sizes, cm, PlannerOptions(
        memory_budget=budget, time_limit_s=5, **options)))


def test_moments_move_in_groups_parameters_stay(gpt_step):
    step, state, batch = gpt_step
    graph = ir.trace(step, state, batch, donate_argnums=(0,))
    groups = offload.groups_of(graph)
    moved = [graph.input_paths[k] for g in groups for k in g.inputs]
    params = [p for p in graph.input_paths if "['params']" in p]
    assert groups and not any("['params']" in p for p in moved)
    # one group per parameter: its first and second moments, which one update reads together
    assert len(groups) == len(params)
    for g in groups:
        names = sorted(graph.input_paths[k] for k in g.inputs)
        assert len(names) == 2 and ".mu[" in names[0] and ".nu[" in names[1]
        assert names[0].split(".mu", 1)[1] == names[1].split(".nu", 1)[1]
    # the rewritten step: the moments and their new values are host values, moved once each
    new = offload.rewrite_graph(graph, [k for g in groups for k in g.inputs])
    moves = [op for op in new.ops if op.prim == "device_put"]
    assert len(moves) == 2 * len(moved)
    assert len(new.host) == 2 * len(moved)


def test_rewritten_step_is_the_same_function(gpt_step):
    step, state, batch = gpt_step
    graph = ir.trace(step, state, batch, donate_argnums=(0,))
    groups = offload.groups_of(graph)
    new = offload.rewrite_graph(graph, [k for g in groups[::2] for k in g.inputs])
    flat_in = jax.tree_util.tree_leaves((state, batch))
    want = jax.jit(jax.extend.core.jaxpr_as_fun(graph.jaxpr))(*flat_in)
    got = jax.jit(jax.extend.core.jaxpr_as_fun(new.jaxpr))(*flat_in)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_budget_below_any_layouts_state_offloads_and_runs_exactly(tmp_path):
    """Under 0.95x the step's state spread over all 8 devices no layout fits (the arguments
    alone break it); holding the moments in host memory does."""
    step, state, batch = mlp.concrete(256, 512, 2, 16)
    budget = 0.95 * sum(x.nbytes for x in jax.tree_util.tree_leaves(state)) / 8
    graph = ir.trace(step, state, batch, donate_argnums=(0,))
    with pytest.raises(autopar.BudgetError):      # the ablation: no layout fits that budget
        _make_plan(graph, budget, offload=False, explain_budget=False)
    want_state, want_loss = jax.jit(step)(state, batch)
    auto = autopar.autoparallel(step, mesh=_mesh(), hardware="cpu", memory_budget=budget,
                                time_limit_s=5, donate_argnums=(0,))
    got_state, got_loss = auto(_copy(state), batch)
    plan = auto.plan
    assert plan.offload and plan.cost.peak_memory_bytes <= budget
    numerics.assert_same_step(got_state["params"], want_state["params"], lr=1e-3,
                              got_loss=got_loss, want_loss=want_loss,
                              got_mu=got_state["opt_state"][0].mu,
                              want_mu=want_state["opt_state"][0].mu, atol=1e-8)
    mu = jax.tree_util.tree_leaves(got_state["opt_state"][0].mu)
    assert {x.sharding.memory_kind for x in mu} == {"pinned_host"}
    # the next call takes the state where the last one left it
    again_state, _ = auto(got_state, batch)
    want2, _ = jax.jit(step)(want_state, batch)
    numerics.assert_same_step(again_state["params"], want2["params"], lr=1e-3)
    # a checkpoint of the host-resident state restores into the plan's memory kinds and trains on
    like = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with autopar.checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, again_state, plan=plan, wait=True)
        restored = ckpt.restore(like, train_step=auto, args=(batch,))
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(
        restored.state["opt_state"][0].nu)} == {"pinned_host"}
    third, loss3 = auto(restored.state, batch)
    want3, want_loss3 = jax.jit(step)(want2, batch)
    numerics.assert_same_step(third["params"], want3["params"], lr=1e-3, got_loss=loss3,
                              want_loss=want_loss3)
    # XLA's device peak and host bytes, against the prediction. The device peak is over-
    # predicted by 14% here (548 against 482 KiB): XLA:CPU puts a weight's gradient into the
    # donated weight's own buffer, which the memory model does not (known limits); on
    # benchmarks/offload.py's GPT, whose activations outweigh that, it is within 10%
    compiled = auto.lower(_copy(state), batch).compile()
    mem = hlo.memory(compiled)
    assert abs(plan.cost.peak_memory_bytes - mem["peak"]) <= 0.15 * mem["peak"], mem
    host = sum(o.host_bytes for o in plan.offload)
    assert host > 0 and abs(host - mem["host"]) <= 0.10 * mem["host"], (host, mem)
    check = autopar.verify(plan, compiled).check("host memory")    # verify holds it too
    assert check.ok and (check.predicted, check.measured) == (host, mem["host"]), check
    wrong = dataclasses.replace(plan, offload=tuple(
        dataclasses.replace(o, host_bytes=2 * o.host_bytes) for o in plan.offload))
    assert autopar.verify(wrong, compiled).check("host memory").ok is False
    text = plan.summary()
    assert "held in host memory between steps" in text and ".mu[" in text
    assert "host memory" in plan._repr_html_()
    # a loaded plan carries the decision (a step given it runs through the same codegen)
    assert autopar.Plan.from_json(plan.to_json()).offload == plan.offload


def test_host_memory_counts_the_results_beside_arguments_not_donated():
    """Without donation the updated moments are new host buffers beside the old ones: XLA
    holds both during the step, and the plan says so (measured: host bytes twice the
    arguments'); the moves over the host link stay the arguments' in and out."""
    step, state, batch = mlp.concrete(256, 512, 2, 16)
    with pytest.raises(autopar.BudgetError) as least:     # the least peak of any layout
        _make_plan(ir.trace(step, state, batch), 1e4, offload=False)
    kw = dict(mesh=_mesh(), hardware="cpu", memory_budget=0.9 * least.value.least_bytes,
              time_limit_s=5)
    kept = autopar.autoparallel(step, **kw)
    compiled = kept.lower(state, batch).compile()
    plan = kept.plan
    assert plan.offload
    leaves = jax.tree_util.tree_leaves((state, batch))
    sizes = dict(plan.mesh)
    hw = cost_models.hardware("cpu")
    for o in plan.offload:
        args = sum(leaves[k].nbytes / shard_factor(plan.input_shardings[k], sizes)
                   for k in o.inputs)
        assert o.host_bytes == 2 * args and o.transfer_s == 2 * hw.host_transfer_s(args), o
    check = autopar.verify(plan, compiled).check("host memory")
    assert check.ok and check.measured == sum(o.host_bytes for o in plan.offload), check


def test_no_host_link_no_offload(gpt_step):
    step, state, batch = gpt_step
    graph = ir.trace(step, state, batch, donate_argnums=(0,))
    hw = dataclasses.replace(cost_models.hardware("cpu"), host_bytes_per_s=0.0)
    cm = cost_models.CostModel(hw, dict(_mesh().shape))
    assert not offload.offerable(graph, cm)
    assert offload.offerable(graph, cost_models.CostModel(cost_models.hardware("cpu"),
                                                          dict(_mesh().shape)))


def test_hlo_memory_reads_host_buffers_off_the_entry_layout():
    mesh = _mesh()
    dev = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    host = dev.with_memory_kind("pinned_host")

    def f(w, m):
        m2 = 0.9 * jax.device_put(m, jax.memory.Space.Device) + w
        return w * 2, jax.device_put(m2, jax.memory.Space.Host)

    w = jax.device_put(np.ones((64, 32), np.float32), dev)
    m = jax.device_put(np.zeros((64, 32), np.float32), host)
    compiled = jax.jit(f, in_shardings=(dev, host), out_shardings=(dev, host),
                       donate_argnums=(1,)).lower(w, m).compile()
    mem = hlo.memory(compiled)
    shard = 64 * 8 * 4          # (64, 32) split 4 ways over 'model', float32
    assert mem["host"] == shard                  # the argument and the result share a buffer
    assert mem["argument"] == shard and 0 <= mem["output"] - shard <= 64   # + a tuple table


def test_plan_json_rejects_a_bad_offload(gpt_step):
    step, state, batch = gpt_step
    plan = autopar.plan(step, state, batch, mesh=_mesh(), hardware="cpu", time_limit_s=3)
    n = len(plan.input_paths)
    bad = dataclasses.replace(plan, offload=(Offload((n + 3,), (0,), ("x",), 1.0, 1.0),))
    with pytest.raises(autopar.PlanError, match="out of range"):
        autopar.Plan.from_json(bad.to_json())
    twice = dataclasses.replace(plan, offload=(Offload((1,), (1,), ("x",), 1.0, 1.0),
                                               Offload((1,), (1,), ("x",), 1.0, 1.0)))
    with pytest.raises(autopar.PlanError, match="twice"):
        autopar.Plan.from_json(twice.to_json())


def test_memory_decisions_choose_which_trades_the_planner_may_make():
    step, state, batch = mlp.abstract(256, 512, 2, 16)
    budget = 0.95 * sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)) / 8
    kw = dict(mesh={"data": 8}, hardware="cpu", donate_argnums=(0,), memory_budget=budget)
    assert autopar.plan(step, state, batch, memory_decisions=("offload",), **kw).offload
    with pytest.raises(autopar.BudgetError) as err:
        autopar.plan(step, state, batch, memory_decisions=(), **kw)
    assert "host memory" not in str(err.value)
    with pytest.raises(autopar.AutoparError, match=r"memory_decisions=\('swap',\)"):
        autopar.plan(step, state, batch, memory_decisions=("swap",), **kw)
    with pytest.raises(autopar.AutoparError, match="memory_decisions"):   # at decoration
        autopar.autoparallel(step, mesh=_mesh(), memory_decisions="remat")


def test_updates_run_where_their_gradients_are_ready_on_xla_cpu(gpt_step):
    """XLA:CPU runs each group's update right after its parameter's gradient (the barriers on
    the moves do not survive its pipeline), so the results' buffers are written inside the
    backward pass and cannot take its temporaries. ``updates_when_ready`` puts the lm_head's
    update before the backward reaches layer 0; a step that does not donate its state is
    planned in that order, and XLA's device peak is within 10% of the prediction (0.87 on 2x4
    in the traced order, where the model put the backward's temporaries into the moments'
    result buffers)."""
    step, state, batch = gpt_step
    graph = ir.trace(step, state, batch)
    new = offload.rewrite_graph(graph, [k for g in offload.groups_of(graph) for k in g.inputs])
    early = ir.offload.updates_when_ready(new)
    assert sorted(op.id for op in early.ops) == sorted(op.id for op in new.ops)

    def first_host_write(g, path):
        j = next(j for j, p in enumerate(g.output_paths) if ".mu[" in p and path in p)
        return next(t for t, op in enumerate(g.ops)
                    if op.prim == "device_put" and op.outs[0] == g.outputs[j])

    def layer_0_backward(g):
        return min(t for t, op in enumerate(g.ops)
                   if "transpose" in op.name and "layer_0" in op.name)
    assert first_host_write(new, "lm_head") > layer_0_backward(new)        # traced: last
    assert first_host_write(early, "lm_head") < layer_0_backward(early)    # as XLA:CPU runs it
    with pytest.raises(autopar.BudgetError) as least:
        _make_plan(graph, 1e4, offload=False)
    kept = autopar.autoparallel(step, mesh=_mesh(), hardware="cpu", time_limit_s=5,
                                memory_budget=0.9 * least.value.least_bytes, deterministic=True)
    compiled = kept.lower(state, batch).compile()
    assert kept.plan.offload
    check = autopar.verify(kept.plan, compiled).check("peak memory")
    assert check.ok, check
