"""The intra-operator planner: ``ir.Graph`` -> ``autopar.Plan``.

Stages (each a pure function): ``problem.build`` (strategies from ``rules``, costs from
``cost_models``, groups and edges) -> ``ilp.solve`` -> ``assemble`` (the Plan).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable, Mapping

import numpy as np

from autopar.errors import AutoparError, BudgetError, PlanError, ShardingError
from autopar.options import PlannerOptions, Request
from autopar.plan import Collective, CostBreakdown, Plan, SolverStats
from autopar.planner import (
    combine,
    constraints,
    descent,
    ilp,
    kernel_choice,
    memory,
    offload,
    pins,
    problem,
    recompute,
    scatter,
)
from autopar.planner.budget import SEARCH_BEFORE, START_BEFORE, Clock, warn_many_axes
from autopar.planner.reshard import reshard_steps, step_bytes, step_hbm_bytes
from autopar.planner.unfold import unfold
from autopar.sharding import Sharding, fmt
from cost_models.collectives import hbm_bytes as collective_hbm_bytes
from ir import Graph, collector
from ir.fold import fold

__all__ = ["make_plan"]


def _allowed(prob: problem.Problem, fixed: Mapping[int, Sharding]) -> dict[int, set[int]]:
    """Restrict fixed inputs to their given layout; a layout the planner does not offer is an
    error."""
    allowed, seen = {}, {}    # (strategies, layout) -> indices: tied inputs share strategies
    for k, want in fixed.items():
        grp = prob.groups[prob.input_group[k]]
        key = (id(grp.strategies), want)
        ok = seen.get(key)
        if ok is None:
            ok = seen[key] = {i for i, s in enumerate(grp.strategies) if s.outs[0] == want}
        # the inputs of repeated layers share one set object (read only, as ``_filtered``'s
        # are): ``descent._masked`` then masks once per (root, set), not once per layer
        if not ok:
            t = prob.graph.values[prob.graph.inputs[k]]
            raise ShardingError(
                f"input {prob.graph.input_paths[k]} with shape {t.shape} cannot take layout "
                f"{fmt(want)} on mesh {dict(prob.mesh)}: every split dim must divide by its axes' "
                f"sizes and a dim holds at most two axes. Pick a layout whose axes divide the "
                f"shape.")
        allowed[prob.input_group[k]] = ok
    return allowed


def operand_origins(prob: problem.Problem, op) -> tuple[str | None, ...]:
    """Per operand of ``op``: the pytree path of the graph input whose decision it follows
    (a parameter seen through casts and reshapes), or None for a computed value."""
    out = []
    for v in op.ins:
        g = prob.group_of_value.get(v)
        leader = prob.groups[g].leader if g is not None else 0
        k = -1 - leader
        out.append(prob.graph.input_paths[k] if 0 <= k < len(prob.graph.inputs) else None)
    return tuple(out)


def _takes_origins(op_filter) -> bool:
    import inspect

    try:
        return len(inspect.signature(op_filter).parameters) >= 3
    except (TypeError, ValueError):
        return False


def _filtered(prob: problem.Problem, op_filter, allowed: dict[int, set[int]]) -> None:
    """Let a hand-written strategy veto op strategies (e.g. ZeRO-1 forbids reduce-scatter).
    ``op_filter(op, strategy)`` or ``op_filter(op, strategy, origins)`` (see operand_origins)."""
    with_origins = _takes_origins(op_filter)
    origins = _group_origins(prob) if with_origins else {}
    seen: dict[tuple, set[int]] = {}   # a repeated layer's groups ask once per role
    for grp in prob.groups:
        if grp.leader < 0 or grp.id in allowed:
            continue
        mine, kind = origins.get(grp.id, (None, ()))
        key = (prob.root(grp.id), kind)
        ok = seen.get(key)
        if ok is None:
            op, extra = prob.graph.op(grp.leader), (mine,) if with_origins else ()
            ok = seen[key] = {i for i, st in enumerate(grp.strategies) if op_filter(op, st, *extra)}
        if ok and len(ok) < grp.n:
            allowed[grp.id] = ok


def _group_origins(prob: problem.Problem) -> dict[int, tuple]:
    """Op-led group -> (``operand_origins`` of its leader, ``_origin_kinds`` of them): the same
    for every hand-written start, so computed once per problem."""
    hit = prob.memo.group_origins
    if hit is None:
        kinds: dict[tuple, tuple] = {}     # origins -> _origin_kinds of them
        hit = prob.memo.group_origins = {}
        for grp in prob.groups:
            if grp.leader >= 0:
                mine = operand_origins(prob, prob.graph.op(grp.leader))
                kind = kinds.get(mine)
                if kind is None:
                    kind = kinds[mine] = _origin_kinds(mine)
                hit[grp.id] = (mine, kind)
    return hit


def _origin_kinds(origins: tuple[str | None, ...]) -> tuple:
    """Origins with layer indices dropped: ``['h']['3']['attn']`` and ``['h']['7']['attn']`` filter
    alike, so tied groups are asked once."""
    return tuple(None if o is None else re.sub(r"\d+", "#", o) for o in origins)


@dataclasses.dataclass(frozen=True)
class _Seed:
    """A complete plan the auto search starts from and is held against: the free descent, a
    given hint, or a hand-written strategy's own plan (``name``)."""

    name: str
    choice: tuple[int, ...]          # per group: strategy index
    step_s: float                    # plan_cost of it
    peak: float | None               # its estimated peak memory (None: no budget asked for it)
    status: str = ""                 # its solver's status
    # A hand-written start's unrepaired solve, (its problem, allowed, solution), while its plan
    # breaks the budget: ``_never_worse`` repairs it with cut rounds only if it could still win.
    repair: tuple | None = dataclasses.field(default=None, compare=False, repr=False)


def _seeds(prob: problem.Problem, cm, allowed, options: PlannerOptions, hint,
           clock: Clock) -> list[_Seed]:
    """The plans auto's search must beat: the free descent (from ``hint``), ``hint`` itself,
    and every hand-written start's own plan, solved as ``plan(strategy=...)`` solves it (its
    layouts pinned, its op filter applied, the same ILP) on this problem. Starts that pin the
    same layouts as an earlier one (fsdp and zero3; ep without experts) are solved once; one
    that does not apply to the step or fits no plan is skipped. Starts are tried while the call
    is within ``START_BEFORE`` times its time limit (see ``planner.budget``).

    A start whose plan breaks the memory budget through the resharded copies the solver's
    memory terms do not see is kept unrepaired (``_Seed.repair``): its cut rounds, which only
    add constraints and so only raise its cost, run in ``_never_worse`` when its unrepaired
    cost is still below the best plan that fits (transformers' Llama-7B at one sequence a
    device: three starts' repairs took 6 of the call's 20-30 s, and none could win)."""
    budget = options.memory_budget
    free = descent.descend(prob, cm, dict(hint) if hint else None, allowed=allowed,
                           clock=clock)
    out = [_seed(prob, cm, "descent", free, budget)]
    if hint:
        out.append(_seed(prob, cm, "hint", hint, budget))
    given = {}
    for plan in options.seed_plans:
        choice = choice_of(prob, plan)
        if len(choice) == len(prob.groups):     # a plan of another graph (a folded one) is not
            given[plan.strategy] = _seed(prob, cm, plan.strategy, choice, budget)
    out += list(given.values())
    pinned = {}
    for strat in options.starts:     # strategies pinning the same layouts are solved once
        if getattr(strat, "name", None) in given:
            continue
        got = _pinned(prob, strat, allowed)
        if got is not None:
            key = frozenset((g, frozenset(ok)) for g, ok in got[1].items())
            pinned.setdefault(key, got)
    # Branch and bound: a start whose every plan costs at least the best seed so far cannot
    # win; the weakest bounds are tried first, so the best seeds come early.
    bounded = sorted((ilp.lower_bound_s(prob.untied(m), cm, m), n, m) for n, m in pinned.values())
    start_clock = clock.for_starts()
    for k, (bound, name, merged) in enumerate(bounded):
        if clock.spent(START_BEFORE):
            clock.note(f"time limit: tried {k} of {len(bounded)} hand-written starts")
            break
        best = _cheapest(out, budget)
        if best is not None and bound >= best.step_s:
            continue
        sub = prob.untied(merged)
        if budget is not None and ilp.memory_lower_bound(sub, merged, rounded=True) > budget:
            continue           # its solve would find no plan (the bound of the solver's terms)
        try:
            sol = ilp.solve(sub, cm, budget, options.time_limit_s, merged, clock=start_clock,
                            score=_scorer(prob, cm), explain=False,
                            beat_s=_in_hand_s(prob, out, budget))
        except PlanError:      # this strategy fits no plan, or its solve proved it cannot beat
            continue           # a plan in hand (ilp.CannotBeat): auto has nothing to beat here
        seed = _seed(prob, cm, name, sol.choice, budget)
        out.append(dataclasses.replace(
            seed, status=sol.status, repair=None if _fits(seed, budget) else (sub, merged, sol)))
    return out


def _in_hand_s(prob: problem.Problem, seeds: list[_Seed], budget) -> float | None:
    """The least ``ilp.kept_s`` of the seeds that fit ``budget``: a start's solve whose bound
    reaches it cannot beat a plan in hand by the solver's own objective, and stops there
    (GPT-6.7B under full remat on {data: 2, model: 4} H100s: zero1's solve ran CP-SAT to the
    wall clock, 24 s, for a plan 20% slower than the descent's in hand, which its first LP
    bound, 0.5 s in, already exceeded). None where nothing fits, or where kernels are chosen
    (a kernel site's terms price a plan above its ``kept_s``)."""
    if prob.kernel_sites:
        return None
    fitting = [s for s in seeds if _fits(s, budget)]
    return min((ilp.kept_s(prob, s.choice) for s in fitting), default=None)


def _repaired(prob, cm, seed: _Seed, options: PlannerOptions, clock: Clock) -> _Seed | None:
    """``seed`` after ``SEED_CUT_ROUNDS`` cut rounds (``_within_budget``), as
    ``plan(strategy=...)`` would start to repair it; None if it still breaks the budget."""
    sub, merged, sol = seed.repair
    # _within_budget keeps the last solution when a round's solve finds none
    kept, peak, _ = _within_budget(sub, sol, cm, options, merged, clock.for_starts(),
                                   SEED_CUT_ROUNDS, 0, seek_least=False)
    if peak > options.memory_budget:
        return None
    return _Seed(seed.name, kept.choice, plan_cost(prob, cm, kept.choice), peak, kept.status)


def choice_of(prob: problem.Problem, plan: Plan) -> dict[int, int]:
    """Group id -> strategy index that reproduces ``plan``'s op choices and input layouts on
    ``prob`` (partial where ``plan`` was made on another graph)."""
    by_leader = {g.leader: g for g in prob.groups}
    out: dict[int, int] = {}
    for op_id, _prim, _src, name in plan.choices:
        g = by_leader.get(op_id)
        idx = next((i for i, s in enumerate(g.strategies) if s.name == name), None) if g else None
        if idx is not None:
            out[g.id] = idx
    if len(plan.input_shardings) != len(prob.input_group):
        return out
    for k, layout in enumerate(plan.input_shardings):
        g = prob.groups[prob.input_group[k]]
        idx = next((i for i, s in enumerate(g.strategies) if s.outs[0] == layout), None)
        if idx is not None:
            out[g.id] = idx
    return out


def _seed(prob, cm, name: str, choice, budget) -> _Seed:
    choice = ilp._as_tuple(prob, choice) if isinstance(choice, Mapping) else tuple(choice)
    peak = None if budget is None else memory.estimate(prob, choice).peak
    return _Seed(name, choice, plan_cost(prob, cm, choice), peak)


def _seed_plan(prob: problem.Problem, seed: _Seed, cm, options: PlannerOptions) -> Plan:
    """A seed as a Plan (of ``prob``'s graph), labelled with its strategy."""
    stats = SolverStats(seed.status or "DESCENT", None, 0.0, 0.0, 0.0, prob.num_decisions, 0, 0)
    return assemble(prob, seed.choice, cm, cm.hw.name, seed.name, options.memory_budget, stats,
                    seed.peak)


def _pinned(prob: problem.Problem, strat, allowed) -> tuple[str, dict[int, set[int]]] | None:
    """(name, allowed strategies per group) of a hand-written strategy on this problem, None
    when it does not apply (a layout the planner does not offer, a mesh it cannot take)."""
    sizes = dict(prob.mesh)
    try:
        if hasattr(strat, "bind"):
            strat = strat.bind(prob.graph, sizes)
        fixed = _allowed(prob, strat.fix_inputs(prob.graph, sizes))
        if getattr(strat, "allows", None) is not None:
            _filtered(prob, strat.allows, fixed)
        if getattr(strat, "keeps_constraints", False):
            constraints.restrict(prob, fixed)
    except (ShardingError, PlanError):
        return None
    return getattr(strat, "name", "start"), {**fixed, **allowed}


def _fits(seed: _Seed, budget) -> bool:
    return budget is None or seed.peak is None or seed.peak <= budget


def _cheapest(seeds: list[_Seed], budget) -> _Seed | None:
    """The cheapest seed that fits ``budget`` (the first of equals: the ILP's own plan wins
    ties)."""
    fitting = [s for s in seeds if _fits(s, budget)]
    return min(fitting, key=lambda s: s.step_s) if fitting else None


def _cheapest_alone(prob: problem.Problem, allowed, hint=None) -> dict[int, int]:
    """``hint``'s choices, else each decision group's cheapest allowed strategy, resharding
    ignored: a valid plan that needs none of descent's edge matrices (which cost about as much as
    building the problem)."""
    from autopar.planner.descent import _expand

    cost = dict(prob.root_costs())        # new arrays below: the memo is not modified
    for g, ok in allowed.items():
        r = prob.root(g)
        cost[r] = cost[r] + np.array([0.0 if i in ok else np.inf for i in range(len(cost[r]))])
    hint = hint or {}
    return _expand(prob, {r: hint.get(r, int(np.argmin(c))) for r, c in cost.items()})


def _allowed_in_time(prob: problem.Problem, options: PlannerOptions, clock: Clock):
    """``_allowed``; a build cut short by the time limit offers inputs only whole, which is no
    fault of the strategy's layouts: say so."""
    try:
        return _allowed(prob, options.fixed_inputs or {})
    except ShardingError as e:
        if not clock.spent(SEARCH_BEFORE):
            raise
        raise PlanError(f"time_limit_s={clock.limit_s:g} ran out while the problem was built "
                        f"({clock.elapsed_s():.1f} s), before the layouts strategy "
                        f"{options.strategy!r} fixes were offered ({e}); raise time_limit_s"
                        ) from None


def make_plan(request: Request, *, trace_s: float = 0.0) -> Plan:
    """Plan ``request.graph`` on ``request.mesh`` under ``request.options`` (see
    ``autopar.options.Request``); ``trace_s``: seconds of the time limit already spent.

    With ``options.starts`` (hand-written strategies) each one's own plan is solved on the same
    problem (``_seeds``); the cheapest that fits the budget is the solver's starting point, every
    seed's strategies are among the solver's candidates, and the plan returned is the cheapest of
    the solver's and the seeds' (``_never_worse``): auto is never predicted slower than a start.

    Where no plan fits ``options.memory_budget`` and the step has scanned layers, the step is
    planned again with their saved values recomputed (``planner.recompute``) or its state
    offloaded (``planner.offload``), the whole search in one more time limit (see
    ``planner.budget``), rewritten steps proved unable to win skipped unplanned
    (``planner.prune``).
    """
    graph, mesh, cost_model = request.graph, dict(request.mesh), request.cost_model
    options = request.options
    # the call's clock: the error's advice, and the memory decisions' search once a plan is
    # in hand (each plan below keeps its own)
    began = Clock(time.perf_counter() - trace_s, options.time_limit_s, options.deterministic)
    open_ = options.op_filter is None and options.memory_budget is not None
    may_r = open_ and options.recompute and recompute.has_sites(graph, cost_model)
    # whether the step has state to offload is read (a retrace) only once the budget breaks
    may_o = open_ and options.offload and cost_model.hw.host_bytes_per_s > 0
    try:    # where a memory decision may follow, a failure need not seek the smallest budget
        plan = _plan_layouts(graph, mesh, cost_model,
                             options.replace(explain_budget=False) if may_r or may_o
                             else options, trace_s=trace_s)
    except BudgetError as e:
        if not may_r:       # with recomputation offered, read where offload is tried
            may_o = may_o and offload.offerable(graph, cost_model)
        if not (may_r or may_o):
            if e.least_bytes is None and options.explain_budget:   # the advice, after all
                if began.spent():
                    raise BudgetError(f"{e} {_NOT_SOUGHT}", None) from None
                return _plan_layouts(graph, mesh, cost_model, options, trace_s=trace_s)
            raise
        return _memory_decisions(graph, mesh, cost_model, options, e, may_r, may_o, began)
    return _traded(graph, mesh, cost_model, options, plan) if may_r else plan


def _traded(graph, mesh, cost_model, options, plan: Plan) -> Plan:
    """Mist's trade (Zhu et al., EuroSys'25): where the budget binds the plan's layouts (a
    start it ruled out is predicted faster, ``SolverStats.ruled_out``; any gain at all, since
    a recomputed step can be predicted faster than the plain one: fewer saved values
    written), the step is planned again with its saved values recomputed
    (``recompute.plan_recomputed``: the policies share one time limit, and one proved no faster
    than the plan in hand is not planned), and the faster of the two plans is returned. A step
    whose plan the budget does not bind is left as it is, and costs nothing more."""
    ruled = plan.solver.ruled_out
    # ruled_out is faster than the solver's plan; the assembled plan's own cost may differ
    if ruled is None or ruled[1] > plan.cost.step_time_s:
        return plan
    gain = plan.cost.step_time_s / ruled[1]
    held = BudgetError(f"the start {ruled[0]!r} is predicted {gain:.2f}x faster than the plan "
                       f"but needs {ruled[2] / 2**30:.3f} GiB per device",
                       plan.cost.peak_memory_bytes)
    try:      # a policy that cannot beat the plan in hand is not planned (planner.prune)
        traded = recompute.plan_recomputed(graph, mesh, cost_model,
                                           options.replace(explain_budget=False), held,
                                           _plan_layouts, beat_s=plan.cost.step_time_s)
    except AutoparError:
        return plan
    return traded if traded.cost.step_time_s < plan.cost.step_time_s else plan


# Where the call has spent its time limit, the smallest budget is not sought for the error's
# advice: a search from a plan built greedily in no time gives no useful figure (transformers'
# Llama-7B at one sequence a device: 3.89e3 GiB, after 30 s more).
_NOT_SOUGHT = ("The smallest budget a plan fits was not sought: the call had spent its "
               "time_limit_s; raise time_limit_s to have it sought.")


def _memory_decisions(graph, mesh, cost_model, options, error: BudgetError, may_r: bool,
                      may_o: bool, began: Clock) -> Plan:
    """The fastest plan that fits where the plain step does not: its loops' saved values
    recomputed, or its state offloaded; where neither fits alone, each recomputation policy
    with its state offloaded too (tried last: each pairing plans the step up to three times).
    ``may_o``: offload may apply; whether the step has state to offload (a walk of its inlined
    step: 0.6 s of CPU on transformers' Llama-7B) is read only where offload is tried."""
    offers = functools.cache(lambda: offload.offerable(graph, cost_model))

    def layouts_then_offload(g, mesh, cost_model, opts, *, trace_s=0.0):
        try:
            return _plan_layouts(g, mesh, cost_model, opts.replace(explain_budget=False),
                                 trace_s=trace_s)
        except BudgetError as e:
            if not offload.offerable(g, cost_model):
                raise
            return offload.plan_offloaded(g, mesh, cost_model, opts, e, _plan_layouts)

    found, failed = [], []
    tries = [(recompute.plan_recomputed, _plan_layouts)] if may_r else []
    tries += [(offload.plan_offloaded, _plan_layouts)] if may_o else []
    both = [(recompute.plan_recomputed, layouts_then_offload)] if may_r and may_o else []
    # the call's time limit: a plan in hand stops the search once the call has spent it
    # (planner.budget)
    clock = began
    skipped = []
    for decide, plan_one in tries + both:
        if found and plan_one is layouts_then_offload:
            break
        if found and clock.spent(START_BEFORE):   # heuristic, and said so in the plan's notes
            skipped.append(f"{decide.__module__.rsplit('.', 1)[-1]}: not tried: the memory "
                           f"decisions' search had spent its time limit "
                           f"({clock.elapsed_s():.1f} s of time_limit_s={clock.limit_s:g}) with "
                           f"a plan in hand")
            continue
        if (decide is offload.plan_offloaded or plan_one is layouts_then_offload) and not offers():
            continue
        best_s = min((p.cost.step_time_s for p in found), default=None)
        try:      # with offload after each policy its step's bound does not hold: none used
            found.append(decide(graph, mesh, cost_model, options, error, plan_one, clock=clock,
                                beat_s=best_s, bounded=plan_one is _plan_layouts))
        except BudgetError as e:
            failed.append(e)
    if not found:
        least = [e.least_bytes for e in failed if e.least_bytes is not None]
        if not least and options.explain_budget and began.spent():
            failed.append(BudgetError(_NOT_SOUGHT, None))
        elif not least and options.explain_budget:   # the smallest budget the plain step fits
            try:
                _plan_layouts(graph, mesh, cost_model, options)
            except BudgetError as e:
                failed.insert(0, e)
                least = [e.least_bytes] if e.least_bytes is not None else []
        raise BudgetError(" ".join(str(e) for e in failed), min(least) if least else None)
    best = min(found, key=lambda p: p.cost.step_time_s)
    notes = [n for p in found if p is not best for n in p.notes if n not in best.notes]
    return dataclasses.replace(best, notes=tuple(best.notes) + tuple(notes + skipped))


def _plan_layouts(graph: Graph, mesh: Mapping[str, int], cost_model, options: PlannerOptions,
                  *, trace_s: float = 0.0) -> Plan:
    """``make_plan`` without the memory decisions: the layouts (and kernels) of ``graph``."""
    with collector.paused():   # see ir.collector: a sixth of a deep plan went to collections
        t0 = time.perf_counter()
        folded = _foldable(graph, options)
        if folded is not None:
            seeds: list[Callable[[], Plan]] = []
            try:
                plan = _make_plan(folded.graph, mesh, cost_model, options, trace_s, t0, folded,
                                  seeds)
            except PlanError:     # the full graph's own planning says what does not fit
                plan = None
            budget = options.memory_budget
            if plan is not None and (budget is None or plan.cost.peak_memory_bytes <= budget):
                return unfold(plan, folded)
            trace_s += time.perf_counter() - t0    # the full graph plans in what is left
            t0 = time.perf_counter()
            # the hand-written starts' plans, solved on the folded graph (whose objective is
            # the full graph's for the same decisions), are held against the full graph's plan
            # as they are, not solved again on it: that took 230 s of 340 on Llama-7B
            options = options.replace(starts=(), seed_plans=tuple(options.seed_plans) + tuple(
                unfold(assembled(), folded) for assembled in seeds))
        return _make_plan(graph, mesh, cost_model, options, trace_s, t0)


def _foldable(graph: Graph, options: PlannerOptions):
    """``ir.fold.fold(graph)`` when the plan may be made on it (``PlannerOptions.fold``):
    nothing pins inputs, filters ops, hints groups or chooses kernels by the full graph's
    indices."""
    if (not options.fold or options.fixed_inputs or options.op_filter is not None
            or options.keep_constraints or options.hint or options.kernels != "never"):
        return None
    return fold(graph)


def _make_plan(graph: Graph, mesh: Mapping[str, int], cost_model, options: PlannerOptions,
               trace_s: float, t0: float, folded=None, keep_seeds: list | None = None) -> Plan:
    """One plan of ``graph``; ``keep_seeds``: a list that receives, per hand-written start, a
    function that assembles its plan: as solved, then as ``_never_worse`` left it (repaired
    where it could win). Assembled only if asked for (a folded plan over the budget)."""
    clock = Clock(t0 - trace_s, options.time_limit_s, options.deterministic)
    warn_many_axes(mesh, clock)
    prob = problem.build(graph, mesh, cost_model, clock=clock, host_inputs=options.host_inputs,
                         folded=folded)
    prob = kernel_choice.prepare(prob, cost_model, options.kernels, clock)
    allowed = _allowed_in_time(prob, options, clock)
    if options.op_filter is not None:
        _filtered(prob, options.op_filter, allowed)
    if options.keep_constraints:      # the user's strategy: the step's constraints as written
        constraints.restrict(prob, allowed)
    prob = prob.untied(allowed)
    hint, hint_name, seeds = options.hint, "HINT", []
    if clock.spent(SEARCH_BEFORE):
        clock.note(f"building the problem ({len(prob.groups)} decision groups) spent the time "
                   f"limit; each group takes its cheapest strategy alone, no descent or ILP")
        hint, hint_name = _cheapest_alone(prob, allowed, hint), "GREEDY"
    elif options.starts or options.seed_plans:
        try:
            seeds = _seeds(prob, cost_model, allowed, options, hint, clock)
        except descent.OutOfTime:
            clock.note(f"the descent's reshard prices ({len(prob.groups)} decision groups) "
                       f"spent the time limit; each group takes its cheapest strategy alone, "
                       f"no ILP")
            seeds = [_seed(prob, cost_model, "greedy", _cheapest_alone(prob, allowed, hint),
                           options.memory_budget)]
        _keep(keep_seeds, prob, seeds, cost_model, options)
        # the cheapest seed that fits; else the cheapest (an unrepaired start's plan is a good
        # hint even where its copies break the budget: the solve's own cut rounds repair it)
        start = (_cheapest(seeds, options.memory_budget)
                 or min(seeds, key=lambda s: s.step_s))
        hint, hint_name = dict(enumerate(start.choice)), start.name.upper()
    build_s = time.perf_counter() - t0
    sol = ilp.solve(prob, cost_model, options.memory_budget, options.time_limit_s, allowed, hint,
                    clock=clock, hint_name=hint_name,
                    seeds=[dict(enumerate(s.choice)) for s in seeds],
                    score=_scorer(prob, cost_model), explain=options.explain_budget)
    sol, peak, least = _within_budget(prob, sol, cost_model, options, allowed, clock,
                                      seek_least=options.explain_budget)
    sol, peak, exact, seeds, ruled_out = _never_worse(prob, cost_model, sol, peak, seeds,
                                                      options, clock)
    _keep(keep_seeds, prob, seeds, cost_model, options)
    stats = SolverStats(sol.status, sol.gap if exact and not sol.candidates else None, sol.solve_s,
                        build_s, trace_s, prob.num_decisions, sol.num_vars, sol.num_constraints,
                        sol.candidates, ruled_out=ruled_out)
    plan = assemble(prob, sol.choice, cost_model, cost_model.hw.name, options.strategy,
                    options.memory_budget, stats, peak)
    plan = kernel_choice.finish(plan, prob, sol.choice, cost_model)
    if folded is None:      # a folded plan over the budget is planned again on the full graph
        _check_budget(plan, options.memory_budget, prob, least)
    return plan


def _keep(keep_seeds: list | None, prob, seeds: list[_Seed], cm, options) -> None:
    if keep_seeds is not None:
        keep_seeds[:] = [functools.partial(_seed_plan, prob, s, cm, options) for s in seeds
                         if s.name not in ("descent", "hint")]


def _never_worse(prob, cm, sol, peak, seeds: list[_Seed], options: PlannerOptions,
                 clock: Clock):
    """The ILP's plan, or the cheapest seed where one is cheaper by the assembled plan's own
    figures (``plan_cost``): the ILP's objective approximates the combiner's launches by its
    start's levels and works over candidates on large models, so the plans it started from are
    held against it here. A start kept unrepaired (``_Seed.repair``) whose cost is below the
    best plan that fits is repaired now (``_repaired``), cheapest first: repairs only raise a
    cost, so one at or above the best cannot win. The status says which plan won. Returns
    (solution, its peak, whether it is the solver's own: a seed's plan has no gap the solver
    could vouch for, the seeds with those repairs, and ``SolverStats.ruled_out``: the cheapest
    start over the budget, unrepaired, that is faster than the plan returned)."""
    budget = options.memory_budget
    mine = _Seed("ilp", tuple(sol.choice), plan_cost(prob, cm, sol.choice), peak)
    seeds = list(seeds)
    over = [s for s in seeds if s.repair is not None and s.peak is not None]
    for s in sorted((s for s in seeds if s.repair is not None), key=lambda s: s.step_s):
        best = _cheapest([mine, *seeds], budget)
        if best is not None and s.step_s >= best.step_s:
            break
        seeds.remove(s)
        fixed = _repaired(prob, cm, s, options, clock)
        if fixed is not None:
            seeds.append(fixed)
    best = _cheapest([mine, *seeds], budget)
    won = mine if best is None or best.step_s >= mine.step_s * (1 - 1e-12) else best
    faster = [s for s in over if s.step_s < won.step_s * (1 - 1e-9)]
    ruled = min(faster, key=lambda s: s.step_s) if faster else None
    ruled_out = None if ruled is None else (ruled.name, ruled.step_s, ruled.peak)
    if won is mine:
        return sol, peak, True, seeds, ruled_out
    status = (f"{best.name} plan ({best.status or 'descent'}): the ILP's plan "
              f"({sol.status}) was predicted {mine.step_s / best.step_s:.3f}x slower")
    return dataclasses.replace(sol, choice=best.choice, status=status,
                               objective_s=best.step_s), best.peak, False, seeds, ruled_out


def _within_budget(prob, sol, cost_model, options, allowed, clock, rounds=None,
                   margins=None, seek_least: bool = True):
    """The solver's memory constraints see resharded copies only through cuts added lazily
    (``planner.memory``): while the chosen plan's full estimate exceeds the budget, add a
    ``CopyCut`` at its peak and solve again, ``COPY_CUT_ROUNDS`` times at most (or ``rounds``).
    The first round starts from the descent from the plan (as the plain solve did); each later
    one from the plan so far, which every cut but the new one already holds: the descent, blind
    to copies, walked it back to plans the cuts rule out, and CP-SAT first spent its search
    repairing that start (transformers' Llama-7B at two sequences a device, ``selective``: its
    second round's peak is at the first cut's position again, whose cut undercounts the
    estimate there by 1 GiB; from the plan so far, with no second copy of the cut, which the
    plan meets, so CP-SAT does not repair it: 4.8 s of CPU -> 1.0 s, the same plan). Should
    the plan still break the budget, the budget shapes the solve: ``MARGIN_ROUNDS`` (or
    ``margins``) more solves, each under the solver's limit less what the plan so far holds
    beyond the budget (the copies no cut caught, a folded graph's gap, which the estimate sees
    and the solver's memory terms do not). Keeps the first
    solution that fits, else (``least``) the plan of least memory if it fits, else the lowest
    estimated peak (``_check_budget`` then refuses it; ``seek_least=False``: not sought).
    Returns (the solution, its estimated peak, ``ilp.min_memory``'s answer if it was sought;
    Nones when no budget asked for one)."""
    budget = options.memory_budget
    if budget is None:
        return sol, None, None
    est = memory.estimate(prob, sol.choice)
    best, cuts, limit = (est.peak, sol), [], budget
    cut_rounds = COPY_CUT_ROUNDS if rounds is None else rounds
    for k in range(cut_rounds + (MARGIN_ROUNDS if margins is None else margins)):
        if est.peak <= budget or clock.spent(SEARCH_BEFORE):
            break
        if k < cut_rounds:
            cuts += _new_cut(prob, cuts, est.peak_position)
        else:
            limit -= est.peak - budget      # what the plan so far holds beyond the budget
            if limit <= 0:
                break
        try:      # after the first round, from the plan so far (_within_budget's note)
            sol = ilp.solve(prob, cost_model, limit, options.time_limit_s, allowed,
                            _as_map(sol.choice), clock=clock, hint_name="FIRST SOLUTION",
                            cuts=cuts, explain=False, descend=k == 0)
        except PlanError:
            break
        est = memory.estimate(prob, sol.choice)
        best = min(best, (est.peak, sol), key=lambda b: b[0])
    if est.peak <= budget or not seek_least:
        return (sol, est.peak, None) if est.peak <= budget else (best[1], best[0], None)
    # The plan of least memory: it is taken if it fits, and its budget is what the PlanError of
    # _check_budget suggests otherwise.
    least = ilp.min_memory(prob, cost_model, allowed, options.time_limit_s, clock.solver_wall_s())
    if least is not None and least[1] <= budget:
        kept = ilp.kept_choice(prob, least[0], "MIN MEMORY")
        return kept, memory.estimate(prob, kept.choice).peak, least
    return best[1], best[0], least


def _new_cut(prob, cuts: list, position: int) -> list:
    """``[memory.cut_at(prob, position)]``, or none where ``cuts`` has one at ``position``
    already: a cut is its position's, and the same one twice only doubles its rows (the
    round then searches around the plan so far under the cuts it has)."""
    if any(c.position == position for c in cuts):
        return []
    return [memory.cut_at(prob, position)]


def _as_map(choice) -> dict[int, int]:
    return choice if isinstance(choice, Mapping) else dict(enumerate(choice))


# Re-solves with copy cuts when a plan's resharded copies break the memory budget: each round
# adds the copies live at the new peak. The cases seen fit after one to four: the 3-layer MLP of
# test_memory_budget_below_replicated_adam... takes four from the descent's ops-first start (its
# first solution, as fast as the other start's, holds other copies), three from the other.
COPY_CUT_ROUNDS = 6
# Then re-solves under a budget less what the estimate holds beyond the solver's memory terms:
# transformers' Llama-7B on {data: 8, model: 8} at one sequence a device, folded, still broke
# 80 GiB (90.2 GiB) after six cut rounds, and planning the full graph instead took 467 s.
MARGIN_ROUNDS = 3
# A hand-written start's plan gets this many cut rounds and no margin rounds (auto's own gets
# COPY_CUT_ROUNDS and MARGIN_ROUNDS): one that still breaks the budget is dropped as a seed,
# though plan(strategy=...) with its full rounds might fit it. A 7B model's dp start went
# through all six (7 solves) to end over 80 GiB, a third of the plan call.
SEED_CUT_ROUNDS = 2


def _check_budget(plan: Plan, budget: float | None, prob, least) -> None:
    """A plan whose full estimate exceeds the budget is refused, with the smallest budget a plan
    was found to fit (``least``: ``ilp.min_memory``'s answer). The ILP sees resharded copies
    (and bytes below 1 KiB) only through the cuts ``_within_budget`` adds (see
    ``planner.memory``), so its own solution may not fit."""
    peak = plan.cost.peak_memory_bytes
    if budget is None or peak <= budget:
        return
    need = None if least is None else least[1]
    smallest = ("no smaller plan was found in time" if need is None else
                f"the smallest peak found for any plan is {need / 2**30:.3g} GiB ({int(need)} "
                f"bytes: memory_budget={int(need)} plans)")
    raise BudgetError(
        f"no plan fits a memory budget of {budget / 2**30:.3g} GiB ({int(budget)} bytes) per "
        f"device on mesh {dict(prob.mesh)}: the solver's best plan peaks at {int(peak)} bytes "
        f"by the full estimate (exact bytes and the copies its resharding makes, which the "
        f"solver counts only in part: {COPY_CUT_ROUNDS} rounds of copy cuts did not bring it "
        f"within); {smallest}. Raise memory_budget to at least that, use a larger mesh, or "
        f"shrink the batch.", need)


def _layout(prob: problem.Problem, choice, v: int) -> Sharding:
    g = prob.group_of_value.get(v)
    if g is None:
        return ((),) * len(prob.graph.values[v].shape)
    return prob.groups[g].shard[v][choice[g]]


@dataclasses.dataclass
class _Tally:
    """What a plan's choice adds up to: its collectives and seconds, and the bytes of the local
    slices its transitions take (not collectives, but kernels that read and write memory)."""

    collectives: list[Collective] = dataclasses.field(default_factory=list)
    compute_s: float = 0.0
    comm_s: float = 0.0
    transition_s: float = 0.0
    slice_bytes: float = 0.0


def _collectives(prob: problem.Problem, choice, cm) -> _Tally:
    """Every collective of the plan, with compute, op-collective and transition seconds."""
    tally = _Tally()
    priced = _Priced(prob, cm)    # repeated layers price the same few collectives and moves
    for g in prob.groups:
        i = choice[g.id]
        tally.compute_s += g.compute_s[i]
        tally.comm_s += g.comm_s[i]
        for op_id, per_i in g.members.items():
            mult = g.mults.get(op_id, 1.0)
            comms = per_i[i].comms
            if not comms:
                continue
            where, source = _where(prob, op_id), _source(prob, op_id)
            last = scatter.last_reduce(comms)
            for c in comms:
                seconds, moved = priced.collective(c.kind, c.nbytes, c.axes)
                kind = c.kind
                if c is last and scatter.scattered(prob, g, op_id, i, c.axes, choice):
                    # XLA turns an all-reduce whose every reader slices it over the reduced
                    # axes into a reduce-scatter (ReduceScatterCreator): priced as one
                    rs_s, moved = priced.collective("reduce-scatter", c.nbytes, c.axes)
                    tally.comm_s += mult * (rs_s - seconds)
                    kind, seconds = "reduce-scatter", rs_s
                tally.collectives.append(Collective(
                    where, kind, c.axes, c.nbytes, mult * seconds, mult, *source, moved))
        for e in g.self_edges:
            _edge_collectives(prob, e, g.shard[e.value][i], e.need[i], priced, tally)
    for es in prob.edge_sets():   # a value moved to one layout for several readers moves once
        src = prob.groups[es[0].src].shard[es[0].value][choice[es[0].src]]
        moves = {}
        for e in es:
            moves.setdefault(e.need[choice[e.dst]], e)
        for need, e in moves.items():
            tally.transition_s += _edge_collectives(prob, e, src, need, priced, tally)
    return tally


class _Priced:
    """Seconds and bytes of collectives and staged transitions, memoised by what they read."""

    def __init__(self, prob: problem.Problem, cm):
        self.prob, self.cm, self.memo = prob, cm, {}

    def collective(self, kind: str, nbytes: float, axes) -> tuple[float, float]:
        """(seconds, bytes it reads and writes in memory) of one collective."""
        key = ("c", kind, nbytes, axes)
        hit = self.memo.get(key)
        if hit is None:
            n = math.prod(self.prob.mesh[a] for a in axes)
            hit = self.memo[key] = (self.cm.collective_time_s(kind, nbytes, axes),
                                    collective_hbm_bytes(kind, nbytes, n))
        return hit

    def steps(self, v: int, src: Sharding, need: Sharding) -> tuple:
        """(step, bytes it moves, collective bytes, unscaled seconds) per step of a staged
        transition of value ``v`` (``reshard_steps``)."""
        t = self.prob.graph.values[v]
        key = ("s", t, src, need)
        hit = self.memo.get(key)
        if hit is None:
            mesh, out, before = self.prob.mesh, [], src
            for step in reshard_steps(src, need, mesh):
                moved = step_hbm_bytes(t, before, step, mesh)
                before = step.layout
                if step.kind == "slice":
                    out.append((step, moved, 0.0, 0.0))
                    continue
                nbytes = step_bytes(t, step, mesh)
                out.append((step, moved, nbytes,
                            self.cm.collective_time_s(step.kind, nbytes, step.axes)))
            hit = self.memo[key] = tuple(out)
        return hit


def _edge_collectives(prob: problem.Problem, e, src: Sharding, need: Sharding, priced: _Priced,
                      tally: _Tally) -> float:
    """Adds the collectives of one resharding edge to ``tally``, one per step of its staged
    transition (a local slice adds its bytes only); returns their seconds."""
    seconds = 0.0
    for step, moved, nbytes, unit_s in priced.steps(e.value, src, need):
        if step.kind == "slice":
            tally.slice_bytes += e.mult * moved
            continue
        time_s = e.mult * unit_s
        seconds += time_s
        tally.collectives.append(Collective(
            f"edge {e.where} {fmt(src)}->{fmt(need)}", step.kind, step.axes, nbytes, time_s,
            e.mult, *_source(prob, e.op), moved))
    return seconds


def _where(prob: problem.Problem, op_id: int) -> str:
    if op_id < 0:
        return "input"
    op = prob.graph.op(op_id)
    return f"op{op_id} {op.prim}" + (f" @ {op.source}" if op.source else "")


def _source(prob: problem.Problem, op_id: int) -> tuple[str, str]:
    """(``file.py:LINE`` of an op's user source, its name stack), ``("", "")`` for none."""
    if op_id < 0:
        return "", ""
    op = prob.graph.op(op_id)
    return op.source.split(" ")[0], op.name


def _hbm_bytes(prob: problem.Problem, choice, tally: _Tally) -> float:
    """Per-device bytes the step's kernels and collectives read and write: each group's fused
    kernels (``ir.fusion``), every collective with the copies around it, and local slices."""
    kernels = sum(g.hbm_bytes[choice[g.id]] for g in prob.groups)
    moved = sum(c.hbm_bytes * c.count for c in tally.collectives)
    return float(kernels + moved + tally.slice_bytes)


def _bytes_by_kind(colls) -> tuple[tuple[str, float], ...]:
    out: dict[str, float] = {}
    for c in colls:
        out[c.kind] = out.get(c.kind, 0.0) + c.nbytes * c.count
    return tuple(sorted(out.items()))


def _reduces(colls) -> list[tuple[int, tuple[str, ...], float]]:
    """(op id, axes, executions per step) of the plan's all-reduces: the op that issues one
    (``op17 ...``) or reads its result (``edge op12:arg1 ...``); ``combine`` keeps those run
    once per execution of their region."""
    out = []
    for c in colls:
        m = re.match(r"(?:edge )?op(\d+)", c.where)
        if c.kind == "all-reduce" and m:
            out.append((int(m.group(1)), tuple(c.axes), c.count))
    return out


def _seconds(prob: problem.Problem, cm, tally: _Tally) -> tuple[float, ...]:
    """(dispatch, compute, collectives, resharding, combiner refund) seconds of a plan's tally:
    XLA merges independent all-reduces over one group, whose launches are then paid once
    (``combine``); the refund comes off the collectives first, then off resharding."""
    dispatch = float(getattr(cm.hw, "dispatch_s", 0.0))
    compute, comm, transition = tally.compute_s, tally.comm_s, tally.transition_s
    refund = combine.launch_refund_s(prob.graph, _reduces(tally.collectives),
                                     cm.hw.collective_launch_s)
    comm, transition = comm - min(refund, comm), transition - min(max(refund - comm, 0.0),
                                                                  transition)
    return dispatch, compute, comm, transition, refund


def _scorer(prob: problem.Problem, cm):
    return lambda choice: plan_cost(prob, cm, choice)


def plan_cost(prob: problem.Problem, cm, choice) -> float:
    """The predicted step time of ``choice`` (per group: strategy index), as ``assemble``'s
    ``CostBreakdown.step_time_s`` gives it."""
    return sum(_seconds(prob, cm, _collectives(prob, choice, cm))[:4])


def assemble(prob: problem.Problem, choice, cm, hardware_name: str, strategy: str,
             memory_budget: float | None, stats: SolverStats, peak: float | None = None) -> Plan:
    """The ``Plan`` of ``choice``; ``peak``: its estimated peak memory when the caller has it."""
    g = prob.graph
    tally = _collectives(prob, choice, cm)
    colls = tally.collectives
    by_kind: dict[str, float] = {}
    for c in colls:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.time_s
    dispatch, compute, comm, transition, refund = _seconds(prob, cm, tally)
    if refund:
        by_kind["all-reduce"] = max(by_kind.get("all-reduce", 0.0) - refund, 0.0)
    cost = CostBreakdown(compute + comm + transition + dispatch, compute, comm, transition,
                         memory.estimate(prob, choice).peak if peak is None else peak,
                         memory_budget,
                         tuple(sorted(by_kind.items(), key=lambda kv: -kv[1])), dispatch,
                         _bytes_by_kind(colls), _hbm_bytes(prob, choice, tally))
    in_layout = tuple(prob.groups[prob.input_group[k]].shard[v][choice[prob.input_group[k]]]
                      for k, v in enumerate(g.inputs))
    out_layout = tuple(in_layout[prob.output_pairs[j]] if j in prob.output_pairs
                       else _layout(prob, choice, v) for j, v in enumerate(g.outputs))
    choices = tuple((grp.leader, g.op(grp.leader).prim, g.op(grp.leader).source,
                     grp.strategies[choice[grp.id]].name)
                    for grp in prob.groups if grp.leader >= 0)
    return Plan(tuple(prob.mesh.items()), hardware_name, strategy, g.fingerprint(),
                g.input_paths, g.output_paths, tuple(g.values[v].shape for v in g.inputs),
                in_layout, out_layout, pins.pins(prob, choice), choices, tuple(colls), cost, stats,
                in_tree=g.in_tree, out_tree=g.out_tree,
                constraints=constraints.followed(prob, choice))
