"""The sharding ILP, solved with OR-tools CP-SAT, assembled from decision families.

Each family (``planner/families``: its protocol in ``families/__init__.py``) brings its
variables, named constraints, memory terms, objective terms, a start and a read-back:

  layouts   ``families/layouts.py``: one-hot x[g, i] per decision group, resharding edges
            (flows, shared moves, big-M edges), the combiner's launches, ``allowed`` pins;
  kernels   ``families/kernels.py``: a fused kernel or XLA per kernel site (``kernels="auto"``
            or ``"always"``).

Objective  min Σ over the families of their time terms (integer nanoseconds).

Memory     for each check point p of the schedule (``memory:p``), and each copy cut
           (``memory:cut:k``, added by ``make_plan`` when a plan's full estimate exceeds the
           budget): Σ over the families of their KiB at p ≤ budget.

``_build`` makes the model: per family in order ``variables`` then ``constraints``, then the
memory constraints, then the objective terms; ``_solve_model`` adds every family's start and
reads the choice back from the layouts. ``solve(..., families=)`` appends more families (a test
or a new decision) to the two above. One worker and a deterministic time limit keep the answer
the same from run to run.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
from ortools.sat.python import cp_model

from autopar.errors import BudgetError, PlanError
from autopar.planner import combine
from autopar.planner.budget import SEARCH_BEFORE, Clock
from autopar.planner.families import (
    KIB,
    PS,
    Model,
    OutOfTime,
    cut_point,
    memory_expr,
    memory_points,
    ns,
)
from autopar.planner.families.kernels import Kernels
from autopar.planner.families.layouts import Layouts
from autopar.planner.problem import Problem, flow_pairs, restrict, value_bytes

# Memory budgets above this many bytes cannot bind; capping keeps the KiB bound inside int64.
MAX_BUDGET = 2.0**62


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



def _solver(time_limit_s: float, wall_s: float = math.inf, num_vars: int = 0,
            repair: bool = False) -> cp_model.CpSolver:
    s = cp_model.CpSolver()
    s.parameters.num_workers = 1
    s.parameters.random_seed = 0
    s.parameters.max_deterministic_time = float(time_limit_s)
    # The wall-clock cap of the plan call (planner.budget): a solve it does not cut is the same
    # from run to run; one it cuts returns the best solution found so far.
    if math.isfinite(wall_s):
        s.parameters.max_time_in_seconds = float(wall_s)
    # Probing in presolve spends a full deterministic second per pass on these 0-1 models and
    # found nothing the search does not; without it the search starts from the hint at once.
    s.parameters.cp_model_probing_level = 0
    # The LP relaxation of the flow constraints is tight: keeping it in the search proves
    # optimality several times faster (GPT, 2x4 mesh: 3.8 s against 26 s at the default level).
    s.parameters.linearization_level = 2
    # ... and, on large models, all of it from the start: added lazily (CP-SAT's default), the
    # flow rows enter the LP as violated cuts over many rounds, and on the 30-40k-variable models
    # of small encoder-decoders (2-layer T5, Whisper on 2x4) that search ran 19-22 s of CPU; with
    # every row in the first LP it proves the same optimum in 1.4-2.7 s (unrolled GPT-2, 8k
    # variables: 3.4 s -> 0.9 s). Small models solve in a fraction of a second either way and
    # keep the default, so that their plans (ties included) stay as they were.
    if num_vars > EAGER_LP_VARS:
        s.parameters.add_lp_constraints_lazily = False
    # Presolve turned a complete, feasible hint (the best hand-written plan) infeasible on
    # GPT-39B and the search ended at 3x its cost; without presolve the hint is the first
    # solution and the ILP can only improve on it.
    s.parameters.cp_model_presolve = False
    # A cut round's first solve (``repair``) starts from the plan its cut rules out: CP-SAT
    # then searches near that hint first instead of from scratch (transformers' Llama-7B at one
    # sequence a device, 7.4k variables, one cut: the same optimum in 6 s instead of 22 s); a
    # hint that breaks no row is not repaired (``_solve_model``).
    s.parameters.repair_hint = repair
    if repair:
        # ... and with CP-SAT's own LP settings: the copy cut's rows make the eager level-2 LP
        # above slow to re-solve (Llama-7B's cut round: 6.0 s eager at level 2, 3.2 s lazy at
        # level 1, the same optimum; 4.7 s without the hint's repair)
        s.parameters.linearization_level = 1
        s.parameters.add_lp_constraints_lazily = True
        # ... and no conflicts spent on the repair phase alone: CP-SAT's default (10) ran it to
        # a poor first solution before the search proper (Llama-7B, the same optima in
        # deterministic time: one sequence a device 2.1 -> 1.4, two 4.3 -> 1.8)
        s.parameters.hint_conflict_limit = 0
    return s


# Models with more variables than this give CP-SAT all LP rows at once (see ``_solver``).
EAGER_LP_VARS = 5_000
# Above this many flow pairs the full model costs more to build and search than it gains over
# the descent start: the solver works on the best few candidate strategies of each group.
FULL_MODEL_PAIRS = 10_000
CANDIDATES = 6


def solve(p: Problem, cost_model, memory_budget: float | None = None, time_limit_s: float = 30.0,
          allowed: Mapping[int, set[int]] | None = None,
          hint: Mapping[int, int] | None = None, clock: Clock | None = None,
          hint_name: str = "HINT", seeds=(), cuts=(), score=None, explain: bool = True,
          beat_s: float | None = None, families=(), descend: bool = True) -> Solution:
    """The best plan CP-SAT finds from the descent start (see the module docstring); ``clock``
    (``planner.budget``) cuts the model build and the search at the call's wall-clock budget,
    and a plan kept without the ILP is labelled by where it came from (``hint_name`` for
    ``hint`` itself). A model with more than ``FULL_MODEL_PAIRS`` flow pairs is solved over
    candidates: per root group the strategies of the start and of ``seeds`` (other good
    solutions, e.g. each hand-written start's), plus the ``CANDIDATES`` cheapest given the start,
    then again around each better solution (``_solve_candidates``); the solution then says so
    (``candidates``) and its gap is over the last round's candidates.
    ``cuts``: ``memory.CopyCut``s, memory constraints that count resharded copies (added by
    ``make_plan`` when a solution's full estimate exceeds the budget). ``score``: choice -> the
    plan's predicted step, which candidate rounds compare (``_score``). ``beat_s``: the
    objective of a plan already in hand (``kept_s`` of it): once CP-SAT's bound shows that no
    solution of a solve of the whole model (not a candidate round's) comes in below it, the
    solve stops, with the best solution it has found (status FEASIBLE), or, where it has none,
    raises ``CannotBeat``. ``families``: makers (problem -> ``families.Family``) of decision
    families the model takes after the layouts' and the kernels', called for each model built
    (a candidate round's problem has the candidates as its strategies). ``descend=False``: start
    from ``hint`` itself, not the descent from it (a cut round's hint, which the descent, blind
    to copies, would walk back over the budget)."""
    clock = clock or Clock(time.perf_counter(), time_limit_s)
    if memory_budget is not None and (memory_lower_bound(p, allowed or {})
                                      > min(memory_budget, MAX_BUDGET) + _rounding_bytes(p)):
        # infeasible by the model's own memory constraints: the error CP-SAT's proof would
        # give, without building the model (transformers' Llama-7B at two sequences a device,
        # before its recomputation: 1.3 s of the call, folded and full graph); the smallest
        # budget is not sought once the call has spent its limit (a proof that the clock
        # would have cut short before)
        raise _memory_error(p, cost_model, memory_budget, allowed, clock,
                            explain and not clock.spent())
    start, name = _start(p, cost_model, memory_budget, allowed, hint, clock, hint_name,
                         descend)
    fits = memory_budget is None or memory_of(p, _as_tuple(p, start)) <= memory_budget
    if clock.spent(SEARCH_BEFORE) and fits:
        clock.note(f"time limit: returning the {name.lower()} plan without the ILP")
        return _kept(p, start, f"{name} (time limit)", 0.0, 0.0, (0, 0))
    run = _Run(cost_model, memory_budget, time_limit_s, clock, name, fits, tuple(cuts),
               _launches(p, start, cost_model), score, explain, beat_s, tuple(families))
    if flow_pairs(p) <= FULL_MODEL_PAIRS:
        return _solve_model(p, allowed, start, run)
    return _solve_candidates(p, allowed, start, seeds, run)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every model of one ``solve`` call shares."""

    cost_model: object
    memory_budget: float | None
    time_limit_s: float
    clock: Clock
    name: str         # where the start came from ("DESCENT", "HINT", ...)
    fits: bool        # the start fits the memory budget
    cuts: tuple = ()  # memory.CopyCut, in the full problem's strategy indices
    launches: Mapping = dataclasses.field(default_factory=dict)  # combine.launch_terms
    score: Callable | None = None   # choice -> the plan's predicted step (else the objective)
    explain: bool = True  # an infeasible budget's error seeks the smallest budget that fits
    beat_s: float | None = None   # stop once the bound shows no solution below this (seconds)
    families: tuple = ()  # makers of families after the layouts' and the kernels' (``solve``)


def _score(run: _Run, sol: Solution) -> float:
    """What rounds compare: the assembled plan's step time where the caller gives it (each
    round prices the combiner's launches by its own start's levels, so their objectives differ
    in what they approximate), else the objective."""
    return run.score(sol.choice) if run.score is not None else sol.objective_s


def _solve_candidates(p: Problem, allowed, start, seeds, run: _Run) -> Solution:
    """``_solve_model`` over each root's candidate strategies (``_candidates``), then again
    around each better solution (its strategies, the cheapest given it, the earlier
    solutions'), ``NEIGHBOURHOOD_ROUNDS`` times at most, while a round gains ``ROUND_GAIN``,
    the candidate model has at most ``ROUND_MAX_VARS`` variables and time is left. A cut round
    (``run.cuts``: a memory repair of a plan whose own rounds have run) takes no rounds: on
    transformers' Llama-7B at one sequence a device its round ran 6.4 s of a 20 s call and
    found nothing."""
    sol = _solve_round(p, allowed, start, seeds, run)
    for _ in range(NEIGHBOURHOOD_ROUNDS):
        if (not sol.candidates or sol.num_vars > ROUND_MAX_VARS   # whole model: exact
                or run.cuts or run.clock.spent(SEARCH_BEFORE)):
            break
        here, wider = dict(enumerate(sol.choice)), tuple(seeds) + (start,)
        try:
            nxt = _solve_round(p, allowed, here, wider, run, whole=False,
                               width=ROUND_CANDIDATES)
        except PlanError:
            break
        before, after = _score(run, sol), _score(run, nxt)
        if after >= before * (1 - 1e-9):
            break
        gain = 1 - after / before
        seeds, start, sol = wider, here, nxt
        if gain < ROUND_GAIN:
            break
    return sol


# Candidate solves around each better solution found (``_solve_candidates``), while the last
# one gained at least ROUND_GAIN, on candidate models of at most ROUND_MAX_VARS variables. A
# round costs about what the first candidate solve did: 0.3 s on GPT-6.7B at 8x8 (its layers
# tie: 7-9.5k variables), where a poor start's rounds gained 30%, 9% and 1.5%, and the wide
# conv net at 8x8 (4.5k variables) gains 6%; but 2-3 s on transformers' 2-layer Whisper at 2x4
# (few ties, 40k variables), whose rounds doubled its plan for 3.3%.
NEIGHBOURHOOD_ROUNDS = 4
ROUND_GAIN = 0.02
ROUND_MAX_VARS = 20_000
# A round searches more candidates per group than the first solve (CANDIDATES): a better plan
# can need several groups to leave the start together (GPT-1.3B at 8x2 unseeded: megatron's
# attention layouts), each no better than the start's alone. The rounds' ROUND_MAX_VARS limit
# keeps the wider models small.
ROUND_CANDIDATES = 10


def _solve_round(p: Problem, allowed, start, seeds, run: _Run, whole: bool = True,
                 width: int = CANDIDATES) -> Solution:
    """One candidate solve around ``start`` over ``width`` candidates besides the start's and
    the seeds'; ``whole``: when the candidates miss what fits the budget, solve the whole model
    instead (a later round keeps the solution it has)."""
    from autopar.planner.descent import local_costs

    local = local_costs(p, run.cost_model, {g: start[g] for g in start if p.root(g) == g})
    cands = {r: _candidates(r, cost, start, seeds, allowed, width) for r, cost in local.items()}
    small = restrict(p, cands)
    small_allowed = {g: {j for j, i in enumerate(cands[p.root(g)]) if i in ok}
                     for g, ok in (allowed or {}).items()}
    small_start = {g.id: cands[p.root(g.id)].index(start[g.id]) for g in p.groups}
    launches = _launches(p, start, run.cost_model)
    try:
        # no cutoff here: a candidate solve is short, and its plan's layouts are among auto's
        # candidates (cut short, a hand-written start's offered others: GPT-6.7B's plan 0.06%
        # slower)
        sol = _solve_model(small, small_allowed, small_start, dataclasses.replace(
            run, cuts=tuple(_restrict_cut(p, c, cands) for c in run.cuts),
            launches={r: [per_i[i] for i in cands[r]] for r, per_i in launches.items()},
            beat_s=None))
    except PlanError:   # the candidates may miss what fits the budget: the whole model decides
        if not whole:
            raise
        return _solve_model(p, allowed, start, dataclasses.replace(run, launches=launches))
    choice = tuple(cands[p.root(g.id)][j] for g, j in zip(p.groups, sol.choice))
    return dataclasses.replace(sol, choice=choice, candidates=max(map(len, cands.values())))


def _restrict_cut(p: Problem, cut, cands):
    """``cut`` in the candidates' indices: readers none of whose choices are candidates, and
    copies that can then no longer happen, are dropped."""
    def small(g, idx):
        return frozenset(j for j, i in enumerate(cands[p.root(g)]) if i in idx)

    copies = []
    for size, src, other, before, after in cut.copies:
        other = small(src, other)
        before = tuple((d, small(d, ix)) for d, ix in before if small(d, ix))
        after = tuple((d, small(d, ix)) for d, ix in after if small(d, ix))
        if other and before and after:
            copies.append((size, src, other, before, after))
    return dataclasses.replace(cut, copies=tuple(copies))


def _candidates(r: int, cost, start, seeds, allowed, width: int = CANDIDATES) -> list[int]:
    """The start's strategy, the seeds' and the ``width`` cheapest others (allowed ones only)."""
    ok = (allowed or {}).get(r)
    picks = [start[r]] + [s[r] for s in seeds if r in s]
    order = [int(i) for i in np.argsort(cost, kind="stable") if ok is None or i in ok]
    out = list(dict.fromkeys(i for i in picks if ok is None or i in ok))
    for i in order:
        if len(out) >= len(set(picks)) + width:
            break
        if i not in out:
            out.append(i)
    return out or [start[r]]


def _solve_model(p: Problem, allowed, start, run: _Run) -> Solution:
    clock, name = run.clock, run.name
    layouts = Layouts(allowed, run.launches, run.cost_model.hw.collective_launch_s,
                      clock if run.fits else None)
    kernels = (Kernels(p.kernel_sites, p.kernel_mode),) if p.kernel_sites else ()
    families = (layouts, *kernels, *(make(p) for make in run.families))
    try:
        mdl = _build(p, families, run.memory_budget, run.cuts)
    except OutOfTime:
        clock.note(f"time limit while building the ILP: returning the {name.lower()} plan")
        return _kept(p, start, f"{name} (time limit)", 0.0, 0.0, (0, 0))
    pick = {g: start.get(g, 0) for g in mdl.x}     # a complete start: every family's hints
    for family in families:
        family.start(mdl, pick)
    mdl.m.Minimize(sum(c * x for c, x in mdl.obj))
    size = (len(mdl.m.Proto().variables), len(mdl.m.Proto().constraints))
    solver = _solver(run.time_limit_s, clock.solver_wall_s(), size[0], repair=bool(run.cuts))
    if solver.parameters.repair_hint and _hint_holds(mdl.m):
        # a later cut round's hint, the plan so far, may break no row: CP-SAT's repair then
        # only slows its search (Llama-7B at two sequences a device, ``selective``'s second
        # round: 2.9 s of CPU with the repair, 0.9 s without, the same optimum)
        solver.parameters.repair_hint = False
    stopped = _stop_above(solver, run.beat_s, len(mdl.obj))
    t0 = time.perf_counter()
    status = solver.Solve(mdl.m)
    dt = time.perf_counter() - t0
    if stopped and status == cp_model.UNKNOWN:    # cut short by the bound, nothing found
        raise CannotBeat(f"{name}: no solution below {run.beat_s:.6g} s (CP-SAT's bound "
                         f"{solver.BestObjectiveBound() / PS:.6g} s after {dt:.1f} s)")
    if status == cp_model.UNKNOWN and run.fits:
        # The time limit ran out before CP-SAT rebuilt a solution: keep the descent plan, which
        # fits the budget, and report the solver's bound for the gap.
        return _kept(p, start, f"{name} (time limit)", solver.BestObjectiveBound() / PS, dt, size)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _no_plan(p, run.cost_model, run.memory_budget, allowed, solver, status, dt, clock,
                       mdl, run.explain)
    choice = layouts.read_back(mdl, solver)
    return Solution(choice, solver.ObjectiveValue() / PS, solver.BestObjectiveBound() / PS,
                    solver.StatusName(status), dt, *size)


def _hint_holds(model: cp_model.CpModel) -> bool:
    """Whether ``model``'s solution hint is complete and meets every constraint (linear, and
    the Boolean kinds the planner's models use; any other kind: not known, so False)."""
    proto = model.Proto()
    val = dict(zip(proto.solution_hint.vars, proto.solution_hint.values))
    if len(val) != len(proto.variables):
        return False

    def lit(v: int) -> int:
        return val[v] if v >= 0 else 1 - val[-v - 1]

    def within(x: int, domain) -> bool:
        d = list(domain)
        return any(lo <= x <= hi for lo, hi in zip(d[::2], d[1::2]))

    if not all(within(val[k], var.domain) for k, var in enumerate(proto.variables)):
        return False
    for c in proto.constraints:
        if not all(lit(v) for v in c.enforcement_literal):
            continue
        if c.has_linear():
            terms = c.linear
            total = sum(k * (val[v] if v >= 0 else -val[-v - 1])
                        for v, k in zip(terms.vars, terms.coeffs))
            ok = within(total, terms.domain)
        elif c.has_exactly_one():
            ok = sum(map(lit, c.exactly_one.literals)) == 1
        elif c.has_at_most_one():
            ok = sum(map(lit, c.at_most_one.literals)) <= 1
        elif c.has_bool_or():
            ok = any(map(lit, c.bool_or.literals))
        elif c.has_bool_and():
            ok = all(map(lit, c.bool_and.literals))
        else:
            ok = False
        if not ok:
            return False
    return True


class CannotBeat(PlanError):
    """A solve given ``beat_s`` stopped before it found a solution: CP-SAT's bound showed that
    none of its solutions has an objective below it."""


def _stop_above(solver: cp_model.CpSolver, beat_s: float | None, terms: int) -> list:
    """Makes ``solver`` stop once its objective bound reaches ``beat_s`` (a plan's ``kept_s``);
    returns a list that is non-empty once it did. Each of the model's ``terms`` objective terms
    is rounded to the nanosecond, so the bound must pass ``beat_s`` by that many nanoseconds
    to prove that the plan priced at ``beat_s`` is no worse than every solution."""
    fired: list = []
    if beat_s is None or not math.isfinite(beat_s):
        return fired
    cutoff = ns(beat_s) + terms

    def check(bound: float) -> None:
        if bound >= cutoff and not fired:
            fired.append(bound)
            solver.StopSearch()

    solver.best_bound_callback = check
    return fired


def kept_s(p: Problem, choice) -> float:
    """The objective ``choice`` (per group: strategy index) would have in any model of ``p``
    at most: every edge pays its move (a model shares some of a value's moves between its
    readers) and every all-reduce its launch (a model refunds merged ones). A solve whose bound
    reaches it has no solution better than ``choice`` by its own objective."""
    return _kept(p, dict(enumerate(choice)), "", 0.0, 0.0, (0, 0)).objective_s


def _launches(p: Problem, start, cost_model) -> dict:
    """``combine.launch_terms`` with levels read off ``start`` (full-problem indices)."""
    return combine.launch_terms(p, _as_tuple(p, start), cost_model.hw.collective_launch_s)


def _start(p: Problem, cost_model, memory_budget, allowed, hint, clock: Clock,
           hint_name: str, descend_: bool = True) -> tuple[dict[int, int], str]:
    """(start, its name): the descent plan from ``hint``; ``hint`` itself when asked
    (``descend_`` false), when the budget is spent (descent's edge matrices cost about as much
    as building the problem) or when only it fits the memory."""
    from autopar.planner.descent import OutOfTime, descend

    if hint and (not descend_ or clock.spent(SEARCH_BEFORE)):
        return dict(hint), hint_name
    try:     # with a hint to fall back on, the descent stops when the budget runs out
        start = descend(p, cost_model, dict(hint) if hint else None, allowed=allowed,
                        clock=clock if hint else None)
    except OutOfTime:
        return dict(hint), hint_name
    if hint and memory_budget is not None:
        fits_start = memory_of(p, _as_tuple(p, start)) <= memory_budget
        if not fits_start and memory_of(p, _as_tuple(p, hint)) <= memory_budget:
            return dict(hint), hint_name   # descent ignores memory: keep the start that fits
    return start, "DESCENT"


def _build(p: Problem, families, memory_budget: float | None = None, cuts=()) -> Model:
    """The model of ``families`` (in order: each one's variables, then its constraints; the
    memory constraints within ``memory_budget`` at each memory point, the copy cuts ``cuts``
    last; then each one's objective terms). Raises OutOfTime when a family's build runs out
    of the wall-clock budget."""
    mdl = Model(p)
    for family in families:
        family.variables(mdl)
        family.constraints(mdl)
    if memory_budget is not None:
        limit = int(min(memory_budget, MAX_BUDGET) / KIB)
        for point in memory_points(p, cuts):
            mdl.m.Add(memory_expr(mdl, families, point) <= limit).WithName(f"memory:{point.name}")
    for family in families:
        family.objective(mdl)
    return mdl


def _rounding_bytes(p: Problem) -> float:
    """How far below its bytes a memory constraint of the model can count: each value's bytes
    are rounded to the KiB (``Layouts.bytes_terms``), half a KiB at most, once per time the
    constraint counts it."""
    return KIB / 2 * (len(p.const_values) + max(map(len, p.mem_points), default=0))


def _kept(p: Problem, start, status: str, bound_s: float, dt: float, size) -> Solution:
    """A solution that keeps ``start``, costed edge by edge (no dense matrices)."""
    choice = _as_tuple(p, start)
    cost = sum(g.compute_s[choice[g.id]] + g.comm_s[choice[g.id]] for g in p.groups)
    for e in p.edges:
        src = p.groups[e.src].shard[e.value][choice[e.src]]
        cost += e.mult * p.reshard_s(e.value, src, e.need[choice[e.dst]])
    return Solution(choice, float(cost), max(0.0, bound_s), status, dt, *size)


def _no_plan(p: Problem, cost_model, memory_budget, allowed, solver, status, dt, clock,
             mdl, explain: bool = True) -> Exception:
    name = solver.StatusName(status)
    if status == cp_model.INFEASIBLE and memory_budget is not None:
        return _memory_error(p, cost_model, memory_budget, allowed, clock, explain)
    if status == cp_model.UNKNOWN:
        return BudgetError(
            f"no plan within the memory budget of {memory_budget / 2**30:.3f} GiB per device on "
            f"mesh {dict(p.mesh)} was found in {clock.elapsed_s():.1f} s (time_limit_s="
            f"{clock.limit_s:g}); the descent start does not fit. Raise time_limit_s or "
            f"memory_budget.")
    if status == cp_model.INFEASIBLE:
        return PlanError(f"the fixed input layouts admit no plan on mesh {dict(p.mesh)} (solver "
                         f"status {name} after {dt:.1f}s); relax the strategy's fixed layouts")
    raise AssertionError(f"sharding ILP: {name}: {mdl.m.Validate()}")


def _as_tuple(p: Problem, choice: Mapping[int, int]) -> tuple[int, ...]:
    return tuple(choice[g.id] for g in p.groups)


def min_memory(p: Problem, cost_model, allowed=None, time_limit_s: float = 10.0,
               wall_s: float = math.inf) -> tuple[tuple[int, ...], float] | None:
    """(choice, budget) of the plan with the smallest peak per-device memory the solver finds
    (``wall_s``: the wall-clock seconds of all its solves together),
    or None when it finds none within its time limits. ``budget`` is a memory budget under
    which this plan is both feasible for the solver's memory terms (KiB per value) and within
    the full estimate (``memory.estimate``: exact bytes, resharded copies included), so a plan
    made with it fits (``make_plan`` falls back to this choice when its own does not)."""
    from autopar.planner import memory

    layouts = Layouts(allowed, priced=False)
    families = (layouts,)
    mdl = _build(p, families)
    peak = mdl.m.NewIntVar(0, 2 ** 60, "memory:peak")
    for point in memory_points(p):
        mdl.m.Add(peak >= memory_expr(mdl, families, point)).WithName(f"memory:{point.name}")
    mdl.m.Minimize(peak)
    best = None
    end = time.perf_counter() + wall_s     # wall_s bounds all rounds together
    for k in range(MIN_MEMORY_CUTS + 1):   # each round counts the last plan's copies at its peak
        left = end - time.perf_counter()
        if k and left <= 0:
            break
        solver = _solver(time_limit_s, max(left, 0.1))
        status = solver.Solve(mdl.m)
        if status == cp_model.UNKNOWN:
            break
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise AssertionError(f"min-memory model: {solver.StatusName(status)} "
                                 f"{mdl.m.Validate()}")
        choice = layouts.read_back(mdl, solver)
        est = memory.estimate(p, choice)
        found = (choice, max(float(solver.ObjectiveValue()) * KIB, float(math.ceil(est.peak))))
        best = found if best is None or found[1] < best[1] else best
        if est.peak <= solver.ObjectiveValue() * KIB:
            break
        point = cut_point(k, memory.cut_at(p, est.peak_position))
        mdl.m.Add(memory_expr(mdl, families, point) <= peak).WithName(f"memory:{point.name}")
    return best


# Rounds of copy cuts ``min_memory`` adds when its plan's full estimate exceeds its memory terms.
MIN_MEMORY_CUTS = 6


def min_memory_bytes(p: Problem, cost_model, allowed=None, time_limit_s: float = 10.0,
                     wall_s: float = math.inf) -> float | None:
    """The smallest memory budget found that a plan fits (``min_memory``), or None."""
    found = min_memory(p, cost_model, allowed, time_limit_s, wall_s)
    return None if found is None else found[1]


def kept_choice(p: Problem, choice: tuple[int, ...], status: str) -> Solution:
    """``choice`` as a solution, costed edge by edge (``_kept``)."""
    return _kept(p, dict(enumerate(choice)), status, 0.0, 0.0, (0, 0))


def _memory_error(p: Problem, cost_model, budget: float, allowed, clock: Clock,
                  explain: bool = True) -> PlanError:
    """The error of a budget no plan fits; ``explain``: with the smallest budget that fits
    (``min_memory``'s search: seconds), else saying it was not sought."""
    where = (f"no plan fits a memory budget of {budget / 2**30:.3f} GiB per device on mesh "
             f"{dict(p.mesh)}")
    if not explain:
        return BudgetError(f"{where} (the smallest that fits was not sought)")
    # the search for the smallest budget (an error's advice) gets what is left of the call's
    # time, at least a tenth of it: not MIN_MEMORY_CUTS full solves after the time ran out. On
    # the deterministic clock it gets the whole limit, whatever the wall clock says: what was
    # left of the wall clock made the advice (and an offload or recompute search that starts
    # from it) depend on the machine's load (a small GPT's least budget: 2.0 MB idle, 3.6 MB
    # with the host busy, so a test's budget under it found nothing to offload)
    left = (clock.limit_s if clock.deterministic
            else max(clock.limit_s - clock.elapsed_s(), 0.1 * clock.limit_s))
    need = min_memory_bytes(p, cost_model, allowed, time_limit_s=min(10.0, left),
                            wall_s=math.inf if clock.deterministic
                            else min(clock.solver_wall_s(), left))
    if need is None:
        return BudgetError(f"{where}, and the smallest budget that fits was not found within "
                         f"time_limit_s={clock.limit_s:g}. Raise memory_budget, use a larger "
                         f"mesh, or raise time_limit_s to learn the smallest budget.")
    return BudgetError(
        f"{where}: the smallest peak found for any plan is {need / 2**30:.3g} GiB "
        f"({int(need)} bytes: memory_budget={int(need)} plans). Raise memory_budget to at least "
        f"that, use a larger mesh, or shrink the batch.", need)


def memory_of(p: Problem, choice) -> float:
    """Predicted peak per-device bytes of a chosen plan (same model as the constraints).
    ``choice``: a strategy index per group, in group order (``_as_tuple``). Each table's
    entries are gathered with numpy and summed in table order, one float at a time, as a sum
    over the table's groups would: the same float at any depth, without a Python step per
    group."""
    base, points = _memory_tables(p)
    pick = np.asarray(choice, dtype=np.int64)

    def total(table) -> float:
        gids, flat, offsets = table
        return sum(flat[offsets + pick[gids]].tolist())

    return float(total(base) + max((total(t) for t in points), default=0.0))


def memory_lower_bound(p: Problem, allowed: Mapping[int, set[int]],
                       rounded: bool = False) -> float:
    """Bytes every plan that keeps to ``allowed`` holds at its peak at least, by the memory
    model of the constraints (``memory_of``): at each check point, each group's always-live
    values and values live there under its smallest allowed strategy for them (a pinned
    input's, exactly; tied groups each their own smallest), the largest over the check points.
    ``rounded``: each check point's bound less half a KiB per value it counts, so that it is
    below the solver's own terms too, which round each value's bytes to the nearest KiB.

    It bounds the solver's memory terms, not the full estimate (``memory.estimate``), which
    lets temporaries use the step's result buffers before the results are written
    (``memory._output_slots``) where these terms hold each result the whole step, and can be
    lower (12% on a 2-layer GPT with d_model 16 on one device, 0.3-0.5% on a 4-layer one with
    d_model 32: on one device that pooling is the whole gap). So a budget below this
    bound proves only that the solver finds no plan under it: ``planner._seeds`` skips a
    start whose ``rounded`` bound exceeds the budget without solving it, as its solve would
    find nothing (transformers' Llama-7B at one sequence a device on 64 H100s: dp's, ep's and
    zero1's starts, whose always-live state alone fits 80 GiB, each took 0.7 s to fail)."""
    base, points = _memory_tables(p)
    n_base, n_points = _memory_counts(p)
    half = KIB / 2 if rounded else 0.0

    def rows(table) -> dict[int, np.ndarray]:
        gids, flat, offsets = table
        return {g: flat[o: o + p.groups[g].n] for g, o in zip(gids.tolist(), offsets.tolist())}

    def least(row: np.ndarray, g: int) -> float:
        ok = allowed.get(g)
        return float(row[sorted(ok)].min() if ok else row.min())

    always = rows(base)
    best = sum(least(row, g) for g, row in always.items()) - half * n_base
    for table, n in zip(points, n_points):
        here = rows(table)
        total = sum(least(row + here[g] if g in here else row, g) for g, row in always.items())
        total += sum(least(row, g) for g, row in here.items() if g not in always)
        best = max(best, total - half * (n_base + n))
    return best


def _memory_counts(p: Problem) -> tuple[int, list[int]]:
    """How many values (a folded graph's twins each) ``_memory_tables`` sums: always live, and
    live at each check point."""
    hit = p.memo.memory_counts
    if hit is None:
        def count(values) -> int:
            return sum(1 for v in values if v in p.group_of_value)
        hit = p.memo.memory_counts = (count(p.const_values),
                                      [count(live) for live in p.mem_points])
    return hit


def _memory_tables(p: Problem):
    """Per group, the bytes of its always-live values and of its values live at each check
    point, under each of its strategies (summed once per problem: descent asks per start), each
    table as (group ids, their per-strategy arrays concatenated, each array's offset)."""
    hit = p.memo.memory_tables
    if hit is None:
        def table(values):
            out: dict[int, np.ndarray] = {}
            for v, n in Counter(values).items():    # a folded graph repeats its twins'
                g = p.group_of_value.get(v)
                if g is not None:
                    b = value_bytes(p, v) * n     # a new array: the memo is not modified
                    out[g] = out[g] + b if g in out else b
            arrays = list(out.values())
            sizes = np.array([len(a) for a in arrays], dtype=np.int64)
            offsets = np.cumsum(sizes) - sizes
            flat = np.concatenate(arrays) if arrays else np.zeros(0)
            return np.array(list(out), dtype=np.int64), flat, offsets
        hit = p.memo.memory_tables = (table(p.const_values),
                                         [table(live) for live in p.mem_points])
    return hit


def lower_bound_s(p: Problem, cost_model, allowed=None) -> float:
    """A bound below every plan's predicted step (``allowed`` respected): each root's cheapest
    allowed strategy alone, with its top-level all-reduces' launches free, plus the resharding
    its reads of values whose layout ``allowed`` fixes (a pinned input) must pay, plus the
    dispatch. A value read by k groups of one edge set moves at most once per layout, so each
    reader is charged 1/k of its move. Weak where little is pinned, but valid for the whole
    problem (a candidate solve's own bound is not), and tight enough to show that a start
    whose pinned parameters every step gathers cannot beat a plan already in hand."""
    allowed = allowed or {}
    launch_s = cost_model.hw.collective_launch_s
    terms = combine.launch_terms(p, (0,) * len(p.groups), launch_s)
    net = {}
    for r, cost in p.root_costs().items():
        n = np.array([k for k, _ in terms[r]]) if r in terms else 0
        net[r] = cost - launch_s * n
    for es in p.merged_edge_sets():
        e0 = es[0]
        src = allowed.get(p.root(e0.src))
        if src is None or len(src) != 1:
            continue
        have = p.groups[e0.src].shard[e0.value][next(iter(src))]
        for e in es:
            d = p.root(e.dst)
            if d == p.root(e.src):
                continue
            net[d] = net[d] + np.array([e.mult * p.reshard_s(e.value, have, need)
                                        for need in e.need]) / len(es)
    total = float(getattr(cost_model.hw, "dispatch_s", 0.0))
    for r, vec in net.items():
        ok = allowed.get(r)
        total += float(min(vec[i] for i in ok) if ok else vec.min())
    return max(total, 0.0)
