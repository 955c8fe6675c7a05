"""Pipeline stages cut out of a loss function's traced program: no hand-written ``StagedModel``.

A pipelined step needs a model's embedding, one layer and its head as three functions
(``autopar.pipeline.model.StagedModel``). Written by hand for autopar's GPT and HF's GPT-2;
``staged(loss_fn, tx, params)`` derives them for any loss over an unrolled model whose
numbered layers ``autopar.pipeline.unrolled.find`` locates (HF's Llama, BERT, ViT, a user's
own loop over blocks), or a scanned one (below):

1. ``loss_fn(params, batch)`` is traced (``jax.make_jaxpr``) at the shapes a microbatch has.
   Its equations are in execution order, so the Python loop over layers leaves ``L`` runs of
   equations one after the other.
2. Layer ``i``'s *anchor* is the first equation reading one of its parameters. The anchors are
   ``P`` equations apart; the cut puts the start of every unit ``k`` equations before its
   anchor, for the smallest ``k`` at which the units are the same function: each unit's
   equations are equal (primitive, parameters, shapes, literals) and wired alike, read their
   own layer's parameters at the same places, constants made before the first layer, and
   exactly one value of the unit before (the *carry*, the residual stream), always made at the
   same place. Unit 0 reads the prefix's value at the places later units read their carry.
3. ``embed(rest, batch)`` evaluates the equations before unit 0 that make its carry;
   ``layer(p, x)`` evaluates unit 0's equations with ``p`` for layer 0's parameters and ``x``
   for its carry; ``head_loss(rest, x, batch)`` evaluates the equations after the last unit
   with ``x`` for its carry, recomputing what they read from before the first layer (shifted
   labels, say). All three replay the user's own equations, so they compute what the loss does.

Refused, with an ``AutoparError`` naming the equation and its source line: layers that read a
value computed from the batch or the non-layer parameters (a padding mask from the data, a
relative-position bias made by the first layer and shared, tied weights), layers that differ
(units not equal for any ``k``), a head that reads a layer's inner values. The loss must be the
mean over the batch's rows (the pipeline averages microbatch losses), as a training loss is.

A *scanned* model (its layers stacked in one subtree whose leaves share a leading dim ``L``,
run by one ``lax.scan``, as ``flax.linen.scan`` does) is cut at that scan: the embedding is what
makes its carry, the layer is one step of its body, the head is what reads its final carry. The
scan must carry one value, scan over exactly the stacked parameters and close over constants
only.

The params may be any pytree (an ``nnx.State``, an Equinox module): the loss is traced and cut
over their dict view (``autopar.pipeline.model.ParamsView``), where ``nnx.List`` blocks are
``blocks/0 ..`` and an Equinox list of blocks ``blocks/0 ..`` too. A call that wraps the layers
(the loss under ``jax.jit`` or ``eqx.filter_jit``) is inlined before the cut (``_inlined``); any
other equation that reads several layers' parameters (a ``jax.checkpoint`` around the whole
model) is refused, naming it.

``train_step(loss_fn, tx, params)`` is ``autopar.models.adamw_step(loss_fn, tx)`` declaring its
derived ``StagedModel``, so ``autopar.plan(..., pipeline=...)`` and
``@autoparallel(pipeline=...)`` take it.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from autopar.errors import AutoparError
from autopar.pipeline.model import ParamsView, StagedModel, declare, key_names
from autopar.pipeline.unrolled import Stacking, find
from autopar.validate import signature
from ir.replay import read as _read


@dataclasses.dataclass(frozen=True)
class Cut:
    """One trace of the loss, cut into prefix, ``count`` units of ``period`` equations from
    ``start``, and suffix."""

    jaxpr: Any                       # the loss's jaxpr (a ClosedJaxpr's .jaxpr)
    consts: tuple
    start: int
    period: int
    count: int
    x_in: Any                        # unit 0's carry: a variable the prefix makes
    out_at: tuple[int, int]          # (equation offset in a unit, output index) of its carry out
    layer_vars: dict                 # subpath in a layer -> layer 0's invar
    rest_vars: dict                  # path -> invar of a non-layer parameter
    batch_vars: tuple                # the batch's invars, flattened
    scan: Any = None                 # a scanned model's ScanLayer; None: unrolled units

    @property
    def end(self) -> int:
        """The first equation after the layers."""
        return self.start + (1 if self.scan is not None else self.count * self.period)

    def unit(self, i: int) -> range:
        return range(self.start + i * self.period, self.start + (i + 1) * self.period)

    def carry_out(self, i: int):
        if self.scan is not None:
            return self.jaxpr.eqns[self.start].outvars[0]
        off, k = self.out_at
        return self.jaxpr.eqns[self.start + i * self.period + off].outvars[k]


def staged(loss_fn: Callable, tx, params, where: str | None = None,
           name: str = "model") -> StagedModel:
    """The ``StagedModel`` of ``loss_fn(params, batch)`` over the unrolled ``params`` (arrays or
    ``ShapeDtypeStruct``s, the user's layout), with optimizer ``tx``; ``where`` picks the stack
    of layers when the params hold several (``autopar.pipeline.unrolled.find``)."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    view = ParamsView.of(abstract)
    if view is not None:        # an nnx.State, an Equinox module: cut on its dict view
        abstract, user_loss = view.to_dict(abstract), loss_fn

        def loss_fn(params, batch):
            return user_loss(view.from_dict(params), batch)

    try:
        stacking = find(abstract, where)
    except AutoparError as numbered:
        path, count = _stacked_subtree(abstract, where, numbered)
        cuts = _Cuts(loss_fn, abstract, Scanned(path, count))
        return StagedModel(cuts.embed, cuts.layer, cuts.head_loss, path[-1], count, tx,
                           name=name, layers_path=path, view=view)
    stacking = dataclasses.replace(stacking, view=view)
    cuts = _Cuts(loss_fn, abstract, stacking)
    return StagedModel(cuts.embed, cuts.layer, cuts.head_loss, stacking.layers_path[-1],
                       stacking.count, tx, name=name, layers_path=stacking.layers_path,
                       stacking=stacking, view=view)


@dataclasses.dataclass(frozen=True)
class Scanned:
    """Layers already stacked at ``path`` (``count`` of them), which the loss runs with one
    ``lax.scan`` (``flax.linen.scan``): the scan's body is the layer."""

    path: tuple[str, ...]
    count: int


def _stacked_subtree(params, where: str | None, numbered: AutoparError):
    """(path, L) of the one subtree whose leaves (at least two, of rank 2 or more) all have the
    leading dim ``L >= 2``, largest such, or ``where`` if given; else an error naming both
    searches."""
    found = []

    def walk(node, path):
        if not isinstance(node, Mapping):
            return
        leaves = jax.tree_util.tree_leaves(node)
        dims = {getattr(x, "shape", (0,))[:1] for x in leaves}
        stacked = all(len(getattr(x, "shape", ())) >= 2 for x in leaves)   # (L, ...) each
        if len(leaves) >= 2 and len(dims) == 1 and stacked and next(iter(dims))[0] >= 2 \
                and path:
            found.append((path, next(iter(dims))[0]))
            return
        for k, v in node.items():
            walk(v, (*path, str(k)))

    walk(params, ())
    if where is not None:
        found = [f for f in found if "/".join(f[0]) == where]
    if len(found) == 1:
        return found[0]
    what = "; ".join(f"{'/'.join(p)} ({n})" for p, n in found) or "none"
    raise AutoparError(f"{numbered} Nor are they stacked for a scan: subtrees whose leaves "
                       f"all have one leading dim of 2 or more (and rank 2 or more): {what}"
                       + ("; name the one with where=" if found else ""))


def train_step(loss_fn: Callable, tx, params, where: str | None = None, name: str = "model"):
    """``adamw_step(loss_fn, tx)`` (one optax step of ``loss_fn``; ``state = {"params",
    "opt_state"}``) declaring the ``StagedModel`` derived from ``loss_fn``."""
    from autopar.models import adamw_step

    return declare(adamw_step(loss_fn, tx), staged(loss_fn, tx, params, where, name))


class _Cuts:
    """The derived functions; a cut per batch signature (microbatches of different sizes)."""

    def __init__(self, loss_fn: Callable, params, stacking: Stacking):
        self.loss_fn, self.params, self.stacking = loss_fn, params, stacking
        self.by_batch: dict = {}
        self.last_batch = None

    # ---- the StagedModel's functions ---------------------------------------------------------
    def embed(self, rest, batch):
        cut = self._for_batch(batch)
        env = self._inputs(cut, rest, batch)
        _run(cut, _needed(cut.jaxpr.eqns, range(cut.start), [cut.x_in]), env)
        return env[cut.x_in]

    def layer(self, p, x):
        cut = self._for_carry(x)
        if cut.scan is not None:
            return _scan_layer(cut, p, x)
        env = dict(zip(cut.jaxpr.constvars, cut.consts))
        for sub, leaf in _flat(p).items():
            env[cut.layer_vars[sub]] = leaf
        env[cut.x_in] = x
        prefix = _needed(cut.jaxpr.eqns, range(cut.start), _reads(cut, cut.unit(0)),
                         have=set(env))
        _run(cut, prefix, env)
        _run(cut, cut.unit(0), env)
        return env[cut.carry_out(0)]

    def head_loss(self, rest, x, batch):
        cut = self._for_batch(batch)
        env = self._inputs(cut, rest, batch)
        env[cut.carry_out(cut.count - 1)] = x
        tail = range(cut.end, len(cut.jaxpr.eqns))
        loss = cut.jaxpr.outvars[0]
        tail = _needed(cut.jaxpr.eqns, tail, [loss], have=set(env))
        prefix = _needed(cut.jaxpr.eqns, range(cut.start), _reads(cut, tail), have=set(env))
        _run(cut, prefix, env)
        _run(cut, tail, env)
        return _read(env, loss)

    # ---- cuts ---------------------------------------------------------------------------------
    def _for_batch(self, batch) -> Cut:
        avals = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        key = signature(avals, jax.tree_util.tree_leaves(avals))
        if key not in self.by_batch:
            self.by_batch[key] = cut(self.loss_fn, self.params, avals, self.stacking)
        self.last_batch = avals
        return self.by_batch[key]

    def _for_carry(self, x) -> Cut:
        for c in self.by_batch.values():
            if c.x_in.aval.shape == x.shape and c.x_in.aval.dtype == x.dtype:
                return c
        if self.last_batch is None:
            raise AutoparError(f"the derived layer was called on a {x.dtype}{list(x.shape)} "
                               f"input before any batch was seen; call the model's embed "
                               f"first (the pipelined step does)")
        rows = x.shape[0]       # a microbatch of another size: the batch with that many rows
        batch = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype), self.last_batch)
        got = self._for_batch(batch)
        if got.x_in.aval.shape != x.shape:
            raise AutoparError(f"the derived layer's input is {got.x_in.aval.str_short()} for "
                               f"batches of {rows} rows, and it was called on "
                               f"{x.dtype}{list(x.shape)}")
        return got

    def _inputs(self, cut: Cut, rest, batch) -> dict:
        env = dict(zip(cut.jaxpr.constvars, cut.consts))
        for path, leaf in _flat(rest).items():
            if path in cut.rest_vars:
                env[cut.rest_vars[path]] = leaf
        env.update(zip(cut.batch_vars, jax.tree_util.tree_leaves(batch)))
        return env


def cut(loss_fn: Callable, params, batch, stacking) -> Cut:
    """``loss_fn`` traced at ``batch``'s shapes and cut into its layers (module docstring)."""
    closed = jax.make_jaxpr(loss_fn)(params, batch)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    n_params = len(flat)
    closed = _inlined(closed, _layer_group(flat, closed.jaxpr.invars, stacking))
    jaxpr = closed.jaxpr
    if isinstance(stacking, Scanned):
        return _scan_cut(closed, flat, n_params, stacking)
    layer_of, rest_vars, layer_vars = {}, {}, [dict() for _ in range(stacking.count)]
    names = {n: i for i, n in enumerate(stacking.names())}
    depth = len(stacking.parent)
    for (path, _), var in zip(flat, jaxpr.invars[:n_params]):
        keys = key_names(path)
        i = names.get(keys[depth]) if keys[:depth] == stacking.parent and len(keys) > depth \
            else None
        if i is None:
            rest_vars["/".join(keys)] = var
        else:
            layer_of[var] = i
            layer_vars[i]["/".join(keys[depth + 1:])] = var
    if len(jaxpr.outvars) != 1 or jaxpr.outvars[0].aval.shape != ():
        raise AutoparError(f"a pipelined loss returns one scalar; this loss_fn returns "
                           f"{[v.aval.str_short() for v in jaxpr.outvars]}")
    anchors = _anchors(jaxpr, layer_of, stacking.count)
    period = anchors[1] - anchors[0]
    uneven = [i for i in range(1, len(anchors)) if anchors[i] - anchors[i - 1] != period]
    if uneven:
        i = uneven[0]
        raise AutoparError(f"the layers of {stacking.describe()} are not one repeated block in "
                           f"the traced loss: layer {i} starts {anchors[i] - anchors[i - 1]} "
                           f"equations after layer {i - 1}, layer 1 {period} after layer 0; "
                           f"declare a StagedModel by hand (autopar.pipeline.model.declare)")
    if period == 0:
        eqn = jaxpr.eqns[anchors[0]]
        raise AutoparError(f"cannot cut the traced loss into {stacking.describe()}: one "
                           f"equation reads the parameters of layers 0 and 1 "
                           f"({_where(eqn, 'first read')}), so the layers do not run one after "
                           f"the other at the loss's top level; apply the layers one by one in "
                           f"the loss (outside a transformation around several of them), or "
                           f"declare a StagedModel by hand (autopar.pipeline.model.declare)")
    layer_sets = [set(v.values()) for v in layer_vars]
    tr = _Trace(jaxpr, closed.consts, n_params)
    whys = []
    for k in range(min(period, anchors[0] + 1)):
        got, why = _try(tr, anchors[0] - k, period, stacking.count, layer_sets, layer_vars,
                        rest_vars)
        if got is not None:
            return got
        whys.append(why)
    # the reason at the cut nearest the layers' first parameters that got past the carry count
    why = next((w for w in whys if " values cross " not in w), whys[0])
    raise AutoparError(f"cannot cut the traced loss into {stacking.describe()}: {why}; "
                       f"declare a StagedModel by hand (autopar.pipeline.model.declare)")


CALLS = ("pjit", "jit", "closed_call", "core_call")


def _layer_group(flat, invars, stacking) -> dict:
    """Each layer parameter's input variable -> its layer (0 for a scanned model's stack)."""
    if isinstance(stacking, Scanned):
        path, names = stacking.path, {}
    else:
        path, names = stacking.parent, {n: i for i, n in enumerate(stacking.names())}
    out, depth = {}, len(path)
    for (p, _), var in zip(flat, invars):
        keys = key_names(p)
        if keys[:depth] == path and len(keys) > depth:
            i = 0 if isinstance(stacking, Scanned) else names.get(keys[depth])
            if i is not None:
                out[var] = i
    return out


def _inlined(closed, group: dict):
    """The loss's program with every call (a ``jax.jit``, an ``eqx.filter_jit``) that wraps
    the layer stack replaced by its body, until none does: a call that reads the parameters of
    more than one layer, or any of a scanned stack (whose scan must be visible). The cut needs
    the layers' equations at the top level; the values are the same."""
    def wraps(eqn) -> bool:
        if str(eqn.primitive) not in CALLS:
            return False
        seen = {group[v] for v in eqn.invars if isinstance(v, jcore.Var) and v in group}
        return len(seen) > 1 or (seen and len(set(group.values())) == 1)

    while any(wraps(e) for e in closed.jaxpr.eqns):
        closed, group = _inline_once(closed, group, wraps)
    return closed


def _inline_once(closed, group: dict, wraps):
    """``closed`` retraced with the calls ``wraps`` picks (at the top level) inlined; ``group``
    on the new program's inputs."""
    from ir.replay import bind as _bind
    from ir.replay import user_context as _user_context

    def run(jaxpr, consts, args, top: bool):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [_read(env, v) for v in eqn.invars]
            if top and wraps(eqn):
                body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                body = body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, ())
                outs = run(body.jaxpr, body.consts, ins, False)
            else:
                with _user_context(eqn):
                    out = _bind(eqn, ins)
                outs = out if eqn.primitive.multiple_results else [out]
            env.update((v, x) for v, x in zip(eqn.outvars, outs)
                       if not isinstance(v, jcore.DropVar))
        return [_read(env, v) for v in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new = jax.make_jaxpr(lambda *a: run(closed.jaxpr, closed.consts, a, True))(*avals)
    index = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    return new, {new.jaxpr.invars[index[v]]: g for v, g in group.items()}


@dataclasses.dataclass(frozen=True)
class ScanLayer:
    """The scan's body as the layer: ``xs``, per scanned operand, the subpath of the layer
    parameter it is; ``consts``, the scan's constant operands (made from constants alone)."""

    consts: tuple
    xs: tuple[str, ...]


def _scan_cut(closed, flat, n_params: int, scanned: Scanned) -> Cut:
    jaxpr = closed.jaxpr
    depth = len(scanned.path)
    layer_vars, rest_vars = {}, {}
    for (path, _), var in zip(flat, jaxpr.invars[:n_params]):
        keys = key_names(path)
        if keys[:depth] == scanned.path:
            layer_vars[var] = "/".join(keys[depth:])
        else:
            rest_vars["/".join(keys)] = var
    where = "/".join(scanned.path)
    scans = [e for e, eqn in enumerate(jaxpr.eqns) if str(eqn.primitive) == "scan"
             and any(isinstance(v, jcore.Var) and v in layer_vars for v in eqn.invars)]
    readers = [e for e, eqn in enumerate(jaxpr.eqns) if e not in scans and any(
        isinstance(v, jcore.Var) and v in layer_vars for v in eqn.invars)]
    if len(scans) != 1 or readers:
        e = (readers or scans or [None])[0]
        at = _where(jaxpr.eqns[e], "first") if e is not None else "none"
        raise AutoparError(f"the stacked layers at {where} are not read by exactly one scan in "
                           f"the traced loss ({len(scans)} scans read them, {len(readers)} other "
                           f"equations; {at}); declare a StagedModel by hand "
                           f"(autopar.pipeline.model.declare)")
    start = scans[0]
    eqn = jaxpr.eqns[start]
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = (eqn.invars[:nc], eqn.invars[nc:nc + ncarry],
                         eqn.invars[nc + ncarry:])
    tr = _Trace(jaxpr, closed.consts, n_params)
    why = None
    if eqn.params["length"] != scanned.count or eqn.params["reverse"]:
        why = f"it runs {eqn.params['length']} steps (reverse={eqn.params['reverse']})"
    elif ncarry != 1:
        why = f"it carries {ncarry} values (only the residual stream may cross a layer)"
    elif any(not isinstance(v, jcore.Var) or v not in layer_vars for v in xs):
        why = "it also scans over values that are not the layers' parameters"
    elif sorted(layer_vars[v] for v in xs) != sorted(layer_vars.values()):
        why = "it does not scan over every stacked parameter"
    elif any(isinstance(v, jcore.Var) and v not in tr.free for v in consts):
        why = ("its body reads a value computed from the batch or the other parameters (a "
               "padding mask, a shared bias)")
    elif any(not isinstance(v, jcore.DropVar) and i > 0 for i, v in enumerate(eqn.outvars)):
        used = {u for q in jaxpr.eqns[start + 1:] for u in q.invars if isinstance(u, jcore.Var)}
        if any(v in used or v in jaxpr.outvars for v in eqn.outvars[1:]):
            why = "the loss reads the scan's per-layer outputs"
    if why is None and any(isinstance(v, jcore.Var) and v in layer_vars
                           for q in jaxpr.eqns[start + 1:] for v in q.invars):
        why = "a layer parameter is read after the scan"
    if why is not None:
        raise AutoparError(f"cannot run the scan over {where} as pipeline layers: "
                           f"{_where(eqn, why)}; declare a StagedModel by hand "
                           f"(autopar.pipeline.model.declare)")
    layer = ScanLayer(tuple(tr._value(v) if isinstance(v, jcore.Var) else v.val
                            for v in consts), tuple(layer_vars[v] for v in xs))
    return Cut(jaxpr, tr.consts, start, 1, scanned.count, carry[0], (0, 0), {}, rest_vars,
               tr.batch_vars, layer)


def _scan_layer(cut: Cut, p, x):
    """One step of the scan's body: the layer ``p`` on the carry ``x``."""
    eqn = cut.jaxpr.eqns[cut.start]
    body = eqn.params["jaxpr"]
    leaves = _flat(p)
    env = dict(zip(body.jaxpr.constvars, body.consts))
    env.update(zip(body.jaxpr.invars, [*cut.scan.consts, x, *(leaves[s] for s in cut.scan.xs)]))
    _replay(body.jaxpr.eqns, env)
    return _read(env, body.jaxpr.outvars[0])


def _anchors(jaxpr, layer_of: dict, count: int) -> list[int]:
    first = [None] * count
    for e, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            i = layer_of.get(v) if isinstance(v, jcore.Var) else None
            if i is not None and first[i] is None:
                first[i] = e
    missing = [i for i, f in enumerate(first) if f is None]
    if missing:
        raise AutoparError(f"the traced loss reads no parameter of layer {missing[0]}; a "
                           f"pipelined loss uses every layer")
    return first


class _Trace:
    """What every cut of one trace shares: producers, inputs, the values made from constants
    alone (folded to their contents on demand, so that equal masks or tables made per layer
    compare equal)."""

    def __init__(self, jaxpr, consts, n_params: int):
        self.jaxpr, self.consts = jaxpr, tuple(consts)
        self.made = {v: (e, k) for e, eqn in enumerate(jaxpr.eqns)
                     for k, v in enumerate(eqn.outvars)}
        self.inputs = set(jaxpr.invars)
        self.batch_vars = tuple(jaxpr.invars[n_params:])
        self.free = _input_free(jaxpr, len(jaxpr.eqns), self.inputs) | set(jaxpr.constvars)
        self.values = dict(zip(jaxpr.constvars, consts))
        self.keys: dict = {}
        self.labels: dict = {}

    def label(self, e: int) -> tuple:
        if e not in self.labels:
            self.labels[e] = _label(self.jaxpr.eqns[e])
        return self.labels[e]

    def key(self, v) -> tuple:
        if v not in self.keys:
            self.keys[v] = _value_key(self._value(v))
        return self.keys[v]

    def _value(self, v):
        if v not in self.values:
            eqn = self.jaxpr.eqns[self.made[v][0]]
            with jax.ensure_compile_time_eval():
                ins = [u.val if isinstance(u, jcore.Literal) else
                       self._value(u) if used else jnp.zeros(u.aval.shape, u.aval.dtype)
                       for u, used in zip(eqn.invars, _used(eqn))]
                from ir.replay import bind as _bind

                out = _bind(eqn, ins)
            outs = out if eqn.primitive.multiple_results else [out]
            self.values.update(zip(eqn.outvars, outs))
        return self.values[v]


def _try(tr: _Trace, start: int, period: int, count: int, layer_sets, layer_vars, rest_vars):
    """The ``Cut`` with units of ``period`` from ``start``, or ``(None, why not)``."""
    jaxpr, made, free = tr.jaxpr, tr.made, tr.free
    eqns = jaxpr.eqns
    if start + count * period > len(eqns):
        return None, "the last layer runs past the end of the loss"
    wiring, carries = [], []
    for i in range(count):
        first = start + i * period
        own = {v: s for s, v in layer_vars[i].items()}
        wires, carry = [], set()
        for off in range(period):
            eqn = eqns[first + off]
            if all(v in free for v in eqn.outvars):       # folded: its results are compared
                wires.append(("folded",))
                continue
            wire = [tr.label(first + off)]
            for v in eqn.invars:
                if isinstance(v, jcore.Literal):
                    wire.append(("literal", _value_key(v.val)))
                elif v in own:
                    wire.append(("param", own[v]))
                elif v in free:
                    wire.append(("const", tr.key(v)))
                elif v in tr.inputs:
                    return None, _where(eqn, f"layer {i} reads "
                                        f"{_what(v, rest_vars, tr.batch_vars)}")
                elif made[v][0] >= first:
                    wire.append(("in", made[v][0] - first, made[v][1]))
                elif made[v][0] >= first - period and i > 0:
                    carry.add(v)
                    wire.append(("carry",))
                elif made[v][0] < start and i == 0:
                    carry.add(v)
                    wire.append(("carry",))
                elif made[v][0] < start:
                    return None, _where(eqn, f"layer {i} reads a value computed from the "
                                        f"batch or the other parameters before the first "
                                        f"layer (a padding mask, a shared bias)")
                else:
                    return None, _where(eqn, f"layer {i} reads a value of an earlier layer "
                                        f"than the one before it")
            wires.append(tuple(wire))
        if len(carry) > 1 and i == 0:
            makers = "; ".join(_where(eqns[made[v][0]], v.aval.str_short())
                               for v in sorted(carry, key=lambda v: made[v][0]))
            return None, (f"layer 0 reads {len(carry)} values computed before it from the "
                          f"batch or the other parameters, where only the residual stream "
                          f"may cross into a layer (a padding mask, a shared bias must not): "
                          f"{makers}")
        if len(carry) != 1:
            return None, (f"{len(carry)} values cross from layer {i - 1} into layer {i} at "
                          f"this cut (one, the residual stream, may)")
        wiring.append(tuple(wires))
        carries.append(next(iter(carry)))
        if wiring[i] != wiring[0]:      # checked as each layer is read: most cuts fail early
            off = next(o for o in range(period) if wiring[i][o] != wiring[0][o])
            return None, _where(eqns[first + off], f"layer {i} differs from layer 0 here")
    out_at = None
    for i in range(1, count):
        e, k = made[carries[i]]
        at = (e - (start + (i - 1) * period), k)
        if out_at not in (None, at):
            return None, "the layers hand on their carry from different places"
        out_at = at
    if out_at is None:
        return None, "a pipeline needs at least two layers"
    c = Cut(jaxpr, tr.consts, start, period, count, carries[0], out_at, layer_vars[0],
            rest_vars, tr.batch_vars)
    bad = _outside_reads(c, made, set().union(*layer_sets))
    if bad is not None:
        return None, bad
    return c, ""


def _outside_reads(c: Cut, made: dict, layer_params: set) -> str | None:
    """Why the equations before the first layer and after the last cannot be the embedding
    and the head, or None."""
    end = c.start + c.count * c.period
    carry = c.carry_out(c.count - 1)
    for e in (*range(c.start), *range(end, len(c.jaxpr.eqns))):
        eqn = c.jaxpr.eqns[e]
        for v in eqn.invars:
            if not isinstance(v, jcore.Var):
                continue
            if v in layer_params:
                return _where(eqn, "a layer's parameter is read outside its layer (tied to "
                              "the embedding or the head)")
            if e >= end and v is not carry and c.start <= made.get(v, (-1,))[0] < end:
                return _where(eqn, "the head reads a layer's inner value besides the last "
                              "layer's output")
    loss = c.jaxpr.outvars[0]
    if isinstance(loss, jcore.Var) and made.get(loss, (len(c.jaxpr.eqns),))[0] < end:
        return "the loss is computed before the last layer ends"
    return None


def _input_free(jaxpr, end: int, inputs: set) -> set:
    """Variables the first ``end`` equations make from constants alone (an operand a call's
    body never reads, such as the array ``jnp.ones_like`` takes its shape from, is no input)."""
    tainted, free = set(inputs), set()
    for eqn in jaxpr.eqns[:end]:
        dirty = any(isinstance(v, jcore.Var) and v in tainted and used
                    for v, used in zip(eqn.invars, _used(eqn)))
        (tainted if dirty else free).update(eqn.outvars)
    return free


def _used(eqn) -> tuple[bool, ...]:
    """Per operand of ``eqn``: whether its results can depend on its value."""
    inner = eqn.params.get("jaxpr") if str(eqn.primitive) in ("pjit", "jit", "closed_call") \
        else None
    inner = getattr(inner, "jaxpr", inner)
    if not isinstance(inner, jcore.Jaxpr) or len(inner.invars) != len(eqn.invars):
        return (True,) * len(eqn.invars)
    live = {v for v in inner.outvars if isinstance(v, jcore.Var)}
    for e in reversed(inner.eqns):
        if any(v in live for v in e.outvars if not isinstance(v, jcore.DropVar)):
            live.update(v for v, u in zip(e.invars, _used(e))
                        if u and isinstance(v, jcore.Var))
    return tuple(v in live for v in inner.invars)


def _value_key(x) -> tuple:
    """A constant by its contents (two layers' equal rotary tables are one constant)."""
    a = np.asarray(x)
    return str(a.dtype), a.shape, hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def _label(eqn) -> tuple:
    return (str(eqn.primitive), tuple(_param(k, v) for k, v in sorted(eqn.params.items())),
            tuple(v.aval.str_short() for v in eqn.invars),
            tuple(v.aval.str_short() for v in eqn.outvars))


def _param(key, v):
    if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return key, str(v)
    if isinstance(v, (tuple, list)):
        return key, tuple(_param(None, x)[1] for x in v)
    if callable(v):
        return key, type(v).__name__
    return key, repr(v)


def _what(v, rest_vars: dict, batch_vars: tuple) -> str:
    for path, r in rest_vars.items():
        if r is v:
            return f"the parameter {path}, which is not one of its own"
    if v in batch_vars:
        return f"batch input {batch_vars.index(v)} directly"
    return "an input that is not its own parameter"


def _where(eqn, why: str) -> str:
    src = ""
    try:
        from jax._src import source_info_util as siu

        src = f" ({siu.summarize(eqn.source_info)})"
    except Exception:    # private module; the message stands without the line
        pass
    return f"{why}: {eqn.primitive}{src}"


def _needed(eqns, where: range, wanted, have=frozenset()) -> list[int]:
    """The equations of ``where`` (in order) that ``wanted`` depends on, stopping at ``have``."""
    made = {}
    for e in where:
        for v in eqns[e].outvars:
            made[v] = e
    keep, stack = set(), [v for v in wanted if isinstance(v, jcore.Var)]
    while stack:
        v = stack.pop()
        e = made.get(v)
        if e is None or e in keep or v in have:
            continue
        keep.add(e)
        stack.extend(u for u, used in zip(eqns[e].invars, _used(eqns[e]))
                     if used and isinstance(u, jcore.Var))
    return sorted(keep)


def _reads(cut: Cut, eqns) -> list:
    return [v for e in eqns for v in cut.jaxpr.eqns[e].invars if isinstance(v, jcore.Var)]


def _run(cut: Cut, eqns, env: dict) -> None:
    _replay([cut.jaxpr.eqns[e] for e in eqns], env)


def _replay(eqns, env: dict) -> None:
    """Bind ``eqns`` in order on the values in ``env``, adding their results to it."""
    from ir.replay import bind as _bind
    from ir.replay import user_context as _user_context

    for eqn in eqns:
        ins = [_read(env, v) if used or not isinstance(v, jcore.Var) or v in env
               else jnp.zeros(v.aval.shape, v.aval.dtype)     # never read
               for v, used in zip(eqn.invars, _used(eqn))]
        with _user_context(eqn):        # the HLO's metadata names the user's line
            out = _bind(eqn, ins)
        outs = out if eqn.primitive.multiple_results else [out]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x


def _flat(tree) -> dict:
    return {"/".join(key_names(p)): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
