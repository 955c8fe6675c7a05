"""A GPT training step on one GPU with and without autopar's fused kernels: time and MFU.

The step (``autopar.models.gpt``, adamw, bfloat16 compute) runs through ``autopar.autoparallel``
on a one-device mesh three ways: ``kernels="never"`` (XLA's code), ``"always"`` (every fused
kernel the layouts allow: attention, norms, LM-head cross-entropy, AdamW) and ``"auto"`` (those
the cost model prefers). Each row: the kernels used, the median step time after warm-up, the
model FLOP/s and MFU (the traced step's FLOPs, ``ir.Graph.total_flops``, over the device's bf16
peak), the plan's predicted step time and measured / predicted.

    python benchmarks/gpu_step.py                      # a GPU: results/gpu_step.md (GPT-1.3B)
    python benchmarks/gpu_step.py --quick --interpret  # CPU check of the script

``--interpret`` runs on the CPU with a tiny GPT, the kernels in Pallas' interpreter (a test of
the script, not a measurement): results go to ``gpu_step_interpret.md``.
"""
from __future__ import annotations

import os
import sys

INTERPRET = "--interpret" in sys.argv
if not INTERPRET:
    os.environ.setdefault("JAX_PLATFORMS", "")   # keep the GPU: _common defaults to the CPU

import dataclasses  # noqa: E402
from collections import Counter  # noqa: E402

import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_kernels import device_profile, gpu_args  # noqa: E402

import autopar  # noqa: E402
import ir  # noqa: E402
from autopar.models import gpt  # noqa: E402
from cost_models.measure import median_time_s  # noqa: E402

HEADER = ("model", "batch x seq", "kernels", "kernels used", "median_ms", "TFLOP/s", "MFU",
          "predicted_ms", "measured/predicted", "speedup_vs_never", "status")
MODES = ("never", "always", "auto")


def config(quick: bool) -> tuple[str, gpt.GPTConfig, int]:
    if quick:
        return "GPT-tiny", gpt.GPTConfig(vocab=256, seq=64, d_model=64, heads=2, d_ff=256,
                                         layers=1), 2
    return "GPT-1.3B", dataclasses.replace(gpt.GPT_CONFIGS["1.3B"], seq=2048), 4


def run(mode: str, cfg, batch_size: int, repeats: int, hw) -> tuple[list, float]:
    """``[kernels used, median ms, TFLOP/s, MFU, predicted ms, measured/predicted]`` and the
    step's FLOPs."""
    step, state, batch = gpt.concrete(cfg, batch_size)
    flops = ir.trace(step, state, batch).total_flops
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    fn = autopar.autoparallel(step, mesh=mesh, hardware=hw, kernels=mode, time_limit_s=30)
    compiled = fn.lower(state, batch).compile()
    t = median_time_s(compiled, (state, batch), repeats, warmup=2)
    used = Counter(k.kernel for k in fn.plan.kernels)
    predicted = fn.plan.cost.step_time_s
    peak = hw.peak_flops_per_s("bfloat16")
    return [" ".join(f"{k}x{n}" for k, n in sorted(used.items())) or "none", t * 1e3,
            flops / t / 1e12, flops / t / peak, predicted * 1e3, t / predicted], flops


def main() -> None:
    args = gpu_args(__doc__, "run on the CPU, kernels in Pallas' interpreter (a script check)",
                    repeats=10)
    hw = device_profile()
    name, cfg, batch_size = config(args.quick)
    repeats = 2 if args.quick else args.repeats
    rows = []
    for mode in MODES:
        try:
            cells, _ = run(mode, cfg, batch_size, repeats, hw)
            status = "ok"
        except Exception as e:  # a failing mode is a result: say why, keep going
            cells, status = [float("nan")] * 6, f"error: {type(e).__name__}: {str(e)[:120]}"
        rows.append([name, f"{batch_size} x {cfg.seq}", mode] + cells + [float("nan"), status])
        print(rows[-1])
    never = rows[0][4]
    for r in rows:
        r[9] = never / r[4] if r[4] == r[4] else float("nan")
    write(args, rows, hw)


def write(args, rows: list[list], hw) -> None:
    out = _common.out_dir(args)
    stem = "gpu_step_interpret" if INTERPRET else "gpu_step"
    _common.write_csv(out / f"{stem}.csv", HEADER, rows)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    lines = ["# GPT training step with and without fused kernels, one device"
             + (" (interpret-mode check)" if INTERPRET else ""), "",
             f"Device: {device}; jax {jax.__version__}; prediction profile: {hw.name}.",
             f"Environment: {_common.environment()}.", "",
             "Medians of timed steps after warm-up. MFU: the traced step's FLOPs per second over "
             "the profile's bfloat16 peak. predicted_ms: the plan's step time.", ""]
    if INTERPRET:
        lines += ["Interpret mode runs the kernels in Pallas' interpreter on the CPU: the times "
                  "say nothing about GPU speed; this file only shows the script works.", ""]
    lines.append(_common.md_table(HEADER, rows))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (stem + '.md')}")


if __name__ == "__main__":
    jnp.zeros(())   # start the backend before planning
    main()
