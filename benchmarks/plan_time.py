"""Planning time of autopar on scanned and unrolled (HF-style) GPT models from 12 to 96 layers,
and the first call (trace, plan, compile) of small third-party encoder-decoders.

Depth table: each row runs in a fresh process (so its peak memory is its own and no trace cache
carries over) and calls ``ir.trace`` then ``autopar.api.plan_graph`` on abstract inputs
(``jax.ShapeDtypeStruct``: no memory) with ``hardware="h100"``; trace, problem build (rules,
costs, layer tying, hand-written starts) and ILP solve are timed apart, with the process's CPU
time and peak resident memory. Models at GPT-3 width (d_model 12288, 96 heads, seq 2048,
vocabulary 51200, bfloat16 compute) on 64 devices ``{data: 8, model: 8}``:

* ``HF GPT-2 unrolled``: transformers' Flax GPT-2 (its Python loop over ``h/0 .. h/L-1``), as a
  user would bring it, at 12, 48 and 96 layers;
* ``+ global-norm clip``: the same with ``optax.clip_by_global_norm`` before adamw, whose norm
  reads every layer's gradients;
* ``autopar GPT scan``: ``autopar.models.gpt`` with its layers in one ``nn.scan``;
* ``Equinox LM unrolled``: ``autopar.models.zoo.eqx_lm``, an Equinox decoder as Equinox teaches
  it (a list of blocks, one example at a time under ``jax.vmap``), width 4096, 32 heads,
  float32, at 12 and 48 layers (its attention and layer norm read NaN literals, which once cut
  its blocks apart, so it was planned unfolded);
* ``GPT-175B scan+remat``: the paper configuration (96 layers, 1 sequence per device);
* ``transformers Llama-7B``: transformers' Flax Llama at 7B shapes (32 unrolled layers, float32,
  seq 2048) at 0.5, 1 and 2 sequences per device under the H100's 80 GB, where memory is tight
  (at 2 it fits only with the memory decisions: the status names what was recomputed;
  meta-pytorch/autoparallel publishes about 52 s for Llama3-8B on 64 GPUs).

First-call table: ``@autopar.autoparallel`` on transformers' 2-layer, 64-wide Flax T5, BART,
Whisper and GPT-2 on the 8 CPU devices as a 2x4 mesh, from the call to the result (trace, plan,
compile, run), in a fresh process each, against ``jax.jit`` of the same step.

Writes ``benchmarks/results/plan_time.md`` and ``plan_time.csv``.

    python benchmarks/plan_time.py            # full sweep (~10 minutes on 2 idle cores)
    python benchmarks/plan_time.py --quick    # one small row
    python benchmarks/plan_time.py --only hf,first --repeat 1   # some rows, one process each
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)

HEADER = ("model", "layers", "mesh", "devices", "trace_s", "build_s", "solve_s", "total_s",
          "wall_s", "trace_cpu_s", "plan_cpu_s", "peak_mb", "status", "gap", "groups", "vars",
          "predicted step ms", "plan_s")
FIRST_HEADER = ("model", "mesh", "first_call_s", "trace_s", "plan_s", "compile_s", "cpu_s",
                "jit_first_call_s", "status", "gap")
MESH64 = {"data": 8, "model": 8}
# Global batch for the GPT-3-width depth rows: 2 sequences per data-parallel replica. The
# unrolled model has no remat, so with 2 sequences per *device* no plan fits 80 GB under the
# planner's (conservative) memory estimate at any depth; those rows plan under a lifted budget.
DEPTH_BATCH = 16
LIFTED_BUDGET = 1e13
REPEAT = 3          # fresh processes per depth row; the table shows each column's median
FIRST_REPEAT = 1    # first-call rows and the tracing floor: one fresh process each (minutes)
# time_limit_s (the whole call's wall-clock budget, tracing included): the 30 s the issue allows
# an unrolled model (a loaded machine traces 96 layers in over 10 s of it), 10 s for GPT-175B.
LIMIT_S = {"hf": 30.0, "clip": 30.0, "scan": 30.0, "175B": 10.0, "tiny": 2.0, "llama7b": 10.0,
           "eqx": 30.0}
FULL_LIMIT_S = 60.0   # deterministic seconds for the whole-ILP reference solve


# What ``--only`` selects: depth families, the whole-ILP reference solve of GPT-175B
# (``gap_lines``), jax's tracing floor (``floor_lines``) and the first-call table.
PARTS = ("hf", "clip", "scan", "eqx", "175B", "llama7b", "reference", "floor", "first")


def depth_rows(quick: bool, only=PARTS):
    """(label, family, layers, mesh, batch, budget)."""
    if quick:
        return [("GPT tiny scan", "tiny", 2, {"data": 8}, 16, None)]
    return [r for r in _all_depth_rows() if r[1] in only]


def _all_depth_rows():
    rows = []
    for layers in (12, 48, 96):
        rows.append(("HF GPT-2 unrolled, GPT-3 width", "hf", layers, MESH64, DEPTH_BATCH,
                     LIFTED_BUDGET))
    for layers in (12, 48, 96):     # the step most training runs take: a reduction over layers
        rows.append(("HF GPT-2 unrolled + global-norm clip, GPT-3 width", "clip", layers,
                     MESH64, DEPTH_BATCH, LIFTED_BUDGET))
    for layers in (12, 48, 96):
        rows.append(("autopar GPT scan, GPT-3 width", "scan", layers, MESH64, DEPTH_BATCH,
                     LIFTED_BUDGET))
    for layers in (12, 48):
        rows.append(("Equinox LM unrolled, width 4096", "eqx", layers, MESH64, DEPTH_BATCH,
                     LIFTED_BUDGET))
    rows.append(("GPT-175B scan+remat", "175B", 96, MESH64, 64, None))
    # 0.5, 1 and 2 sequences per device: 1 is memory-tight, 2 fits only with the memory
    # decisions (recomputation of the unrolled layers)
    for rows_ in (32, 64, 128):
        rows.append((f"transformers Llama-7B, {rows_} sequences", "llama7b", 32, MESH64, rows_,
                     None))
    return rows


def _abstract(family: str, layers: int, batch: int):
    import dataclasses

    import jax.numpy as jnp

    from autopar.models import gpt, hf

    if family == "llama7b":
        cfg = hf._transformers().LlamaConfig(
            hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32,
            num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
            max_position_embeddings=4096)
        return hf.abstract("llama", cfg, batch, seq=2048)
    if family == "eqx":
        from autopar.models import zoo

        step, params, opt, batch_ = zoo.eqx_lm(zoo.Config(
            vocab=51200, seq=2048, width=4096, heads=32, ff=16384, layers=layers, batch=batch),
            abstract=True)
        return (lambda state, b: step(*state, b)), (params, opt), batch_
    if family in ("hf", "clip"):
        cfg = hf.gpt2_config(layers=layers, width=12288, heads=96)
        return hf.abstract("gpt2", cfg, batch, seq=2048, dtype=jnp.bfloat16,
                           clip=1.0 if family == "clip" else None)
    if family == "175B":
        cfg = dataclasses.replace(gpt.GPT_CONFIGS["175B"], scan=True, remat=True,
                                  dtype=jnp.bfloat16)
    elif family == "tiny":
        cfg = gpt.GPTConfig(layers=layers, scan=True)
    else:
        cfg = dataclasses.replace(gpt.GPT_CONFIGS["175B"], layers=layers, scan=True)
    return gpt.abstract(cfg, batch)


def child_depth(spec: dict) -> dict:
    """One depth row, measured in this (fresh) process."""
    import resource

    import ir
    from autopar.api import plan_graph

    fn, state, batch = _abstract(spec["family"], spec["layers"], spec["batch"])
    t0, c0 = time.perf_counter(), time.process_time()
    graph = ir.trace(fn, state, batch)
    trace_s, c1 = time.perf_counter() - t0, time.process_time()
    t1 = time.perf_counter()
    p = plan_graph(graph, spec["mesh"], hardware="h100", memory_budget=spec["budget"],
                   time_limit_s=spec["time_limit_s"], trace_s=trace_s,
                   deterministic=spec.get("deterministic"))
    t2, c2 = time.perf_counter(), time.process_time()
    wall = t2 - t0
    s = p.solver
    return dict(trace_s=s.trace_s, build_s=s.build_s, solve_s=s.solve_s, wall_s=wall,
                plan_s=t2 - t1,
                trace_cpu_s=c1 - c0, plan_cpu_s=c2 - c1,
                peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                status=s.status + (f" ({s.candidates} cand.)" if s.candidates else "")
                + "".join(f", recomputed: {r.policy}" for r in p.recompute[:1])
                + (", offloaded" if p.offload else ""),
                gap=s.gap, groups=s.num_groups, vars=s.num_vars, step_ms=p.cost.step_time_s * 1e3,
                objective_s=p.cost.step_time_s - p.cost.dispatch_s)


def child_jaxpr(spec: dict) -> dict:
    """``jax.make_jaxpr`` of the step alone, in a fresh process: what jax itself spends tracing
    the user's Python (the floor under ``trace_s``), with Python's cycle collector paused as
    ``ir.trace`` runs it (``ir.collector``) or, with ``spec["collector"]``, on (jax's default)."""
    import contextlib

    import jax

    from ir import collector

    fn, state, batch = _abstract(spec["family"], spec["layers"], spec["batch"])
    t0 = time.perf_counter()
    with contextlib.nullcontext() if spec.get("collector") else collector.paused():
        jax.make_jaxpr(fn)(state, batch)
    return dict(jaxpr_s=time.perf_counter() - t0)


def child_full(spec: dict) -> dict:
    """The row planned over the whole ILP (no candidate restriction), deterministically with a
    longer limit: its best bound is a lower bound for every plan, so it prices the gap of the
    candidate plan."""
    import ir
    from autopar.api import plan_graph
    from autopar.planner import ilp

    ilp.FULL_MODEL_PAIRS = float("inf")
    graph = ir.trace(*_abstract(spec["family"], spec["layers"], spec["batch"]))
    p = plan_graph(graph, spec["mesh"], hardware="h100", memory_budget=spec["budget"],
                   time_limit_s=spec["time_limit_s"], deterministic=True)
    s = p.solver
    objective = p.cost.step_time_s - p.cost.dispatch_s
    bound = None if s.gap is None else objective * (1 - s.gap)
    return dict(status=s.status, objective_s=objective, bound_s=bound, solve_s=s.solve_s,
                vars=s.num_vars)


def child_first_call(spec: dict) -> dict:
    """First call of ``@autoparallel`` on a tiny HF model, against ``jax.jit``'s first call."""
    import jax
    import numpy as np

    import autopar
    from autopar.models import hf

    name = spec["name"]
    step, state, batch = hf.concrete(name, hf.tiny(name), 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharded = autopar.autoparallel(step, mesh=mesh, deterministic=spec.get("deterministic"))
    planned = []           # the wall time of the whole plan call inside the first call
    plan_graph = autopar.api.plan_graph

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return plan_graph(*args, **kw)
        finally:
            planned.append(time.perf_counter() - t)

    autopar.api.plan_graph = timed
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(sharded(state, batch))
    first, cpu = time.perf_counter() - t0, time.process_time() - c0
    autopar.api.plan_graph = plan_graph
    t0 = time.perf_counter()     # after autoparallel: jax's trace caches are warm for it
    jax.block_until_ready(jax.jit(step)(state, batch))
    jit_s = time.perf_counter() - t0
    s = sharded.plan.solver
    plan_s = sum(planned)
    return dict(first_call_s=first, trace_s=s.trace_s, plan_s=plan_s,
                compile_s=first - s.trace_s - plan_s, cpu_s=cpu, jit_first_call_s=jit_s,
                status=s.status + (f" ({s.candidates} cand.)" if s.candidates else ""),
                gap=s.gap)


def _in_child(kind: str, spec: dict, repeat: int = 1) -> dict:
    """Runs one row ``repeat`` times, each in a fresh process; numbers are the medians."""
    runs = []
    for _ in range(repeat):
        cmd = [sys.executable, __file__, "--child", kind, json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v)
            for k, v in runs[0].items()}


def run_depth(label, family, layers, mesh, batch, budget, repeat, deterministic=None) -> tuple:
    """(table row, the child's medians)."""
    time_limit_s = LIMIT_S[family]
    spec = dict(family=family, layers=layers, mesh=mesh, batch=batch, budget=budget,
                time_limit_s=time_limit_s, deterministic=deterministic)
    r = _in_child("depth", spec, repeat)
    return _depth_row(label, layers, mesh, r), r


def _depth_row(label, layers, mesh, r: dict) -> tuple:
    devices = 1
    for n in mesh.values():
        devices *= n
    if "error" in r:
        nan = float("nan")
        return (label, layers, _common.mesh_str(mesh), devices) + (nan,) * 8 + (
            f"error: {r['error']}", nan, 0, 0, nan, nan)
    total = r["trace_s"] + r["build_s"] + r["solve_s"]
    return (label, layers, _common.mesh_str(mesh), devices, r["trace_s"], r["build_s"],
            r["solve_s"], total, r["wall_s"], r["trace_cpu_s"], r["plan_cpu_s"], r["peak_mb"],
            r["status"], r["gap"], r["groups"], r["vars"], r["step_ms"], r["plan_s"])


def run_first_call(name: str, repeat: int, deterministic=None) -> tuple:
    r = _in_child("first", {"name": name, "deterministic": deterministic}, repeat)
    if "error" in r:
        nan = float("nan")
        return (name, "data2xmodel4") + (nan,) * 6 + (f"error: {r['error']}", nan)
    return (name, "data2xmodel4", r["first_call_s"], r["trace_s"], r["plan_s"], r["compile_s"],
            r["cpu_s"], r["jit_first_call_s"], r["status"], r["gap"])


def gap_lines(spec: tuple, r: dict) -> list[str]:
    """The candidate plan of ``spec``'s row against the whole ILP's bound (``child_full``)."""
    label, family, layers, mesh, batch, budget = spec
    if "error" in r:
        return []
    f = _in_child("full", dict(family=family, layers=layers, mesh=mesh, batch=batch,
                               budget=budget, time_limit_s=FULL_LIMIT_S))
    if "error" in f:
        return [f"- {label}: the whole-ILP reference solve failed: {f['error']}"]
    gap = (r["objective_s"] - f["bound_s"]) / r["objective_s"]
    ms = r["objective_s"] * 1e3
    return [f"- {label}, {layers} layers: the plan's objective is {ms:.1f} ms; the whole ILP "
            f"(no candidate restriction, {f['vars']} variables, "
            f"{FULL_LIMIT_S:g} deterministic s, {f['solve_s']:.0f} s wall) ends {f['status']} "
            f"with best plan {f['objective_s'] * 1e3:.1f} ms and lower bound "
            f"{f['bound_s'] * 1e3:.1f} ms: the plan is within {gap:.2%} of the optimum."]


def floor_lines(repeat: int) -> list[str]:
    """jax's own tracing of the unrolled model (``child_jaxpr``) at 12 and 96 layers."""
    got, gc_on = {}, {}
    for layers in (12, 96):
        for on, into in ((False, got), (True, gc_on)):
            r = _in_child("jaxpr", dict(family="hf", layers=layers, batch=DEPTH_BATCH,
                                        collector=on), repeat)
            if "error" in r:
                return [f"- jax.make_jaxpr alone failed: {r['error']}"]
            into[layers] = r["jaxpr_s"]
    return [f"- `jax.make_jaxpr` alone (no autopar) of the unrolled HF GPT-2 at GPT-3 width takes "
            f"{got[12]:.1f} s at 12 layers and {got[96]:.1f} s at 96 ({got[96] / got[12]:.1f}x) "
            f"with Python's cycle collector paused, as `ir.trace` runs it "
            f"({gc_on[12]:.1f} s and {gc_on[96]:.1f} s with it on, jax's default): jax runs the "
            f"Python loop once per layer, so time that includes tracing cannot stay flat in "
            f"depth."]


def _ratio_lines(rows) -> list[str]:
    """Depth ratios (96 vs 12 layers) of each model family, total and planner only."""
    out = []
    for label in dict.fromkeys(r[0] for r in rows):
        by = {r[1]: r for r in rows if r[0] == label and not str(r[12]).startswith("error")}
        if 12 in by and 96 in by:
            a, b = by[12], by[96]
            cpu_a, cpu_b = a[9] + a[10], b[9] + b[10]
            out.append(f"- {label}, 96 vs 12 layers: total {b[7] / a[7]:.2f}x "
                       f"({a[7]:.1f} s -> {b[7]:.1f} s); the whole plan call {b[17] / a[17]:.2f}x "
                       f"({a[17]:.2f} s -> {b[17]:.2f} s), of which build + solve "
                       f"{(b[5] + b[6]) / (a[5] + a[6]):.2f}x; CPU time {cpu_b / cpu_a:.2f}x "
                       f"({cpu_a:.1f} s -> {cpu_b:.1f} s), of which planning "
                       f"{b[10] / a[10]:.2f}x and tracing {b[9] / a[9]:.2f}x; decision groups "
                       f"{a[14]} -> {b[14]}, ILP variables {a[15]} -> {b[15]}.")
    return out


def write(out, rows, first_rows, notes, elapsed: float, repeat: int = REPEAT,
          cmd: str = "python benchmarks/plan_time.py") -> None:
    env = _common.environment()    # before any file is written: the stamp is the code's state
    _common.write_csv(out / "plan_time.csv", HEADER, rows)
    lines = [
        "# autopar planning time",
        "",
        f"Each row is the median of {repeat} fresh process(es), each timing `ir.trace` then",
        "`autopar.api.plan_graph(graph, mesh,",
        "hardware=\"h100\", time_limit_s=L)` on abstract inputs (nothing is allocated; the 64",
        "devices need not exist). L, the wall-clock budget of the call with tracing, is 30 s for",
        "the 12-96-layer rows and 10 s for GPT-175B. `trace_s`, `build_s` (rules, costs, layer",
        "tying, the "
        "hand-written starts' descents) and `solve_s` (CP-SAT) come from `plan.solver`;",
        "`total_s` is their sum, `plan_s` the wall time of the whole `plan_graph` call (build",
        "and solve, then the memory check of the solution and the Plan's assembly, which",
        "`total_s` leaves out), `wall_s` the wall time of trace + plan, `trace_cpu_s` and",
        "`plan_cpu_s` this process's CPU time while tracing and while planning (on a loaded",
        "machine wall time includes waiting for a core; CPU time does not) and `peak_mb` the",
        "process's peak resident memory. `status`",
        "says whether CP-SAT proved its plan optimal; `(N cand.)` means a large model was solved",
        "over the N best candidate strategies of each decision group (the start's, each",
        "hand-written start's and the cheapest given the start) and `gap` is then relative to",
        "the bound over those candidates.",
        "",
        "GPT-3 width: d_model 12288, 96 heads, seq 2048, vocabulary 51200, bfloat16 compute,",
        f"global batch {DEPTH_BATCH} sequences (2 per data replica) for the depth rows. The",
        "unrolled rows are transformers' Flax GPT-2 (no remat): under the planner's",
        "conservative memory estimate they fit no 80 GB budget at 48 or 96 layers, so the depth",
        "rows plan under a lifted budget (the ILP still carries its memory constraints).",
        "GPT-175B is the scanned, rematerialised paper model with 1 sequence per device under",
        "the H100's 80 GB (at 2 per device the memory model's smallest peak is 86 GiB: no plan).",
        "",
        _common.md_table(HEADER, rows),
        "",
        *_ratio_lines(rows),
        *notes,
        "",
        "## First call of small third-party models",
        "",
        "`@autopar.autoparallel(step, mesh=2x4 Mesh)` with default options on transformers'",
        "2-layer, 64-wide Flax models (tiny configs of `autopar.models.hf`, batch 8): the time",
        "of the first call (trace, plan, compile, run): `trace_s` as `plan.solver` reports",
        "it, `plan_s` the wall time of the whole plan call (`compile_s` is the rest;",
        f"{FIRST_REPEAT} fresh process each), against the first",
        "call of `jax.jit(step)` on one device",
        "made afterwards in the same process (so with jax's trace caches warm).",
        "T5 runs with `autopar.models.hf`'s stand-in for the `jnp.clip(a_max=...)` keywords its",
        "relative-position buckets use (this jax removed them).",
        "",
        _common.md_table(FIRST_HEADER, first_rows),
        "",
        f"Sweep wall time {elapsed:.0f} s. Environment: {env}.",
        "",
        f"Reproduce: `{cmd}` (`--quick` for one small row; `--only` picks parts of "
        f"{', '.join(PARTS)} and `--repeat` the processes per depth row).",
        "",
    ]
    (out / "plan_time.md").write_text("\n".join(lines))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        fn = {"depth": child_depth, "first": child_first_call, "jaxpr": child_jaxpr,
              "full": child_full}[argv[1]]
        print(json.dumps(fn(json.loads(argv[2]))))
        return None
    ap = _common.parser(__doc__)
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {', '.join(PARTS)} (default all)")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="fresh processes per depth row")
    ap.add_argument("--deterministic", action="store_true",
                    help="plan with deterministic=True: the wall clock cuts no stage, so a loaded "
                         "machine changes the times but not the plans")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= set(PARTS):
        ap.error(f"--only takes parts of {', '.join(PARTS)}, not {', '.join(only - set(PARTS))}")
    out = _common.out_dir(args)
    repeat = 1 if args.quick else args.repeat
    t_all = time.perf_counter()
    rows, notes = [], []
    if args.deterministic:
        notes.append("- Planned with `deterministic=True` (`--deterministic`): no stage stops on "
                     "the wall clock, so machine load lengthens the wall times but changes no "
                     "plan; CPU times and statuses are those of an unloaded run.")
    for spec in depth_rows(args.quick, only):
        r, medians = run_depth(*spec, repeat, args.deterministic or None)
        print("  " + "  ".join(_common._cell(x) for x in r), flush=True)
        rows.append(r)
        if spec[1] == "175B" and "reference" in only:
            notes += gap_lines(spec, medians)
    if not args.quick and "floor" in only:
        notes += floor_lines(FIRST_REPEAT)
    first_rows = []
    names = ("gpt2", "t5", "bart", "whisper") if "first" in only and not args.quick else ()
    for name in names:
        r = run_first_call(name, 1 if args.quick else FIRST_REPEAT, args.deterministic or None)
        print("  " + "  ".join(_common._cell(x) for x in r), flush=True)
        first_rows.append(r)
    elapsed = time.perf_counter() - t_all
    cmd = " ".join(["python benchmarks/plan_time.py", *(argv or [])])
    write(out, rows, first_rows, notes, elapsed, repeat, cmd)
    print(f"wrote {out / 'plan_time.md'} ({len(rows)} rows, {elapsed:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
