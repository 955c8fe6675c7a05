"""A fast starting plan for the ILP: coordinate descent on the full objective.

Each root group in turn takes the strategy that is cheapest given its neighbours' current choices
(its own costs plus the resharding on every incident edge), sweeping until nothing changes
("iterated conditional modes"). The result is a complete, feasible-by-construction solution the
ILP starts from and can only improve on; memory is left to the ILP.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from autopar.planner.budget import SEARCH_BEFORE
from autopar.planner.problem import Problem


class OutOfTime(Exception):
    """The call's wall-clock budget ran out while the descent's edge matrices were built (on
    meshes of many small axes they take seconds: a reshard price per pair of layouts)."""


def _root(p: Problem, g: int) -> int:
    return p.root(g)


def _index(layouts) -> tuple[list, np.ndarray]:
    distinct: dict = {}
    idx = np.array([distinct.setdefault(x, len(distinct)) for x in layouts])
    return list(distinct), idx


def _dense(have, need, cost) -> np.ndarray:
    """Strategy-by-strategy cost matrix, computed once per distinct pair of layouts."""
    hs, hi = _index(have)
    ns, ni = _index(need)
    small = np.array([[cost(h, n) for n in ns] for h in hs])
    return small[hi[:, None], ni[None, :]]


def edge_matrices(p: Problem, cm, clock=None):
    """(unary cost per root, [(src root, dst root, matrix)]); ``OutOfTime`` where ``clock``
    (a ``planner.budget.Clock``) runs past ``SEARCH_BEFORE`` of its budget meanwhile."""
    memo = p.memo.edge_matrices
    if memo is not None:
        return memo
    rs = p.reshard_s
    unary = dict(p.root_costs())
    pair = []
    for k, e in enumerate(p.merged_edges()):   # repeated layers' edges arrive merged
        if clock is not None and k % 16 == 0 and clock.spent(SEARCH_BEFORE):
            raise OutOfTime
        s, d = _root(p, e.src), _root(p, e.dst)
        have = p.groups[e.src].shard[e.value]
        if s == d:
            unary[s] = unary[s] + e.mult * np.array([rs(e.value, have[i], e.need[i])
                                                     for i in range(len(have))])
            continue
        m = _dense(have, e.need, lambda a, b, v=e.value: rs(v, a, b)) * e.mult
        if m.any():
            pair.append((s, d, m))
    p.memo.edge_matrices = (unary, pair)
    return unary, pair


def descend(p: Problem, cm, start: dict[int, int] | None = None, sweeps: int = 20,
            allowed=None, clock=None) -> dict[int, int]:
    """A descent solution (see the module docstring) from ``start``, else the best of three
    starts of its own; ``OutOfTime`` as ``edge_matrices`` says."""
    unary, pair = edge_matrices(p, cm, clock)
    unary = _masked(p, dict(unary), allowed or {})
    incident = defaultdict(list)
    for k, (s, d, _) in enumerate(pair):
        incident[s].append(k)
        incident[d].append(k)
    if start:
        choice = {r: int(np.argmin(u)) for r, u in unary.items()}
        choice.update({r: start[r] for r in choice if r in start})
        return _expand(p, _icm(unary, pair, incident, choice, sweeps))
    best = None
    cheapest_alone = {r: int(np.argmin(u)) for r, u in unary.items()}
    ops_first = sorted(unary, key=lambda r: (p.groups[r].leader < 0, r))
    for init in (_propagate(unary, pair, incident), cheapest_alone,
                 _propagate(unary, pair, incident, ops_first)):
        choice = _icm(unary, pair, incident, init, sweeps)
        cost = _cost(unary, pair, choice)
        if best is None or cost < best[0]:
            best = (cost, choice)
    return _expand(p, best[1])


def _masked(p: Problem, unary: dict, allowed) -> dict:
    """``unary`` with ``big`` added to each root's strategies once per group of it whose
    ``allowed`` set leaves them out. Adding 0 changes no float, so an entry's sum depends only on
    how many sets leave it out: those counts are taken per distinct set (tied groups share one
    set object), then ``big`` is added that many times in turn, as one addition per group did."""
    big = 1e30
    times: dict[tuple, list] = {}
    for g, ok in allowed.items():
        entry = times.setdefault((_root(p, g), id(ok)), [ok, 0])
        entry[1] += 1
    left_out: dict[int, np.ndarray] = {}
    for (r, _), (ok, count) in times.items():
        out = left_out.get(r)
        if out is None:
            out = left_out[r] = np.zeros(len(unary[r]), dtype=np.int64)
        keep = np.zeros(len(out), dtype=bool)
        keep[list(ok)] = True
        out[~keep] += count
    most = max((int(out.max()) for out in left_out.values()), default=0)
    sums = [0.0]              # sums[t]: big added t times in turn to a cost it absorbs
    for _ in range(most):
        sums.append(sums[-1] + big)
    sums = np.array(sums)
    for r, out in left_out.items():
        u = unary[r] + 0.0     # a new array: the memoised one is not modified
        absorbed = (out > 0) & (np.abs(u) < _ABSORBED)
        u[absorbed] = sums[out[absorbed]]
        rest = np.where(absorbed, 0, out)
        for t in range(int(rest.max())):      # any cost not absorbed: the additions in turn
            u[rest > t] += big
        unary[r] = u
    return unary


# A cost (seconds) this small vanishes when ``big`` (1e30, whose float spacing is ~1.4e14) is
# added to it: ``cost + big == big``.
_ABSORBED = 1e13


def _expand(p: Problem, choice: dict[int, int]) -> dict[int, int]:
    return {g.id: choice[_root(p, g.id)] for g in p.groups}


def _cost(unary, pair, choice) -> float:
    return float(sum(u[choice[r]] for r, u in unary.items())
                 + sum(m[choice[s], choice[d]] for s, d, m in pair))


def _propagate(unary, pair, incident, order=None) -> dict[int, int]:
    """Greedy sharding propagation: in creation (topological) order, each group takes what is
    cheapest given the groups already decided, so a batch or head split flows through.
    ``order``: another order; ops before inputs lets the computation choose its layouts and
    each parameter and batch input take what its readers chose (in creation order the inputs
    come first and, alone, take what makes their optimizer update cheapest: split as far as
    the mesh allows, which can set every op after them on a poor course)."""
    choice: dict[int, int] = {}
    for r in (sorted(unary) if order is None else order):
        total = unary[r].copy()
        for k in incident[r]:
            s, d, m = pair[k]
            if s == r and d in choice:
                total += m[:, choice[d]]
            elif d == r and s in choice:
                total += m[choice[s], :]
        choice[r] = int(np.argmin(total))
    return choice


def _icm(unary, pair, incident, choice: dict[int, int], sweeps: int) -> dict[int, int]:
    """Iterated conditional modes: sweep until no group can lower the total alone."""
    choice = dict(choice)
    for _ in range(sweeps):
        changed = False
        for r in unary:
            total = unary[r].copy()
            for k in incident[r]:
                s, d, m = pair[k]
                total += m[:, choice[d]] if s == r else m[choice[s], :]
            best = int(np.argmin(total))
            if total[best] < total[choice[r]] - 1e-15:
                choice[r] = best
                changed = True
        if not changed:
            break
    return choice


def objective(p: Problem, cm, choice: dict[int, int]) -> float:
    """The plan's exact objective (the descent itself works on pairwise edge costs, which count
    a value resharded for several readers once per reader; see ``Problem.edge_sets``)."""
    unary = sum(float(c[choice[r]]) for r, c in p.root_costs().items())
    return float(unary + p.transition_s(choice))


def local_costs(p: Problem, cm, choice: dict[int, int]) -> dict[int, np.ndarray]:
    """Per root: the total cost of each of its strategies with every other group kept at
    ``choice`` (what one descent step compares)."""
    unary, pair = edge_matrices(p, cm)
    out = {r: u.copy() for r, u in unary.items()}
    for s, d, m in pair:
        out[s] += m[:, choice[d]]
        out[d] += m[choice[s], :]
    return out
