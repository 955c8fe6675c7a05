"""Comparing one sharded optax adamw step with the unsharded one, as several test files do.

Adam's first moment after one step from zero is exactly (1 - b1) x the gradient (b1 = 0.9), so
the new optimizer state carries the gradients; its first update is about lr * sign(gradient),
so parameters are compared to a fraction of the learning rate where a gradient is rounding
noise (a key bias's is exactly zero in exact arithmetic: softmax ignores shifts).
"""
from __future__ import annotations

import jax
import numpy as np


def adam_mu(state):
    """The first moment of an ``optax.adamw`` state (``opt_state[0].mu``)."""
    return state["opt_state"][0].mu


def assert_same_step(state, out, ref, lr: float = 1e-3) -> None:
    """``out`` and ``ref`` (each ``(new_state, loss)`` of one step from ``state``) agree: the
    loss to 1e-5, the gradients (Adam's mu) to 1e-4, the updates as ``assert_same_update``."""
    (new_state, loss), (ref_state, ref_loss) = out, ref
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(adam_mu(new_state)),
                                 jax.tree_util.tree_leaves(adam_mu(ref_state))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7,
                                   err_msg=f"gradient of {jax.tree_util.keystr(path)}")
    grads = jax.tree_util.tree_map(lambda m: m / 0.1, adam_mu(ref_state))
    for old, got, want, g in zip(*(jax.tree_util.tree_leaves(t) for t in (
            state["params"], new_state["params"], ref_state["params"], grads))):
        assert_same_update(*(np.asarray(x) for x in (old, got, want, g)), lr=lr)


def assert_same_update(old, got, want, grad, lr: float = 1e-3) -> None:
    """Adam's first update is about lr * sign(gradient): where a gradient is rounding noise its
    sign, and so a ~lr step, may differ between two correct programs. Elsewhere the updates
    agree closely."""
    assert np.max(np.abs(got - want)) <= 2.05 * lr
    real = np.abs(grad) > 1e-5     # 1000 x Adam's eps: the update no longer amplifies noise
    np.testing.assert_allclose((got - old)[real], (want - old)[real], rtol=1e-3, atol=1e-8)
