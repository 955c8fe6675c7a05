"""One numerics check for every test that compares a sharded step with its unsharded twin.

Tolerances follow the numerics, not a test's luck:

* the loss: one float32 reduction summed in another order agrees to ``LOSS_RTOL``;
* gradients and optimizer moments: each leaf to ``rel`` of that leaf's largest magnitude (a sum
  split over devices rounds differently; an element near zero has no relative accuracy of its
  own, so an elementwise rtol fails on it once in a while);
* parameters after an optimizer step, to a fraction of the learning rate: Adam's first update of
  an element is lr * g / (|g| + eps), so where the gradient is rounding noise (a key bias's is
  exactly zero in exact arithmetic) the update's sign, and so a step of up to 2 lr, may differ
  between two correct programs. Given the reference gradient (or Adam's first moment, which is
  proportional to it), elements whose gradient stands clear of the leaf's noise must agree to
  ``frac`` x lr and the others to ``NOISE_STEPS`` x lr; without it, every element to
  ``NOISE_STEPS`` x lr and the leaf's median to ``frac`` x lr.
"""
from __future__ import annotations

import jax
import numpy as np

LOSS_RTOL = 1e-5
# A gradient element is noise-dominated below this fraction of its leaf's largest one: float32
# sums of O(100-1000) terms round at ~1e-6 of their magnitude; a decade of margin.
NOISE_REL = 1e-4
# ... and below this fraction of the largest gradient of the whole step: float32's epsilon
# (1.2e-7) times the magnitudes that cancel, with a decade of margin.
FLOOR_REL = 1e-6
# Adam's first step moves an element by at most lr: opposite signs differ by 2 lr.
NOISE_STEPS = 2.05


def _pairs(got, want, what: str):
    gs, ws = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)
    assert len(gs) == len(ws), f"{what}: {len(gs)} leaves against {len(ws)}"
    for (path, g), w in zip(gs, ws):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
        yield where, g, w


def assert_loss(got, want, rtol: float = LOSS_RTOL) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=rtol, err_msg="loss")


def assert_scaled(got, want, rel: float = 1e-5, atol: float = 1e-12, what: str = "") -> None:
    """Gradients, optimizer moments, activations: every leaf within ``rel`` x its largest
    reference magnitude (``atol`` for an all-zero leaf)."""
    for where, g, w in _pairs(got, want, what):
        bound = max(rel * float(np.max(np.abs(w), initial=0.0)), atol)
        err = float(np.max(np.abs(g - w), initial=0.0))
        assert err <= bound, f"{where}: max |diff| {err:.3g} > {bound:.3g} ({rel} x leaf scale)"


def assert_params(got, want, lr: float, grads=None, frac: float = 0.1, what: str = "params"
                  ) -> None:
    """Parameters after one optimizer step (see the module docstring); ``grads``: the reference
    gradients, or Adam's first moment (any tree of the parameters' structure and scale)."""
    gleaves = (jax.tree_util.tree_leaves(grads) if grads is not None
               else [None] * len(jax.tree_util.tree_leaves(want)))
    # a leaf whose gradient is zero in exact arithmetic (a key bias: softmax ignores a shift
    # shared by all keys) holds noise at float32's rounding of the gradients that cancel in it
    top = max((float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0)) for x in gleaves
               if x is not None), default=0.0)
    for (where, g, w), gr in zip(_pairs(got, want, what), gleaves):
        diff = np.abs(g - w)
        worst = float(np.max(diff, initial=0.0))
        assert worst <= NOISE_STEPS * lr, f"{where}: max |diff| {worst:.3g} > {NOISE_STEPS} lr"
        if gr is None:
            med = float(np.median(diff)) if diff.size else 0.0
            assert med <= frac * lr, f"{where}: median |diff| {med:.3g} > {frac} lr"
            continue
        gr = np.abs(np.asarray(gr, np.float64))
        clear = gr > max(NOISE_REL * float(np.max(gr, initial=0.0)), FLOOR_REL * top)
        if clear.any():
            err = float(np.max(diff[clear]))
            assert err <= frac * lr, (f"{where}: max |diff| {err:.3g} > {frac} lr where the "
                                      f"gradient stands clear of rounding noise")


def assert_same_step(got_params, want_params, *, lr: float, got_loss=None, want_loss=None,
                     got_mu=None, want_mu=None, rel: float = 1e-5, atol: float = 1e-12
                     ) -> None:
    """A whole Adam(W) step: the loss, the first moment (relative to each leaf's scale, or
    ``atol`` for a leaf that is zero in exact arithmetic) and the updated parameters (to a
    fraction of ``lr`` where the gradient is not noise)."""
    if want_loss is not None:
        assert_loss(got_loss, want_loss)
    if want_mu is not None:
        assert_scaled(got_mu, want_mu, rel=rel, atol=atol, what="mu")
    assert_params(got_params, want_params, lr, grads=want_mu)
