"""A model as pipeline stages see it: an embedding, a stack of identical layers, a head and loss.

``StagedModel`` is what the pipelined step (``autopar.pipeline.runtime``) runs: the parameters
split into the stacked layers (a leading layer axis ``L``, as ``flax.linen.scan`` stacks them)
and the rest (embedding, head), and three pure functions over them. An unrolled model's numbered
layers are stacked into that layout (``autopar.pipeline.unrolled``). A step built with
``gpt_train_step`` (or ``autopar.pipeline.hf.gpt2_train_step``) carries its ``StagedModel``
(``staged_model_of``), which is how ``autopar.plan(..., pipeline=...)`` learns the layer
structure of a step; ``autopar.pipeline.derive`` cuts one out of any loss function over
numbered layers (the step is then that loss's optax step).

The parameters sit in the training state at ``params_path`` (``"params"`` of a dict by
default; wherever the user's ``autopar.value_and_grad`` found them otherwise). Parameters that
are not string-keyed dicts (an ``nnx.State``, an Equinox module) are seen through their dict
view (``ParamsView``): the model's functions, stacking and layouts use it, the user's step its
own tree.

Shapes: ``b`` rows of one microbatch, ``S`` sequence, ``D`` model width.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from autopar.errors import AutoparError

ATTRIBUTE = "__autopar_staged_model__"


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """``embed(rest, batch_mb) -> x`` (b, S, D); ``layer(layer_params, x) -> x``;
    ``head_loss(rest, x, batch_mb) -> scalar`` (the microbatch's mean loss); ``layers_key``: the
    key of the stacked layer parameters in the params dict; ``tx``: the optax optimizer."""

    embed: Callable
    layer: Callable
    head_loss: Callable
    layers_key: str
    num_layers: int
    tx: Any
    name: str = "model"
    # "module/param" -> the dim (after the layer axis) a tensor-parallel axis splits inside a
    # stage (Megatron-LM's layout); parameters not named stay whole on each stage.
    tensor_dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # The key path of the stacked layers when they are not a top-level key (HF GPT-2's
    # ("transformer", "h")); () means (layers_key,).
    layers_path: tuple[str, ...] = ()
    # An unrolled model's ``autopar.pipeline.unrolled.Stacking``: how its numbered layers
    # stack; the pipelined step runs on the stacked layout. None: the params are stacked.
    stacking: Any = None
    # The user's own step after its ``autopar.value_and_grad`` (``autopar.pipeline.user``):
    # ``post(state, batch, loss, grads) -> (state, loss)``, run where the runtimes otherwise run
    # ``tx``'s update. None: a declared step, updated by ``tx``.
    post: Any = None
    # Where the parameters are in the state (key names, ``key_names``; () for the state itself):
    # the subtree the user's step differentiates (``autopar.pipeline.user``).
    params_path: tuple[str, ...] = ("params",)
    # Parameters that are not nested dicts of string keys (an ``nnx.State``, an Equinox module,
    # a tuple): their ``ParamsView``. The functions above take the dict view; ``split`` takes
    # the user's tree and ``join`` gives it back. None: the params are such dicts already.
    view: Any = None

    def _path(self) -> tuple[str, ...]:
        return self.layers_path or (self.layers_key,)

    def params_of(self, state):
        """The parameters in a training state (``params_path``)."""
        return params_at(state, self.params_path)

    def split(self, params) -> tuple[Any, dict]:
        """(stacked layer params, the rest), both in the dict view. ``params`` in the runtime's
        layout: the user's tree, or an unrolled model's stacked dict (``stacking``)."""
        if self.view is not None and self.stacking is None:
            params = self.view.to_dict(params)
        return _pop(params, self._path())

    def join(self, layers, rest: dict):
        """``split``'s inverse: the parameters (or gradients) in the runtime's layout."""
        joined = _put(rest, self._path(), layers)
        if self.view is not None and self.stacking is None:
            return self.view.from_dict(joined)
        return joined

    def loss(self, params: dict, batch: dict):
        """The unpipelined loss, for tests and the reference."""
        layers, rest = self.split(params)
        x = self.embed(rest, batch)
        x, _ = jax.lax.scan(lambda h, p: (self.layer(p, h), None), x, layers)
        return self.head_loss(rest, x, batch)


def _pop(tree: dict, path: tuple[str, ...]):
    head, *tail = path
    if not tail:
        return tree[head], {k: v for k, v in tree.items() if k != head}
    got, inner = _pop(tree[head], tuple(tail))
    return got, {**tree, head: inner}


def _put(tree: dict, path: tuple[str, ...], value) -> dict:
    head, *tail = path
    return {**tree, head: _put(tree[head], tuple(tail), value) if tail else value}


def key_names(path) -> tuple[str, ...]:
    """A jax key path (dict keys, attributes, indices) as strings: ``("opt_state", "0", "mu")``,
    as ``autopar.strategies.roles.path_keys`` reads a key path's string."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def children(node) -> list[tuple[str, Any]]:
    """``(key name, child)`` of a pytree node's direct children (none for a leaf); a ``None``
    child (an empty subtree) is listed too."""
    if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(node)) and node is not None:
        return []
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(key_names(p)[0], child) for p, child in flat]


def get_path(tree, path: tuple[str, ...]):
    """The subtree of any pytree at a path of key names (``key_names``)."""
    for name in path:
        kids = dict(children(tree))
        if name not in kids:
            raise AutoparError(f"no subtree {name!r} below {'/'.join(path)!r}: the tree there "
                               f"is a {type(tree).__name__} with {sorted(kids)[:12]}")
        tree = kids[name]
    return tree


def set_path(tree, path: tuple[str, ...], value):
    """``tree`` with the subtree at ``path`` (key names) replaced by ``value``, its nodes'
    types kept."""
    if not path:
        return value
    flat, tdef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    names = [key_names(p)[0] for p, _ in flat]
    if path[0] not in names:
        raise AutoparError(f"no subtree {path[0]!r} in a {type(tree).__name__} with "
                           f"{sorted(names)[:12]}")
    return jax.tree_util.tree_unflatten(tdef, [
        set_path(child, path[1:], value) if n == path[0] else child
        for n, (_, child) in zip(names, flat)])


def params_at(state, path: tuple[str, ...] = ("params",)):
    """The parameters at ``path`` in a training state, else an error naming what is there."""
    try:
        return get_path(state, path)
    except AutoparError as e:
        raise AutoparError(f"a pipelined step's state holds its parameters at "
                           f"{'/'.join(path) or 'the top'} (where the step's "
                           f"autopar.value_and_grad found them, or 'params' of a declared "
                           f"step's dict); this state has none there ({e}); pass the state "
                           f"the step was planned for") from None


@dataclasses.dataclass(frozen=True)
class ParamsView:
    """A parameter tree of any pytree type as nested dicts keyed by its key names
    (``key_names``) and back: ``nnx.State`` ``blocks/0/attn/kernel/value``, an Equinox module's
    ``blocks/0/attn/query_proj/weight``. The pipeline's functions, stacking and layouts work on
    the dict view; the user's step sees its own tree. ``paths``: each leaf's key names in the
    tree's flattening order; ``tree``: its structure."""

    paths: tuple[tuple[str, ...], ...]
    tree: Any

    def __repr__(self) -> str:
        return f"ParamsView({len(self.paths)} leaves of a {self.tree.node_data()[0].__name__})"

    @staticmethod
    def of(params) -> ParamsView | None:
        """The view of ``params``, or None when the params are string-keyed dicts already (the
        view would be the tree itself)."""
        flat, tree = jax.tree_util.tree_flatten_with_path(params)
        view = ParamsView(tuple(key_names(p) for p, _ in flat), tree)
        if len(set(view.paths)) != len(view.paths):
            seen = [p for p in view.paths if view.paths.count(p) > 1][0]
            raise AutoparError(f"two parameters have the key path {'/'.join(seen)} (keys that "
                               f"differ only in type, like 0 and '0'); give them distinct keys")
        as_dict = view.to_dict(params)
        return None if jax.tree_util.tree_structure(as_dict) == tree else view

    def to_dict(self, tree) -> dict:
        out: dict = {}
        for path, leaf in zip(self.paths, self.tree.flatten_up_to(tree)):
            node = out
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = leaf
        return out

    def from_dict(self, d) -> Any:
        leaves = []
        for path in self.paths:
            node = d
            for k in path:
                node = node[k]
            leaves.append(node)
        return jax.tree_util.tree_unflatten(self.tree, leaves)

    def is_user(self, tree) -> bool:
        """Whether ``tree`` has the user's structure (not the dict view)."""
        return jax.tree_util.tree_structure(tree) == self.tree


def tensor_dim(tensor_dims: Mapping[str, int], keys) -> int | None:
    """The dim ``tensor_dims`` names for a parameter at path ``keys``: by its last three keys
    first ("mlp/c_proj/kernel"), then its last two ("fc1/kernel")."""
    keys = tuple(keys)
    return tensor_dims.get("/".join(keys[-3:]), tensor_dims.get("/".join(keys[-2:])))


def staged_model_of(step: Callable, args=None) -> StagedModel:
    """The ``StagedModel`` a step declares, or, given its ``args`` ``(state, batch)``, the one cut
    from its ``autopar.value_and_grad`` call (``autopar.pipeline.user``); else an
    ``AutoparError`` naming how to get one."""
    model = getattr(step, ATTRIBUTE, None)
    if model is None:
        from autopar.pipeline import user

        model = user.declared(step)
        if model is None and args is not None:
            model = user.staged(step, *args)
    if model is None:
        name = getattr(step, "__name__", type(step).__name__)
        raise AutoparError(
            f"pipeline= needs a step that declares its layers, and {name} does not: call "
            f"the loss as autopar.value_and_grad(loss_fn)(params, batch) in place of "
            f"jax.value_and_grad, params any subtree of the state (state['params'], "
            f"state[0]) (the step is then cut at that call), build it "
            f"from its loss with autopar.pipeline.derive.train_step(loss_fn, tx, params) "
            f"(stages cut from the loss's traced program, for a model that loops over "
            f"numbered layers), with autopar.pipeline.model.gpt_train_step(cfg) for "
            f"autopar's GPT, or attach a StagedModel with "
            f"autopar.pipeline.model.declare(step, model); a plain jax.grad or "
            f"jax.value_and_grad is not cut into stages")
    return model


def declare(step: Callable, model: StagedModel) -> Callable:
    setattr(step, ATTRIBUTE, model)
    return step


def gpt_staged(cfg, lr: float = 1e-3) -> StagedModel:
    """``StagedModel`` of autopar's GPT (``autopar.models.gpt``), with the adamw optimizer
    ``make_train_step`` uses; the same flax modules compute the same values. With
    ``scan=False`` its layers ``layer_0 ..`` are found in the params and stacked
    (``autopar.pipeline.unrolled``)."""
    import flax.linen as nn
    import optax

    from autopar.models import gpt

    block = gpt.Block(dataclasses.replace(cfg, scan=False))
    if cfg.remat:
        block = gpt.remat_block(gpt.Block, cfg.remat)(dataclasses.replace(cfg, scan=False))
    wte = nn.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype)
    ln_f = nn.LayerNorm(dtype=cfg.dtype)
    head = nn.Dense(cfg.vocab, use_bias=False, dtype=cfg.dtype)

    def embed(rest, batch):
        tokens = batch["tokens"]                                        # (b, S)
        x = wte.apply({"params": rest["wte"]}, tokens)                  # (b, S, D)
        return x + rest["wpe"][None, : tokens.shape[1]].astype(cfg.dtype)

    def layer(p, x):
        return block.apply({"params": p}, x)

    def head_loss(rest, x, batch):
        x = ln_f.apply({"params": rest["ln_f"]}, x)
        logits = head.apply({"params": rest["lm_head"]}, x)             # (b, S, V)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()

    tx = optax.adamw(lr, weight_decay=0.01)
    model = StagedModel(embed, layer, head_loss, "layers", cfg.layers, tx, name="gpt",
                        tensor_dims=MEGATRON_GPT)
    if cfg.scan:
        return model
    from autopar.pipeline.unrolled import unrolled

    tokens = jax.ShapeDtypeStruct((1, cfg.seq), jnp.int32)
    params = jax.eval_shape(gpt.GPT(cfg).init, jax.random.PRNGKey(0), tokens)["params"]
    return unrolled(model, params)


# Megatron-LM inside a stage: heads of qkv and out, the hidden dim of the MLP.
MEGATRON_GPT = {"qkv/kernel": 2, "out/kernel": 0, "fc1/kernel": 1, "fc1/bias": 0,
                "fc2/kernel": 0}


def gpt_train_step(cfg, lr: float = 1e-3):
    """``(train_step, init_state)`` of ``autopar.models.gpt.make_train_step`` with the step's
    ``StagedModel`` attached, so ``autopar.plan(step, ..., pipeline=...)`` can pipeline it.
    With ``scan=False`` the step and its state are the unrolled model's; the pipelined step
    runs on their stacked layout (``step.stack_state``)."""
    from autopar.models import gpt

    step, init = gpt.make_train_step(cfg, lr)
    return declare(step, gpt_staged(cfg, lr)), init
