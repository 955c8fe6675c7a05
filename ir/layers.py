"""Find repeated blocks ("layers") in a graph by structure, so the planner solves one and reuses it.

Two views of repetition, both found from the graph alone (never from module or parameter names,
so ``h_0``, ``layers_3``, ``block/3``, nnx lists and anonymous Python loops are all the same):

**Blocks** (``Graph.layers``): runs of top-level ops whose labels (primitive, params, types,
literal operands) repeat back to back, as a Python loop's forward pass and its backward pass do,
are cut into equal units; units of one run with equal internal wiring form a family, and each
unit of a later family that reads from exactly one unit of an earlier one joins it, so a
block's forward, backward (and optimizer update, where it is cut alike) form one layer. Two
blocks with equal ``signature`` have equal op sequences and list their op ids in corresponding
order. A ``scan`` op is one layer (``kind="scan"``, ``repeats`` = trip count) with its body ops.

    >>> g = ir.trace(step, state, batch)      # a 4-layer unrolled GPT
    >>> [layer.name for layer in g.layers][:4]
    ['GPT/layer_0', 'GPT/layer_1', 'GPT/layer_2', 'GPT/layer_3']

**Roles** (``roles(graph)``): every top-level op and every graph input gets an integer role. An
op in a block that computes (has a contraction) takes (block signature, position) as its role:
equal in every copy. Every other node (parameters, optimizer state and updates, embedding and
head, layers that differ) gets colour refinement (1-dimensional Weisfeiler-Lehman) on the op
graph, with edges labelled by (output index, operand index) and read both ways, anchored on the
block roles, which never change and so pass no difference between layers on. Layer 7's and
layer 40's q kernel, their Adam moments and their updates end with one role each, and the
number of roles does not grow with depth. Two nodes of one layer that refinement cannot tell
apart share a role too; sharing a decision there only narrows the search, the costs stay exact.

What it misses: repetition that is not back to back (layers interleaved with other work) is not
cut into blocks (refinement still matches their roles where neighbourhoods agree, though the
first and last layers then differ); a unit is at least ``MIN_BLOCK_OPS`` ops.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from ir.graph import Graph, Layer, Op, Region

# At most this many refinement rounds for the ops and inputs outside blocks (optimizer updates,
# parameters, embedding and head); they settle in a few, as the blocks anchor them.
ROLE_ROUNDS = 32
MIN_BLOCK_OPS = 4
_CONTRACTIONS = ("dot_general", "conv_general_dilated")

_TRANSFORM = re.compile(r"^[\w.-]+\((.*)\)$")
_NOT_MODULES = frozenset({"rematted_computation", "checkpoint", "remat", "jit", "pjit", ""})
_U64 = np.uint64


def find_layers(graph: Graph) -> Graph:
    """Returns ``graph`` with ``layers`` filled and each member op's ``layer`` set."""
    layers: list[Layer] = []
    for op in graph.ops:
        if op.prim == "scan":
            layers.append(_scan_layer(graph, len(layers), op))
    for ops in _blocks(graph):
        layers.append(Layer(len(layers), _block_name(ops), tuple(o.id for o in ops),
                            _signature(graph, ops)))
    return _assign(graph, tuple(layers))


# ---- roles: colour refinement ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Roles:
    """Structural roles: ``op[op_id]`` for top-level ops, ``input[k]`` per graph input."""

    op: dict[int, int]
    input: tuple[int, ...]

    @property
    def distinct(self) -> int:
        return len(set(self.op.values()) | set(self.input))


def roles(graph: Graph, max_rounds: int = ROLE_ROUNDS) -> Roles:
    """The structural role of every top-level op and graph input (see the module docstring).
    Computed once per graph at the default rounds (``Graph.analyses``): the planner asks once
    per plan."""
    if max_rounds == ROLE_ROUNDS:
        return graph.analyses.roles
    return _roles(graph, max_rounds)


def _roles(graph: Graph, max_rounds: int) -> Roles:
    labels, src, dst, tag = node_graph(graph)
    first = len(graph.inputs) + len(graph.consts)
    node = {op.id: first + j for j, op in enumerate(graph.ops)}
    fixed = np.full(len(labels), -1, dtype=np.int64)
    for layer in graph.layers:
        if layer.kind == "unrolled" and _computes(graph, layer):
            fixed[[node[i] for i in layer.op_ids]] = _position_colours(layer)
    colour = _refine(labels, src, dst, tag, max_rounds, fixed)
    return Roles({op.id: int(colour[first + j]) for j, op in enumerate(graph.ops)},
                 tuple(int(c) for c in colour[:len(graph.inputs)]))


def _computes(graph: Graph, layer: Layer) -> bool:
    """A block with a contraction is a model layer. Blocks of optimizer updates only (adamw
    applied leaf by leaf in pytree order) may span two layers' leaves, so their positions are no
    role; refinement gives their ops roles from the layers' gradients instead."""
    return any(graph.op(i).prim in _CONTRACTIONS for i in layer.op_ids)


def _position_colours(layer: Layer) -> np.ndarray:
    """Block ops keep (signature, position) as their role: equal in every copy of the block."""
    base = int(layer.signature, 16) & 0x7FFFFFFF_FFFF
    return base * 4096 + np.arange(len(layer.op_ids), dtype=np.int64)


def node_graph(graph: Graph):
    """Nodes (inputs, consts, top-level ops) as initial labels and labelled edges: ``(labels,
    src, dst, tag)`` arrays, ``tag`` = output index * 1024 + operand index. Computed once per
    graph (``Graph.analyses``; ``find_layers`` carries it to the graph it returns: op and value
    ids do not change)."""
    return graph.analyses.node_graph


def _build_node_graph(graph: Graph):
    literals = dict(graph.literals)
    labels: list = [("input", graph.values[v], d) for v, d in zip(graph.inputs, graph.donated)]
    labels += [("const", graph.values[v]) for v in graph.consts]
    producer = {v: (i, 0) for i, v in enumerate(graph.inputs + graph.consts)}
    src, dst, tag = [], [], []
    for op in graph.ops:
        node = len(labels)
        labels.append(_op_label(graph, op, literals))
        for m, v in enumerate(op.ins):
            hit = producer.get(v)
            if hit is not None:
                src.append(hit[0])
                dst.append(node)
                tag.append(hit[1] * 1024 + m)
        for k, v in enumerate(op.outs):
            producer[v] = (node, k)
    dense: dict = {}
    init = np.array([dense.setdefault(x, len(dense)) for x in labels], dtype=_U64)
    return init, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(
        tag, dtype=_U64)


def _op_label(graph: Graph, op: Op, literals: dict) -> tuple:
    types = tuple(graph.values[v] for v in op.ins + op.outs)
    lits = tuple((m, _literal_key(literals[v])) for m, v in enumerate(op.ins) if v in literals)
    body = _signature(graph, tuple(_walk(r.ops for r in op.regions))) if op.regions else ""
    return op.prim, _structural_params(graph, op), types, lits, op.trip_count, body


def _literal_key(value):
    """A literal's value as a label: NaN never equals itself, so an op reading a NaN literal
    (Equinox's attention and layer norm carry them) would get a label of its own in every layer
    and cut the layers' repeat apart; NaNs (alone or in a tuple) are labelled by their repr."""
    if isinstance(value, tuple):
        return tuple(_literal_key(x) for x in value)
    return repr(value) if isinstance(value, float) and value != value else value


def _structural_params(graph: Graph, op: Op) -> tuple:
    """``op.params``, without the position of an indexing slice: ``x[i]`` of a per-layer table
    (HF BERT's ``head_mask[i]``, a stack of per-layer keys or scales), whose every dim is whole
    or one wide, and of its transpose, the ``pad`` that puts row ``i``'s gradient back. Layer
    ``i``'s and layer ``j``'s are the same op at another row: one label, so the layers around
    them are one block and share roles. Their rule and costs read their shapes only
    (``autopar.planner.rules.passthrough_rule``), never the row."""
    if op.prim == "slice":
        strides = op.param("strides")
        shape = graph.values[op.ins[0]].shape
        start, limit = op.param("start_indices"), op.param("limit_indices")
        row = (strides in (None, ()) or all(s == 1 for s in strides)) and all(
            (a, b) == (0, n) or b - a == 1 for a, b, n in zip(start, limit, shape))
        keys = ("start_indices", "limit_indices")
    elif op.prim == "pad":
        shape = graph.values[op.ins[0]].shape
        row = all((lo, hi, mid) == (0, 0, 0) or (n == 1 and mid == 0 and lo >= 0 and hi >= 0)
                  for (lo, hi, mid), n in zip(op.param("padding_config"), shape))
        keys = ("padding_config",)
    else:
        return op.params
    return tuple((k, "row") if k in keys else (k, v) for k, v in op.params) if row else op.params


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash of each element (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def _refine(init: np.ndarray, src: np.ndarray, dst: np.ndarray, tag: np.ndarray,
            rounds: int, fixed: np.ndarray | None = None) -> np.ndarray:
    """Colour refinement; returns dense colours (0..k-1) per node. A node's new colour hashes its
    colour, the multiset of (producer colour, edge tag) and the multiset of (consumer colour,
    edge tag). Nodes with ``fixed >= 0`` keep that colour (anchors: they pass no difference
    between their neighbours on). Stops after ``rounds`` or once the partition stops splitting."""
    free = np.ones(len(init), dtype=bool) if fixed is None else fixed < 0
    colour = _dense(init, fixed, free)
    n_classes = len(np.unique(colour[free]))
    tag_in, tag_out = _mix(tag + _U64(0x51)), _mix(tag + _U64(0xA3))
    for _ in range(rounds):
        with np.errstate(over="ignore"):
            up = np.zeros_like(colour)
            np.add.at(up, dst, _mix(colour[src] * _U64(0x9E3779B97F4A7C15) + tag_in))
            down = np.zeros_like(colour)
            np.add.at(down, src, _mix(colour[dst] * _U64(0xC2B2AE3D27D4EB4F) + tag_out))
            mixed = _mix(colour * _U64(0x165667B19E3779F9) + _mix(up) + _mix(down ^ _U64(7)))
        colour = _dense(mixed, fixed, free)
        n = len(np.unique(colour[free]))
        if n == n_classes:
            break
        n_classes = n
    return colour


def _dense(colour: np.ndarray, fixed: np.ndarray | None, free: np.ndarray) -> np.ndarray:
    """Colours renumbered 0..k-1 (anchors keep theirs, apart from the free ones)."""
    if fixed is not None:
        colour = np.where(free, colour, _mix(fixed.astype(_U64) + _U64(0xF1)))
    _, dense = np.unique(colour, return_inverse=True)
    return dense.astype(_U64)


# ---- blocks: back-to-back repetition --------------------------------------------------------
def _blocks(graph: Graph) -> list[list[Op]]:
    """Repeated blocks in op order; a forward unit and the backward unit that reads it merged."""
    ops = graph.ops
    if len(ops) < 2 * MIN_BLOCK_OPS:
        return []
    # Tokens are the ops' own labels, not their neighbours': the first layer reads the embedding
    # and the others a residual, yet they line up. Wiring is checked per unit afterwards.
    labels = node_graph(graph)[0]
    tokens = labels[len(graph.inputs) + len(graph.consts):].astype(np.int64)
    units = [_units_of(run) for run in _runs(tokens)]
    families = [[[ops[i] for i in unit] for unit in fam] for fam in units]
    families = [f for f in (_consistent(graph, fam) for fam in families) if len(f) > 1]
    return _pair_forward_backward(graph, families)


def _candidate_periods(tokens: np.ndarray, limit: int = 8) -> list[int]:
    """Periods that many tokens recur at: gaps between consecutive occurrences of a token."""
    last: dict[int, int] = {}
    gaps: Counter = Counter()
    for i, t in enumerate(tokens.tolist()):
        j = last.get(t)
        if j is not None and i - j >= MIN_BLOCK_OPS:
            gaps[i - j] += 1
        last[t] = i
    return [p for p, n in gaps.most_common(limit) if n >= MIN_BLOCK_OPS]


def _runs(tokens: np.ndarray) -> list[tuple[int, int, int]]:
    """Non-overlapping tandem repeats ``(start, period, units)``: ``tokens[start:start+p]``
    repeated ``units`` times back to back. The ones covering most ops win; ties go to the
    shorter period (a block, not a pair of blocks)."""
    found = []
    for p in _candidate_periods(tokens):
        same = np.concatenate([[False], tokens[:-p] == tokens[p:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for a, b in zip(edges[::2], edges[1::2]):
            units = (b - a + p) // p
            if units >= 2:
                found.append((units * p, p, int(a), int(units)))
    taken = np.zeros(len(tokens), dtype=bool)
    out = []
    for cover, p, a, units in sorted(found, key=lambda r: (-r[0], r[1], r[2])):
        if not taken[a:a + cover].any():
            taken[a:a + cover] = True
            out.append((a, p, units))
    return sorted(out)


def _units_of(run: tuple[int, int, int]) -> list[range]:
    a, p, units = run
    return [range(a + j * p, a + (j + 1) * p) for j in range(units)]


def _consistent(graph: Graph, units: list[list[Op]]) -> list[list[Op]]:
    """The units that share the most common signature (equal internal wiring)."""
    sigs = [_signature(graph, u) for u in units]
    common, _ = Counter(sigs).most_common(1)[0]
    return [u for u, s in zip(units, sigs) if s == common]


def _pair_forward_backward(graph: Graph, families: list[list[list[Op]]]) -> list[list[Op]]:
    """Each unit of a later family that reads from exactly one unit of an earlier family with as
    many units joins that unit (a block's backward reads its forward's residuals, its optimizer
    update reads its gradients); chains of such joins end in one block."""
    made = {v: (f, u) for f, fam in enumerate(families) for u, unit in enumerate(fam)
            for op in unit for v in op.outs}
    home: dict[tuple[int, int], tuple[int, int]] = {}   # (family, unit) -> where it now lives
    for f, fam in enumerate(families):
        pairs = [_reads_from(unit, made, f) for unit in fam]
        if None in pairs:
            continue
        dest = [home.get(p, p) for p in pairs]
        roots = {d[0] for d in dest}
        if len(roots) != 1 or len({d[1] for d in dest}) != len(fam):
            continue
        root = roots.pop()
        if len(families[root]) != len(fam) or root == f:
            continue
        for j, (unit, (_, u)) in enumerate(zip(fam, dest)):
            families[root][u] = families[root][u] + unit
            home[(f, j)] = (root, u)
    merged = {f for f, _ in home}
    return [unit for f, fam in enumerate(families) if f not in merged for unit in fam]


def _reads_from(unit: list[Op], made: dict, own: int) -> tuple[int, int] | None:
    counts = Counter(made[v] for op in unit for v in op.ins
                     if v in made and made[v][0] != own)
    return counts.most_common(1)[0][0] if counts else None


def module_path(name: str) -> str:
    """``"transpose(jvp(GPT))/jvp(GPT)/rematted_computation/layer_3/mlp"`` ->
    ``"GPT/layer_3/mlp"``: transform wrappers and remat segments dropped, repeats collapsed."""
    path: list[str] = []
    for seg in name.split("/"):
        while (m := _TRANSFORM.match(seg)) is not None:
            seg = m.group(1)
        if seg not in _NOT_MODULES and (not path or path[-1] != seg):
            path.append(seg)
    return "/".join(path)


def _block_name(ops: Sequence[Op]) -> str:
    """The deepest module path that most (80%) of the block's named ops lie under, else
    ``block@<first op id>``."""
    step = max(1, len(ops) // 64)   # a sample is enough to name the block
    paths = [module_path(op.name).split("/") for op in ops[::step] if op.name]
    best = ""
    for depth in range(1, max((len(p) for p in paths), default=0) + 1):
        prefix, n = Counter("/".join(p[:depth]) for p in paths if len(p) >= depth).most_common(
            1)[0]
        if n < 0.8 * len(paths):
            break
        best = prefix
    return best or f"block@{ops[0].id}"


# ---- shared helpers -------------------------------------------------------------------------
def _scan_layer(graph: Graph, index: int, op: Op) -> Layer:
    body = tuple(_walk(r.ops for r in op.regions[:1]))
    return Layer(index, f"{op.name or 'scan'}#{op.id}", (op.id,) + tuple(o.id for o in body),
                 _signature(graph, (op,) + body), kind="scan", repeats=op.trip_count)


def _walk(op_lists: Iterable[Iterable[Op]]) -> Iterable[Op]:
    for ops in op_lists:
        for op in ops:
            yield op
            yield from _walk(r.ops for r in op.regions)


def _signature(graph: Graph, ops: Sequence[Op]) -> str:
    """Hash of the op sequence: prims, params, trip counts, shapes and internal wiring (which
    earlier op of the sequence feeds each input). Equal within one process for equal blocks."""
    local: dict[int, int] = {}
    items = []
    for j, op in enumerate(ops):
        wiring = tuple(local.get(v, -1) for v in op.ins)
        types = tuple(graph.values[v] for v in op.ins + op.outs)
        body = tuple(o.prim for r in op.regions for o in r.ops)
        items.append((op.prim, _structural_params(graph, op), op.trip_count, wiring, types,
                      body))
        for k, v in enumerate(op.outs):
            local[v] = j * 1024 + k
    digest = hashlib.sha1(repr(hash(tuple(items))).encode()).hexdigest()
    return digest[:16]


def _assign(graph: Graph, layers: tuple[Layer, ...]) -> Graph:
    """Sets ``Op.layer`` (nested ops too) by rebuilding only the ops that change."""
    owner = {op_id: layer.index for layer in layers for op_id in layer.op_ids}
    ops = _relabel(graph.ops, owner) if owner else graph.ops
    out = dataclasses.replace(graph, ops=ops, layers=layers)
    if graph.analyses.computed("node_graph"):   # layers and Op.layer are no part of it
        out.analyses.carry(node_graph=graph.analyses.node_graph)
    return out


def _relabel(ops: tuple[Op, ...], owner: dict[int, int]) -> tuple[Op, ...]:
    out = []
    for op in ops:
        regions = tuple(_relabel_region(r, owner) for r in op.regions)
        layer = owner.get(op.id, op.layer)
        if layer != op.layer or any(a is not b for a, b in zip(regions, op.regions)):
            op = _with(op, layer=layer, regions=regions)
        out.append(op)
    return tuple(out)


def _with(op: Op, **changes) -> Op:
    """``dataclasses.replace`` for ops without re-running ``__init__`` (tens of thousands of
    ops get their layer set; a fresh copy, the original is untouched)."""
    new = object.__new__(Op)
    new.__dict__.update(op.__dict__)
    new.__dict__.update(changes)
    return new


def _relabel_region(region: Region, owner: dict[int, int]) -> Region:
    ops = _relabel(region.ops, owner)
    same = all(a is b for a, b in zip(ops, region.ops))
    return region if same else dataclasses.replace(region, ops=ops)
