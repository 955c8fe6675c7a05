"""What each input of a training step is, found from the graph: never from its name.

Inputs:
  * a *parameter* is carried state (an output of the same pytree path, shape and dtype replaces
    it) that the loss depends on; *optimizer state* is carried state the loss does not depend on
    (Adam moments, the step count), matched to its parameter by path suffix and shape (optax
    states mirror the parameter tree); the *batch* is everything else.

Parameter roles come from the forward pass (the ops the loss depends on), from the first op that
uses the parameter after layout-only ops (casts, transposes, reshapes, scan slicing):
  * gathered  -> ``embedding`` (token ids index it: "vocab") or ``position`` table;
  * contracted with an activation (a *kernel*). Its input cone, walked up through elementwise,
    layout and reduction ops, decides column or row: a kernel whose input comes from exactly one
    column kernel, or from attention (a contraction of two activations), is a *row* kernel
    (``mlp_out`` / ``attn_out``: its contracting dims are split); any other is a *column* kernel
    whose output cone decides what: it reaches attention -> ``attn_in`` (q, k, v, fused or not:
    the output dim that becomes attention's batch dim is "heads"), another kernel -> ``mlp_in``,
    only the loss -> ``head`` ("vocab"). A contraction that batches over a parameter dim is an
    ``expert`` kernel ("expert" on that dim);
  * added to a kernel's output -> that kernel's ``bias`` (its output dims' names); any other
    elementwise use -> ``norm`` (scales, biases of norms: replicated).

    >>> roles.analyse(graph).params[k]
    ParamRole(role='attn_in', names=('heads', 'embed'), why='column kernel ... feeds attention')
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

from autopar.planner.problem import output_pairs
from autopar.planner.rules import ELEMENTWISE, reshape_groups
from ir import Graph, Op

Names = tuple["str | None", ...]
View = tuple["int | None", ...]          # per parameter dim: the dim of the value it became

_CONTRACTIONS = ("dot_general", "conv_general_dilated")
_CASTS = ("convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier")
_LAYOUT = _CASTS + ("transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims")
_FOLLOW = frozenset(ELEMENTWISE) | set(_LAYOUT) | {
    "split", "slice", "dynamic_slice", "concatenate", "pad", "rev", "reduce_sum", "reduce_max",
    "reduce_min", "argmax", "cumsum", "select_n", "iota", "integer_pow", "custom_jvp_call"}
_ROUTING = ("argmax", "argmin", "top_k", "cumsum", "sort")
_WALK_LIMIT = 400   # ops a cone walk visits before it gives up ("many")


@dataclasses.dataclass(frozen=True)
class ParamRole:
    """One parameter's role, the logical name of each of its dims and how it was found."""

    role: str      # attn_in, attn_out, mlp_in, mlp_out, head, embedding, position, expert_in,
    names: Names   # expert_out, bias, norm, conv, unknown
    why: str


@dataclasses.dataclass(frozen=True)
class Analysis:
    kinds: tuple[str, ...]                   # per input: param, opt_state, batch, scalar
    params: dict[int, ParamRole]             # input index -> role
    param_of: dict[int, int]                 # optimizer-state input -> its parameter's input


def analyse(graph: Graph) -> Analysis:
    """Kinds of all inputs and roles of the parameters, computed (``logical.facts(graph)`` keeps
    them with the graph's analyses)."""
    return _Walker(graph).run()


class _Walker:
    def __init__(self, graph: Graph):
        self.g = graph
        self.ops = graph.all_ops()
        self.consumers: dict[int, list[tuple[Op, int]]] = {}
        for op in self.ops:
            for k, v in enumerate(op.ins):
                self.consumers.setdefault(v, []).append((op, k))
        self.state = _state_inputs(graph)
        self.forward = self._forward_ops()
        self.position = {op.id: i for i, op in enumerate(self.ops)}
        self.outputs = frozenset(graph.outputs)

    # -- kinds ------------------------------------------------------------------------------
    def _forward_ops(self) -> set[int] | None:
        """Ids of the ops the non-state outputs (the loss) depend on; None without such output."""
        replaced = {self.g.outputs[j] for j in self.state.values()}
        roots = [v for v in self.g.outputs if v not in replaced]
        if not roots:
            return None
        need, seen = list(roots), set()
        producer = self.g.producer
        while need:
            op = producer(need.pop())
            if op is None or op.id in seen:
                continue
            seen.add(op.id)
            need.extend(op.ins)
            for r in op.regions:
                need.extend(r.outputs)
                need.extend(v for o in r.ops for v in o.ins)
        return seen

    def kinds(self) -> tuple[str, ...]:
        if not self.state:   # no carried state: parameters are what the pytree calls params
            return tuple("scalar" if not self.g.values[v].shape else
                         "param" if "params" in path_keys(p) else "batch"
                         for v, p in zip(self.g.inputs, self.g.input_paths))
        reads = self._loss_inputs()
        out = []
        for k, v in enumerate(self.g.inputs):
            if not self.g.values[v].shape:
                out.append("scalar")
            elif k not in self.state:
                out.append("batch")
            else:
                out.append("param" if k in reads else "opt_state")
        return tuple(out)

    def _loss_inputs(self) -> set[int]:
        index = {v: k for k, v in enumerate(self.g.inputs)}
        if self.forward is None:   # no loss returned: parameters are what contractions read
            return {index[v] for op in self.ops if op.prim in _CONTRACTIONS + ("gather",)
                    for v in self._roots(op.ins) if v in index}
        return {index[v] for op in self.ops if op.id in self.forward for v in op.ins
                if v in index}

    def _roots(self, values: Iterable[int]) -> Iterable[int]:
        for v in values:
            op = self.g.producer(v)
            while op is not None and op.prim in _LAYOUT and op.ins:
                v, op = op.ins[0], self.g.producer(op.ins[0])
            yield v

    # -- the walk ---------------------------------------------------------------------------
    def run(self) -> Analysis:
        kinds = self.kinds_ = self.kinds()
        self.batch = {self.g.inputs[k] for k, j in enumerate(kinds) if j == "batch"}
        self.rows: dict[int, tuple[bool, str]] = {}
        self.param_values = self._param_values(kinds)
        params = {k: self.param_role(k) for k, kind in enumerate(kinds) if kind == "param"}
        self._pair_biases(params)
        return Analysis(kinds, params, _opt_state_params(self.g, kinds))

    def _param_values(self, kinds) -> set[int]:
        """Values that are a parameter seen through layout-only ops (not activations)."""
        out: set[int] = set()
        for k, kind in enumerate(kinds):
            if kind == "param":
                out.update(v for v, _ in self.views(self.g.inputs[k], tuple(range(self._rank(
                    self.g.inputs[k]))), uses=False))
        return out

    def _rank(self, v: int) -> int:
        return len(self.g.values[v].shape)

    def views(self, v: int, view: View, uses: bool = True):
        """(value, view) for ``v`` and what layout-only ops make of it; with ``uses``, then
        (op, arg, view) for each other forward op that reads one of them."""
        todo, seen = [(v, view)], set()
        while todo:
            v, view = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if not uses:
                yield v, view
            for op, k in self.consumers.get(v, ()):
                nxt = self._through(op, k, view)
                if nxt is not None:
                    todo.extend(nxt)
                elif uses and self._is_forward(op):
                    yield op, k, view

    def _is_forward(self, op: Op) -> bool:
        return self.forward is None or op.id in self.forward

    def _through(self, op: Op, k: int, view: View):
        """The (value, view) pairs a layout-only op turns its operand into; None otherwise."""
        if op.prim == "scan" and op.regions:
            body = op.regions[0]
            nc, ncarry = op.param("num_consts", 0), op.param("num_carry", 0)
            inner = body.inputs[k]
            if k >= nc + ncarry:   # scanned over: the body sees one slice
                view = tuple(d if d is None or d < 0 else -1 if d == 0 else d - 1 for d in view)
            return [(inner, view)]
        if op.prim not in _LAYOUT or k != 0:
            return None
        out = op.outs[0]
        return [(out, tuple(d if d is None or d < 0 else _map_dim(self.g, op, d) for d in view))]

    def param_role(self, k: int) -> ParamRole:
        v = self.g.inputs[k]
        rank = self._rank(v)
        uses = sorted(self.views(v, tuple(range(rank))), key=lambda u: self.position[u[0].id])
        if not uses:
            return ParamRole("unknown", (None,) * rank, "no forward op reads it")
        for op, arg, view in uses:
            if op.prim == "gather" and arg == 0:
                return self._embedding(op, view, rank)
            if op.prim in _CONTRACTIONS:
                return self._kernel(op, arg, view, rank)
        op, arg, view = uses[0]
        names = tuple("layers" if d is not None and d < 0 else "norm" for d in view)
        return ParamRole("norm" if rank - names.count("layers") == 1 else "elementwise", names,
                         f"read elementwise by {op.prim} first")

    # -- gathers ------------------------------------------------------------------------------
    def _embedding(self, op: Op, view: View, rank: int) -> ParamRole:
        dn = dict(op.param("dimension_numbers", ()))
        indexed = set(dn.get("collapsed_slice_dims", ())) | set(dn.get("start_index_map", ()))
        tokens = bool(self._input_roots(op.ins[1]) & self.batch)
        table = "vocab" if tokens else "pos"
        names = tuple(None if d is None else "layers" if d < 0 else
                      table if d in indexed else "embed" for d in view)
        role = "embedding" if tokens else "position"
        return ParamRole(role, names, f"gathered by {'token ids' if tokens else 'positions'}")

    def _input_roots(self, v: int) -> set[int]:
        """Graph inputs a value is computed from (bounded walk up)."""
        out, todo, seen = set(), [v], set()
        inputs = set(self.g.inputs)
        while todo and len(seen) < _WALK_LIMIT:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in inputs:
                out.add(v)
            op = self.g.producer(v)
            if op is not None:
                todo.extend(op.ins)
        return out

    # -- contractions -----------------------------------------------------------------------
    def _kernel(self, op: Op, arg: int, view: View, rank: int) -> ParamRole:
        if op.prim == "conv_general_dilated":
            return ParamRole("conv", (None,) * rank, "convolution kernel")
        (lc, rc), (lb, rb) = op.param("dimension_numbers")
        contract, batch = (lc, lb) if arg == 0 else (rc, rb)
        other = op.ins[1 - arg]
        if other in self.param_values:
            return ParamRole("unknown", (None,) * rank, "contracted with another parameter")
        kind = lambda d: ("batch" if d in batch else "contract" if d in contract else "free")
        dims = [None if d is None else "layers" if d < 0 else kind(d) for d in view]
        if "batch" in dims:
            return self._expert(op, arg, dims)
        row, why = self._is_row(op, arg)
        if row:
            role = "attn_out" if why == "attention" else "mlp_out"
            names = _major_first(dims, "contract", "heads" if why == "attention" else "mlp",
                                 "embed")
            return ParamRole(role, names, f"row kernel: its input comes from {why}")
        return self._column(op, arg, dims, view)

    def _is_row(self, op: Op, arg: int) -> tuple[bool, str]:
        """Row kernel: its input cone holds attention, or exactly one kernel that is column."""
        hit = self.rows.get(op.id)
        if hit is None:
            hit = self.rows[op.id] = self._row_of(op, arg)
        return hit

    def _row_of(self, op: Op, arg: int) -> tuple[bool, str]:
        """Row when the input is made from attention alone, or from column kernels alone (one
        MLP input, or a gated pair such as Llama's gate and up projections)."""
        found = self._cone_up(op.ins[1 - arg])
        if found == {"attention"}:
            return True, "attention"
        kernels = [self.g.op(f[1]) for f in found if isinstance(f, tuple)]
        if not kernels or len(kernels) != len(found):
            return False, ""
        for partner in kernels:
            p_arg = 0 if partner.ins[0] in self.param_values else 1
            if self._is_row(partner, p_arg)[0]:
                return False, ""
        return True, "the column kernel(s) of op " + ", ".join(str(k.id) for k in kernels)

    def _cone_up(self, v: int) -> set:
        """What the input of a contraction is made from: kernels ("kernel", op id), attention,
        inputs, gathers or "many" (walk too long); stops early at two findings."""
        found: set = set()
        todo, seen = [v], set()
        while todo:
            if len(seen) > _WALK_LIMIT or len(found) > 4 or found - {"attention"} and any(
                    not isinstance(f, tuple) for f in found):
                return found | {"many"}
            v = todo.pop()
            if v in seen or v in self.param_values:
                continue
            seen.add(v)
            op = self.g.producer(v)
            if op is None:
                if v in self.batch:
                    found.add("input")
            elif op.prim == "dot_general":
                found.add(self._dot_kind(op))
            elif op.prim in _FOLLOW:
                todo.extend(op.ins)
            else:
                found.add(op.prim)
        return found

    def _dot_kind(self, op: Op):
        params = [v in self.param_values for v in op.ins[:2]]
        return ("kernel", op.id) if any(params) else "attention"

    def _cone_down(self, v: int) -> set[str]:
        """What a kernel's output feeds in the forward pass: attention, a kernel, the loss."""
        found: set[str] = set()
        todo, seen = [v], set()
        outputs = self.outputs
        while todo and len(seen) <= _WALK_LIMIT:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in outputs:
                found.add("loss")
            for op, _ in self.consumers.get(v, ()):
                if not self._is_forward(op):
                    continue
                if op.prim == "dot_general":
                    kind = self._dot_kind(op)
                    found.add("kernel" if isinstance(kind, tuple) else kind)
                elif op.prim in _ROUTING:
                    found.add("routing")
                elif op.prim in _FOLLOW or op.prim == "gather":
                    todo.extend(op.outs)
            if "attention" in found or "routing" in found:
                break
        return found

    def _column(self, op: Op, arg: int, dims: list, view: View) -> ParamRole:
        down = self._cone_down(op.outs[0])
        if "routing" in down:
            return ParamRole("router", _major_first(dims, "free", None, "embed"),
                             "column kernel whose output picks experts (top-k / argmax)")
        if "attention" in down:
            names = self._head_names(op, arg, dims, view)
            return ParamRole("attn_in", names, "column kernel whose output feeds attention")
        if "kernel" in down:
            return ParamRole("mlp_in", _major_first(dims, "free", "mlp", "embed"),
                             "column kernel feeding a kernel")
        return ParamRole("head", _major_first(dims, "free", "vocab", "embed"),
                         "column kernel whose output reaches the loss")

    def _head_names(self, op: Op, arg: int, dims: list, view: View) -> Names:
        """"heads" on the free dim that attention batches over (tracked through layout ops),
        else on the major free dim of more than 3 (a fused q/k/v count is not heads)."""
        shape = self.g.values[op.ins[arg]].shape
        out_dim = _out_dims(self.g, op, arg, view)
        heads = next((i for i, d in sorted(out_dim.items())
                      if self._batched_by_attention(op.outs[0], d)), None)
        free = [i for i, d in enumerate(dims) if d == "free"]
        if heads is None:
            heads = next((i for i in free if shape[view[i]] > 3), free[0] if free else None)
        return tuple("heads" if i == heads else d if d == "layers" else
                     "embed" if d == "contract" else
                     "kv" if d == "free" and heads is not None and i > heads else None
                     for i, d in enumerate(dims))

    def _batched_by_attention(self, v: int, dim: int) -> bool:
        """Does dim ``dim`` of ``v`` reach an attention contraction as one of its batch dims?"""
        todo, seen = [(v, dim)], set()
        while todo and len(seen) <= _WALK_LIMIT:
            v, d = todo.pop()
            if (v, d) in seen or d is None:
                continue
            seen.add((v, d))
            rank = len(self.g.values[v].shape)
            for op, k in self.consumers.get(v, ()):
                if not self._is_forward(op):
                    continue
                if op.prim == "dot_general" and self._dot_kind(op) == "attention":
                    (_, _), (lb, rb) = op.param("dimension_numbers")
                    if d in (lb if k == 0 else rb):
                        return True
                elif op.prim in _LAYOUT and k == 0:
                    todo.append((op.outs[0], _map_dim(self.g, op, d)))
                elif op.prim in _FOLLOW:
                    todo.extend((o, d) for o in op.outs
                                if len(self.g.values[o].shape) == rank)
        return False

    def _expert(self, op: Op, arg: int, dims: list) -> ParamRole:
        found = self._cone_up(op.ins[1 - arg])
        row = any(isinstance(f, tuple) for f in found) and "attention" not in found
        inner, outer = ("mlp", "embed") if row else ("embed", "mlp")
        names = tuple(None if d is None else {"batch": "expert", "contract": inner,
                                              "free": outer, "layers": "layers"}[d] for d in dims)
        return ParamRole("expert_out" if row else "expert_in", names,
                         "contraction batched over a parameter dim (experts)")

    # -- biases -----------------------------------------------------------------------------
    def _pair_biases(self, params: dict[int, ParamRole]) -> None:
        """Elementwise parameters added to a kernel's output take the names of that kernel's
        output dims (a column kernel's bias is split with it)."""
        outputs: dict[int, tuple[tuple[int, ...], Names, int]] = {}   # dot output -> kernel
        for k, role in params.items():
            if role.role in ("attn_in", "mlp_in", "head", "attn_out", "mlp_out", "embedding"):
                for op, arg, view in self._uses(k):
                    if op.prim == "dot_general" and op.ins[1 - arg] not in self.param_values:
                        shape = self.g.values[self.g.inputs[k]].shape
                        free = sorted(i for i, d in enumerate(view) if d is not None and d < 0)
                        free += sorted(_out_dims(self.g, op, arg, view))
                        outputs[op.outs[0]] = (tuple(shape[i] for i in free),
                                               tuple(role.names[i] for i in free), k,
                                               tuple(view[i] is not None and view[i] < 0
                                                     for i in free))
                        break
        for k, role in list(params.items()):
            if role.role in ("norm", "elementwise"):
                params[k] = self._bias_of(k, outputs) or role

    def _uses(self, k: int):
        v = self.g.inputs[k]
        return sorted(self.views(v, tuple(range(self._rank(v)))),
                      key=lambda u: self.position[u[0].id])

    def _bias_of(self, k: int, outputs) -> ParamRole | None:
        shape = self.g.values[self.g.inputs[k]].shape
        for op, _, view in self._uses(k)[:1]:
            if op.prim not in ("add", "add_any"):
                return None
            stacked = [d is not None and d < 0 for d in view]
            core = tuple(n for n, st in zip(shape, stacked) if not st)
            for root in self._roots(op.ins):
                hit = outputs.get(root)
                if hit is not None and tuple(n for n, st in zip(hit[0], hit[3]) if not st) == core:
                    names = iter(n for n, st in zip(hit[1], hit[3]) if not st)
                    return ParamRole("bias", tuple("layers" if st else next(names)
                                                   for st in stacked),
                                     f"added to the output of input {hit[2]}'s kernel")
        return None


def _out_dims(graph: Graph, op: Op, arg: int, view: View) -> dict[int, int]:
    """Param dim -> dot_general output dim, for the param's free dims (batch dims come first in
    the output, then the lhs free dims, then the rhs free dims)."""
    (lc, rc), (lb, rb) = op.param("dimension_numbers")
    ranks = [len(graph.values[v].shape) for v in op.ins[:2]]
    lhs_free = [d for d in range(ranks[0]) if d not in lc and d not in lb]
    rhs_free = [d for d in range(ranks[1]) if d not in rc and d not in rb]
    free = lhs_free if arg == 0 else rhs_free
    start = len(lb) + (0 if arg == 0 else len(lhs_free))
    return {i: start + free.index(d) for i, d in enumerate(view) if d is not None and d in free}


def _major_first(dims: list, which: str, first: str, rest: str) -> Names:
    """Names per param dim: the major dim of kind ``which`` is ``first`` (later ones "kv" when
    ``first`` is "heads"), dims of the other kind are ``rest``."""
    out, seen = [], False
    for d in dims:
        if d == which:
            out.append(("kv" if first == "heads" else None) if seen else first)
            seen = True
        elif d is None or d == "layers":
            out.append(d)
        else:
            out.append(rest)
    return tuple(out)


def _map_dim(graph: Graph, op: Op, d: int) -> int | None:
    """Where dim ``d`` of a layout-only op's operand is in its result (None: merged away)."""
    if op.prim in _CASTS:
        return d
    if op.prim == "transpose":
        return tuple(op.param("permutation")).index(d)
    if op.prim == "broadcast_in_dim":
        return tuple(op.param("broadcast_dimensions"))[d]
    if op.prim == "squeeze":
        dims = set(op.param("dimensions", ()))
        return None if d in dims else d - sum(1 for x in dims if x < d)
    if op.prim == "expand_dims":
        out = 0
        rank = len(graph.values[op.outs[0]].shape)
        added = {x % rank for x in op.param("dimensions", ())}
        for j in range(rank):
            if j in added:
                continue
            if out == d:
                return j
            out += 1
        return None
    old, new = graph.values[op.ins[0]].shape, graph.values[op.outs[0]].shape
    for gi, gj in reshape_groups(old, new):
        if d in gi:
            major_in = next((i for i in gi if old[i] != 1), None)
            major_out = next((j for j in gj if new[j] != 1), None)
            return major_out if d == major_in else None
    return None


def _state_inputs(graph: Graph) -> dict[int, int]:
    """Input index -> index of the output that replaces it (same path, shape and dtype). A step
    that returns only the new state of one argument (``return params``, no loss) has output
    paths without the argument's index: match them under each argument's prefix."""
    pairs = {k: j for j, k in output_pairs(graph).items()}
    return pairs or _returned_argument(graph)


def _returned_argument(graph: Graph) -> dict[int, int]:
    """The pairs of the argument whose leaves every output replaces (``[k]`` + output path,
    same type), or none when no single argument is returned whole."""
    by_path = {p: k for k, p in enumerate(graph.input_paths)}
    for arg in sorted({p[:p.index("]") + 1] for p in graph.input_paths if p.startswith("[")}):
        pairs = {}
        for j, p in enumerate(graph.output_paths):
            k = by_path.get(arg + p)
            if k is None or graph.values[graph.inputs[k]] != graph.values[graph.outputs[j]]:
                break
            pairs[k] = j
        else:
            if pairs:
                return pairs
    return {}


def path_keys(path: str) -> tuple[str, ...]:
    """``"[0]['opt_state'][0].mu['wte']"`` -> ``("0", "opt_state", "0", "mu", "wte")``."""
    return tuple(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))


_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)")


def _opt_state_params(graph: Graph, kinds: Sequence[str]) -> dict[int, int]:
    """Optimizer-state input -> the parameter whose path it ends with (longest such suffix, same
    shape): optax states mirror the parameter tree."""
    shapes = [graph.values[v].shape for v in graph.inputs]
    keys = [path_keys(p) for p in graph.input_paths]
    by_suffix: dict[tuple, list[int]] = {}
    for k, kind in enumerate(kinds):
        if kind == "param":
            for n in range(1, len(keys[k]) + 1):
                by_suffix.setdefault(keys[k][-n:], []).append(k)
    out = {}
    for k, kind in enumerate(kinds):
        if kind != "opt_state":
            continue
        for n in range(len(keys[k]), 0, -1):
            hit = [p for p in by_suffix.get(keys[k][-n:], ()) if shapes[p] == shapes[k]]
            if hit:
                out[k] = hit[0]
                break
    return out
