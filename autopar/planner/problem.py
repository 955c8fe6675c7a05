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
from cost_models.compute import MATMUL_PRIMS
from ir import Graph, Op
from ir.fusion import Fusion, fuse

_CONTRACTIONS = ("dot_general", "conv_general_dilated")

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
        self.fusion = fuse(graph)

    # -- groups -----------------------------------------------------------------------------
    def new_group(self, leader: int, strategies: Sequence[Strategy], op: Op | None,
                  mult: float) -> Group:
        n = len(strategies)
        grp = Group(len(self.groups), leader, tuple(strategies), np.zeros(n), np.zeros(n),
                    np.zeros(n))
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
        """Each strategy's compute (a roofline of the op's FLOPs and the bytes its kernel moves
        for it, ``ir.fusion``; the kernel's launch on its last op) and collectives."""
        dtype = self.compute_dtype(op)
        launch = 0.0 if op.id in self.fusion.roots else self.cm.hw.kernel_launch_s
        matmul = op.prim in MATMUL_PRIMS
        for i, st in enumerate(per_i):
            nbytes = self.fused_bytes(op, st)
            if op.flops or nbytes:
                t = self.cm.compute_time_s(op.flops / st.compute_div, nbytes, dtype, matmul)
                grp.compute_s[i] += mult * max(t - launch, 0.0)
                grp.hbm_bytes[i] += mult * nbytes
            for c in st.comms:
                grp.comm_s[i] += mult * self.cm.collective_time_s(c.kind, c.nbytes, c.axes)

    def fused_bytes(self, op: Op, st: Strategy) -> float:
        if op.prim == "alias":       # a loop's carry or slice seen from its body: no kernel
            return 0.0
        return op_hbm_bytes(self.g, self.fusion, self.mesh, op, st)

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


def op_hbm_bytes(graph: Graph, fusion, mesh: Mapping[str, int], op: Op, st: Strategy) -> float:
    """Per-device bytes ``op`` reads and writes for its kernel under ``st``: operands from memory
    in the layouts ``st`` needs, materialized results in its layouts, layout copies twice. A loop
    or branch op (run replicated) counts its bodies' kernels whole."""
    if op.regions:
        inner = [o.id for r in op.regions for o in _walk(r.ops)]
        return fusion.hbm_bytes(graph, inner + [op.id])

    def per_device(v: int, layout: Sharding | None) -> float:
        return graph.values[v].nbytes / (shard_factor(layout, mesh) if layout else 1)

    total = 0.0
    for v in fusion.reads.get(op.id, ()) + 2 * fusion.copies.get(op.id, ()):
        k = op.ins.index(v)
        total += per_device(v, st.ins[k] if k < len(st.ins) else None)
    for v in fusion.writes.get(op.id, ()):
        total += per_device(v, st.outs[op.outs.index(v)])
    return total


def _walk(ops):
    for op in ops:
        yield op
        for r in op.regions:
            yield from _walk(r.ops)


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


def _memory_points(graph: Graph, n_points: int, fusion) -> list[list[int]]:
    """Live temporaries at the ``n_points`` schedule positions with most live bytes.

    XLA allocates a step's arguments and results for the whole execution (``_resident``) and
    its temporaries from one pool, whose size is the peak of the temporaries live at once. Only
    values a kernel writes to memory are temporaries (``ir.fusion``: what XLA fuses away never
    exists). A loop's body runs inside its op: the values live at the body's own peak join the
    live set at the loop's position (carries and stacked results are the loop op's values)."""
    ops = graph.ops
    resident = set(graph.inputs) | set(graph.outputs)
    pos, last_use = {}, {}
    for t, op in enumerate(ops):
        for v in op.outs:
            if v in fusion.materialized and v not in resident and v not in fusion.constants:
                pos[v] = t
        for v in op.ins:
            last_use[v] = t
    intervals = [(v, pos[v], last_use.get(v, pos[v])) for v in pos]
    live_bytes = np.zeros(len(ops) + 1)
    for v, a, b in intervals:
        live_bytes[a: b + 1] += graph.values[v].nbytes
    inner = {t: _body_peak(graph, op, fusion) for t, op in enumerate(ops) if op.regions}
    for t, (_, nbytes) in inner.items():
        live_bytes[t] += nbytes
    points = np.argsort(-live_bytes, kind="stable")[:n_points]
    return [[v for v, a, b in intervals if a <= t <= b] + inner.get(t, ([], 0))[0]
            for t in sorted(points)]


def _resident(graph: Graph, pairs: Mapping[int, int]) -> list[int]:
    """Values held for the whole step: arguments, constants and results, except a result that
    lands in a donated argument's buffer (XLA aliases the two)."""
    aliased = {graph.outputs[j] for j, k in pairs.items() if graph.donated[k]}
    out = dict.fromkeys(list(graph.inputs) + list(graph.consts))
    out.update(dict.fromkeys(v for v in graph.outputs if v not in aliased))
    return list(out)


def _body_peak(graph: Graph, op: Op, fusion) -> tuple[list[int], float]:
    """Values live at the peak of ``op``'s largest body (its inputs and outputs are the loop's
    carries and slices, owned by the loop op: not counted again)."""
    best: tuple[list[int], float] = ([], 0.0)
    for region in op.regions:
        ops = region.ops
        pos, last = {}, {}
        for t, o in enumerate(ops):
            for v in o.outs:
                if v in fusion.materialized and v not in region.outputs:
                    pos[v] = t
            for v in o.ins:
                last[v] = t
        live = np.zeros(len(ops) + 1)
        for v, a in pos.items():
            live[a: last.get(v, a) + 1] += graph.values[v].nbytes
        for t, o in enumerate(ops):
            if o.regions:
                live[t] += _body_peak(graph, o, fusion)[1]
        if len(ops) and live.max() > best[1]:
            t = int(live.argmax())
            best = ([v for v, a in pos.items() if a <= t <= last.get(v, a)], float(live[t]))
    return best


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
                   _memory_points(graph, memory_points, b.fusion), _resident(graph, pairs),
                   b.reshard, b.fusion)


def value_bytes(problem: Problem, v: int) -> np.ndarray:
    """Per-device bytes of value ``v`` under each strategy of its group."""
    grp = problem.groups[problem.group_of_value[v]]
    t = problem.graph.values[v]
    return np.array([t.nbytes / shard_factor(s, problem.mesh) for s in grp.shard[v]])
