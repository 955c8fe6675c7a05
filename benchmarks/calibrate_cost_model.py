"""Calibrates the cost model on this machine's emulated CPU devices and checks its predictions.

1. ``cost_models.profile()`` fits a ``Hardware`` on its own sweep of sizes (powers of two).
2. A *different* sweep (sizes 3 * 2^k, non-square matmuls, a 2 x 4 mesh's axes) is measured and
   predicted with ``CostModel``; the relative error |predicted - measured| / measured is reported.

Writes ``benchmarks/results/cost_model_cpu.md`` (table and median error),
``cost_model_cpu.csv`` and the fitted profile ``cost_model_cpu_profile.json`` (with
``--update-cpu-profile`` also the shipped ``cost_models/profiles/cpu.json``).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/calibrate_cost_model.py
    python benchmarks/calibrate_cost_model.py --quick     # a few seconds, smaller sweeps
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import cost_models  # noqa: E402
from cost_models.collectives import KINDS  # noqa: E402
from cost_models.measure import (  # noqa: E402
    Measurement,
    measure_collective,
    measure_collective_chain,
    measure_kernel_chain,
    measure_matmul,
    measure_memory,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MESH = {"data": 2, "model": 4}  # row-major over devices 0..7
# Collectives over each group of the 2 x 4 mesh: ("data",) has stride 4, unlike any fitted group.
GROUP_AXES: tuple[tuple[str, ...], ...] = (("data", "model"), ("model",), ("data",))
EVAL_MATMULS = ((192, 192, 192), (384, 384, 384), (768, 768, 768), (640, 320, 960),
                (1536, 768, 384), (96, 1024, 512))
EVAL_MEMORY = (3 << 17, 3 << 19, 3 << 20)
EVAL_COLLECTIVE_BYTES = (3 << 11, 3 << 13, 3 << 15, 3 << 17, 3 << 19, 3 << 21)
# Chains of dependent tiny kernels / all-reduces in one program, of lengths the profile did not
# fit (it fits 4, 16, 64 and 1, 4, 16): the launch costs a step pays per kernel and collective.
EVAL_KERNEL_CHAINS = (8, 32, 96)
EVAL_COLLECTIVE_CHAINS = (2, 8, 24)


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str
    dtype: str
    size: str
    axes: str
    measured_s: float
    predicted_s: float

    @property
    def rel_error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s


def evaluate_compute(cm: cost_models.CostModel, quick: bool) -> list[Row]:
    dev = jax.devices()  # every device at once, as in a sharded step
    matmuls = EVAL_MATMULS[:3] if quick else EVAL_MATMULS
    dtypes = ("float32",) if quick else ("float32", "bfloat16")
    samples = [measure_matmul(dev, m, k, n, dt) for dt in dtypes for m, k, n in matmuls]
    samples += [measure_memory(dev, e) for e in (EVAL_MEMORY[:1] if quick else EVAL_MEMORY)]
    return [_compute_row(cm, s) for s in samples]


def _compute_row(cm: cost_models.CostModel, s: Measurement) -> Row:
    # each sample is one program: the op plus one dispatch
    predicted = cm.hw.dispatch_s + cm.compute_time_s(s.flops, s.nbytes, s.dtype,
                                                     is_matmul=s.kind == "matmul")
    return Row(s.kind, s.dtype, s.label, "-", s.time_s, predicted)


def evaluate_collectives(cm: cost_models.CostModel, quick: bool) -> list[Row]:
    grid = np.array(jax.devices()[:8]).reshape(tuple(MESH.values()))
    mesh = Mesh(grid, tuple(MESH))
    sizes = EVAL_COLLECTIVE_BYTES[1::2] if quick else EVAL_COLLECTIVE_BYTES
    rows = []
    for axes in GROUP_AXES:
        for kind in KINDS:
            for nbytes in sizes:
                s = measure_collective(mesh, axes, kind, nbytes)
                predicted = cm.hw.dispatch_s + cm.collective_time_s(kind, s.nbytes, axes)
                rows.append(Row(kind, s.dtype, s.label, ",".join(axes), s.time_s, predicted))
    return rows


def evaluate_chains(cm: cost_models.CostModel, quick: bool) -> list[Row]:
    """One program of n kernels costs a dispatch plus n launches (the tiny ops' own work is
    negligible); one of n dependent all-reduces a dispatch plus n tiny all-reduces."""
    dev = jax.devices()
    rows = []
    for steps in EVAL_KERNEL_CHAINS[:2] if quick else EVAL_KERNEL_CHAINS:
        s = measure_kernel_chain(dev, steps)
        rows.append(Row("kernel-chain", s.dtype, f"{int(s.nbytes)} kernels", "-", s.time_s,
                        cm.hw.dispatch_s + s.nbytes * cm.hw.kernel_launch_s))
    axes = tuple(MESH)
    for steps in EVAL_COLLECTIVE_CHAINS[:2] if quick else EVAL_COLLECTIVE_CHAINS:
        s = measure_collective_chain(dev, steps)
        one = cm.collective_time_s("all-reduce", 32.0, axes)
        rows.append(Row("all-reduce-chain", s.dtype, f"{steps} all-reduces", ",".join(axes),
                        s.time_s, cm.hw.dispatch_s + steps * one))
    return rows


def median_error(rows: Sequence[Row]) -> float:
    return statistics.median(r.rel_error for r in rows)


def write_csv(rows: Sequence[Row], path: pathlib.Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "dtype", "size", "axes", "measured_s", "predicted_s", "rel_error"])
        for r in rows:
            w.writerow([r.kind, r.dtype, r.size, r.axes, f"{r.measured_s:.6e}",
                        f"{r.predicted_s:.6e}", f"{r.rel_error:.4f}"])


def render_markdown(rows: Sequence[Row], hw: cost_models.Hardware, fit_s: float) -> str:
    by_kind = {k: [r for r in rows if r.kind == k] for k in dict.fromkeys(r.kind for r in rows)}
    lines = [
        "# Cost model calibration: emulated CPU devices",
        "",
        f"Profile: {hw.source}; fitted in {fit_s:.1f} s on power-of-two sizes. Evaluated on a",
        f"different sweep (sizes 3*2^k, non-square matmuls, groups of a {MESH} mesh).",
        "Relative error = |predicted - measured| / measured; times are medians of 5 runs.",
        "",
        f"**Median relative error: {median_error(rows):.1%}** over {len(rows)} cases.",
        "",
        "| kind | cases | median error |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {len(rs)} | {median_error(rs):.1%} |" for k, rs in by_kind.items()]
    lines += ["", "| kind | dtype | size | axes | measured (us) | predicted (us) | error |",
              "|---|---|---|---|---|---|---|"]
    lines += [
        f"| {r.kind} | {r.dtype} | {r.size} | {r.axes} | {r.measured_s * 1e6:.1f} | "
        f"{r.predicted_s * 1e6:.1f} | {r.rel_error:.1%} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sweeps, a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="results folder")
    parser.add_argument(
        "--update-cpu-profile", action="store_true",
        help="also save the fitted profile as the shipped cost_models/profiles/cpu.json",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    hw = cost_models.profile(quick=args.quick)
    fit_s = time.perf_counter() - start
    cm = cost_models.CostModel(hw, MESH)
    rows = (evaluate_compute(cm, args.quick) + evaluate_collectives(cm, args.quick)
            + evaluate_chains(cm, args.quick))
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    write_csv(rows, args.out / f"cost_model_cpu{suffix}.csv")
    (args.out / f"cost_model_cpu{suffix}.md").write_text(render_markdown(rows, hw, fit_s))
    hw.save(args.out / f"cost_model_cpu_profile{suffix}.json")
    if args.update_cpu_profile:
        hw.save(pathlib.Path(cost_models.__file__).parent / "profiles" / "cpu.json")
    print(f"median relative error {median_error(rows):.1%} over {len(rows)} cases "
          f"(fit {fit_s:.1f} s, total {time.perf_counter() - start:.1f} s)")
    return median_error(rows)


if __name__ == "__main__":
    main()
