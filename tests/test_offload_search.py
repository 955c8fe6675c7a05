"""The offload search names in the plan's notes each candidate set it skips, and why
(``planner.offload.plan_offloaded``), as the recompute search does for its policies: a set its
bound (``planner.prune``) proves unable to beat the plan in hand, and a set whose plan needs
more host memory than the hardware profile allows. Abstract inputs, the CPU profile, the
unrolled GPT of ``test_offload.py`` on 2x4, under a budget 3% below its plain plan's peak (so
the first set is a few of its largest groups, the second all 27).
"""
from __future__ import annotations

import dataclasses

import pytest

import cost_models
import ir
from autopar.errors import BudgetError
from autopar.models import gpt
from autopar.options import PlannerOptions, Request
from autopar.planner import _plan_layouts, make_plan, offload, prune

CFG = gpt.GPTConfig(scan=False, layers=2, d_model=128, seq=8, d_ff=512, heads=4, vocab=512)
SIZES = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def case():
    graph = ir.trace(*gpt.abstract(CFG, 8), donate_argnums=(0,))
    cm = cost_models.CostModel(cost_models.hardware("cpu"), SIZES)
    plain = make_plan(Request(graph, SIZES, cm, PlannerOptions(time_limit_s=5,
                                                                deterministic=True)))
    peak = plain.cost.peak_memory_bytes
    options = PlannerOptions(memory_budget=0.97 * peak, time_limit_s=5, deterministic=True)
    return graph, cm, options, BudgetError("no plan fits", peak)


def _set_graph(graph, chosen):
    return offload.rewrite_graph(graph, sorted(k for g in chosen for k in g.inputs))


def test_a_set_its_bound_skips_is_named_in_the_notes(case):
    graph, cm, options, error = case
    groups = offload.groups_of(graph)
    few, every_set = offload.candidate_sets(
        groups, error.least_bytes - options.memory_budget, SIZES)
    assert len(few) < len(every_set) == len(groups)
    one = prune.bounds(_set_graph(graph, few), SIZES, cm, options).step_s
    every = prune.bounds(_set_graph(graph, every_set), SIZES, cm, options).step_s
    assert one < every
    beat_s = (one + every) / 2      # the few largest groups are planned, all of them are not
    plan = offload.plan_offloaded(graph, SIZES, cm, options, error, _plan_layouts,
                                  beat_s=beat_s)
    assert [o.inputs for o in plan.offload] == [g.inputs for g in few]
    skipped = [n for n in plan.notes if n.startswith("offload:")]
    assert skipped == [f"offload: all {len(groups)} groups "
                       f"({sum(g.nbytes for g in groups) / 2**20:.3g} MiB) not planned: every "
                       f"plan of it is predicted at {every * 1e3:.1f} ms or more, no faster "
                       f"than the {beat_s * 1e3:.1f} ms in hand"], plan.notes
    # as the note says: the skipped set, planned alone, is no faster
    alone = _plan_layouts(_set_graph(graph, list(groups)), SIZES, cm, options)
    assert alone.cost.step_time_s >= beat_s
    # the same search without the bound plans both sets and skips none
    whole = offload.plan_offloaded(graph, SIZES, cm, options, error, _plan_layouts,
                                   beat_s=beat_s, bounded=False)
    assert not [n for n in whole.notes if n.startswith("offload:")], whole.notes


def test_a_set_over_the_host_memory_is_named_in_the_notes(case):
    graph, cm, options, error = case
    groups = offload.groups_of(graph)
    few, _ = offload.candidate_sets(groups, error.least_bytes - options.memory_budget, SIZES)
    # what the few largest groups' plan holds in host memory per device, and at least what all
    # of them would (their bytes spread over the 8 devices; donated: no results beside them)
    free = offload.plan_offloaded(graph, SIZES, cm, options, error, _plan_layouts,
                                  bounded=False)
    assert [o.inputs for o in free.offload] == [g.inputs for g in few]
    held_few, least_all = sum(o.host_bytes for o in free.offload), sum(
        g.nbytes for g in groups) / 8
    assert held_few < least_all
    limit = (held_few + least_all) / 2
    hw = dataclasses.replace(cm.hw, host_memory_bytes=limit)
    small = cost_models.CostModel(hw, SIZES)
    plan = offload.plan_offloaded(graph, SIZES, small, options, error, _plan_layouts,
                                  bounded=False)
    assert [o.inputs for o in plan.offload] == [g.inputs for g in few]
    skipped = [n for n in plan.notes if n.startswith("offload:")]
    assert len(skipped) == 1 and skipped[0].startswith(
        f"offload: all {len(groups)} groups"), plan.notes
    assert f"more than the hardware profile's {limit / 2**30:.3g} GiB" in skipped[0]
