"""The sharding ILP, solved with OR-tools CP-SAT.

Variables
  x[g, i] ∈ {0,1}   group g (see ``problem.py``) runs its strategy i; Σ_i x[g, i] = 1  (``pick:g``).
                    Tied groups (repeated layers) share the variables of their representative.
  y[e, o, r] ∈ {0,1} edge e moves its value from distinct source layout o to needed layout r.
                    Σ_r y[e,o,r] = Σ_{i: layout_i = o} x[src, i]          (``flow-out:e:o``)
                    Σ_o y[e,o,r] = Σ_{j: need_j = r} x[dst, j]            (``flow-in:e:r``)
                    (an edge with one source or one needed layout needs no y: its cost is linear)
  c[e] ≥ 0          instead of y, for an edge with over FLOW_PAIRS_MAX layout pairs (big-M):
                    c[e] ≥ Σ_i cost(layout_i, r)·x[src,i] - M_r·(1 - Σ_{j: need_j = r} x[dst,j])
                                                                        (``edge:e``)

Objective  min Σ_g Σ_i (compute_s + comm_s)[g,i]·x[g,i]
               + Σ_e Σ_{o,r} mult_e·reshard_s(o→r)·y[e,o,r] + Σ_e c[e]

Memory     for each check point p of the schedule (``mem:p``):
           Σ_{v always live or live at p} bytes_v(i)·x[g(v), i] ≤ budget

Costs are scaled to integer nanoseconds and bytes to KiB. One worker and a deterministic time
limit keep the answer the same from run to run.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from ortools.sat.python import cp_model

from autopar.errors import PlanError
from autopar.planner.problem import Problem, flow_pairs, restrict, value_bytes

# Integer units of the model. CP-SAT's LP works in doubles: with picoseconds a large model's
# objective passed 2^53, presolve discarded a feasible hint and the bound rose above a known
# solution. Nanoseconds and KiB keep every sum exact.
PS = 1e9
KIB = 1024.0
# Edges with more (source layout, needed layout) pairs than this use the big-M form.
FLOW_PAIRS_MAX = 400


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]          # per group: strategy index
    objective_s: float
    bound_s: float
    status: str
    solve_s: float
    num_vars: int
    num_constraints: int
    candidates: int = 0              # > 0: solved over at most this many strategies per group

    @property
    def gap(self) -> float:
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


class _Model:
    def __init__(self, p: Problem, cost_model):
        self.p, self.cm = p, cost_model
        self.m = cp_model.CpModel()
        self.x: dict[int, list] = {}
        self.obj: list = []
        self.flows: list = []   # (edge, y vars) for completing hints
        self.edge_costs: list = []  # (c_e, edge, scaled costs) of big-M edges, for hints
        self.root = {g.id: self._root(g.id) for g in p.groups}
        for g in p.groups:
            if self.root[g.id] == g.id:
                self.x[g.id] = [self.m.NewBoolVar(f"x{g.id}_{i}") for i in range(g.n)]
                self.m.AddExactlyOne(self.x[g.id]).WithName(f"pick:{g.id}")

    def _root(self, g: int) -> int:
        return self.p.root(g)

    def xs(self, g: int) -> list:
        return self.x[self.root[g]]

    def reshard(self, v: int, src, dst) -> float:
        return self.p.reshard_s(v, src, dst)

    def add_group_costs(self) -> None:
        """One term per root strategy: tied groups' costs are summed first."""
        for r, cost in self.p.root_costs().items():
            self.obj += [(int(round(c * PS)), x) for c, x in zip(cost, self.x[r]) if c > 0]

    def add_edges(self) -> None:
        """Edges that repeat between the same tied groups with the same layouts are one edge
        carrying the sum of their multipliers (``Problem.merged_edges``), so the model does not
        grow with depth."""
        for k, e in enumerate(self.p.merged_edges()):
            self.add_edge(k, e)

    def add_edge(self, k: int, e) -> None:
        have = self.p.groups[e.src].shard[e.value]
        xs, xd = self.xs(e.src), self.xs(e.dst)
        if self.root[e.src] == self.root[e.dst]:
            for i, x in enumerate(xs):
                c = e.mult * self.reshard(e.value, have[i], e.need[i])
                if c > 0:
                    self.obj.append((int(round(c * PS)), x))
            return
        outs, needs = _distinct(have), _distinct(e.need)
        cost = {(o, r): e.mult * self.reshard(e.value, o, r) for o in outs for r in needs}
        if not any(c > 0 for c in cost.values()):
            return
        if len(outs) == 1 or len(needs) == 1:
            for i, x in enumerate(xs if len(needs) == 1 else xd):
                c = cost[(have[i], e.need[0])] if len(needs) == 1 else cost[(have[0], e.need[i])]
                if c > 0:
                    self.obj.append((int(round(c * PS)), x))
            return
        if len(outs) * len(needs) > FLOW_PAIRS_MAX:
            self.add_edge_big_m(k, e, have, outs, needs, cost)
            return
        y = {(o, r): self.m.NewBoolVar(f"y{k}") for o in outs for r in needs}
        self.flows.append((e, y))
        for o in outs:
            self.m.Add(sum(y[o, r] for r in needs) == sum(x for x, h in zip(xs, have) if h == o)
                       ).WithName(f"flow-out:{k}")
        for r in needs:
            self.m.Add(sum(y[o, r] for o in outs) == sum(x for x, n in zip(xd, e.need) if n == r)
                       ).WithName(f"flow-in:{k}")
        self.obj += [(int(round(c * PS)), y[key]) for key, c in cost.items() if c > 0]

    def add_edge_big_m(self, k: int, e, have, outs, needs, cost) -> None:
        """A large edge without pair variables: one cost variable c_e and, per needed layout r,
        c_e >= Σ_i cost(layout_i, r)·x[src,i] - max_o cost(o, r)·(1 - z_r)  (``edge:k:r``).
        Weaker in relaxation than the flow form, but linear in size."""
        xs, xd = self.xs(e.src), self.xs(e.dst)
        scaled = {key: int(round(c * PS)) for key, c in cost.items()}
        top = max(scaled.values())
        c_e = self.m.NewIntVar(0, top, f"c{k}")
        self.edge_costs.append((c_e, e, scaled))
        for r in needs:
            z = sum(x for x, n in zip(xd, e.need) if n == r)
            big = max(scaled[(o, r)] for o in outs)
            if big == 0:
                continue
            lhs = sum(scaled[(h, r)] * x for x, h in zip(xs, have) if scaled[(h, r)])
            self.m.Add(c_e >= lhs - big + big * z).WithName(f"edge:{k}")
        self.obj.append((1, c_e))

    def memory_exprs(self) -> list:
        """One linear expression of per-device bytes per check point."""
        always = self._bytes_terms(self.p.const_values)
        exprs = []
        for live in self.p.mem_points or [[]]:
            terms = dict(always)
            for key, c in self._bytes_terms(live).items():
                terms[key] = terms.get(key, 0) + c
            exprs.append(sum(c * self.xs(g)[i] for (g, i), c in terms.items() if c))
        return exprs

    def _bytes_terms(self, values) -> dict[tuple[int, int], int]:
        per_root: dict[int, np.ndarray] = {}
        for v in values:
            if v not in self.p.group_of_value:
                continue
            g = self.root[self.p.group_of_value[v]]
            kib = np.rint(value_bytes(self.p, v) / KIB).astype(np.int64)
            per_root[g] = per_root[g] + kib if g in per_root else kib
        return {(g, i): int(b) for g, arr in per_root.items() for i, b in enumerate(arr)}

    def restrict(self, allowed: Mapping[int, set[int]]) -> None:
        for g, ok in allowed.items():
            for i, x in enumerate(self.xs(g)):
                if i not in ok:
                    self.m.Add(x == 0).WithName(f"fixed:{g}:{i}")

    def hint(self, choice: Mapping[int, int]) -> None:
        """A complete starting solution: x from ``choice``, every flow y implied by it."""
        pick = {g: choice.get(g, 0) for g in self.x}
        for g, xs in self.x.items():
            for i, x in enumerate(xs):
                self.m.AddHint(x, i == pick[g])
        for e, y in self.flows:
            o = self.p.groups[e.src].shard[e.value][pick[self.root[e.src]]]
            r = e.need[pick[self.root[e.dst]]]
            for (oo, rr), var in y.items():
                self.m.AddHint(var, oo == o and rr == r)
        for c_e, e, scaled in self.edge_costs:
            o = self.p.groups[e.src].shard[e.value][pick[self.root[e.src]]]
            self.m.AddHint(c_e, scaled[(o, e.need[pick[self.root[e.dst]]])])


def _distinct(layouts) -> list:
    seen = {}
    for s in layouts:
        seen.setdefault(s, None)
    return list(seen)


def _solver(time_limit_s: float) -> cp_model.CpSolver:
    s = cp_model.CpSolver()
    s.parameters.num_workers = 1
    s.parameters.random_seed = 0
    s.parameters.max_deterministic_time = float(time_limit_s)
    # Probing in presolve spends a full deterministic second per pass on these 0-1 models and
    # found nothing the search does not; without it the search starts from the hint at once.
    s.parameters.cp_model_probing_level = 0
    # The LP relaxation of the flow constraints is tight: keeping it in the search proves
    # optimality several times faster (GPT, 2x4 mesh: 3.8 s against 26 s at the default level).
    s.parameters.linearization_level = 2
    # Presolve turned a complete, feasible hint (the best hand-written plan) infeasible on
    # GPT-39B and the search ended at 3x its cost; without presolve the hint is the first
    # solution and the ILP can only improve on it.
    s.parameters.cp_model_presolve = False
    return s


# Above this many flow pairs the full model costs more to build and search than it gains over
# the descent start: the solver works on the best few candidate strategies of each group.
FULL_MODEL_PAIRS = 10_000
CANDIDATES = 6


def solve(p: Problem, cost_model, memory_budget: float | None = None, time_limit_s: float = 30.0,
          allowed: Mapping[int, set[int]] | None = None,
          hint: Mapping[int, int] | None = None, seeds=()) -> Solution:
    """The best plan CP-SAT finds within ``time_limit_s`` (deterministic seconds), started from
    a descent from ``hint``. A model with more than ``FULL_MODEL_PAIRS`` flow pairs is solved
    over candidates: per root group the strategies of the start and of ``seeds`` (other good
    solutions, e.g. each hand-written start's), plus the ``CANDIDATES`` cheapest given the start;
    the solution then says so (``candidates``) and its gap is over those candidates."""
    from autopar.planner.descent import descend, local_costs

    start = descend(p, cost_model, dict(hint) if hint else None, allowed=allowed)
    if hint and memory_budget is not None:
        fits_start = memory_of(p, _as_tuple(p, start)) <= memory_budget
        if not fits_start and memory_of(p, _as_tuple(p, hint)) <= memory_budget:
            start = dict(hint)   # descent ignores memory: keep the start that fits
    if flow_pairs(p) <= FULL_MODEL_PAIRS:
        return _solve_model(p, cost_model, memory_budget, time_limit_s, allowed, start)
    local = local_costs(p, cost_model, {g: start[g] for g in start if p.root(g) == g})
    cands = {r: _candidates(r, cost, start, seeds, allowed, p) for r, cost in local.items()}
    small = restrict(p, cands)
    small_allowed = {g: {j for j, i in enumerate(cands[p.root(g)]) if i in ok}
                     for g, ok in (allowed or {}).items()}
    small_start = {g.id: cands[p.root(g.id)].index(start[g.id]) for g in p.groups}
    try:
        sol = _solve_model(small, cost_model, memory_budget, time_limit_s, small_allowed,
                           small_start)
    except PlanError:   # the candidates may miss what fits the budget: the whole model decides
        return _solve_model(p, cost_model, memory_budget, time_limit_s, allowed, start)
    choice = tuple(cands[p.root(g.id)][j] for g, j in zip(p.groups, sol.choice))
    return dataclasses.replace(sol, choice=choice, candidates=max(map(len, cands.values())))


def _candidates(r: int, cost, start, seeds, allowed, p: Problem) -> list[int]:
    """The start's strategy, the seeds' and the cheapest others (allowed ones only)."""
    ok = (allowed or {}).get(r)
    picks = [start[r]] + [s[r] for s in seeds if r in s]
    order = [int(i) for i in np.argsort(cost, kind="stable") if ok is None or i in ok]
    out = list(dict.fromkeys(i for i in picks if ok is None or i in ok))
    for i in order:
        if len(out) >= len(set(picks)) + CANDIDATES:
            break
        if i not in out:
            out.append(i)
    return out or [start[r]]


def _solve_model(p: Problem, cost_model, memory_budget, time_limit_s, allowed, start) -> Solution:
    import time

    mdl = _Model(p, cost_model)
    mdl.add_group_costs()
    mdl.add_edges()
    if allowed:
        mdl.restrict(allowed)
    if memory_budget is not None:
        for k, expr in enumerate(mdl.memory_exprs()):
            mdl.m.Add(expr <= int(memory_budget / KIB)).WithName(f"mem:{k}")
    mdl.hint(start)
    mdl.m.Minimize(sum(c * x for c, x in mdl.obj))
    solver = _solver(time_limit_s)
    t0 = time.perf_counter()
    status = solver.Solve(mdl.m)
    dt = time.perf_counter() - t0
    if status == cp_model.UNKNOWN and (memory_budget is None or
                                       memory_of(p, _as_tuple(p, start)) <= memory_budget):
        # The time limit ran out before CP-SAT rebuilt a solution: keep the descent plan, which
        # fits the budget, and report the solver's bound for the gap.
        from autopar.planner.descent import objective

        return Solution(_as_tuple(p, start), objective(p, cost_model, start),
                        max(0.0, solver.BestObjectiveBound() / PS), "DESCENT (time limit)", dt,
                        len(mdl.m.Proto().variables), len(mdl.m.Proto().constraints))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE and memory_budget is not None:
            raise _memory_error(p, cost_model, memory_budget, allowed)
        raise PlanError(f"the sharding ILP found no plan (solver status "
                        f"{solver.StatusName(status)} after {dt:.1f}s): raise time_limit_s or "
                        f"relax the fixed shardings")
    picked = {r: next(i for i, x in enumerate(xs) if solver.Value(x)) for r, xs in mdl.x.items()}
    choice = tuple(picked[p.root(g.id)] for g in p.groups)
    proto = mdl.m.Proto()
    return Solution(choice, solver.ObjectiveValue() / PS, solver.BestObjectiveBound() / PS,
                    solver.StatusName(status), dt, len(proto.variables), len(proto.constraints))


def _as_tuple(p: Problem, choice: Mapping[int, int]) -> tuple[int, ...]:
    return tuple(choice[g.id] for g in p.groups)


def min_memory_bytes(p: Problem, cost_model, allowed=None, time_limit_s: float = 10.0) -> float:
    """The smallest peak per-device memory any plan reaches (the least budget that fits)."""
    mdl = _Model(p, cost_model)
    if allowed:
        mdl.restrict(allowed)
    peak = mdl.m.NewIntVar(0, 2 ** 60, "peak")
    for expr in mdl.memory_exprs():
        mdl.m.Add(peak >= expr)
    mdl.m.Minimize(peak)
    solver = _solver(time_limit_s)
    status = solver.Solve(mdl.m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return float(solver.ObjectiveValue()) * KIB
    raise AssertionError(f"min-memory model: {solver.StatusName(status)} {mdl.m.Validate()}")


def _memory_error(p: Problem, cost_model, budget: float, allowed) -> PlanError:
    need = min_memory_bytes(p, cost_model, allowed)
    return PlanError(
        f"no plan fits a memory budget of {budget / 2**30:.3f} GiB per device on mesh "
        f"{dict(p.mesh)}: the smallest peak any plan reaches is {need / 2**30:.3f} GiB "
        f"({int(need)} bytes). Raise memory_budget to at least that, use a larger mesh, or shrink "
        f"the batch.")


def memory_of(p: Problem, choice) -> float:
    """Predicted peak per-device bytes of a chosen plan (same model as the constraints)."""
    base, points = _memory_tables(p)
    def total(table):
        return sum(float(arr[choice[g]]) for g, arr in table.items())
    return float(total(base) + max((total(t) for t in points), default=0.0))


def _memory_tables(p: Problem):
    """Per group, the bytes of its always-live values and of its values live at each check
    point, under each of its strategies (summed once per problem: descent asks per start)."""
    hit = p.__dict__.get("_memory_tables")
    if hit is None:
        def table(values):
            out: dict[int, np.ndarray] = {}
            for v in values:
                g = p.group_of_value.get(v)
                if g is not None:
                    b = value_bytes(p, v)
                    out[g] = out[g] + b if g in out else b
            return out
        hit = p.__dict__["_memory_tables"] = (table(p.const_values),
                                              [table(live) for live in p.mem_points])
    return hit
