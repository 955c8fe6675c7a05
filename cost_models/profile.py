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
    intercept was ~200 us per kernel, the in-program slope a few us);
  * ``kernel_floor_s`` / ``kernel_floor_bytes``: what a kernel of a training step's size pays on
    top of that launch inside a program, and from which size (``kernel_floor``: chains of
    memory-bound kernels of 2 KiB to 256 KiB per device);
  * ``conv_efficiency``: chained small convolutions' FLOP rate over chained matmuls'
    (``conv_efficiency``);
  * ``transcendental_s``: the median over exp, log, tanh and rsqrt of the seconds one device
    takes per evaluation inside one fused kernel, every device busy
    (``measure_transcendentals``). The IR counts them apart from FLOPs, which priced them free;
  * ``select_scatter_s`` / ``select_scatter_fixed_s``: a max-pool gradient's seconds per operand
    element and per gradient, every device busy (``select_scatter``); XLA:CPU runs it as an
    expansion ending in a scatter element loop, several times the roofline of its bytes.

Each in-program term is measured by its own micro-benchmark and can be switched off in a
profile (``kernel_floor_s=0``, ``conv_efficiency=1``, ``transcendental_s=0``,
``select_scatter_s=select_scatter_fixed_s=0``) to see what it changes.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from cost_models.collectives import COLLECTIVE_TERMS, KINDS
from cost_models.compute import narrow_factor
from cost_models.fit import (
    CollectiveFit,
    ComputeFit,
    fit_collectives,
    fit_compute,
    relative_nnls,
)
from cost_models.hardware import FALLBACK_DTYPE, PLATFORMS, Hardware, Link, hardware
from cost_models.measure import (
    Measurement,
    conv_chain_spec,
    line_mesh,
    matmul_chain_spec,
    measure_chains,
    measure_collective,
    measure_collective_chain,
    measure_dispatch,
    measure_kernel_chain,
    measure_matmul,
    measure_memory,
    measure_select_scatter,
    measure_transcendentals,
    slope_s,
    stream_kernel_spec,
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
    # float32 (rows, 128) shards of chained memory-bound kernels: the per-kernel floor
    stream_rows: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512)
    # (batch, side, channels) of chained 3x3 convolutions, against chained square matmuls
    conv_shapes: tuple[tuple[int, int, int], ...] = ((4, 16, 16), (4, 8, 32), (8, 16, 32))
    conv_matmuls: tuple[int, ...] = (128, 256)
    # channels of chained 3x3 convolutions of equal FLOPs (batch x channels^2 fixed), from narrow
    # to wide: their rates give ``conv_min_features``
    conv_widths: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    transcendental_elements: int = 1 << 16   # float32 per device, for ``transcendental_s``
    # NHWC float32 operands per device of a 2x2 max-pool's gradient, for ``select_scatter_s``
    pool_shapes: tuple[tuple[int, int, int, int], ...] = ((4, 8, 8, 16), (4, 16, 16, 16),
                                                          (8, 16, 16, 32))


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
    stream_rows=(4, 64, 256),
    conv_shapes=((4, 8, 16),),
    conv_matmuls=(128,),
    conv_widths=(2, 8, 32),
    transcendental_elements=1 << 12,
    pool_shapes=((2, 8, 8, 8), (4, 16, 16, 16)),
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
    floor_s, floor_bytes = kernel_floor(devs, sweep, cfit)
    width, power = conv_min_features(devs, sweep)
    conv = conv_efficiency(devs, sweep, width, power)
    trans = statistics.median(m.time_s for m in measure_transcendentals(
        devs, sweep.transcendental_elements, repeats=sweep.repeats, warmup=sweep.warmup))
    per_element, fixed = select_scatter(devs, sweep)
    if kfit is not None:
        kfit = dataclasses.replace(kfit, collective_launch_s=coll_s)
    hw = hardware_from_fits(name or devs[0].platform, devs, cfit, kfit, ref)
    return dataclasses.replace(hw, dispatch_s=dispatch, kernel_floor_s=floor_s,
                               kernel_floor_bytes=floor_bytes, conv_efficiency=conv,
                               conv_min_features=width, conv_narrow_power=power,
                               transcendental_s=max(trans, 0.0), select_scatter_s=per_element,
                               select_scatter_fixed_s=fixed)


def select_scatter(devices: Sequence[jax.Device], sweep: Sweep) -> tuple[float, float]:
    """(``select_scatter_s``, ``select_scatter_fixed_s``): the seconds per operand element and
    per gradient of a 2x2 max-pool's gradient on every device at once
    (``measure_select_scatter``, operands ``sweep.pool_shapes``), fitted as ``t = c + s n``
    (``relative_nnls``). On 8 CPU devices sharing 2 cores the element loop costs tens of ns per
    element, against a few ns for the bytes the op reads and writes."""
    ms = measure_select_scatter(devices, sweep.pool_shapes, repeats=sweep.repeats,
                                warmup=sweep.warmup)
    kept = [m for m in ms if m.time_s > 0]
    if not kept:      # noise ate every difference: leave the op to the roofline
        return 0.0, 0.0
    design = np.array([[1.0, m.nbytes] for m in kept])
    times = np.array([m.time_s for m in kept])
    fixed, per_element = (float(v) for v in relative_nnls(design, times))
    return per_element, fixed


def conv_efficiency(devices: Sequence[jax.Device], sweep: Sweep,
                    min_features: float = 1.0, power: float = 1.0) -> float:
    """A convolution's FLOP rate over a matmul's, both inside one program: the median rate of
    chained same-padded 3x3 float32 convolutions of a small step's shapes
    (``sweep.conv_shapes``), each divided by the narrow-channel factor
    ``min(1, channels / min_features) ** power`` that ``conv_min_features`` fitted, over the
    median rate of chained square matmuls (``sweep.conv_matmuls``), all timed round robin on
    every device at once (``measure_chains``). On CPU devices small convolutions run at about
    half a matmul's rate."""
    reps = dict(repeats=sweep.repeats, warmup=sweep.warmup)
    specs = [conv_chain_spec(b, side, c) for b, side, c in sweep.conv_shapes]
    specs += [matmul_chain_spec(n, n, n, FALLBACK_DTYPE) for n in sweep.conv_matmuls]
    ms = measure_chains(devices, specs, **reps)
    k = len(sweep.conv_shapes)
    conv = [m.flops / m.time_s / narrow_factor(c, min_features, power)
            for m, (_, _, c) in zip(ms[:k], sweep.conv_shapes) if m.time_s > 0]
    mm = [m.flops / m.time_s for m in ms[k:] if m.time_s > 0]
    if not conv or not mm:   # no usable timing (noise ate the chains' slope): as matmuls
        return 1.0
    return statistics.median(conv) / statistics.median(mm)


def conv_min_features(devices: Sequence[jax.Device], sweep: Sweep) -> tuple[float, float]:
    """(``conv_min_features``, ``conv_narrow_power``): the channel count ``W`` below which a
    convolution's rate falls, and how steeply (``(c / W)^p``). Chained 3x3 float32
    convolutions of ``c`` channels in and out (``sweep.conv_widths``), of equal FLOPs (the batch
    shrinks as ``c^2`` grows), are timed round robin on every device at once;
    ``fit_min_features`` fits their rates. (1, 1), no narrow-channel rule, when noise leaves
    fewer than two usable rates."""
    widths = sorted(sweep.conv_widths)
    top = widths[-1]
    specs = [conv_chain_spec((top // c) ** 2, 8, c) for c in widths]
    ms = measure_chains(devices, specs, repeats=sweep.repeats, warmup=sweep.warmup)
    rates = {c: m.flops / m.time_s for c, m in zip(widths, ms) if m.time_s > 0}
    return fit_min_features(rates)


NARROW_POWERS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


def fit_min_features(rates: Mapping[int, float]) -> tuple[float, float]:
    """The ``(W, p)`` for which ``rate(c) = R min(1, c / W)^p`` fits ``rates`` (channels ->
    FLOP/s) best in log space, ``R`` the median rate of the widths from ``W`` up; ``W`` among the
    measured channel counts (a knee beyond the widest cannot be told from the data), ``p`` among
    ``NARROW_POWERS``. (1, 1), no rule, with fewer than two rates."""
    if len(rates) < 2:
        return 1.0, 1.0
    logs = {c: math.log(r) for c, r in rates.items()}

    def misfit(wp: tuple[int, float]) -> float:
        w, p = wp
        top = statistics.median(v for c, v in logs.items() if c >= w)
        return sum((v - top - p * math.log(min(1.0, c / w))) ** 2 for c, v in logs.items())

    w, p = min(((w, p) for w in sorted(rates) for p in NARROW_POWERS), key=misfit)
    return (1.0, 1.0) if w == min(rates) else (float(w), p)


def kernel_floor(devices: Sequence[jax.Device], sweep: Sweep,
                 cfit: ComputeFit) -> tuple[float, float]:
    """(``kernel_floor_s``, ``kernel_floor_bytes``): the fixed cost a memory-bound kernel of a
    training step's size pays inside a program on top of the tiny-kernel launch, and the size
    from which it pays it.

    Chains of ``x - mean(x, -1) / 2`` on float32 ``(rows, 128)`` shards (``sweep.stream_rows``),
    every device at once, give each size's per-kernel time ``t`` and bytes ``M``
    (``measure_chains``). The larger half of the sizes is fitted as ``t = L0 + M / W'``
    (``relative_nnls``); the floor is ``L0`` less the launch ``cfit.kernel_launch_s``, and the
    threshold the smallest size from which every ``t`` is at least ``L0 / 2``. The bandwidth
    ``W'`` of these in-cache kernels is not used: the roofline keeps the profile's bandwidth.
    On 8 CPU devices sharing 2 cores, kernels of a few KiB cost about the launch, and from a
    few KiB up (where XLA runs reductions as library fusions and splits loops into tasks on
    the thread pool all devices share) tens of us more. (0, 0) when the fit shows no floor.
    """
    reps = dict(repeats=sweep.repeats, warmup=sweep.warmup)
    specs = [stream_kernel_spec(r, steps=(4, 36)) for r in sweep.stream_rows]
    ms = sorted(measure_chains(devices, specs, **reps), key=lambda m: m.nbytes)
    upper = ms[len(ms) // 2:]
    design = np.array([[1.0, m.nbytes] for m in upper])
    intercept = float(relative_nnls(design, np.array([m.time_s for m in upper]))[0])
    floor = intercept - cfit.kernel_launch_s
    if floor <= 0.0:
        return 0.0, 0.0
    start = next((m.nbytes for i, m in enumerate(ms)
                  if all(n.time_s >= intercept / 2 for n in ms[i:])), ms[-1].nbytes)
    return floor, float(start)


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
        platform=devices[0].platform if devices[0].platform in PLATFORMS else "",
        # CPU devices are threads on the host's cores, every rate above measured with all of
        # them busy: a device alone gets the whole pool (Hardware.shared_compute_devices)
        shared_compute_devices=len(devices) if devices[0].platform == "cpu" else 1,
        # host offload's link: the reference sheet's, else (CPU devices) a copy within memory
        host_bytes_per_s=ref.host_bytes_per_s if ref else hbm / 2,
        host_memory_bytes=ref.host_memory_bytes if ref else _device_memory_bytes(devices),
        source=source,
        citations=(
            ("peak_flops_by_dtype", ref.name if ref else fitted),
            ("hbm_bytes_per_s", ref.name if ref else fitted),
            ("memory_bytes", "jax Device.memory_stats()['bytes_limit'], else host RAM / devices"),
            ("intra_node", fitted),
            ("inter_node", ref.name if ref else "not measurable in one process: intra copy"),
            ("efficiencies", fitted),
            ("host_bytes_per_s", ref.name if ref else "a copy within memory: hbm_bytes_per_s / 2"),
            ("shared_compute_devices", "cpu devices: threads on the host's cores, every rate "
                                       "measured with all of them busy; else 1"),
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


_UNRESOLVED_BANDWIDTH = 1e18   # bytes/s: fit_collectives' 1 / _TINY for a zero bytes term


def _link_figures(
    name: str, fit: CollectiveFit | None, ref: Hardware | None
) -> tuple[Link, float, tuple[tuple[str, float], ...], float]:
    """(intra-node link, collective efficiency, per-kind efficiencies, collective launch)."""
    if fit is None:  # one device: nothing to measure
        if ref is not None:
            return ref.intra_node, ref.collective_efficiency, ref.collective_kind_efficiency, 0.0
        return Link(f"{name}-none", 1e12, 0.0), 1.0, (), 0.0
    # A kind whose bytes term fitted to zero (its times did not grow with size beyond the noise,
    # as on a loaded machine) has no measured bandwidth: it gets the median kind's.
    bandwidths = dict(fit.bandwidth_by_kind)
    measured = {k: b for k, b in bandwidths.items() if b < _UNRESOLVED_BANDWIDTH}
    if not measured:
        return _link_figures(name, None, ref)[:3] + (fit.collective_launch_s,)
    best = max(measured.values())
    coll_eff = statistics.median(measured.values()) / best
    kind_eff = tuple((k, measured[k] / (best * coll_eff) if k in measured else 1.0)
                     for k in bandwidths)
    intra = Link(f"{name}-measured", best, fit.latency_s)
    return intra, coll_eff, kind_eff, fit.collective_launch_s


def _device_memory_bytes(devices: Sequence[jax.Device]) -> int:
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host // len(devices))
