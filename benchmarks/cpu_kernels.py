"""What a training step's kernels cost on the 8 emulated CPU devices, beside the profile's terms.

Micro-benchmarks only (no training step), every device at once, each figure the slope of time
against the kernel count of chains inside one program (``cost_models.measure.measure_chains``),
all sizes of a section timed round robin so drift in the machine's load hits them alike:

1. matmul rate against size, from 32^3 to the 512^3 the profile used to rate matmuls on, and the
   shapes the plan matrix's GPT and MoE run per device (is a step's small matmul slower?);
2. memory-bound kernels of a step's size (``x - mean(x)``, 2 KiB to 2 MiB per device) against
   the tiny-kernel launch of a chain of 16x16 kernels and the single-op memory programs the
   profile used to fit the bandwidth on;
3. small 3x3 convolutions against the matmul rate;
4. a tiny all-reduce in a chain of bare all-reduces against one between step-sized kernels.

Writes ``benchmarks/results/cpu_kernels.md`` and ``cpu_kernels.csv``.

    python benchmarks/cpu_kernels.py           # about 2 minutes on 2 idle cores
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from cost_models.measure import (  # noqa: E402
    conv_chain_spec,
    matmul_chain_spec,
    measure_chains,
    measure_collective_chain,
    measure_collective_in_step,
    measure_kernel_chain,
    measure_memory,
    slope_s,
    stream_kernel_spec,
)

MATMULS = ((32, 32, 32), (64, 64, 64), (64, 64, 256), (128, 128, 128), (128, 128, 512),
           (512, 128, 128), (96, 512, 128), (256, 256, 256), (512, 512, 512))
STREAM_ROWS = (4, 16, 32, 64, 128, 256, 512, 1024, 4096)
CONVS = ((4, 16, 16), (4, 8, 32), (8, 16, 32))
COLS = ("section", "kernel", "flops", "bytes", "time_us", "rate", "note")


def matmul_rows(devs, reps) -> list[list]:
    ms = measure_chains(devs, [matmul_chain_spec(m, k, n, "float32") for m, k, n in MATMULS],
                        **reps)
    big = ms[-1].flops / ms[-1].time_s
    return [["matmul", m.label, m.flops, m.nbytes, m.time_s * 1e6, m.flops / m.time_s / 1e9,
             f"{m.flops / m.time_s / big:.2f} x the 512^3 rate"] for m in ms]


def stream_rows(devs, reps) -> list[list]:
    tiny = slope_s([measure_kernel_chain(devs, k, **reps) for k in (4, 64)])
    single = [measure_memory(devs, e, **reps) for e in (1 << 18, 1 << 20, 1 << 22)]
    fit = np.polyfit([s.nbytes for s in single], [s.time_s for s in single], 1)
    ms = measure_chains(devs, [stream_kernel_spec(r) for r in STREAM_ROWS], **reps)
    rows = [["memory", "16x16 kernel chain", 0.0, 0.0, tiny * 1e6, float("nan"),
             "tiny-kernel launch (the earlier profile's kernel_launch_s)"],
            ["memory", "single-op programs", 0.0, 0.0, fit[1] * 1e6, 1e-9 / fit[0],
             "2^18..2^22 floats: intercept (us) and GB/s (the earlier profile's bandwidth)"]]
    for m in ms:
        old = tiny + m.nbytes * fit[0]  # what the earlier profile's terms give this kernel
        rows.append(["memory", m.label, 0.0, m.nbytes, m.time_s * 1e6,
                     m.nbytes / m.time_s / 1e9, f"{m.time_s / old:.2f} x launch + bytes / "
                     f"single-op bandwidth"])
    return rows


def conv_rows(devs, reps) -> list[list]:
    specs = [conv_chain_spec(b, s, c) for b, s, c in CONVS] + [
        matmul_chain_spec(128, 128, 128, "float32"), matmul_chain_spec(256, 256, 256, "float32")]
    ms = measure_chains(devs, specs, **reps)
    mm = max(m.flops / m.time_s for m in ms[len(CONVS):])
    return [["conv", m.label, m.flops, m.nbytes, m.time_s * 1e6, m.flops / m.time_s / 1e9,
             f"{m.flops / m.time_s / mm:.2f} x the best matmul rate here"] for m in ms]


def collective_rows(devs, reps) -> list[list]:
    chain = slope_s([measure_collective_chain(devs, k, **reps) for k in (1, 4, 16)])
    rows = [["all-reduce", "chain of bare all-reduces", 0.0, 32.0, chain * 1e6, float("nan"),
             "the earlier profile's collective launch (before ring latency)"]]
    for r in (16, 128, 512):
        t = measure_collective_in_step(devs, r, repeats=2 * reps["repeats"] + 1,
                                       warmup=reps["warmup"])
        rows.append(["all-reduce", f"between {r}x128 kernels", 0.0, 32.0, t * 1e6,
                     float("nan"), f"{t / chain:.2f} x the chain's"])
    return rows


def main(argv=None):
    p = _common.parser(__doc__)
    args = p.parse_args(argv)
    out = _common.out_dir(args)
    devs = jax.devices()
    reps = dict(repeats=3 if args.quick else 9, warmup=1 if args.quick else 2)
    load_before = _common.machine_load()
    rows = (matmul_rows(devs, reps) + stream_rows(devs, reps) + conv_rows(devs, reps)
            + collective_rows(devs, reps))
    _common.write_csv(out / "cpu_kernels.csv", COLS, rows)
    md = ["# Step-sized kernels on 8 emulated CPU devices", "",
          "Reproduce: `python benchmarks/cpu_kernels.py`. Every figure is per kernel, inside "
          "one program (the slope of time against the kernel count of chains), all 8 devices "
          "at once; `rate` is GFLOP/s (matmul, conv) or GB/s (memory). See the script's "
          "docstring for the sections.", "",
          f"Load before: {load_before}; after: {_common.machine_load()}.", "",
          _common.md_table(COLS, rows), "", f"Environment: {_common.environment()}.", ""]
    (out / "cpu_kernels.md").write_text("\n".join(md))
    print(f"wrote {out / 'cpu_kernels.md'}")


if __name__ == "__main__":
    main()
