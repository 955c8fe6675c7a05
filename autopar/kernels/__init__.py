"""Fused Pallas kernels for LLM training steps, and how each replaces what ``ir.patterns`` finds.

Modules: ``flash_attention``, ``norms``, ``cross_entropy``, ``adamw`` (the kernels, each with a
plain-jnp ``*_reference``); ``sharded`` (``shard_map`` wrappers with per-shard specs);
``costs`` (cost-model entries); ``_pallas`` (backend choice: ``"interpret"`` anywhere,
``"triton"`` on GPUs). Each kernel is two plain functions, a forward that also returns the
residuals its backward reads and that backward, plus the ``jax.custom_vjp`` function built
from the two (what a user calls). Codegen substitutes the two halves separately, because the
traced step already holds the forward and the backward as separate ops.

Pattern -> kernel call. Values are named by ``ir.patterns.Match`` role; "primed" values are the
graph value brought to the kernel's layout (reshape/transpose, given by the match's attrs).

  attention_fwd  reads q, k, v [, bias, keep] (roles ``mask``, ``scale``, ``const`` are not
                 passed: the kernel rebuilds a causal mask from attr ``causal`` and takes attr
                 ``scale``). A mask read as data (attr ``mask`` ``"data"``) is brought to the
                 scores' ``(B, H, Sq, Sk)`` order by attrs ``bias_dims``/``keep_dims`` and
                 passed as ``Masks(bias * bias_scale, keep == keep_true, fill)``. k and v are
                 taken before a ``jnp.repeat`` over the heads (attr ``kv_repeat``).
                 ``out, lse = attention_fwd(q', k', v', causal=, scale=, masks=)``; ``out`` ->
                 role ``out``; ``lse (B, Hq, Sq)`` float32 is new, kept for the backward.
                 Layout: ``q' (B, Sq, Hq, D)``, ``k', v' (B, Sk, Hkv, D)``; the attrs
                 ``score_dims``/``value_dims`` (dot_general dimension numbers), ``q_is_lhs`` and
                 ``p_is_lhs`` say which graph dim is which. GPT's q is already ``(B, S, H, D)``;
                 a grouped-query ``(B, S, Hkv, G, D)`` q reshapes to ``(B, S, Hkv*G, D)``;
                 role ``out`` is the value after the match's trailing transpose/reshape,
                 ``(B, Sq, Hq, D)``. Substitute only when attr ``mask`` is ``"causal"``,
                 ``"none"`` or ``"data"``. Attr ``recompute`` marks a re-run under
                 ``jax.checkpoint``.
  attention_bwd  reads dout (cotangent of out), q, k, v; the ``saved`` inputs (probabilities,
                 exp, row sums, mask) are not read: P is recomputed from lse.
                 ``dq, dk, dv = attention_bwd(q', k', v', out, lse, dout', causal=, scale=)``
                 with ``out, lse`` from the call that replaced ``matches[m.forward]``; writes
                 roles ``dq``, ``dk``, ``dv`` (in the graph's layout of q, k, v).
  norm_fwd       reads x [, residual], scale [, bias]; the kernel's scale is ``scale +
                 scale_offset`` (attr; Gemma's ``(1 + w)``).
                 ``y, h, mean, rstd = norm_fwd(kind, x, scale, bias, residual, eps=)`` with
                 attrs ``kind`` ("layer"/"rms") and ``eps``; writes ``y`` [and ``h`` = x +
                 residual, when attr ``residual``]; ``mean``, ``rstd`` (rows, float32) are new.
  norm_bwd       reads dy [, dh], the forward's h (role ``h``, or ``x`` without a residual).
                 ``dx, dscale, dbias = norm_bwd(kind, h, scale, mean, rstd, dy, dh, bias=)``;
                 writes ``dx`` (the gradient of x and of residual alike), ``dscale``
                 [, ``dbias``]. A ``dh`` on a norm without residual is the other use of x,
                 which the graph sums into dx: pass it as ``dh``, the kernel adds it.
  xent_fwd       reads h, w, targets. ``loss, lse = xent_fwd(h', w', targets)`` with
                 ``h' (..., D)``, ``w' (D, V)`` (transpose when not attr ``w_is_rhs``); role
                 ``loss`` may carry a trailing size-1 dim (``take_along_axis``): reshape; it
                 is the picked log-probability (``-loss``) when attr ``loss_sign`` is -1.
  xent_bwd       reads dloss (cotangent of loss), h, w, targets; ``saved`` inputs unread.
                 ``dh, dw = xent_bwd(h', w', targets, lse, dloss')``; writes ``dh``, ``dw``.
  adamw          reads param, grad, mu, nu, bc1, bc2 [, lr].
                 ``param', mu', nu' = adamw_update(param, grad, mu, nu, lr=, bc1=, bc2=,
                 hyper=AdamWHyper(b1, b2, eps, eps_root, weight_decay))`` with the match's attrs
                 (``lr`` from attr ``lr``, or role ``lr`` when the schedule is traced); writes
                 ``param``, ``mu``, ``nu``.

Backward matches in a ``scan`` may list outputs with role ``residual``: forward-body values the
loop hands to its backward body only for these ops. They go dead with the substitution.

Per-shard specs (``sharded``; every wrapper runs the kernel inside ``jax.shard_map``):
``attention_sharded(batch=, heads=, seq=)`` (sequence: queries split, keys/values
all-gathered, causal offset per shard); ``norm_sharded(rows=)`` (one mesh-axis spec per leading
dim; the normalised width whole); ``lm_head_cross_entropy_sharded(rows=, vocab=)`` (the
vocabulary-parallel form: a max then a sum all-reduce); ``adamw_sharded(spec=)`` (any
PartitionSpec). Cost entries (``costs``): ``attention_fwd_cost``, ``attention_bwd_cost``,
``norm_fwd_cost``, ``norm_bwd_cost``, ``xent_fwd_cost``, ``xent_bwd_cost``, ``adamw_cost``,
``adamw_bwd_cost``, all functions of per-shard sizes returning a ``KernelCost``.
"""
from autopar.kernels.adamw import AdamWHyper, adamw_reference, adamw_tree_update, adamw_update
from autopar.kernels.cross_entropy import (
    XentBlocks,
    cross_entropy_reference,
    lm_head_cross_entropy,
    xent_bwd,
    xent_fwd,
)
from autopar.kernels.flash_attention import (
    AttentionBlocks,
    Masks,
    attention,
    attention_bwd,
    attention_fwd,
    attention_reference,
    attention_with_lse,
)
from autopar.kernels.norms import layer_norm, norm_bwd, norm_fwd, norm_reference, rms_norm

__all__ = ["AdamWHyper", "AttentionBlocks", "Masks", "XentBlocks", "adamw_reference",
           "adamw_tree_update", "adamw_update", "attention", "attention_bwd", "attention_fwd",
           "attention_reference", "attention_with_lse", "cross_entropy_reference", "layer_norm",
           "lm_head_cross_entropy", "norm_bwd", "norm_fwd", "norm_reference", "rms_norm",
           "xent_bwd", "xent_fwd"]
