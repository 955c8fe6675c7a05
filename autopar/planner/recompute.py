"""Recomputation as a planner decision: what the backward pass recomputes instead of keeping.

When no layout of the step fits the memory budget, the planner plans the step again with its
scanned layers' saved values recomputed (``ir.recompute``): under ``"selective"`` (only the
attention core recomputed, Megatron-LM's selective recomputation), ``"save_dots"`` (matmul
outputs kept, the rest recomputed), ``"save_weight_dots"`` (only the weight matmuls' outputs
kept: ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) and ``"full"`` (only each
layer's input kept). Each
rewritten step is planned whole (layouts, collectives, the replayed FLOPs and the memory the
loops no longer hold, all priced by the same cost model), and the fastest plan that fits is
returned, with the decision in ``Plan.recompute`` for codegen to apply. A step that fits
without recomputation is planned as before: recomputation only ever trades time for memory
the budget lacks.

The search is bounded in time (``planner.budget``): the policies are planned in the order of
``TRIED`` (least replay first: the likeliest winner where it fits; in the rows of
``benchmarks/recompute.py`` the bounds rise in this order too), each rewritten step, once a
plan is in hand, first
bounded (``planner.prune``) and skipped unplanned where no plan of it could beat the one in
hand; once the search has spent its limit with a plan in hand, the policies left are not tried
(a heuristic cut, written in the plan's notes, as every skip is).

Partial, on purpose for now: the policy is one per step (every loop pair the same), chosen
among four, by planning each rewritten step rather than by variables of one ILP; steps that fit
are not offered recomputation even where it would let a cheaper layout fit (Mist's trade);
unrolled layers are not rewritten (see ``ir.recompute``); hand-written strategies (whose
filters are bound to the traced graph's ops) are not rewritten.
"""
from __future__ import annotations

import dataclasses
import time

from autopar.errors import BudgetError, PlanError
from autopar.plan import Plan, Recompute
from autopar.planner import problem, prune
from autopar.planner.budget import START_BEFORE, Clock
from ir import recompute as rewrite
from ir import recompute_unrolled as unrolled
from ir.from_jaxpr import graph_of

# Tried in this order; every one not skipped (see the module doc) is planned and the
# fastest that fits kept.
TRIED = ("selective", "save_dots", "save_weight_dots", "full")


def has_sites(graph, cost_model=None) -> bool:
    """Whether ``graph``'s step has loops whose saved values could be recomputed, or, on
    hardware where that is offered (``unrolled_offered``), repeated unrolled layers."""
    return rewrite.has_sites(graph.jaxpr) or (
        cost_model is not None and unrolled_offered(cost_model)
        and rewrite.has_unrolled_layers(graph))


def unrolled_offered(cost_model) -> bool:
    """Whether unrolled layers' recomputation is offered on ``cost_model``'s hardware: not on
    XLA:CPU, whose default scheduler (``BFSMemoryScheduler``: an instruction runs once its
    operands are ready) runs a recomputation as soon as the forward values it reads exist,
    so the memory it would save is not saved (measured: ``jax.checkpoint`` around each of 6
    unrolled layers lowers XLA:CPU's temporaries by 3%; 31% with the memory-minimizing
    scheduler). XLA:GPU's and XLA:TPU's schedulers place it by memory pressure, as
    ``jax.checkpoint`` relies on."""
    return cost_model.hw.platform not in ("cpu", "")


def plan_recomputed(graph, mesh, cost_model, options, error: BudgetError, plan_layouts, *,
                    clock: Clock | None = None, beat_s: float | None = None,
                    bounded: bool = True) -> Plan:
    """The fastest plan of ``graph`` with its loops' saved values recomputed (or, without loop
    pairs and off CPU, its unrolled layers': ``ir.recompute_unrolled``) that fits the budget
    ``error`` says the plain step breaks; ``plan_layouts(graph, mesh, cost_model, options,
    trace_s=...)`` plans one graph. ``clock``: the time limit the search shares (by default
    one that starts now); ``beat_s``: a policy whose every plan is predicted at least this slow
    is not planned (Mist's trade: the plain plan's step); ``bounded=False``: no policy is
    skipped by its bound (``plan_layouts`` may do more than plan the rewritten step, e.g.
    offload its state, which the bound does not see). Raises ``error``, extended, if none
    fits."""
    clock = clock or Clock(time.perf_counter(), options.time_limit_s, options.deterministic)
    flat = rewrite.flat(graph.jaxpr)
    sites = rewrite.find_sites(flat)
    if sites:
        def rewritten(policy):
            if not any(s.recomputed(policy) for s in sites):
                return None       # e.g. no attention core to recompute selectively
            # the step inlined once (``flat`` retraces a jitted step), rewritten per policy
            return rewrite.apply(flat, dict.fromkeys(range(len(sites)), policy))

        what = f"{len(sites)} scanned loop(s) ({'; '.join(s.where for s in sites)})"
    else:
        # the inlined step offload's candidates read too: traced once per graph
        found_site = (rewrite.unrolled_site(graph, problem.facts(graph).inlined)
                      if unrolled_offered(cost_model) else None)
        if found_site is None:
            raise error
        closed, site = found_site

        def rewritten(policy):
            if not any(unrolled.layer_plan(closed.jaxpr.eqns, lay, policy).dropped
                       for lay in site.layers):
                return None
            return unrolled.apply(closed, site, policy)

        what = f"{site.length} unrolled layers ({site.where})"
    policy, plan = _fastest(graph, mesh, cost_model, options, error, plan_layouts, rewritten,
                            what, clock, beat_s if bounded else None, bounded)
    if sites:
        eqns = flat.jaxpr.eqns
        records = []
        for k, s in enumerate(sites):
            c = rewrite.choose(eqns[s.fwd], eqns[s.bwd], s, policy)
            records.append(Recompute(k, policy, s.where, float(c.dropped_bytes),
                                     float(c.stacked_bytes), c.replayed_flops,
                                     error.least_bytes))
    else:
        records = [Recompute(0, policy, f"{site.length} unrolled layers {site.where}",
                             float(unrolled.dropped_bytes(closed, site, policy)),
                             float(unrolled.kept_bytes(closed, site, policy)),
                             unrolled.replayed_flops(closed, site, policy), error.least_bytes)]
    return dataclasses.replace(plan, recompute=tuple(records),
                               graph_fingerprint=graph.fingerprint())


def _fastest(graph, mesh, cost_model, options, error: BudgetError, plan_layouts, rewritten,
             what: str, clock: Clock, beat_s: float | None, bounded: bool
             ) -> tuple[str, Plan]:
    """``(policy, plan)``: the fastest plan that fits among the steps ``rewritten(policy)``
    (a jaxpr, or None where the policy changes nothing) for the policies of ``TRIED``, each
    skipped unplanned where its bound (``planner.prune``) proves it cannot beat the best plan
    in hand (or ``beat_s``, the step a plan must beat to be of use). The plans share
    ``clock``'s time limit once one is in hand (``planner.budget``); the plan returned carries
    in its notes which policies were skipped and why."""
    found, notes, last = [], [], error
    for k, policy in enumerate(TRIED):
        in_hand = bool(found) or beat_s is not None
        if in_hand and clock.spent(START_BEFORE):
            # heuristic, and said so: no bound shows these could not win
            notes.append(f"recompute: {', '.join(TRIED[k:])} not tried: the search had spent "
                         f"its time limit ({clock.elapsed_s():.1f} s of "
                         f"time_limit_s={clock.limit_s:g}) with a plan in hand")
            break
        best_s = min([f[0] for f in found] + ([beat_s] if beat_s is not None else []),
                     default=None)
        last_try = policy == TRIED[-1]
        try:      # the rewrite, as the plan, may fail: as before, that policy is passed over
            closed = rewritten(policy)
            if closed is None:
                continue
            new = graph_of(closed, graph)
            skip, why = (_bounded_out(new, mesh, cost_model, options, policy, best_s)
                         if bounded else (False, ""))
            if skip:
                notes.append(why)
                continue
            plan = plan_layouts(new, mesh, cost_model, options.replace(
                seed_plans=(), explain_budget=last_try and not found and options.explain_budget),
                                trace_s=_spent_s(clock, in_hand))
        except BudgetError as e:
            last = e
            continue
        except PlanError as e:        # e.g. the time limit ran out: keep what fits already
            if not found:
                last = e
            continue
        found.append((plan.cost.step_time_s, k, policy, plan))
    if not found:
        raise BudgetError(f"{error} Recomputing the saved values of the step's {what} did not "
                          f"bring it within either: {last}", getattr(last, "least_bytes", None)
                          ) from None
    _, _, policy, plan = min(found)
    return policy, dataclasses.replace(plan, notes=tuple(plan.notes) + tuple(notes))


def _spent_s(clock: Clock, in_hand: bool) -> float:
    """The seconds a rewritten step's plan starts with spent: the search's, once a plan is in
    hand; none before (each step planned before one fits has a whole time limit of its own, as
    the shared one left a tight step's first fitting policy unfitted: transformers' Llama-7B at
    128 sequences on a loaded machine then fitted only ``save_dots``, planned greedily, 3%
    slower than ``selective``)."""
    return clock.elapsed_s() if in_hand else 0.0


def _bounded_out(new, mesh, cost_model, options, policy: str,
                 best_s: float | None) -> tuple[bool, str]:
    """(whether the rewritten step ``new`` is proved unable to beat ``best_s``, the note that
    says so): ``planner.prune``'s bound."""
    b = prune.cannot_beat(new, mesh, cost_model, options, best_s)
    if b is None:
        return False, ""
    return True, (f"recompute: {policy} not planned: every plan of it is predicted at "
                  f"{b.step_s * 1e3:.1f} ms or more, no faster than the {best_s * 1e3:.1f} ms "
                  f"in hand")
