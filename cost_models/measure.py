"""Micro-benchmarks on real devices: matmul, a streaming elementwise op, and the collectives.

Each returns a ``Measurement``: the counts the cost model takes (FLOPs, bytes, group size) and the
median wall time of ``repeats`` runs after ``warmup`` runs, each ended by ``block_until_ready``.
Collectives run under ``jax.shard_map`` on a 1-D mesh (axis ``"x"``) of the given devices, and
their ``nbytes`` follows the convention of ``CostModel.collective_time_s``.
"""
from __future__ import annotations

import dataclasses
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
