"""Host offload as a planner decision: predicted at scale, predicted and measured on the CPU.

Part 1 (abstract, H100 profile): ``autopar.models.gpt`` at the paper's 6.7B configuration
(scanned, bfloat16, sequences of 2048, no user remat, the state donated) on one H100, where
parameters, gradients and Adam's moments (~107 GB) outweigh the device: the planner decides what
the backward pass recomputes (``Plan.recompute``) and which state lives in host memory
(``Plan.offload``), or says why nothing fits. 8 sequences (what one device takes with gradient
accumulation) and 64; and the 8-sequence step with every group offloaded on top of full
recomputation, the budget lifted (what that choice costs, priced apart from the search).

Part 2 (measured, 8 CPU devices as 2x4, whose ``pinned_host`` memory is real): a small unrolled
GPT whose parameters outweigh its activations (nothing to recompute), the state donated, planned
without offload at the smallest peak the planner finds (``least``), then under 0.9x that: each
plan compiled and run, XLA's device and host bytes (``memory_analysis``, host buffers read off
the entry layout on XLA:CPU) beside the prediction, the step timed in interleaved rounds
(medians). An ablation row plans the same budget with offload switched off.

    python benchmarks/offload.py            # both parts
    python benchmarks/offload.py --quick    # part 2 only

Writes ``benchmarks/results/offload.md``.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
import cost_models  # noqa: E402
import ir  # noqa: E402
from autopar import api, hlo, planner  # noqa: E402
from autopar.models import gpt  # noqa: E402
from autopar.options import PlannerOptions, Request  # noqa: E402
from autopar.planner import offload  # noqa: E402
from ir import recompute  # noqa: E402

BIG = dataclasses.replace(gpt.GPT_CONFIGS["6.7B"], scan=True, seq=2048)
SMALL = gpt.GPTConfig(scan=False, layers=2, d_model=128, seq=8, d_ff=512, heads=4, vocab=512)
SMALL_ROWS = 8
RUNS = 15
QUICK_RUNS = 3


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _size(b) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.3g} MiB"


def _decided(plan) -> str:
    what = [f"recompute {r.policy}" for r in plan.recompute]
    if plan.offload:
        what.append(f"offload {sum(len(o.inputs) for o in plan.offload)} args "
                    f"({_size(sum(o.host_bytes for o in plan.offload))} host, "
                    f"{sum(o.transfer_s for o in plan.offload) * 1e3:.0f} ms moves)")
    return ", ".join(what) or "none"


def big_rows() -> list[tuple]:
    rows = []
    for rows_, mesh in [(8, {"data": 1}), (64, {"data": 1})]:
        step, state, batch = gpt.abstract(BIG, rows_)
        t0 = time.perf_counter()
        try:
            plan = autopar.plan(step, state, batch, mesh=mesh, hardware="h100", time_limit_s=30,
                                donate_argnums=(0,))
            rows.append((f"{rows_} x 2048", _common.mesh_str(mesh),
                         f"{plan.cost.step_time_s * 1e3:.0f}", _gib(plan.cost.peak_memory_bytes),
                         _decided(plan), f"{time.perf_counter() - t0:.1f}", plan.solver.status))
        except autopar.AutoparError as e:
            rows.append((f"{rows_} x 2048", _common.mesh_str(mesh), "-", "-", "-",
                         f"{time.perf_counter() - t0:.1f}",
                         f"{type(e).__name__}: {str(e)[:200]}".replace("|", "/")))
    # what the device would need: every group offloaded on top of full recomputation, the
    # budget lifted (the plan the search could not fit, priced)
    step, state, batch = gpt.abstract(BIG, 8)
    t0 = time.perf_counter()
    graph = ir.trace(step, state, batch, donate_argnums=(0,))
    both = offload.rewrite_graph(recompute.rewrite_graph(graph, {0: "full"}), [
        k for g in offload.groups_of(recompute.rewrite_graph(graph, {0: "full"}))
        for k in g.inputs])
    plan = api.plan_graph(both, {"data": 1}, hardware="h100", time_limit_s=30,
                          memory_budget=2**40)
    largest = max(g.nbytes for g in offload.groups_of(graph))
    rows.append(("8 x 2048, full recompute + all moments offloaded, budget lifted", "data1",
                 f"{plan.cost.step_time_s * 1e3:.0f}", _gib(plan.cost.peak_memory_bytes),
                 f"forced (largest group {_size(largest)} of moments)",
                 f"{time.perf_counter() - t0:.1f}", plan.solver.status))
    return rows


def _least(step, state, batch, mesh, donate_argnums=(0,), deterministic=False) -> float:
    """The smallest peak the planner finds for the step without host offload (also
    ``verify_matrix.py --memory-decisions``' budget)."""
    graph = ir.trace(step, state, batch, donate_argnums=donate_argnums)
    sizes = dict(mesh.shape)
    cm = cost_models.CostModel(cost_models.hardware("cpu"), sizes)
    try:
        planner.make_plan(Request(graph, sizes, cm, PlannerOptions(
            memory_budget=1e4, time_limit_s=10, offload=False, deterministic=deterministic)))
    except autopar.BudgetError as e:
        return e.least_bytes
    raise AssertionError("a 10 kB budget fitted")


def small_rows(runs: int = RUNS) -> tuple[list[tuple], float, float]:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    step, state, batch = gpt.concrete(SMALL, SMALL_ROWS)
    least = _least(step, state, batch, mesh)
    budget = 0.9 * least
    kw = dict(mesh=mesh, hardware="cpu", time_limit_s=10, donate_argnums=(0,))
    steps = {"no budget": autopar.autoparallel(step, **kw),
             "under 0.9x least": autopar.autoparallel(step, memory_budget=budget, **kw)}
    states = {k: jax.tree_util.tree_map(lambda x: x.copy(), state) for k in steps}
    for k, s in steps.items():                          # plan, compile, warm
        states[k], _ = jax.block_until_ready(s(states[k], batch))
    times = {k: [] for k in steps}
    for _ in range(runs):                               # interleaved rounds
        for k, s in steps.items():
            t0 = time.perf_counter()
            states[k], _ = jax.block_until_ready(s(states[k], batch))
            times[k].append(time.perf_counter() - t0)
    rows = []
    for k, s in steps.items():
        plan = s.plan
        compiled = s.lower(states[k], batch).compile()
        mem = hlo.memory(compiled)
        meas = statistics.median(times[k])
        host = sum(o.host_bytes for o in plan.offload)
        rows.append((k, _decided(plan), f"{plan.cost.step_time_s * 1e3:.2f}",
                     f"{meas * 1e3:.2f}", f"{plan.cost.step_time_s / meas:.2f}",
                     f"{plan.cost.peak_memory_bytes / 2**20:.3f}", f"{mem['peak'] / 2**20:.3f}",
                     f"{plan.cost.peak_memory_bytes / mem['peak']:.3f}",
                     f"{host / 2**20:.3f}", f"{mem['host'] / 2**20:.3f}"))
    # ablation: the same budget, offload switched off
    graph = ir.trace(step, state, batch, donate_argnums=(0,))
    sizes = dict(mesh.shape)
    cm = cost_models.CostModel(cost_models.hardware("cpu"), sizes)
    try:
        planner.make_plan(Request(graph, sizes, cm, PlannerOptions(
            memory_budget=budget, time_limit_s=10, offload=False)))
        ablation = "a plan fits without offload (the budget is not tight)"
    except autopar.BudgetError as e:
        ablation = f"BudgetError: {str(e)[:200]}"
    rows.append(("under 0.9x least, offload off", ablation.replace("|", "/"), "-", "-", "-",
                 "-", "-", "-", "-", "-"))
    return rows, budget, least


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    out = _common.out_dir(args)
    t0 = time.perf_counter()
    text = ["# Host offload as a planner decision", "",
            "`benchmarks/offload.py`: where no layout fits the memory budget, the planner holds",
            "groups of the step's update-only state (Adam's moments, one parameter's at a time)",
            "in host memory and streams them through the device for the update (`ir.offload`),",
            "beside the recomputation policies (on top of each where neither fits alone), and",
            "keeps the fastest plan that fits.",
            ""]
    if not args.quick:
        text += ["## GPT-6.7B (scanned, bf16, no user remat) on one H100, predicted", "",
                 _common.md_table(("batch", "mesh", "pred step ms", "pred peak GiB",
                                   "decided", "plan s", "status"), big_rows()), ""]
    rows, budget, least = small_rows(QUICK_RUNS if args.quick else RUNS)
    text += [f"## Small unrolled GPT on 2x4 CPU devices, measured (least peak without offload "
             f"{least / 2**20:.3f} MiB; budget {budget / 2**20:.3f} MiB = 0.9x that)", "",
             _common.md_table(("plan", "decided", "pred step ms", "meas step ms", "pred/meas",
                               "pred peak MiB", "XLA peak MiB", "pred/XLA",
                               "pred host MiB", "XLA host MiB"), rows),
             "",
             "XLA's figures: `autopar.hlo.memory` (arguments + results + temporaries - aliases "
             "on the device; host buffers read off the entry layout, memory space S(5), since "
             "XLA:CPU counts them among the device's).", "",
             f"Wall time {time.perf_counter() - t0:.0f} s. Environment: "
             f"{_common.environment()}.", "",
             "Reproduce: `python benchmarks/offload.py`.", ""]
    (out / "offload.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
