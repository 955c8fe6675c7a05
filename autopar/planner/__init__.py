"""The intra-operator planner: ``ir.Graph`` -> ``autopar.Plan``.

Stages (each a pure function): ``problem.build`` (strategies from ``rules``, costs from
``cost_models``, groups and edges) -> ``ilp.solve`` -> ``assemble`` (the Plan).
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping

import numpy as np

from autopar.errors import PlanError, ShardingError
from autopar.options import PlannerOptions
from autopar.plan import Collective, CostBreakdown, Plan, SolverStats
from autopar.planner import combine, ilp, kernel_choice, memory, pins, problem
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
    hit = prob.__dict__.get("_group_origins")
    if hit is None:
        kinds: dict[tuple, tuple] = {}     # origins -> _origin_kinds of them
        hit = prob.__dict__["_group_origins"] = {}
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


def _best_start(prob: problem.Problem, cm, allowed, starts, hint, budget, clock: Clock):
    """The cheapest descent solution that fits ``budget`` among the hand-written starts, the
    free descent and ``hint``. A start over the budget would leave CP-SAT to repair it, which
    under a time limit ends far from the optimum. Starts are tried while the call is within
    ``START_BEFORE`` times its time limit (see ``planner.budget``)."""
    from autopar.planner import descent

    sizes = dict(prob.mesh)

    def fits(choice) -> bool:
        return budget is None or ilp.memory_of(prob, ilp._as_tuple(prob, choice)) <= budget

    free = descent.descend(prob, cm, dict(hint) if hint else None, allowed=allowed)
    best = (descent.objective(prob, cm, free), free) if fits(free) else None
    seeds = [free]
    for k, strat in enumerate(starts):
        if clock.spent(START_BEFORE):
            clock.note(f"time limit: tried {k} of {len(starts)} hand-written starts")
            break
        try:
            if hasattr(strat, "bind"):
                strat = strat.bind(prob.graph, sizes)
            fixed = _allowed(prob, strat.fix_inputs(prob.graph, sizes))
            if getattr(strat, "allows", None) is not None:
                _filtered(prob, strat.allows, fixed)
        except Exception:  # noqa: BLE001 - a start that does not apply is skipped
            continue
        merged = {**fixed, **allowed}
        choice = descent.descend(prob, cm, allowed=merged)
        cost = descent.objective(prob, cm, choice)
        seeds.append(choice)
        if fits(choice) and (best is None or cost < best[0]):
            best = (cost, choice)
    return (best[1] if best else free), seeds


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


def make_plan(graph: Graph, mesh: Mapping[str, int], cost_model,
              options: PlannerOptions | None = None, *, trace_s: float = 0.0) -> Plan:
    """Plan ``graph`` on ``mesh`` under ``options`` (see ``autopar.options.PlannerOptions``).

    With ``options.starts`` (hand-written strategies) each one's descent solution is costed and
    the cheapest that fits the budget is the solver's starting point, so the plan is never
    predicted slower than the starts' descent solutions.
    """
    options = options or PlannerOptions()
    with collector.paused():   # see ir.collector: a sixth of a deep plan went to collections
        t0 = time.perf_counter()
        folded = _foldable(graph, options)
        if folded is not None:
            try:
                plan = _make_plan(folded.graph, mesh, cost_model, options, trace_s, t0, folded)
            except PlanError:     # the full graph's own planning says what does not fit
                plan = None
            budget = options.memory_budget
            if plan is not None and (budget is None or plan.cost.peak_memory_bytes <= budget):
                return unfold(plan, folded)
            trace_s += time.perf_counter() - t0    # the full graph plans in what is left
            t0 = time.perf_counter()
        return _make_plan(graph, mesh, cost_model, options, trace_s, t0)


def _foldable(graph: Graph, options: PlannerOptions):
    """``ir.fold.fold(graph)`` when the plan may be made on it (``PlannerOptions.fold``):
    nothing pins inputs, filters ops, hints groups or chooses kernels by the full graph's
    indices."""
    if (not options.fold or options.fixed_inputs or options.op_filter is not None
            or options.hint or options.kernels != "never"):
        return None
    return fold(graph)


def _make_plan(graph: Graph, mesh: Mapping[str, int], cost_model, options: PlannerOptions,
               trace_s: float, t0: float, folded=None) -> Plan:
    clock = Clock(t0 - trace_s, options.time_limit_s, options.deterministic)
    warn_many_axes(mesh, clock)
    prob = problem.build(graph, mesh, cost_model, clock=clock, host_inputs=options.host_inputs,
                         folded=folded)
    kernel_choice.prepare(prob, cost_model, options.kernels, clock)
    allowed = _allowed_in_time(prob, options, clock)
    if options.op_filter is not None:
        _filtered(prob, options.op_filter, allowed)
    prob.untie(allowed)
    hint, hint_name, seeds = options.hint, "HINT", []
    if clock.spent(SEARCH_BEFORE):
        clock.note(f"building the problem ({len(prob.groups)} decision groups) spent the time "
                   f"limit; each group takes its cheapest strategy alone, no descent or ILP")
        hint, hint_name = _cheapest_alone(prob, allowed, hint), "GREEDY"
    elif options.starts:
        (hint, seeds), hint_name = _best_start(prob, cost_model, allowed, options.starts, hint,
                                               options.memory_budget, clock), "DESCENT"
    build_s = time.perf_counter() - t0
    sol = ilp.solve(prob, cost_model, options.memory_budget, options.time_limit_s, allowed, hint,
                    clock=clock, hint_name=hint_name, seeds=seeds)
    sol, peak, least = _within_budget(prob, sol, cost_model, options, allowed, clock)
    stats = SolverStats(sol.status, sol.gap, sol.solve_s, build_s, trace_s, prob.num_decisions,
                        sol.num_vars, sol.num_constraints, sol.candidates)
    plan = assemble(prob, sol.choice, cost_model, cost_model.hw.name, options.strategy,
                    options.memory_budget, stats, peak)
    plan = kernel_choice.finish(plan, prob, sol.choice, cost_model)
    if folded is None:      # a folded plan over the budget is planned again on the full graph
        _check_budget(plan, options.memory_budget, prob, least)
    return plan


def _within_budget(prob, sol, cost_model, options, allowed, clock):
    """The solver's memory constraints see resharded copies only through cuts added lazily
    (``planner.memory``): while the chosen plan's full estimate exceeds the budget, add a
    ``CopyCut`` at its peak and solve again (from the plan so far), ``COPY_CUT_ROUNDS`` times at
    most. Keeps the first solution that fits, else the plan of least memory if it fits, else the
    lowest estimated peak (``_check_budget`` then refuses it). Returns (the solution, its
    estimated peak, ``ilp.min_memory``'s answer if it was sought; Nones when no budget asked for
    one)."""
    budget = options.memory_budget
    if budget is None:
        return sol, None, None
    est = memory.estimate(prob, sol.choice)
    best, cuts = (est.peak, sol), []
    for _ in range(COPY_CUT_ROUNDS):
        if est.peak <= budget or clock.spent(SEARCH_BEFORE):
            break
        cuts.append(memory.cut_at(prob, est.peak_position))
        hint = sol.choice if isinstance(sol.choice, Mapping) else dict(enumerate(sol.choice))
        try:
            sol = ilp.solve(prob, cost_model, budget, options.time_limit_s, allowed, hint,
                            clock=clock, hint_name="FIRST SOLUTION", cuts=cuts)
        except PlanError:
            break
        est = memory.estimate(prob, sol.choice)
        best = min(best, (est.peak, sol), key=lambda b: b[0])
    if est.peak <= budget:
        return sol, est.peak, None
    # The plan of least memory: it is taken if it fits, and its budget is what the PlanError of
    # _check_budget suggests otherwise.
    least = ilp.min_memory(prob, cost_model, allowed, options.time_limit_s, clock.solver_wall_s())
    if least is not None and least[1] <= budget:
        kept = ilp.kept_choice(prob, least[0], "MIN MEMORY")
        return kept, memory.estimate(prob, kept.choice).peak, least
    return best[1], best[0], least


# Re-solves with copy cuts when a plan's resharded copies break the memory budget: each round
# adds the copies live at the new peak. The cases seen fit after one to four: the 3-layer MLP of
# test_memory_budget_below_replicated_adam... takes four from the descent's ops-first start (its
# first solution, as fast as the other start's, holds other copies), three from the other.
COPY_CUT_ROUNDS = 6


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
    raise PlanError(
        f"no plan fits a memory budget of {budget / 2**30:.3g} GiB ({int(budget)} bytes) per "
        f"device on mesh {dict(prob.mesh)}: the solver's best plan peaks at {int(peak)} bytes "
        f"by the full estimate (exact bytes and the copies its resharding makes, which the "
        f"solver counts only in part: {COPY_CUT_ROUNDS} rounds of copy cuts did not bring it "
        f"within); {smallest}. Raise memory_budget to at least that, use a larger mesh, or "
        f"shrink the batch.")


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
            for c in comms:
                seconds, moved = priced.collective(c.kind, c.nbytes, c.axes)
                tally.collectives.append(Collective(
                    where, c.kind, c.axes, c.nbytes, mult * seconds, mult, *source, moved))
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


def _top_level_reduces(g, colls) -> list[tuple[int, tuple[str, ...]]]:
    """(op id, axes) of the all-reduces run once per step outside loops: the op that issues one
    (``op17 ...``) or reads its result (``edge op12:arg1 ...``)."""
    top = {op.id for op in g.ops}
    out = []
    for c in colls:
        m = re.match(r"(?:edge )?op(\d+)", c.where)
        if c.kind == "all-reduce" and c.count == 1 and m and int(m.group(1)) in top:
            out.append((int(m.group(1)), tuple(c.axes)))
    return out


def assemble(prob: problem.Problem, choice, cm, hardware_name: str, strategy: str,
             memory_budget: float | None, stats: SolverStats, peak: float | None = None) -> Plan:
    """The ``Plan`` of ``choice``; ``peak``: its estimated peak memory when the caller has it."""
    g = prob.graph
    tally = _collectives(prob, choice, cm)
    colls = tally.collectives
    by_kind: dict[str, float] = {}
    for c in colls:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.time_s
    dispatch = float(getattr(cm.hw, "dispatch_s", 0.0))
    compute, comm, transition = tally.compute_s, tally.comm_s, tally.transition_s
    # XLA merges independent all-reduces over one group: their launches are paid once.
    refund = combine.launch_refund_s(g, _top_level_reduces(g, colls), cm.hw.collective_launch_s)
    comm, transition = comm - min(refund, comm), transition - min(max(refund - comm, 0.0),
                                                                  transition)
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
                in_tree=g.in_tree, out_tree=g.out_tree)
