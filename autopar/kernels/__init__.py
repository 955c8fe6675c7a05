"""Fused Pallas kernels for LLM training steps (see the module docstrings for the math)."""
from autopar.kernels.adamw import AdamWHyper, adamw_reference, adamw_tree_update, adamw_update
from autopar.kernels.cross_entropy import XentBlocks, cross_entropy_reference, lm_head_cross_entropy
from autopar.kernels.flash_attention import (
    AttentionBlocks,
    attention,
    attention_reference,
    attention_with_lse,
)
from autopar.kernels.norms import layer_norm, norm_reference, rms_norm

__all__ = ["AdamWHyper", "AttentionBlocks", "XentBlocks", "adamw_reference", "adamw_tree_update",
           "adamw_update", "attention", "attention_reference", "attention_with_lse",
           "cross_entropy_reference", "layer_norm", "lm_head_cross_entropy", "norm_reference",
           "rms_norm"]
