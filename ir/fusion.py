"""Which ops XLA fuses into one kernel, and so which values ever reach device memory.

XLA runs a training step as a few hundred kernels, not one per primitive: elementwise and layout
ops are fused into the kernel that consumes them, reductions absorb their elementwise inputs, and
only a kernel's results that another kernel reads (or the step returns) are written to memory.
The HBM traffic of a step is therefore the bytes its kernels read from and write to memory, and
its temporaries are those written values; ``fuse`` models both.

Rules (``fuse``), applied within each top-level op list and separately within each loop body:

  * a *fusible producer* (``FUSIBLE``: elementwise, broadcast, reshape, transpose, convert,
    slices, concatenate, pad, iota, select, gather) joins the kernel of its consumers when they
    all belong to one kernel; when they belong to several it is duplicated into each of them,
    unless it is ``EXPENSIVE`` (transcendental or a division), which XLA does not recompute, or
    its copies would read more than it writes and one of its readers is reached from it through
    an unfusible op or a reduction (``_Kernels.kept_whole``: XLA's "fuse on all paths" test,
    approximated; a pre-norm residual add, read by its layer norm's statistics and the centred
    value, is the case): then it is a kernel of its own whose result is written. A producer with
    at most one full operand (``_Kernels.at_most_unary``, XLA's "effectively at most unary":
    broadcasts, iotas, constants and operands of lower rank do not count; a layer norm's
    ``x - mean`` is one) is always duplicated, into the backward pass's kernels too, which then
    read its operands: they stay in memory until the last copy runs (``Fusion.duplicated``);
  * *fusing consumers* are fusible ops and reductions (``ABSORBING``); contractions,
    convolutions, scatters, sorts, loops and collectives take their operands from memory and
    write their results;
  * reductions run on XLA:CPU as library (YNNPACK) fusions that take elementwise producers but
    not broadcasts: a broadcast feeding a reduction's kernel is written to memory, whether it is
    explicit (``broadcast_in_dim``, a kernel of its own) or implicit (an elementwise operand with
    a size-1 dim where the result's is larger). XLA's CSE gives all readers of one operand
    broadcast to one shape a single buffer, alive from the first reader to the last, often from
    the forward pass into the backward (``Fusion.broadcasts``; implicit ones count in memory
    only, not yet in ``hbm_bytes``);
  * constant values (ops on literals only) are folded away by XLA: they cost nothing;
  * a contraction whose operand's dims are not in the order XLA's dot emitter takes (batch dims
    first, then free then contracting dims for the left operand, contracting then free for the
    right; a 2-D operand may be either way round) gets a layout copy of that operand, a kernel
    that reads and writes it (``copies``), unless the operand's only reader is this contraction
    and its producer is a fused kernel that can write it in that order.

A value is *materialized* when a kernel other than its producer's reads it, or the graph
returns it. A kernel reads each materialized (or graph input) value it uses once. ``Fusion``
attributes every read to the first op of the kernel that reads it and every write to the op that
produces it, so per-op bytes add up to the kernel's bytes; the kernel's launch is attributed to
its last op (``roots``).

Measured against XLA:CPU's ``cost_analysis()["bytes accessed"]`` by ``autopar.verify`` (the
rules are a model of XLA's instruction fusion, not a copy of it: multi-output fusion and
backend-specific fusions are not modelled).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence

from ir.graph import Graph, Op

FUSIBLE = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "exp", "exp2", "log", "log1p",
    "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "abs", "sign", "integer_pow", "square",
    "select_n", "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "is_finite", "stop_gradient", "add_any", "erf", "erfc", "erf_inv", "sin", "cos",
    "tan", "atan2", "floor", "ceil", "round", "clamp", "nextafter", "copy", "copy_p", "real",
    "imag", "reduce_precision", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "conj", "broadcast_in_dim", "reshape", "transpose", "squeeze",
    "expand_dims", "iota", "slice", "pad", "concatenate", "rev", "dynamic_slice", "gather",
    "bitcast_convert_type", "clz",
})
EXPENSIVE = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt",
                       "rsqrt", "cbrt", "erf", "erfc", "erf_inv", "sin", "cos", "tan", "atan2",
                       "div", "rem", "pow", "gather"})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "reduce_xor", "argmax", "argmin"})
ABSORBING = FUSIBLE | REDUCTIONS
ELEMENTWISE = FUSIBLE - {"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
                         "iota", "slice", "pad", "concatenate", "rev", "dynamic_slice", "gather"}
# Ops XLA folds when every input is constant (the tracer's ``ir.flops.fold`` folds the same).
_FOLDS = FUSIBLE - {"gather", "dynamic_slice"}


@dataclasses.dataclass(frozen=True)
class Fusion:
    """Kernels of a graph (every op, nested ones too, has a kernel id).

    Attributes:
      kernel_of: op id -> kernel id (ops of one kernel run as one launch).
      reads: op id -> value ids the op reads from memory for its kernel.
      writes: op id -> value ids the op writes to memory (its materialized results).
      roots: op ids that launch their kernel (the last op of each kernel).
      constants: value ids XLA folds to constants (never read or written).
      copies: op id -> operand value ids copied into another layout before the op runs (one
        more kernel each, reading and writing the operand).
      broadcasts: (value, op ids) per broadcast buffer XLA:CPU writes
        (``_Kernels.broadcast_buffers``): the ops that read one operand broadcast to their
        result's shape; ``value`` is the result of the first of them that runs in a reduction's
        kernel (preferably as its own op, not a duplicate), so it has the buffer's shape and the
        layout that kernel reads it in.
      duplicated: op id -> the kernels (ids) a duplicated producer is recomputed in; its
        operands are read where those kernels run, and so live until the last of them.
    """

    kernel_of: Mapping[int, int]
    reads: Mapping[int, tuple[int, ...]]
    writes: Mapping[int, tuple[int, ...]]
    roots: frozenset[int]
    constants: frozenset[int]
    copies: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    broadcasts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    duplicated: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def materialized(self) -> frozenset[int]:
        """Every value some kernel writes (computed once: the memory schedule asks per value)."""
        return frozenset(v for vs in self.writes.values() for v in vs)

    def kernels(self) -> int:
        return len(set(self.kernel_of.values()))

    def hbm_bytes(self, graph: Graph, op_ids: Sequence[int] | None = None) -> float:
        """Bytes read and written by the kernels of ``op_ids`` (default: every op), unsharded."""
        ids = self.kernel_of if op_ids is None else op_ids
        return float(sum(graph.values[v].nbytes for i in ids
                         for v in self.reads.get(i, ()) + self.writes.get(i, ())
                         + 2 * self.copies.get(i, ())))


def _constants(graph: Graph) -> set[int]:
    const = {v for v, _ in graph.literals}
    for op in graph.all_ops():
        if op.prim in _FOLDS and op.ins and all(v in const for v in op.ins):
            const.update(op.outs)
        elif op.prim == "iota":
            const.update(op.outs)
    return const


class _Kernels:
    """Union of ops into kernels within one op list (a region or the top level)."""

    def __init__(self, ops: Sequence[Op], const: set[int], outputs: set[int], values):
        self.ops, self.const, self.outputs, self.values = list(ops), const, outputs, values
        self.by_id = {op.id: op for op in self.ops}
        self.consumers: dict[int, list[Op]] = defaultdict(list)
        for op in self.ops:
            ins = op.ins
            for v in (ins if len(ins) == 1 else set(ins)):
                self.consumers[v].append(op)
        self.kernel = {op.id: op.id for op in self.ops}
        self.producer = {v: op for op in self.ops for v in op.outs}
        self.copies: dict[int, set[int]] = defaultdict(set)  # op id -> kernels it is copied into
        self.level = self.unfusible_levels()
        self.settled: dict[int, int] | None = None   # op id -> kernel id, once fuse() is done

    def find(self, op_id: int) -> int:
        settled = self.settled
        if settled is not None:
            return settled[op_id]
        while self.kernel[op_id] != op_id:
            self.kernel[op_id] = self.kernel[self.kernel[op_id]]
            op_id = self.kernel[op_id]
        return op_id

    def kernels_of(self, op_id: int) -> set[int]:
        """The kernels ``op_id`` runs in: each of its copies', else its own."""
        return self.copies.get(op_id) or {self.find(op_id)}

    def read_elsewhere(self, v: int, kernel_id: int) -> bool:
        """Some kernel other than ``kernel_id`` reads ``v`` (``user_kernels`` less one, without
        building the set)."""
        copies = self.copies
        for u in self.consumers.get(v, ()):
            c = copies.get(u.id)
            if c:
                if len(c) > 1 or kernel_id not in c:
                    return True
            elif self.find(u.id) != kernel_id:
                return True
        return False

    def reduces(self, kernels) -> bool:
        """Some kernel of ``kernels`` (ids of this list's ops) is a reduction's."""
        return any(self.by_id[t].prim in REDUCTIONS for t in kernels)

    def user_kernels(self, v: int) -> set[int]:
        """Kernels that read value ``v`` (a duplicated reader counts as each of its copies)."""
        out: set[int] = set()
        copies = self.copies
        for u in self.consumers.get(v, ()):
            c = copies.get(u.id)
            if c:
                out |= c
            else:
                out.add(self.find(u.id))
        return out

    def fuse(self) -> None:
        for op in reversed(self.ops):
            if op.prim not in FUSIBLE or not self.outputs.isdisjoint(op.outs):
                continue
            outs = op.outs
            users = (self.consumers.get(outs[0], []) if len(outs) == 1
                     else [u for v in outs for u in self.consumers.get(v, ())])
            if not users or any(u.prim not in ABSORBING for u in users):
                continue
            targets = (self.user_kernels(outs[0]) if len(outs) == 1
                       else set().union(*(self.user_kernels(v) for v in outs)))
            if self.kept_for_reduction(op, targets):
                continue
            if len(targets) == 1:
                self.kernel[op.id] = next(iter(targets))
            elif op.prim not in EXPENSIVE and not self.kept_whole(op, users):
                self.copies[op.id] = targets
        # the kernels are final: one look-up per op from here on, not a walk up the union tree
        self.settled = {i: self.find(i) for i in self.kernel}

    def unfusible_levels(self) -> dict[int, int]:
        """Value id -> the most unfusible ops on a path from this op list's inputs to it.
        Reductions count: XLA does not duplicate one (it is expensive) and its result has
        several readers (a mean feeds the centring and the backward pass), so a path through a
        reduction is not one a producer fuses along."""
        level: dict[int, int] = {}
        get = level.get
        for op in self.ops:
            up = 0
            for v in op.ins:
                here = get(v, 0)
                if here > up:
                    up = here
            if op.prim not in FUSIBLE:
                up += 1
            for v in op.outs:
                level[v] = up
        return level

    def kept_whole(self, op: Op, users: list[Op]) -> bool:
        """XLA does not duplicate a producer whose copies would read more than it writes (two
        or more operands that are not scalars, more elements in than out) unless it fuses into
        every consumer on every path; a consumer that also reads a value that went through more
        unfusible ops than the producer (a residual add after the layer it skips) is taken as
        reached through an unfusible path, an approximation of XLA's reachability test. Without
        this rule an unrolled model's residual stream would be re-added in every later layer."""
        arrays = [v for v in dict.fromkeys(op.ins)
                  if v not in self.const and self.values[v].shape]
        out = sum(self.values[v].size for v in op.outs)
        if self.at_most_unary(op) or sum(self.values[v].size for v in arrays) <= out:
            return False
        mine = max(self.level.get(v, 0) for v in op.outs)
        return any(self.level.get(v, 0) > mine for u in users for v in u.ins)

    def at_most_unary(self, op: Op) -> bool:
        """At most one operand is a full array of the result's rank: XLA's "effectively at
        most unary" test, under which a producer is always duplicable. An operand does not count
        when it is a constant, a broadcast or an iota, or has fewer dims larger than one than
        the result (so an implicitly broadcast operand never counts; a layer norm's
        ``x - mean`` has one full operand: its copies read ``x`` and the row statistics)."""
        rank = max((_true_rank(self.values[v].shape) for v in op.outs), default=0)
        full = [v for v in dict.fromkeys(op.ins) if v not in self.const
                and _true_rank(self.values[v].shape) >= rank
                and getattr(self.producer.get(v), "prim", None) not in ("broadcast_in_dim",
                                                                        "iota")]
        return len(full) <= 1

    def kept_for_reduction(self, op: Op, targets: set[int]) -> bool:
        """An expanding broadcast that feeds a reduction's kernel: XLA:CPU runs reductions as
        library (YNNPACK) fusions that take elementwise producers but read a broadcast from
        memory, so the broadcast is a kernel of its own whose result is written."""
        if op.prim != "broadcast_in_dim" or self.values[op.outs[0]].nbytes <= sum(
                self.values[v].nbytes for v in op.ins):
            return False
        return self.reduces(targets)

    def broadcast_buffers(self) -> list[tuple[int, tuple[int, ...]]]:
        """Operands an elementwise op broadcasts implicitly (a dim of size 1 where its result's
        is larger), grouped by (operand, result shape) as XLA's CSE merges the explicit
        broadcasts it makes of them; a group with an op in a reduction's kernel is written to
        memory once and lives from its first reader to its last (``kept_for_reduction``)."""
        groups: dict[tuple, list[Op]] = {}
        for op in self.ops:
            if op.prim not in ELEMENTWISE or not op.outs:
                continue
            shape = self.values[op.outs[0]].shape
            for v in dict.fromkeys(op.ins):
                have = self.values[v].shape
                if have != shape and v not in self.const and len(have) == len(shape) and any(
                        a == 1 < b for a, b in zip(have, shape)):
                    groups.setdefault((v, shape), []).append(op)
        out = []
        for ops in groups.values():
            reducing = sorted((o for o in ops if self.in_reduction(o)),
                              key=lambda o: o.id in self.copies)   # a kernel's own op first
            if reducing:
                out.append((reducing[0].outs[0], tuple(o.id for o in ops)))
        return out

    def in_reduction(self, op: Op) -> bool:
        """Some kernel ``op`` runs in (a duplicated op runs in several) is a reduction's."""
        return self.reduces(self.kernels_of(op.id))

    def members(self) -> dict[int, list[Op]]:
        """kernel id -> its ops in order, duplicated producers included in each copy."""
        out: dict[int, list[Op]] = defaultdict(list)
        for op in self.ops:
            c = self.copies.get(op.id)
            if c:
                for k in c:
                    out[k].append(op)
            else:
                out[self.find(op.id)].append(op)
        return out


def _true_rank(shape: tuple[int, ...]) -> int:
    """Dims larger than one (XLA's ``TrueRank``)."""
    return sum(d > 1 for d in shape)


def _kernel_io(ops: list[Op], kernel_id: int, k: _Kernels, reads: dict, writes: dict) -> None:
    """Reads (first reader pays) and writes of one kernel's ops."""
    inside = {v for op in ops for v in op.outs}
    seen: set[int] = set()
    for op in ops:
        got = []
        for v in op.ins:
            if v in k.const or v in inside or v in seen:
                continue
            seen.add(v)
            got.append(v)
        if got:
            reads.setdefault(op.id, []).extend(got)   # a copied op reads once per kernel
        if op.id in k.copies:
            continue   # a duplicated producer writes nothing: each copy feeds its kernel
        outs = tuple(v for v in op.outs if v not in k.const and (
            v in k.outputs or k.read_elsewhere(v, kernel_id)))
        if outs:
            writes[op.id] = outs


def _canonical(op: Op, side: int, rank: int) -> bool:
    """The operand's dims are in the order XLA's dot emitter takes (see the module docstring)."""
    (lc, rc), (lb, rb) = op.param("dimension_numbers")
    contract, batch = (lc, lb) if side == 0 else (rc, rb)
    free = [d for d in range(rank) if d not in contract and d not in batch]
    order = list(batch) + (free + list(contract) if side == 0 else list(contract) + free)
    return order == list(range(rank)) or (rank == 2 and not batch)


def _layout_copies(op: Op, k: _Kernels, graph_values) -> tuple[int, ...]:
    out = []
    for side, v in enumerate(op.ins[:2]):
        if v in k.const or _canonical(op, side, len(graph_values[v].shape)):
            continue
        producer = k.producer.get(v)
        alone = len(k.consumers.get(v, ())) == 1
        if alone and producer is not None and producer.prim in FUSIBLE | REDUCTIONS:
            continue   # the producer's kernel writes it in the order the dot wants
        out.append(v)
    return tuple(out)


def _fuse_list(ops: Sequence[Op], const: set[int], outputs: set[int], result: dict) -> None:
    k = _Kernels(ops, const, outputs, result["values"])
    k.fuse()
    for kernel_id, members in k.members().items():
        _kernel_io(members, kernel_id, k, result["reads"], result["writes"])
        result["roots"].add(members[-1].id)
    result["broadcasts"].extend(k.broadcast_buffers())
    result["duplicated"].update((i, tuple(sorted(c))) for i, c in k.copies.items())
    for op in ops:
        if op.prim == "dot_general":
            copied = _layout_copies(op, k, result["values"])
            if copied:
                result["copies"][op.id] = copied
    for op in ops:
        result["kernel_of"][op.id] = k.find(op.id)
        for region in op.regions:
            _fuse_list(region.ops, const, set(region.outputs), result)


def fuse(graph: Graph) -> Fusion:
    """The kernels XLA makes of ``graph`` (see the module docstring). Computed once per graph,
    as its roles are: every plan of one graph (``autopar.compare`` plans it once per strategy)
    asks for the same kernels (``Graph.analyses``)."""
    return graph.analyses.fusion


def _fuse(graph: Graph) -> Fusion:
    const = _constants(graph)
    result: dict = {"kernel_of": {}, "reads": {}, "writes": {}, "roots": set(), "copies": {},
                    "values": graph.values, "broadcasts": [], "duplicated": {}}
    _fuse_list(graph.ops, const, set(graph.outputs), result)
    reads = {i: tuple(vs) for i, vs in result["reads"].items()}
    return Fusion(result["kernel_of"], reads, result["writes"],
                  frozenset(result["roots"]), frozenset(const), result["copies"],
                  tuple(result["broadcasts"]), result["duplicated"])
