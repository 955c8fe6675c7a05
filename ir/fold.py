"""Fold the middle copies of an unrolled model's repeated layer out of its graph.

An unrolled model's graph repeats one block (a layer's forward and backward ops, ``ir.layers``)
``n`` times. Every copy does the same work under the same decisions (the planner ties equal
roles), so a planner needs only a few of them: ``fold`` keeps the first ``KEEP_HEAD`` copies and
the last, and removes the ``n - KEEP_HEAD - 1`` copies between, with everything that only they
used (their parameters, optimizer state, optimizer updates and results). The kept copy before
the gap, the *representative*, stands for the removed ones: each of its ops carries a
``weight``, the number of removed ops it copies, and so does each kept op or input whose
structural twin (``ir.layers.roles``) was removed. Of the kept twins of a role, the one next to
the representative is taken: for a removed parameter, the one the representative reads in its
place; for a removed optimizer op, the kept op of its primitive and types that reads what
stands for its operands (the first layer's update is of the same role, yet reads a parameter
the plan may lay out otherwise).

    full:    ... f0 f1 f2 f3 ... f94 f95  loss  b95 b94 ... b3 b2 b1 b0  adam(0..95)
    folded:  ... f0 f1 f2 ---------- f95  loss  b95 ---------- b2 b1 b0  adam(0, 1, 2, 95)

Reads across the gap are spliced: the last copy's forward reads the representative's forward
values where it read copy 94's, and the representative's backward reads the last copy's
backward values where it read copy 3's; the values are of equal type and role.

What carries over exactly (``tests/test_fold.py`` checks it): every op's cost times its weight,
and every resharding between copies, is the full graph's cost for the same decisions, since the
representative's neighbours are tied to it. What is modelled: memory. The removed copies'
values that are live across the gap (activations a forward keeps for its backward, gradients
waiting for the optimizer) are the representative's, times its weight, over the span they
would be live in the folded schedule (``phantoms``); the removed parameters, optimizer state
and results count as their kept twins do.

``autopar.planner.unfold`` maps what a plan decides for the folded graph back onto the full
one with ``Folded.op_of``, ``input_of`` and ``output_of``: each removed op takes its twin's
layouts, each removed input and output its twin's.

A reduction over every layer (global-norm clipping's ``sum(sum(g ** 2) for g in grads)``, a
sum of per-layer auxiliary losses) reads the removed copies too: each removed copy's part of it
(the ``sum(g ** 2)``) is removed with a kept twin as any optimizer op is, and each scalar step
that adds that part to the running total is passed through (``Folded.passed``): the total
reads the kept parts alone. Its value is then not the full graph's, which a plan does not
need: a scalar costs nothing and is laid out replicated.

Not folded (``fold`` returns None): fewer than ``MIN_COPIES`` copies, a family whose copies
hold loops, or one whose removed ops or inputs have no kept twin.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping

from ir.graph import Graph, Layer, Op
from ir.layers import Roles, node_graph
from ir.layers import roles as layer_roles

# Copies kept at the front (the last of them represents the removed ones) and the fewest copies
# worth folding: with 3 kept in front and the last, 8 copies lose half their ops.
KEEP_HEAD = 3
MIN_COPIES = 8


@dataclasses.dataclass(frozen=True)
class Folded:
    """A folded graph and how it maps onto the full one (see the module docstring).

    Attributes:
      graph: the folded graph (the full graph's kept ops and values, same ids).
      full: the graph it was folded from.
      weight: folded op id -> the removed ops it stands for (ops absent: 0).
      input_weight: per folded input, the removed inputs it stands for.
      output_weight: per folded output, the removed outputs it stands for.
      op_of: removed full op id -> the folded op it copies.
      input_of: per full input, its index among the folded graph's inputs (its twin's).
      output_of: per full output, its index among the folded graph's outputs (its twin's).
      representative: the representative copy's op ids.
      stage: kept copy's op id -> "f" (a forward op: the removed copies' run after the
        representative's), "b" (a backward op: theirs run before the representative's) or "o"
        (an optimizer update, run in the parameters' pytree order).
      shared: (kept op id, operand index) where every removed op the kept op stands for reads
        the same value as it does (one value, moved once for all its readers).
      passed: removed full op ids outside the family that fold passed through: scalar steps
        of a reduction over every layer (``_through``), which stand for nothing and get no
        layout (a scalar's is replicated).
      copies / removed: the family's copies, and how many were removed.
    """

    graph: Graph
    full: Graph
    weight: Mapping[int, int]
    input_weight: tuple[int, ...]
    output_weight: tuple[int, ...]
    op_of: Mapping[int, int]
    input_of: tuple[int, ...]
    output_of: tuple[int, ...]
    representative: tuple[int, ...]
    stage: Mapping[int, str]
    shared: frozenset[tuple[int, int]]
    passed: tuple[int, ...]
    copies: int
    removed: int


def fold(graph: Graph, keep_head: int = KEEP_HEAD, min_copies: int = MIN_COPIES
         ) -> Folded | None:
    """``graph`` with the middle copies of its largest repeated layer family removed, or None
    when there is nothing safe to remove (see the module docstring). The default fold is
    computed once per graph (``Graph.analyses``), as its fusion and roles are: every plan of
    one graph plans the same folded graph and reuses the analyses of it."""
    if (keep_head, min_copies) != (KEEP_HEAD, MIN_COPIES):
        return _fold(graph, keep_head, min_copies)
    return graph.analyses.fold


def _fold(graph: Graph, keep_head: int, min_copies: int) -> Folded | None:
    family = largest_family(graph)
    n = len(family)
    if n < max(min_copies, keep_head + 2):
        return None
    ops_by = graph.analyses.op_index
    rep, last = keep_head - 1, n - 1
    removed = range(keep_head, last)
    stages = _stages(family, rep, last)
    if stages is None:
        return None
    # a copy's forward and backward ops go with it; its optimizer updates ("o") are cut by
    # the parameters' pytree order, where a unit may start a parameter early (a vocabulary
    # as wide as the MLP makes the embedding's update look like a layer's last kernel's), so
    # they are dropped as any update that reads a removed gradient, and twinned by what they
    # read (``_twins``)
    gone = {i for j in removed for p, i in enumerate(family[j].op_ids) if stages[p] != "o"}
    if any(ops_by[i].regions for i in gone):
        return None
    copy_of, pos_of = {}, {}
    for j, layer in enumerate(family):
        for p, i in enumerate(layer.op_ids):
            if stages[p] != "o":
                copy_of[i], pos_of[i] = j, p
    made = {v: (i, k) for i in gone for k, v in enumerate(ops_by[i].outs)}
    gone_vals = {v for i in gone for v in ops_by[i].outs}

    def splice(v: int, reader: int) -> int:
        """The kept value of equal role across the gap: the representative's for a later
        copy (forward flow), the last copy's for an earlier one (backward flow)."""
        i, k = made[v]
        to = last if reader < copy_of[i] else rep
        return ops_by[family[to].op_ids[pos_of[i]]].outs[k]

    kept, dropped, passed = _splice(graph, gone, gone_vals, copy_of, splice)
    kept, dead = _dead_code(graph, kept)
    dropped += dead
    roles = layer_roles(graph)
    weight = Counter({i: len(removed) for i in family[rep].op_ids if i in pos_of})
    op_of = {i: family[rep].op_ids[pos_of[i]] for i in gone}
    read = _read(graph, kept)
    role_of = {v: roles.input[k] for k, v in enumerate(graph.inputs)}
    value_of: dict[int, int] = {}      # removed value -> the kept value that stands for it
    for op in graph.ops:               # a removed layer's parameters: the representative's
        t = op_of.get(op.id)
        if t is not None:
            _stand_in(op.ins, ops_by[t].ins, role_of, read, value_of)
    for i, t in op_of.items():
        value_of.update(zip(ops_by[i].outs, ops_by[t].outs))
    twins = _twins(graph, kept, dropped, roles, role_of, value_of, read, copy_of)
    if twins is None:
        return None
    for i, t in twins.items():
        weight[t] += 1
        op_of[i] = t
    # reads where every op a kept op stands for reads the kept op's very value (an attention
    # mask, a learning rate): one value, resharded once for all of them, not once per copy
    same: Counter = Counter()
    for i, t in op_of.items():
        for k, (v, w) in enumerate(zip(ops_by[i].ins, ops_by[t].ins)):
            if v == w:
                same[t, k] += 1
    shared = frozenset(key for key, n in same.items() if n == weight[key[0]])
    ids = {op.id for op in kept}
    folded, input_of, input_weight, output_of, output_weight = _rebuild(graph, kept, ids, roles,
                                                                        read, value_of)
    if folded is None:
        return None
    stage = {i: stages[p] for j, layer in enumerate(family) if j not in removed
             for p, i in enumerate(layer.op_ids) if i in ids}
    return Folded(folded, graph, dict(weight), input_weight, output_weight, op_of, input_of,
                  output_of, family[rep].op_ids, stage, shared,
                  tuple(op.id for op in passed), n, len(removed))


def largest_family(graph: Graph) -> list[Layer]:
    """The unrolled layers of the signature that covers most ops, in graph order."""
    families: dict[str, list[Layer]] = {}
    for layer in graph.layers:
        if layer.kind == "unrolled":
            families.setdefault(layer.signature, []).append(layer)
    if not families:
        return []
    family = max(families.values(), key=lambda f: len(f) * len(f[0].op_ids))
    return sorted(family, key=lambda layer: layer.op_ids[0])


def _splice(graph: Graph, gone: set[int], gone_vals: set[int], copy_of, splice):
    """(kept ops, with reads across the gap spliced; ops outside the family that read a
    removed value: the removed copies' optimizer updates, dropped with what they make; the
    scalar ops passed through, see ``_through``)."""
    kept: list[Op] = []
    dropped: list[Op] = []
    passed: list[Op] = []
    alias: dict[int, int] = {}
    for op in graph.ops:
        if op.id in gone:
            continue
        if alias and not alias.keys().isdisjoint(op.ins):
            op = dataclasses.replace(op, ins=tuple(alias.get(v, v) for v in op.ins))
        if gone_vals.isdisjoint(op.ins):
            kept.append(op)
            continue
        c = copy_of.get(op.id)
        if c is None:
            through = _through(graph, op, gone_vals)
            if through is not None:
                alias[op.outs[0]] = through
                passed.append(op)
                continue
            dropped.append(op)
            gone_vals.update(op.outs)
            continue
        kept.append(dataclasses.replace(op, ins=tuple(
            splice(v, c) if v in gone_vals else v for v in op.ins)))
    return kept, dropped, passed


def _through(graph: Graph, op: Op, gone_vals: set[int]) -> int | None:
    """The kept operand an op outside the family passes through when it folds a removed
    copy's scalar into a kept one: one step of a reduction over every layer (a global norm's
    ``acc + sum(g_k ** 2)``, a sum of per-layer auxiliary losses). Without the removed copies
    the step is the identity on its kept operand; the op is a scalar's, its cost nothing, its
    layout replicated whatever the plan. None for any other op."""
    if op.regions or len(op.outs) != 1:
        return None
    out = graph.values[op.outs[0]]
    if out.size != 1:
        return None
    for v in op.ins:
        value = graph.values[v]
        if v not in gone_vals and (value.shape, value.dtype) == (out.shape, out.dtype):
            return v
    return None


def _dead_code(graph: Graph, kept: list[Op]) -> tuple[list[Op], list[Op]]:
    """Kept ops whose results nothing kept reads any more (a removed layer's weight decay reads
    its parameter alone) are dropped too."""
    made = {v for op in kept for v in op.outs}
    readers = Counter(v for op in kept for v in op.ins)
    for v in graph.outputs:
        if v in made:
            readers[v] += 1
    dead: list[Op] = []
    alive = set()
    for op in reversed(kept):
        if op.regions or any(readers[v] for v in op.outs):
            alive.add(op.id)
            continue
        dead.append(op)
        for v in op.ins:
            readers[v] -= 1
    return [op for op in kept if op.id in alive], dead


def _stages(family: list[Layer], rep: int, last: int) -> list[str] | None:
    """Per position in a copy: "f" where the copies run in order before the gap's forward
    (the representative's op precedes the last copy's first op), "b" where they run in
    reverse (a backward pass: the copy before the representative runs after it), "o" where
    they run in order after (optimizer updates, in the parameters' pytree order). None when
    the copies are not ordered so."""
    first_of_last = min(family[last].op_ids)
    out = []
    for mine, before in zip(family[rep].op_ids, family[rep - 1].op_ids):
        if before > mine:
            out.append("b")
        elif mine < first_of_last:
            out.append("f")
        else:
            out.append("o")
    return out if "f" in out and "b" in out else None


def _read(graph: Graph, kept: list[Op]) -> set[int]:
    """The values the kept ops (and their bodies) read, and the graph's results."""
    read = {v for op in kept for v in op.ins} | set(graph.outputs)
    for op in kept:
        for region in op.regions:
            read.update(v for o in region.ops for v in o.ins)
    return read


def _stand_in(ins, twin_ins, role_of: Mapping[int, int], read: set[int],
              value_of: dict[int, int]) -> None:
    """Each removed input among ``ins`` (one no kept op reads) that stands for nothing yet
    stands for the kept input of its role that ``twin_ins``, the operands of the kept op
    standing for the reader, have in its place."""
    for v, w in zip(ins, twin_ins):
        if v in role_of and v not in read and v not in value_of and w in read and \
                role_of.get(w) == role_of[v]:
            value_of[v] = w


def _twins(graph: Graph, kept: list[Op], dropped: list[Op], roles: Roles,
           role_of: Mapping[int, int], value_of: dict[int, int], read: set[int],
           family: Mapping[int, int]) -> dict[int, int] | None:
    """Dropped op id -> the kept op that stands for it (None when one has none), matched by
    what they read, from what is known to stand for what (``value_of``: the representative's
    value for a removed copy's): a dropped op whose operand stands as a kept value twins the
    kept op of its primitive, parameters and types reading that value there, and its results
    then stand as the twin's; the producer of a twinned op's operand twins the producer of the
    twin's operand; a removed input read where the twin reads a kept input of its role (a
    removed layer's optimizer state) stands as that input. What is left twins the first kept
    op of its role. Matching by reads gives each removed layer's update the representative's,
    which costs as it does under any plan; another op of the role may not (the first layer's
    weight decay reads a parameter the plan may lay out otherwise). Twins by reads are sought
    among the kept ops outside the ``family`` copies (the optimizer's), by role among all."""
    ops_by = {op.id: op for op in kept}
    codes = node_graph(graph)[0]       # structural labels: primitive, params, types, literals
    first_op = len(graph.inputs) + len(graph.consts)
    labels = {op.id: int(codes[first_op + j]) for j, op in enumerate(graph.ops)}

    def label(o: Op) -> int:
        return labels[o.id]

    readers: dict[tuple[int, int], list[int]] = {}
    maker: dict[int, int] = {}
    first: dict[int, int] = {}
    for op in kept:
        first.setdefault(roles.op[op.id], op.id)
        if op.id in family:
            continue
        for m, v in enumerate(op.ins):
            readers.setdefault((v, m), []).append(op.id)
        for v in op.outs:
            maker[v] = op.id
    made_by = {v: op for op in dropped for v in op.outs}
    out: dict[int, int] = {}

    def pair(op: Op, t: int) -> None:
        out[op.id] = t
        twin = ops_by[t]
        for v, w in zip(op.outs, twin.outs):
            value_of[v] = w
        _stand_in(op.ins, twin.ins, role_of, read, value_of)

    def by_reads(op: Op) -> int | None:
        mine = labels[op.id]
        for m, v in enumerate(op.ins):
            w = value_of.get(v)
            if w is not None:
                for r in readers.get((w, m), ()):
                    if labels[r] == mine:
                        return r
        return None

    left = sorted(dropped, key=lambda o: o.id)
    newly = []
    while left:
        for op in left:                       # in graph order: operands are matched first
            t = by_reads(op)
            if t is not None:
                pair(op, t)
                newly.append(op)
        for op in newly:                      # producers of twinned ops' operands
            for v, w in zip(op.ins, ops_by[out[op.id]].ins):
                p, q = made_by.get(v), maker.get(w)
                if p is not None and q is not None and p.id not in out and \
                        label(p) == label(ops_by[q]):
                    pair(p, q)
                    newly.append(p)
        if not newly:
            break
        newly = []
        left = [op for op in left if op.id not in out]
    for op in left:
        t = first.get(roles.op[op.id])
        if t is None:
            return None
        pair(op, t)
    return out


def _rebuild(graph: Graph, kept: list[Op], ids: set[int], roles: Roles, read: set[int],
             value_of: Mapping[int, int]):
    """The folded Graph over ``kept``, with each removed input and output mapped to a kept
    twin: (graph, input_of, input_weight, output_of, output_weight), or Nones when some has
    none. A removed input's or result's twin is its stand-in (``value_of``: the input the
    representative reads in its place, the result of the op that stands for its producer),
    else the first kept one of its role."""
    made = {v: op.id for op in kept for v in op.outs}
    keep_in = [k for k, v in enumerate(graph.inputs) if v in read]
    in_index = {k: j for j, k in enumerate(keep_in)}
    in_twin: dict[int, int] = {}
    for k in keep_in:
        in_twin.setdefault(roles.input[k], in_index[k])
    position = {v: k for k, v in enumerate(graph.inputs)}
    input_of, in_weight = [], Counter()
    for k, v in enumerate(graph.inputs):
        j = in_index[position[value_of[v]]] if v in value_of else in_index.get(
            k, in_twin.get(roles.input[k]))
        if j is None:
            return None, None, None, None, None
        input_of.append(j)
        if k not in in_index:
            in_weight[j] += 1
    kept_inputs = {graph.inputs[k] for k in keep_in}
    keep_out = [j for j, v in enumerate(graph.outputs) if v in made or v in kept_inputs]
    out_index = {j: i for i, j in enumerate(keep_out)}

    def out_role(j: int):
        v = graph.outputs[j]
        producer = graph.producer(v)
        if producer is not None:
            return ("op", roles.op[producer.id])
        return ("input", roles.input[graph.inputs.index(v)]) if v in graph.inputs else None

    out_twin: dict = {}
    for j in keep_out:
        out_twin.setdefault(out_role(j), out_index[j])
    kept_out = {graph.outputs[j]: out_index[j] for j in keep_out}
    output_of, out_weight = [], Counter()
    for j, v in enumerate(graph.outputs):
        i = out_index.get(j)
        if i is None:
            i = kept_out.get(value_of.get(v), out_twin.get(out_role(j)))
        if i is None:
            return None, None, None, None, None
        output_of.append(i)
        if j not in out_index:
            out_weight[i] += 1
    layers = tuple(dataclasses.replace(layer, index=i) for i, layer in enumerate(
        layer for layer in graph.layers if ids.issuperset(layer.op_ids)))
    folded = dataclasses.replace(
        graph, ops=tuple(kept), inputs=tuple(graph.inputs[k] for k in keep_in),
        outputs=tuple(graph.outputs[j] for j in keep_out),
        input_paths=tuple(graph.input_paths[k] for k in keep_in),
        output_paths=tuple(graph.output_paths[j] for j in keep_out),
        donated=tuple(graph.donated[k] for k in keep_in), layers=layers)
    # the full graph's roles: the folded graph's own would tell the representative from its
    # neighbours (the splice changes who reads whom), and ties must be the full graph's
    folded.analyses.carry(roles=Roles({op.id: roles.op[op.id] for op in kept},
                                      tuple(roles.input[k] for k in keep_in)))
    return (folded, tuple(input_of), tuple(in_weight[j] for j in range(len(keep_in))),
            tuple(output_of), tuple(out_weight[i] for i in range(len(keep_out))))
