"""Recomputation as a planner decision: predicted at scale, predicted and measured on the CPU.

Part 1 (abstract, H100 profile): ``autopar.models.gpt`` at the paper's 6.7B configuration
(scanned, bfloat16, 64 sequences of 2048), without the user's remat, planned by auto on ``{data:
8}``: the planner decides what the backward pass recomputes (``Plan.recompute``). Beside it, the
same model with the user's own full remat (``nn.remat``, as MaxText users set it), and megatron
on that, and with the user's own selective remat (``nn.remat`` with jax's
``dots_with_no_batch_dims_saveable``, Megatron-LM-style) under megatron and auto, and the
model on one H100 (which fits only with host offload and its state donated:
``benchmarks/offload.py`` plans it); and ``benchmarks/checkpoint.py``'s re-plan of the model
(sequence 1024, 224 rows) from 64 H100s onto the 56 left after losing a node, which no layout
fits without recomputation.

Part 1b (abstract, H100 profile): transformers' Flax Llama at 7B shapes (32 unrolled layers,
float32, sequences of 2048) on 64 H100s as ``{data: 8, model: 8}``, at 64 sequences (fits) and
128 (fits only with recomputation of its unrolled layers, ``ir.recompute_unrolled``).

Part 3 (measured, one CPU device, in a child process with XLA:CPU's memory-minimizing
scheduler, ``--xla_cpu_enable_concurrency_optimized_scheduler=false``): the unrolled rewrite's
steps of two models this project did not write (``autopar.models.zoo``'s Flax linen and Flax
NNX LMs, 4 unrolled layers), each policy's XLA peak beside the planner's prediction for it
(H100 profile, the one device's plan; the prediction models GPU scheduling, not XLA:CPU's, so
this is a cross-check of the rewrite's effect, not of the CPU memory model) and beside
``jax.checkpoint``'s own effect on XLA:CPU's default scheduler.

Part 4 (measured, 8 CPU devices as ``{data: 8}``): Mist's trade, a step that fits its budget
but whose budget rules out a faster layout (``SolverStats.ruled_out``): a scanned GPT of width
384 under 0.9x its plain plan's peak, planned without memory decisions (``memory_decisions=()``)
and with them (the planner may then trade recomputation for that layout), and without a
budget; all run, timed in interleaved rounds, XLA's peaks beside the predictions.

Part 2 (measured, 8 CPU devices as 2x4): a small scanned GPT whose activations outweigh its
parameters, planned plain, then under 0.6x the plain plan's peak; each plan compiled and run,
XLA's peak (``memory_analysis``) beside the prediction, and the step timed in interleaved
rounds (medians), the plain and the recomputing plan side by side.

    python benchmarks/recompute.py            # all parts (about 8 minutes on 2 cores)
    python benchmarks/recompute.py --quick    # parts 2 and 3 only
    python benchmarks/recompute.py --predicted    # parts 1 and 1b only, to predicted.md

Writes ``benchmarks/results/recompute.md``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar.models import gpt  # noqa: E402

BIG = dataclasses.replace(gpt.GPT_CONFIGS["6.7B"], scan=True, seq=2048)
SMALL = gpt.GPTConfig(scan=True, layers=4, d_model=32, seq=128, d_ff=128, heads=4, vocab=64)
SMALL_ROWS = 32
RUNS = 15
QUICK_RUNS = 3


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _what(plan) -> str:
    return ", ".join(f"{r.policy}: {r.replayed_flops / 1e12:.3g} TFLOP replayed"
                     for r in plan.recompute) or "none"


def big_rows() -> list[tuple]:
    rows = []
    cases = [("no user remat", BIG, "auto", {"data": 8}),
             ("no user remat", BIG, "auto", {"data": 2, "model": 4}),
             ("user full remat (nn.remat)", dataclasses.replace(BIG, remat=True), "auto",
              {"data": 2, "model": 4}),
             ("user full remat (nn.remat)", dataclasses.replace(BIG, remat=True), "auto",
              {"data": 8}),
             ("user full remat (nn.remat)", dataclasses.replace(BIG, remat=True), "megatron",
              {"data": 8}),
             # Megatron-LM-style selective recomputation written by the user: nn.remat with
             # jax's dots_with_no_batch_dims_saveable (the weight matmuls' outputs kept)
             ("user selective remat (weight dots kept)",
              dataclasses.replace(BIG, remat="selective"), "megatron", {"data": 8}),
             ("user selective remat (weight dots kept)",
              dataclasses.replace(BIG, remat="selective"), "auto", {"data": 8}),
             ("no user remat, one H100", BIG, "auto", {"data": 1}),
             # benchmarks/checkpoint.py's re-plan after losing a node: 224 sequences of 1024
             ("seq 1024, 224 rows, 64 H100s", dataclasses.replace(BIG, seq=1024), "auto",
              {"data": 8, "model": 8}),
             ("seq 1024, 224 rows, 56 H100s", dataclasses.replace(BIG, seq=1024), "auto",
              {"data": 7, "model": 8})]
    for label, cfg, strategy, mesh in cases:
        step, state, batch = gpt.abstract(cfg, 224 if "224" in label else 64)
        t0 = time.perf_counter()
        try:
            plan = autopar.plan(step, state, batch, mesh=mesh, hardware="h100", time_limit_s=30,
                                strategy=strategy)
            rows.append((label, strategy, _common.mesh_str(mesh),
                         f"{plan.cost.step_time_s * 1e3:.0f}",
                         _gib(plan.cost.peak_memory_bytes), _what(plan),
                         f"{time.perf_counter() - t0:.1f}", plan.solver.status))
        except autopar.AutoparError as e:
            rows.append((label, strategy, _common.mesh_str(mesh), "-", "-", "-",
                         f"{time.perf_counter() - t0:.1f}",
                         f"{type(e).__name__}: {str(e)[:160]}".replace("|", "/")))
    return rows


def llama_rows() -> list[tuple]:
    from autopar.models import hf

    rows = []
    mesh = {"data": 8, "model": 8}
    for n in (64, 128):
        cfg = hf._transformers().LlamaConfig(
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
            max_position_embeddings=4096)
        step, *args = hf.abstract("llama", cfg, n, seq=2048)
        t0 = time.perf_counter()
        try:
            plan = autopar.plan(step, *args, mesh=mesh, hardware="h100", time_limit_s=10)
            rows.append((f"{n} x 2048", _common.mesh_str(mesh),
                         f"{plan.cost.step_time_s * 1e3:.0f}",
                         _gib(plan.cost.peak_memory_bytes), _what(plan),
                         f"{time.perf_counter() - t0:.1f}", plan.solver.status))
        except autopar.AutoparError as e:
            rows.append((f"{n} x 2048", _common.mesh_str(mesh), "-", "-", "-",
                         f"{time.perf_counter() - t0:.1f}",
                         f"{type(e).__name__}: {str(e)[:160]}".replace("|", "/")))
    return rows


# Part 3, run in a child process: XLA_FLAGS must hold the scheduler flag before jax starts.
_UNROLLED_CHILD = """
import dataclasses, json, sys
import jax
from jax.extend import core as jcore
import ir
from autopar import api, hlo
from autopar.models import zoo
from ir import recompute, recompute_unrolled

quick = sys.argv[1] == "quick"
cfg = (zoo.Config(layers=2, width=64, seq=32, ff=128, heads=4, batch=8) if quick else
       zoo.Config(layers=4, width=128, seq=64, ff=512, heads=4, batch=16))
out = []
for name in ("linen_lm",) if quick else ("linen_lm", "nnx_lm"):
    step, params, opt, batch = getattr(zoo, name)(cfg, abstract=True)
    graph = ir.trace(step, params, opt, batch)
    closed, site = recompute.unrolled_site(graph)
    args = jax.tree_util.tree_leaves((params, opt, batch))
    for policy in ("none", "selective", "save_dots", "save_weight_dots", "full"):
        new = closed if policy == "none" else recompute_unrolled.apply(closed, site, policy)
        g = graph if policy == "none" else recompute.rewrite_graph(graph, {0: policy})
        plan = api.plan_graph(g, {"data": 1}, hardware="h100", time_limit_s=5)
        compiled = jax.jit(jcore.jaxpr_as_fun(new)).lower(*args).compile()
        dropped = 0 if policy == "none" else recompute_unrolled.dropped_bytes(closed, site, policy)
        out.append((name, policy, dropped, plan.cost.peak_memory_bytes,
                    hlo.memory(compiled)["peak"]))
    # the library's own remat around each block (jax.checkpoint), for the measured side
    step_r, params, opt, batch = getattr(zoo, name)(dataclasses.replace(cfg, remat=True),
                                                    abstract=True)
    compiled = jax.jit(step_r).lower(params, opt, batch).compile()
    out.append((name, "library remat (jax.checkpoint)", 0, None, hlo.memory(compiled)["peak"]))
print(json.dumps(out))
"""


def unrolled_rows(quick: bool = False) -> list[tuple]:
    # the parent's LLVM level passes on (the test suite's -O0): the peaks are buffer assignment's
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_backend_optimization_level=")]
    env = dict(os.environ, XLA_FLAGS=" ".join(
        keep + ["--xla_cpu_enable_concurrency_optimized_scheduler=false"]))
    run = subprocess.run([sys.executable, "-c", _UNROLLED_CHILD, "quick" if quick else "full"],
                         capture_output=True,
                         text=True, timeout=1200, env=env)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    rows = []
    base: dict = {}
    for name, policy, dropped, pred, meas in json.loads(run.stdout.strip().splitlines()[-1]):
        base.setdefault(name, (pred, meas))
        if pred is None:       # measured only
            rows.append((name, policy, "-", "-", f"{meas / 2**20:.2f}", "-", "-",
                         f"{meas / base[name][1]:.2f}"))
            continue
        rows.append((name, policy, f"{dropped / 2**20:.1f}", f"{pred / 2**20:.2f}",
                     f"{meas / 2**20:.2f}", f"{pred / meas:.3f}",
                     f"{pred / base[name][0]:.2f}", f"{meas / base[name][1]:.2f}"))
    return rows


TRADE = gpt.GPTConfig(scan=True, layers=4, d_model=384, seq=128, d_ff=1536, heads=4, vocab=64)


def trade_rows(runs: int = 7) -> tuple[list[tuple], float]:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    step, state, batch = gpt.concrete(TRADE, SMALL_ROWS)
    plain = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu", time_limit_s=5)
    budget = 0.9 * plain.cost.peak_memory_bytes
    kw = dict(mesh=mesh, hardware="cpu", time_limit_s=5, memory_budget=budget)
    steps = {"no budget": autopar.autoparallel(step, mesh=mesh, hardware="cpu",
                                               time_limit_s=5),
             "budget, no memory decisions": autopar.autoparallel(step, memory_decisions=(),
                                                                 **kw),
             "budget, memory decisions (the trade)": autopar.autoparallel(step, **kw)}
    return _timed(steps, state, batch, runs), budget


def _timed(steps: dict, state, batch, runs: int) -> list[tuple]:
    for s in steps.values():
        jax.block_until_ready(s(state, batch))            # plan, compile, warm
    times = {k: [] for k in steps}
    for _ in range(runs):                                 # interleaved rounds
        for k, s in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(s(state, batch))
            times[k].append(time.perf_counter() - t0)
    rows = []
    for k, s in steps.items():
        report = s.verify(state, batch)
        (mem,) = [c for c in report.checks if c.metric == "peak memory"]
        plan = s.plan
        meas = statistics.median(times[k])
        rows.append((k, _what(plan), f"{plan.cost.step_time_s * 1e3:.2f}", f"{meas * 1e3:.2f}",
                     f"{plan.cost.step_time_s / meas:.2f}",
                     f"{mem.predicted / 2**20:.2f}", f"{mem.measured / 2**20:.2f}",
                     f"{mem.predicted / mem.measured:.3f}"))
    return rows


def small_rows(runs: int = RUNS) -> tuple[list[tuple], float]:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    step, state, batch = gpt.concrete(SMALL, SMALL_ROWS)
    plain = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu", time_limit_s=10)
    budget = 0.6 * plain.cost.peak_memory_bytes
    steps = {"plain": autopar.autoparallel(step, mesh=mesh, plan=plain),   # planned above
             "under 0.6x the plain peak": autopar.autoparallel(
                 step, mesh=mesh, hardware="cpu", time_limit_s=10, memory_budget=budget)}
    return _timed(steps, state, batch, runs), budget


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--predicted", action="store_true",
                    help="parts 1 and 1b only (planning at scale, predicted: their plan times), "
                         "written to predicted.md")
    args = ap.parse_args()
    if args.predicted:
        return _predicted(args)
    out = _common.out_dir(args)
    t0 = time.perf_counter()
    text = ["# Recomputation as a planner decision", "",
            "`benchmarks/recompute.py`: where no layout fits the memory budget, the planner",
            "rewrites a scanned model's step so its backward loop recomputes what the forward",
            "loop saved (`ir.recompute`; policies `selective`: the attention core recomputed, "
            "`save_dots`: matmul outputs kept, `save_weight_dots`: the weight matmuls' outputs "
            "kept, `full`: only",
            "each layer's input kept), plans each rewritten step and keeps the fastest that fits.",
            ""]
    if not args.quick:
        text += ["## GPT-6.7B (scanned, bf16, 64 x 2048 unless said), H100 profile, predicted",
                 "",
                 _common.md_table(("model", "strategy", "mesh", "pred step ms",
                                   "pred peak GiB", "recomputed", "plan s", "status"),
                                  big_rows()), ""]
        text += ["## transformers' Flax Llama-7B (32 unrolled layers, float32), H100 profile, "
                 "predicted", "",
                 _common.md_table(("sequences", "mesh", "pred step ms", "pred peak GiB",
                                   "recomputed", "plan s", "status"), llama_rows()), ""]
    rows, budget = small_rows(QUICK_RUNS if args.quick else RUNS)
    text += [f"## Small scanned GPT on 2x4 CPU devices, measured (budget "
             f"{budget / 2**20:.2f} MiB = 0.6 x the plain plan's peak)", "",
             _common.md_table(("plan", "recomputed", "pred step ms", "meas step ms",
                               "pred/meas", "pred peak MiB", "XLA peak MiB", "pred/XLA"), rows),
             ""]
    if not args.quick:
        trade, tbudget = trade_rows()
        text += [f"## Mist's trade: a scanned GPT of width 384 on {{data: 8}} CPU devices, "
                 f"measured (budget {tbudget / 2**20:.2f} MiB = 0.9 x the plain plan's peak)",
                 "", _common.md_table(("plan", "recomputed", "pred step ms", "meas step ms",
                                       "pred/meas", "pred peak MiB", "XLA peak MiB",
                                       "pred/XLA"), trade), ""]
    text += ["## Unrolled layers rewritten, one CPU device, XLA:CPU's memory-minimizing "
             "scheduler", "",
             ("Flax linen LM of `autopar.models.zoo` (--quick: 2 unrolled layers, width 64, "
              "seq 32, batch 8). " if args.quick else
              "Flax linen and Flax NNX LMs of `autopar.models.zoo` (4 unrolled layers, width "
              "128, seq 64, batch 16). ") + "Predicted: the H100 profile's memory model on the "
             "rewritten step (GPU scheduling); measured: XLA:CPU's peak (arguments + outputs + "
             "temporaries) under `--xla_cpu_enable_concurrency_optimized_scheduler=false`. "
             "XLA:CPU's default scheduler runs a replay as soon as its inputs exist, which is "
             "why the planner offers this off CPU only.", "",
             _common.md_table(("model", "policy", "dropped MiB (all layers)",
                               "pred peak MiB", "XLA peak MiB", "pred/XLA",
                               "pred / plain", "XLA / plain"), unrolled_rows(args.quick)),
             "",
             f"Wall time {time.perf_counter() - t0:.0f} s. Environment: "
             f"{_common.environment()}.", "",
             "Reproduce: `python benchmarks/recompute.py`.", ""]
    (out / "recompute.md").write_text("\n".join(text))
    print("\n".join(text))


def _predicted(args) -> None:
    """Parts 1 and 1b alone: the rows whose planning time the memory decisions' search sets."""
    out = _common.out_dir(args)
    t0 = time.perf_counter()
    text = ["## GPT-6.7B (scanned, bf16, 64 x 2048 unless said), H100 profile, predicted", "",
            _common.md_table(("model", "strategy", "mesh", "pred step ms", "pred peak GiB",
                              "recomputed", "plan s", "status"), big_rows()), "",
            "## transformers' Flax Llama-7B (32 unrolled layers, float32), H100 profile, "
            "predicted", "",
            _common.md_table(("sequences", "mesh", "pred step ms", "pred peak GiB",
                              "recomputed", "plan s", "status"), llama_rows()), "",
            f"Wall time {time.perf_counter() - t0:.0f} s. Environment: "
            f"{_common.environment()}.", "",
            "Reproduce: `python benchmarks/recompute.py --predicted`.", ""]
    (out / "predicted.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
