"""The user's own training step, pipelined: ``autopar.value_and_grad`` in place of
``jax.value_and_grad`` is the one marker it asks for.

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    run = autopar.autoparallel(step, mesh={"stage": 2, "data": 2, "model": 2},
                               pipeline="auto")

Outside a pipeline the marker is ``jax.value_and_grad`` (the step runs, plans and traces as
written). With ``pipeline=``, the step is traced once (``jax.make_jaxpr``) and cut at the marked
call:

1. the loss the marker was given is cut into embedding, layers and head
   (``autopar.pipeline.derive.staged``: numbered layers or one ``lax.scan`` over stacked ones);
2. what the step does with the loss and gradients (the user's optax code, metrics) is the rest
   of the traced program after the marked call, replayed as it was traced (``post``). The
   pipeline runtimes run it where they ran the declared step's optimizer: in the lockstep
   step's one program, or as the MPMD runtime's one program over the whole mesh.

The parameters are the subtree of the state that the marked call takes as its first argument,
as the step received it: ``state["params"]``, ``state[0]`` of a ``(params, opt_state)`` tuple,
``state["model"]`` beside other entries, or the whole state (``_located`` finds it among the
traced step's inputs; ``StagedModel.params_path`` records where). Its type is the user's: an
``nnx.State`` from ``nnx.split``, an Equinox module from ``eqx.partition``, nested dicts; the
pipeline cuts, stacks and lays out its dict view (``autopar.pipeline.model.ParamsView``), and
``post`` sees the user's own tree. Flax NNX, as its functional API teaches::

    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        return xent(nnx.merge(graphdef, params)(batch["tokens"]), batch["targets"])

    def step(state, batch):                   # state = (params, opt_state)
        params, opt_state = state
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

and Equinox alike (``params, static = eqx.partition(model, eqx.is_array)``, the loss
``eqx.combine(params, static)``). The marked call's other argument must be the step's whole
batch (the pipeline splits it into microbatches), and the step must return ``(state, loss)``
with the state in the structure it was given. An unrolled model's state runs in its stacked
layout (``step.stack_state``; its first call converts the user's), its ``post`` replayed on the
user's layout inside the same program (``unrolled.stacked_step``); ``step.unstack_state`` gives
the user's tree back. A scanned model's state keeps the user's layout throughout.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore

from autopar.errors import AutoparError
from autopar.pipeline.model import key_names

MARK = "autopar_value_and_grad_"
# token -> the loss a marked call differentiates; the token is in the marked program's name, so
# a traced step names its loss even where jax reuses a cached trace of it
_losses: dict[int, Callable] = {}
_tokens: dict[int, int] = {}
# token -> (tree of its first argument, tree of the others, their count) as last traced
_trees: dict[int, tuple] = {}


def value_and_grad(fun: Callable, argnums: int = 0, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad(fun)``, marked so that a pipelined ``autoparallel`` finds the loss
    in the user's step (module docstring). ``argnums`` must be 0 and ``has_aux`` False: the
    pipeline differentiates the parameters, the first argument."""
    if argnums != 0 or has_aux:
        raise AutoparError(f"autopar.value_and_grad(fun, argnums={argnums!r}, "
                           f"has_aux={has_aux!r}): the pipeline differentiates the loss with "
                           f"respect to its first argument (the parameters) and takes no aux "
                           f"output; use argnums=0, has_aux=False, or jax.value_and_grad "
                           f"outside a pipelined step")
    token = _tokens.setdefault(id(fun), len(_tokens))
    _losses[token] = fun
    vg = jax.value_and_grad(fun)

    def marked(*args):
        _trees[token] = (jax.tree_util.tree_structure(args[0]),
                         jax.tree_util.tree_structure(args[1:]), len(args))
        return vg(*args)

    marked.__name__ = marked.__qualname__ = f"{MARK}{token}"
    return jax.jit(marked)


@dataclasses.dataclass(frozen=True)
class Split:
    """A user's step cut at its marked call: ``loss_fn`` and ``post(state, batch, loss,
    grads) -> the step's outputs``."""

    loss_fn: Callable
    post: Callable
    params_path: tuple[str, ...] = ("params",)    # key names of the parameters in the state


def split(step: Callable, state, batch) -> Split | None:
    """The user's ``step`` traced at ``(state, batch)`` and cut at its ``autopar.value_and_grad``
    call; ``None`` when it has none. An ``AutoparError`` for a marked call the pipeline cannot
    take (module docstring)."""
    abstract = jax.eval_shape(lambda args: args, (state, batch))
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*abstract)
    closed = _unwrapped(closed)
    jaxpr = closed.jaxpr
    at = [i for i, e in enumerate(jaxpr.eqns) if _token(e) is not None]
    if not at:
        if _nested(jaxpr):
            raise AutoparError("autopar.value_and_grad was called inside another "
                               "transformation of the step (a jit, scan or cond around it); "
                               "call it at the step's top level")
        return None
    if len(at) > 1:
        raise AutoparError(f"the step calls autopar.value_and_grad {len(at)} times; a pipelined "
                           f"step differentiates one loss")
    eqn = jaxpr.eqns[at[0]]
    path = _located(jaxpr, eqn, abstract, _trees.get(_token(eqn)))
    info = jaxpr.debug_info
    if info is not None and info.arg_names is not None:   # names for the added inputs too
        try:
            info = info._replace(arg_names=(*info.arg_names, *(
                f"value_and_grad output {i}" for i in range(len(eqn.outvars)))))
        except AttributeError:      # another jax's DebugInfo: go without names
            info = None
    post_fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jcore.Jaxpr(
        jaxpr.constvars, [*jaxpr.invars, *eqn.outvars],
        jaxpr.outvars, [e for i, e in enumerate(jaxpr.eqns) if i != at[0]], jaxpr.effects,
        debug_info=info), closed.consts))
    out_tree = jax.tree_util.tree_structure(out_shape)
    if out_tree.num_leaves < 1 or not (isinstance(out_shape, tuple) and len(out_shape) == 2):
        raise AutoparError("a pipelined step must return (state, loss)")
    if jax.tree_util.tree_structure(abstract[0]) != jax.tree_util.tree_structure(out_shape[0]):
        raise AutoparError(f"a pipelined step returns its state in the layout it was given (the "
                           f"pipeline keeps it in place between steps), and this one does not: "
                           f"{_differs(abstract[0], out_shape[0])}; return the new state with "
                           f"the same structure")

    def post(state, batch, loss, grads):
        leaves = [*jax.tree_util.tree_leaves((state, batch)), loss,
                  *jax.tree_util.tree_leaves(grads)]
        outs = post_fn(*leaves)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return Split(_losses[_token(eqn)], post, path)


def _differs(given, got) -> str:
    """Where two trees' structures first differ, in words."""
    paths = [[jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
             for t in (given, got)]
    for a, b in zip(*paths):
        if a != b:
            return f"the state's leaf state{a} comes back as state{b}"
    n, m = map(len, paths)
    if n != m:
        return f"it was given {n} leaves and returns {m}"
    return (f"its node types differ (given {type(given).__name__}, returned "
            f"{type(got).__name__}, or a node below)")


def _located(jaxpr, eqn, abstract, trees) -> tuple[str, ...]:
    """The key names of the subtree of the step's state that the marked call takes as its
    first argument (the parameters), its other argument being the step's batch; else an
    ``AutoparError`` naming what it takes."""
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    where = {id(v): jax.tree_util.keystr(p) for v, (p, _) in zip(jaxpr.invars, flat)}
    n_state = len(jax.tree_util.tree_leaves(abstract[0]))
    batch = list(jaxpr.invars[n_state:])
    got = list(eqn.invars)
    first = trees[0].num_leaves if trees is not None else len(got) - len(batch)
    seen = ", ".join(where.get(id(v), "a value the step computed") for v in got[:3])
    usage = (f"autopar.value_and_grad(loss)(...) must be called on (state['params'], batch) "
             f"as the step received them, or with another subtree of the state in place of "
             f"state['params'] (state[0], state.params: the parameters), and the step's whole "
             f"batch (the pipeline splits exactly those); its arguments here start with "
             f"{seen}")
    rest = got[first:]
    if trees is not None and (trees[1] != jax.tree_util.tree_structure((abstract[1],))):
        raise AutoparError(f"{usage}; it takes {trees[2]} arguments, and those after the "
                           f"parameters are not the step's batch: call it as "
                           f"loss(params, batch)")
    if len(rest) != len(batch) or any(a is not b for a, b in zip(rest, batch)):
        raise AutoparError(usage)
    ids = {id(v): i for i, v in enumerate(jaxpr.invars[:n_state])}
    pos = [ids.get(id(v)) for v in got[:first]]
    if not pos or None in pos or pos != list(range(pos[0], pos[0] + first)):
        raise AutoparError(usage)
    paths = [flat[i][0][1:] for i in pos]          # key paths below the state
    common = paths[0]
    for p in paths[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common),
                                                                              len(p)))
        common = common[:n]
    for n in range(len(common), -1, -1):        # the subtree with exactly those leaves
        sub = _subtree(abstract[0], common[:n])
        tree = jax.tree_util.tree_structure(sub)
        if tree.num_leaves == first and (trees is None or tree == trees[0]):
            return key_names(common[:n])
    raise AutoparError(usage)


def _subtree(tree, keypath):
    for key in keypath:
        tree = next(c for p, c in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x, t=tree: x is not t)[0] if p[0] == key)
    return tree


def _unwrapped(closed):
    """A jitted step's own program: the body of a ``jit`` that is the whole traced step."""
    while (len(closed.jaxpr.eqns) == 1 and _token(closed.jaxpr.eqns[0]) is None
           and closed.jaxpr.eqns[0].primitive.name in ("pjit", "jit")
           and list(closed.jaxpr.eqns[0].invars) == list(closed.jaxpr.invars)
           and list(closed.jaxpr.eqns[0].outvars) == list(closed.jaxpr.outvars)):
        closed = closed.jaxpr.eqns[0].params["jaxpr"]
    return closed


def _token(eqn) -> int | None:
    """The loss token of a marked call's equation, else None."""
    name = str(eqn.params.get("name", ""))
    if eqn.primitive.name in ("pjit", "jit") and name.startswith(MARK):
        return int(name[len(MARK):])
    return None


def _nested(jaxpr) -> bool:
    """Whether a marked call sits inside another equation's sub-program."""
    for e in jaxpr.eqns:
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jcore.Jaxpr) and (
                        any(_token(x) is not None for x in inner.eqns) or _nested(inner)):
                    return True
    return False


def staged(step: Callable, state, batch) -> Any | None:
    """The ``StagedModel`` of a user's step marked with ``autopar.value_and_grad``: its loss cut
    into stages (``derive.staged``), the rest of the step as its ``post``; declared on ``step``
    for later calls. ``None`` when the step has no marked call."""
    from autopar.pipeline.derive import staged as derive_staged
    from autopar.pipeline.model import declare, get_path

    cut = split(step, state, batch)
    if cut is None:
        return None
    params = get_path(state, cut.params_path)
    model = derive_staged(cut.loss_fn, None, params)
    model = dataclasses.replace(model, params_path=cut.params_path)
    if model.stacking is not None:
        model = dataclasses.replace(model, stacking=dataclasses.replace(
            model.stacking, params_path=cut.params_path))
    post = cut.post
    if model.stacking is not None:      # the runtime's stacked layout, the step's own inside
        stacking = model.stacking

        def post(state, batch, loss, grads, _post=cut.post):
            new, out_loss = _post(stacking.unstack_state(state), batch, loss,
                                  stacking.unstack(grads))
            return stacking.stack_state(new), out_loss

    model = dataclasses.replace(model, post=post)
    try:
        declare(step, model)
    except (AttributeError, TypeError):   # a step that takes no attributes (a jax.jit object)
        _declared[id(step)] = (step, model)
    return model


_declared: dict[int, tuple] = {}        # id(step) -> (step, model) for such steps


def declared(step: Callable):
    """The model ``staged`` cut for ``step`` where the step took no attribute, else None."""
    hit = _declared.get(id(step))
    return hit[1] if hit is not None and hit[0] is step else None
