"""Flax NNX and Equinox training steps pipelined as their libraries teach them
(``autopar.pipeline.user``): the parameters are an ``nnx.State`` from ``nnx.split`` or the
arrays of an Equinox module from ``eqx.partition``, somewhere in a state that is a tuple or a
dict, the loss merges or combines them with the static half it closes over, and the layers are
a list of blocks (unrolled) or one block stacked by ``nnx.vmap`` / ``eqx.filter_vmap`` and run
by ``nnx.scan`` / ``lax.scan``. Each is run by the pipeline runtimes and compared with the
unsharded step."""
import jax
import jax.numpy as jnp
import optax
import pytest
from numerics import FLOOR_REL, assert_loss, assert_params, assert_scaled

import autopar
from autopar.errors import AutoparError

LR = 1e-3
VOCAB, SEQ, WIDTH, HEADS, FF, LAYERS, ROWS = 32, 8, 16, 2, 32, 4, 8
MESH = {"stage": 2, "data": 2, "model": 2}


def _batch():
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {"tokens": jax.random.randint(k1, (ROWS, SEQ), 0, VOCAB, jnp.int32),
            "targets": jax.random.randint(k2, (ROWS, SEQ), 0, VOCAB, jnp.int32)}


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---- Flax NNX: nnx.split / nnx.merge, as the NNX docs' functional API --------------------------
def nnx_lm(scan: bool):
    """``(loss_fn, params)``: a decoder whose blocks are an ``nnx.List`` (unrolled) or one block
    made by ``nnx.vmap`` and run by ``nnx.scan`` (the NNX guide's scan over layers)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = nnx.Linear(WIDTH, FF, rngs=rngs)
            self.down = nnx.Linear(FF, WIDTH, rngs=rngs)

        def __call__(self, x):                                       # (B, S, D)
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            if scan:
                @nnx.split_rngs(splits=LAYERS)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def blocks(rngs):
                    return Block(rngs)

                self.blocks = blocks(rngs)
            else:
                self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

        def __call__(self, tokens):                                  # (B, S)
            x = self.embed(tokens)                                   # (B, S, D)
            if scan:
                @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                def forward(x, block):
                    return block(x)

                x = forward(x, self.blocks)
            else:
                for block in self.blocks:
                    x = block(x)
            return self.head(self.ln(x))                             # (B, S, V)

    graphdef, params = nnx.split(LM(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return _xent(model(batch["tokens"]), batch["targets"])

    return loss_fn, params


# ---- Equinox: eqx.partition / eqx.combine, one example under jax.vmap ---------------------------
def eqx_lm(scan: bool):
    """``(loss_fn, params)``: a decoder whose blocks are a list (unrolled) or one block made by
    ``eqx.filter_vmap`` and run by ``lax.scan`` (Equinox's FAQ on scanning over layers)."""
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1 = eqx.nn.LayerNorm(WIDTH)
            self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
            self.ln2 = eqx.nn.LayerNorm(WIDTH)
            self.up = eqx.nn.Linear(WIDTH, FF, key=k2)
            self.down = eqx.nn.Linear(FF, WIDTH, key=k3)

        def __call__(self, x):                                       # (S, D)
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            y = jax.vmap(self.ln1)(x)
            x = x + self.attn(y, y, y, mask=mask)
            y = jax.vmap(self.ln2)(x)
            return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(y)

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: object
        ln: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            k0, k1, k2 = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k0)
            keys = jax.random.split(k2, LAYERS)
            self.blocks = (eqx.filter_vmap(Block)(keys) if scan
                           else [Block(k) for k in keys])
            self.ln = eqx.nn.LayerNorm(WIDTH)
            self.head = eqx.nn.Linear(WIDTH, VOCAB, key=k1)

        def __call__(self, tokens):                                  # (S,)
            x = jax.vmap(self.embed)(tokens)                         # (S, D)
            if scan:
                dynamic, static = eqx.partition(self.blocks, eqx.is_array)

                def f(x, layer):
                    return eqx.combine(layer, static)(x), None

                x, _ = jax.lax.scan(f, x, dynamic)
            else:
                for block in self.blocks:
                    x = block(x)
            return jax.vmap(lambda t: self.head(self.ln(t)))(x)      # (S, V)

    params, static = eqx.partition(LM(jax.random.PRNGKey(0)), eqx.is_array)

    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        return _xent(jax.vmap(model)(batch["tokens"]), batch["targets"])

    return loss_fn, params


# ---- the users' steps -----------------------------------------------------------------------
def tuple_step(loss_fn, tx):
    """``state = (params, opt_state)``, as the NNX and Equinox examples keep them."""
    def step(state, batch):
        params, opt_state = state
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, lambda params: (params, tx.init(params))


def dict_step(loss_fn, tx):
    """A dict state whose parameters are not under "params", with a step counter beside them."""
    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["model"], batch)
        updates, opt = tx.update(grads, state["opt"], state["model"])
        return {"model": optax.apply_updates(state["model"], updates), "opt": opt,
                "step": state["step"] + 1}, loss

    return step, lambda params: {"model": params, "opt": tx.init(params),
                                 "step": jnp.zeros((), jnp.int32)}


def _parts(state):
    """(params, Adam's state) of either layout."""
    if isinstance(state, dict):
        return state["model"], state["opt"][0]
    return state[0], state[1][0]


def _top(tree) -> float:
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(tree))


def _same(new, loss, ref, ref_loss):
    assert_loss(loss, ref_loss)
    (params, adam), (ref_params, ref_adam) = _parts(new), _parts(ref)
    # a key bias's gradient is zero in exact arithmetic: its leaf is rounding noise, held to a
    # floor of the step's largest moment (numerics.FLOOR_REL) rather than its own scale
    assert_scaled(adam.mu, ref_adam.mu, rel=1e-5, atol=FLOOR_REL * _top(ref_adam.mu))
    assert_scaled(adam.nu, ref_adam.nu, rel=2e-5, atol=FLOOR_REL * _top(ref_adam.nu))
    assert_params(params, ref_params, LR, grads=ref_adam.mu)


CASES = {   # name: (model, scan, step)
    "nnx_unrolled": (nnx_lm, False, tuple_step),
    "nnx_scanned": (nnx_lm, True, dict_step),
    "eqx_unrolled": (eqx_lm, False, dict_step),
    "eqx_scanned": (eqx_lm, True, tuple_step),
}


def _pipelined(step, state, runtime: str):
    """The step pipelined and run twice, checked against the unsharded step each time; the
    first call's (state, plan)."""
    batch = _batch()
    ref, ref_loss = jax.jit(step)(state, batch)
    run = autopar.autoparallel(step, mesh=jax.make_mesh(tuple(MESH.values()), tuple(MESH)),
                               pipeline={"schedule": "1f1b", "microbatches": 2,
                                         "runtime": runtime})
    new, loss = run(state, batch)
    pp = run.plan.pipeline
    assert (pp.runtime, pp.stages) == (runtime, 2)
    assert [a for a, _ in pp.layer_ranges[1:]] == [b for _, b in pp.layer_ranges[:-1]]
    assert (pp.layer_ranges[0][0], pp.layer_ranges[-1][1]) == (0, LAYERS)   # every layer cut
    mine = run.unstack_state(new)
    tree = jax.tree_util.tree_structure
    assert tree(mine) == tree(state)
    _same(mine, loss, ref, ref_loss)
    again, loss2 = run(new, batch)                  # a second call takes what the first returned
    ref2, ref_loss2 = jax.jit(step)(ref, batch)
    assert_loss(loss2, ref_loss2)
    assert tree(run.unstack_state(again)) == tree(state)
    return new


@pytest.mark.parametrize("runtime", ["lockstep", "mpmd"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_users_step_pipelines(case, runtime):
    """The step as written, pipelined on 2 stages x 2 data x 2 tensor devices with the unsharded
    step's numbers, twice; the state comes back in the user's own layout (an unrolled model's
    as the stacked layout the pipeline keeps, which ``unstack_state`` turns back into it)."""
    pytest.importorskip("equinox" if case.startswith("eqx") else "flax")
    make, scan, make_step = CASES[case]
    loss_fn, params = make(scan)
    step, init = make_step(loss_fn, optax.adamw(LR))
    state = init(params)
    new = _pipelined(step, state, runtime)
    if scan:                        # already stacked: the user's own layout, as given
        assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)


@pytest.mark.parametrize("case", ["nnx_unrolled", "eqx_scanned"])
def test_a_jitted_loss_pipelines(case):
    """A loss under ``jax.jit`` (``eqx.filter_jit``) is one call in the traced step: the cut
    looks inside it."""
    make, scan, make_step = CASES[case]
    loss_fn, params = make(scan)
    if case.startswith("eqx"):
        import equinox as eqx

        loss_fn = eqx.filter_jit(loss_fn)
    else:
        loss_fn = jax.jit(loss_fn)
    step, init = make_step(loss_fn, optax.adamw(LR))
    _pipelined(step, init(params), "lockstep")


def test_what_cannot_be_pipelined_is_refused():
    pytest.importorskip("equinox")
    loss_fn, params = eqx_lm(False)
    mesh, batch = MESH, _batch()
    step, init = tuple_step(jax.checkpoint(loss_fn), optax.sgd(LR))
    state = init(params)
    with pytest.raises(AutoparError, match="reads the parameters of layers 0 and 1"):
        autopar.plan(step, state, batch, mesh=mesh, pipeline="auto")

    def tokens_only(state, batch):          # the loss takes a part of the batch
        loss, _ = autopar.value_and_grad(
            lambda p, t: loss_fn(p, {"tokens": t, "targets": t}))(state[0], batch["tokens"])
        return state, loss

    with pytest.raises(AutoparError, match="not the step's batch: call it as loss"):
        autopar.plan(tokens_only, state, batch, mesh=mesh, pipeline="auto")

    def grows(state, batch):                # returns a state of another structure
        loss, _ = autopar.value_and_grad(loss_fn)(state[0], batch)
        return (*state, loss), loss

    with pytest.raises(AutoparError, match="given 53 leaves and returns 54"):
        autopar.plan(grows, state, batch, mesh=mesh, pipeline="auto")


def test_the_state_may_be_the_parameters_alone():
    """An ``nnx.State`` of parameters is the whole state, updated by hand-written SGD."""
    pytest.importorskip("flax")
    loss_fn, params = nnx_lm(scan=True)

    def step(params, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), loss

    batch = _batch()
    ref, ref_loss = jax.jit(step)(params, batch)
    run = autopar.autoparallel(step, mesh=jax.make_mesh(tuple(MESH.values()), tuple(MESH)),
                               pipeline={"schedule": "gpipe", "microbatches": 2,
                                         "runtime": "mpmd"})
    new, loss = run(params, batch)
    assert run.plan.pipeline.stages == 2
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(params)
    assert_loss(loss, ref_loss)
    # SGD's step is LR x the gradient, compared as gradients are (relative to each leaf's
    # scale), up to the rounding of p - LR g: two ulps of the largest parameter
    moved, ref_moved = (jax.tree_util.tree_map(jnp.subtract, p, params) for p in (new, ref))
    ulp = float(jnp.finfo(jnp.float32).eps) * _top(params)
    assert_scaled(moved, ref_moved, rel=1e-5, atol=2 * ulp)
    assert 2 * ulp < 0.01 * _top(ref_moved)         # far below the step itself
    again, loss2 = run(new, batch)
    assert_loss(loss2, jax.jit(step)(ref, batch)[1])
