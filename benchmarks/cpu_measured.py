"""Predicted vs measured step time on the 8 emulated CPU devices, over the plan matrix.

The matrix of issue 7: the reference GPT unrolled and ``nn.scan``-ned, the MoE and the conv net
(all small, float32), each planned with ``hardware="cpu"`` (the profile fitted to this kind of
machine by ``benchmarks/calibrate_cost_model.py``, ``cost_models/profiles/cpu.json``) on the
meshes ``1x8`` (``{"data": 8}``), ``2x4`` and ``4x2`` (``{"data", "model"}``) and, for the MoE,
``2x2x2`` (``{"data", "model", "expert"}``): ``auto`` and every hand-written strategy that applies
on each mesh. Plans and compiled executables come from ``autopar.compare`` (the codegen
``autopar.autoparallel`` runs).

Timing: every executable is warmed up, then the plans are timed round robin (repeat ``r`` of
every plan before repeat ``r + 1`` of any), so drift in the machine's load hits all plans alike;
each plan's figure is the median of its repeats. The load average before and after, and the CPU
time other processes took while the timings ran (from ``/proc/stat``), are reported beside the
figures: on a shared machine they, not the cost model, can dominate the error.

Reported: the median relative error |predicted - measured| / measured and the Spearman rank
correlation of predicted vs measured step times (numpy, average ranks for ties), pooled and per
model, and whether the predicted-fastest plan of each (model, mesh) is the measured-fastest.

Writes ``benchmarks/results/cpu_measured.md``, ``cpu_measured.csv`` and ``cpu_measured.png``.

    python benchmarks/cpu_measured.py          # the matrix, about 10 minutes on 2 idle cores
    python benchmarks/cpu_measured.py --quick  # one tiny GPT, 1-D mesh, 3 strategies

What each CPU term of the profile changes, on the same measured steps (plans only, no timing):

    python benchmarks/cpu_measured.py --reprice benchmarks/results/cpu_measured_profile.json \
        --without kernel_floor_s          # or conv_efficiency, conv_min_features,
                                          # transcendental_s, select_scatter_s,
                                          # select_scatter_fixed_s, or several
"""
from __future__ import annotations

import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import cost_models  # noqa: E402

# The compare function itself (``autopar.compare`` is also reachable as the submodule name).
from autopar.compare import compare  # noqa: E402
from autopar.models import convnet, gpt, moe  # noqa: E402
from cost_models.measure import count_hlo_kernels  # noqa: E402

DP = ("dp", "zero1", "zero2", "zero3")   # "fsdp" is zero3 under another name
TP = ("megatron", "megatron_sp", "fsdp_tp")
MESHES = {"1x8": {"data": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2},
          "2x2x2": {"data": 2, "model": 2, "expert": 2}}
GPT = gpt.GPTConfig(vocab=512, seq=64, d_model=128, heads=4, d_ff=512, layers=2)
MOE = moe.MoEConfig(vocab=256, seq=32, d_model=64, d_ff=256, experts=4, layers=2)
CONV = convnet.ConvConfig(side=16, channels=(16, 32))


@dataclasses.dataclass(frozen=True)
class Setup:
    label: str
    build: object                       # () -> (fn, state, batch), concrete arrays
    batch: int
    meshes: tuple[tuple[str, tuple[str, ...]], ...]   # (mesh name, strategies)
    config: str


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


def setups(quick: bool) -> list[Setup]:
    if quick:
        cfg = gpt.GPTConfig(vocab=256, seq=32, d_model=64, heads=4, d_ff=256, layers=1)
        return [Setup("GPT-tiny", lambda: gpt.concrete(cfg, 16), 16,
                      (("1x8", ("dp", "zero3", "auto")),), _gpt_text(cfg))]
    gpt_meshes = (("1x8", DP + ("auto",)), ("2x4", TP + ("auto",)),
                  ("4x2", ("megatron", "fsdp_tp", "auto")))
    moe_meshes = (("1x8", DP + ("ep", "auto")), ("2x4", TP + ("ep", "auto")),
                  ("2x2x2", ("megatron", "ep", "auto")))
    conv_meshes = (("1x8", DP + ("auto",)), ("2x4", ("megatron", "fsdp_tp", "auto")))
    scan = dataclasses.replace(GPT, scan=True)
    return [
        Setup("GPT unrolled", lambda: gpt.concrete(GPT, 16), 16, gpt_meshes, _gpt_text(GPT)),
        Setup("GPT scan", lambda: gpt.concrete(scan, 16), 16, gpt_meshes, "the same, nn.scan"),
        Setup("MoE", lambda: moe.concrete(MOE, 16), 16, moe_meshes,
              f"vocab {MOE.vocab}, seq {MOE.seq}, d_model {MOE.d_model}, d_ff {MOE.d_ff}, "
              f"{MOE.experts} experts top-{MOE.top_k}, {MOE.layers} layers"),
        Setup("conv net", lambda: convnet.concrete(CONV, 32), 32, conv_meshes,
              f"{CONV.side}x{CONV.side} images, channels {CONV.channels}, {CONV.classes} "
              f"classes"),
    ]


def _gpt_text(c) -> str:
    return (f"vocab {c.vocab}, seq {c.seq}, d_model {c.d_model}, {c.heads} heads, d_ff {c.d_ff}, "
            f"{c.layers} layers")


COLS = ("model", "batch", "mesh", "strategy", "predicted_ms", "measured_ms", "rel_error",
        "spread", "compute_ms", "collectives_ms", "resharding_ms", "dispatch_ms",
        "n_collectives", "hlo_kernels", "hlo_collectives", "hlo_loops", "plan_id", "error")


def load_rows(path) -> list[dict]:
    import csv

    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for c in COLS[4:-2]:
            r[c] = math.nan if r[c] in ("-", "") else float(r[c])
        r.setdefault("plan_id", "")
    return rows


# ---- HLO features (what the compiled step launches) -----------------------------------------
_COLLECTIVE = re.compile(r"= .*\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def hlo_features(compiled) -> tuple[int, int, int]:
    """(kernels, collectives, while loops) of the compiled program: kernels as
    ``cost_models.measure.count_hlo_kernels`` counts them (instructions doing work in the entry
    and loop bodies, each once), collectives and loops as instructions of the whole text."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - features are diagnostics only
        return -1, -1, -1
    lines = text.splitlines()
    return (count_hlo_kernels(compiled), sum(1 for ln in lines if _COLLECTIVE.search(ln)),
            sum(1 for ln in lines if " while(" in ln))


# ---- the load other processes put on the machine --------------------------------------------
def _cpu_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields) - idle) / hz, sum(fields) / hz


def _own_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class LoadMeter:
    """CPU seconds other processes used while it ran, as a fraction of the machine's capacity."""

    def __enter__(self):
        self.before, self.own, self.t0 = _cpu_jiffies(), _own_cpu_s(), time.perf_counter()
        self.loadavg_before = _common.machine_load()
        return self

    def __exit__(self, *exc):
        after, own = _cpu_jiffies(), _own_cpu_s()
        self.seconds = time.perf_counter() - self.t0
        self.loadavg_after = _common.machine_load()
        if self.before is None or after is None:
            self.others = math.nan
            return
        busy = after[0] - self.before[0]
        capacity = self.seconds * (os.cpu_count() or 1)
        self.others = max(busy - (own - self.own), 0.0) / capacity

    def text(self) -> str:
        return (f"other processes used {self.others:.0%} of the {os.cpu_count()} cores during "
                f"the {self.seconds:.0f} s of timing; {self.loadavg_before} before, "
                f"{self.loadavg_after} after")


# ---- planning, compiling, timing ------------------------------------------------------------
@dataclasses.dataclass
class Case:
    model: str
    batch: int
    mesh: str
    strategy: str
    row: object                          # autopar.compare Row
    args: tuple = ()
    times: list = dataclasses.field(default_factory=list)


def plan_and_compile(setups_: list[Setup], hw, time_limit_s: float) -> list[Case]:
    cases = []
    for s in setups_:
        fn, state, batch = s.build()
        for mesh_name, names in s.meshes:
            t0 = time.perf_counter()
            cmp = compare(fn, state, batch, mesh=MESHES[mesh_name], hardware=hw,
                          strategies=names, measure=True, runs=1, time_limit_s=time_limit_s,
                          progress=False)
            for r in cmp.rows:
                args = ()
                if r.compiled is not None:
                    args = jax.device_put((state, batch), r.compiled.input_shardings[0])
                cases.append(Case(s.label, s.batch, mesh_name, r.strategy, r, args))
            print(f"  {s.label} {mesh_name}: {time.perf_counter() - t0:.0f}s", flush=True)
            print("    " + str(cmp).replace("\n", "\n    "), flush=True)
    return cases


def time_round_robin(cases: list[Case], repeats: int, warmup: int) -> None:
    """Warm every executable up, then time repeat r of every plan before repeat r + 1."""
    live = [c for c in cases if c.row.compiled is not None]
    for c in live:
        for _ in range(warmup):
            jax.block_until_ready(c.row.compiled(*c.args))
    for _ in range(repeats):
        for c in live:
            t0 = time.perf_counter()
            jax.block_until_ready(c.row.compiled(*c.args))
            c.times.append(time.perf_counter() - t0)


def to_row(c: Case) -> dict:
    r, plan = c.row, c.row.plan
    cost = plan.cost if plan is not None else None
    meas = statistics.median(c.times) if c.times else math.nan
    spread = ((np.percentile(c.times, 75) - np.percentile(c.times, 25)) / meas
              if c.times else math.nan)
    kernels, colls, loops = hlo_features(r.compiled) if r.compiled is not None else (-1,) * 3
    ms = (lambda x: x * 1e3) if cost else (lambda x: math.nan)
    pred = ms(cost.step_time_s) if cost else math.nan
    return dict(model=c.model, batch=c.batch, mesh=c.mesh, strategy=c.strategy,
                predicted_ms=pred, measured_ms=meas * 1e3,
                rel_error=abs(pred - meas * 1e3) / (meas * 1e3) if c.times else math.nan,
                spread=spread, compute_ms=ms(cost.compute_s) if cost else math.nan,
                collectives_ms=ms(cost.comm_s) if cost else math.nan,
                resharding_ms=ms(cost.transition_s) if cost else math.nan,
                dispatch_ms=ms(cost.dispatch_s) if cost else math.nan,
                n_collectives=float(sum(x.count for x in plan.collectives)) if plan else math.nan,
                hlo_kernels=float(kernels), hlo_collectives=float(colls), hlo_loops=float(loops),
                plan_id=plan_id(plan),
                error=(r.error or "").splitlines()[0][:120] if r.error else "")


def plan_id(plan) -> str:
    """A short fingerprint of a plan's layouts (inputs, outputs, pins, op choices): two runs
    that price the same plan give it the same id."""
    if plan is None:
        return ""
    key = repr((plan.input_shardings, plan.output_shardings, plan.pins, plan.choices))
    return hashlib.sha1(key.encode()).hexdigest()[:10]


# ---- re-pricing measured plans under another profile ----------------------------------------
def reprice(chosen: list[Setup], hw, out, time_limit_s: float) -> list[dict]:
    """The rows of ``out/cpu_measured.csv`` (a measured run) with ``predicted_ms`` and its
    parts replaced by the plans made under ``hw`` (planned, not compiled or timed): the same
    measured steps priced by two profiles. ``same_plan`` says whether the plan under ``hw``
    is the one measured (``auto``, seeded by the hand-written plans, can change)."""
    measured = {(r["model"], r["mesh"], r["strategy"]): r
                for r in load_rows(out / "cpu_measured.csv")}
    rows = []
    for s in chosen:
        fn, state, batch = s.build()
        for mesh_name, names in s.meshes:
            cmp = compare(fn, state, batch, mesh=MESHES[mesh_name], hardware=hw,
                          strategies=names, measure=False, time_limit_s=time_limit_s,
                          progress=False)
            for r in cmp.rows:
                old = measured.get((s.label, mesh_name, r.strategy))
                if old is None or r.plan is None:
                    continue
                cost = r.plan.cost
                new = dict(old, predicted_ms=cost.step_time_s * 1e3,
                           compute_ms=cost.compute_s * 1e3, collectives_ms=cost.comm_s * 1e3,
                           resharding_ms=cost.transition_s * 1e3,
                           dispatch_ms=cost.dispatch_s * 1e3, plan_id=plan_id(r.plan))
                new["rel_error"] = abs(new["predicted_ms"] - old["measured_ms"]) / old[
                    "measured_ms"]
                new["same_plan"] = new["plan_id"] == old["plan_id"] or not old["plan_id"]
                rows.append(new)
            print(f"  repriced {s.label} {mesh_name}", flush=True)
    return rows


def reprice_report(rows: list[dict], hw_name: str, base: list[dict]) -> list[str]:
    """Before (the run's own predictions) and after (``hw``) on the same measured steps."""
    same = [r for r in rows if r["same_plan"]]
    keys = {(r["model"], r["mesh"], r["strategy"]) for r in same}
    base_same = [r for r in base if (r["model"], r["mesh"], r["strategy"]) in keys]
    lines = [f"# Measured steps re-priced under {hw_name}", "",
             f"{len(rows)} plans re-planned, {len(same)} the same plan as measured.", ""]
    table = []
    hand = [r for r in same if r["strategy"] != "auto"]
    base_hand = [r for r in base_same if r["strategy"] != "auto"]
    for label, rs in (("run's profile", base_same), (hw_name, same),
                      ("run's profile, hand-written only", base_hand),
                      (f"{hw_name}, hand-written only", hand)):
        err, rho, ratio = summarise(rs)
        fam = "; ".join(f"{g[0]} {g[4]:.2f}" for g in group_table(rs, lambda r: r["model"]))
        table.append((label, len(rs), err, rho, ratio, fam))
    lines.append(_common.md_table(("profile", "plans", "median rel. error", "Spearman",
                                   "measured / predicted", "measured / predicted by model"),
                                  table))
    return lines + [""]


# ---- report ---------------------------------------------------------------------------------
def summarise(ok: list[dict]) -> tuple[float, float, float]:
    """(median relative error, Spearman, median measured / predicted) of ``ok`` rows."""
    if not ok:
        return math.nan, math.nan, math.nan
    pred = np.array([r["predicted_ms"] for r in ok])
    meas = np.array([r["measured_ms"] for r in ok])
    return (float(np.median(np.abs(pred - meas) / meas)), spearman(pred, meas),
            float(np.median(meas / pred)))


def group_table(ok: list[dict], key) -> list[tuple]:
    out = []
    for g in dict.fromkeys(key(r) for r in ok):
        gr = [r for r in ok if key(r) == g]
        err, rho, ratio = summarise(gr)
        best_p = min(gr, key=lambda r: r["predicted_ms"])["strategy"]
        best_m = min(gr, key=lambda r: r["measured_ms"])["strategy"]
        out.append((*((g,) if isinstance(g, str) else g), len(gr), err, rho, ratio,
                    best_p, best_m))
    return out


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--runs", type=int, default=None, help="timed runs per plan (median)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the .md and .png from the .csv in the output directory")
    p.add_argument("--note", default="", help="a sentence added to the report")
    p.add_argument("--calibrate", action="store_true",
                   help="profile this machine first (cost_models.profile(): micro-benchmarks of "
                        "ops and collectives, no step) and plan with that profile, written to "
                        "cpu_measured_profile.json; default: the shipped 'cpu' profile")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of: GPT unrolled, GPT scan, MoE, conv net")
    p.add_argument("--reprice", default=None, metavar="PROFILE",
                   help="plan only (no compile, no timing) under PROFILE (a name or a JSON file) "
                        "and price the measured steps of the CSV in the output directory: "
                        "writes cpu_measured_repriced_<PROFILE>.md and .csv beside it")
    p.add_argument("--without", default="",
                   help="with --reprice: comma-separated CPU terms set neutral in PROFILE first "
                        f"(of {', '.join(NEUTRAL)}), to see what each one changes")
    args = p.parse_args(argv)
    out = _common.out_dir(args)
    if args.reprice:
        return _reprice_main(args, out)
    runs = args.runs or (3 if args.quick else 9)
    time_limit_s = 3.0 if args.quick else 8.0
    hw = cost_models.hardware("cpu")
    if args.calibrate and args.report_only:
        hw = cost_models.hardware(str(out / "cpu_measured_profile.json"))
    elif args.calibrate:
        hw = cost_models.profile(quick=args.quick)
        hw.save(out / "cpu_measured_profile.json")
        print(f"profiled this machine: {hw.to_json()}", flush=True)
    chosen = [s for s in setups(args.quick)
              if args.models is None or s.label in args.models.split(",")]
    t_all = time.perf_counter()
    meter = None
    if args.report_only:
        rows = load_rows(out / "cpu_measured.csv")
        meter = _previous_load(out / "cpu_measured.md")
    else:
        cases = plan_and_compile(chosen, hw, time_limit_s)
        with LoadMeter() as meter:
            time_round_robin(cases, runs, warmup=2)
        rows = [to_row(c) for c in cases]
        _common.write_csv(out / "cpu_measured.csv", COLS, [[r[c] for c in COLS] for r in rows])
    elapsed = time.perf_counter() - t_all
    ok = [r for r in rows if r["measured_ms"] == r["measured_ms"]
          and r["predicted_ms"] == r["predicted_ms"]]
    _plot(ok, out / "cpu_measured.png", *summarise(ok)[:2])
    md = report(rows, ok, args, runs, time_limit_s, meter, elapsed, hw)
    (out / "cpu_measured.md").write_text("\n".join(md))
    err, rho, _ = summarise(ok)
    print(f"wrote {out / 'cpu_measured.md'}: median rel. error {err:.1%}, Spearman {rho:.3f} "
          f"over {len(ok)} plans ({elapsed:.0f} s); "
          + (meter.text() if meter else "report rebuilt"))
    return err, rho


# The profile terms --without can switch off, and the values that make them neutral.
NEUTRAL = {"kernel_floor_s": 0.0, "conv_efficiency": 1.0, "conv_min_features": 1.0,
           "transcendental_s": 0.0, "select_scatter_s": 0.0, "select_scatter_fixed_s": 0.0}


def _reprice_main(args, out):
    off = [t for t in args.without.split(",") if t]
    unknown = [t for t in off if t not in NEUTRAL]
    if unknown:
        raise SystemExit(f"--without {unknown}: not a term; use some of {list(NEUTRAL)}")
    hw = dataclasses.replace(cost_models.hardware(args.reprice), **{t: NEUTRAL[t] for t in off})
    name = args.reprice + "".join(f" without {t}" for t in off)
    chosen = [s for s in setups(args.quick)
              if args.models is None or s.label in args.models.split(",")]
    rows = reprice(chosen, hw, out, 3.0 if args.quick else 8.0)
    base = [r for r in load_rows(out / "cpu_measured.csv")
            if r["measured_ms"] == r["measured_ms"] and r["predicted_ms"] == r["predicted_ms"]]
    md = reprice_report(rows, name, base)
    stem = ("cpu_measured_repriced_" + os.path.basename(args.reprice).removesuffix(".json")
            + "".join(f"_no_{t}" for t in off))
    (out / f"{stem}.md").write_text("\n".join(md))
    _common.write_csv(out / f"{stem}.csv", COLS + ("same_plan",),
                      [[r[c] for c in COLS + ("same_plan",)] for r in rows])
    print("\n".join(md))
    err, rho, _ = summarise([r for r in rows if r["same_plan"]])
    return err, rho


def report(rows, ok, args, runs, time_limit_s, meter, elapsed, hw) -> list[str]:
    err, rho, ratio = summarise(ok)
    load = meter.text() if meter else "unknown (report rebuilt without the original report)"
    met = "met" if err <= 0.15 and rho >= 0.8 else "NOT met"
    failed = [f"- {r['model']} {r['mesh']} {r['strategy']}: {r['error']}" for r in rows
              if r["error"]]
    return [
        "# Cost model vs measurement on 8 emulated CPU devices", "",
        "Reproduce (on an otherwise idle machine): `python benchmarks/cpu_measured.py "
        "--calibrate` (profiles the machine, then plans, compiles and times the matrix: about "
        "10 minutes on 2 idle cores; without `--calibrate` the shipped `cpu` profile is used; "
        "`--quick`: one tiny GPT, three strategies).", "",
        f"**{len(ok)} plans: median relative error {err:.1%}, Spearman rank correlation "
        f"{rho:.3f}** (predicted vs measured step time, all plans pooled; issue 7's target "
        f"median <= 15% and Spearman >= 0.8: {met}). Median measured / predicted {ratio:.2f}.",
        "", f"Machine load: {load}.", "",
        *_prose(ok, hw), "",
        "## Per model", "",
        _common.md_table(("model", "plans", "median rel. error", "Spearman",
                          "measured / predicted", "predicted fastest", "measured fastest"),
                         group_table(ok, lambda r: r["model"])), "",
        "## Per model and mesh", "",
        _common.md_table(("model", "mesh", "plans", "median rel. error", "Spearman",
                          "measured / predicted", "predicted fastest", "measured fastest"),
                         group_table(ok, lambda r: (r["model"], r["mesh"]))), "",
        "## Every plan", "",
        "`spread`: interquartile range of the repeats / median. `hlo_kernels`: instructions "
        "doing work in the compiled entry and loop bodies (fusions, dots, copies, "
        "collectives), each counted once.", "",
        _common.md_table(COLS, [[r[c] for c in COLS] for r in rows]), "",
        *(["## Plans that failed", "", *failed, ""] if failed else []),
        "![predicted vs measured](cpu_measured.png)", "",
        "## Method", "",
        "- Profile: " + ("fitted by `cost_models.profile()` on this machine just before the "
                         "timings (micro-benchmarks of matmuls, a streaming op, collectives and "
                         "chains of kernels, all-reduces, step-sized memory-bound kernels, "
                         "small convolutions, transcendentals and max-pool gradients; no "
                         "training step), saved as "
                         "`cpu_measured_profile.json`" if args.calibrate else
                         "the shipped `cost_models/profiles/cpu.json`") + ": "
        f"float32 peak {hw.peak_flops_per_s() / 1e9:.1f} GFLOP/s and memory "
        f"{hw.hbm_bytes_per_s / 1e9:.2f} GB/s per device, kernel launch "
        f"{hw.kernel_launch_s * 1e6:.1f} us (plus a floor of {hw.kernel_floor_s * 1e6:.0f} us "
        f"from {hw.kernel_floor_bytes / 1024:.1f} KiB per kernel up), convolutions at "
        f"{hw.conv_efficiency:.2f} x the matmul rate (times (c / {hw.conv_min_features:g})^"
        f"{hw.conv_narrow_power:g} below {hw.conv_min_features:g} channels c per device), "
        f"{hw.transcendental_s * 1e9:.1f} ns per "
        f"transcendental, a max-pool gradient {hw.select_scatter_fixed_s * 1e6:.0f} us + "
        f"{hw.select_scatter_s * 1e9:.1f} ns per operand element, collective launch "
        f"{hw.collective_launch_s * 1e6:.0f} us, program dispatch {hw.dispatch_s * 1e6:.0f} us.",
        "- `autopar.compare(train_step, state, batch, mesh=..., hardware=profile, "
        f"strategies=..., measure=True, runs=1, time_limit_s={time_limit_s:g})` plans and "
        "compiles every plan (autopar's codegen, as `autopar.autoparallel` runs it). Then every "
        f"executable runs twice to warm up and the plans are timed round robin, {runs} repeats "
        "each, `block_until_ready` each; a plan's time is the median of its repeats.",
        "- Models (float32): " + "; ".join(f"{s.label}: {s.config}, batch {s.batch}"
                                          for s in setups(args.quick)) + ".",
        "- Meshes: " + "; ".join(f"`{s.label}` {m}: {', '.join(n)}" for s in setups(args.quick)
                                 for m, n in s.meshes) + ".",
        "- The 8 devices are emulated by XLA on the host's "
        f"{os.cpu_count()} cores: 'communication' is memory copies and the devices contend for "
        "the same cores, so other work on the machine inflates and scatters the measurements.",
        "- Spearman's rho is computed with numpy (ranks with ties averaged, then Pearson).",
        *([args.note] if args.note else []), "",
        (f"Wall time {elapsed:.0f} s. Environment: {_common.environment()}."
         if not args.report_only else f"Report rebuilt from the CSV (`--report-only`), "
         f"{_common.environment()}. The run's {_previous_environment(args)}"), ""]


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """The load line of an earlier report, for a report rebuilt with ``--report-only``."""
    line: str

    def text(self) -> str:
        return self.line


def _previous_environment(args) -> str:
    """The environment line of the report being rebuilt (the run's commit and load)."""
    try:
        lines = (_common.out_dir(args) / "cpu_measured.md").read_text().splitlines()
    except OSError:
        return "environment: unknown."
    hit = next((ln for ln in lines if "nvironment: " in ln), "")
    return "environment: " + hit.split("nvironment: ", 1)[1] if hit else "environment: unknown."


def _previous_load(path) -> _Loaded | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    hit = next((ln for ln in lines if ln.startswith("Machine load: ")), None)
    return _Loaded(hit[len("Machine load: "):].rstrip(".")) if hit else None


def _prose(ok: list[dict], hw) -> list[str]:
    """Sentences computed from the data: where the model is off, by model and by component."""
    if not ok:
        return ["No plan was measured."]
    lines = []
    worst = max(ok, key=lambda r: r["rel_error"])
    lines.append(f"Worst plan: {worst['model']} {worst['mesh']} {worst['strategy']}, predicted "
                 f"{worst['predicted_ms']:.1f} ms, measured {worst['measured_ms']:.1f} ms "
                 f"({worst['rel_error']:.0%} off).")
    per = group_table(ok, lambda r: r["model"])
    over = [f"{g[0]} {g[4]:.2f}" for g in per]
    lines.append("Measured / predicted by model (median): " + ", ".join(over) + ".")
    gap = [(r["measured_ms"] - r["predicted_ms"], r["hlo_kernels"]) for r in ok
           if r["hlo_kernels"] > 0]
    if len(gap) >= 3:
        per_kernel = statistics.median(g / k for g, k in gap) * 1e3
        rho = spearman([g for g, _ in gap], [k for _, k in gap])
        lines.append(f"The time the model misses, measured - predicted, is {per_kernel:.0f} us "
                     f"per HLO kernel of the compiled step (median; the profile's in-program "
                     f"launch is {hw.kernel_launch_s * 1e6:.0f} us) and its rank correlation "
                     f"with the kernel count is {rho:.2f}.")
    noisy = sum(1 for r in ok if r["spread"] > 0.2)
    lines.append(f"{noisy} of {len(ok)} plans had an interquartile spread of their repeats "
                 f"above 20% of their median (load noise).")
    return [" ".join(lines)]


def _plot(rows, path, med_err, rho):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(9, 5.8))
    models = list(dict.fromkeys(r["model"] for r in rows))
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    markers = "osD^v<>"
    cmap = plt.get_cmap("tab10")
    for r in rows:
        ax.scatter(r["predicted_ms"], r["measured_ms"], color=cmap(models.index(r["model"]) % 10),
                   marker=markers[meshes.index(r["mesh"]) % len(markers)], s=40,
                   edgecolor="k", linewidth=0.4)
    vals = [v for r in rows for v in (r["predicted_ms"], r["measured_ms"])]
    if vals:
        lo, hi = min(vals) / 1.3, max(vals) * 1.3
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
        ax.fill_between([lo, hi], [lo / 1.15, hi / 1.15], [lo * 1.15, hi * 1.15], color="0.9",
                        label="within 15%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    for m in models:
        ax.scatter([], [], color=cmap(models.index(m) % 10), label=m)
    for m in meshes:
        ax.scatter([], [], color="w", edgecolor="k", marker=markers[meshes.index(m) % 7],
                   label=f"mesh {m}")
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(fmt)
        axis.set_minor_formatter(fmt)
    ax.tick_params(which="minor", labelsize=6)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms, median)")
    ax.set_title(f"8 CPU devices, {len(rows)} plans: median rel. error {med_err:.0%}, "
                 f"Spearman {rho:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
