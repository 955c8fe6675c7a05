"""Build the planning problem from an ``ir.Graph``: decision groups, resharding edges, memory.

Notation (used by ``ilp.py`` too):
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

Regions: a scan body is planned once, not unrolled. Its inputs follow the scan's operands (xs lose
their leading axis), its outputs feed the scan's results (ys gain it), and a loop-carried value
pays an edge from the body's carry-out back to its carry-in, ``trip_count`` times.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from autopar.planner import rules
from autopar.planner.budget import SEARCH_BEFORE
from autopar.planner.reshard import reshard_s
from autopar.planner.rules import Choices, Follow, RuleContext, Strategy
from autopar.sharding import Sharding, replicated, shard_factor
from ir import Graph, Op

_CONTRACTIONS = ("dot_general", "conv_general_dilated")
FUSIBLE = frozenset(rules.ELEMENTWISE) | {
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "iota", "slice",
    "pad", "concatenate", "select_n", "convert_element_type", "rev", "dynamic_slice"}


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
    members: dict[int, list[Strategy]] = dataclasses.field(default_factory=dict)
    shard: dict[int, list[Sharding]] = dataclasses.field(default_factory=dict)  # value -> per i
    mults: dict[int, float] = dataclasses.field(default_factory=dict)  # member op -> multiplier
    self_edges: list[Edge] = dataclasses.field(default_factory=list)   # both ends in this group

    @property
    def n(self) -> int:
        return len(self.strategies)


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
    const_values: list[int]                       # values always live (inputs, consts)
    reshard: ReshardCache
    kernel_sites: list = dataclasses.field(default_factory=list)   # planner.kernel_sites.Site
    kernel_mode: str = "never"                    # PlannerOptions.kernels

    def reshard_s(self, v: int, src: Sharding, dst: Sharding) -> float:
        return self.reshard(self.graph.values[v], src, dst)

    def edge_sets(self) -> list[list[Edge]]:
        """Edges that move the same value from the same group in the same region: XLA reshards
        a value once per layout its readers need (identical reshards are common
        subexpressions), so a set costs each distinct needed layout once."""
        memo = self.__dict__.get("_edge_sets")
        if memo is None:
            by_key: dict[tuple, list[Edge]] = {}
            for e in self.edges:
                by_key.setdefault((e.src, e.value, e.mult), []).append(e)
            memo = self.__dict__["_edge_sets"] = list(by_key.values())
        return memo

    def transition_s(self, choice) -> float:
        """Resharding seconds of the plan ``choice`` (group -> strategy index) on the edges
        between groups, each distinct (value, layout) move counted once (``edge_sets``)."""
        total = 0.0
        for es in self.edge_sets():
            have = self.groups[es[0].src].shard[es[0].value][choice[es[0].src]]
            for need in {e.need[choice[e.dst]] for e in es} - {have}:
                total += es[0].mult * self.reshard_s(es[0].value, have, need)
        return total


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


class _Builder:
    def __init__(self, graph: Graph, mesh: Mapping[str, int], cost_model, max_strategies: int,
                 clock=None):
        self.clock = clock    # planner.budget.Clock: past its search limit, ops run replicated
        self.late_ops = 0
        self.g = graph
        self.mesh = dict(mesh)
        self.cm = cost_model
        lit = frozenset(v for v, _ in graph.literals)
        producers = {v: op.prim for op in graph.all_ops() for v in op.outs}
        self.ctx = RuleContext(graph.values, lit, producers, self.mesh, max_strategies, clock)
        self.groups: list[Group] = []
        self.edges: list[Edge] = []
        self.gv: dict[int, int] = {}
        self.gop: dict[int, int] = {}
        self.reshard = ReshardCache(cost_model, mesh)

    # -- groups -----------------------------------------------------------------------------
    def new_group(self, leader: int, strategies: Sequence[Strategy], op: Op | None,
                  mult: float) -> Group:
        n = len(strategies)
        grp = Group(len(self.groups), leader, tuple(strategies), np.zeros(n), np.zeros(n))
        self.groups.append(grp)
        outs = op.outs if op is not None else ()
        grp.members[leader] = list(strategies)
        grp.mults[leader] = mult
        for k, v in enumerate(outs):
            grp.shard[v] = [s.outs[k] for s in strategies]
            self.gv[v] = grp.id
        if op is not None:
            self.add_costs(grp, op, list(strategies), mult)
        return grp

    def compute_dtype(self, op: Op) -> str:
        """A contraction runs at its inputs' rate (bf16 x bf16 accumulating in f32 is a bf16
        matmul); other ops at their result's."""
        v = op.ins[0] if op.prim in _CONTRACTIONS and op.ins else (op.outs[0] if op.outs else None)
        return self.g.values[v].dtype if v is not None else "float32"

    def add_costs(self, grp: Group, op: Op, per_i: list[Strategy], mult: float) -> None:
        dtype = self.compute_dtype(op)
        # XLA fuses elementwise and layout ops into a neighbouring kernel: they pay their memory
        # traffic but no launch of their own.
        fused = self.cm.hw.kernel_launch_s if op.prim in FUSIBLE else 0.0
        for i, st in enumerate(per_i):
            if op.flops or op.bytes_accessed:
                t = self.cm.op_time_s(op, st.compute_div, dtype=dtype)
                grp.compute_s[i] += mult * max(t - fused, 0.0)
            for c in st.comms:
                grp.comm_s[i] += mult * self.cm.collective_time_s(c.kind, c.nbytes, c.axes)

    def follow(self, op: Op, operand_value: int, derive, mult: float,
               out_values: Sequence[int] | None = None) -> Group:
        grp = self.groups[self.gv[operand_value]]
        per_i = [derive(s) for s in grp.shard[operand_value]]
        if op.prim != "alias":
            grp.members[op.id] = per_i
            grp.mults[op.id] = mult
        self.add_costs(grp, op, per_i, mult)
        outs = op.outs if out_values is None else out_values
        for k, v in enumerate(outs):
            grp.shard[v] = [st.outs[k] for st in per_i]
            self.gv[v] = grp.id
        return grp

    def link_inputs(self, op: Op, grp: Group, per_i: Sequence[Strategy], skip: int | None,
                    mult: float) -> None:
        """Edges for every non-literal input the op reads, except the one it follows."""
        for k, v in enumerate(op.ins):
            if k == skip or v in self.ctx.literals or v not in self.gv:
                continue
            need = tuple(st.ins[k] if k < len(st.ins) and st.ins[k] is not None
                         else replicated(len(self.g.values[v].shape)) for st in per_i)
            self.add_edge(self.gv[v], grp.id, v, need, mult, f"op{op.id}:arg{k}", op.id)

    def add_edge(self, src: int, dst: int, v: int, need: tuple[Sharding, ...], mult: float,
                 where: str, op: int = -1) -> None:
        if src == dst:  # both ends decided by one variable: a per-strategy cost
            grp = self.groups[src]
            if any(e.value == v and e.need == need and e.mult == mult for e in grp.self_edges):
                return   # the same move again: XLA computes it once
            have = grp.shard[v]
            for i in range(grp.n):
                grp.comm_s[i] += mult * self.reshard(self.g.values[v], have[i], need[i])
            grp.self_edges.append(Edge(src, dst, v, need, mult, where, op))
            return
        self.edges.append(Edge(src, dst, v, need, mult, where, op))

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
                choices = (Strategy("R", (), (replicated(len(shape)),), 1),)
            else:
                choices = rules.input_choices(shape, self.mesh)
            grp = self.new_group(-1 - k, choices, None, 1.0)
            grp.shard[v] = [s.outs[0] for s in grp.strategies]
            self.gv[v] = grp.id
            out.append(grp.id)
        for v in self.g.consts:
            self.whole(v, -1000 - v)
        return out

    def whole(self, v: int, leader: int) -> None:
        """A value with one layout, replicated: a closed-over constant, a literal scan operand."""
        layout = replicated(len(self.g.values[v].shape))
        grp = self.new_group(leader, (Strategy("R", (), (layout,)),), None, 1.0)
        grp.shard[v] = [layout]
        self.gv[v] = grp.id

    def walk(self, ops: Sequence[Op], mult: float) -> None:
        for op in ops:
            if op.prim == "scan" and op.regions:
                self.walk_scan(op, mult)
            else:
                self.add_op(op, mult)

    def add_op(self, op: Op, mult: float) -> None:
        if op.regions:  # while / cond: opaque, replicated
            rule = rules.fallback_rule(op, self.ctx)
        elif self.late():
            self.late_ops += 1   # the time limit has passed: no more strategies to enumerate
            rule = rules.fallback_rule(op, self.ctx)
        else:
            rule = rules.rule_for(op, self.ctx)
        if isinstance(rule, Follow) and op.ins[rule.operand] in self.gv:
            grp = self.follow(op, op.ins[rule.operand], rule.derive, mult)
            self.link_inputs(op, grp, grp.members[op.id], rule.operand, mult)
        else:
            choices = rule if isinstance(rule, Choices) else rules.fallback_rule(op, self.ctx)
            grp = self.new_group(op.id, choices.strategies, op, mult)
            self.link_inputs(op, grp, list(choices.strategies), None, mult)
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
                need = tuple(self.groups[self.gv[cin]].shard[cin])
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


def _output_pairs(graph: Graph) -> dict[int, int]:
    """Outputs that replace an input (same pytree path, shape and dtype): new params for old."""
    by_path = {p: k for k, p in enumerate(graph.input_paths)}
    pairs = {}
    for j, p in enumerate(graph.output_paths):
        k = by_path.get(p)
        if k is not None and graph.values[graph.inputs[k]] == graph.values[graph.outputs[j]]:
            pairs[j] = k
    return pairs


# Host-to-device link that feeds each step's batch: PCIe Gen5 x16, ~64 GB/s per direction (PCI-SIG
# 5.0 spec, as on H100 SXM hosts), for every profile.
HOST_LINK_BYTES_PER_S = 64e9


def _feed_costs(graph: Graph, b: _Builder, input_group: list[int], pairs: Mapping[int, int]):
    """Inputs that are not carried state (the batch) arrive from the host every step: each
    device pays for the bytes it receives, so a replicated batch is not free."""
    state = set(pairs.values())
    bw = HOST_LINK_BYTES_PER_S   # hardware profiles do not carry a host link yet
    for k, v in enumerate(graph.inputs):
        if k in state:
            continue
        grp = b.groups[input_group[k]]
        t = graph.values[v]
        grp.comm_s += np.array([t.nbytes / shard_factor(s, b.mesh) / bw for s in grp.shard[v]])


def _ties(graph: Graph, b: _Builder) -> dict[int, int]:
    """Groups of structurally equal layers share the ILP variables of the first such layer."""
    ties: dict[int, int] = {}
    first: dict[str, tuple[int, ...]] = {}
    for layer in graph.layers:
        if layer.kind != "unrolled":
            continue
        ref = first.setdefault(layer.signature, layer.op_ids)
        if ref is layer.op_ids or len(ref) != len(layer.op_ids):
            continue
        for a, r in zip(layer.op_ids, ref):
            ga, gr = b.gop.get(a), b.gop.get(r)
            if ga is None or gr is None or ga == gr or ga < 0 or gr < 0:
                continue
            A, R = b.groups[ga], b.groups[gr]
            if A.leader == a and R.leader == r and [s.name for s in A.strategies] == [
                    s.name for s in R.strategies]:
                ties[ga] = gr
        # inputs read by the layer's decision ops: tie parameters too
    return ties


def _memory_points(graph: Graph, pairs: Mapping[int, int], n_points: int) -> list[list[int]]:
    """Live intermediate values at the ``n_points`` schedule positions with most live bytes."""
    ops = graph.ops
    pos = {}
    last_use: dict[int, int] = {}
    for t, op in enumerate(ops):
        for v in op.outs:
            pos[v] = t
        for v in op.ins:
            last_use[v] = t
    replaced = {graph.outputs[j] for j in pairs}
    for v in graph.outputs:
        if v not in replaced:
            last_use[v] = len(ops)
    intervals = [(v, pos[v], last_use.get(v, pos[v])) for v in pos]
    live_bytes = np.zeros(len(ops) + 1)
    for v, a, b in intervals:
        live_bytes[a: b + 1] += graph.values[v].nbytes
    points = np.argsort(-live_bytes, kind="stable")[:n_points]
    return [[v for v, a, b in intervals if a <= t <= b] for t in sorted(points)]


def build(graph: Graph, mesh: Mapping[str, int], cost_model, max_strategies: int = 96,
          memory_points: int = 6, clock=None) -> Problem:
    b = _Builder(graph, mesh, cost_model, max_strategies, clock)
    input_group = b.add_inputs()
    b.walk(graph.ops, 1.0)
    if b.late_ops:
        clock.note(f"time limit while building the problem: the last {b.late_ops} inputs and "
                   f"ops stay replicated (no sharding strategies enumerated)")
    pairs = _output_pairs(graph)
    for j, k in pairs.items():  # donated state: the new value lands in the old one's layout
        v_out, v_in = graph.outputs[j], graph.inputs[k]
        if v_out == v_in or v_out not in b.gv:
            continue
        need = tuple(b.groups[input_group[k]].shard[v_in])
        b.add_edge(b.gv[v_out], input_group[k], v_out, need, 1.0, f"output{j}->input{k}")
    _feed_costs(graph, b, input_group, pairs)
    ties = _ties(graph, b)
    return Problem(graph, dict(mesh), b.groups, b.edges, b.gv, b.gop, input_group, ties, pairs,
                   _memory_points(graph, pairs, memory_points),
                   list(graph.inputs) + list(graph.consts), b.reshard)


def value_bytes(problem: Problem, v: int) -> np.ndarray:
    """Per-device bytes of value ``v`` under each strategy of its group."""
    grp = problem.groups[problem.group_of_value[v]]
    t = problem.graph.values[v]
    return np.array([t.nbytes / shard_factor(s, problem.mesh) for s in grp.shard[v]])
