"""Kernel or XLA: the ILP decides, per site and layout, and the plan records what it chose.

Each site ``s`` (``kernel_sites``) adds to the sharding ILP (``ilp.py``, notation there), for
``kernels="auto"``:

  y[s, o] ∈ {0,1}  the kernel replaces the site's ops, in option o (a layout of its interface
                   values); Σ_o y[s, o] <= 1, and k[s] = Σ_o y[s, o] says "kernel".
  Layouts          y[s, o] <= Σ_{i: layout_i(v) = o's layout of v} x[g(v), i]
                   for every interface value v                          (``kernel-layout:s:o``)
  XLA time saved   S[s] <= Σ_g Σ_i X[g, i] x[g, i],  S[s] <= X_max k[s]  (``kernel-saved:s``)
  Objective        += Σ_o T_o y[s, o] - S[s]

``T_o`` is the kernel's time in option o (compute and collectives), ``X[g, i]`` the replaced
ops' time (compute and collectives) in group g's strategy i. Given the layouts the optimum is
exactly "kernel where its time is below the ops' it replaces", which is how ``choose`` reads the
solution back. Resharding edges into and inside the replaced ops stay in the objective (the
kernel reads the values in the same layouts, so those edges are mostly free), and the memory
constraints ignore what the kernel saves (the probabilities of attention, the logits): the
planner's peak memory stays an upper bound.

With ``kernels="always"`` the kernels' times are 0 and leaving a site to XLA costs
``ALWAYS_PENALTY_NS`` (one second, more than any resharding a layout change costs), so the ILP
takes layouts a kernel can take wherever there are some, and ``choose`` takes a kernel at every
site whose layouts fit one of its options, faster or not: a mode for testing the kernels and
forcing them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar.plan import Collective, KernelUse, Plan
from autopar.planner import problem
from autopar.planner.kernel_sites import Option, Site

ALWAYS_PENALTY_NS = 10**9


@dataclasses.dataclass(frozen=True)
class Chosen:
    site: Site
    option: Option
    saved_compute_s: float
    saved_comm_s: float


def _ns(seconds: float) -> int:
    from autopar.planner.ilp import _ns as ilp_ns

    return ilp_ns(seconds)


def _picks(mdl, g: int, v: int, layout) -> list:
    """The variables of group ``g``'s strategies that lay ``v`` out as ``layout``."""
    return [x for x, s in zip(mdl.xs(g), mdl.p.groups[g].shard[v]) if s == layout]


def add_to_model(mdl, sites: Sequence[Site], mode: str) -> None:
    """The variables, constraints and objective terms of the module docstring, on ``mdl``
    (``ilp._Model``); for ``mode`` "always" the kernels' times are 0 and each site left to XLA
    is penalised. Their handles go to
    ``mdl.kernel_vars`` for ``hint``."""
    mdl.kernel_vars = []
    p, m = mdl.p, mdl.m
    for n, site in enumerate(sites):
        ys = [m.NewBoolVar(f"kernel{n}_{j}") for j in range(len(site.options))]
        m.AddAtMostOne(ys)
        for j, (o, y) in enumerate(zip(site.options, ys)):
            for v, layout in o.layouts:
                ok = _picks(mdl, p.group_of_value[v], v, layout)
                m.Add(y <= sum(ok)).WithName(f"kernel-layout:{n}:{j}")
        times = [_ns(o.time_s) if mode != "always" else 0 for o in site.options]
        mdl.obj += [(t, y) for t, y in zip(times, ys) if t]
        xla = None
        if mode == "always":          # a penalty for leaving the site to XLA
            xla = m.NewBoolVar(f"kernel{n}_xla")
            m.Add(xla + sum(ys) == 1).WithName(f"kernel-always:{n}")
            mdl.obj.append((ALWAYS_PENALTY_NS, xla))
        terms = [(_ns(cs + ms), x) for g, (comp, comm) in site.savings.items()
                 for cs, ms, x in zip(comp, comm, mdl.xs(g))]
        most = _most(site)
        s = m.NewIntVar(0, most, f"kernel_saved{n}")
        m.Add(s <= sum(t * x for t, x in terms if t)).WithName(f"kernel-saved:{n}")
        m.Add(s <= most * sum(ys)).WithName(f"kernel-saved:{n}")
        mdl.obj.append((-1, s))
        mdl.kernel_vars.append((site, ys, s, xla))


def _most(site: Site) -> int:
    """The most the replaced ops can cost, in the ILP's nanoseconds."""
    return sum(max((_ns(a + b) for a, b in zip(comp, comm)), default=0)
               for comp, comm in site.savings.values())


def hint(mdl, pick: dict[int, int], mode: str) -> None:
    """Hints for the kernel variables that complete ``pick`` (root group -> strategy): each
    site takes its kernel exactly where ``choose`` would."""
    choice = [pick[mdl.root[g.id]] for g in mdl.p.groups]
    for site, ys, s, xla in getattr(mdl, "kernel_vars", ()):
        got = _decide(mdl.p, site, choice, mode)
        for o, y in zip(site.options, ys):
            mdl.m.AddHint(y, got is not None and got.option == o)
        if xla is not None:
            mdl.m.AddHint(xla, got is None)
        saved = sum(_ns(comp[choice[g]] + comm[choice[g]])
                    for g, (comp, comm) in site.savings.items())
        mdl.m.AddHint(s, min(saved, _most(site)) if got is not None else 0)


def _compatible(prob: problem.Problem, site: Site, choice: Sequence[int]) -> Option | None:
    def layout(v: int):
        g = prob.group_of_value[v]
        return prob.groups[g].shard[v][choice[g]]

    option = site.option_for(layout(site.anchor))
    if option is None or any(layout(v) != want for v, want in option.layouts[1:]):
        return None
    return option


def _decide(prob: problem.Problem, site: Site, choice: Sequence[int], mode: str) -> Chosen | None:
    option = _compatible(prob, site, choice)
    if option is None:
        return None
    comp, comm = site.saved_s(choice)
    if mode != "always" and _ns(option.time_s) >= _ns(comp + comm):
        return None
    return Chosen(site, option, comp, comm)


def choose(prob: problem.Problem, sites: Sequence[Site], choice: Sequence[int],
           mode: str) -> list[Chosen]:
    """The kernels the plan ``choice`` (group -> strategy) runs: every site whose layouts fit
    one of its options and (unless ``mode`` is "always") whose kernel is faster."""
    return [c for s in sites if (c := _decide(prob, s, choice, mode)) is not None]


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
