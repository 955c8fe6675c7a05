"""Copy-cut rounds (``planner._within_budget``): each round after the first starts from the plan
so far, a cut already in the model is not added again, and CP-SAT repairs no hint that meets
every row: less search, the same plans."""
from __future__ import annotations

import jax

import autopar
import autopar.planner as planner
from autopar.models import mlp
from autopar.planner import ilp, memory


def _mlp():
    """The 3-layer MLP whose first solution's resharded copies break 0.6 of its replicated
    state (test_planner's budget test): four cut rounds bring it within."""
    step, state, batch = mlp.abstract(1024, 4096, 2, 4096)
    replicated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return step, state, batch, 0.6 * replicated


def _plan(step, state, batch, budget):
    return autopar.plan(step, state, batch, mesh={"data": 1, "model": 4}, hardware="h100",
                        memory_budget=budget, time_limit_s=5, donate_argnums=0)


def test_later_cut_rounds_start_from_the_plan_so_far_and_plan_the_same(monkeypatch):
    step, state, batch, budget = _mlp()
    solve, rounds = ilp.solve, []

    def recording(*args, descend=True, **kw):
        if kw.get("cuts"):
            rounds.append(descend)
        return solve(*args, descend=descend, **kw)

    monkeypatch.setattr(ilp, "solve", recording)
    plan = _plan(step, state, batch, budget)
    assert len(rounds) >= 3 and rounds[0] and not any(rounds[1:]), rounds
    assert plan.cost.peak_memory_bytes <= budget

    # every round from the descent, as before: the same plan
    monkeypatch.setattr(ilp, "solve", lambda *a, descend=True, **kw: solve(*a, **kw))
    before = _plan(step, state, batch, budget)
    assert plan.choices == before.choices
    assert plan.input_shardings == before.input_shardings
    assert plan.cost.step_time_s == before.cost.step_time_s
    assert plan.cost.peak_memory_bytes == before.cost.peak_memory_bytes


def test_a_repeated_cut_is_not_added_and_a_hint_that_holds_is_not_repaired(monkeypatch):
    """The second round at the first one's peak (Llama-7B's ``selective`` at two sequences a
    device: the cut undercounts the estimate there) adds no cut and starts from the first
    round's plan, which meets the cut: CP-SAT takes it as its first solution, unrepaired, and
    proves the same optimum."""
    import cost_models
    import ir
    from autopar.planner import problem

    step, state, batch, budget = _mlp()
    sizes = {"data": 1, "model": 4}
    prob = problem.build(ir.trace(step, state, batch, donate_argnums=0), sizes,
                         cost_models.CostModel(cost_models.hardware("h100"), sizes))
    cm = prob.reshard.cm
    first = ilp.solve(prob, cm, budget, 5.0)
    est = memory.estimate(prob, first.choice)
    assert est.peak > budget             # the copies the memory rows do not see
    cut = memory.cut_at(prob, est.peak_position)
    assert planner._new_cut(prob, [cut], cut.position) == []
    assert planner._new_cut(prob, [cut], cut.position + 1) != []

    repaired = []
    make = ilp._solver

    def recording(*args, **kw):
        s = make(*args, **kw)
        repaired.append(s)
        return s

    monkeypatch.setattr(ilp, "_solver", recording)
    cut_round = ilp.solve(prob, cm, budget, 5.0, hint=dict(enumerate(first.choice)),
                          cuts=[cut])
    again = ilp.solve(prob, cm, budget, 5.0, hint=dict(enumerate(cut_round.choice)),
                      cuts=[cut], descend=False)
    assert [s.parameters.repair_hint for s in repaired] == [True, False]
    assert cut_round.status == again.status == "OPTIMAL"
    assert again.objective_s == cut_round.objective_s
