"""Predictions against the compiled executable: ``autopar.verify`` over models x meshes x plans.

For each (model, mesh, strategy) the step is planned (``hardware="cpu"``), compiled and run once
on the 8 emulated CPU devices, and ``step.verify()`` compares the plan with XLA: bytes of each
collective kind from the HLO, peak memory against ``memory_analysis()`` (arguments + outputs +
temporaries - aliases) and HBM bytes against ``cost_analysis()["bytes accessed"]`` (not compared
for programs with loops, where XLA counts a body once). Each row gives predicted / measured ratios
and whether each metric is within the verify tolerances (collectives 25%, memory 10%, HBM 20%).

Writes ``benchmarks/results/verify_matrix.md`` and ``verify_matrix.csv``.

    python benchmarks/verify_matrix.py            # 5 models x 4 meshes x 4 plans (~20 minutes)
    python benchmarks/verify_matrix.py --models "conv net" --stem verify_matrix_conv
    python benchmarks/verify_matrix.py --quick    # one row
    python benchmarks/verify_matrix.py --models "GPT unrolled,MoE" --meshes 1x8,2x4
    python benchmarks/verify_matrix.py --memory-decisions   # recompute and offload plans (~3 min)

``--memory-decisions`` verifies plans whose memory the planner traded (``Plan.recompute``,
``Plan.offload``) on the 1x8 and 2x4 meshes, each under a budget no layout of the plain step
fits: a scanned GPT under 0.6x its plain plan's peak (the backward recomputes), an unrolled GPT
under 0.9x the least peak any layout of it reaches (Adam's moments wait in host memory). Each
is run once against its unsharded step (loss) and verified, host memory included; it writes
``verify_matrix_memory.md`` and ``.csv``.
"""
from __future__ import annotations

import dataclasses  # noqa: E402
import statistics  # noqa: E402

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar.models import convnet, gpt, moe  # noqa: E402

HEADER = ("model", "mesh", "strategy", "collective bytes pred/XLA (worst kind)", "collectives ok",
          "peak memory KiB pred", "peak memory KiB XLA", "memory pred/XLA", "memory ok",
          "HBM pred/XLA", "HBM ok")
TINY = gpt.GPTConfig(vocab=128, seq=16, d_model=64, heads=4, d_ff=128, layers=2)
# make demo's GPT: its weights outweigh its activations, which TINY's do not, so the gradients
# XLA holds whole until its merged reduction (not in autopar.planner.memory) show only here
WIDE = gpt.GPTConfig(vocab=256, seq=32, d_model=128, heads=4, d_ff=512, layers=2)
MESHES = {"1x8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model")),
          "4x2": ((4, 2), ("data", "model")), "2x2x2": ((2, 2, 2), ("data", "model", "expert"))}


def models(quick: bool):
    out = {"GPT unrolled": lambda: gpt.concrete(TINY, 16)}
    if not quick:
        out["GPT scan"] = lambda: gpt.concrete(dataclasses.replace(TINY, scan=True), 16)
        out["MoE"] = lambda: moe.concrete(moe.MoEConfig(), 8)
        out["conv net"] = lambda: convnet.concrete(convnet.ConvConfig(), 16)
        out["GPT wide unrolled"] = lambda: gpt.concrete(WIDE, 16)
    return out


def row(label, model, mesh_name, strategy):
    step_fn, state, batch = model
    shape, axes = MESHES[mesh_name]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), axes)
    step = autopar.autoparallel(step_fn, mesh=mesh, hardware="cpu", strategy=strategy,
                                time_limit_s=3, deterministic=True)   # load-independent
    step(state, batch)
    report = step.verify()
    comm = [c for c in report.checks if c.metric.endswith("bytes") and c.metric != "HBM bytes"]
    mem = next(c for c in report.checks if c.metric == "peak memory")
    hbm = next(c for c in report.checks if c.metric == "HBM bytes")
    worst = max(comm, key=lambda c: abs(_ratio(c) - 1.0), default=None)
    return (label, mesh_name, strategy, _ratio(worst) if worst else float("nan"),
            all(c.ok for c in comm), mem.predicted / 1024, mem.measured / 1024, _ratio(mem),
            mem.ok, _ratio(hbm), "not compared (loop)" if hbm.ok is None else hbm.ok)


MEMORY_HEADER = ("model", "mesh", "budget KiB", "decided", "collectives ok",
                 "peak memory KiB pred", "peak memory KiB XLA", "memory pred/XLA", "memory ok",
                 "host KiB pred", "host KiB XLA", "host ok", "loss - unsharded loss")


def memory_row(label, model, mesh_name, budget_of, donate=()) -> tuple:
    step_fn, state, batch = model
    shape, axes = MESHES[mesh_name]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), axes)
    budget = budget_of(step_fn, state, batch, mesh, donate)
    step = autopar.autoparallel(step_fn, mesh=mesh, hardware="cpu", memory_budget=budget,
                                time_limit_s=10, deterministic=True, donate_argnums=donate)
    copy = jax.tree_util.tree_map(lambda x: x.copy(), state)
    _, loss = step(copy, batch)
    _, want = jax.jit(step_fn)(state, batch)
    plan = step.plan
    report = step.verify()
    comm = [c for c in report.checks if c.metric.endswith("bytes") and c.metric != "HBM bytes"]
    mem = report.check("peak memory")
    host = next((c for c in report.checks if c.metric == "host memory"), None)
    decided = "; ".join([f"recompute {r.policy}" for r in plan.recompute]
                        + [f"offload {len(plan.offload)} group(s)"] * bool(plan.offload)) or "none"
    return (label, mesh_name, budget / 1024, decided, all(c.ok for c in comm),
            mem.predicted / 1024, mem.measured / 1024, _ratio(mem), mem.ok,
            host.predicted / 1024 if host else 0.0, host.measured / 1024 if host else 0.0,
            host.ok if host else "-", float(loss) - float(want))


def memory_decisions(args) -> None:
    def under_plain(fraction):
        def budget(step_fn, state, batch, mesh, donate):
            plain = autopar.plan(step_fn, state, batch, mesh=mesh, hardware="cpu",
                                 time_limit_s=10, deterministic=True, donate_argnums=donate)
            return fraction * plain.cost.peak_memory_bytes
        return budget

    # the models of benchmarks/recompute.py's and benchmarks/offload.py's measured parts, whose
    # activations (recompute) and moments (offload) are worth trading
    import offload as offload_bench
    import recompute as recompute_bench

    def under_least(fraction):
        def budget(step_fn, state, batch, mesh, donate):
            return fraction * offload_bench._least(step_fn, state, batch, mesh,
                                                   donate_argnums=donate, deterministic=True)
        return budget

    offload = gpt.concrete(offload_bench.SMALL, offload_bench.SMALL_ROWS)
    cases = [("GPT scan, recompute",
              gpt.concrete(recompute_bench.SMALL, recompute_bench.SMALL_ROWS), under_plain(0.6),
              ()),
             ("GPT unrolled, offload, state donated", offload, under_least(0.9), (0,)),
             ("GPT unrolled, offload", offload, under_least(0.9), ())]
    rows = []
    for label, model, budget_of, donate in cases:
        for m in ("1x8", "2x4"):
            r = memory_row(label, model, m, budget_of, donate)
            print("  " + "  ".join(_common._cell(x) for x in r), flush=True)
            rows.append(r)
    out = _common.out_dir(args)
    _common.write_csv(out / "verify_matrix_memory.csv", MEMORY_HEADER, rows)
    mem = [r[7] for r in rows]
    text = [
        "# autopar's predictions against the compiled executable: plans that trade memory", "",
        "`step.verify()` after one step on 8 emulated CPU devices, `hardware=\"cpu\"`, each "
        "step under a budget no layout of its plain step fits, so the planner decides what the "
        "backward recomputes (`Plan.recompute`) or what waits in host memory "
        "(`Plan.offload`). GPT scan: 4 `nn.scan` layers, d_model 32, seq 128, batch 32, "
        "budget 0.6x its plain plan's peak. GPT unrolled: 2 layers, d_model 128, seq 8, vocab "
        "512, batch 8, budget 0.9x the least peak of any layout, its state donated "
        "(`donate_argnums=(0,)`, as a ZeRO-Offload user runs it) and not. Peak memory is XLA's "
        "arguments + outputs + temporaries - aliases on the device; host memory the "
        "arguments and results in `pinned_host` memory (`autopar.hlo.memory`). The last "
        "column is the step's loss less the unsharded step's (`jax.jit`).", "",
        _common.md_table(MEMORY_HEADER, rows), "",
        f"Peak memory within 10%: {sum(1 for r in rows if r[8])} of {len(rows)}; pred/XLA "
        f"{min(mem):.3f}-{max(mem):.3f}. Host memory within 10%: "
        f"{sum(1 for r in rows if r[11] is True)} of "
        f"{sum(1 for r in rows if r[11] != '-')} plans that hold any.", "",
        f"Reproduce: `python benchmarks/verify_matrix.py --memory-decisions`. "
        f"Environment: {_common.environment()}.", ""]
    (out / "verify_matrix_memory.md").write_text("\n".join(text))
    print(f"wrote {out / 'verify_matrix_memory.md'}")


def _ratio(check) -> float:
    return check.predicted / check.measured if check.measured else float("nan")


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--models", default=None, help="comma-separated subset of the model labels")
    p.add_argument("--meshes", default=None, help="comma-separated subset of " + ",".join(MESHES))
    p.add_argument("--stem", default="verify_matrix",
                   help="name of the result files (a subset run beside the whole matrix's)")
    p.add_argument("--memory-decisions", action="store_true",
                   help="verify recompute and offload plans (verify_matrix_memory.md)")
    args = p.parse_args(argv)
    if args.memory_decisions:
        return memory_decisions(args)
    out = _common.out_dir(args)
    meshes = ["2x4"] if args.quick else list(MESHES)
    meshes = args.meshes.split(",") if args.meshes else meshes
    strategies = ["auto"] if args.quick else ["dp", "zero3", "megatron", "auto"]
    rows = []
    for label, make in models(args.quick).items():
        if args.models and label not in args.models.split(","):
            continue
        model = make()
        for m in meshes:
            for s in strategies:
                try:
                    r = row(label, model, m, s)
                except autopar.AutoparError as e:   # a strategy that does not apply
                    print(f"  {label} {m} {s}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                print("  " + "  ".join(_common._cell(x) for x in r), flush=True)
                rows.append(r)
    _common.write_csv(out / f"{args.stem}.csv", HEADER, rows)
    (out / f"{args.stem}.md").write_text("\n".join(_report(rows)) + "\n")
    print(f"wrote {out / args.stem}.md")


def _report(rows) -> list[str]:
    mem = [r[7] for r in rows]
    hbm = [r[9] for r in rows if r[10] != "not compared (loop)"]
    within = sum(1 for r in rows if r[8])
    return [
        "# autopar's predictions against the compiled executable",
        "",
        "`step.verify()` after one step on 8 emulated CPU devices, `hardware=\"cpu\"`. GPT is",
        "vocab 128, seq 16, d_model 64, 4 heads, d_ff 128, 2 layers, batch 16 (unrolled and",
        "`nn.scan`); GPT wide is `make demo`'s (vocab 256, seq 32, d_model 128, d_ff 512, 2",
        "layers, batch 16, unrolled: weights larger than activations); MoE and the conv net are",
        "`autopar.models`' defaults. Ratios are predicted / measured; tolerances are verify's",
        "(collectives 25%, memory 10%, HBM 20%).",
        "",
        _common.md_table(HEADER, rows),
        "",
        f"Collectives within tolerance: {sum(1 for r in rows if r[4])} of {len(rows)} plans.",
        f"Peak memory within 10%: {within} of {len(rows)}; pred/XLA median "
        f"{statistics.median(mem):.2f}, range {min(mem):.2f}-{max(mem):.2f}.",
        (f"HBM bytes (programs without loops) pred/XLA median {statistics.median(hbm):.2f}, "
         f"range {min(hbm):.2f}-{max(hbm):.2f}; within 20%: "
         f"{sum(1 for r in rows if r[10] is True)} of {len(hbm)}." if hbm else ""),
        "",
        f"Environment: {_common.environment()}.",
    ]


if __name__ == "__main__":
    main()
