"""The layouts family: which strategy each decision group runs, and what its layouts cost.

Variables (notation of ``problem.py``)
  x[g, i] ∈ {0,1}   group g runs its strategy i; Σ_i x[g, i] = 1           (``layouts:pick:g``).
                    Tied groups (repeated layers) share the variables of their representative.
  y[e, o, r] ∈ {0,1} edge e moves its value from distinct source layout o to needed layout r.
                    Σ_r y[e,o,r] = Σ_{i: layout_i = o} x[src, i]        (``layouts:flow-out:e``)
                    Σ_o y[e,o,r] = Σ_{j: need_j = r} x[dst, j]          (``layouts:flow-in:e``)
                    (an edge with one source or one needed layout needs no y: its cost is linear)
  c[e] ≥ 0          instead of y, for an edge with over FLOW_PAIRS_MAX layout pairs (big-M):
                    c[e] ≥ Σ_i cost(layout_i, r)·x[src,i] - M_r·(1 - Σ_{j: need_j = r} x[dst,j])
                                                                        (``layouts:edge:e``)
  u[k, o, r]        a value read by several groups moves once per layout (``layouts:share:k``)
  x[g, i] = 0       for a strategy ``allowed`` leaves out (a pinned input: ``layouts:fixed:g:i``)

Objective  Σ_g Σ_i (compute_s + comm_s)[g,i]·x[g,i]
           + Σ_e Σ_{o,r} mult_e·reshard_s(o→r)·y[e,o,r] + Σ_e c[e] + the combiner's launches

Memory     at a check point p: Σ_{v always live or live at p} bytes_v(i)·x[g(v), i]; at a copy
           cut, plus each resharded copy the plan may hold there (``layouts:copy:k``).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import numpy as np

from autopar.planner.budget import BUDGET_FACTOR
from autopar.planner.families import KIB, Family, Model, OutOfTime, Point, ns
from autopar.planner.problem import value_bytes

# Edges with more (source layout, needed layout) pairs than this use the big-M form.
FLOW_PAIRS_MAX = 400


class Layouts(Family):
    """The layouts family (module docstring). ``allowed``: group -> the strategies it may run;
    ``launches``: ``combine.launch_terms`` of the combiner's launches, each ``launch_s``;
    ``clock``: raises ``OutOfTime`` while the edges are built once its budget is spent;
    ``priced``: False for a model of memory alone (``ilp.min_memory``): no costs, no edges."""

    name = "layouts"

    def __init__(self, allowed: Mapping[int, set[int]] | None = None, launches=None,
                 launch_s: float = 0.0, clock=None, priced: bool = True):
        self.allowed, self.clock, self.priced = allowed, clock, priced
        self.launches, self.launch_s = launches or {}, launch_s
        self.terms: list = []        # the edges' objective terms, for ``objective``
        self.flows: list = []        # (edge, y vars) for completing hints
        self.edge_costs: list = []   # (c_e, edge, scaled costs) of big-M edges, for hints
        self.shares: list = []       # (edges, u vars) of shared edge sets, for hints
        self.copies: list = []       # (c, before, after vars, ...) of copy cuts, for hints
        self.launch_sets: dict = {}  # (level, axes) -> z var: one launch per merged set
        self.launch_uses: list = []  # (root, strategy, keys) behind the z vars, for hints
        self.always: dict | None = None   # bytes_terms of the values live all step

    # ---- variables and constraints -------------------------------------------------------
    def variables(self, mdl: Model) -> None:
        for g in mdl.p.groups:
            if mdl.root[g.id] == g.id:
                mdl.x[g.id] = [mdl.m.NewBoolVar(f"x{g.id}_{i}") for i in range(g.n)]

    def constraints(self, mdl: Model) -> None:
        for g, xs in mdl.x.items():
            mdl.named(mdl.m.AddExactlyOne(xs), self, "pick", g)
        if self.priced:
            self.add_edges(mdl)
        for g, ok in (self.allowed or {}).items():
            for i, x in enumerate(mdl.xs(g)):
                if i not in ok:
                    mdl.named(mdl.m.Add(x == 0), self, "fixed", g, i)

    def add_edges(self, mdl: Model) -> None:
        """Edge sets (a value and its readers, ``Problem.edge_sets``) that repeat between the same
        tied groups with the same layouts arrive as one set carrying the sum of their
        multipliers (``Problem.merged_edge_sets``), so the model does not grow with depth.
        Raises OutOfTime when the clock's budget is spent (the model is then discarded)."""
        for k, es in enumerate(mdl.p.merged_edge_sets()):
            if self.clock is not None and self.clock.spent(BUDGET_FACTOR):
                raise OutOfTime
            if len(es) == 1:
                self.add_edge(mdl, k, es[0])
            else:
                self.add_edge_set(mdl, k, es)

    def add_edge_set(self, mdl: Model, k: int, es) -> None:
        """One value read by several groups: ``u[o, r]`` is 1 when the value, made in layout
        ``o``, is moved to layout ``r`` for at least one reader, and carries that move's cost
        once: u[o, r] >= y[e, o, r] for every edge e (``layouts:share:k``)."""
        e0 = es[0]
        have = mdl.p.groups[e0.src].shard[e0.value]
        outs = _distinct(have)
        needs = _distinct([n for e in es for n in e.need])
        cost = {(o, r): e0.mult * mdl.p.reshard_s(e0.value, o, r) for o in outs for r in needs}
        cost = {key: c for key, c in cost.items() if c > 0}
        if not cost:
            return
        shared = []
        for j, e in enumerate(es):
            pairs = len(outs) * len(_distinct(e.need))
            if mdl.root[e.src] == mdl.root[e.dst] or len(cost) > FLOW_PAIRS_MAX or (
                    pairs > FLOW_PAIRS_MAX):
                self.add_edge(mdl, f"{k}.{j}", e)     # no sharing: each reader pays its move
            else:
                shared.append(e)
        if not shared:
            return
        u = {key: mdl.m.NewBoolVar(f"u{k}") for key in cost}
        self.shares.append((shared, u))
        for j, e in enumerate(shared):
            for key, ind in self._indicators(mdl, f"{k}.{j}", e, have, outs).items():
                if key in u:
                    mdl.named(mdl.m.Add(u[key] >= ind), self, "share", k)
        self.terms += [(ns(cost[key]), var) for key, var in u.items()]

    def _indicators(self, mdl: Model, k, e, have, outs) -> dict:
        """(o, r) -> a 0/1 expression: edge ``e`` moves its value from ``o`` to ``r``."""
        xs, xd = mdl.xs(e.src), mdl.xs(e.dst)
        needs = _distinct(e.need)
        if len(outs) == 1:
            return {(outs[0], r): sum(x for x, n in zip(xd, e.need) if n == r) for r in needs}
        if len(needs) == 1:
            return {(o, needs[0]): sum(x for x, h in zip(xs, have) if h == o) for o in outs}
        return self._flows(mdl, k, e, have, outs, needs)

    def _flows(self, mdl: Model, k, e, have, outs, needs) -> dict:
        """y[o, r] with Σ_r y = [src picks o] and Σ_o y = [dst picks r]."""
        xs, xd = mdl.xs(e.src), mdl.xs(e.dst)
        y = {(o, r): mdl.m.NewBoolVar(f"y{k}") for o in outs for r in needs}
        self.flows.append((e, y))
        for o in outs:
            mdl.named(mdl.m.Add(sum(y[o, r] for r in needs)
                                == sum(x for x, h in zip(xs, have) if h == o)), self, "flow-out", k)
        for r in needs:
            mdl.named(mdl.m.Add(sum(y[o, r] for o in outs)
                                == sum(x for x, n in zip(xd, e.need) if n == r)),
                      self, "flow-in", k)
        return y

    def add_edge(self, mdl: Model, k, e) -> None:
        have = mdl.p.groups[e.src].shard[e.value]
        xs, xd = mdl.xs(e.src), mdl.xs(e.dst)
        if mdl.root[e.src] == mdl.root[e.dst]:
            for i, x in enumerate(xs):
                c = e.mult * mdl.p.reshard_s(e.value, have[i], e.need[i])
                if c > 0:
                    self.terms.append((ns(c), x))
            return
        outs, needs = _distinct(have), _distinct(e.need)
        cost = {(o, r): e.mult * mdl.p.reshard_s(e.value, o, r) for o in outs for r in needs}
        if not any(c > 0 for c in cost.values()):
            return
        if len(outs) == 1 or len(needs) == 1:
            for i, x in enumerate(xs if len(needs) == 1 else xd):
                c = cost[(have[i], e.need[0])] if len(needs) == 1 else cost[(have[0], e.need[i])]
                if c > 0:
                    self.terms.append((ns(c), x))
            return
        if len(outs) * len(needs) > FLOW_PAIRS_MAX:
            self.add_edge_big_m(mdl, k, e, have, outs, needs, cost)
            return
        y = self._flows(mdl, k, e, have, outs, needs)
        self.terms += [(ns(c), y[key]) for key, c in cost.items() if c > 0]

    def add_edge_big_m(self, mdl: Model, k, e, have, outs, needs, cost) -> None:
        """A large edge without pair variables: one cost variable c_e and, per needed layout r,
        c_e >= Σ_i cost(layout_i, r)·x[src,i] - max_o cost(o, r)·(1 - z_r)  (``layouts:edge:k``).
        Weaker in relaxation than the flow form, but linear in size."""
        xs, xd = mdl.xs(e.src), mdl.xs(e.dst)
        scaled = {key: ns(c) for key, c in cost.items()}
        top = max(scaled.values())
        c_e = mdl.m.NewIntVar(0, top, f"c{k}")
        self.edge_costs.append((c_e, e, scaled))
        for r in needs:
            z = sum(x for x, n in zip(xd, e.need) if n == r)
            big = max(scaled[(o, r)] for o in outs)
            if big == 0:
                continue
            lhs = sum(scaled[(h, r)] * x for x, h in zip(xs, have) if scaled[(h, r)])
            mdl.named(mdl.m.Add(c_e >= lhs - big + big * z), self, "edge", k)
        self.terms.append((1, c_e))

    # ---- memory --------------------------------------------------------------------------
    def memory(self, mdl: Model, point: Point) -> list:
        """The KiB of the values live all step and of those live at ``point``, under each
        strategy; at a copy cut, plus its copies (``_copies``)."""
        if self.always is None:
            self.always = self.bytes_terms(mdl, mdl.p.const_values)
        terms = dict(self.always)
        for key, c in self.bytes_terms(mdl, point.live).items():
            terms[key] = terms.get(key, 0) + c
        out = [(c, mdl.xs(g)[i]) for (g, i), c in terms.items() if c]
        if point.cut is not None:
            out += self._copies(mdl, point)
        return out

    def _copies(self, mdl: Model, point: Point) -> list:
        """A copy cut's possible copies: each copy's KiB times a 0-1 variable c, where c >=
        [source makes another layout] + before + after - 2, and before (after) >= [reader
        needs the layout] for each reader at or before (after) the position (``layouts:copy:k``):
        minimising memory keeps them at 0 unless the plan makes the copy."""
        k, out = point.name.rpartition(":")[2], []
        for size, src, other, before, after in point.cut.copies:
            c, lo, hi = (mdl.m.NewBoolVar(f"copy{k}") for _ in range(3))
            self.copies.append((c, lo, hi, src, other, before, after))
            for var, readers in ((lo, before), (hi, after)):
                for d, needs in readers:
                    mdl.named(mdl.m.Add(var >= sum(mdl.xs(d)[j] for j in needs)), self, "copy", k)
            mdl.named(mdl.m.Add(c >= sum(mdl.xs(src)[i] for i in other) + lo + hi - 2),
                      self, "copy", k)
            out.append((math.ceil(size / KIB), c))
        return out

    @staticmethod
    def bytes_terms(mdl: Model, values) -> dict[tuple[int, int], int]:
        """Per (root, strategy): KiB of ``values`` under it. The values of a repeated layer
        repeat (root, layouts) pairs: each distinct pair is rounded once and counted (integer
        sums: the same totals in any order), roots in the order the values first name them."""
        counts: dict[tuple[int, int], int] = {}
        arrays: dict[int, np.ndarray] = {}
        for v, n in Counter(values).items():   # a folded graph repeats its twins' values
            g = mdl.p.group_of_value.get(v)
            if g is None:
                continue
            b = value_bytes(mdl.p, v)     # memoised: one array per (type, layouts)
            kib = arrays.get(id(b))
            if kib is None:
                kib = arrays[id(b)] = np.rint(b / KIB).astype(np.int64)
            key = (mdl.root[g], id(b))
            counts[key] = counts.get(key, 0) + n
        per_root: dict[int, np.ndarray] = {}
        for (g, b), n in counts.items():
            add = n * arrays[b]
            per_root[g] = per_root[g] + add if g in per_root else add
        return {(g, i): int(b) for g, arr in per_root.items() for i, b in enumerate(arr)}

    # ---- objective ------------------------------------------------------------------------
    def objective(self, mdl: Model) -> None:
        """One term per root strategy (tied groups' costs summed first), the edges' terms,
        and the combiner's launches (``_launches``)."""
        if not self.priced:
            return
        for r, cost in mdl.p.root_costs().items():
            mdl.obj += [(ns(c), x) for c, x in zip(cost, mdl.x[r]) if c > 0]
        mdl.obj += self.terms
        self._launches(mdl)

    def _launches(self, mdl: Model) -> None:
        """XLA's all-reduce combiner (``combine.launch_terms``): each top-level all-reduce is
        charged without its launch, and each merge set it joins, ``z[level, axes]`` (at least
        every strategy whose all-reduces join it: ``layouts:launch:r:i``), one launch per
        execution."""
        for r, per_i in self.launches.items():
            for i, (n, keys) in enumerate(per_i):
                if not n:
                    continue
                x = mdl.x[r][i]
                mdl.obj.append((-ns(self.launch_s * n), x))
                for key in sorted(keys):    # a set's order follows string hashes: sorted,
                    z = self.launch_sets.get(key)   # the model is the same in every process
                    if z is None:
                        z = self.launch_sets[key] = mdl.m.NewBoolVar(f"z{len(self.launch_sets)}")
                        mdl.obj.append((ns(self.launch_s * key[-1]), z))  # once per execution
                    mdl.named(mdl.m.AddImplication(x, z), self, "launch", r, i)
                self.launch_uses.append((r, i, keys))

    # ---- start and read-back ------------------------------------------------------------
    def start(self, mdl: Model, pick: dict[int, int]) -> None:
        """A complete starting solution: x from ``pick``, every flow, share, copy and launch
        variable implied by it."""
        for g, xs in mdl.x.items():
            for i, x in enumerate(xs):
                mdl.m.AddHint(x, i == pick[g])
        for e, y in self.flows:
            o = mdl.p.groups[e.src].shard[e.value][pick[mdl.root[e.src]]]
            r = e.need[pick[mdl.root[e.dst]]]
            for (oo, rr), var in y.items():
                mdl.m.AddHint(var, oo == o and rr == r)
        for c_e, e, scaled in self.edge_costs:
            o = mdl.p.groups[e.src].shard[e.value][pick[mdl.root[e.src]]]
            mdl.m.AddHint(c_e, scaled[(o, e.need[pick[mdl.root[e.dst]]])])
        for es, u in self.shares:
            o = mdl.p.groups[es[0].src].shard[es[0].value][pick[mdl.root[es[0].src]]]
            moved = {e.need[pick[mdl.root[e.dst]]] for e in es}
            for (oo, rr), var in u.items():
                mdl.m.AddHint(var, oo == o and rr in moved)
        for c, lo, hi, src, other, before, after in self.copies:
            lo_on = any(pick[mdl.root[d]] in needs for d, needs in before)
            hi_on = any(pick[mdl.root[d]] in needs for d, needs in after)
            mdl.m.AddHint(lo, lo_on)
            mdl.m.AddHint(hi, hi_on)
            mdl.m.AddHint(c, lo_on and hi_on and pick[mdl.root[src]] in other)
        used = {key for r, i, keys in self.launch_uses if pick[r] == i for key in keys}
        for key, z in self.launch_sets.items():
            mdl.m.AddHint(z, key in used)

    def read_back(self, mdl: Model, solver) -> tuple[int, ...]:
        """The choice: per group, in group order, the strategy its root's variables pick."""
        picked = {r: next(i for i, x in enumerate(xs) if solver.Value(x))
                  for r, xs in mdl.x.items()}
        return tuple(picked[mdl.root[g.id]] for g in mdl.p.groups)


def _distinct(layouts) -> list:
    seen = {}
    for s in layouts:
        seen.setdefault(s, None)
    return list(seen)
