"""The planner's search stops work that cannot change its answer (issue 28: planning time of the
memory decisions), and the plans stay as they were."""
from __future__ import annotations

import functools

import pytest

import autopar
import cost_models
import ir
from autopar import planner
from autopar.errors import BudgetError
from autopar.models import gpt, zoo
from autopar.planner import ilp, problem

TINY = zoo.Config(layers=1, width=32, ff=64, heads=4, batch=8)


@functools.cache
def _nnx_lm():
    return zoo.nnx_lm(TINY, abstract=True)


def _plan():
    fn, *args = _nnx_lm()
    return autopar.plan(fn, *args, mesh={"data": 8}, hardware="h100", time_limit_s=5,
                        deterministic=True)


def test_a_start_whose_solve_cannot_beat_the_plan_in_hand_stops(monkeypatch):
    """The descent's plan fits and is in hand; a hand-written start's solve of the whole model
    whose CP-SAT bound reaches that plan's ``kept_s`` stops there (with what it found, else
    ``ilp.CannotBeat``). The bound is a proof: each stopped solve, run again to its end,
    returns no solution below it, and given a plan in hand just above its own optimum it is
    not stopped. And the plan is the one planned without the stop."""
    solve, stop_above, calls = ilp.solve, ilp._stop_above, []

    def spy(*args, **kwargs):
        fired = []
        monkeypatch.setattr(ilp, "_stop_above", lambda *a: fired.append(stop_above(*a))
                            or fired[-1])
        try:
            sol = solve(*args, **kwargs)
        except ilp.CannotBeat:
            sol = None
        if any(fired):
            calls.append((args, kwargs, sol))
        if sol is None:
            raise ilp.CannotBeat("stopped")
        return sol

    monkeypatch.setattr(ilp, "solve", spy)
    plan = _plan()
    monkeypatch.setattr(ilp, "solve", solve)
    monkeypatch.setattr(ilp, "_stop_above", stop_above)
    assert calls, "no start's solve was stopped by its bound"
    for args, kwargs, sol in calls:
        whole = solve(*args, **{**kwargs, "beat_s": None})
        assert whole.objective_s >= kwargs["beat_s"] * (1 - 1e-12), (whole, kwargs["beat_s"])
        assert sol is None or sol.objective_s >= whole.objective_s
        above = solve(*args, **{**kwargs, "beat_s": whole.objective_s * (1 + 1e-6)})
        assert above.objective_s == whole.objective_s

    monkeypatch.setattr(planner, "_in_hand_s", lambda *a: None)
    unstopped = _plan()
    assert plan.choices == unstopped.choices
    assert plan.input_shardings == unstopped.input_shardings
    assert plan.cost.step_time_s == unstopped.cost.step_time_s


def test_a_solve_its_memory_bound_rules_out_raises_without_a_model(monkeypatch):
    """Where every plan's memory by the model's own constraints (``ilp.memory_lower_bound``)
    exceeds the budget, ``ilp.solve`` raises the BudgetError CP-SAT's proof of infeasibility
    gave, without building the model; with room above the bound it solves as before."""
    mesh = {"data": 2, "model": 4}
    cm = cost_models.CostModel(cost_models.hardware("h100"), mesh)
    cfg = gpt.GPTConfig(layers=2, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)
    p = problem.build(ir.trace(*gpt.abstract(cfg, 8)), mesh, cm)
    least = ilp.memory_lower_bound(p, {})
    below = least - ilp._rounding_bytes(p) - 4096

    def proved(**kw):
        with pytest.raises(BudgetError) as e:
            ilp.solve(p, cm, below, 5.0, explain=False, **kw)
        return str(e.value)

    built = []
    build = ilp._build
    monkeypatch.setattr(ilp, "_build", lambda *a, **k: built.append(1) or build(*a, **k))
    skipped = proved()
    assert not built
    monkeypatch.setattr(ilp, "memory_lower_bound", lambda *a: 0.0)   # CP-SAT proves it
    assert proved() == skipped and built
    monkeypatch.undo()
    assert ilp.solve(p, cm, least * 2, 5.0, explain=False).status == "OPTIMAL"
