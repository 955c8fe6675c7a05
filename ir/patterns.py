"""Find where the fused kernels apply in a traced training step, forward and backward.

``find_patterns(graph)`` returns one frozen ``Match`` per occurrence of:

  pattern         inputs (roles)                        outputs (roles)
  attention_fwd   q, k, v [, mask, scale, const]        out
  attention_bwd   dout, q, k, v, saved... [, mask, ...] dq, dk, dv
  norm_fwd        x [, residual], scale [, bias]        y [, h]         (h = x + residual)
  norm_bwd        dy [, dh], x/residual/scale..., saved dx, dscale [, dbias]
  xent_fwd        h, w, targets                         loss            (per token)
  xent_bwd        dloss, h, w, targets, saved...        dh, dw
  adamw           param, grad, mu, nu, bc1, bc2 [, lr]  param, mu, nu

How forward patterns are found (``ir.rules_*``, registered in ``ir.pattern_rules``): each
recogniser starts at an anchor primitive (``exp`` for softmax attention, ``rsqrt`` for norms,
``log`` for log-softmax cross-entropy, ``sqrt`` for Adam) and checks the dataflow around it:
the score matmul, mask and scale before a softmax and the value matmul after it; a norm's
statistics; the LM-head matmul, log-softmax and target pick; the two moment updates around
Adam's square root. The match's ops
are the ancestors of its outputs back to its inputs (``cone``), so everything the kernel
replaces (masks built from iotas, scale constants, parameter reshapes) is included and nothing
that is used elsewhere is, except the inputs.

How backward patterns are found: JAX gives every backward equation the source line, the site
(``Op.site``: the library line inside flax or transformers) and the module path (name stack,
transforms stripped) of the forward equation it differentiates. The
ops that share those keys with a forward match, are not part of any forward match, and are
connected by dataflow to the forward match's values (directly, or through the residuals a
``scan`` passes from its forward to its backward body) form its backward match. The
forward-pass ops that only compute residuals for the backward (``integer_pow`` of a softmax
sum, ``2 x`` of a square) belong to the backward match: a kernel that saves its own residuals
makes them dead.

Matches never share ops. Ops are found at the top level and in every region (a ``scan`` body
is matched once; ``Match.region`` names the region op). This module reads only the graph and
never imports ``autopar``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ir.consteval import Evaluator
from ir.graph import Graph, Op
from ir.layers import module_path  # the name-stack grammar layers already parses

PATTERNS = ("attention_fwd", "attention_bwd", "norm_fwd", "norm_bwd", "xent_fwd", "xent_bwd",
            "adamw")


@dataclasses.dataclass(frozen=True)
class Match:
    """One place a kernel applies.

    Attributes:
      pattern: one of ``PATTERNS``.
      op_ids: the ops the kernel call replaces, in graph order.
      inputs: ``(role, value id)`` of each value the ops read from outside the match.
      outputs: ``(role, value id)`` of each value the ops produce for the rest of the step.
      sources: the distinct user source lines of the ops, in op order.
      region: id of the region op (``scan``...) whose body holds the ops (for a backward match,
        its last op); ``None`` at top level.
      attrs: pattern facts as ``(key, value)`` pairs (``causal``, ``scale``, ``kind``...).
      forward: for a backward match, the index of its forward match in the result tuple.
    """

    pattern: str
    op_ids: tuple[int, ...]
    inputs: tuple[tuple[str, int], ...]
    outputs: tuple[tuple[str, int], ...]
    sources: tuple[str, ...]
    region: int | None = None
    attrs: tuple[tuple[str, Any], ...] = ()
    forward: int | None = None

    def input(self, role: str) -> int:
        return _role(self.inputs, role, self)

    def output(self, role: str) -> int:
        return _role(self.outputs, role, self)

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    def roles(self, which: str = "inputs") -> tuple[str, ...]:
        return tuple(r for r, _ in getattr(self, which))


def _role(pairs, role: str, match: Match) -> int:
    for r, v in pairs:
        if r == role:
            return v
    raise KeyError(f"{match.pattern} match has no role {role!r}; it has "
                   f"{[r for r, _ in pairs]}")


def counts(matches: Iterable[Match]) -> Counter:
    """``Counter`` of pattern names."""
    return Counter(m.pattern for m in matches)


# ---- graph index ------------------------------------------------------------------------------


class Index:
    """Lookups the recognisers share: producers, consumers, scopes, literals, origins."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.literals: Mapping[int, Any] = dict(graph.literals)
        self.producer: dict[int, Op] = {}
        self.consumers: dict[int, list[Op]] = defaultdict(list)
        self.scope: dict[int, int | None] = {}
        self.order: dict[int, int] = {}
        self.ops: list[Op] = []
        self._outer: dict[int, int] = {}      # loop-body input -> the value feeding it
        self._inner: dict[int, int] = {}      # scan output -> the body value it stacks
        self._walk(graph.ops, None)
        self.eval = Evaluator(self.producer, self.literals, self.shape, self.origin)

    def _walk(self, ops: Sequence[Op], region: int | None) -> None:
        for op in ops:
            self.order[op.id] = len(self.ops)
            self.ops.append(op)
            self.scope[op.id] = region
            for v in op.outs:
                self.producer[v] = op
            for v in op.ins:
                self.consumers[v].append(op)
            if op.prim == "scan" and op.regions:
                body = op.regions[0]
                self._outer.update(zip(body.inputs, op.ins))
                self._inner.update(zip(op.outs, body.outputs))
            for r in op.regions:
                self._walk(r.ops, op.id)

    def shape(self, v: int) -> tuple[int, ...]:
        return self.graph.values[v].shape

    def dtype(self, v: int) -> str:
        return self.graph.values[v].dtype

    def lit(self, v: int) -> Any:
        return self.literals.get(v)

    def origin(self, v: int) -> int:
        """The value ``v`` stands for across scan boundaries (a body input's outer value, or a
        stacked scan output's body value), followed to its end."""
        for _ in range(64):
            nxt = self._outer.get(v, self._inner.get(v))
            if nxt is None or nxt == v:
                return v
            v = nxt
        return v

    def key(self, op: Op) -> tuple[str, str, str]:
        return self.keys[op.id]

    @functools.cached_property
    def keys(self) -> dict[int, tuple[str, str, str]]:
        """Op id -> (source line, site, module path): what a backward op shares with its
        forward."""
        paths: dict[str, str] = {}
        return {op.id: (op.source, op.site, paths.setdefault(op.name, module_path(op.name)))
                for op in self.ops}

    @functools.cached_property
    def by_key(self) -> dict[tuple[str, str, str], list[Op]]:
        out: dict[tuple[str, str, str], list[Op]] = defaultdict(list)
        for op in self.ops:
            out[self.keys[op.id]].append(op)
        return out

    def local_producer(self, v: int, op: Op) -> Op | None:
        """The producer of ``v`` if it is in the same region as ``op``."""
        p = self.producer.get(v)
        return p if p is not None and self.scope[p.id] == self.scope[op.id] else None

    def is_param(self, v: int) -> bool:
        """``v`` is (a loop slice of) a graph input: a parameter or state, not an activation."""
        return self.origin(v) in self._graph_inputs

    @functools.cached_property
    def _graph_inputs(self) -> frozenset[int]:
        return frozenset(self.graph.inputs)

    @functools.cached_property
    def returned(self) -> frozenset[int]:
        """Values the graph or a region returns."""
        vals = set(self.graph.outputs)
        for op in self.ops:
            for r in op.regions:
                vals.update(r.outputs)
        return frozenset(vals)


def cone(index: Index, outputs: Iterable[int], stops: Iterable[int], anchor: Op) -> set[int]:
    """Ids of the ops in ``anchor``'s region that ``outputs`` depend on, not looking past
    ``stops`` (the match's inputs)."""
    stop = set(stops)
    seen: set[int] = set()
    todo = [v for v in outputs if v not in stop]
    while todo:
        op = index.local_producer(todo.pop(), anchor)
        if op is None or op.id in seen:
            continue
        seen.add(op.id)
        todo.extend(v for v in op.ins if v not in stop)
    return seen


def externals(index: Index, op_ids: Iterable[int]) -> list[int]:
    """Values the ops read that none of them produces (literals excluded), first use first."""
    ids = set(op_ids)
    out: dict[int, None] = {}
    for i in sorted(ids, key=index.order.__getitem__):
        for v in index.ops[index.order[i]].ins:
            p = index.producer.get(v)
            if (p is None or p.id not in ids) and v not in index.literals:
                out[v] = None
    return list(out)


def produced_outside(index: Index, op_ids: Iterable[int]) -> list[int]:
    """Values the ops produce that something else reads (or a region/graph returns)."""
    ids = set(op_ids)
    returned = index.returned
    out = []
    for i in sorted(ids, key=index.order.__getitem__):
        for v in index.ops[index.order[i]].outs:
            if v in returned or any(c.id not in ids for c in index.consumers.get(v, ())):
                out.append(v)
    return out


# ---- the pass ---------------------------------------------------------------------------------
def find_patterns(graph: Graph) -> tuple[Match, ...]:
    """Every forward pattern, then the backward match of each, in graph order.

    Before/after: for a GPT block, the ops of ``softmax(q k^T / sqrt(d) + mask) v``
    (dot_general, div, iota/ge/select_n mask, reduce_max, sub, exp, reduce_sum, div,
    dot_general, transpose) become one ``attention_fwd`` match with inputs ``q, k, v`` and
    output ``out``; the 4 dot_generals and the softmax/mask/scale transposes of its backward
    become one ``attention_bwd`` match with inputs ``dout, q, k, v, saved...`` and outputs
    ``dq, dk, dv``.
    """
    from ir.pattern_rules import FORWARD_RULES

    index = Index(graph)
    forward: list[Match] = []
    claimed: set[int] = set()
    for op in index.ops:
        rule = FORWARD_RULES.get(op.prim)
        match = rule(index, op) if rule is not None else None
        if match is not None and not claimed.intersection(match.op_ids):
            forward.append(match)
            claimed.update(match.op_ids)
    forward.sort(key=lambda m: index.order[m.op_ids[0]])
    result = list(forward)
    for i, fwd in enumerate(forward):
        if not fwd.pattern.endswith("_fwd"):
            continue                          # the optimizer update has no backward
        bwd = _backward_of(index, fwd, i, claimed)
        if bwd is not None:
            result.append(bwd)
            claimed.update(bwd.op_ids)
    return tuple(result)


def make_match(index: Index, pattern: str, op_ids: Iterable[int], inputs, outputs,
               attrs: Mapping[str, Any] | Sequence[tuple[str, Any]] = (),
               forward: int | None = None) -> Match:
    ids = sorted(set(op_ids), key=index.order.__getitem__)
    sources = tuple(dict.fromkeys(index.ops[index.order[i]].source for i in ids
                                  if index.ops[index.order[i]].source))
    items = tuple(attrs.items()) if isinstance(attrs, Mapping) else tuple(attrs)
    # A backward match may also hold forward-region ops that only compute its residuals; its
    # region is the one its last op (the backward computation) runs in.
    return Match(pattern, tuple(ids), tuple(inputs), tuple(outputs), sources,
                 index.scope[ids[-1]], items, forward)


# ---- backward ---------------------------------------------------------------------------------
def _backward_of(index: Index, fwd: Match, position: int, claimed: set[int]) -> Match | None:
    keys = {index.key(index.ops[index.order[i]]) for i in fwd.op_ids}
    candidates = sorted((op for key in keys for op in index.by_key.get(key, ())
                         if op.id not in claimed and not op.regions),
                        key=lambda op: index.order[op.id])
    before = _ancestors_among(index, fwd, [op for op in candidates
                                           if index.order[op.id] < index.order[fwd.op_ids[-1]]])
    candidates = [op for op in candidates if op.id not in before]
    touched = {v for i in fwd.op_ids for v in index.ops[index.order[i]].outs}
    forward_values = touched | {index.origin(v) for _, v in fwd.inputs} | {v for _, v in
                                                                           fwd.inputs}
    grown = _grow(index, _components(index, candidates), touched)
    chosen = _trim(index, grown, forward_values)
    if not chosen:
        return None
    from ir.pattern_rules import BACKWARD_ROLES

    touched -= {v for i in grown - chosen for v in index.ops[index.order[i]].outs}
    pattern = fwd.pattern.replace("_fwd", "_bwd")
    inputs, outputs = BACKWARD_ROLES[pattern](index, fwd, chosen, touched)
    return make_match(index, pattern, chosen, inputs, outputs, fwd.attrs, forward=position)


def _ancestors_among(index: Index, fwd: Match, early: Sequence[Op]) -> set[int]:
    """The ``early`` ops that the forward match depends on (forward work before or among the
    pattern's ops, e.g. a reshape of q written on the same source line, a mask that the
    backward reads too): never part of its backward."""
    if not early:
        return set()
    floor = min(index.order[op.id] for op in early)
    seen: set[int] = set()
    todo = [v for _, v in fwd.inputs]
    while todo:
        p = index.producer.get(todo.pop())
        if p is None or p.id in seen or index.order[p.id] < floor:
            continue
        seen.add(p.id)
        todo.extend(p.ins)
    return seen & {op.id for op in early}


def _grow(index: Index, components: list[list[int]], touched: set[int]) -> set[int]:
    """Components that read a value of the forward match (or of a component taken before),
    and components that read only what taken ones read (``sum(dy)`` of a bias gradient).
    ``touched`` gains every value produced by a taken component."""
    chosen: set[int] = set()
    read: set[int] = set()
    ins = [[v for i in comp for v in index.ops[index.order[i]].ins if v not in index.literals]
           for comp in components]
    grew = True
    while grew:
        grew = False
        for comp, comp_ins in zip(components, ins):
            if comp[0] in chosen:
                continue
            own = {v for i in comp for v in index.ops[index.order[i]].outs}
            outside = [v for v in comp_ins if v not in own]
            if any(v in touched or index.origin(v) in touched for v in comp_ins) or (
                    chosen and outside and all(v in read for v in outside)):
                chosen.update(comp)
                touched.update(own)
                read.update(comp_ins)
                grew = True
    return chosen


def _trim(index: Index, chosen: set[int], forward: set[int]) -> set[int]:
    """Drops from a backward match what shares its ops' source but is not the backward: the
    constants it reads (the ``-1/N`` cotangent of a mean written on the same line as the
    pattern, a zero fill), which become its inputs, and forward work that only computes the
    step's other results from the pattern's (the mean of its per-token losses)."""
    order = sorted(chosen, key=index.order.__getitem__)
    const: set[int] = set()          # values computed from literals only
    pure: set[int] = set()           # values computed from forward values (and literals) only
    for i in order:
        op = index.ops[index.order[i]]
        ins = [v for v in op.ins if v not in index.literals]
        if all(v in const for v in ins):
            const.update(op.outs)
        elif all(v in pure or v in forward or index.origin(v) in forward for v in ins):
            pure.update(op.outs)
    kept = {i for i in chosen if not const.issuperset(index.ops[index.order[i]].outs)}
    for i in reversed(order):        # forward-only work no kept backward op reads
        op = index.ops[index.order[i]]
        if i in kept and pure.issuperset(op.outs) and not any(
                c.id in kept for v in op.outs for c in index.consumers.get(v, ())):
            kept.discard(i)
    return kept


def _components(index: Index, ops: Sequence[Op]) -> list[list[int]]:
    """Connected components of ``ops`` (producer-consumer edges, also through the residuals a
    scan hands from its forward body to its backward body), each in graph order."""
    parent = {op.id: op.id for op in ops}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for op in ops:
        for v in op.ins:
            for p in (index.producer.get(v), index.producer.get(index.origin(v))):
                if p is not None and p.id in parent:
                    parent[find(p.id)] = find(op.id)
    groups: dict[int, list[int]] = defaultdict(list)
    for op in ops:
        groups[find(op.id)].append(op.id)
    return list(groups.values())


def backward_inputs(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    """``(role, value)`` for a backward match's inputs: the forward's roles where a value is a
    forward input or output, ``saved`` for other forward values, ``const`` for constants,
    ``cotangent`` for the rest (a value shaped like a forward output is its cotangent even if
    it is a constant, as the ``1/N`` of a mean loss is, unless it is all zeros)."""
    from ir.dataflow import is_constant

    out_shapes = {index.shape(v) for _, v in fwd.outputs}

    by_origin = {index.origin(v): r for r, v in fwd.inputs}
    out_roles = {index.origin(v): r for r, v in fwd.outputs}
    roles = []
    for v in externals(index, ops):
        o = index.origin(v)
        if o in by_origin:
            roles.append((by_origin[o], v))
        elif o in out_roles:
            roles.append((out_roles[o], v))
        elif o in touched or v in touched:
            roles.append(("saved", v))
        else:           # a zero fill shaped like an output is no cotangent
            constant = is_constant(index, v) and (index.shape(v) not in out_shapes
                                                  or _all_zero(index, v))
            roles.append(("const" if constant else "cotangent", v))
    return roles


def _all_zero(index: Index, v: int) -> bool:
    try:
        return index.eval.scalar(v) == 0.0
    except (ArithmeticError, IndexError, KeyError, TypeError, ValueError):
        return False


def backward_outputs(index: Index, ops: set[int], name) -> list[tuple[str, int]]:
    """``(role, value)`` for a backward match's outputs: ``residual`` for values a forward
    region hands to the backward one, ``name(v)`` for the rest."""
    last = max(ops, key=index.order.__getitem__)
    region = index.scope[last]
    return [("residual" if index.scope[index.producer[v].id] != region else name(v), v)
            for v in produced_outside(index, ops)]
