"""How long ``autopar.plan`` takes against the ``time_limit_s`` it was given.

For each (model, mesh, time_limit_s) the public ``autopar.plan`` runs twice on abstract inputs:
with the default wall-clock budget (``deterministic=False``) and with ``deterministic=True``
(the solver's deterministic clock only, the behaviour before the budget existed). Each row gives
the median wall time of the call, its ratio to ``time_limit_s``, the plan's status and predicted
step time, so the bound and what it costs in plan quality are side by side. Meshes with many
size-2 axes are where planning used to run far past its limit.

Writes ``benchmarks/results/time_limit.md`` and ``time_limit.csv``.

    python benchmarks/time_limit.py            # the sweep (several minutes on 2 cores)
    python benchmarks/time_limit.py --quick    # one small row
"""
from __future__ import annotations

import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autopar  # noqa: E402
from autopar.models import gpt  # noqa: E402

HEADER = ("model", "mesh", "time_limit_s", "mode", "runs", "median wall_s", "wall / limit",
          "status", "predicted step ms")
TINY = gpt.GPTConfig(vocab=128, seq=16, d_model=64, heads=4, d_ff=128, layers=2)


def _matmul_grad():
    def loss(w, x):
        return jnp.tanh(x @ w).sum()

    s = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    return "matmul grad", jax.grad(loss), (s, s)


def _gpt(label, cfg, rows):
    step, state, batch = gpt.abstract(cfg, rows)
    return label, step, (state, batch)


def configs(quick: bool):
    """(model, mesh, time_limit_s, also run deterministic?)."""
    axes = lambda n: {f"a{i}": 2 for i in range(n)}   # noqa: E731
    tiny = _gpt("GPT tiny", TINY, 256)
    if quick:
        return [(tiny, {"data": 8}, 1.0, True)]
    big = _gpt("GPT-1.3B scan", dataclasses.replace(gpt.GPT_CONFIGS["1.3B"], scan=True), 64)
    return [(tiny, {"data": 2, "model": 4}, 1.0, True), (tiny, {"data": 2, "model": 4}, 5.0, True),
            (tiny, axes(3), 1.0, True), (tiny, axes(4), 1.0, True), (tiny, axes(8), 1.0, False),
            (_matmul_grad(), axes(8), 1.0, True), (big, {"data": 32, "model": 8}, 5.0, True)]


def run(model, mesh, limit: float, deterministic: bool, runs: int):
    label, fn, args = model
    walls, plan = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = autopar.plan(fn, *args, mesh=mesh, hardware="h100", time_limit_s=limit,
                            deterministic=deterministic)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    return (label, _common.mesh_str(mesh), limit, "deterministic" if deterministic else "wall",
            runs, wall, wall / limit, plan.solver.status, plan.cost.step_time_s * 1e3)


def main(argv=None):
    args = _common.parser(__doc__).parse_args(argv)
    out = _common.out_dir(args)
    w = gpt.abstract(TINY, 2)          # warm up tracing so the first row is not import time
    jax.make_jaxpr(w[0])(*w[1:])
    rows = []
    for model, mesh, limit, also_det in configs(args.quick):
        for det in (False, True) if also_det else (False,):
            runs = 1 if args.quick or det or "1.3B" in model[0] else 3
            r = run(model, mesh, limit, det, runs)
            print("  " + "  ".join(_common._cell(x) for x in r), flush=True)
            rows.append(r)
    _common.write_csv(out / "time_limit.csv", HEADER, rows)
    bounded = [r for r in rows if r[3] == "wall"]
    notes = [
        "# autopar planning time against time_limit_s",
        "",
        "`autopar.plan(fn, *abstract_args, mesh=..., hardware=\"h100\", time_limit_s=L,",
        "deterministic=...)`. `wall`: the default, the whole call (tracing included) is budgeted",
        "on the wall clock (`autopar/planner/budget.py`); `deterministic`: the solver stops on",
        "its deterministic clock only and every stage runs to completion. `status` ending in",
        "`(time limit)` means stages were cut and the best plan so far was returned; FEASIBLE",
        "means CP-SAT stopped at a limit with a solution. `predicted step ms` shows what the cut",
        "costs in plan quality. `wall` rows are the median of 3 calls (1 for GPT-1.3B),",
        "`deterministic` rows one call. `GPT tiny` is vocab 128, seq 16, d_model 64, 2 layers,",
        "batch 256; `matmul grad` is the gradient of tanh(x @ w).sum() for 256x256 x and w.",
        "",
        _common.md_table(HEADER, rows),
        "",
        f"Largest wall / limit with the wall-clock budget: "
        f"{max(r[6] for r in bounded):.1f}x ({_worst(bounded)}).",
        "",
        f"Environment: {_common.environment()}.",
    ]
    (out / "time_limit.md").write_text("\n".join(notes) + "\n")
    print(f"wrote {out / 'time_limit.md'}")


def _worst(rows) -> str:
    r = max(rows, key=lambda r: r[6])
    return f"{r[0]} on {r[1]}, time_limit_s={r[2]:g}"


if __name__ == "__main__":
    main()
