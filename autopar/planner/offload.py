"""Host offload as a planner decision: which of the step's carried state lives in host memory.

When no layout of the step fits the memory budget (and the hardware profile has a host link,
``Hardware.host_bytes_per_s``), the planner plans the step again with groups of its update-only
state (``ir.offload``: Adam's moments, one parameter's at a time) held in host memory and
streamed through the device for the update. Each offloaded step is planned whole: its layouts,
the moves over the host link (priced as ``device_put`` ops, not overlapped with compute) and the
device memory the groups no longer hold, all by the same cost model. Two sets are tried: the
fewest groups, largest first, whose bytes spread over the mesh cover what the step lacks, and
every group; the faster that fits wins. ``Plan.offload`` records the decision for codegen, and
the plan's notes say which set was not planned, or planned and not kept, and why (as
``planner.recompute``'s do for its policies).

Partial, on purpose for now: the set is chosen among two by planning each, not by variables of
one ILP; parameters and saved activations stay on the device; a step that fits is not offered
offload even where it would let a faster layout fit.
"""
from __future__ import annotations

import dataclasses
import time

from autopar.errors import BudgetError, PlanError
from autopar.plan import Offload, Plan
from autopar.planner import prune
from autopar.planner.budget import Clock
from autopar.planner.problem import facts
from autopar.sharding import shard_factor
from ir import offload as rewrite
from ir.from_jaxpr import graph_of


def offerable(graph, cost_model) -> bool:
    """Whether ``graph``'s step has state that may live in host memory on this hardware."""
    return cost_model.hw.host_bytes_per_s > 0 and bool(groups_of(graph))


def groups_of(graph) -> tuple[rewrite.Group, ...]:
    """``ir.offload.find_groups`` of ``graph``'s step, every jit call inlined (computed once
    per graph: ``problem.GraphFacts``)."""
    return facts(graph).offload_groups[1]


def rewrite_graph(graph, inputs):
    """``graph`` traced again with the groups holding argument positions ``inputs`` offloaded
    (``ir.offload.apply``), its host values marked."""
    inlined, groups = facts(graph).offload_groups
    chosen = [g for g in groups if set(g.inputs) & set(inputs)]
    missing = set(inputs) - {k for g in chosen for k in g.inputs}
    if missing:
        raise PlanError(f"the plan offloads argument(s) {sorted(missing)} "
                        f"({', '.join(graph.input_paths[k] for k in sorted(missing))}), which "
                        f"this step does not update apart from its computation; plan again for "
                        f"this step")
    g = graph_of(rewrite.apply(inlined, chosen), graph)
    return dataclasses.replace(g, host=rewrite.host_values(g, sorted(inputs)))


def plan_offloaded(graph, mesh, cost_model, options, error: BudgetError, plan_layouts, *,
                   clock: Clock | None = None, beat_s: float | None = None,
                   bounded: bool = True) -> Plan:
    """The fastest plan of ``graph`` with some of its state in host memory that fits the budget
    ``error`` says the step breaks; ``plan_layouts(graph, mesh, cost_model, options,
    trace_s=...)`` plans one graph. ``clock``: the time limit the memory decisions' search
    shares (by default one that starts now); ``bounded``: a set whose offloaded step's bound
    (``planner.prune``) shows it has no plan faster than ``beat_s`` or a set's plan in hand is
    not planned. The plan returned carries in its notes each set skipped (by that bound, or
    because it fits no plan, failed to plan or needs more host memory than the hardware has).
    Raises ``error``, extended, if none fits."""
    clock = clock or Clock(time.perf_counter(), options.time_limit_s, options.deterministic)
    groups = groups_of(graph)
    if not groups:
        raise error
    excess = (error.least_bytes - options.memory_budget) if error.least_bytes else None
    found, last, notes = [], error, []
    for chosen in candidate_sets(groups, excess, mesh):
        inputs = sorted(k for g in chosen for k in g.inputs)
        what = _which(chosen, groups)
        try:
            g = rewrite_graph(graph, inputs)
            if cost_model.hw.platform == "cpu" and not any(graph.donated[k] for k in inputs):
                # planned in the order XLA:CPU runs it (``ir.offload.updates_when_ready``). Not
                # where the state is donated: there XLA:CPU also copies each donated parameter
                # the early update overwrites before its last reader, from the top of the step
                # (23 of 27 in the small GPT's 1x8 plan), which the memory model does not count;
                # without them the early order under-predicts by 35-40%, the traced one by 12%
                g = rewrite.updates_when_ready(g)
            best_s = min([f[0] for f in found] + ([beat_s] if beat_s is not None else []),
                         default=None)
            b = prune.cannot_beat(g, mesh, cost_model, options, best_s) if bounded else None
            if b is not None:                          # proved unable to beat the plan in hand
                notes.append(f"offload: {what} not planned: every plan of it is predicted at "
                             f"{b.step_s * 1e3:.1f} ms or more, no faster than the "
                             f"{best_s * 1e3:.1f} ms in hand")
                continue
            plan = plan_layouts(g, mesh, cost_model, options.replace(
                seed_plans=(), explain_budget=False),
                trace_s=clock.elapsed_s() if found or beat_s is not None else 0.0)
        except BudgetError as e:
            last = e
            notes.append(f"offload: {what}: no plan of it fits the memory budget")
            continue
        except PlanError as e:
            if not found:
                last = e
            notes.append(f"offload: {what}: not planned ({_first(e)})")
            continue
        host = _host_bytes(graph, plan, chosen, mesh)
        held = sum(h for _, h in host)
        limit = cost_model.hw.host_memory_bytes
        if limit and held > limit:
            last = BudgetError(f"offloading {len(inputs)} arguments needs "
                               f"{held / 2**30:.2f} GiB of host memory per device; the "
                               f"hardware profile allows {limit / 2**30:.2f} GiB", None)
            notes.append(f"offload: {what}: refused: its plan holds {held / 2**30:.3g} GiB of "
                         f"host memory per device, more than the hardware profile's "
                         f"{limit / 2**30:.3g} GiB")
            continue
        found.append((plan.cost.step_time_s, len(inputs), chosen, host, plan))
    if not found:
        raise BudgetError(f"{error} Holding the step's update-only state ({len(groups)} "
                          f"group(s), {sum(g.nbytes for g in groups) / 2**30:.2f} GiB in all) "
                          f"in host memory did not bring it within either: {last}",
                          getattr(last, "least_bytes", None)) from None
    _, _, chosen, host, plan = min(found, key=lambda f: f[:2])
    records = tuple(
        Offload(g.inputs, g.outputs, tuple(graph.input_paths[k] for k in g.inputs), held,
                2 * cost_model.hw.host_transfer_s(moved), error.least_bytes)
        for g, (moved, held) in zip(chosen, host))
    return dataclasses.replace(plan, offload=records, graph_fingerprint=graph.fingerprint(),
                               notes=tuple(plan.notes) + tuple(notes))


def candidate_sets(groups, excess: float | None, mesh) -> list[list]:
    """The sets of ``groups`` tried, in order: the fewest, largest first, whose bytes spread
    over the mesh cover ``excess`` (the bytes per device the step lacks; None: unknown), then
    every group."""
    n_dev = 1
    for size in dict(mesh).values():
        n_dev *= size
    sets = []
    if excess is not None and excess > 0:
        some, covered = [], 0.0
        for g in sorted(groups, key=lambda g: -g.nbytes):
            some.append(g)
            covered += g.nbytes / n_dev
            if covered >= excess:
                break
        if len(some) < len(groups):
            sets.append(some)
    return sets + [list(groups)]


def _which(chosen, groups) -> str:
    """A candidate set in a note: how many of the step's groups, and their bytes."""
    size = f"{sum(g.nbytes for g in chosen) / 2**20:.3g} MiB"
    if len(chosen) == len(groups):
        return f"all {len(groups)} groups ({size})"
    return f"the {len(chosen)} largest of {len(groups)} groups ({size})"


def _first(e: Exception) -> str:
    """The first sentence of an error, for a note."""
    text = str(e)
    return text[: text.find(". ") + 1] if ". " in text else text


def _host_bytes(graph, plan: Plan, chosen, mesh) -> list[tuple[float, float]]:
    """Per group, per device under ``plan``'s input layouts: (the bytes its arguments hold in
    host memory, which each step moves to the device and back; what it holds there during the
    step: its arguments, and its results beside them where the arguments are not donated, the
    results taking donated arguments' buffers; measured: XLA's host bytes are twice the
    arguments' without donation)."""
    sizes = dict(mesh)
    out = []
    for g in chosen:
        args = [graph.values[graph.inputs[k]].nbytes / shard_factor(plan.input_shardings[k], sizes)
                for k in g.inputs]
        out.append((sum(args), sum(b * (1 if graph.donated[k] else 2)
                                   for b, k in zip(args, g.inputs))))
    return out
