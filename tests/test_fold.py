"""Folding an unrolled model's repeated layers (``ir.fold``): the planner plans a graph with
the middle copies removed, prices it as the full graph, and maps the plan back."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import autopar
import cost_models
import ir
from autopar.models import gpt, hf
from autopar.options import PlannerOptions, Request
from autopar.planner import descent, make_plan, problem
from ir.fold import fold

pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")

LAYERS = 10
MESH = {"data": 2, "model": 4}


@functools.cache
def _concrete():
    return hf.concrete("gpt2", hf.tiny("gpt2", layers=LAYERS), batch_size=8)


@functools.cache
def _graph() -> ir.Graph:
    return ir.trace(*_concrete())


def test_fold_keeps_the_first_copies_and_the_last():
    """Ten unrolled GPT-2 blocks: the first three and the last stay, the six between go with
    their parameters, optimizer state and updates, and every removed op, input and result has
    a kept one that stands for it."""
    g = _graph()
    f = fold(g)
    assert f is not None and (f.copies, f.removed) == (LAYERS, LAYERS - 4)
    assert len(f.graph.ops) < 0.6 * len(g.ops)
    assert len(f.graph.inputs) < 0.6 * len(g.inputs)
    assert len(f.input_of) == len(g.inputs) and len(f.output_of) == len(g.outputs)
    kept = {op.id for op in f.graph.ops}
    assert set(f.op_of).isdisjoint(kept) and set(f.op_of.values()) <= kept
    assert len(f.op_of) + len(kept) == len(g.ops) and f.passed == ()
    assert sum(f.weight.values()) == len(f.op_of)
    assert sum(f.input_weight) + len(f.graph.inputs) == len(g.inputs)
    assert fold(g) is f        # cached on the graph: every plan of it plans one folded graph
    # no fold below MIN_COPIES copies
    assert fold(ir.trace(*hf.concrete("gpt2", hf.tiny("gpt2", layers=4), batch_size=8))) is None


def test_a_folded_graph_does_not_grow_with_depth():
    """8 and 12 unrolled layers fold to graphs of as many ops and inputs."""
    sizes = []
    for n in (8, 12):
        f = fold(ir.trace(*hf.abstract("gpt2", hf.tiny("gpt2", layers=n), 8)))
        sizes.append((len(f.graph.ops), len(f.graph.inputs), len(f.graph.outputs)))
        assert f.removed == n - 4
    assert sizes[0] == sizes[1]


@functools.cache
def _clipped():
    return hf.concrete("gpt2", hf.tiny("gpt2", layers=LAYERS), batch_size=8, clip=0.1)


def test_a_global_norm_clip_folds_and_its_plan_matches_unsharded_step():
    """``clip_by_global_norm`` sums every layer's squared gradients into one norm: the removed
    copies' parts go as their other optimizer ops do, the scalar adds that fold them into the
    total are passed through, and the plan (mapped back) clips as the unsharded step does."""
    step, state, batch = _clipped()
    g = ir.trace(step, state, batch)
    f = fold(g)
    assert f is not None and f.removed == LAYERS - 4
    ops = g.analyses.op_index
    # the running total's adds: one per removed layer's parameter leaves (12 in a GPT-2 block)
    assert len(f.passed) == 12 * (LAYERS - 4)
    assert all(ops[i].prim == "add" and g.values[ops[i].outs[0]].shape == () for i in f.passed)
    assert len(f.op_of) + len(f.graph.ops) + len(f.passed) == len(g.ops)
    new_state, ref_state = _folded_and_unsharded_step(step, state, batch)
    # the clip acts: Adam's first moment from zero is 0.1 x the clipped gradient, norm 0.01
    mu = ref_state["opt_state"][1][0].mu
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree_util.tree_leaves(mu)))
    assert float(norm) == pytest.approx(0.1 * 0.1, rel=1e-4)
    for got, want in zip(jax.tree_util.tree_leaves(new_state["opt_state"][1][0].mu),
                         jax.tree_util.tree_leaves(mu)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-9)
    # parameters: Adam's first step is about lr * sign(g), which amplifies rounding noise where
    # a gradient is near zero; within 2% of a step (lr 1e-3) everywhere
    for got, want in zip(jax.tree_util.tree_leaves(new_state["params"]),
                         jax.tree_util.tree_leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)


def _full_choice(full: problem.Problem, fp: problem.Problem, f, cf) -> dict[int, int]:
    """The folded plan ``cf`` as a choice of the full problem: each group decides as the kept
    op (or input) that stands for its leader."""
    choice = {}
    for grp in full.groups:
        if grp.leader >= 0:
            t = f.op_of.get(grp.leader, grp.leader)
            kept = fp.groups[fp.group_of_op[t]]
            name = kept.members[t][cf[kept.id]].name
        elif grp.leader > -1000:
            kept = fp.groups[fp.input_group[f.input_of[-1 - grp.leader]]]
            name = kept.strategies[cf[kept.id]].name
        else:
            choice[grp.id] = 0
            continue
        names = [s.name for s in grp.strategies]
        assert names.count(name) == 1
        choice[grp.id] = names.index(name)
    return choice


@functools.cache
def _bert() -> ir.Graph:
    # 64 wide: its MLP is as wide as the 128-word vocabulary, so the word embedding's Adam ops
    # look like a layer's last kernel's and ir.layers cuts the Adam units one parameter early:
    # each copy holds the previous layer's last update. Folding twins updates by what they
    # read, not by the cut
    return ir.trace(*hf.abstract("bert", hf.tiny("bert", layers=LAYERS), 8))


@functools.cache
def _gpt16() -> ir.Graph:
    # autopar's GPT, its layers named layer_0 .. layer_15: the optimizer updates run in the
    # parameters' sorted order (layer_0, layer_1, layer_10, ...), and a vocabulary as wide as
    # the MLP cuts their units one parameter early (each copy holds another layer's update)
    cfg = gpt.GPTConfig(vocab=128, seq=16, d_model=64, heads=4, d_ff=128, layers=16)
    return ir.trace(*gpt.abstract(cfg, 16))


@pytest.mark.parametrize("name", ["gpt2", "bert", "gpt16"])
def test_folded_problem_prices_a_plan_as_the_full_graph_does(name):
    """Every kept op's cost times what it stands for, and every move between copies, add up to
    the full graph's objective for the same decisions (the folded descent's plan mapped back).
    BERT folds too: its layers index ``head_mask[i]``, a slice whose row differs per layer.
    Its copies start an op into the layer (layer 2's output layer-norm bias is reshaped in copy
    3), so that read of a kept parameter is priced as the representative's read of layer 1's,
    laid out as the plan lays out that one: 1e-6 of the objective here."""
    g = {"gpt2": _graph, "bert": _bert, "gpt16": _gpt16}[name]()
    f = fold(g)
    assert f is not None and f.copies == {"gpt16": 16}.get(name, LAYERS)
    assert f.removed == f.copies - 4
    cm = cost_models.CostModel(cost_models.hardware("h100"), MESH)
    full = problem.build(g, MESH, cm)
    fp = problem.build(f.graph, MESH, cm, folded=f)
    cf = descent.descend(fp, cm)
    mine = descent.objective(fp, cm, cf)
    theirs = descent.objective(full, cm, _full_choice(full, fp, f, cf))
    assert mine == pytest.approx(theirs, rel=2e-6)     # float sums in another order
    assert fp.num_decisions == full.num_decisions


@pytest.mark.parametrize("name", ["gpt2", "bert", "gpt16"])
def test_folded_memory_estimate_is_the_full_graphs(name):
    """The folded problem's peak for a plan equals the full graph's for the same decisions on
    a GPU profile, for the hand-written layouts that copy weights and activations between
    forward and backward (zero3, fsdp_tp, megatron) and the free descent's. A removed layer's
    resharded copy is live across the gap only when the layer makes it there and reads it on
    the other side: placing each where the layer makes its source, or first reads an
    argument, counted the backward's copies once per removed layer at the gap's edge (zero3
    on the 16-layer GPT 1.15x, fsdp_tp on BERT 1.13x, megatron 1.13x)."""
    from autopar import strategies
    from autopar.planner import _pinned, memory

    g = {"gpt2": _graph, "bert": _bert, "gpt16": _gpt16}[name]()
    f = fold(g)
    cm = cost_models.CostModel(cost_models.hardware("h100"), MESH)
    full = problem.build(g, MESH, cm)
    fp = problem.build(f.graph, MESH, cm, folded=f)
    for strat in ("zero3", "fsdp_tp", "megatron", None):
        allowed = _pinned(fp, strategies.get(strat), {})[1] if strat else None
        cf = descent.descend(fp, cm, allowed=allowed)
        cf = [cf[i] for i in range(len(fp.groups))]
        theirs = _full_choice(full, fp, f, cf)
        want = memory.estimate(full, [theirs[i] for i in range(len(full.groups))]).peak
        assert memory.estimate(fp, cf).peak == pytest.approx(want, rel=0.015), strat


def _plans():
    g = _graph()
    hw = cost_models.hardware("h100")
    cm = cost_models.CostModel(hw, MESH)
    opts = PlannerOptions(memory_budget=hw.memory_bytes, time_limit_s=60, deterministic=True)
    return (make_plan(Request(g, MESH, cm, opts)),
            make_plan(Request(g, MESH, cm, opts.replace(fold=False))))


def test_folded_plan_predicts_the_full_plans_figures():
    """The folded plan (mapped back) against the full graph's own: step time within 0.5%, peak
    memory within 6% (the removed copies' memory is modelled from the representative's: what
    is live across the gap, ``problem.Gap``), a layout for every argument and result."""
    folded, whole = _plans()
    assert folded.solver.folded == LAYERS - 4 and whole.solver.folded == 0
    assert folded.graph_fingerprint == whole.graph_fingerprint
    assert len(folded.input_shardings) == len(whole.input_shardings)
    assert folded.cost.step_time_s == pytest.approx(whole.cost.step_time_s, rel=5e-3)
    assert folded.cost.peak_memory_bytes == pytest.approx(whole.cost.peak_memory_bytes,
                                                          rel=0.06)


def _folded_and_unsharded_step(step, state, batch):
    """(new state of the folded plan on 2x4, new state of the unsharded step), their losses
    checked equal."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharded = autopar.autoparallel(step, mesh=mesh, time_limit_s=5)
    new_state, loss = sharded(state, batch)
    assert sharded.plan.solver.folded == LAYERS - 4
    ref_state, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    return new_state, ref_state


def test_folded_plan_matches_unsharded_step():
    """The folded plan runs: loss and Adam's first moment equal the unsharded step's."""
    new_state, ref_state = _folded_and_unsharded_step(*_concrete())
    for got, want in zip(jax.tree_util.tree_leaves(new_state["opt_state"][0].mu),
                         jax.tree_util.tree_leaves(ref_state["opt_state"][0].mu)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)


def test_a_folded_plan_over_the_budget_is_planned_again_on_the_full_graph(monkeypatch):
    """When the folded plan's estimate breaks the memory budget (the ILP's copy cuts do not see
    the removed copies' resharded copies), the full graph is planned: the result is the plan
    ``fold=False`` makes."""
    from autopar.planner import memory

    real = memory.estimate

    def over(prob, choice):
        est = real(prob, choice)
        return dataclasses.replace(est, resident=est.resident + 1e15) if prob.gap else est

    monkeypatch.setattr(memory, "estimate", over)
    folded, whole = _plans()
    assert folded.solver.folded == 0
    assert folded.choices == whole.choices and folded.pins == whole.pins
