"""``profile()``: measure the devices jax runs on and fit a ``Hardware`` to them.

Stages: ``run_sweep`` times matmuls (per size and dtype) and a streaming elementwise op on one
device, and each collective over groups of the devices (a 1-D mesh of all of them, and in the
full sweep also groups of 4 and 2, all groups running at once) (``cost_models.measure``);
``fit_compute`` / ``fit_collectives`` fit the model's parameters (``cost_models.fit``);
``hardware_from_fits`` assembles the profile:

  * peaks and HBM bandwidth are the fitted rates, with efficiencies 1.0 -- unless a ``reference``
    profile (e.g. the data-sheet ``"h100"``) is given, whose peaks are kept and whose efficiencies
    become fitted rate / data-sheet peak;
  * link bandwidth is the best kind's fitted bandwidth ``B_max``; ``collective_efficiency`` is the
    median kind's ``B_k / B_max`` and each kind's factor makes up the rest, so
    ``B_max * collective_efficiency * kind_efficiency = B_k``;
  * the inter-node link cannot be measured from one process: it is the reference's, else a copy
    of the measured intra-node link;
  * ``kernel_launch_s`` and ``collective_launch_s`` are what one more kernel or all-reduce costs
    *inside* a program (``in_program_launches``: the slope of time against the count in chains
    of dependent tiny kernels and all-reduces), not the intercept of single-op programs: on CPU
    devices a lone op pays thread wake-ups that a step's hundreds of kernels do not (the
    intercept was ~200 us per kernel, the in-program slope a few us).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence

import jax

from cost_models.collectives import COLLECTIVE_TERMS, KINDS
from cost_models.fit import CollectiveFit, ComputeFit, fit_collectives, fit_compute
from cost_models.hardware import FALLBACK_DTYPE, Hardware, Link, hardware
from cost_models.measure import (
    Measurement,
    line_mesh,
    measure_collective,
    measure_collective_chain,
    measure_dispatch,
    measure_kernel_chain,
    measure_matmul,
    measure_memory,
    slope_s,
)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Sizes a profile measures. ``collective_nbytes`` follow ``collective_time_s``'s convention."""

    matmul_sizes: tuple[tuple[int, int, int], ...]
    dtypes: tuple[str, ...]
    memory_elements: tuple[int, ...]
    collective_nbytes: tuple[int, ...]
    group_sizes: tuple[int, ...]  # groups of g devices (0: all), all devices busy at once
    repeats: int
    warmup: int
    chain_steps: tuple[int, ...] = (4, 16, 64)   # kernel chains: launch cost inside a program
    collective_chain: tuple[int, ...] = (1, 4, 16)  # dependent all-reduces in one program


# Powers of two (and 4x steps for collectives): calibrate_cost_model.py checks the fit on sizes
# in between. Upper ends stay below where 8 emulated devices on a small host leave the caches
# and time jumps super-linearly.
FULL_SWEEP = Sweep(
    matmul_sizes=((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
                  (2048, 512, 512)),
    dtypes=("float32", "bfloat16"),
    memory_elements=(1 << 18, 1 << 20, 1 << 22),
    collective_nbytes=(1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22),
    group_sizes=(0, 4, 2),  # several group sizes separate per-step latency from fixed cost
    repeats=7,
    warmup=2,
)
QUICK_SWEEP = Sweep(
    matmul_sizes=((128, 128, 128), (512, 512, 512)),
    dtypes=("float32",),
    memory_elements=(1 << 18, 1 << 21),
    collective_nbytes=(1 << 14, 1 << 20),
    group_sizes=(0,),
    repeats=3,
    warmup=1,
    chain_steps=(4, 32),
    collective_chain=(1, 8),
)


def run_sweep(
    devices: Sequence[jax.Device], sweep: Sweep
) -> tuple[list[Measurement], list[Measurement]]:
    """Returns (compute measurements, every device at once; collective measurements)."""
    reps = dict(repeats=sweep.repeats, warmup=sweep.warmup)
    compute = [
        measure_matmul(devices, m, k, n, dtype, **reps)
        for dtype in sweep.dtypes
        for m, k, n in sweep.matmul_sizes
    ]
    compute += [measure_memory(devices, e, **reps) for e in sweep.memory_elements]
    n = len(devices)
    groups = sorted({g if 0 < g <= n else n for g in sweep.group_sizes if n % (g or n) == 0})
    comms = [
        measure_collective(*line_mesh(devices, g), kind, nbytes, **reps)
        for g in groups
        if g > 1
        for kind in KINDS
        for nbytes in sweep.collective_nbytes
    ]
    return compute, comms


def profile(
    devices: Sequence[jax.Device] | None = None,
    quick: bool = False,
    reference: Hardware | str | None = None,
    name: str | None = None,
) -> Hardware:
    """Measures ``devices`` (default: all local devices) and returns a fitted ``Hardware``.

    Args:
      devices: the devices to profile; collectives run over all of them, compute on the first.
      quick: a sweep of a few seconds (for tests) instead of the full one (< 1 min on 8 CPU
        devices).
      reference: a data-sheet profile whose peaks are kept; efficiencies are then fitted
        relative to it (see the module docstring).
      name: the profile's name (default: the platform, e.g. ``"cpu"``).

    Returns:
      A ``Hardware`` that ``save``/``load`` as JSON and feeds ``CostModel``.
    """
    devs = list(devices) if devices is not None else jax.local_devices()
    sweep = QUICK_SWEEP if quick else FULL_SWEEP
    compute, comms = run_sweep(devs, sweep)
    dispatch = measure_dispatch(devs, sweep.repeats + 2, sweep.warmup)
    ref = hardware(reference) if reference is not None else None
    # A single-op program pays the op, the program's dispatch and whatever a lone op costs on
    # top (thread wake-ups on CPU devices): the launch a step pays per kernel and per collective
    # is the slope of time against their count in one program (``in_program_launches``).
    cfit = fit_compute(compute)
    kfit = fit_collectives(comms) if comms else None
    kernel_s, coll_s = in_program_launches(devs, sweep, kfit)
    cfit = dataclasses.replace(cfit, kernel_launch_s=kernel_s)
    if kfit is not None:
        kfit = dataclasses.replace(kfit, collective_launch_s=coll_s)
    hw = hardware_from_fits(name or devs[0].platform, devs, cfit, kfit, ref)
    return dataclasses.replace(hw, dispatch_s=dispatch)


def in_program_launches(devices: Sequence[jax.Device], sweep: Sweep,
                        kfit: CollectiveFit | None) -> tuple[float, float]:
    """(kernel launch, collective launch) seconds inside one program: the slopes of a chain of
    dependent tiny kernels and of dependent tiny all-reduces over all ``devices``; the
    all-reduce's ring latency steps (``kfit.latency_s``) are taken off its slope."""
    reps = dict(repeats=sweep.repeats, warmup=sweep.warmup)
    kernel_s = slope_s([measure_kernel_chain(devices, k, **reps) for k in sweep.chain_steps])
    if kfit is None or len(devices) < 2:
        return kernel_s, 0.0
    per = slope_s([measure_collective_chain(devices, k, **reps) for k in sweep.collective_chain])
    steps, _ = COLLECTIVE_TERMS["all-reduce"](len(devices))
    return kernel_s, max(per - steps * kfit.latency_s, 0.0)


def hardware_from_fits(
    name: str,
    devices: Sequence[jax.Device],
    compute: ComputeFit,
    comms: CollectiveFit | None,
    ref: Hardware | None,
) -> Hardware:
    """Assembles a ``Hardware`` from the fits (rules in the module docstring)."""
    peaks, matmul_eff, hbm, memory_eff = _compute_figures(compute, ref)
    intra, coll_eff, kind_eff, coll_launch = _link_figures(name, comms, ref)
    source = (
        f"measured by cost_models.profile() on {len(devices)} x {devices[0].device_kind} "
        f"(jax {jax.__version__})" + (f"; peaks from the {ref.name!r} profile" if ref else "")
    )
    fitted = "least-squares fit of cost_models.profile() measurements"
    return Hardware(
        name=name,
        peak_flops_by_dtype=peaks,
        memory_bytes=_device_memory_bytes(devices),
        hbm_bytes_per_s=hbm,
        devices_per_node=len(devices),
        intra_node=intra,
        inter_node=ref.inter_node if ref else dataclasses.replace(intra, name=f"{name}-inter"),
        matmul_efficiency=matmul_eff,
        memory_efficiency=memory_eff,
        collective_efficiency=coll_eff,
        collective_kind_efficiency=kind_eff,
        kernel_launch_s=compute.kernel_launch_s,
        collective_launch_s=coll_launch,
        source=source,
        citations=(
            ("peak_flops_by_dtype", ref.name if ref else fitted),
            ("hbm_bytes_per_s", ref.name if ref else fitted),
            ("memory_bytes", "jax Device.memory_stats()['bytes_limit'], else host RAM / devices"),
            ("intra_node", fitted),
            ("inter_node", ref.name if ref else "not measurable in one process: intra copy"),
            ("efficiencies", fitted),
        ),
    )


def _compute_figures(
    fit: ComputeFit, ref: Hardware | None
) -> tuple[tuple[tuple[str, float], ...], float, float, float]:
    """(peaks, matmul efficiency, HBM bandwidth, memory efficiency)."""
    fitted = dict(fit.peak_flops_by_dtype)
    if ref is None:
        fitted.setdefault(FALLBACK_DTYPE, statistics.median(fitted.values()))
        return tuple(fitted.items()), 1.0, fit.hbm_bytes_per_s, 1.0
    ratios = [rate / ref.peak_flops_per_s(d) for d, rate in fitted.items()]
    return (
        ref.peak_flops_by_dtype,
        statistics.median(ratios),
        ref.hbm_bytes_per_s,
        fit.hbm_bytes_per_s / ref.hbm_bytes_per_s,
    )


def _link_figures(
    name: str, fit: CollectiveFit | None, ref: Hardware | None
) -> tuple[Link, float, tuple[tuple[str, float], ...], float]:
    """(intra-node link, collective efficiency, per-kind efficiencies, collective launch)."""
    if fit is None:  # one device: nothing to measure
        if ref is not None:
            return ref.intra_node, ref.collective_efficiency, ref.collective_kind_efficiency, 0.0
        return Link(f"{name}-none", 1e12, 0.0), 1.0, (), 0.0
    bandwidths = dict(fit.bandwidth_by_kind)
    best = max(bandwidths.values())
    coll_eff = statistics.median(bandwidths.values()) / best
    kind_eff = tuple((k, b / (best * coll_eff)) for k, b in bandwidths.items())
    intra = Link(f"{name}-measured", best, fit.latency_s)
    return intra, coll_eff, kind_eff, fit.collective_launch_s


def _device_memory_bytes(devices: Sequence[jax.Device]) -> int:
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host // len(devices))
