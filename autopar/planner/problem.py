"""Build the planning problem from an ``ir.Graph``: decision groups, resharding edges, memory.

Notation (used by ``ilp.py`` and ``families/layouts.py`` too):
  g        a *group*: one decision op (dot_general, an input, ...) plus every op merged into it
           because it can only follow its operand (``rules.Follow``). ``x[g, i]`` = 1 when the
           group runs under its i-th strategy.
  cost[g]  per strategy: compute + the group's own collectives, each times its op's multiplier
           (a scan body op runs ``trip_count`` times).
  e        an *edge*: value ``v`` made by group ``src`` and read by group ``dst``, which under its
           strategy j needs ``v`` in sharding ``need[j]``; resharding costs
           ``reshard_s(shard[src][v][i] -> need[j])``.
  memory   per-device bytes of inputs plus the live intermediates at a few check points of the
           schedule (the points where the replicated live size is largest).

Repeated layers: ops and inputs with equal structural role (``ir.layers.roles``: the same part of
structurally equal unrolled layers, their parameters, optimizer state and updates) that lead
groups with the same strategies share one decision (``ties``: group -> root group). Per-op work is
memoised by the op's structure and the layouts of the operand it follows, so a repeated layer
costs dictionary look-ups, not rule evaluations; ``merged_edges`` folds edges that repeat between
the same roots with the same layouts into one, summing their multipliers. The problem the solver
sees (roots and merged edges) is then the same size for 12 layers as for 96.

Folded graphs (``ir.fold``): the planner builds the problem of an unrolled model on its graph
with the middle copies of the repeated layer removed (``build(..., folded=...)``). Each kept op
of the representative copy, and each kept op, input or result with removed twins, weighs what it
stands for (its multiplier and its input edges times ``1 + weight``, except reads of a value all
of them share; result edges times their removed twins); the removed copies' memory is what of
theirs is live across the gap (``Gap``, ``phantoms``, and ``memory``'s resharded copies and
result buffers), and resident values repeat once per removed twin. The objective of a plan is
then the full graph's objective for the same decisions, and the build, the memory estimate and
the assembly walk a graph of the same size at any depth; what still grows is the fold itself
and mapping the plan back (``planner.unfold``: the pins of every op, the graph's fingerprint).

Regions: a scan body is planned once, not unrolled. Its inputs follow the scan's operands (xs lose
their leading axis), its outputs feed the scan's results (ys gain it), and a loop-carried value
pays an edge from the body's carry-out back to its carry-in, ``trip_count`` times.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from autopar.planner import rules
from autopar.planner.budget import SEARCH_BEFORE
from autopar.planner.reshard import reshard_s
from autopar.planner.rules import Choices, Follow, RuleContext, Strategy
from autopar.sharding import Sharding, replicated, shard_factor
from cost_models.compute import CONV_PRIMS, MATMUL_PRIMS
from ir import Graph, Op
from ir.fold import Folded
from ir.fusion import Fusion, fuse
from ir.layers import _walk as walk_ops
from ir.layers import node_graph
from ir.layers import roles as layer_roles
from ir.offload import find_groups
from ir.recompute import flat, is_call


@dataclasses.dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    value: int
    need: tuple[Sharding, ...]                    # per dst strategy
    mult: float
    where: str                                    # "op12:arg1", for explanations
    op: int = -1                                  # the op that reads the value (-1: none)


@dataclasses.dataclass
class Group:
    id: int
    leader: int                                   # op id (or -1 - input index for an input)
    strategies: tuple[Strategy, ...]              # the leader's
    compute_s: np.ndarray
    comm_s: np.ndarray
    hbm_bytes: np.ndarray                         # per strategy: bytes its kernels move
    members: dict[int, list[Strategy]] = dataclasses.field(default_factory=dict)
    shard: dict[int, list[Sharding]] = dataclasses.field(default_factory=dict)  # value -> per i
    mults: dict[int, float] = dataclasses.field(default_factory=dict)  # member op -> multiplier
    self_edges: list[Edge] = dataclasses.field(default_factory=list)   # both ends in this group

    @property
    def n(self) -> int:
        return len(self.strategies)


@dataclasses.dataclass(eq=False)
class Memo:
    """What is computed about one ``Problem`` and reused (by the descent per start, by the
    memory model per check point...): each slot filled on first use by the function named
    beside it. Read a slot's value only: it is shared. A problem made from another
    (``Problem.untied``, ``restrict``, ``kernel_choice.prepare``) starts with an empty memo
    unless the function that makes it hands on what still holds."""

    edge_sets: list | None = None         # Problem.edge_sets
    merged: list | None = None            # Problem.merged_edge_sets (depends on the ties)
    root_costs: dict | None = None        # Problem.root_costs (depends on the ties)
    value_bytes: dict = dataclasses.field(default_factory=dict)   # value_bytes, by type/layouts
    edge_matrices: tuple | None = None    # descent.edge_matrices (depends on the ties)
    memory_tables: tuple | None = None    # ilp._memory_tables
    memory_counts: tuple | None = None    # ilp._memory_counts
    group_origins: dict | None = None     # planner._group_origins
    launch_sites: tuple | None = None     # combine._sites: (the ties they were found under, sites)
    all_reduced: dict | None = None       # scatter._reduced
    edges_by_value: dict | None = None    # scatter._edges_by_value
    # memory.py's plan-independent facts (its ``_memo``), by the name of the function that
    # makes each: fourteen private tables of one module, named at their one call site each
    memory: dict = dataclasses.field(default_factory=dict)

    def for_ties(self) -> Memo:
        """This memo for a problem that differs only in its ties: the slots that depend on the
        ties empty, the others shared."""
        return dataclasses.replace(self, merged=None, root_costs=None, edge_matrices=None)


@dataclasses.dataclass
class Problem:
    graph: Graph
    mesh: Mapping[str, int]
    groups: list[Group]
    edges: list[Edge]
    group_of_value: dict[int, int]
    group_of_op: dict[int, int]
    input_group: list[int]                        # per graph input
    ties: dict[int, int]                          # group -> representative group (layer tying)
    output_pairs: dict[int, int]                  # output index -> input index it replaces
    mem_points: list[list[int]]                   # per check point: live intermediate value ids
    const_values: list[int]               # held the whole step: args, consts, non-aliased results
    reshard: ReshardCache
    fusion: Fusion                                # the kernels XLA makes of the graph
    kernel_sites: list = dataclasses.field(default_factory=list)   # planner.kernel_sites.Site
    kernel_mode: str = "never"                    # PlannerOptions.kernels
    kernel_rejected: list = dataclasses.field(default_factory=list)   # plan.RejectedKernel
    # a folded graph (``ir.fold``): (value, first, last position, copies) of the removed
    # layers' values live across the gap, each the representative's value ``copies`` times
    phantoms: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    gap: Gap | None = None                        # a folded graph's gap (``Gap``)
    # what is computed about this problem and reused; a problem made by dataclasses.replace
    # starts with an empty one (see ``Memo``)
    memo: Memo = dataclasses.field(default_factory=Memo, init=False, repr=False, compare=False)

    def reshard_s(self, v: int, src: Sharding, dst: Sharding) -> float:
        return self.reshard(self.graph.values[v], src, dst)

    def root(self, g: int) -> int:
        return self.ties.get(g, g)

    @property
    def num_decisions(self) -> int:
        """Groups with variables of their own (the others are tied to a root)."""
        return len(self.groups) - len(self.ties)

    def untied(self, allowed: Mapping[int, set[int]]) -> Problem:
        """This problem with the tie classes whose members a hand-written strategy restricts
        differently split (it may pin two parameters of one role to different layouts): each
        distinct restriction gets its own root. Itself when no tie splits, else a copy (sharing
        groups, edges and what of the memo does not depend on the ties)."""
        ties = _untied(self.ties, allowed)
        if ties == self.ties:
            return self
        out = dataclasses.replace(self, ties=ties)
        out.memo = self.memo.for_ties()
        return out

    def merged_edge_sets(self) -> list[list[Edge]]:
        """``edge_sets`` of repeated layers folded together: sets moving values of one type in
        the same layouts from the same root to the same roots, which need the same layouts, are
        one set whose edges carry the summed multipliers. The solver and the descent see these,
        so their size does not grow with depth. The set semantics (each distinct move paid once)
        are kept: only edges that make the same move are folded."""
        hit = self.memo.merged
        if hit is None:
            # key -> (the first such set's edges, their multipliers summed over the sets, in
            # order): the folded edges are made once, not once per repeated layer
            merged: dict[tuple, tuple[list[Edge], list[float] | None]] = {}
            root = self.ties.get
            for es in self.edge_sets():
                # readers of one root needing one layout share its move: one edge stands for
                # them (a value every layer reads, like a mask, stays one edge at any depth)
                same_move: dict[tuple, Edge] = {}
                for e in es:
                    same_move.setdefault((root(e.dst, e.dst), id(e.need)), e)
                e0 = es[0]
                key = (root(e0.src, e0.src), self.graph.values[e0.value],
                       id(self.groups[e0.src].shard[e0.value]), tuple(same_move))
                old = merged.get(key)
                if old is None:
                    merged[key] = (list(same_move.values()), None)
                else:
                    sums = old[1] or [o.mult for o in old[0]]
                    merged[key] = (old[0], [m + e.mult for m, e in zip(sums, same_move.values())])
            hit = self.memo.merged = [
                es if sums is None else [dataclasses.replace(o, mult=m) for o, m in zip(es, sums)]
                for es, sums in merged.values()]
        return hit

    def merged_edges(self) -> list[Edge]:
        """The edges of ``merged_edge_sets``, one list."""
        return [e for es in self.merged_edge_sets() for e in es]

    def root_costs(self) -> dict[int, np.ndarray]:
        """Per root group: the summed compute and collective time of it and its tied groups
        (memoised: do not modify)."""
        out = self.memo.root_costs
        if out is None:
            out = self.memo.root_costs = {}
            for g in self.groups:
                r = self.root(g.id)
                out[r] = out[r] + g.compute_s + g.comm_s if r in out else g.compute_s + g.comm_s
        return out

    def edge_sets(self) -> list[list[Edge]]:
        """Edges that move the same value from the same group in the same region: XLA reshards
        a value once per layout its readers need (identical reshards are common
        subexpressions), so a set costs each distinct needed layout once."""
        memo = self.memo.edge_sets
        if memo is None:
            by_key: dict[tuple, list[Edge]] = {}
            for e in self.edges:
                by_key.setdefault((e.src, e.value, e.mult), []).append(e)
            memo = self.memo.edge_sets = list(by_key.values())
        return memo

    def transition_s(self, choice) -> float:
        """Resharding seconds of the plan ``choice`` (group -> strategy index) on the edges
        between groups, each distinct (value, layout) move counted once (``edge_sets``)."""
        total = 0.0
        for es in self.merged_edge_sets():   # repeated layers' sets fold into one: same total
            have = self.groups[es[0].src].shard[es[0].value][choice[es[0].src]]
            for need in {e.need[choice[e.dst]] for e in es} - {have}:
                total += es[0].mult * self.reshard_s(es[0].value, have, need)
        return total


def _untied(ties: Mapping[int, int], allowed: Mapping[int, set[int]]) -> dict[int, int]:
    """``ties`` with the classes whose members ``allowed`` restricts differently split: each
    distinct restriction gets its own root."""
    out = dict(ties)
    classes: dict[tuple[int, frozenset | None], int] = {}
    for g in sorted(ties):
        r = ties[g]
        mine, theirs = allowed.get(g), allowed.get(r)
        if mine == theirs:
            continue
        key = (r, None if mine is None else frozenset(mine))
        new_root = classes.setdefault(key, g)
        if new_root == g:
            del out[g]
        else:
            out[g] = new_root
    return out


def _add_costs(grp: Group, kind: str, what, mult: float) -> None:
    if kind == "e":
        grp.comm_s += mult * what
    elif mult == 1.0:     # most ops: no scaled copies of the three arrays
        grp.compute_s += what.compute_s
        grp.comm_s += what.comm_s
        grp.hbm_bytes += what.hbm_bytes
    else:
        grp.compute_s += mult * what.compute_s
        grp.comm_s += mult * what.comm_s
        grp.hbm_bytes += mult * what.hbm_bytes


class ReshardCache:
    """Resharding time by (tensor type, source, destination): shared by every stage, since the
    same few layouts of the same few shapes recur on thousands of edges."""

    def __init__(self, cost_model, mesh: Mapping[str, int]):
        self.cm, self.mesh, self.memo = cost_model, dict(mesh), {}

    def __call__(self, t, src: Sharding, dst: Sharding) -> float:
        key = (t, src, dst)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = reshard_s(self.cm, t, src, dst, self.mesh)
        return hit


@dataclasses.dataclass(frozen=True)
class _Planned:
    """What one op contributes under each strategy of its group, shared by every op of the same
    structure that sees the same operand layouts: strategies, output layouts, unscaled costs and
    the layout each strategy needs of every operand (interned tuples, compared by identity)."""

    per_i: tuple[Strategy, ...]
    outs: tuple[tuple[Sharding, ...], ...]
    compute_s: np.ndarray
    comm_s: np.ndarray
    needs: tuple[tuple[Sharding, ...] | None, ...]
    hbm_bytes: np.ndarray


class _Builder:
    def __init__(self, graph: Graph, mesh: Mapping[str, int], cost_model, max_strategies: int,
                 clock=None, fusion: Fusion | None = None):
        self.clock = clock    # planner.budget.Clock: past its search limit, ops run replicated
        self.late_ops = 0
        self.g = graph
        self.mesh = dict(mesh)
        self.cm = cost_model
        lit = frozenset(v for v, _ in graph.literals)
        producers = {v: op.prim for op in graph.all_ops() for v in op.outs}
        self.ctx = RuleContext(graph.values, lit, producers, self.mesh, max_strategies, clock,
                               sums_by_dim=cost_model.hw.platform == "cpu")
        self.groups: list[Group] = []
        self.edges: list[Edge] = []
        self.gv: dict[int, int] = {}
        self.gop: dict[int, int] = {}
        self.reshard = ReshardCache(cost_model, mesh)
        self.fusion = fuse(graph) if fusion is None else fusion
        self.kernel_bytes = facts(graph).kernel_bytes(self.fusion)
        self.memo: dict = {}        # op structure (+ operand layouts) -> rule / _Planned
        self.rule_memo: dict = {}   # op_key's first int -> the op's rule
        self.follow_memo: dict = {}  # (op_key's second int, id of the followed layouts) -> _Planned
        first = len(graph.inputs) + len(graph.consts)
        labels = node_graph(graph)[0]
        self.labels = {op.id: int(labels[first + j]) for j, op in enumerate(graph.ops)}
        self.interned: dict = {}    # layout tuple -> the one instance of it
        self.key_ids: dict = {}     # op_key's tuples -> their ints
        self.self_moves: set = set()  # (group, value, need, mult) of self edges already costed
        # group id -> the costs added to it while walking, in order ("f", _Planned, mult) or
        # ("e", self-edge seconds, mult): summed by ``add_pending`` once per distinct list
        self.pending: dict[int, list] | None = {}
        self.initial: dict[int, tuple] = {}   # group id -> what its arrays started from
        self.weight: Mapping[int, int] = {}   # a folded graph's op -> removed ops it stands for
        self.shared: frozenset = frozenset()  # (op, operand) all of those read as it does

    def intern(self, layouts: tuple) -> tuple:
        return self.interned.setdefault(layouts, layouts)

    def op_key(self, op: Op) -> tuple[int, int] | None:
        """(what the rules read of an op, that and what its costs read too), each as a small
        int naming its tuple (so the memo hashes a long tuple once per op, not once per look-up);
        None for ops with regions. The rules read the op's structure: a top-level op's
        structural label (``ir.layers.node_graph``: primitive, params, types, literals) stands
        in for the first five entries of it. The costs read the fusion role too."""
        if op.regions:
            return None
        ctx = self.ctx
        label = self.labels.get(op.id)
        producers = tuple(map(ctx.producers.get, op.ins))
        if label is not None:
            structure = (label, producers, op.flops, op.transcendentals, op.bytes_accessed)
        else:
            vals = self.g.values
            structure = (op.prim, op.params, tuple(vals[v] for v in op.ins),
                         tuple(vals[v] for v in op.outs), tuple(v in ctx.literals for v in op.ins),
                         producers, op.flops, op.transcendentals, op.bytes_accessed)
        ids = self.key_ids
        rid = ids.setdefault(structure, len(ids))
        fusion, i = self.fusion, op.id
        if i in fusion.reads or i in fusion.writes or i in fusion.copies:
            role = (rid,) + self.fusion_role(op)
        else:   # most ops of a fused kernel read and write nothing from memory
            role = (rid, (), (), (), i in fusion.roots, self.kernel_bytes.get(i, 0.0))
        return rid, ids.setdefault(role, len(ids))

    def fusion_role(self, op: Op) -> tuple:
        """What the op's kernel reads (with how often), writes and copies, as positions among its
        operands and results (``kernel_io``), and whether it launches the kernel: its costs
        depend on them."""
        return kernel_io(self.fusion, op) + (op.id in self.fusion.roots,
                                             self.kernel_bytes.get(op.id, 0.0))

    def planned(self, op: Op, per_i: Sequence[Strategy], key) -> _Planned:
        """The op's contribution under ``per_i``, memoised under ``key`` (None: not memoised)."""
        hit = self.memo.get(key) if key is not None else None
        if hit is None:
            per_i = tuple(per_i)
            n = len(per_i)
            outs = tuple(self.intern(tuple(st.outs[k] for st in per_i))
                         for k in range(len(op.outs)))
            needs = tuple(None if v in self.ctx.literals else self.intern(tuple(
                st.ins[k] if k < len(st.ins) and st.ins[k] is not None
                else replicated(len(self.g.values[v].shape)) for st in per_i))
                for k, v in enumerate(op.ins))
            scratch = Group(-1, op.id, per_i, np.zeros(n), np.zeros(n), np.zeros(n))
            self.add_costs(scratch, op, list(per_i), 1.0)
            hit = _Planned(per_i, outs, scratch.compute_s, scratch.comm_s, needs,
                           scratch.hbm_bytes)
            if key is not None:
                self.memo[key] = hit
        return hit

    # -- groups -----------------------------------------------------------------------------
    def new_group(self, leader: int, strategies: Sequence[Strategy], op: Op | None = None,
                  mult: float = 1.0, pl: _Planned | None = None) -> Group:
        """A decision group led by an input (``op`` None) or by ``op`` under ``strategies``
        (``pl``: their memoised contribution, computed here when not given)."""
        if op is None:
            n = len(strategies)
            grp = Group(len(self.groups), leader, tuple(strategies), np.zeros(n), np.zeros(n),
                        np.zeros(n))
            grp.members[leader] = grp.strategies
        else:
            pl = pl or self.planned(op, strategies, None)
            grp = Group(len(self.groups), leader, pl.per_i, mult * pl.compute_s,
                        mult * pl.comm_s, mult * pl.hbm_bytes)
            grp.members[leader] = pl.per_i
            for v, layouts in zip(op.outs, pl.outs):
                grp.shard[v] = layouts
                self.gv[v] = grp.id
        grp.mults[leader] = mult
        self.initial[grp.id] = (pl, mult) if op is not None else (None, len(strategies))
        self.groups.append(grp)
        return grp

    def compute_dtype(self, op: Op) -> str:
        """A contraction runs at its inputs' rate (bf16 x bf16 accumulating in f32 is a bf16
        matmul); other ops at their result's."""
        v = op.ins[0] if op.prim in MATMUL_PRIMS and op.ins else (op.outs[0] if op.outs else None)
        return self.g.values[v].dtype if v is not None else "float32"

    def add_costs(self, grp: Group, op: Op, per_i: list[Strategy], mult: float) -> None:
        """Each strategy's compute (a roofline of the op's FLOPs and the bytes its kernel moves
        for it, ``ir.fusion``; the kernel's launch on its last op) and collectives."""
        dtype = self.compute_dtype(op)
        root = op.id in self.fusion.roots
        matmul = op.prim in MATMUL_PRIMS
        io = None if op.regions or op.prim == "alias" else kernel_io(self.fusion, op)
        pool_grad = op.prim == "select_and_scatter_add"
        for i, st in enumerate(per_i):
            nbytes = self.fused_bytes(op, st, io)
            if pool_grad and self.cm.hw.platform == "cpu":
                nbytes = pool_gradient_bytes(self.g, self.mesh, op, st)
            if op.flops or op.transcendentals or nbytes:
                conv = op.prim in CONV_PRIMS
                t = self.cm.compute_time_s(op.flops / st.compute_div, nbytes, dtype, matmul,
                                           conv, op.transcendentals / st.compute_div,
                                           conv_features(self.g, self.mesh, op, st) if conv
                                           else math.inf)
                if pool_grad:   # the measured floor of a max-pool's gradient, when profiled
                    n = _elements(self.g, self.mesh, op.ins[1], _layout_in(st, 1))
                    t = max(t, self.cm.hw.select_scatter_time_s(n) + self.cm.hw.launch_s(nbytes))
                t -= self.cm.hw.launch_s(nbytes)   # the body; the kernel's launch on its root:
                if root:   # sized by the whole kernel's bytes, split as the root's work is
                    t += self.cm.hw.launch_s(self.kernel_bytes[op.id] / st.compute_div)
                grp.compute_s[i] += mult * max(t, 0.0)
                grp.hbm_bytes[i] += mult * nbytes
            for c in st.comms:
                grp.comm_s[i] += mult * self.cm.collective_time_s(c.kind, c.nbytes, c.axes)
            if op.prim == "device_put" and op.param("devices") in _HOST_MOVES:
                # a move over the host link (ir.offload), not overlapped with compute
                moved = _elements(self.g, self.mesh, op.outs[0], st.outs[0]) * \
                    self.g.values[op.outs[0]].itemsize
                grp.compute_s[i] += mult * self.cm.hw.host_transfer_s(moved)

    def fused_bytes(self, op: Op, st: Strategy, io: tuple | None = None) -> float:
        if op.prim == "alias":       # a loop's carry or slice seen from its body: no kernel
            return 0.0
        return op_hbm_bytes(self.g, self.fusion, self.mesh, op, st, io)

    def follow(self, op: Op, operand_value: int, derive, mult: float,
               out_values: Sequence[int] | None = None, key=None) -> tuple[Group, _Planned]:
        gv = self.gv
        grp = self.groups[gv[operand_value]]
        have = grp.shard[operand_value]
        fkey = None if key is None else (key[1], id(have))
        pl = self.follow_memo.get(fkey) if fkey is not None else None
        if pl is None:
            derived_key = None if key is None else ("derived", key[0], id(have))
            per_i = self.memo.get(derived_key) if derived_key is not None else None
            if per_i is None:
                per_i = [derive(s) for s in have]
                if derived_key is not None:
                    self.memo[derived_key] = per_i
            pl = self.planned(op, per_i, None)
            if fkey is not None:
                self.follow_memo[fkey] = pl
        if op.prim != "alias":
            grp.members[op.id] = pl.per_i
            grp.mults[op.id] = mult
        self.add_to(grp, "f", pl, mult)
        outs = op.outs if out_values is None else out_values
        shard, gid = grp.shard, grp.id
        for v, layouts in zip(outs, pl.outs):
            shard[v] = layouts
            gv[v] = gid
        return grp, pl

    def add_to(self, grp: Group, kind: str, what, mult: float) -> None:
        """Adds an op's contribution (``kind`` "f": a ``_Planned``) or a self edge's seconds
        ("e": an array) to ``grp``'s costs; while walking, only noted (``add_pending``)."""
        if self.pending is not None:
            self.pending.setdefault(grp.id, []).append((kind, what, mult))
        else:
            _add_costs(grp, kind, what, mult)

    def add_pending(self) -> int:
        """Sums the contributions noted while walking, in the order they came, once per distinct
        (start, contributions) list: a repeated layer's groups take copies of the first such
        group's sums (the same additions in the same order: the same floats), so the walk does
        not pay three array additions per op. Returns how many distinct lists it summed."""
        pending, self.pending = self.pending, None
        done: dict[tuple, Group] = {}
        for gid, adds in pending.items():
            grp, (start, mult) = self.groups[gid], self.initial[gid]
            key = (id(start), mult, tuple((kind, id(what), m) for kind, what, m in adds))
            first = done.get(key)
            if first is None:
                for kind, what, m in adds:
                    _add_costs(grp, kind, what, m)
                done[key] = grp
            else:
                grp.compute_s, grp.comm_s = first.compute_s.copy(), first.comm_s.copy()
                grp.hbm_bytes = first.hbm_bytes.copy()
        return len(done)

    def link_inputs(self, op: Op, grp: Group, pl: _Planned, skip: int | None,
                    mult: float) -> None:
        """Edges for every non-literal input the op reads, except the one it follows."""
        gv, needs, shared = self.gv, pl.needs, self.shared
        for k, v in enumerate(op.ins):
            if k == skip or needs[k] is None:
                continue
            src = gv.get(v)
            if src is None:
                continue
            m = mult / (1 + self.weight[op.id]) if shared and (op.id, k) in shared else mult
            self.add_edge(src, grp.id, v, needs[k], m, f"op{op.id}:arg{k}", op.id)

    def add_edge(self, src: int, dst: int, v: int, need: tuple[Sharding, ...], mult: float,
                 where: str, op: int = -1) -> None:
        if src == dst:  # both ends decided by one variable: a per-strategy cost
            grp = self.groups[src]
            key = (src, v, need, mult)
            if key in self.self_moves:
                return   # the same move again: XLA computes it once
            self.self_moves.add(key)
            self.add_to(grp, "e", self.self_edge(v, grp.shard[v], need), mult)
            grp.self_edges.append(Edge(src, dst, v, need, mult, where, op))
            return
        self.edges.append(Edge(src, dst, v, need, mult, where, op))

    def self_edge(self, v: int, have: Sequence[Sharding], need: Sequence[Sharding]) -> np.ndarray:
        t = self.g.values[v]
        key = ("self-edge", t, id(have), id(need))
        hit = self.memo.get(key)
        if hit is None:
            hit = np.array([self.reshard(t, a, b) for a, b in zip(have, need)])
            self.memo[key] = hit
            self.memo[("keep", key)] = (have, need)   # keeps the ids above unique
        return hit

    # -- walking the graph ------------------------------------------------------------------
    def late(self) -> bool:
        """Past the plan call's time limit for enumerating strategies (``planner.budget``)."""
        return self.clock is not None and self.clock.spent(SEARCH_BEFORE)

    def add_inputs(self) -> list[int]:
        out = []
        for k, v in enumerate(self.g.inputs):
            shape = self.g.values[v].shape
            if self.late():   # only the replicated layout: no time left to enumerate them all
                self.late_ops += 1
                hit = ((Strategy("R", (), (replicated(len(shape)),), 1),),
                       self.intern((replicated(len(shape)),)))
            else:
                key = ("input", shape)
                hit = self.memo.get(key)
                if hit is None:
                    strategies = rules.input_choices(shape, self.mesh)
                    hit = self.memo[key] = (strategies,
                                            self.intern(tuple(s.outs[0] for s in strategies)))
            grp = self.new_group(-1 - k, hit[0])
            grp.shard[v] = hit[1]
            self.gv[v] = grp.id
            out.append(grp.id)
        for v in self.g.consts:
            self.whole(v, -1000 - v)
        return out

    def whole(self, v: int, leader: int) -> None:
        """A value with one layout, replicated: a closed-over constant, a literal scan operand."""
        layout = replicated(len(self.g.values[v].shape))
        grp = self.new_group(leader, (Strategy("R", (), (layout,)),))
        grp.shard[v] = self.intern((layout,))
        self.gv[v] = grp.id

    def walk(self, ops: Sequence[Op], mult: float) -> None:
        for op in ops:
            if op.prim == "scan" and op.regions:
                self.walk_scan(op, mult)
            else:
                self.add_op(op, mult)

    def rule(self, op: Op, key) -> Choices | Follow:
        """The op's rule, memoised under its key without the fusion role (rules read the op's
        structure only: ops that differ in how many kernels read them share it)."""
        rule_key = None if key is None else key[0]
        hit = self.rule_memo.get(rule_key) if rule_key is not None else None
        if hit is not None:
            return hit
        if op.regions:  # while / cond: opaque, replicated
            found = rules.fallback_rule(op, self.ctx, rules.OPAQUE)
        elif self.late():
            self.late_ops += 1   # the time limit has passed: no more strategies to enumerate
            return rules.fallback_rule(op, self.ctx, rules.LATE)
        else:
            found = rules.rule_for(op, self.ctx)
        if rule_key is not None:
            self.rule_memo[rule_key] = found
        return found

    def add_op(self, op: Op, mult: float) -> None:
        w = self.weight.get(op.id)
        if w:
            mult = mult * (1 + w)
        key = self.op_key(op)
        rule = self.rule(op, key)
        if isinstance(rule, Follow) and op.ins[rule.operand] in self.gv:
            grp, pl = self.follow(op, op.ins[rule.operand], rule.derive, mult, key=key)
            self.link_inputs(op, grp, pl, rule.operand, mult)
        else:
            choices = rule if isinstance(rule, Choices) else rules.fallback_rule(op, self.ctx)
            memo_key = (("decide", key[1]) if isinstance(rule, Choices) and key is not None
                        else None)
            pl = self.planned(op, choices.strategies, memo_key)
            grp = self.new_group(op.id, pl.per_i, op, mult, pl)
            self.link_inputs(op, grp, pl, None, mult)
        self.gop[op.id] = grp.id

    def walk_scan(self, op: Op, mult: float) -> None:
        body = op.regions[0]
        nc, ncarry = op.param("num_consts", 0), op.param("num_carry", 0)
        trip = float(op.trip_count)
        for k, (outer, inner) in enumerate(zip(op.ins, body.inputs)):
            if outer in self.ctx.literals or outer not in self.gv:
                self.whole(inner, -2000 - inner)
                continue
            derive = (_alias_drop0(self.ctx, outer) if k >= nc + ncarry else _alias_same)
            self.follow(_alias_op(op, outer, inner), outer, derive, mult, (inner,))
        self.walk(body.ops, mult * trip)
        for k in range(ncarry):  # loop-carried: carry-out must come back as carry-in
            cin, cout = body.inputs[nc + k], body.outputs[k]
            if cout in self.gv and cin in self.gv:
                need = self.groups[self.gv[cin]].shard[cin]
                self.add_edge(self.gv[cout], self.gv[cin], cout, need, mult * trip,
                              f"op{op.id}:carry{k}", op.id)
        for k, (inner, outer) in enumerate(zip(body.outputs, op.outs)):
            # a carry leaves the loop in its carry-in layout (the carry edge above moves it there)
            if k < ncarry and body.inputs[nc + k] in self.gv:
                inner = body.inputs[nc + k]
            if inner not in self.gv:
                continue
            derive = _alias_same if k < ncarry else _alias_add0
            self.follow(_alias_op(op, inner, outer), inner, derive, mult, (outer,))
        self.gop[op.id] = self.gv.get(op.outs[0], -1) if op.outs else -1


def _kernel_bytes(graph: Graph, fusion: Fusion) -> dict[int, float]:
    """Root op id -> bytes its whole kernel reads and writes, unsharded (what the kernel floor
    of a CPU profile, ``Hardware.launch_s``, is judged by)."""
    members: dict[int, list[int]] = {}
    for op_id, k in fusion.kernel_of.items():
        members.setdefault(k, []).append(op_id)
    return {r: fusion.hbm_bytes(graph, members.get(fusion.kernel_of.get(r), [r]))
            for r in fusion.roots}


def kernel_io(fusion: Fusion, op: Op) -> tuple[tuple, tuple, tuple]:
    """(reads, writes, copies) of ``op``'s kernel (``ir.fusion``) as positions: ``((operand,
    times read), ...)``, result positions written, ``((operand, times copied), ...)``. A
    producer duplicated into many kernels (``ir.fusion`` copies an unrolled model's residual
    adds into every later layer's kernels) reads its operand once per kernel; counting keeps
    pricing it linear in its operands, not in its kernels."""
    i = op.id
    reads, writes, copies = fusion.reads.get(i), fusion.writes.get(i), fusion.copies.get(i)
    return (_counted(op.ins, reads) if reads else (),
            tuple(op.outs.index(v) for v in writes) if writes else (),
            _counted(op.ins, copies) if copies else ())


def _counted(ins: tuple, vs) -> tuple:
    """``((operand position, times), ...)`` of the values ``vs`` among the operands ``ins``."""
    if len(vs) == 1:
        return ((ins.index(vs[0]), 1),)
    times: dict[int, int] = {}
    for v in vs:
        k = ins.index(v)
        times[k] = times.get(k, 0) + 1
    return tuple(times.items())


_HOST_MOVES = (("Host",), ("Device",))


def op_hbm_bytes(graph: Graph, fusion, mesh: Mapping[str, int], op: Op, st: Strategy,
                 io: tuple | None = None) -> float:
    """Per-device bytes ``op`` reads and writes for its kernel under ``st``: operands from memory
    in the layouts ``st`` needs, materialized results in its layouts, layout copies twice. A loop
    or branch op (run replicated) counts its bodies' kernels whole. ``io``: ``kernel_io`` of the
    op, when the caller prices it under several strategies."""
    if op.regions:
        inner = [o.id for o in walk_ops(r.ops for r in op.regions)]
        return fusion.hbm_bytes(graph, inner + [op.id])
    reads, writes, copies = kernel_io(fusion, op) if io is None else io

    def per_device(v: int, layout: Sharding | None) -> float:
        return graph.values[v].nbytes / (shard_factor(layout, mesh) if layout else 1)

    total = 0.0
    for (k, times), weight in [(r, 1) for r in reads] + [(c, 2) for c in copies]:
        total += weight * times * per_device(op.ins[k], st.ins[k] if k < len(st.ins) else None)
    for k in writes:
        total += per_device(op.outs[k], st.outs[k])
    return total


def _layout_in(st: Strategy, k: int) -> Sharding | None:
    return st.ins[k] if k < len(st.ins) else None


def _elements(graph: Graph, mesh: Mapping[str, int], v: int, layout: Sharding | None) -> float:
    """Elements of value ``v`` one device holds in ``layout``."""
    val = graph.values[v]
    return math.prod(val.shape) / (shard_factor(layout, mesh) if layout else 1)


def conv_features(graph: Graph, mesh: Mapping[str, int], op: Op, st: Strategy) -> float:
    """The width of convolution ``op`` on one device under ``st``, what ``conv_min_features``
    prices: the geometric mean of its input features per feature group (the kernel's
    input-feature dim, or the input's feature dim over the groups, whichever the layouts leave
    smaller) and the output features it computes (the kernel's output-feature dim), each divided
    by the mesh axes its layout splits that dim over. The output features are read off the
    kernel, not the result's layout: a strategy that reduce-scatters a partial result onto the
    feature dim (``|RS`` on it) computes every output feature of its kernel shard and splits
    only the sum afterwards, as fast as the all-reduce strategy with the same operands.
    ``profile()`` fits the rule on convolutions with as many channels in as out; the mean
    carries it to others (XLA:CPU runs a 3-in, 1-out convolution 3-7x slower per FLOP than a
    3-in, 8-out one, and 8-in, 2-out ~30x slower than 8-in, 16-out). The convolutions of a
    conv's gradient name other dims features (the kernel gradient's input features are the
    batch) and are priced by their own dimension numbers."""
    lhs_spec, rhs_spec, _ = op.param("dimension_numbers")
    groups = op.param("feature_group_count", 1) or 1

    def local(v: int, layout: Sharding | None, dim: int) -> float:
        size = graph.values[v].shape[dim]
        return size / (math.prod(mesh[a] for a in layout[dim]) if layout else 1)

    lhs, rhs = _layout_in(st, 0), _layout_in(st, 1)
    fin = min(local(op.ins[0], lhs, lhs_spec[1]) / groups, local(op.ins[1], rhs, rhs_spec[1]))
    return math.sqrt(fin * local(op.ins[1], rhs, rhs_spec[0]))


def pool_gradient_bytes(graph: Graph, mesh: Mapping[str, int], op: Op, st: Strategy) -> float:
    """Per-device bytes XLA:CPU's expansion of a ``select_and_scatter_add`` reads and writes,
    as its ``cost_analysis`` counts them (checked on 2x2 pools of rank-4 operands: 68 bytes per
    float32 operand element). With ``n`` operand and ``m`` source elements per device, rank
    ``r`` and item size ``b``: the ``r`` s32 iotas written (``4rn``); the argmax reduce-window
    reading the operand and the iotas and writing a value and ``r`` indices per window
    (``bn + 4rn + bm + 4rm``); the indices concatenated (``8rm``); the source copied to the
    scatter's update shape (``2bm``); the zero fill (``bn``); the scatter reading the zeros,
    indices and updates and writing the result (``2bn + 4rm + bm``)."""
    source, operand = op.ins[0], op.ins[1]
    n = _elements(graph, mesh, operand, _layout_in(st, 1))
    m = _elements(graph, mesh, source, _layout_in(st, 0))
    r = len(graph.values[operand].shape)
    b = graph.values[operand].itemsize
    return n * (8 * r + 4 * b) + m * (4 * b + 16 * r)


def _alias_op(op: Op, src: int, dst: int) -> Op:
    return Op(id=op.id, prim="alias", ins=(src,), outs=(dst,))


def _alias_same(s: Sharding) -> Strategy:
    return Strategy("alias", (s,), (s,))


def _alias_drop0(ctx: RuleContext, outer: int):
    """A scanned-over operand: the body sees one slice, so its loop axis must be whole."""

    def derive(s: Sharding) -> Strategy:
        keep = ((),) + s[1:]
        comms = ()
        if s[0]:
            comms = (rules.Comm("all-gather", ctx.per_device_bytes(outer, keep), s[0]),)
        return Strategy("slice0", (s,), (s[1:],), 1, comms)

    return derive


def _alias_add0(s: Sharding) -> Strategy:
    return Strategy("stack0", (s,), (((),) + s,))


def output_pairs(graph: Graph) -> dict[int, int]:
    """Outputs that replace an input (same pytree path, shape and dtype): new params for old.

    Paths are matched whole (``(state, batch) -> (state, loss)``: ``[0]['w']`` for ``[0]['w']``),
    then, for the outputs left, without their leading position, where that names one input
    left of the same type: a step that returns its new parameters alone (``['w']`` for
    ``[0]['w']``) or in another position (``(loss, params)``) carries them all the same.
    Computed once per graph (``GraphFacts``)."""
    return facts(graph).output_pairs


def _output_pairs(graph: Graph) -> dict[int, int]:
    by_path = {p: k for k, p in enumerate(graph.input_paths)}
    pairs = {}
    for j, p in enumerate(graph.output_paths):
        k = by_path.get(p)
        if k is not None and graph.values[graph.inputs[k]] == graph.values[graph.outputs[j]]:
            pairs[j] = k
    taken = set(pairs.values())
    loose: dict[tuple, list[int]] = {}
    for k, p in enumerate(graph.input_paths):
        if k not in taken:
            loose.setdefault((_unplaced(p), graph.values[graph.inputs[k]]), []).append(k)
    for j, p in enumerate(graph.output_paths):
        if j in pairs:
            continue
        ks = loose.get((_unplaced(p), graph.values[graph.outputs[j]]), [])
        if len(ks) == 1 and _unplaced(p):
            pairs[j] = ks.pop()
    return pairs


def _unplaced(path: str) -> str:
    """A pytree path without its leading positional index: ``[0]['w']`` -> ``['w']``."""
    return path[path.index("]") + 1:] if path.startswith("[") and path[1:2].isdigit() else path


# Host-to-device link that feeds each step's batch: PCIe Gen5 x16, ~64 GB/s per direction (PCI-SIG
# 5.0 spec, as on H100 SXM hosts), for every profile.
HOST_LINK_BYTES_PER_S = 64e9


def _feed_costs(graph: Graph, b: _Builder, input_group: list[int], pairs: Mapping[int, int]):
    """Inputs that are not carried state (the batch) arrive from the host every step: each
    device pays for the bytes it receives, so a replicated batch is not free."""
    state = set(pairs.values())
    # one figure for every profile, kept apart from ``Hardware.host_bytes_per_s`` (host offload's
    # link): on CPU devices that is a copy within memory, 65x slower, and pricing the fed batch
    # at it would change every CPU plan the verify matrix measured (not re-measured yet)
    bw = HOST_LINK_BYTES_PER_S
    for k, v in enumerate(graph.inputs):
        if k in state:
            continue
        grp = b.groups[input_group[k]]
        t = graph.values[v]
        grp.comm_s += np.array([t.nbytes / shard_factor(s, b.mesh) / bw for s in grp.shard[v]])


def _ties(graph: Graph, b: _Builder) -> dict[int, int]:
    """Groups led by ops or inputs of equal structural role (``ir.layers.roles``) with the same
    strategies share the ILP variables of the first such group: layer ``k``'s q projection, its
    kernel, the kernel's Adam moments and their update decide as layer 0's do."""
    role = layer_roles(graph)
    n_in = len(graph.inputs)
    first: dict[tuple, int] = {}
    ties: dict[int, int] = {}
    for grp in b.groups:
        if grp.leader >= 0:
            r = role.op.get(grp.leader)
        else:
            k = -1 - grp.leader
            r = role.input[k] if k < n_in else None
        if r is None:
            continue
        root = first.setdefault((grp.leader >= 0, r, id(grp.strategies)), grp.id)
        if root != grp.id:
            ties[grp.id] = root
    return ties


def _memory_points(graph: Graph, n_points: int, schedule, phantoms=()) -> list[list[int]]:
    """Live temporaries at the ``n_points`` schedule positions with most live bytes.

    XLA allocates a step's arguments and results for the whole execution (``_resident``) and
    its temporaries from one pool, whose size is the peak of the temporaries live at once. Only
    values a kernel writes to memory are temporaries (``ir.fusion``: what XLA fuses away never
    exists). A loop's body runs inside its op: the values live at the body's own peak join the
    live set at the loop's position (carries and stacked results are the loop op's values).
    ``schedule``: ``(temporaries(...), body_peaks(...))``."""
    intervals, inner = schedule
    # one difference array for all intervals, not a slice addition each: byte counts are
    # integers far below 2**53, so the prefix sums are the exact totals the slices added up to
    n = len(graph.ops) + 1
    vs = np.array([v for v, _, _ in intervals], dtype=np.int64)
    starts = np.array([a for _, a, _ in intervals], dtype=np.int64)
    ends = np.array([b for _, _, b in intervals], dtype=np.int64)
    sizes = np.array([graph.values[v].nbytes for v in vs.tolist()], dtype=np.float64)
    delta = np.zeros(n + 1)
    np.add.at(delta, starts, sizes)
    np.add.at(delta, ends + 1, -sizes)
    live_bytes = np.cumsum(delta[:n])
    for t, (_, nbytes) in inner.items():
        live_bytes[t] += nbytes
    for v, a, b, copies in phantoms:      # a folded graph's removed copies, live across the gap
        live_bytes[a: b + 1] += copies * graph.values[v].nbytes
    points = np.argsort(-live_bytes, kind="stable")[:n_points]
    return [vs[(starts <= t) & (t <= ends)].tolist() + inner.get(t, ([], 0))[0]
            + phantoms_at(phantoms, t) for t in sorted(points)]


def phantoms_at(phantoms, t: int) -> list[int]:
    """The ``phantoms`` live at position ``t``, each value once per removed copy (the memory
    check points and ``memory.cut_at`` count them as live values)."""
    return [v for v, a, b, copies in phantoms if a <= t <= b for _ in range(copies)]


def _intervals(ops: Sequence[Op], keep, fusion: Fusion) -> list[tuple[int, int, int]]:
    """(value, producer position, last reader position) of each result of ``ops`` ``keep``s
    (a producer duplicated into several kernels reads its operands where the last of them
    runs, ``Fusion.duplicated``), then of each broadcast buffer the ops read
    (``Fusion.broadcasts``, sized as its value)."""
    pos, last = {}, {}
    at = {op.id: t for t, op in enumerate(ops)}
    for t, op in enumerate(ops):
        for v in op.outs:
            if keep(v):
                pos[v] = t
        copies = fusion.duplicated.get(op.id)
        run = max(at[k] for k in copies) if copies else t   # a copy reads where its kernel runs
        for v in op.ins:
            last[v] = max(last.get(v, run), run)
    spans = [(v, a, last.get(v, a)) for v, a in pos.items()]
    for v, readers in fusion.broadcasts:
        if readers[0] in at:
            where = [at[i] for i in readers]
            spans.append((v, min(where), max(where)))
    return spans


def schedule_of(graph: Graph, fusion: Fusion) -> tuple:
    """``(temporaries, body_peaks)`` of ``graph`` under its ``fusion`` (``GraphFacts``: read
    only, the memory model and the memory points only read it)."""
    return facts(graph).schedule(fusion)


def facts(graph: Graph) -> GraphFacts:
    """The planner's facts about ``graph``, kept with its analyses (``ir.analyses``)."""
    return graph.analyses.attached(GraphFacts)


class GraphFacts:
    """What the planner computes about one graph, independent of any plan, and reuses across
    its plans (``autopar.compare`` plans a graph once per strategy): one per graph, made by
    ``graph.analyses.attached`` (``ir`` cannot hold the planner's slots itself). A fact made
    under a fusion (``_Builder``'s may differ from the graph's own) is kept beside that fusion
    and made again under another."""

    def __init__(self, graph: Graph):
        self._graph = graph
        self._schedule: tuple[Fusion, tuple] | None = None
        self._kernel_bytes: tuple[Fusion, dict[int, float]] | None = None

    @functools.cached_property
    def output_pairs(self) -> dict[int, int]:
        """``output_pairs``: output index -> the input index it replaces."""
        return _output_pairs(self._graph)

    @functools.cached_property
    def inlined(self):
        """The step's jaxpr with every jit call inlined (a retrace: half a second on a 7B
        model), which offload's candidates and the unrolled layers' recomputation both read."""
        return flat(self._graph.jaxpr, inline=is_call)

    @functools.cached_property
    def offload_groups(self) -> tuple:
        """(``inlined``, ``ir.offload.find_groups`` of it): ``planner.offload``'s candidates."""
        return self.inlined, find_groups(self.inlined, self.output_pairs)

    def schedule(self, fusion: Fusion) -> tuple:
        """``(temporaries, body_peaks)`` under ``fusion``."""
        hit = self._schedule
        if hit is None or hit[0] is not fusion:
            g = self._graph
            hit = self._schedule = (fusion, (temporaries(g, fusion), body_peaks(g, fusion)))
        return hit[1]

    def kernel_bytes(self, fusion: Fusion) -> dict[int, float]:
        """``_kernel_bytes`` under ``fusion``."""
        hit = self._kernel_bytes
        if hit is None or hit[0] is not fusion:
            hit = self._kernel_bytes = (fusion, _kernel_bytes(self._graph, fusion))
        return hit[1]


def temporaries(graph: Graph, fusion: Fusion) -> list[tuple[int, int, int]]:
    """(value, first, last top-level position) of each temporary a kernel writes: not an
    argument or result, not a folded constant."""
    resident = set(graph.inputs) | set(graph.outputs) | graph.host
    return _intervals(graph.ops, lambda v: v in fusion.materialized and v not in resident
                      and v not in fusion.constants, fusion)


def body_peaks(graph: Graph, fusion: Fusion) -> dict[int, tuple[list[int], float]]:
    """Top-level position of each loop or branch op -> its bodies' peak (``_body_peak``)."""
    return {t: _body_peak(graph, op, fusion) for t, op in enumerate(graph.ops) if op.regions}


def _resident(graph: Graph, pairs: Mapping[int, int], folded: Folded | None = None
              ) -> list[int]:
    """Values held for the whole step: arguments, constants and results, except a result that
    lands in a donated argument's buffer (XLA aliases the two). A folded graph's inputs and
    results appear once more for each removed twin they stand for."""
    aliased = {graph.outputs[j] for j, k in pairs.items() if graph.donated[k]}
    out = dict.fromkeys(list(graph.inputs) + list(graph.consts))
    out.update(dict.fromkeys(v for v in graph.outputs if v not in aliased))
    values = [v for v in out if v not in graph.host]   # host memory is not the device's
    if folded is not None:
        values += [v for v, w in zip(graph.inputs, folded.input_weight) for _ in range(w)]
        values += [v for v, w in zip(graph.outputs, folded.output_weight)
                   if v not in aliased and v not in graph.inputs for _ in range(w)]
    return values


def _body_peak(graph: Graph, op: Op, fusion) -> tuple[list[int], float]:
    """Values live at the peak of ``op``'s largest body (its inputs and outputs are the loop's
    carries and slices, owned by the loop op: not counted again)."""
    best: tuple[list[int], float] = ([], 0.0)
    for region in op.regions:
        ops = region.ops
        intervals = _intervals(ops, lambda v: v in fusion.materialized
                               and v not in region.outputs, fusion)  # noqa: B023 (used at once)
        live = np.zeros(len(ops) + 1)
        for v, a, b in intervals:
            live[a: b + 1] += graph.values[v].nbytes
        for t, o in enumerate(ops):
            if o.regions:
                live[t] += _body_peak(graph, o, fusion)[1]
        if len(ops) and live.max() > best[1]:
            t = int(live.argmax())
            best = ([v for v, a, b in intervals if a <= t <= b], float(live[t]))
    return best


def build(graph: Graph, mesh: Mapping[str, int], cost_model, max_strategies: int = 96,
          memory_points: int = 6, clock=None, host_inputs: bool = True,
          folded: Folded | None = None) -> Problem:
    """The ILP's problem of ``graph`` on ``mesh``; ``host_inputs``: price the bytes of inputs
    that are not carried state as fed from the host every step (``_feed_costs``); ``folded``:
    ``graph`` is ``folded.graph``, whose weighted ops, inputs and outputs also stand for the
    removed layers' (``ir.fold``)."""
    b = _Builder(graph, mesh, cost_model, max_strategies, clock)
    if folded is not None:
        b.weight, b.shared = folded.weight, folded.shared
    input_group = b.add_inputs()
    b.walk(graph.ops, 1.0)
    b.add_pending()
    if b.late_ops:
        clock.note(f"time limit while building the problem: the last {b.late_ops} inputs and "
                   f"ops stay replicated (no sharding strategies enumerated)")
    pairs = output_pairs(graph)
    for j, k in pairs.items():  # donated state: the new value lands in the old one's layout
        v_out, v_in = graph.outputs[j], graph.inputs[k]
        if v_out == v_in or v_out not in b.gv:
            continue
        need = b.groups[input_group[k]].shard[v_in]
        copies = 1 + (folded.output_weight[j] if folded is not None else 0)
        b.add_edge(b.gv[v_out], input_group[k], v_out, need, float(copies),
                   f"output{j}->input{k}")
    if host_inputs:
        _feed_costs(graph, b, input_group, pairs)
    ties = _ties(graph, b)
    schedule = schedule_of(graph, b.fusion)
    gap = _gap(graph, folded) if folded is not None else None
    phantoms = _phantoms(graph, gap, schedule[0])
    prob = Problem(graph, dict(mesh), b.groups, b.edges, b.gv, b.gop, input_group, ties, pairs,
                   _memory_points(graph, memory_points, schedule, phantoms),
                   _resident(graph, pairs, folded), b.reshard, b.fusion, phantoms=phantoms,
                   gap=gap)
    return prob


@dataclasses.dataclass(frozen=True)
class Gap:
    """Where a folded graph's removed copies would run in its schedule: their forward ops
    after position ``fwd_next - 1`` (the representative's last forward op), their backward
    ops before ``bwd_start`` (its first backward op); ``weight`` and ``stage`` as
    ``ir.fold.Folded``'s, ``at`` each top-level op's position."""

    fwd_next: int
    bwd_start: int
    weight: Mapping[int, int]
    stage: Mapping[int, str]
    at: Mapping[int, int]

    def born(self, op_id: int) -> int | None:
        """Where the removed copies of ``op_id``'s results are made: None if not a weighted
        forward or backward op (they are then never live at a kept op, or are its twins')."""
        if not self.in_layer(op_id):
            return None
        return self.fwd_next if self.stage[op_id] == "f" else self.bwd_start

    def in_layer(self, op_id: int) -> bool:
        """Whether ``op_id`` is a weighted forward or backward op of the layer: its removed
        copies run inside the gap."""
        return bool(self.weight.get(op_id)) and self.stage.get(op_id) in ("f", "b")

    def made(self, op_id: int) -> int:
        """Where the removed copies of ``op_id`` make a copy of an argument they read: inside
        the gap for a forward or backward op of the layer (so the copies of an argument that
        only the layer's forward, or only its backward, reads are made and freed inside it,
        never live at a kept op), where the reader itself runs for any other."""
        return self.born(op_id) if self.in_layer(op_id) else self.at[op_id]

    def read(self, op_id: int) -> int:
        """Where the removed copies of a value's reader ``op_id`` read it: inside the gap for a
        forward or backward op of the layer, where the reader itself runs for any other."""
        s = self.stage.get(op_id)
        if s == "f":
            return self.fwd_next - 1
        if s == "b":
            return self.bwd_start - 1
        return self.at[op_id]


def _gap(graph: Graph, folded: Folded) -> Gap | None:
    at = {op.id: t for t, op in enumerate(graph.ops)}
    rep = [i for i in folded.representative if i in at]
    fwd = [at[i] for i in rep if folded.stage[i] == "f"]
    bwd = [at[i] for i in rep if folded.stage[i] == "b"]
    if not fwd or not bwd:
        return None
    return Gap(1 + max(fwd), min(bwd), folded.weight, folded.stage, at)


def _phantoms(graph: Graph, gap: Gap | None, intervals) -> list[tuple[int, int, int, int]]:
    """(value, first, last position, copies) of the removed copies' temporaries that are live
    across the gap in the folded schedule (``Gap``): born where the removed copies run, dead
    where their last reader would run (a producer duplicated into later kernels, ``ir.fusion``,
    reads its operands there). What is born and read inside the gap is never live at a kept
    op: not counted."""
    if gap is None:
        return []
    out = []
    for v, first, last in intervals:   # from its producer (a broadcast buffer: its first
        p = graph.ops[first].id          # reader) to its last reader's kernel
        lo = gap.born(p)
        if lo is None:
            continue
        hi = gap.read(graph.ops[last].id) if last < len(graph.ops) else last
        if lo <= hi:
            out.append((v, lo, hi, gap.weight[p]))
    return out


def flow_pairs(problem: Problem) -> int:
    """How many (source layout, needed layout) pairs the merged edges have: the size of the
    solver's flow model."""
    total = 0
    for e in problem.merged_edges():
        if problem.root(e.src) != problem.root(e.dst):
            total += len(set(problem.groups[e.src].shard[e.value])) * len(set(e.need))
    return total


def restrict(problem: Problem, candidates: Mapping[int, Sequence[int]]) -> Problem:
    """The same problem, for the solver, with each root group (and the groups tied to it) down
    to the strategy indices ``candidates[root]``, in that order; a solution's index ``j`` of
    root ``r`` is ``candidates[r][j]`` of the full problem. Sliced layout tuples are shared
    between tied groups, so their edges still merge."""
    memo: dict = {}

    def pick(seq, idx):
        key = (id(seq), idx)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = tuple(seq[i] for i in idx)
            memo[("keep", key)] = seq
        return hit

    groups = []
    for g in problem.groups:
        idx = tuple(candidates[problem.root(g.id)])
        # members (per-op strategies, for reports) are left out: the solver never reads them
        new = Group(g.id, g.leader, pick(g.strategies, idx), g.compute_s[list(idx)],
                    g.comm_s[list(idx)], g.hbm_bytes[list(idx)],
                    {}, {v: pick(s, idx) for v, s in g.shard.items()},
                    g.mults)
        groups.append(new)
    sets = [[dataclasses.replace(e, need=pick(e.need, tuple(candidates[problem.root(e.dst)])))
             for e in es] for es in problem.merged_edge_sets()]   # the solver sees only these
    small = dataclasses.replace(problem, groups=groups, edges=[e for es in sets for e in es],
                                ties=dict(problem.ties))
    small.memo.edge_sets = small.memo.merged = sets   # already merged
    return small


def value_bytes(problem: Problem, v: int) -> np.ndarray:
    """Per-device bytes of value ``v`` under each strategy of its group (memoised by type and
    layout list: an unrolled model asks for the same few thousands of times)."""
    layouts = problem.groups[problem.group_of_value[v]].shard[v]
    t = problem.graph.values[v]
    memo = problem.memo.value_bytes
    hit = memo.get((t, id(layouts)))
    if hit is None:
        hit = np.array([t.nbytes / shard_factor(s, problem.mesh) for s in layouts])
        memo[(t, id(layouts))] = hit
        memo[("keep", id(layouts))] = layouts   # keeps the id above unique
    return hit
