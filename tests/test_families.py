"""The ILP is assembled from decision families (``autopar.planner.families``): a family defined
here, outside autopar, plugs into ``ilp.solve`` and changes the plan as its constraint or its
objective says; every constraint of a built model is named by its family; and the planner's
own families (layouts, kernels) still make the plan they made before the split."""
from __future__ import annotations

import functools
import time

import cost_models
import ir
from autopar.models import gpt, mlp
from autopar.planner import ilp, kernel_choice, memory, problem
from autopar.planner.budget import Clock
from autopar.planner.families import Family, Model, ns
from autopar.planner.families.kernels import Kernels
from autopar.planner.families.layouts import Layouts
from autopar.sharding import used_axes

MESH = {"data": 2, "model": 4}
KERNELS = ("layer_0", "layer_1", "head")


@functools.cache
def _mlp():
    """(graph, problem, cost model) of a 2-layer MLP's adamw step on 2x4 H100s."""
    graph = ir.trace(*mlp.abstract(256, 512, 2, 512))
    cm = cost_models.CostModel(cost_models.hardware("h100"), MESH)
    return graph, problem.build(graph, MESH, cm), cm


def _solve(**kw) -> ilp.Solution:
    _, p, cm = _mlp()
    return ilp.solve(p, cm, clock=Clock(time.perf_counter(), 10.0, True), **kw)


def _value(name: str) -> int:
    """The value id of the parameter ``params[name]['kernel']``."""
    graph = _mlp()[0]
    path = f"[0]['params']['{name}']['kernel']"
    return graph.inputs[graph.input_paths.index(path)]


def _layout(sol: ilp.Solution, v: int):
    p = _mlp()[1]
    g = p.group_of_value[v]
    return p.groups[g].shard[v][sol.choice[g]]


class Forbid(Family):
    """A family of constraints alone: value ``v`` is never laid out as ``layout``."""

    name = "forbid"

    def __init__(self, p, v: int, layout):
        self.v, self.layout = v, layout

    def constraints(self, mdl: Model) -> None:
        g = mdl.p.group_of_value[self.v]
        for i, (x, s) in enumerate(zip(mdl.xs(g), mdl.p.groups[g].shard[self.v])):
            if s == self.layout:
                mdl.named(mdl.m.Add(x == 0), self, f"op{g}", i)


class Penalise(Family):
    """A family of objective terms alone: ``penalty_s`` for every strategy that replicates
    value ``v``."""

    name = "penalise"

    def __init__(self, p, v: int, penalty_s: float):
        self.v, self.penalty_s = v, penalty_s

    def objective(self, mdl: Model) -> None:
        g = mdl.p.group_of_value[self.v]
        for x, s in zip(mdl.xs(g), mdl.p.groups[g].shard[self.v]):
            if not used_axes(s):
                mdl.obj.append((ns(self.penalty_s), x))


def test_the_layouts_family_makes_the_known_plan():
    """The golden MLP plan: the first weight split by column, the second by row, the head's
    replicated, at the objective it had before the ILP was split into families."""
    sol = _solve()
    assert sol.status == "OPTIMAL" and not sol.candidates
    layouts = {k: _layout(sol, _value(k)) for k in KERNELS}
    assert layouts == {"layer_0": ((), ("data",)), "layer_1": (("data",), ()),
                       "head": ((), ())}, layouts
    assert ns(sol.objective_s) == 242003


def test_a_family_from_outside_constrains_the_plan():
    """Forbidding the first weight's layout in the plan moves it, at a cost; the family was
    given to ``ilp.solve`` and nothing in autopar names it."""
    base = _solve()
    v = _value("layer_0")
    sol = _solve(families=(lambda p: Forbid(p, v, _layout(base, v)),))
    assert _layout(sol, v) != _layout(base, v)
    assert sol.objective_s > base.objective_s


def test_a_family_from_outside_prices_the_plan():
    """A second of penalty on replicating the head's weight makes the plan split it."""
    base = _solve()
    v = _value("head")
    assert not used_axes(_layout(base, v))
    sol = _solve(families=(lambda p: Penalise(p, v, 1.0),))
    assert used_axes(_layout(sol, v))
    assert sol.objective_s < base.objective_s + 1.0


def _names(mdl: Model) -> set[str]:
    return {c.name for c in mdl.m.Proto().constraints}


def test_every_constraint_is_named_by_its_family():
    """Layouts (edges, pins), memory points and a copy cut, and a family from outside."""
    _, p, cm = _mlp()
    v = _value("layer_0")
    pins = {p.group_of_value[v]: {0}}
    families = (Layouts(pins), Forbid(p, v, p.groups[p.group_of_value[v]].shard[v][1]))
    cut = memory.cut_at(p, 3)
    names = _names(ilp._build(p, families, memory_budget=2**30, cuts=(cut,)))
    assert {n.split(":")[0] for n in names} == {"layouts", "memory", "forbid"}, names
    assert {n.split(":")[1] for n in names if n.startswith("layouts")} >= {"pick", "fixed"}
    assert "memory:cut:0" in names and "memory:0" in names


def test_kernel_constraints_are_named_by_their_family():
    """A GPT layer's kernel sites on 8 H100s, kernels forced."""
    cfg = gpt.GPTConfig(vocab=64, seq=16, d_model=32, heads=4, d_ff=64, layers=1)
    mesh = {"data": 8}
    cm = cost_models.CostModel(cost_models.hardware("h100"), mesh)
    p = kernel_choice.prepare(problem.build(ir.trace(*gpt.abstract(cfg, 8)), mesh, cm), cm,
                              "always")
    assert p.kernel_sites
    names = _names(ilp._build(p, (Layouts(), Kernels(p.kernel_sites, p.kernel_mode))))
    assert {n.split(":")[0] for n in names} == {"layouts", "kernels"}, names
    assert {n.split(":")[1] for n in names if n.startswith("kernels")} == {
        "one", "layout", "always", "saved"}
