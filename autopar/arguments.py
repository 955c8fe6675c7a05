"""What a step receives, as autopar traces and runs it: NNX graph objects split, static leaves kept
apart (``prepare``), and what the step changed written back (``Call.finish``).

A call's arguments are parted as ``nnx.jit`` and ``eqx.filter_jit`` part them:

* **NNX graph objects** (modules, ``nnx.Optimizer``, ``nnx.Rngs``, metrics, any ``nnx.Object``,
  an ``nnx.Variable`` passed as an argument itself) are split together (one ``nnx.split`` of
  them all, so references they share stay shared): their graph definition is static, their
  state is traced in each object's place;
* **arrays** (jax, numpy, ``jax.ShapeDtypeStruct``) are traced;
* **every other leaf** (functions, Python scalars, strings, ...) is static: fixed at trace time
  and part of the plan's cache key, as ``eqx.filter_jit`` keeps it (a Python scalar held by an
  NNX ``Variable`` is state, traced as ``nnx.jit`` traces it).

The step is traced as a function of the traced part alone (``Call.function``). It returns the
step's own results with their non-array leaves taken out (kept at trace time, as
``eqx.filter_jit`` does) and, when NNX objects came in, before them the state leaves the step
changed (all of a donated argument's), each at its argument's own path, so that the planner
pairs a new value with the old one (``planner.problem.output_pairs``). ``Call.finish`` puts the
static results back and writes the changes into the caller's objects (parameters, optimizer
state and step, RNG counts, batch statistics): the step behaves as it does under ``nnx.jit``.
Before/after, for ``train_step(model, optimizer, batch)`` returning ``loss``::

    train_step(model, optimizer, batch)      traced(state_0, state_1, batch)
      -> loss                                  -> (changed_0, changed_1, None, loss)
                                                  changed_0: State({'l': {'kernel': ...}, ...})
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autopar.errors import AutoparError

TRACED, NODE, STATIC = "traced", "node", "static"


def _nnx():
    """``flax.nnx`` when the program imported it (no NNX object can exist otherwise)."""
    return sys.modules.get("flax.nnx")


def is_graph_object(x: Any) -> bool:
    """An NNX object (module, optimizer, ``nnx.Rngs``, metrics, any ``nnx.Object``). A Variable
    counts only as an argument itself (``_graph_leaf``): inside a plain pytree (an ``nnx.State``,
    the optax state of a functional step) it is a pytree node whose value is traced, as
    ``jax.jit`` traces it."""
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Pytree)


def _graph_leaf(args: tuple) -> Callable[[Any], bool]:
    nnx = _nnx()
    if nnx is None:
        return lambda x: False
    top = [id(a) for a in args if isinstance(a, nnx.Variable)]
    return lambda x: isinstance(x, nnx.Pytree) or (isinstance(x, nnx.Variable) and id(x) in top)


def is_array(x: Any) -> bool:
    """What ``eqx.is_array`` counts as an array, and ``ShapeDtypeStruct`` (planning from shapes)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def has_graph_objects(args: tuple) -> bool:
    is_node = _graph_leaf(args)
    return any(map(is_node, jax.tree_util.tree_leaves(args, is_leaf=is_node)))


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """One call's arguments, parted: ``dynamic`` is what is traced and fed (each graph object's
    place holds its state, each static leaf's ``None``); ``key`` the static rest, hashable."""

    dynamic: tuple
    key: tuple
    treedef: Any                  # the arguments, graph objects as leaves
    kinds: tuple                  # per leaf of treedef: TRACED, NODE or (STATIC, value)
    nodes: tuple                  # the caller's graph objects, in leaf order
    node_args: tuple[int, ...]    # the argument each node sits in
    graphdef: Any = None          # nnx graph definition of ``nodes``
    state: Any = None             # their joint nnx.State: the caller's own Variables

    def function(self, fn: Callable, donated: Sequence[int] = ()) -> tuple[Callable, Results]:
        """``fn`` as a function of ``dynamic`` alone, and the record its trace fills."""
        results = Results()

        def traced(*dynamic):
            args, merged, before = self._rebuild(dynamic)
            out = _call(fn, args)
            self._check_no_lost_updates(args, merged, dynamic, out)
            out = results.record_out(out, merged)
            if not self.nodes:
                return out
            # each changed leaf at its argument's own path, so the planner pairs the new value
            # with the old (the state a step carries), then the step's results
            return (*results.record_updates(self, merged, before, donated), out)

        return traced, results

    def _rebuild(self, dynamic: tuple):
        """The arguments as ``fn`` takes them, from the traced ``dynamic`` ones; the objects
        merged from their states, and those states' leaves before the step runs (merging
        reuses the states' Variables, so the step's changes show in them too)."""
        parts = self.treedef.flatten_up_to(dynamic)
        merged, before = (), {}
        if self.nodes:
            nnx = _nnx()
            joint = _joint_state(parts, self.kinds)
            before = {path: jax.tree_util.tree_leaves(v) for path, v in nnx.to_flat_state(joint)}
            merged = tuple(nnx.merge(self.graphdef, joint))
        return self.treedef.unflatten(self._leaves(parts, merged)), merged, before

    def _leaves(self, parts: list, merged: tuple) -> list:
        """The arguments' leaves (graph objects as leaves) from the traced parts."""
        it = iter(merged)
        return [next(it) if k == NODE else k[1] if k != TRACED else x
                for k, x in zip(self.kinds, parts)]

    def _check_no_lost_updates(self, args: tuple, merged: tuple, dynamic: tuple, out) -> None:
        """A change the step made in place to a plain pytree it was given (a dict, a list, an
        ``nnx.State``) lives only in the copy the trace handed it: unless the step returns the
        changed value, refuse it, naming the fix (``state["w"] = w; return state`` is fine)."""
        given = {id(x) for x in self._leaves(self.treedef.flatten_up_to(dynamic), merged)}
        returned = {id(x) for x in jax.tree_util.tree_leaves(out, is_leaf=is_graph_object)}
        is_node = _graph_leaf(merged)     # a Variable passed whole is a node, not its value
        for path, x in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_node)[0]:
            if id(x) not in given and id(x) not in returned:
                raise _lost("argument " + jax.tree_util.keystr(path))

    def adopt(self, placed: tuple) -> None:
        """Give the caller's objects the arrays ``placed`` moved (``placed`` is ``dynamic`` with
        arrays moved into their planned layouts); nothing when none moved."""
        parts = [self.treedef.flatten_up_to(t) for t in (self.dynamic, placed)]
        if all(a is b for k, x, y in zip(self.kinds, *parts) if k == NODE
               for a, b in zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(y))):
            return        # the usual call: the objects hold what the last call placed
        nnx = _nnx()
        before, after = (nnx.to_flat_state(_joint_state(p, self.kinds)) for p in parts)
        for (_, old), (_, new) in zip(before, after):
            if not _same_leaves(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old)):
                old.update_from_state(new)     # old: the caller's own Variable

    def finish(self, results: Results, out):
        """The step's results as it returned them, after writing its NNX changes back."""
        if self.nodes:
            *updates, out = out
            results.write_back(self, tuple(updates))
        return results.rebuild_out(out, self.nodes)


def prepare(args: tuple) -> Call:
    """Part ``args`` (see the module docstring); a static leaf must be hashable."""
    is_node = _graph_leaf(args)
    flat, treedef = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_node)
    kinds, nodes, node_args = [], [], []
    for path, x in flat:
        if is_node(x):
            kinds.append(NODE)
            nodes.append(x)
            node_args.append(path[0].idx)
        elif is_array(x):
            kinds.append(TRACED)
        else:
            kinds.append((STATIC, _hashable(x, path)))
    graphdef = state = None
    leaves: list = [x for _, x in flat]
    if nodes:
        graphdef, state = _nnx().split(tuple(nodes))
        # node i's part of the joint state; None when all of it sits under an earlier node (the
        # same object passed twice)
        it = iter(range(len(nodes)))
        leaves = [state.get(next(it)) if k == NODE else x for k, x in zip(kinds, leaves)]
    leaves = [None if isinstance(k, tuple) else x for k, x in zip(kinds, leaves)]
    key = (treedef, tuple(k if not isinstance(k, tuple) else (STATIC, type(k[1]), k[1])
                          for k in kinds), graphdef)
    return Call(treedef.unflatten(leaves), key, treedef, tuple(kinds), tuple(nodes),
                tuple(node_args), graphdef, state)


class Results:
    """What the trace of a step found out about its results, filled once while tracing."""

    def __init__(self):
        self.out_treedef = None
        self.out_kinds: tuple = ()
        self.graphdef_after = None          # the objects' graph definition after the step
        self.same = True                    # ... and it equals the one before

    # ---- trace time ---------------------------------------------------------------------------
    def record_out(self, out, merged: tuple):
        """The traced part of ``out``: arrays; graph objects the step was given stand for the
        caller's own (``("input", k)``), new ones return their state; other leaves are static."""
        flat, self.out_treedef = jax.tree_util.tree_flatten(out, is_leaf=is_graph_object)
        kinds, leaves = [], []
        index = _node_index(merged) if any(map(is_graph_object, flat)) else {}
        for x in flat:
            if is_graph_object(x) and id(x) in index:
                kinds.append(("input", index[id(x)]))
                leaves.append(None)
            elif is_graph_object(x):
                graphdef, state = _nnx().split(x)
                kinds.append(("new", graphdef))
                leaves.append(state)
            elif isinstance(x, jax.Array):
                kinds.append(TRACED)
                leaves.append(x)
            else:
                kinds.append((STATIC, x))
                leaves.append(None)
        self.out_kinds = tuple(kinds)
        return self.out_treedef.unflatten(leaves)

    def record_updates(self, call: Call, merged: tuple, before: dict,
                       donated: Sequence[int]) -> tuple:
        """The state the step changed, and all of a donated argument's (its buffers are gone
        after the call), shaped like the arguments: each node's place holds its changed part
        (an ``nnx.State``, or None). Every leaf when the step changed the objects' structure."""
        nnx = _nnx()
        self.graphdef_after, after = nnx.split(merged)
        self.same = self.graphdef_after == call.graphdef
        donated_nodes = {i for i, a in enumerate(call.node_args) if a in donated}
        kept = [(path, v) for path, v in nnx.to_flat_state(after)
                if not self.same or path[0] in donated_nodes
                or not _same_leaves(jax.tree_util.tree_leaves(v), before.get(path))]
        changed = nnx.from_flat_state(kept)
        parts = iter([changed.get(i) for i in range(len(merged))])
        return call.treedef.unflatten([next(parts) if k == NODE else None for k in call.kinds])

    # ---- run time -----------------------------------------------------------------------------
    def write_back(self, call: Call, updates: tuple) -> None:
        nnx = _nnx()
        nodes = tuple(call.nodes)
        changed = _joint_state(call.treedef.flatten_up_to(updates), call.kinds)
        if self.same:   # each changed Variable of the caller's, found by path: no graph walk
            mine = dict(nnx.to_flat_state(call.state))
            for path, new in nnx.to_flat_state(changed):
                mine[path].update_from_state(new)
            return
        nnx.update(nodes, changed)
        if nnx.graphdef(nodes) != self.graphdef_after:
            raise AutoparError(
                "the step changed a static attribute of an NNX object it was given (a plain "
                "Python attribute such as a flag or a size, not an nnx.Variable): its arrays were "
                "written back, but autopar cannot set such attributes on the caller's objects. "
                "Make that change before calling the step (e.g. model.eval() or model.train() "
                "outside it), or hold the value in an nnx.Variable")

    def rebuild_out(self, out, nodes: tuple):
        parts = self.out_treedef.flatten_up_to(out)
        leaves = []
        for kind, x in zip(self.out_kinds, parts):
            if kind == TRACED:
                leaves.append(x)
            elif kind[0] == STATIC:
                leaves.append(kind[1])
            elif kind[0] == "input":
                leaves.append(_node_at(nodes, kind[1]))
            else:
                leaves.append(_nnx().merge(kind[1], x))
        return self.out_treedef.unflatten(leaves)


# ---- helpers ------------------------------------------------------------------------------------
def _call(fn: Callable, args: tuple):
    """``fn(*args)``, with flax's error for a change to an object the step closes over (which
    the trace cannot hand back) turned into one that names the fix."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - re-raised unless it is flax's trace-level error
        # flax: "Cannot mutate Param from a different trace level" (TraceContextError, a
        # FlaxError), or "Cannot extract graph node from different trace level" (ValueError)
        if _nnx() is None or "different trace level" not in str(e):
            raise
        raise AutoparError(
            f"the step changed, or took the gradient of, an NNX object it did not receive as "
            f"an argument ({str(e).splitlines()[0]}): it reads it from an enclosing scope (a "
            f"closure, a global, a bound method's object), so a change could never reach the "
            f"caller. Pass the object to the step: step(model, optimizer, batch), as for "
            f"nnx.jit") from None


def _lost(what: str) -> AutoparError:
    return AutoparError(
        f"the step changed {what} in place; the change cannot reach the caller: like jax.jit, "
        f"autopar hands the step copies of plain pytrees (dicts, lists, tuples, nnx.State), so "
        f"the update would be dropped. Return the new value from the step instead (e.g. return "
        f"state, loss), or pass the NNX objects themselves (modules, nnx.Optimizer, nnx.Rngs), "
        f"whose changes autopar writes back as nnx.jit does")


def _hashable(x: Any, path) -> Any:
    try:
        hash(x)
    except TypeError:
        where = "argument " + jax.tree_util.keystr(path)
        raise AutoparError(
            f"{where} is {type(x).__name__} {_short(x)}: neither an array, which autopar traces, "
            f"nor hashable, which a static leaf must be (autopar keeps non-array leaves static "
            f"and keys its plans on them, as eqx.filter_jit does). Make it an array "
            f"(jnp.asarray) to trace it, make it hashable (a tuple, a frozen dataclass), or "
            f"filter it out of the arguments: params, static = eqx.partition(model, "
            f"eqx.is_array), then close over static with functools.partial") from None
    return x


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _same_leaves(a: list, b: list | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _joint_state(parts: list, kinds: tuple):
    """The joint ``nnx.State`` of all nodes, from each node's part (see ``prepare``)."""
    nodes = [x for k, x in zip(kinds, parts) if k == NODE]
    return _nnx().State({i: s for i, s in enumerate(nodes) if s is not None})


def _node_index(merged: tuple) -> dict[int, tuple[int, tuple]]:
    """id of every graph object reachable from ``merged`` -> (its top node, its path there), to
    map a result that is one of them to the caller's own object."""
    out: dict[int, tuple[int, tuple]] = {}
    for i, node in enumerate(merged):
        for path, sub in _nnx().iter_graph(node):
            if is_graph_object(sub):
                out.setdefault(id(sub), (i, tuple(path)))
    return out


def _node_at(nodes: tuple, where: tuple[int, tuple]):
    i, path = where
    for p, sub in _nnx().iter_graph(nodes[i]):
        if tuple(p) == path:
            return sub
    raise AssertionError(f"graph object {where} not found after the write-back")
