"""Unrolled models in a pipeline: their numbered layers stacked into one ``(L, ...)`` tree.

A model whose layers are a Python loop keeps each layer's parameters in its own numbered
subtree: ``layer_0 .. layer_{L-1}`` (autopar's GPT with ``scan=False``), ``transformer/h/0 ..
L-1`` (HF's Flax GPT-2). The pipelined step needs them *stacked*: a stage owns the parameters and
Adam moments of its layers only when they are slices of one ``(L, ...)`` array split over the
stage axis; a whole per-layer array cannot live on a subset of the mesh's devices inside one
``jax.jit`` program, so in the user's layout every stage would hold every layer (``3 x`` all
parameters with Adam, replicated over the stage axis), which is what pipelining exists to avoid.

So the contract is: the pipelined step runs on the *stacked layout* and returns it.
``Stacking.stack_state(state)`` converts the user's state once (its parameters and every subtree
of the optimizer state shaped like them), ``unstack_state`` converts back for checkpoints and
evaluation; the step refuses the user's layout with an error naming the conversion. Planning
(``autopar.plan(..., pipeline=...)``) takes either layout: it converts shapes, which is free.

``find(params)`` locates the layers generically: sibling subtrees whose keys are one prefix and
the numbers ``0 .. L-1`` and whose leaves have identical shapes and dtypes. A model may have
the stacked layout hold some leaves reshaped (``unrolled(..., views=...)``), e.g. to give a fused
dim's heads a dim of their own that a tensor axis can split.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from autopar.errors import AutoparError
from autopar.pipeline.model import key_names, params_at

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Stacking:
    """Numbered layers ``{prefix}0 .. {prefix}{count-1}`` in the dict at ``parent`` (a key
    path). Stacked, they become one tree at ``layers_path``: the dict itself when it holds only
    the layers (``whole``, HF's ``h``), else the key ``key`` beside the other entries.

    ``views``: ``(path in a layer, the layer's shape, the stacked layout's shape)`` of leaves
    the stacked layout holds reshaped (row-major, no data reordered), so that a dim the model
    fuses becomes its own: HF GPT-2's ``attn/c_attn/kernel`` ``(3 D, D)`` as ``(3, H, Dh, D)``,
    whose head dim a tensor axis splits into whole heads (``autopar.pipeline.hf``)."""

    parent: tuple[str, ...]
    prefix: str
    count: int
    key: str
    whole: bool
    views: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    # Parameters that are not string-keyed dicts (``autopar.pipeline.model.ParamsView``): the
    # layers are found and stacked in the dict view, which is the stacked layout's type.
    view: Any = None
    # Where the parameters are in the training state (key names; () for the state itself).
    params_path: tuple[str, ...] = ("params",)

    @property
    def layers_path(self) -> tuple[str, ...]:
        return self.parent if self.whole else (*self.parent, self.key)

    def names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(self.count)]

    def describe(self) -> str:
        where = "/".join(self.parent) or "the top level"
        return f"{self.count} layers {self.prefix}0..{self.prefix}{self.count - 1} in {where}"

    # ---- parameters ---------------------------------------------------------------------------
    def stack(self, params):
        if self.view is not None and self.view.is_user(params):
            params = self.view.to_dict(params)
        node = _get(params, self.parent)
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *(node[n] for n in
                                                                      self.names()))
        stacked = self._reshaped(stacked, stacked=True)
        if self.whole:
            return _set(params, self.parent, stacked)
        kept = {k: v for k, v in node.items() if k not in set(self.names())}
        return _set(params, self.parent, _like(node, {**kept, self.key: stacked}))

    def unstack(self, params):
        stacked = self._reshaped(_get(params, self.layers_path), stacked=False)
        layers = {n: jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
                  for i, n in enumerate(self.names())}
        if self.whole:
            out = _set(params, self.parent, _like(stacked, layers))
        else:
            node = _get(params, self.parent)
            kept = {k: v for k, v in node.items() if k != self.key}
            out = _set(params, self.parent, _like(node, {**kept, **layers}))
        return out if self.view is None else self.view.from_dict(out)

    def _reshaped(self, layers, *, stacked: bool):
        """The stacked ``(L, ...)`` leaves ``views`` names in the stacked layout's shapes
        (``stacked``) or back in the layer's own."""
        if not self.views:
            return layers
        shapes = {path: view if stacked else own for path, own, view in self.views}

        def one(path, x):
            shape = shapes.get("/".join(key_names(path)))
            return x if shape is None else x.reshape(x.shape[0], *shape)

        return jax.tree_util.tree_map_with_path(one, layers)

    def layout(self, params) -> str | None:
        """``"user"``, ``"stacked"`` or ``None`` (neither) of a params tree."""
        if self.view is not None and self.view.is_user(params):
            params = self.view.to_dict(params)
        try:
            node = _get(params, self.parent)
        except (KeyError, TypeError):
            return None
        if isinstance(node, Mapping) and all(n in node for n in self.names()):
            return "user"
        try:
            leaves = jax.tree_util.tree_leaves(_get(params, self.layers_path))
        except (KeyError, TypeError):
            return None
        ok = leaves and all(getattr(x, "shape", ())[:1] == (self.count,) for x in leaves)
        return "stacked" if ok else None

    # ---- training state -----------------------------------------------------------------------
    def stack_state(self, state):
        """The training state (``{"params", "opt_state", ...}``, or any tree holding the
        parameters at ``params_path``) in the stacked layout: the parameters and every
        optimizer-state subtree shaped like them (Adam's moments), the rest as it was."""
        return _map_like(self.stack, state, self.params_of(state))

    def unstack_state(self, state):
        return _map_like(self.unstack, state, self.params_of(state))

    def params_of(self, state):
        return params_at(state, self.params_path)


def _map_like(fn, tree, like):
    """``fn`` on every subtree of ``tree`` with ``like``'s structure, other leaves kept."""
    pdef = jax.tree_util.tree_structure(like)

    def match(x) -> bool:
        return (not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))
                and jax.tree_util.tree_structure(x) == pdef)

    return jax.tree_util.tree_map(lambda x: fn(x) if match(x) else x, tree, is_leaf=match)


def _like(node, items: dict):
    """``items`` as a mapping of ``node``'s type (dict, flax FrozenDict)."""
    return items if type(node) is dict else type(node)(items)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    head, *tail = path
    return _like(tree, {**tree, head: _set(tree[head], tuple(tail), value)})


# ---- finding the layers -----------------------------------------------------------------------
def find(params, where: str | None = None) -> Stacking:
    """The one group of numbered, identically shaped sibling subtrees in ``params`` (or the one
    at ``where``, ``"transformer/h"`` or ``"layer_"``), else an ``AutoparError`` saying what
    was found."""
    groups, near = [], []
    _walk(params, (), groups, near)
    if where is not None:
        groups = [g for g in groups if where in ("/".join(g.parent), g.prefix,
                                                  "/".join((*g.parent, g.prefix)))]
    if len(groups) == 1:
        return groups[0]
    if groups:
        raise AutoparError(f"the params hold {len(groups)} stacks of numbered layers: "
                           f"{'; '.join(g.describe() for g in groups)}; name the one to "
                           f"pipeline with where= (its parent path or key prefix)")
    top = sorted(params)[:12] if isinstance(params, Mapping) else type(params).__name__
    hint = f" (found {'; '.join(near)})" if near else ""
    raise AutoparError(f"found no numbered layers to pipeline in the params{hint}: expected "
                       f"sibling subtrees named like layer_0 .. layer_{{L-1}} or h/0 .. "
                       f"h/{{L-1}}, at least 2, with identical shapes and dtypes; the top-level "
                       f"keys are {top}")


def _walk(node, path, groups: list, near: list) -> None:
    if not isinstance(node, Mapping):
        return
    by_prefix: dict[str, dict[int, str]] = {}
    for k in node:
        m = _NUMBERED.match(str(k))
        if m and isinstance(node[k], Mapping):
            by_prefix.setdefault(m.group(1), {})[int(m.group(2))] = k
    for prefix, members in by_prefix.items():
        _group(node, path, prefix, members, groups, near)
    numbered = {k for ms in by_prefix.values() for k in ms.values()}
    for k, v in node.items():
        if k not in numbered:
            _walk(v, (*path, str(k)), groups, near)


def _group(node, path, prefix: str, members: dict, groups: list, near: list) -> None:
    n = len(members)
    where = "/".join((*path, prefix)) + "*"
    if n < 2:
        return
    if sorted(members) != list(range(n)) or any(members[i] != f"{prefix}{i}" for i in members):
        near.append(f"{where}: numbers {sorted(members)[:8]} are not 0..{n - 1}")
        return
    sigs = [_signature(node[members[i]]) for i in range(n)]
    if any(s != sigs[0] for s in sigs):
        bad = next(i for i in range(n) if sigs[i] != sigs[0])
        near.append(f"{where}: {members[bad]} differs in shapes or dtypes from {members[0]}")
        return
    whole = len(node) == n
    key = prefix.rstrip("_-.") or "layers"
    if not whole and key in node:
        key = f"{key}_stacked"
    groups.append(Stacking(tuple(path), prefix, n, key, whole))


def _signature(tree):
    leaves, tdef = jax.tree_util.tree_flatten(tree)
    return tdef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


# ---- planning and running ---------------------------------------------------------------------
def stacked_state(stacking: Stacking | None, state, *, abstract: bool):
    """``state`` in the stacked layout: as given when it is, converted (shapes only when
    ``abstract``) when it is the user's layout, else an error naming what was found."""
    if stacking is None:
        return state
    kind = stacking.layout(stacking.params_of(state))
    if kind == "stacked":
        return state
    if kind == "user":
        return jax.eval_shape(stacking.stack_state, state) if abstract else \
            stacking.stack_state(state)
    raise AutoparError(f"the state's params have neither the model's layout ({stacking.describe()}"
                       f") nor its stacked layout (one tree at {'/'.join(stacking.layers_path)} "
                       f"with a leading dim of {stacking.count}); build the state with the "
                       f"step's init function")


def require_stacked(stacking: Stacking | None, state) -> None:
    """The pipelined step's own check: it runs on the stacked layout only."""
    if stacking is None or stacking.layout(stacking.params_of(state)) == "stacked":
        return
    stacked_state(stacking, state, abstract=True)       # neither layout: that error
    raise AutoparError(f"this pipelined step runs on the stacked layout, and the state has the "
                       f"model's unrolled one ({stacking.describe()}); convert it once with "
                       f"state = step.stack_state(state) (each stage then holds only its own "
                       f"layers) and back with step.unstack_state(state) for checkpoints")


def stacked_step(stacking: Stacking, fn):
    """The user's step ``fn`` on the stacked layout: what the pipelined step computes, as one
    unsharded program (the plan's traced graph)."""
    def step(state, batch):
        new, loss = fn(stacking.unstack_state(state), batch)
        return stacking.stack_state(new), loss

    return step


def unrolled(model, params, where: str | None = None, views: dict | None = None):
    """``model`` (a ``StagedModel`` whose functions take one layer's parameters, in the stacked
    layout's shapes) for the unrolled ``params``: its layer path and stacking found in them.
    ``views``: ``{path in a layer: shape}`` of leaves the stacked layout reshapes
    (``Stacking.views``)."""
    st = find(params, where)
    if views:
        st = dataclasses.replace(st, views=_views(st, params, views))
    return dataclasses.replace(model, layers_key=st.layers_path[-1], layers_path=st.layers_path,
                               num_layers=st.count, stacking=st)


def _views(st: Stacking, params, views: dict) -> tuple:
    """``Stacking.views`` of ``{path: shape}``, checked against the first layer's leaves."""
    first = _get(params, st.parent)[st.names()[0]]
    own = {"/".join(key_names(p)): tuple(x.shape)
           for p, x in jax.tree_util.tree_flatten_with_path(first)[0]}
    out = []
    for path, shape in views.items():
        if path not in own or math.prod(own[path]) != math.prod(shape):
            got = own.get(path, f"no such leaf (a layer has {sorted(own)})")
            raise AutoparError(f"the stacked view of {path} has shape {tuple(shape)}, which does "
                               f"not reshape that layer parameter: {got}; give a shape of the "
                               f"same size for a leaf of the layer")
        out.append((path, own[path], tuple(shape)))
    return tuple(out)
