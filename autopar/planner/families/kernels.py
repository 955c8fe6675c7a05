"""The kernels family: a fused kernel or XLA's ops at each kernel site (``kernel_sites``).

Each site ``s`` adds (notation of ``layouts.py``), for ``kernels="auto"``:

  y[s, o] ∈ {0,1}  the kernel replaces the site's ops, in option o (a layout of its interface
                   values); Σ_o y[s, o] <= 1 (``kernels:one:s``), and k[s] = Σ_o y[s, o] says
                   "kernel".
  Layouts          y[s, o] <= Σ_{i: layout_i(v) = o's layout of v} x[g(v), i]
                   for every interface value v                        (``kernels:layout:s:o``)
  XLA time saved   S[s] <= Σ_g Σ_i X[g, i] x[g, i],  S[s] <= X_max k[s]  (``kernels:saved:s``)
  Objective        += Σ_o T_o y[s, o] - S[s]

``T_o`` is the kernel's time in option o (compute and collectives), ``X[g, i]`` the replaced
ops' time (compute and collectives) in group g's strategy i. Given the layouts the optimum is
exactly "kernel where its time is below the ops' it replaces", which is how
``kernel_choice.choose`` reads the solution back (``read_back``). Resharding edges into and
inside the replaced ops stay in the objective (the kernel reads the values in the same layouts,
so those edges are mostly free), and the memory terms ignore what the kernel saves (the
probabilities of attention, the logits): the planner's peak memory stays an upper bound.

With ``kernels="always"`` the kernels' times are 0 and leaving a site to XLA costs
``ALWAYS_PENALTY_NS`` (one second, more than any resharding a layout change costs; ``xla[s]``,
``kernels:always:s``), so the ILP takes layouts a kernel can take wherever there are some.
"""
from __future__ import annotations

from collections.abc import Sequence

from autopar.planner import kernel_choice
from autopar.planner.families import Family, Model, ns
from autopar.planner.kernel_sites import Site

ALWAYS_PENALTY_NS = 10**9


class Kernels(Family):
    """The kernels family (module docstring) of ``sites`` in ``mode`` "auto" or "always"."""

    name = "kernels"

    def __init__(self, sites: Sequence[Site], mode: str):
        self.sites, self.mode = sites, mode
        self.vars: list = []    # per site: (site, option vars y, saved S, xla var or None)

    def variables(self, mdl: Model) -> None:
        for n, site in enumerate(self.sites):
            ys = [mdl.m.NewBoolVar(f"kernel{n}_{j}") for j in range(len(site.options))]
            xla = mdl.m.NewBoolVar(f"kernel{n}_xla") if self.mode == "always" else None
            saved = mdl.m.NewIntVar(0, _most(site), f"kernel_saved{n}")
            self.vars.append((site, ys, saved, xla))

    def constraints(self, mdl: Model) -> None:
        m = mdl.m
        for n, (site, ys, saved, xla) in enumerate(self.vars):
            mdl.named(m.AddAtMostOne(ys), self, "one", n)
            for j, (o, y) in enumerate(zip(site.options, ys)):
                for v, layout in o.layouts:
                    ok = _picks(mdl, mdl.p.group_of_value[v], v, layout)
                    mdl.named(m.Add(y <= sum(ok)), self, "layout", n, j)
            if xla is not None:
                mdl.named(m.Add(xla + sum(ys) == 1), self, "always", n)
            terms = [(ns(cs + ms), x) for g, (comp, comm) in site.savings.items()
                     for cs, ms, x in zip(comp, comm, mdl.xs(g))]
            mdl.named(m.Add(saved <= sum(t * x for t, x in terms if t)), self, "saved", n)
            mdl.named(m.Add(saved <= _most(site) * sum(ys)), self, "saved", n)

    def objective(self, mdl: Model) -> None:
        for site, ys, saved, xla in self.vars:
            times = [ns(o.time_s) if self.mode != "always" else 0 for o in site.options]
            mdl.obj += [(t, y) for t, y in zip(times, ys) if t]
            if xla is not None:
                mdl.obj.append((ALWAYS_PENALTY_NS, xla))
            mdl.obj.append((-1, saved))

    def start(self, mdl: Model, pick: dict[int, int]) -> None:
        """Each site takes its kernel exactly where ``read_back`` would under ``pick``."""
        choice = [pick[mdl.root[g.id]] for g in mdl.p.groups]
        for site, ys, saved, xla in self.vars:
            got = kernel_choice.decide(mdl.p, site, choice, self.mode)
            for o, y in zip(site.options, ys):
                mdl.m.AddHint(y, got is not None and got.option == o)
            if xla is not None:
                mdl.m.AddHint(xla, got is None)
            s = sum(ns(comp[choice[g]] + comm[choice[g]])
                    for g, (comp, comm) in site.savings.items())
            mdl.m.AddHint(saved, min(s, _most(site)) if got is not None else 0)

    def read_back(self, mdl: Model, solver) -> list:
        """The kernels the solution's layouts run (``kernel_choice.choose``)."""
        choice = [next(i for i, x in enumerate(mdl.xs(g.id)) if solver.Value(x))
                  for g in mdl.p.groups]
        return kernel_choice.choose(mdl.p, self.sites, choice, self.mode)


def _picks(mdl: Model, g: int, v: int, layout) -> list:
    """The variables of group ``g``'s strategies that lay ``v`` out as ``layout``."""
    return [x for x, s in zip(mdl.xs(g), mdl.p.groups[g].shard[v]) if s == layout]


def _most(site: Site) -> int:
    """The most the replaced ops can cost, in the ILP's nanoseconds."""
    return sum(max((ns(a + b) for a, b in zip(comp, comm)), default=0)
               for comp, comm in site.savings.values())
