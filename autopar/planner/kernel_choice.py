"""Kernel or XLA: the ILP decides, per site and layout, and the plan records what it chose.

The ILP's variables, constraints and objective terms of the kernel sites (``kernel_sites``) are
the kernels family's (``families/kernels.py``, with the math). Given the layouts, its optimum is
exactly "kernel where its time is below the ops' it replaces", which is how ``choose`` reads the
solution back; ``prepare`` finds the sites before the ILP, ``finish`` records the chosen kernels
(``attach``) and the matches left to XLA, with why, in the plan.

With ``kernels="always"`` ``choose`` takes a kernel at every site whose layouts fit one of its
options, faster or not: a mode for testing the kernels and forcing them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar.plan import Collective, KernelUse, Plan
from autopar.planner import problem
from autopar.planner.families import ns
from autopar.planner.kernel_sites import Option, Site


@dataclasses.dataclass(frozen=True)
class Chosen:
    site: Site
    option: Option
    saved_compute_s: float
    saved_comm_s: float


def _compatible(prob: problem.Problem, site: Site, choice: Sequence[int]) -> Option | None:
    def layout(v: int):
        g = prob.group_of_value[v]
        return prob.groups[g].shard[v][choice[g]]

    option = site.option_for(layout(site.anchor))
    if option is None or any(layout(v) != want for v, want in option.layouts[1:]):
        return None
    return option


def decide(prob: problem.Problem, site: Site, choice: Sequence[int], mode: str) -> Chosen | None:
    """The kernel site ``site`` runs under ``choice`` (``choose``), or None: XLA's ops."""
    option = _compatible(prob, site, choice)
    if option is None:
        return None
    comp, comm = site.saved_s(choice)
    if mode != "always" and ns(option.time_s) >= ns(comp + comm):
        return None
    return Chosen(site, option, comp, comm)


def choose(prob: problem.Problem, sites: Sequence[Site], choice: Sequence[int],
           mode: str) -> list[Chosen]:
    """The kernels the plan ``choice`` (group -> strategy) runs: every site whose layouts fit
    one of its options and (unless ``mode`` is "always") whose kernel is faster."""
    return [c for s in sites if (c := decide(prob, s, choice, mode)) is not None]


# ---- into the plan ----------------------------------------------------------------------------
def attach(plan: Plan, chosen: Sequence[Chosen], cm) -> Plan:
    """``plan`` with ``kernels`` recorded and its predicted cost and collectives updated: the
    replaced ops' compute and collectives out, each kernel's in."""
    if not chosen:
        return plan
    gone = {i for c in chosen for i in c.site.replaced}
    colls = [c for c in plan.collectives if not _of_ops(c, gone)]
    for c in chosen:
        colls += _kernel_collectives(c, cm)
    compute = plan.cost.compute_s + sum(c.option.compute_s - c.saved_compute_s for c in chosen)
    comm = plan.cost.comm_s + sum(c.option.comm_s - c.saved_comm_s for c in chosen)
    cost = dataclasses.replace(
        plan.cost, compute_s=compute, comm_s=comm,
        step_time_s=compute + comm + plan.cost.transition_s + plan.cost.dispatch_s,
        comm_by_kind=_by_kind(colls, lambda c: c.time_s),
        comm_bytes_by_kind=tuple(sorted(_by_kind(colls, lambda c: c.nbytes * c.count))))
    return dataclasses.replace(plan, kernels=tuple(_record(c) for c in chosen),
                               collectives=tuple(colls), cost=cost)


def _of_ops(c: Collective, ops: set[int]) -> bool:
    head = c.where.split(" ", 1)[0]
    return head.startswith("op") and head[2:].isdigit() and int(head[2:]) in ops


def _kernel_collectives(c: Chosen, cm) -> list[Collective]:
    fwd = c.site.fwd
    source = fwd.sources[0].split(" ")[0] if fwd.sources else ""
    where = f"kernel {c.site.kernel} @ op{fwd.op_ids[0]}"
    return [Collective(where, kind, axes, nbytes, cm.collective_time_s(kind, nbytes, axes), 1.0,
                       source, "") for kind, nbytes, axes in c.option.comms if axes]


def _by_kind(colls, measure) -> tuple[tuple[str, float], ...]:
    out: dict[str, float] = {}
    for c in colls:
        out[c.kind] = out.get(c.kind, 0.0) + measure(c)
    return tuple(sorted(out.items(), key=lambda kv: -kv[1]))


def _record(c: Chosen) -> KernelUse:
    site = c.site
    bwd = site.bwd.op_ids if site.bwd is not None else ()
    sources = tuple(dict.fromkeys(site.fwd.sources + (site.bwd.sources if site.bwd else ())))
    return KernelUse(site.kernel, site.fwd.op_ids, bwd, sources, c.option.split, c.option.specs,
                     c.option.time_s, c.saved_compute_s + c.saved_comm_s)


# ---- the planner's two hooks ------------------------------------------------------------------
def prepare(prob: problem.Problem, cm, mode: str, clock=None) -> problem.Problem:
    """``prob`` with its kernel sites (``mode`` "auto" or "always"; "never" finds none) for the
    ILP. None are sought when the time limit has already cut the problem's build."""
    from autopar.planner.budget import SEARCH_BEFORE
    from autopar.planner.kernel_sites import find_sites

    sites, rejected = [], []
    if mode != "never" and clock is not None and clock.spent(SEARCH_BEFORE):
        clock.note("time limit: no fused kernels considered")
    elif mode != "never":
        sites, rejected = find_sites(prob, cm)
    out = dataclasses.replace(prob, kernel_mode=mode, kernel_sites=sites,
                              kernel_rejected=rejected)
    out.memo = prob.memo      # the kernel sites feed none of it
    return out


def finish(plan: Plan, prob: problem.Problem, choice: Sequence[int], cm) -> Plan:
    """The assembled ``plan`` with the kernels the solution ``choice`` runs, and every match
    it leaves to XLA with the reason (``Plan.rejected_kernels``)."""
    chosen = choose(prob, prob.kernel_sites, choice, prob.kernel_mode)
    taken = {id(c.site) for c in chosen}
    left = [_why_not(prob, s, choice) for s in prob.kernel_sites if id(s) not in taken]
    skipped = sorted(list(prob.kernel_rejected) + left, key=lambda r: r.op_ids[0])
    return dataclasses.replace(attach(plan, chosen, cm), rejected_kernels=tuple(skipped))


def _why_not(prob: problem.Problem, site: Site, choice: Sequence[int]):
    """Why ``choose`` left a sound site to XLA under the plan ``choice``."""
    from autopar.planner.kernel_sites import rejected
    from autopar.sharding import to_spec

    option = _compatible(prob, site, choice)
    if option is None:
        g = prob.group_of_value[site.anchor]
        spec = to_spec(prob.groups[g].shard[site.anchor][choice[g]])
        return rejected(prob.graph, site.kernel, site.fwd,
                        f"the plan's layouts fit none of the kernel's {len(site.options)} splits "
                        f"(its {site.fwd.pattern} input %{site.anchor} is laid out {spec})")
    comp, comm = site.saved_s(choice)
    return rejected(prob.graph, site.kernel, site.fwd,
                    f"XLA's ops are predicted faster: {(comp + comm) * 1e3:.4f} ms against the "
                    f"kernel's {option.time_s * 1e3:.4f} ms")
