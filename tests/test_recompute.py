"""Recomputation as a planner decision (``ir.recompute``, ``autopar.planner.recompute``).

A scanned model's forward loop saves values for its backward loop; where no layout fits the
memory budget, the planner rewrites the step so the backward loop recomputes them, plans the
rewritten step, and codegen runs it. Checked here: the rewrite computes the same step and
saves what it claims; a plan under 0.6x the plain step's peak fits, runs with the unsharded
step's numbers and XLA's peak within 10% of the prediction; the decision is data (JSON,
summary); a step that fits, and a user's own remat, are left as they are.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import autopar
import ir
from autopar import api, codegen
from autopar.models import gpt, nnx_lm
from autopar.plan import Recompute
from ir import recompute
from tests import numerics

# Activations outweigh parameters (batch x sequence x heads x sequence scores per layer), as
# they do at scale: the regime where recomputation is worth its FLOPs.
CFG = gpt.GPTConfig(scan=True, layers=4, d_model=32, seq=128, d_ff=128, heads=4, vocab=64)
ROWS = 32


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def gpt_step():
    return gpt.concrete(CFG, ROWS)


def _stacked_bytes(closed) -> int:
    """Bytes of the stacked outputs of the step's first forward loop (its residuals)."""
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    nk = eqn.params["num_carry"]
    return sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.outvars[nk:])


def _same_step(graph, got_flat, want_flat) -> None:
    """Two runs of an adamw step (``autopar.models.adamw_step``), compared as the numerics
    allow: loss, first moment, parameters after Adam's step. A key projection's bias has a
    zero gradient in exact arithmetic (softmax ignores a shift shared by all keys): its first
    moment is rounding noise, ~1e-10 here, held to 1e-8."""
    (got, got_loss) = jax.tree_util.tree_unflatten(graph.out_tree, got_flat)
    (want, want_loss) = jax.tree_util.tree_unflatten(graph.out_tree, want_flat)
    numerics.assert_same_step(got["params"], want["params"], lr=1e-3, got_loss=got_loss,
                              want_loss=want_loss, got_mu=got["opt_state"][0].mu,
                              want_mu=want["opt_state"][0].mu, atol=1e-8)


def _runs_the_same(graph, closed, new, args) -> None:
    flat_in = jax.tree_util.tree_leaves(args)
    want = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*flat_in)
    got = jax.jit(jax.extend.core.jaxpr_as_fun(new))(*flat_in)
    _same_step(graph, got, want)


@pytest.mark.parametrize("policy", ["selective", "save_dots", "save_weight_dots", "full"])
def test_rewritten_step_is_the_same_function_and_saves_less(gpt_step, policy):
    step, state, batch = gpt_step
    graph = ir.trace(step, state, batch)
    closed = recompute.flat(graph.jaxpr)
    (site,) = recompute.find_sites(closed)
    assert site.length == CFG.layers and len(site.residuals) > 10
    new = recompute.apply(closed, {0: policy})
    choice = recompute.choose(closed.jaxpr.eqns[site.fwd], closed.jaxpr.eqns[site.bwd], site,
                              policy)
    # the forward loop now stacks what the choice says, instead of the residuals it dropped
    before, after = _stacked_bytes(closed), _stacked_bytes(new)
    assert after == before - choice.dropped_bytes + choice.stacked_bytes
    # the attention core alone (two (rows, heads, seq, seq) values a layer) is near half
    assert after < (0.6 if policy == "selective" else 0.5) * before
    if policy == "full":       # only the layer inputs: (layers, rows, seq, width) float32
        assert choice.stacked_bytes == CFG.layers * ROWS * CFG.seq * CFG.d_model * 4
        assert choice.replayed_flops > 0
    elif policy == "selective":   # the scores' matmul again, from the saved queries and keys
        assert choice.stacked_bytes == 0
        assert {r.cls for r in site.recomputed(policy)} <= {"attention", "input"}
        assert choice.replayed_flops == 2 * ROWS * CFG.heads * CFG.seq ** 2 * (
            CFG.d_model // CFG.heads) * CFG.layers
    elif policy == "save_weight_dots":   # the attention's two batched matmuls again
        assert choice.replayed_flops == 4 * ROWS * CFG.heads * CFG.seq ** 2 * (
            CFG.d_model // CFG.heads) * CFG.layers
    else:                      # matmul outputs are kept: no matmul is replayed
        assert choice.replayed_flops == 0
    _runs_the_same(graph, closed, new, (state, batch))


def test_plan_under_six_tenths_of_the_peak_recomputes_and_runs_exactly(gpt_step):
    step, state, batch = gpt_step
    mesh = _mesh()
    plain = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu", time_limit_s=10)
    assert plain.recompute == ()
    budget = 0.6 * plain.cost.peak_memory_bytes
    auto = autopar.autoparallel(step, mesh=mesh, hardware="cpu", memory_budget=budget,
                                time_limit_s=5)
    got_state, got_loss = auto(state, batch)
    plan = auto.plan
    assert plan.recompute and plan.recompute[0].policy in recompute.POLICIES[1:]
    assert plan.cost.peak_memory_bytes <= budget
    assert "recomputed in the backward pass" in plan.summary()
    want_state, want_loss = jax.jit(step)(state, batch)
    numerics.assert_same_step(got_state["params"], want_state["params"], lr=1e-3,
                              got_loss=got_loss, want_loss=want_loss)
    report = auto.verify(state, batch)
    (mem,) = [c for c in report.checks if c.metric == "peak memory"]
    assert abs(mem.predicted - mem.measured) <= 0.10 * mem.measured, str(report)
    assert mem.measured <= 1.05 * budget
    # the decision is data: it survives JSON and a step given the loaded plan runs it
    loaded = autopar.Plan.from_json(plan.to_json())
    assert loaded.recompute == plan.recompute
    again = autopar.autoparallel(step, mesh=mesh, plan=loaded)
    state2, loss2 = again(state, batch)
    numerics.assert_loss(loss2, want_loss)


def test_each_policy_is_priced_by_the_same_planner(gpt_step):
    """Less memory costs time: the plans of the rewritten steps (dp, so one layout for all)
    hold less in the order of the policies, none is fastest and full slowest, and XLA agrees
    on the memory within 10% but under full recomputation."""
    step, state, batch = gpt_step
    mesh = _mesh()
    graph = ir.trace(step, state, batch)
    rows = []
    for policy in recompute.POLICIES:
        g = recompute.rewrite_graph(graph, {0: policy}) if policy != "none" else graph
        plan = api.plan_graph(g, mesh, hardware="cpu", strategy="dp", time_limit_s=5)
        exe, _ = codegen.build(g, plan, mesh)
        report = autopar.verify(plan, exe.lower(state, batch).compile())
        (mem,) = [c for c in report.checks if c.metric == "peak memory"]
        rows.append((policy, plan.cost.step_time_s, mem.predicted, mem.measured))
    times = {r[0]: r[1] for r in rows}
    peaks = [r[2] for r in rows]
    assert peaks == sorted(peaks, reverse=True), rows          # each policy holds less
    assert min(times, key=times.get) == "none" and max(times, key=times.get) == "full", rows
    for _, _, predicted, measured in rows[:3]:
        assert abs(predicted - measured) <= 0.10 * measured, rows
    # full recomputation: XLA holds more than predicted (known gap, see known limits); the
    # measured figure still falls with the policy
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True), rows


def test_a_step_that_fits_is_not_rewritten_nor_a_users_remat(gpt_step):
    step, state, batch = gpt_step
    plan = autopar.plan(step, state, batch, mesh=_mesh(), hardware="cpu", time_limit_s=5,
                        memory_budget=2 ** 30)
    assert plan.recompute == ()
    remat = dataclasses.replace(CFG, remat=True)
    step_r, state_r, batch_r = gpt.abstract(remat, ROWS)
    assert recompute.sites_of(ir.trace(step_r, state_r, batch_r)) == ()
    # the planner's cheap check (no retrace) sees through a jax.jit-decorated step, not remat
    assert recompute.has_sites(ir.trace(jax.jit(step), state, batch).jaxpr)
    assert not recompute.has_sites(ir.trace(jax.jit(step_r), state_r, batch_r).jaxpr)


def test_nnx_scan_model_recomputes_and_matches():
    """NNX's ``nnx.scan`` over stacked layers, as the Flax docs build deep models."""
    cfg = nnx_lm.NNXLMConfig(scan=True, layers=3, seq=64, d_model=32, d_ff=64, heads=4)
    step, state, batch = nnx_lm.concrete(cfg, 16)
    graph = ir.trace(step, state, batch)
    closed = recompute.flat(graph.jaxpr)
    (site,) = recompute.find_sites(closed)
    assert site.length == cfg.layers
    for policy in ("save_dots", "full"):
        new = recompute.apply(closed, {0: policy})
        assert _stacked_bytes(new) < _stacked_bytes(closed)
        _runs_the_same(graph, closed, new, (state, batch))


def test_budget_below_full_recomputation_says_so():
    small = dataclasses.replace(CFG, layers=2, seq=32)
    step, state, batch = gpt.abstract(small, 8)
    # time_limit_s bounds each of the error's smallest-budget solves (up to seven rounds on
    # the deterministic clock: most of this test's time at 2 s); that advice is not what this
    # test checks. At 0.5 s the error is the same BudgetError, its least budget 12% higher
    with pytest.raises(autopar.BudgetError, match="Recomputing the saved values"):
        autopar.plan(step, state, batch, mesh=_mesh(), hardware="cpu", time_limit_s=0.5,
                     memory_budget=2 ** 16, memory_decisions=("recompute",))


def test_plan_json_rejects_an_unknown_policy(gpt_step):
    step, state, batch = gpt_step
    plan = autopar.plan(step, state, batch, mesh=_mesh(), hardware="cpu", time_limit_s=3)
    bad = dataclasses.replace(plan, recompute=(Recompute(0, "sometimes", "x", 1.0, 1.0, 0.0),))
    with pytest.raises(autopar.PlanError, match="recompute policy"):
        autopar.Plan.from_json(bad.to_json())


def test_user_selective_remat_is_the_same_step_and_saves_less():
    """``GPTConfig(remat="selective")``: the user's own Megatron-style recomputation (jax's
    ``dots_with_no_batch_dims_saveable``), the baseline the planner's ``save_weight_dots``
    is held against: the same step, fewer saved values than none, more than full remat."""
    small = dataclasses.replace(CFG, layers=2, seq=32)
    outs, saved = {}, {}
    for remat in (False, "selective", True):
        step, state, batch = gpt.concrete(dataclasses.replace(small, remat=remat), 8)
        outs[remat] = jax.jit(step)(state, batch)
        saved[remat] = _stacked_bytes(recompute.flat(ir.trace(step, state, batch).jaxpr))
    (got, got_loss), (want, want_loss) = outs["selective"], outs[False]
    numerics.assert_same_step(got["params"], want["params"], lr=1e-3, got_loss=got_loss,
                              want_loss=want_loss, got_mu=got["opt_state"][0].mu,
                              want_mu=want["opt_state"][0].mu, atol=1e-8)
    assert saved[True] < saved["selective"] < saved[False]
    with pytest.raises(ValueError, match="remat"):
        gpt.concrete(dataclasses.replace(small, remat="sometimes"), 8)
