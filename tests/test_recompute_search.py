"""The recomputation search stays fast (``planner.recompute._fastest``, ``planner.prune``).

A policy whose rewritten step's bounds prove it fits no plan, or cannot beat the plan in hand,
is skipped unplanned: checked here against the same search with the bounds off (same policy,
same step), and each skip against the skipped policy's own plan. The number of plans the search
makes is counted (a spy on ``plan_layouts``) rather than timed: with the bounds, and once the
search's shared time limit is spent with a plan in hand. Abstract inputs, the H100 profile, one
device (every op one strategy: the bound is tight there, so it skips something).
"""
from __future__ import annotations

import math
import time

import pytest

import ir
from autopar.errors import BudgetError
from autopar.models import gpt
from autopar.planner import _plan_layouts, prune
from autopar.planner import recompute as planner_recompute
from autopar.planner.budget import Clock
from autopar.request import make_request, plan_graph
from ir import recompute

CFG = gpt.GPTConfig(scan=True, layers=4, d_model=32, seq=128, d_ff=128, heads=4, vocab=64)
MESH = {"data": 1}


@pytest.fixture(scope="module")
def graph():
    return ir.trace(*gpt.abstract(CFG, 32))


@pytest.fixture(scope="module")
def plain_peak(graph):
    return plan_graph(graph, MESH, hardware="h100", time_limit_s=2).cost.peak_memory_bytes


def _plan(graph, budget):
    return plan_graph(graph, MESH, hardware="h100", time_limit_s=2, memory_budget=budget,
                      memory_decisions=("recompute",))


@pytest.mark.parametrize("frac", [0.7, 0.5])
def test_a_policy_skipped_by_its_bounds_could_not_have_won(graph, plain_peak, monkeypatch,
                                                           frac):
    budget = frac * plain_peak
    pruned = _plan(graph, budget)
    skipped = [n for n in pruned.notes if "not planned" in n]
    assert skipped, pruned.notes                  # the bounds did skip something here
    with monkeypatch.context() as m:
        m.setattr(prune, "offered", lambda options: False)
        whole = _plan(graph, budget)
    assert whole.notes == ()
    assert [r.policy for r in pruned.recompute] == [r.policy for r in whole.recompute]
    assert pruned.cost.step_time_s == pytest.approx(whole.cost.step_time_s, rel=1e-12)
    # each skipped policy, planned alone, breaks the budget or is no faster, as its note says
    for note in skipped:
        policy = note.split()[1]
        alone = recompute.rewrite_graph(graph, {0: policy})
        try:
            plan = plan_graph(alone, MESH, hardware="h100", time_limit_s=2,
                              memory_budget=budget, memory_decisions=())
        except BudgetError:
            continue       # it fits no plan alone (the bound's skip needs no such proof)
        assert "no faster" in note, note
        assert plan.cost.step_time_s >= pruned.cost.step_time_s, (policy, note)


class _Spy:
    """``plan_layouts`` that counts its calls and plans each in a fresh time limit (so a
    spent search clock changes which plans are made, not how each is made)."""

    def __init__(self):
        self.spent = []

    def __call__(self, g, mesh, cm, options, *, trace_s=0.0):
        self.spent.append(trace_s)
        return _plan_layouts(g, mesh, cm, options)


def _search(graph, budget, clock=None, spy=None):
    request = make_request(graph, MESH, hardware="h100", time_limit_s=2, memory_budget=budget)
    spy = spy or _Spy()
    plan = planner_recompute.plan_recomputed(
        graph, MESH, request.cost_model, request.options, BudgetError("plain", None), spy,
        clock=clock)
    return plan, len(spy.spent)


def test_the_search_plans_only_the_policies_its_bounds_leave(graph, plain_peak):
    plan, calls = _search(graph, 0.5 * plain_peak)
    skipped = [n for n in plan.notes if "not planned" in n]
    # every policy rewrites the step here; each is either planned or skipped with a note
    assert calls + len(skipped) == len(planner_recompute.TRIED), plan.notes
    assert calls < len(planner_recompute.TRIED)


def test_a_spent_time_limit_stops_the_search_once_a_plan_fits(graph, plain_peak, monkeypatch):
    monkeypatch.setattr(prune, "offered", lambda options: False)   # no bound skips anything
    budget = 0.7 * plain_peak
    _, all_calls = _search(graph, budget)
    assert all_calls == len(planner_recompute.TRIED)
    # the search's clock long spent: after the first policy that fits, none is started
    spent, spy = Clock(time.perf_counter() - 1e3, 1.0, deterministic=False), _Spy()
    plan, calls = _search(graph, budget, clock=spent, spy=spy)
    (first_fit,) = [r.policy for r in plan.recompute]
    assert calls == planner_recompute.TRIED.index(first_fit) + 1
    assert spy.spent == [0.0] * calls     # until one fits, each plans in a limit of its own
    assert any("not tried" in n and "time limit" in n for n in plan.notes), plan.notes
    # deterministic: the wall clock cuts nothing, every policy is planned
    still, spy = Clock(time.perf_counter() - 1e3, 1.0, deterministic=True), _Spy()
    assert _search(graph, budget, clock=still, spy=spy)[1] == len(planner_recompute.TRIED)
    fit = planner_recompute.TRIED.index(first_fit) + 1
    assert spy.spent[:fit] == [0.0] * fit and min(spy.spent[fit:]) >= 1e3  # the search's time


def test_the_bounds_are_below_the_plan(graph, plain_peak):
    """``prune.bounds`` of each policy's step lies below its plan's predicted step."""
    request = make_request(graph, MESH, hardware="h100", time_limit_s=2)
    for policy in planner_recompute.TRIED:
        g = recompute.rewrite_graph(graph, {0: policy})
        b = prune.bounds(g, MESH, request.cost_model, request.options)
        plan = plan_graph(g, MESH, hardware="h100", time_limit_s=2)
        assert b.step_s <= plan.cost.step_time_s * (1 + 1e-9), policy
        assert math.isfinite(b.build_s) and b.build_s >= 0


def test_bounds_are_not_offered_where_kernels_are_chosen(graph):
    request = make_request(graph, MESH, hardware="h100", time_limit_s=2)
    assert prune.offered(request.options)
    assert not prune.offered(request.options.replace(kernels="auto"))
