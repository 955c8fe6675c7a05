"""Roofline model of one kernel on one device.

Variables: ``F`` FLOPs, ``M`` bytes read plus written, ``P`` peak FLOP/s of the dtype, ``W`` memory
bandwidth, ``e_f`` the matmul (or vector) efficiency, ``e_c`` the convolution factor
(``conv_efficiency``, times ``min(1, c / conv_min_features) ** conv_narrow_power`` for a
convolution ``c`` channels wide per device, the geometric mean of its input and output
features there; 1 for other ops), ``e_m`` the memory efficiency, ``L`` the
kernel's fixed cost (``Hardware.launch_s``: the launch, plus ``kernel_floor_s`` when the kernel
moves at least ``kernel_floor_bytes``):

    t = max(F / (P e_f e_c) + T s_T, M / (W e_m)) + L

with ``T`` the op's transcendental evaluations (exp, log, tanh, sqrt, ...) and ``s_T`` the
profile's ``transcendental_s`` (0 in the GPU profiles).

A kernel is compute-bound when the first term wins. Matmul-like primitives (``MATMUL_PRIMS``) use
the dtype's peak (tensor cores on GPUs); other primitives run on the vector units, modelled by
the float32 peak. ``roofline_time_s`` implements the formula; ``is_compute_bound`` names the
winning term.
"""
from __future__ import annotations

import math

from cost_models.hardware import FALLBACK_DTYPE, Hardware

# Primitives that run on matrix units (tensor cores / MXU / BLAS gemm).
MATMUL_PRIMS: frozenset[str] = frozenset({"dot_general", "conv_general_dilated"})
# Matmul-like primitives priced at the profile's ``conv_efficiency`` of the matmul rate.
CONV_PRIMS: frozenset[str] = frozenset({"conv_general_dilated"})


def conv_factor(hw: Hardware, features: float = math.inf) -> float:
    """``e_c`` of a convolution ``features`` channels wide per device (the geometric mean of
    its input features per feature group and its output features)."""
    return hw.conv_efficiency * narrow_factor(features, hw.conv_min_features,
                                              hw.conv_narrow_power)


def narrow_factor(features: float, min_features: float, power: float) -> float:
    """``min(1, features / min_features) ** power``: the rate of a convolution that narrow
    relative to a wide one (``Hardware.conv_min_features``, ``conv_narrow_power``)."""
    return min(1.0, features / min_features) ** power


def compute_bound_time_s(flops: float, hw: Hardware, dtype: str, is_matmul: bool,
                         conv: bool = False, transcendentals: float = 0.0,
                         conv_features: float = math.inf) -> float:
    """F / (P e_f e_c) + T s_T: vector (non-matmul) ops use the float32 peak whatever their
    dtype; a convolution (``conv``) runs at ``conv_factor(hw, conv_features)`` of the matmul
    rate; each transcendental evaluation costs ``hw.transcendental_s``."""
    peak = hw.peak_flops_per_s(dtype if is_matmul else FALLBACK_DTYPE)
    factor = conv_factor(hw, conv_features) if conv else 1.0
    return flops / (peak * hw.matmul_efficiency * factor) + transcendentals * hw.transcendental_s


def memory_bound_time_s(bytes_accessed: float, hw: Hardware) -> float:
    """M / (W e_m)."""
    return bytes_accessed / (hw.hbm_bytes_per_s * hw.memory_efficiency)


def roofline_time_s(
    flops: float, bytes_accessed: float, hw: Hardware, dtype: str, is_matmul: bool,
    conv: bool = False, transcendentals: float = 0.0, conv_features: float = math.inf,
) -> float:
    """max(compute-bound, memory-bound) time plus the kernel's fixed cost; 0 for an empty op."""
    if flops <= 0 and bytes_accessed <= 0 and transcendentals <= 0:
        return 0.0
    body = max(
        compute_bound_time_s(flops, hw, dtype, is_matmul, conv, transcendentals, conv_features),
        memory_bound_time_s(bytes_accessed, hw),
    )
    return body + hw.launch_s(bytes_accessed)


def is_compute_bound(
    flops: float, bytes_accessed: float, hw: Hardware, dtype: str, is_matmul: bool
) -> bool:
    """True when the FLOP term of the roofline exceeds the memory term."""
    return compute_bound_time_s(flops, hw, dtype, is_matmul) > memory_bound_time_s(
        bytes_accessed, hw
    )
