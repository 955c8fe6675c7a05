"""Micro-benchmarks on real devices: matmul, a streaming elementwise op, and the collectives.

Each returns a ``Measurement``: the counts the cost model takes (FLOPs, bytes, group size) and the
median wall time of ``repeats`` runs after ``warmup`` runs, each ended by ``block_until_ready``.
Collectives run under ``jax.shard_map`` on a 1-D mesh (axis ``"x"``) of the given devices, and
their ``nbytes`` follows the convention of ``CostModel.collective_time_s``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "x"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed benchmark.

    Attributes:
      kind: ``"matmul"``, ``"memory"`` or a collective kind.
      dtype: element dtype.
      flops: FLOPs of one run (0 for memory and collectives).
      nbytes: bytes accessed (matmul, memory) or the collective's nbytes convention.
      group_size: devices taking part (1 for matmul and memory).
      time_s: median seconds of one run.
      label: a human-readable size, e.g. ``"512x512x512"``.
    """

    kind: str
    dtype: str
    flops: float
    nbytes: float
    group_size: int
    time_s: float
    label: str


def median_time_s(fn: Callable[..., Any], args: Sequence[Any], repeats: int, warmup: int) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _devices(device_or_devices) -> list[jax.Device]:
    if isinstance(device_or_devices, jax.Device):
        return [device_or_devices]
    return list(device_or_devices)


def _on_every_device(fn: Callable, devices: Sequence[jax.Device], *shapes_dtypes) -> Callable:
    """``fn`` run by every device on its own inputs at once (a 1-D shard_map): the way a sharded
    step computes, so devices that share host cores or memory see each other's load."""
    mesh = Mesh(np.array(devices), ("x",))
    spec = PartitionSpec("x")
    stacked = [jax.device_put(jnp.ones((len(devices),) + shape, dtype), NamedSharding(mesh, spec))
               for shape, dtype in shapes_dtypes]  # (devices, *shape) each
    body = jax.shard_map(lambda *xs: fn(*(x[0] for x in xs))[None], mesh=mesh,
                         in_specs=(spec,) * len(stacked), out_specs=spec)
    return jax.jit(body), stacked


def measure_dispatch(devices: Sequence[jax.Device], repeats: int = 7, warmup: int = 2) -> float:
    """Time of a program that does almost nothing, on every device at once: the per-call cost
    that single-op measurements carry on top of their op."""
    fn, args = _on_every_device(lambda v: v + 1.0, list(devices), ((1,), jnp.float32))
    return median_time_s(fn, args, repeats, warmup)


def measure_matmul(
    device, m: int, k: int, n: int, dtype: str, repeats: int = 5, warmup: int = 2
) -> Measurement:
    """Times ``(m, k) @ (k, n)`` on each given device at once (a device, or a list of them);
    flops and bytes are per device."""
    fn, args = _on_every_device(jnp.matmul, _devices(device), ((m, k), dtype), ((k, n), dtype))
    t = median_time_s(fn, args, repeats, warmup)
    itemsize = jnp.dtype(dtype).itemsize
    return Measurement(
        "matmul", dtype, 2.0 * m * k * n, float((m * k + k * n + m * n) * itemsize), 1, t,
        f"{m}x{k}x{n}",
    )


def measure_memory(
    device, num_elements: int, repeats: int = 5, warmup: int = 2
) -> Measurement:
    """Times ``x * 2 + 1`` on a float32 vector on each given device at once: one read and one
    write of every element (bytes per device)."""
    fn, args = _on_every_device(lambda v: v * 2.0 + 1.0, _devices(device),
                                ((num_elements,), jnp.float32))
    t = median_time_s(fn, args, repeats, warmup)
    return Measurement("memory", "float32", 0.0, 8.0 * num_elements, 1, t, f"{num_elements}")


def _collective_body(
    kind: str, axes: tuple[str, ...], n: int
) -> Callable[[jax.Array], jax.Array]:
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, axes)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, axes, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axes, tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
    if kind == "collective-permute":
        return lambda x: jax.lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])
    raise ValueError(f"unknown collective kind {kind!r}")


def _input_elements_per_device(kind: str, nbytes: float, n: int) -> int:
    """Per-device input length (float32, a multiple of n) that gives ``nbytes`` by convention."""
    elems = int(nbytes) // 4
    if kind == "all-gather":
        elems //= n  # nbytes counts the gathered output
    return max(n, elems // n * n)


def line_mesh(devices: Sequence[jax.Device], group_size: int = 0) -> tuple[Mesh, tuple[str, ...]]:
    """A ``(len/g, g)`` mesh ``("outer", "x")`` of ``devices`` and the group axes ``("x",)``.

    ``group_size`` 0 means all devices. Every device takes part, in ``len/g`` concurrent groups,
    as in a sharded program (emulated CPU devices share the host, so idle devices would flatter).
    """
    g = group_size or len(devices)
    grid = np.array(devices).reshape(len(devices) // g, g)
    return Mesh(grid, ("outer", AXIS)), (AXIS,)


def measure_collective(
    mesh: Mesh,
    axes: tuple[str, ...],
    kind: str,
    nbytes: float,
    repeats: int = 5,
    warmup: int = 2,
) -> Measurement:
    """Times one collective of about ``nbytes`` (rounded to a multiple of 4n) over ``axes``.

    Every device of ``mesh`` holds a shard; groups along ``axes`` run concurrently.
    """
    n = int(np.prod([mesh.shape[a] for a in axes]))
    elems = _input_elements_per_device(kind, nbytes, n)
    spec = PartitionSpec(tuple(mesh.axis_names))
    x = jax.device_put(  # (devices * elems,)
        jnp.ones((mesh.size * elems,), jnp.float32), NamedSharding(mesh, spec)
    )
    body = _collective_body(kind, axes, n)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    t = median_time_s(fn, (x,), repeats, warmup)
    actual = 4.0 * elems * (n if kind == "all-gather" else 1)
    return Measurement(kind, "float32", 0.0, actual, n, t, f"{int(actual)}B")


# ---- overheads inside one program ---------------------------------------------------------------
# A single-op program pays the op, its launch and the program's dispatch at once; the launch a step
# pays per kernel (or per collective, per loop trip) is the slope of time against the count of
# kernels in one program, every device running its chain at once.
def count_hlo_kernels(compiled) -> int:
    """Instructions that do work in a compiled program's entry and loop bodies (fusions, dots,
    copies, collectives; not parameters, constants, tuples or bitcasts), each counted once."""
    free = ("parameter(", "constant(", "tuple(", "get-tuple-element(", "bitcast(", "-done(")
    kernels, fused = 0, False
    for line in compiled.as_text().splitlines():
        s = line.strip()
        if s.endswith("{") and " = " not in s:
            fused = any(w in s.split(" ")[0] for w in ("fused", "wrapped"))
            continue
        if fused or " = " not in s or any(f in s.split(" = ", 1)[1] for f in free):
            continue
        kernels += 1
    return kernels


def _chain(x: jax.Array, w: jax.Array, steps: int) -> jax.Array:
    for _ in range(steps):  # a dot and an elementwise kernel per step, each reading the last
        x = jnp.tanh(x @ w)
    return x


def measure_kernel_chain(
    devices: Sequence[jax.Device], steps: int, size: int = 16, repeats: int = 7, warmup: int = 2
) -> Measurement:
    """Times ``steps`` dependent tiny matmul + tanh kernels in one program on every device at
    once; ``nbytes`` holds the program's kernel count (``count_hlo_kernels``)."""
    fn, args = _on_every_device(lambda x, w: _chain(x, w, steps), list(devices),
                                ((size, size), jnp.float32), ((size, size), jnp.float32))
    kernels = count_hlo_kernels(fn.lower(*args).compile())
    t = median_time_s(fn, args, repeats, warmup)
    return Measurement("kernel-chain", "float32", 0.0, float(kernels), 1, t, f"{steps} steps")


def measure_collective_chain(
    devices: Sequence[jax.Device], steps: int, repeats: int = 7, warmup: int = 2
) -> Measurement:
    """Times ``steps`` dependent tiny all-reduces over all ``devices`` in one program (each
    reads the last, so XLA cannot combine them); ``nbytes`` holds the collective count."""
    mesh, axes = line_mesh(devices)
    spec = PartitionSpec(tuple(mesh.axis_names))

    def body(x):
        for _ in range(steps):
            x = jax.lax.psum(x, axes) * 0.5
        return x

    x = jax.device_put(jnp.ones((mesh.size * 8,), jnp.float32), NamedSharding(mesh, spec))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    t = median_time_s(fn, (x,), repeats, warmup)
    return Measurement("collective-chain", "float32", 0.0, float(steps), len(devices), t,
                       f"{steps} all-reduces")


def measure_loop(
    devices: Sequence[jax.Device], trips: int, repeats: int = 7, warmup: int = 2
) -> Measurement:
    """Times a ``fori_loop`` of ``trips`` trips of one tiny kernel on every device at once;
    ``nbytes`` holds the trip count."""
    fn, args = _on_every_device(
        lambda x: jax.lax.fori_loop(0, trips, lambda i, v: jnp.tanh(v) + 1.0, x),
        list(devices), ((16,), jnp.float32))
    t = median_time_s(fn, args, repeats, warmup)
    return Measurement("loop", "float32", 0.0, float(trips), 1, t, f"{trips} trips")


def slope_s(samples: Sequence[Measurement]) -> float:
    """Least-squares seconds per unit of ``nbytes`` (kernels, collectives, trips) over
    ``samples`` of one kind: the in-program cost of one more of them (>= 0)."""
    x = np.array([s.nbytes for s in samples])
    t = np.array([s.time_s for s in samples])
    slope = np.polyfit(x, t, 1)[0] if len(set(x.tolist())) > 1 else 0.0
    return max(float(slope), 0.0)
# ---- kernels of a step's size, inside one program -----------------------------------------------
# A training step's kernels read and write tensors of tens of KiB to a few MiB per device and run
# among hundreds of others. Timed the way the step pays them: the slope of time against the kernel
# count of a chain of such kernels in one program, on every device at once (measured on 8 CPU
# devices: these kernels cost several times the launch of a tiny one, and run at in-cache rather
# than DRAM rates; small convolutions run well below a matmul's rate).
def round_robin_times_s(programs: Sequence[tuple[Callable, Sequence[Any]]], repeats: int,
                        warmup: int) -> list[float]:
    """Median wall time of each ``(fn, args)``, timed round robin (repeat r of every program
    before repeat r + 1 of any), so drift in the machine's load hits all of them alike."""
    for fn, args in programs:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: list[list[float]] = [[] for _ in programs]
    for _ in range(repeats):
        for i, (fn, args) in enumerate(programs):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """A chain benchmark: ``body(steps, *xs)`` on per-device inputs ``shapes_dtypes``, compiled
    at two chain lengths ``steps``; ``finish(seconds, kernels)`` (what one more step adds)
    returns the per-kernel ``Measurement``."""

    body: Callable
    shapes_dtypes: tuple
    steps: tuple[int, int]
    finish: Callable[[float, float], Measurement]


def measure_chains(devices: Sequence[jax.Device], specs: Sequence[ChainSpec], repeats: int = 7,
                   warmup: int = 2) -> list[Measurement]:
    """Compiles every spec at both lengths, times all the programs round robin on every device
    at once (so drift in the machine's load hits every size alike), and returns each spec's
    ``finish`` of the time and kernel count one more step adds."""
    programs, kernels = [], []
    for spec in specs:
        for n in spec.steps:
            fn, args = _on_every_device(lambda *xs, n=n, body=spec.body: body(n, *xs),
                                        list(devices), *spec.shapes_dtypes)
            compiled = fn.lower(*args).compile()
            programs.append((compiled, args))
            kernels.append(count_hlo_kernels(compiled))
    t = round_robin_times_s(programs, repeats, warmup)
    out = []
    for i, spec in enumerate(specs):
        extra = spec.steps[1] - spec.steps[0]
        per_step = (t[2 * i + 1] - t[2 * i]) / extra
        out.append(spec.finish(per_step, max(kernels[2 * i + 1] - kernels[2 * i], 1) / extra))
    return out


def _norm_steps(steps: int, x: jax.Array) -> jax.Array:
    for _ in range(steps):  # a row reduction and an elementwise kernel per step, each reading x
        x = x - jnp.mean(x, axis=-1, keepdims=True) * 0.5
    return x


def stream_kernel_spec(rows: int, cols: int = 128, steps: tuple[int, int] = (4, 16)) -> ChainSpec:
    """Memory-bound kernels of a step's size: chains of ``x - mean(x, -1) / 2`` on a float32
    ``(rows, cols)`` per device (each step reads x twice and writes it once); ``time_s`` and
    ``nbytes`` per kernel (a step's over its kernels)."""
    step_bytes = 3.0 * rows * cols * 4

    def finish(per_step: float, kernels: float) -> Measurement:
        return Measurement("memory", "float32", 0.0, step_bytes / kernels, 1,
                           per_step / kernels, f"{rows}x{cols} in program")

    return ChainSpec(_norm_steps, (((rows, cols), jnp.float32),), steps, finish)


def _matmul_steps(steps: int, x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    w1 = w1 / w1.shape[0]  # keeps the values bounded along the chain
    w2 = w2 / w2.shape[0]
    for _ in range(steps):
        x = (x @ w1) @ w2
    return x


def matmul_chain_spec(m: int, k: int, n: int, dtype: str,
                      steps: tuple[int, int] = (1, 3)) -> ChainSpec:
    """``(m, k) @ (k, n)`` then ``@ (n, k)``, chained; ``time_s``, ``flops`` and ``nbytes`` per
    kernel."""
    itemsize = jnp.dtype(dtype).itemsize

    def finish(per_step: float, kernels: float) -> Measurement:
        return Measurement("matmul", dtype, 4.0 * m * k * n / kernels,
                           2.0 * (m * k + k * n + m * n) * itemsize / kernels, 1,
                           per_step / kernels, f"{m}x{k}x{n} in program")

    shapes = (((m, k), dtype), ((k, n), dtype), ((n, k), dtype))
    return ChainSpec(_matmul_steps, shapes, steps, finish)


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _conv_steps(steps: int, x: jax.Array, w: jax.Array) -> jax.Array:
    w = w / (w.shape[0] * w.shape[1] * w.shape[2])
    for _ in range(steps):
        x = _conv(x, w)
    return x


def conv_chain_spec(batch: int, side: int, channels: int, window: int = 3,
                    steps: tuple[int, int] = (2, 6)) -> ChainSpec:
    """Same-padded ``window x window`` convolutions of a float32 ``(batch, side, side,
    channels)`` per device, channels in = out, chained; per kernel figures."""
    flops = 2.0 * batch * side * side * channels * channels * window * window
    nbytes = 4.0 * (2 * batch * side * side * channels + window * window * channels**2)

    def finish(per_step: float, kernels: float) -> Measurement:
        return Measurement("conv", "float32", flops / kernels, nbytes / kernels, 1,
                           per_step / kernels, f"{batch}x{side}x{side}x{channels} w{window}")

    shapes = (((batch, side, side, channels), jnp.float32),
              ((window, window, channels, channels), jnp.float32))
    return ChainSpec(_conv_steps, shapes, steps, finish)


# Transcendental functions a training step evaluates (softmax, GELU, layer norm, Adam), each
# wrapped so that repeated application stays finite.
TRANSCENDENTAL_FNS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "exp": lambda x: jnp.exp(x * -1e-3),
    "log": lambda x: jnp.log(x + 2.0),
    "tanh": jnp.tanh,
    "rsqrt": lambda x: jax.lax.rsqrt(x + 2.0),
}


def measure_transcendentals(devices: Sequence[jax.Device], elements: int = 1 << 16,
                            steps: tuple[int, int] = (2, 18), repeats: int = 7,
                            warmup: int = 2) -> list[Measurement]:
    """Seconds one device takes per evaluation of each of ``TRANSCENDENTAL_FNS``, every device
    busy at once: ``steps`` applications in a row, which XLA fuses into one elementwise kernel
    over a float32 vector of ``elements`` per device, timed round robin; the slope of time
    against the count, per element (``time_s``; ``nbytes`` holds ``elements``)."""
    programs = []
    for f in TRANSCENDENTAL_FNS.values():
        for n in steps:
            def body(x, n=n, f=f):
                for _ in range(n):
                    x = f(x)
                return x
            programs.append(_on_every_device(body, list(devices), ((elements,), jnp.float32)))
    t = round_robin_times_s(programs, repeats, warmup)
    extra = (steps[1] - steps[0]) * elements
    return [Measurement("transcendental", "float32", 0.0, float(elements), 1,
                        (t[2 * i + 1] - t[2 * i]) / extra, name)
            for i, name in enumerate(TRANSCENDENTAL_FNS)]


# ---- a max-pool's gradient ----------------------------------------------------------------------
# XLA:CPU has no select-and-scatter kernel: it expands one into s32 iotas (one per operand dim), a
# variadic reduce-window finding each window's argmax, a concatenation of the indices, a zero fill
# and a scatter of the source into it (an element loop). Its figure is what that expansion costs.
def _pool_gradient(x: jax.Array, source: jax.Array) -> jax.Array:
    """The gradient of a 2 x 2, stride-2 max-pool of an NHWC ``x`` for the cotangent ``source``
    (one ``select_and_scatter_add``: the forward pool is not used, so XLA drops it)."""
    def pool(v):
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                     "VALID")
    return jax.vjp(pool, x)[1](source)[0]


def measure_select_scatter(devices: Sequence[jax.Device],
                           shapes: Sequence[tuple[int, int, int, int]], repeats: int = 7,
                           warmup: int = 2) -> list[Measurement]:
    """Seconds one max-pool gradient takes on a float32 NHWC operand of each of ``shapes`` per
    device, every device busy at once: a program holding only the gradient, less a program that
    reads and writes the same operand once (``x * 2``: the dispatch and one kernel), all timed
    round robin (``time_s``; ``nbytes`` holds the operand's elements). Separate programs rather
    than a chain: XLA would share the iotas of chained expansions of one shape, which a step's
    pools (one per shape) do not."""
    programs = []
    for b, h, w, c in shapes:
        pooled = (b, h // 2, w // 2, c)
        programs.append(_on_every_device(_pool_gradient, list(devices),
                                         ((b, h, w, c), jnp.float32), (pooled, jnp.float32)))
        programs.append(_on_every_device(lambda x, s: x * 2.0, list(devices),
                                         ((b, h, w, c), jnp.float32), (pooled, jnp.float32)))
    t = round_robin_times_s(programs, repeats, warmup)
    return [Measurement("select-scatter", "float32", 0.0, float(math.prod(shape)), 1,
                        t[2 * i] - t[2 * i + 1], "x".join(map(str, shape)))
            for i, shape in enumerate(shapes)]
