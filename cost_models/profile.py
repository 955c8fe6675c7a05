"""``profile()``: measure the devices jax runs on and fit a ``Hardware`` to them.

Stages: ``run_sweep`` times, on every device at once and *inside one program* (the slope of time
against the kernel count of chains, ``cost_models.measure.chain_slope``), matmuls of several sizes
and dtypes, small convolutions and memory-bound kernels of a training step's sizes (tens of KiB
to a few MiB per device); and each collective alone over groups of the devices (a 1-D mesh of
all of them, and in the full sweep also groups of 4 and 2, all groups running at once)
(``cost_models.measure``); ``fit_compute`` / ``fit_collectives`` fit the model's parameters
(``cost_models.fit``); ``hardware_from_fits`` assembles the profile:

  * peaks and HBM bandwidth are the fitted rates, with efficiencies 1.0 -- unless a ``reference``
    profile (e.g. the data-sheet ``"h100"``) is given, whose peaks are kept and whose efficiencies
    become fitted rate / data-sheet peak;
  * ``conv_efficiency`` is the fitted convolution rate over the matmul rate (float32);
  * ``kernel_launch_s`` is the fit's shared intercept: what one more step-sized kernel costs
    inside a program beyond its FLOPs or bytes. On 8 CPU devices sharing 2 cores this is several
    times a tiny kernel's launch (XLA splits step-sized kernels into tasks on a shared thread
    pool); single-op programs are not used, as a lone op pays thread wake-ups and output
    allocation that a step's kernels do not, and streams from DRAM where a step's kernels mostly
    hit the caches;
  * link bandwidth is the best kind's fitted bandwidth ``B_max``; ``collective_efficiency`` is the
    median kind's ``B_k / B_max`` and each kind's factor makes up the rest, so
    ``B_max * collective_efficiency * kind_efficiency = B_k``;
  * the inter-node link cannot be measured from one process: it is the reference's, else a copy
    of the measured intra-node link;
  * ``collective_launch_s`` is what one more tiny all-reduce costs *between step-sized kernels*
    (``measure_collective_in_step``) less its ring latency steps: the devices drift apart between
    collectives, so each waits longer than in a chain of bare all-reduces.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence

import jax

from cost_models.collectives import COLLECTIVE_TERMS, KINDS
from cost_models.fit import CollectiveFit, ComputeFit, fit_collectives, fit_compute
from cost_models.hardware import FALLBACK_DTYPE, MIN_EFFICIENCY, Hardware, Link, hardware
from cost_models.measure import (
    Measurement,
    conv_chain_spec,
    line_mesh,
    matmul_chain_spec,
    measure_chains,
    measure_collective,
    measure_collective_in_step,
    measure_dispatch,
    stream_kernel_spec,
)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Sizes a profile measures. ``collective_nbytes`` follow ``collective_time_s``'s convention;
    ``stream_rows`` are float32 ``(rows, 128)`` shards of memory-bound kernels, ``conv_shapes``
    ``(batch, side, channels)`` of 3x3 convolutions, ``step_rows`` the shard of the kernels run
    between the all-reduces of ``measure_collective_in_step``."""

    matmul_sizes: tuple[tuple[int, int, int], ...]
    dtypes: tuple[str, ...]
    stream_rows: tuple[int, ...]
    conv_shapes: tuple[tuple[int, int, int], ...]
    collective_nbytes: tuple[int, ...]
    group_sizes: tuple[int, ...]  # groups of g devices (0: all), all devices busy at once
    repeats: int
    warmup: int
    step_rows: int = 128


# Sizes of a small training step's kernels (a 128-wide model's activations and weights: 16 KiB to
# 2 MiB per device); collectives in powers of 4. Upper ends stay below where 8 emulated devices
# on a small host leave the caches and time jumps super-linearly.
FULL_SWEEP = Sweep(
    matmul_sizes=((64, 64, 256), (128, 128, 128), (128, 128, 512), (256, 256, 256),
                  (512, 512, 512)),
    dtypes=("float32", "bfloat16"),
    stream_rows=(32, 64, 128, 256, 512, 1024, 4096),
    conv_shapes=((4, 16, 16), (4, 8, 32), (8, 16, 32)),
    collective_nbytes=(1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22),
    group_sizes=(0, 4, 2),  # several group sizes separate per-step latency from fixed cost
    repeats=7,
    warmup=2,
)
QUICK_SWEEP = Sweep(
    matmul_sizes=((128, 128, 128), (256, 256, 256)),
    dtypes=("float32",),
    stream_rows=(64, 2048),
    conv_shapes=((4, 8, 16),),
    collective_nbytes=(1 << 14, 1 << 20),
    group_sizes=(0,),
    repeats=3,
    warmup=1,
    step_rows=32,
)


def run_sweep(
    devices: Sequence[jax.Device], sweep: Sweep
) -> tuple[list[Measurement], list[Measurement]]:
    """Returns (compute measurements, in program and every device at once; collective
    measurements)."""
    reps = dict(repeats=sweep.repeats, warmup=sweep.warmup)
    specs = [matmul_chain_spec(m, k, n, dtype)
             for dtype in sweep.dtypes for m, k, n in sweep.matmul_sizes]
    specs += [conv_chain_spec(b, side, c) for b, side, c in sweep.conv_shapes]
    specs += [stream_kernel_spec(rows) for rows in sweep.stream_rows]
    compute = measure_chains(devices, specs, **reps)
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
    cfit = fit_compute(compute)  # in-program rows: its intercept is the in-program launch
    kfit = fit_collectives(comms) if comms else None
    if kfit is not None:
        coll_s = collective_launch_in_step(devs, sweep, kfit)
        kfit = dataclasses.replace(kfit, collective_launch_s=coll_s)
    hw = hardware_from_fits(name or devs[0].platform, devs, cfit, kfit, ref)
    return dataclasses.replace(hw, dispatch_s=dispatch)


def collective_launch_in_step(devices: Sequence[jax.Device], sweep: Sweep,
                              kfit: CollectiveFit) -> float:
    """Seconds one collective costs inside a step beyond its ring terms: a tiny all-reduce's
    in-step cost (``measure_collective_in_step``) less its ring latency steps."""
    if len(devices) < 2:
        return 0.0
    # a difference of differences of four programs: twice the repeats for a stable median
    per = measure_collective_in_step(devices, sweep.step_rows, repeats=2 * sweep.repeats + 1,
                                     warmup=sweep.warmup)
    steps, _ = COLLECTIVE_TERMS["all-reduce"](len(devices))
    return max(per - steps * kfit.latency_s, 0.0)


def hardware_from_fits(
    name: str,
    devices: Sequence[jax.Device],
    compute: ComputeFit,
    comms: CollectiveFit | None,
    ref: Hardware | None,
) -> Hardware:
    """Assembles a ``Hardware`` from the fits (rules in the module docstring)."""
    peaks, matmul_eff, hbm, memory_eff = _compute_figures(compute, ref)
    conv_eff = _conv_factor(compute)
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
        conv_efficiency=conv_eff,
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
            ("kernel_launch_s", "intercept of the fit of in-program kernels (chains of "
                                "step-sized matmuls, convolutions and memory-bound kernels)"),
            ("collective_launch_s", "in-step all-reduce (between step-sized kernels) less its "
                                    "ring latency"),
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
        _fraction(statistics.median(ratios)),
        ref.hbm_bytes_per_s,
        _fraction(fit.hbm_bytes_per_s / ref.hbm_bytes_per_s),
    )


def _fraction(x: float) -> float:
    """An efficiency kept in ``[MIN_EFFICIENCY, 1]``: step-sized kernels are dominated by their
    launch, so a noisy fit can find no bandwidth (or FLOP) signal at all, which the fit reports
    as a near-infinite rate; the data sheet's figure is then the best there is."""
    return min(max(x, MIN_EFFICIENCY), 1.0)


def _conv_factor(fit: ComputeFit) -> float:
    """Fitted convolution rate / matmul rate of the same dtype (median over dtypes), kept in
    the range ``Hardware`` accepts; 1.0 when no convolution was measured."""
    peaks = dict(fit.peak_flops_by_dtype)
    ratios = [rate / peaks[d] for d, rate in fit.conv_flops_by_dtype if d in peaks]
    if not ratios:
        return 1.0
    return min(max(statistics.median(ratios), MIN_EFFICIENCY), 1.0 / MIN_EFFICIENCY)


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
