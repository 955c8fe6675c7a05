"""The usual call's shortcut (``AutoParallel._fast_hit``): a step called again with arrays of a
signature it has run skips the argument parting and checks that build its messages, and
behaves exactly as the whole path does: same results, same errors, same replanning.

Why it exists: the whole path costs about 20 us a leaf in Python; on the zoo's linen LM (72
leaves) that was 1.5 ms of a 10-13 ms step on CPU devices, and the step measured slower than
the same program called through ``jax.jit``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import AutoparError
from autopar.api import AutoParallel


def _step(params, batch, lr):
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda w, d: w - lr * d, params, g), loss


def _data(rows=16):
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (8, 32)) * 0.3,
              "w2": jax.random.normal(k[1], (32, 4)) * 0.3}
    batch = {"x": jax.random.normal(k[2], (rows, 8)), "y": jax.random.normal(k[3], (rows, 4))}
    return params, batch


@pytest.fixture
def prepared_calls(monkeypatch):
    """How many calls took the whole path."""
    count = [0]
    whole = AutoParallel._prepared

    def counted(self, args, run):
        count[0] += 1
        return whole(self, args, run)

    monkeypatch.setattr(AutoParallel, "_prepared", counted)
    return count


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_repeated_call_takes_the_shortcut_and_computes_the_same(mesh_2x4, prepared_calls):
    params, batch = _data()
    step = autopar.autoparallel(lambda p, b: _step(p, b, 0.1), mesh=mesh_2x4, strategy="dp",
                                time_limit_s=5)
    ref = jax.jit(lambda p, b: _step(p, b, 0.1))
    want_p, want_l = ref(params, batch)
    got_p, got_l = step(params, batch)                       # plans, compiles: whole path
    assert prepared_calls[0] == 1
    _close((got_p, got_l), (want_p, want_l))
    # the returned state is in the plan's layouts; the batch is the caller's (uncommitted
    # layout), moved again: both take the shortcut
    for _ in range(2):
        want_p, want_l = ref(want_p, batch)
        got_p, got_l = step(got_p, batch)
    assert prepared_calls[0] == 1
    _close((got_p, got_l), (want_p, want_l))
    # in a layout of the caller's own (replicated) the arrays are moved, still the shortcut
    rep = jax.device_put(got_p, NamedSharding(mesh_2x4, P()))
    again_p, again_l = step(rep, batch)
    assert prepared_calls[0] == 1
    _close((again_p, again_l), ref(want_p, batch))
    # the compiled form too
    compiled = step.compile(params, batch)
    before = prepared_calls[0]
    _close(compiled(params, batch), ref(params, batch))
    assert prepared_calls[0] == before


def test_a_new_signature_static_leaves_and_numpy_arrays_take_the_whole_path(
        mesh_2x4, prepared_calls):
    params, batch = _data()
    step = autopar.autoparallel(_step, mesh=mesh_2x4, strategy="dp", time_limit_s=5)
    step(params, batch, 0.1)
    step(params, batch, 0.1)
    # a Python float is a static leaf (part of the plan's key): never the shortcut, so a new
    # value is a new plan, not the old one run again
    assert prepared_calls[0] == 2
    _close(step(params, batch, 0.5), jax.jit(_step, static_argnums=2)(params, batch, 0.5))
    step_arrays = autopar.autoparallel(lambda p, b: _step(p, b, 0.1), mesh=mesh_2x4,
                                       strategy="dp", time_limit_s=5)
    step_arrays(params, batch)
    n = prepared_calls[0]
    _, bigger = _data(rows=32)
    _close(step_arrays(params, bigger), jax.jit(lambda p, b: _step(p, b, 0.1))(params, bigger))
    assert prepared_calls[0] == n + 1                        # new shapes: planned anew
    step_arrays(params, jax.tree_util.tree_map(np.asarray, batch))   # numpy leaves
    assert prepared_calls[0] == n + 2


def test_a_typed_prng_key_argument_takes_the_shortcut(mesh_2x4, prepared_calls):
    """A ``jax.random.key`` is a ``jax.Array`` without ``weak_type``."""
    params, batch = _data()

    def noisy(p, b, key):
        noise = jax.random.normal(key, b["x"].shape) * 0.01
        new, loss = _step(p, {"x": b["x"] + noise, "y": b["y"]}, 0.1)
        return new, loss, jax.random.split(key)[0]

    step = autopar.autoparallel(noisy, mesh=mesh_2x4, strategy="dp", time_limit_s=5)
    key = jax.random.key(1)
    got = step(params, batch, key)
    again = step(params, batch, key)
    assert prepared_calls[0] == 1
    _close(again[:2], got[:2])
    _close(again[:2], jax.jit(noisy)(params, batch, key)[:2])


def test_a_donated_array_passed_again_is_still_an_autopar_error(mesh_2x4, prepared_calls):
    params, batch = _data()
    step = autopar.autoparallel(lambda p, b: _step(p, b, 0.1), mesh=mesh_2x4, strategy="dp",
                                donate_argnums=0, time_limit_s=5)
    placed = jax.device_put(params, step.input_shardings(params, batch)[0])
    new, _ = step(placed, batch)
    n = prepared_calls[0]
    new2, _ = step(new, batch)                               # the shortcut, donating `new`
    assert prepared_calls[0] == n
    with pytest.raises(AutoparError, match="donated"):
        step(new, batch)
    step(new2, batch)
