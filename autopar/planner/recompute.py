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

Partial, on purpose for now: the policy is one per step (every loop pair the same), chosen
among four, by planning each rewritten step rather than by variables of one ILP; steps that fit
are not offered recomputation even where it would let a cheaper layout fit (Mist's trade);
unrolled layers are not rewritten (see ``ir.recompute``); hand-written strategies (whose
filters are bound to the traced graph's ops) are not rewritten.
"""
from __future__ import annotations

import dataclasses

from autopar.errors import BudgetError, PlanError
from autopar.plan import Plan, Recompute
from ir import recompute as rewrite
from ir.from_jaxpr import graph_of

# Tried in this order; every one that fits is planned and the fastest kept.
TRIED = ("selective", "save_dots", "save_weight_dots", "full")


def has_sites(graph) -> bool:
    """Whether ``graph``'s step has loops whose saved values could be recomputed."""
    return rewrite.has_sites(graph.jaxpr)


def plan_recomputed(graph, mesh, cost_model, options, error: BudgetError, plan_layouts) -> Plan:
    """The fastest plan of ``graph`` with its loops' saved values recomputed that fits the
    budget ``error`` says the plain step breaks; ``plan_layouts(graph, mesh, cost_model,
    options, trace_s=...)`` plans one graph. Raises ``error``, extended, if none fits."""
    flat = rewrite.flat(graph.jaxpr)
    sites = rewrite.find_sites(flat)
    if not sites:
        raise error
    found, last = [], error
    for policy in TRIED:
        if not any(s.recomputed(policy) for s in sites):
            continue              # e.g. no attention core to recompute selectively
        # each rewritten step plans in the whole time limit, whatever the plain step's failure
        # spent: a step that breaks its budget may take up to 1 + len(TRIED) time limits (a
        # shared limit left the later policies a greedy plan)
        last_try = policy == TRIED[-1]
        try:
            # the step inlined once (``flat`` retraces a jitted step), rewritten per policy
            g = graph_of(rewrite.apply(flat, dict.fromkeys(range(len(sites)), policy)),
                                 graph)
            plan = plan_layouts(g, mesh, cost_model, options.replace(
                seed_plans=(), explain_budget=last_try and not found and options.explain_budget),
                                trace_s=0.0)
        except BudgetError as e:
            last = e
            continue
        except PlanError as e:        # e.g. the time limit ran out: keep what fits already
            if not found:
                last = e
            continue
        found.append((plan.cost.step_time_s, TRIED.index(policy), policy, plan))
    if not found:
        where = "; ".join(s.where for s in sites)
        raise BudgetError(f"{error} Recomputing the saved values of the step's "
                          f"{len(sites)} scanned loop(s) ({where}) did not bring it within "
                          f"either: {last}", getattr(last, "least_bytes", None)) from None
    _, _, policy, plan = min(found)
    eqns = flat.jaxpr.eqns
    records = []
    for k, s in enumerate(sites):
        c = rewrite.choose(eqns[s.fwd], eqns[s.bwd], s, policy)
        records.append(Recompute(k, policy, s.where, float(c.dropped_bytes),
                                 float(c.stacked_bytes), c.replayed_flops, error.least_bytes))
    return dataclasses.replace(plan, recompute=tuple(records),
                               graph_fingerprint=graph.fingerprint())

