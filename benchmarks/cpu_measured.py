"""Predicted vs measured step time on the 8 emulated CPU devices, over all strategies.

Small GPT training steps are planned with ``hardware="cpu"`` (the cost model fitted to this kind
of machine, ``cost_models/profiles/cpu.json``) by ``autopar.compare(..., measure=True)``: each
plan (``auto`` and the hand-written strategies) is compiled by autopar's codegen and timed, the
median of ``RUNS`` runs after one warm-up. The data-parallel families run on the 1-D mesh
``{"data": 8}``, the tensor-parallel ones on ``{"data": 2, "model": 4}``; ``auto`` on both.

Reported: the cost model's median relative error |predicted - measured| / measured, and the
Spearman rank correlation of predicted vs measured step times (numpy, average ranks for ties),
pooled over every plan and per (model, mesh) group, and whether the predicted-fastest plan is the
measured-fastest.

Writes ``benchmarks/results/cpu_measured.md``, ``cpu_measured.csv`` and ``cpu_measured.png``.

    python benchmarks/cpu_measured.py          # two small GPTs, two meshes (a few minutes)
    python benchmarks/cpu_measured.py --quick  # one tiny GPT, 1-D mesh, 3 strategies
"""
from __future__ import annotations

import math  # noqa: E402
import time  # noqa: E402

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import numpy as np  # noqa: E402

# The compare function itself (``autopar.compare`` is also reachable as the submodule name).
from autopar.compare import compare  # noqa: E402
from autopar.models import gpt  # noqa: E402

DP = ("dp", "zero1", "zero2", "zero3")
TP = ("megatron", "megatron_sp", "fsdp_tp")


def rankdata(x) -> np.ndarray:
    """Ranks 1..n, ties get their average rank (like scipy.stats.rankdata)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return (sums / counts)[inv]


def spearman(a, b) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (nan for fewer than 3 points)."""
    if len(a) < 3:
        return float("nan")
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den else float("nan")


def setups(quick: bool):
    """(label, GPTConfig, global batch, [(mesh, strategies)])."""
    if quick:
        cfg = gpt.GPTConfig(vocab=256, seq=32, d_model=64, heads=4, d_ff=256, layers=1)
        return [("GPT-tiny", cfg, 16, [({"data": 8}, ("dp", "zero3", "auto"))])]
    meshes = [({"data": 8}, DP + ("auto",)), ({"data": 2, "model": 4}, TP + ("auto",))]
    small = gpt.GPTConfig(vocab=1024, seq=128, d_model=256, heads=8, d_ff=1024, layers=2)
    wide = gpt.GPTConfig(vocab=2048, seq=128, d_model=512, heads=8, d_ff=2048, layers=2)
    return [("GPT-d256-L2", small, 32, meshes), ("GPT-d512-L2", wide, 16, meshes)]


COLS = ("model", "params", "batch", "mesh", "strategy", "predicted_ms", "measured_ms",
        "rel_error", "predicted_peak_mib", "xla_peak_mib", "status", "error")


def load_rows(path) -> list[dict]:
    import csv

    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["params"], r["batch"] = int(r["params"]), int(r["batch"])
        for c in ("predicted_ms", "measured_ms", "predicted_peak_mib", "xla_peak_mib"):
            r[c] = math.nan if r[c] in ("-", "") else float(r[c])
    return rows


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="timed runs per plan (median)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the .md and .png from the .csv in the output directory")
    p.add_argument("--note", default="", help="a sentence added to the report (e.g. the load)")
    args = p.parse_args(argv)
    out = _common.out_dir(args)
    runs = args.runs or (2 if args.quick else 7)
    time_limit_s = 2.0 if args.quick else 5.0
    rows = []
    t_all = time.perf_counter()
    if args.report_only:
        rows = load_rows(out / "cpu_measured.csv")
    for label, cfg, batch_size, meshes in ([] if args.report_only else setups(args.quick)):
        fn, state, batch = gpt.concrete(cfg, batch_size)
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(state["params"]))
        for mesh, names in meshes:
            t0 = time.perf_counter()
            cmp = compare(fn, state, batch, mesh=mesh, hardware="cpu", strategies=names,
                          measure=True, runs=runs, time_limit_s=time_limit_s, progress=False)
            for r in cmp.rows:
                rows.append(dict(
                    model=label, params=n_params, batch=batch_size,
                    mesh=_common.mesh_str(mesh), strategy=r.strategy,
                    predicted_ms=r.predicted_step_s * 1e3 if r.predicted_step_s else math.nan,
                    measured_ms=r.measured_step_s * 1e3 if r.measured_step_s else math.nan,
                    predicted_peak_mib=(r.predicted_peak_bytes / 2**20
                                        if r.predicted_peak_bytes else math.nan),
                    xla_peak_mib=(r.measured_peak_bytes / 2**20
                                  if r.measured_peak_bytes else math.nan),
                    status=r.plan.solver.status if r.plan is not None else "-",
                    error=(r.error or "").splitlines()[0][:120] if r.error else ""))
            print(f"  {label} {mesh}: {time.perf_counter() - t0:.0f}s")
            print("    " + str(cmp).replace("\n", "\n    "), flush=True)
    elapsed = time.perf_counter() - t_all
    for r in rows:
        r["rel_error"] = (abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
                          if r["measured_ms"] == r["measured_ms"] else math.nan)

    cols = COLS
    _common.write_csv(out / "cpu_measured.csv", cols, [[r[c] for c in cols] for r in rows])

    ok = [r for r in rows if r["measured_ms"] == r["measured_ms"]
          and r["predicted_ms"] == r["predicted_ms"]]
    pred = np.array([r["predicted_ms"] for r in ok])
    meas = np.array([r["measured_ms"] for r in ok])
    med_err = float(np.median(np.abs(pred - meas) / meas)) if ok else math.nan
    rho = spearman(pred, meas)
    groups = list(dict.fromkeys((r["model"], r["mesh"]) for r in ok))
    group_lines = []
    for g in groups:
        gr = [r for r in ok if (r["model"], r["mesh"]) == g]
        gp = [r["predicted_ms"] for r in gr]
        gm = [r["measured_ms"] for r in gr]
        best_p = min(gr, key=lambda r: r["predicted_ms"])["strategy"]
        best_m = min(gr, key=lambda r: r["measured_ms"])["strategy"]
        auto = next((r for r in gr if r["strategy"] == "auto"), None)
        auto_rank = (1 + sorted(gm).index(auto["measured_ms"])) if auto else "-"
        group_lines.append((g[0], g[1], len(gr), spearman(gp, gm),
                            float(np.median([abs(a - b) / b for a, b in zip(gp, gm)])),
                            best_p, best_m, f"{auto_rank} of {len(gr)}"))
    _plot(ok, out / "cpu_measured.png", med_err, rho)
    def group(r):
        return (r["model"], r["mesh"])

    bugs = [f"- {g[0]} on {g[1]}: auto is *predicted* slower ({auto['predicted_ms']:.1f} ms) "
            f"than {best['strategy']} ({best['predicted_ms']:.1f} ms) on the same mesh, although "
            f"`autopar.compare` seeds auto with the best hand-written plan."
            for g, auto, best in _common.auto_losses(rows, group, "predicted_ms")]
    bugs += [f"- {r['model']} on {r['mesh']}, {r['strategy']}: {r['error']}"
             for r in rows if r["error"]]

    md = ["# Cost model vs measurement on 8 emulated CPU devices", "",
          f"**{len(ok)} plans: median relative error {med_err:.1%}, Spearman rank correlation "
          f"{rho:.3f}** (predicted vs measured step time, all strategies pooled). Median "
          f"measured / predicted: {float(np.median(meas / pred)) if ok else math.nan:.2f}.", "",
          "## Problems found", "",
          *(bugs or ["None."]), "",
          "## Results", "",
          "Per model and mesh:", "",
          _common.md_table(("model", "mesh", "plans", "Spearman", "median rel. error",
                            "predicted fastest", "measured fastest", "auto's measured rank"),
                           group_lines), "",
          "Every plan:", "",
          _common.md_table(cols, [[r[c] for c in cols] for r in rows]), "",
          "![predicted vs measured](cpu_measured.png)", "",
          "## Method", "",
          "- `autopar.compare(train_step, state, batch, mesh=..., hardware=\"cpu\", "
          f"strategies=..., measure=True, runs={runs}, time_limit_s={time_limit_s:g})`: each "
          "plan is compiled with autopar's codegen (the executable `autopar.autoparallel` runs) "
          f"and timed, median of {runs} runs after one warm-up, `block_until_ready` each.",
          "- Data-parallel families on `{\"data\": 8}`, tensor-parallel ones on "
          "`{\"data\": 2, \"model\": 4}`, `auto` on both. GPT configs: "
          + "; ".join(f"{lab}: d_model {c.d_model}, d_ff {c.d_ff}, heads {c.heads}, {c.layers} "
                      f"layers, seq {c.seq}, vocab {c.vocab}, batch {b}"
                      for lab, c, b, _ in setups(args.quick)) + ", float32.",
          "- The 8 devices are emulated by XLA on the host's cores "
          f"({_common.os.cpu_count()} here, shared with other work), so 'communication' is "
          "memory copies and the devices contend for the same cores: timings are noisy, and "
          "absolute errors mostly reflect the fitted CPU profile.",
          "- Spearman's rho is computed with numpy (ranks with ties averaged, then Pearson).",
          *([args.note] if args.note else []),
          "", (f"Wall time {elapsed:.0f} s. " if not args.report_only else "Report rebuilt "
               "from the CSV with `--report-only`. ")
          + f"Environment: {_common.environment()}.", "",
          "Reproduce: `python benchmarks/cpu_measured.py` (`--quick`: one tiny GPT, three "
          "strategies).", ""]
    (out / "cpu_measured.md").write_text("\n".join(md))
    print(f"wrote {out / 'cpu_measured.md'}: median rel. error {med_err:.1%}, Spearman {rho:.3f} "
          f"over {len(ok)} plans ({elapsed:.0f} s)")
    return med_err, rho


def _plot(rows, path, med_err, rho):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    groups = list(dict.fromkeys((r["model"], r["mesh"]) for r in rows))
    markers = "osD^v<>"
    cmap = plt.get_cmap("tab10")
    for r in rows:
        ax.scatter(r["predicted_ms"], r["measured_ms"],
                   color=cmap(strategies.index(r["strategy"]) % 10),
                   marker=markers[groups.index((r["model"], r["mesh"])) % len(markers)], s=45,
                   edgecolor="k", linewidth=0.4)
    vals = [v for r in rows for v in (r["predicted_ms"], r["measured_ms"])]
    if vals:
        lo, hi = min(vals) / 1.5, max(vals) * 1.5
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    for s in strategies:
        ax.scatter([], [], color=cmap(strategies.index(s) % 10), label=s)
    for g in groups:
        ax.scatter([], [], color="w", edgecolor="k", marker=markers[groups.index(g) % 7],
                   label=f"{g[0]} {g[1]}")
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(fmt)
        axis.set_minor_formatter(fmt)
    ax.tick_params(which="minor", labelsize=6)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms, median)")
    ax.set_title(f"8 CPU devices: median rel. error {med_err:.0%}, Spearman {rho:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
