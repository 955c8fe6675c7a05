"""Predicted throughput of autopar's plan against the best hand-written strategy of each family.

For each model, device count and hardware profile, every hand-written family is grid-searched
over the mesh shapes it can use and the best predicted step time is kept:

* data-parallel families (``dp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp``; for the MoE also
  ``ep``, experts over the data axis, GShard-style) on the 1-D mesh ``{"data": n}``;
* tensor-parallel families (``megatron``, ``megatron_sp``, ``fsdp_tp``; ``ep`` with experts over
  the model axis) on 2-D meshes ``{"data": n/m, "model": m}`` for m in {2, 8} (plus 4 on 8
  devices), the model axis inside one 8-GPU node.

``"auto"`` is planned on every one of those mesh shapes twice, and each one's best shape is kept:
seeded (``autopar.compare`` starts it from the best hand-written plan of that shape, so it is
never predicted slower than that plan: >= 1.0 by construction) and unseeded
(``compare(..., seed_auto=False)``: its own descent start, no hand-written plan or start, the same
solver time limit as each hand-written plan). Everything is a prediction of the cost model
(``plan.cost.step_time_s``) on abstract inputs: nothing runs. Throughput is global batch / step
time. Seeded auto predicted slower than a hand-written strategy is a planner bug: those cases are
listed first in the report. Every plan's ops run replicated for want of a sharding rule
(``plan.replicated_fallbacks``) are counted in the plans CSV and the report.

Writes ``benchmarks/results/handwritten_vs_auto.md``, ``.csv`` (one row per model, devices and
hardware), ``handwritten_vs_auto_plans.csv`` (every plan) and ``handwritten_vs_auto.png``.

    python benchmarks/handwritten_vs_auto.py           # full sweep (~10 min on 2 cores)
    python benchmarks/handwritten_vs_auto.py --quick   # tiny GPT, 8 devices (1-D mesh), h100
    python benchmarks/handwritten_vs_auto.py --only GPT-6.7B   # re-plan one model, merge
"""
from __future__ import annotations

import csv
import dataclasses  # noqa: E402
import math  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)

# The compare function itself (``autopar.compare`` is also reachable as the submodule name).
from autopar.compare import compare  # noqa: E402
from autopar.models import convnet, gpt, moe  # noqa: E402

UNSEEDED = "auto-unseeded"     # the seeded auto plan keeps the strategy name "auto"
AUTOS = ("auto", UNSEEDED)
DP_FAMILIES = ("dp", "zero1", "zero2", "zero3", "fsdp")
TP_FAMILIES = ("megatron", "megatron_sp", "fsdp_tp")
PER_DEVICE_BATCH = 8


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    build: object          # global batch -> (fn, state, batch) abstract
    moe: bool = False


def models(quick: bool) -> list[Model]:
    if quick:
        tiny = gpt.GPTConfig(vocab=512, seq=64, d_model=128, heads=4, d_ff=512, layers=2,
                             scan=True)
        return [Model("GPT-tiny", lambda b: gpt.abstract(tiny, b))]

    def g(name, remat=False):
        cfg = dataclasses.replace(gpt.GPT_CONFIGS[name], scan=True, remat=remat)
        return Model(f"GPT-{name}" + (" remat" if remat else ""), lambda b: gpt.abstract(cfg, b))

    moe_cfg = moe.MoEConfig(vocab=32000, seq=1024, d_model=1024, d_ff=4096, experts=16,
                            top_k=2, layers=4)
    conv_cfg = convnet.ConvConfig(side=64, channels=(256, 512, 1024, 2048), classes=1000)
    # GPT-6.7B without remat needs > 80 GiB per device at 8 sequences per device on every
    # strategy (the attention probabilities of 32 layers stay live): recompute each block.
    return [g("125M"), g("1.3B"), g("6.7B", remat=True),
            Model("MoE-16x(1024,4096) 4L", lambda b: moe.abstract(moe_cfg, b), moe=True),
            Model("WideConvNet-64px (256..2048)", lambda b: convnet.abstract(conv_cfg, b))]


def sweep(quick: bool) -> list[tuple[str, int, str]]:
    """(model name, devices, hardware) to run; kept small enough for a 2-core machine."""
    if quick:
        return [("GPT-tiny", 8, "h100")]
    runs = []
    for m in ("GPT-125M", "GPT-1.3B", "GPT-6.7B remat", "MoE-16x(1024,4096) 4L",
              "WideConvNet-64px (256..2048)"):
        for n in (8, 64):
            runs.append((m, n, "h100"))
    runs += [("GPT-1.3B", 16, "h100"), ("GPT-1.3B", 32, "h100")]
    runs += [("GPT-1.3B", 8, "a100"), ("GPT-1.3B", 64, "a100")]
    return runs


def mesh_shapes(n: int, quick: bool) -> list[dict[str, int]]:
    shapes = [{"data": n}]
    ms = () if quick else ((2, 4, 8) if n == 8 else (2, 8))
    shapes += [{"data": n // m, "model": m} for m in ms if n % m == 0 and n // m >= 1]
    return shapes


def plan_all(model: Model, n: int, hw: str, quick: bool, tl_1d: float, tl_2d: float):
    """One row per (mesh shape, strategy)."""
    batch = PER_DEVICE_BATCH * n
    fn, state, data = model.build(batch)
    out = []
    for shape in mesh_shapes(n, quick):
        one_d = len(shape) == 1
        names = DP_FAMILIES if one_d else TP_FAMILIES
        if model.moe:
            names = names + ("ep",)
        t0 = time.perf_counter()
        kw = dict(mesh=shape, hardware=hw, measure=False, progress=False,
                  time_limit_s=tl_1d if one_d else tl_2d)
        rows = compare(fn, state, data, strategies=names + ("auto",), **kw).rows
        alone = compare(fn, state, data, strategies=("auto",), seed_auto=False, **kw).rows
        rows += tuple(dataclasses.replace(r, strategy=UNSEEDED) for r in alone)
        out += [_plan_row(model, n, hw, batch, shape, r) for r in rows]
        print(f"  {model.name} n={n} {hw} {shape}: {time.perf_counter() - t0:.0f}s  " + ", ".join(
            f"{r.strategy} {r.predicted_step_s * 1e3:.1f}ms" if r.ok else f"{r.strategy} error"
            for r in rows), flush=True)
    return out


def _plan_row(model: Model, n: int, hw: str, batch: int, shape, r) -> dict:
    """One row of the plans CSV from one ``autopar.compare`` row."""
    nan = float("nan")
    fallbacks = r.plan.replicated_fallbacks if r.plan is not None else ()
    return dict(model=model.name, devices=n, hardware=hw, batch=batch,
                mesh=_common.mesh_str(shape), strategy=r.strategy,
                step_ms=r.predicted_step_s * 1e3 if r.ok else nan,
                samples_s=batch / r.predicted_step_s if r.ok else nan,
                peak_gib=(r.predicted_peak_bytes / 2**30 if r.ok else nan),
                status=r.plan.solver.status if r.plan is not None else "-", plan_s=r.plan_s,
                fallbacks=len(fallbacks) if r.plan is not None else nan,
                fallback_prims=" ".join(sorted({f[1] for f in fallbacks})),
                error=(r.error or "").splitlines()[0][:120] if not r.ok else "")


def family(strategy: str) -> str:
    return "zero3/fsdp" if strategy in ("zero3", "fsdp") else strategy


def _best(ps):
    return min(ps, key=lambda p: p["step_ms"]) if ps else None


def _ratio(a, h) -> float:
    return a["samples_s"] / h["samples_s"] if a and h else float("nan")


def summarize(plans):
    """One row per (model, devices, hardware): best seeded and unseeded auto, best per family,
    their ratios, and the most ops any plan of it ran replicated for want of a sharding rule."""
    keys = list(dict.fromkeys((p["model"], p["devices"], p["hardware"]) for p in plans))
    fams = list(dict.fromkeys(family(p["strategy"]) for p in plans if p["strategy"] not in AUTOS))
    rows = []
    for key in keys:
        mine = [p for p in plans if (p["model"], p["devices"], p["hardware"]) == key]
        ps = [p for p in mine if not math.isnan(p["step_ms"])]
        hand = [p for p in ps if p["strategy"] not in AUTOS]
        best_auto = _best([p for p in ps if p["strategy"] == "auto"])
        unseeded = _best([p for p in ps if p["strategy"] == UNSEEDED])
        best_hand = _best(hand)
        per_fam = {f: _best([p for p in hand if family(p["strategy"]) == f]) for f in fams}
        counts = [p["fallbacks"] for p in mine if not math.isnan(p.get("fallbacks", math.nan))]
        prims = sorted({x for p in mine for x in p.get("fallback_prims", "").split()})
        rows.append(dict(key=key, auto=best_auto, unseeded=unseeded, hand=best_hand,
                         fams=per_fam, ratio=_ratio(best_auto, best_hand),
                         ratio_unseeded=_ratio(unseeded, best_hand),
                         fallbacks=max(counts) if counts else math.nan, fallback_prims=prims,
                         batch=ps[0]["batch"] if ps else PER_DEVICE_BATCH * key[1]))
    return rows, fams


def plot(summary, fams, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hws = list(dict.fromkeys(s["key"][2] for s in summary))
    fig, axes = plt.subplots(len(hws), 1, figsize=(max(8, 1.3 * len(summary)), 4 * len(hws)),
                             squeeze=False)
    series = list(AUTOS) + fams
    cmap = plt.get_cmap("tab10")
    lowest, highest = 1.0, 1.0
    for ax, hw in zip(axes[:, 0], hws):
        rows = [s for s in summary if s["key"][2] == hw]
        width = 0.8 / len(series)
        for j, name in enumerate(series):
            xs, ys = [], []
            for i, s in enumerate(rows):
                best = ({"auto": s["auto"], UNSEEDED: s["unseeded"]}.get(name)
                        if name in AUTOS else s["fams"].get(name))
                ref = s["hand"]
                if best is None or ref is None:
                    continue
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                ys.append(best["samples_s"] / ref["samples_s"])
            if ys:
                lowest, highest = min(lowest, min(ys)), max(highest, max(ys))
                label = "auto (seeded)" if name == "auto" else name
                ax.bar(xs, ys, width, label=label, color=cmap(j % 10),
                       edgecolor="k" if name in AUTOS else None)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlim(-0.6, max(len(rows), max(len(r) for r in
                                              [[s for s in summary if s["key"][2] == h]
                                               for h in hws])) - 0.4)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([textwrap.fill(s["key"][0], 16) + f"\n{s['key'][1]} dev"
                            for s in rows], fontsize=7)
        ax.set_ylabel("throughput / best hand-written")
        ax.set_title(f"predicted throughput relative to the best hand-written strategy ({hw})")
        ax.legend(fontsize=7, ncol=len(series), loc="lower center", bbox_to_anchor=(0.5, 1.08))
    for ax in axes[:, 0]:
        ax.set_ylim(max(0.0, lowest - 0.05), highest + 0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLAN_COLS = ("model", "devices", "hardware", "batch", "mesh", "strategy", "step_ms",
             "samples_s", "peak_gib", "status", "plan_s", "fallbacks", "fallback_prims", "error")


def load_plans(path) -> list[dict]:
    """The plans CSV of an earlier run, with numbers parsed ("-" is nan)."""
    import csv

    def num(x):
        return float("nan") if x in ("-", "") else float(x)

    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["devices"], r["batch"] = int(r["devices"]), int(r["batch"])
        for c in ("step_ms", "samples_s", "peak_gib", "plan_s", "fallbacks"):
            r[c] = num(r.get(c, "-"))   # "fallbacks": absent from plans CSVs before it
        r.setdefault("fallback_prims", "")
    return rows


def summary_table(summary, fams):
    """The per-configuration table: header and rows."""
    head = (["model", "devices", "hardware", "batch", "auto (seeded) mesh",
             "auto (seeded) samples/s", "auto (unseeded) mesh", "auto (unseeded) samples/s",
             "best hand-written", "its mesh", "its samples/s", "seeded / best",
             "unseeded / best", "replicated fallback ops"]
            + [f"{f} samples/s" for f in fams])
    nan = float("nan")
    table = []
    for s in summary:
        a, u, h = s["auto"], s["unseeded"], s["hand"]
        table.append([s["key"][0], s["key"][1], s["key"][2], s["batch"],
                      a["mesh"] if a else "failed", a["samples_s"] if a else nan,
                      u["mesh"] if u else "failed", u["samples_s"] if u else nan,
                      h["strategy"] if h else "all failed", h["mesh"] if h else "-",
                      h["samples_s"] if h else nan, s["ratio"], s["ratio_unseeded"],
                      _fallback_cell(s)]
                     + [s["fams"][f]["samples_s"] if s["fams"][f] else nan for f in fams])
    return head, table


def _fallback_cell(s) -> str:
    if math.isnan(s["fallbacks"]):
        return "-"
    n = int(s["fallbacks"])
    return f"{n} ({', '.join(s['fallback_prims'])})" if n else "0"


def _where(s) -> str:
    return f"{s['key'][0]} on {s['key'][1]} {s['key'][2]}"


def _geomean(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def bug_lines(summary, plans) -> list[str]:
    """Seeded auto predicted slower than a hand-written strategy: planner bugs."""
    slower = [s for s in summary if not math.isnan(s["ratio"]) and s["ratio"] < 0.999]
    no_auto = [s for s in summary if s["auto"] is None and s["hand"] is not None]
    md = ["## Planner bugs: seeded auto predicted slower than a hand-written strategy", ""]
    for s in slower:
        md.append(f"- **{_where(s)}**: auto {s['auto']['samples_s']:.4g} samples/s "
                  f"({s['auto']['mesh']}, {s['auto']['status']}) < {s['hand']['strategy']} "
                  f"{s['hand']['samples_s']:.4g} samples/s ({s['hand']['mesh']}); ratio "
                  f"{s['ratio']:.3f}")
    md += [f"- **{_where(s)}**: seeded auto failed on every mesh shape while "
           f"{s['hand']['strategy']} planned" for s in no_auto]
    if not (slower or no_auto):
        md.append("None: on every configuration the seeded auto plan is predicted at least as "
                  "fast as the best hand-written strategy (it starts from that plan).")
    seeded = [p for p in plans if p["strategy"] != UNSEEDED]
    same_shape = [f"- {key[0]} on {key[1]} {key[2]}, mesh {key[3]}: auto "
                  f"{auto['step_ms']:.1f} ms ({auto['status']}) vs {best['strategy']} "
                  f"{best['step_ms']:.1f} ms ({best['status']}), "
                  f"{auto['step_ms'] / best['step_ms']:.2f}x slower"
                  for key, auto, best in _common.auto_losses(seeded, _shape, "step_ms")]
    if same_shape:
        md += ["", "Seeded auto predicted slower than a hand-written strategy **on the same mesh "
               "shape** (it is seeded with the best hand-written plan of that shape, so it "
               "should never lose there; these do not change the headline ratio when another "
               "shape wins, but they are planner bugs):", ""] + same_shape
    nothing = [s for s in summary if s["auto"] is None and s["hand"] is None]
    if nothing:
        md += ["", "Not a planner bug, but no plan at all (every strategy and auto over the "
               "memory budget): " + "; ".join(_where(s) for s in nothing) + "."]
    return md


def _shape(p):
    return (p["model"], p["devices"], p["hardware"], p["mesh"])


def headline_lines(summary) -> list[str]:
    """The summary prose, every figure computed from ``summary``."""
    seeded = [s["ratio"] for s in summary if not math.isnan(s["ratio"])]
    alone = [s for s in summary if not math.isnan(s["ratio_unseeded"])]
    md = ["", "## Summary", ""]
    if not seeded:
        return md + ["No configuration has both an auto and a hand-written plan."]
    md.append(f"Throughput of auto over the best hand-written strategy, geometric mean over "
              f"{len(seeded)} configurations: **seeded {_geomean(seeded):.3f}** (min "
              f"{min(seeded):.3f}, max {max(seeded):.3f}; >= 1.0 by construction, auto starts "
              f"from the best hand-written plan)" + (
                  f", **unseeded {_geomean([s['ratio_unseeded'] for s in alone]):.3f}** (min "
                  f"{min(s['ratio_unseeded'] for s in alone):.3f}, max "
                  f"{max(s['ratio_unseeded'] for s in alone):.3f}, over {len(alone)} "
                  f"configurations; its own descent start, the same solver time limit)."
                  if alone else "; unseeded auto planned on none."))
    lose = [s for s in alone if s["ratio_unseeded"] < 0.999]
    md += ["", f"Unseeded auto is predicted slower than the best hand-written strategy on "
               f"{len(lose)} of {len(alone)} configurations" + (":" if lose else ".")]
    md += [f"- {_where(s)}: {s['ratio_unseeded']:.3f} ({s['unseeded']['mesh']}, "
           f"{s['unseeded']['status']}) against {s['hand']['strategy']} ({s['hand']['mesh']})"
           for s in lose]
    with_fb = [s for s in summary if not math.isnan(s["fallbacks"]) and s["fallbacks"] > 0]
    md += ["", "Ops run replicated for want of a sharding rule (`plan.replicated_fallbacks`, the "
               "most in any plan of a configuration): " + (
                   "; ".join(f"{_where(s)}: {int(s['fallbacks'])} "
                             f"({', '.join(s['fallback_prims'])})" for s in with_fb)
                   if with_fb else "none in any plan.")]
    return md


def _environment_of(md_path) -> str:
    """The environment a results file names (its first ``Environment: `` line, up to the
    first period that ends it), or ``"unknown"``."""
    if not md_path.exists():
        return "unknown"
    for line in md_path.read_text().splitlines():
        if "Environment: " in line:
            return line.split("Environment: ", 1)[1].split(" (the plans)", 1)[0].rstrip(".")
    return "unknown"


def pipeline_lines(csv_path) -> list[str]:
    """The 3-D (tensor x pipeline x data) comparison of GPT 39B-175B, from the rows
    ``benchmarks/pipeline_3d.py`` wrote (its own run, commit and load, named here)."""
    head = ["## GPT 39B-175B: auto's 3-D pipeline vs the best megatron_3d (predicted)", ""]
    if not csv_path.exists():
        return head + [f"No `{csv_path.name}`: run `python benchmarks/pipeline_3d.py`.", ""]
    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    env = _environment_of(csv_path.with_suffix(".md"))
    table, slower = [], 0
    for key in dict.fromkeys((r["model"], r["gpus"], r["hardware"]) for r in rows):
        side = {r["side"]: r for r in rows if (r["model"], r["gpus"], r["hardware"]) == key}
        hand, auto = side.get("megatron_3d"), side.get("auto")
        if hand is None or auto is None or "-" in (hand["step_s"], auto["step_s"]):
            continue
        ratio = float(hand["step_s"]) / float(auto["step_s"])
        slower += ratio < 1
        table.append([f"GPT-{key[0]}", key[1], key[2], ratio,
                      f"{auto['mesh']} {auto['schedule']} V={auto['virtual']} "
                      f"M={auto['microbatches']}",
                      f"{hand['mesh']} {hand['schedule']} V={hand['virtual']} "
                      f"M={hand['microbatches']}",
                      float(auto["bubble"]), float(hand["bubble"]), float(auto["peak_gib"])])
    cols = ("model", "GPUs", "hardware", "auto throughput / megatron_3d", "auto's choice",
            "megatron_3d's best", "auto bubble", "megatron_3d bubble", "auto peak GiB")
    return head + [
        "Whole 3-D configurations, which the 2-D sweep above cannot express: tensor parallel "
        "inside a node, pipeline stages and data parallel across nodes (`benchmarks/"
        "pipeline_3d.py`, abstract planning). Auto's search space contains Megatron 3-D's, so "
        "auto is never predicted slower **by construction** (predicted slower here on "
        f"{slower} of {len(table)}); what the rows add is what it chose. Why each choice won "
        "(bubble, memory, communication, its runners-up) is in `pipeline_3d.md`. Both sides are "
        "predictions on data-sheet profiles; nothing here ran on those GPUs.", "",
        _common.md_table(cols, table), "", f"Those rows' run: {env}.", ""]


def method_lines(plans, args, tl_1d: float, tl_2d: float, planned_in: str = "") -> list[str]:
    """The method section; ``planned_in``: the environment the plans were made in, when this
    report is rebuilt from their CSV (else the run's own)."""
    from autopar.options import deterministic_default

    elapsed = sum(r["plan_s"] for r in plans)
    clock = ("CP-SAT's deterministic clock only (`AUTOPAR_DETERMINISTIC=1`: the wall clock cuts "
             "nothing, so the plans do not depend on the machine's load)"
             if deterministic_default() else "the wall clock (plans depend on the machine's load)")
    return [
        "## Method", "",
        f"- Global batch {PER_DEVICE_BATCH} per device (sequences for GPT/MoE, images for the "
        "conv net). GPT configs from `GPT_CONFIGS` with `scan=True` (the layer stack is one "
        "loop region); MoE: `MoEConfig(vocab=32000, seq=1024, d_model=1024, d_ff=4096, "
        "experts=16, top_k=2, layers=4)`; GPT-6.7B with `remat=True` (without it no strategy "
        "fits 80 GiB per device at this batch); conv net: `ConvConfig(side=64, "
        "channels=(256, 512, 1024, 2048), classes=1000)` (conv + BatchNorm + max-pool stages, "
        "no residuals).",
        "- Each mesh shape is one `autopar.compare(..., measure=False)` call: the hand-written "
        "strategies pin the input layouts and the ILP fills in the activations under the same "
        "cost model; `auto` (seeded) is planned last, started from the best hand-written plan "
        "of that shape. A second call, `compare(..., strategies=('auto',), seed_auto=False)`, "
        "plans auto (unseeded) from its own descent start with no hand-written plan or start. "
        "Plans that do not fit the 80 GiB budget are errors (see the plans CSV) and drop out.",
        f"- Solver time limit {tl_1d:g} s on 1-D meshes and {tl_2d:g} s on 2-D meshes, the same "
        f"for every hand-written plan, seeded and unseeded auto, measured on {clock}. 2-D plans "
        "often stop at the limit (status `DESCENT (time limit)` or `FEASIBLE`).",
        "- Caveats: a hand-written family's number includes the planner's activation layouts "
        "found under the same short limit, so it can be worse than a hand-placed "
        "implementation; ratios near 1.00 are within the solver's noise. Absolute throughputs "
        "are the cost model's predictions: compare ratios, not samples/s against published "
        "numbers.",
        "- **Sweep kept small for a 2-core machine:** 8 and 64 devices for every model on H100, "
        "16 and 32 devices only for GPT-1.3B, A100 only for GPT-1.3B (8, 64); 2-D shapes use "
        "a model axis of 2 or 8 (and 4 on 8 devices); GPT-39B left out." if not args.quick
        else "- `--quick`: a tiny GPT on the 1-D mesh of 8 devices, H100 only.",
        f"- This run re-planned only the models whose name contains {args.only!r}; the other "
        "rows come from the plans CSV an earlier run wrote." if args.only is not None else "",
        "", f"Sum of planning wall times {elapsed:.0f} s. Environment: "
        + (f"{planned_in} (the plans); this report was rebuilt from their CSV "
           f"(`--report-only`) at {_common.environment()}." if planned_in
           else f"{_common.environment()}."), "",
        "Reproduce: `" + ("AUTOPAR_DETERMINISTIC=1 " if deterministic_default() else "")
        + "python benchmarks/handwritten_vs_auto.py` (`--quick`: a tiny GPT on the "
        "1-D mesh of 8 devices, H100 only; `--only NAME` re-plans the models whose name "
        "contains NAME and merges them into the existing plans CSV; `--report-only` rebuilds "
        "the report from that CSV).", ""]


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--only", default=None,
                   help="re-plan only the models whose name contains this text and merge them "
                        "into the plans CSV already in the output directory")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the plans CSV in the output directory")
    args = p.parse_args(argv)
    out = _common.out_dir(args)
    tl_1d, tl_2d = (2.0, 1.0) if args.quick else (5.0, 1.0)
    by_name = {m.name: m for m in models(args.quick)}
    todo = sweep(args.quick)
    kept = []
    if args.report_only:
        todo, kept = [], load_plans(out / "handwritten_vs_auto_plans.csv")
    elif args.only is not None:
        todo = [t for t in todo if args.only in t[0]]
        kept = [r for r in load_plans(out / "handwritten_vs_auto_plans.csv")
                if args.only not in r["model"]]
    # 8-device configurations first; the reports are rewritten after each configuration, so a
    # run stopped early leaves reports of what it planned, naming what it did not reach.
    todo.sort(key=lambda t: t[1] != 8)
    new_plans, summary = [], []
    for k, (name, n, hw) in enumerate(todo):
        new_plans += plan_all(by_name[name], n, hw, args.quick, tl_1d, tl_2d)
        summary = write_reports(out, args, kept + new_plans, len(new_plans), todo[k + 1:],
                                (tl_1d, tl_2d))
    return summary if todo else write_reports(out, args, kept, 0, [], (tl_1d, tl_2d))


def write_reports(out, args, plans, n_new: int, missing, limits) -> list[dict]:
    """The plans CSV, the summary CSV, the plot and the markdown report of ``plans``."""
    tl_1d, tl_2d = limits
    order = {t: i for i, t in enumerate(sweep(args.quick))}
    plans = sorted(plans,
                   key=lambda r: order.get((r["model"], r["devices"], r["hardware"]), 1 << 30))
    summary, fams = summarize(plans)
    _common.write_csv(out / "handwritten_vs_auto_plans.csv", PLAN_COLS,
                      [[p[c] for c in PLAN_COLS] for p in plans])
    head, table = summary_table(summary, fams)
    _common.write_csv(out / "handwritten_vs_auto.csv", head, table)
    plot(summary, fams, out / "handwritten_vs_auto.png")
    planned_in = _environment_of(out / "handwritten_vs_auto.md") if args.report_only else ""
    md = (["# autopar vs hand-written strategies (predicted throughput)", ""]
          + (["**Partial: this run stopped before planning** " + "; ".join(
              f"{m} on {n} {hw}" for m, n, hw in missing) + ". Every figure below covers only "
              "the configurations in the table.", ""] if missing else [])
          + bug_lines(summary, plans) + headline_lines(summary)
          + ["", _common.md_table(head, table), "",
             "![throughput relative to the best hand-written strategy](handwritten_vs_auto.png)",
             ""] + pipeline_lines(_common.RESULTS / "pipeline_3d.csv")
          + method_lines(plans, args, tl_1d, tl_2d, planned_in))
    (out / "handwritten_vs_auto.md").write_text("\n".join(md))
    print(f"wrote {out / 'handwritten_vs_auto.md'} ({len(plans)} plans, {n_new} new)", flush=True)
    return summary


if __name__ == "__main__":
    main()
