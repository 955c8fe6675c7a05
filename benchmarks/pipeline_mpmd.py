"""The two pipeline runtimes side by side on CPU devices: lockstep (one SPMD program of ticks)
against MPMD (each stage its own programs, issued asynchronously), predicted and measured.

A scanned GPT is pipelined over 2 and 4 CPU devices (``{"stage": P}``) under 1F1B, eager 1F1B
and GPipe at two microbatch counts. For each configuration both runtimes run the same schedule
on the same state and batch:

* **predicted**: ``autopar.plan(..., pipeline={schedule, microbatches, runtime})`` on the cpu
  profile, the planner's own figures (stage costs from its sub-plans; the lockstep tick loop,
  or the asynchronous timeline with the profile's ``pipeline_issue_s`` per action; both share
  the host's compute among the busy stages, ``planning.compute_pool``), and their ratio, MPMD
  over lockstep, against the measured one: what ``pipeline="auto"`` compares;
* **measured**: the step's median wall time over interleaved rounds (lockstep, MPMD, lockstep,
  ...), both warmed up first, in one process;
* **issue**: the MPMD controller's host time per action (the issuing loop's wall time, without
  waiting for the devices, over its actions), which calibrates the cpu profile's
  ``pipeline_issue_s``;
* **bubble** of the MPMD step, measured inside the real step: ``jax.profiler`` traces of three
  steps, read by ``autopar.pipeline.measured.measure_mpmd`` (per device the union of its stage
  programs' launches against the step's makespan). Its prediction is
  ``schedules.price_async`` over the stage programs' times run alone
  (``MpmdStep.action_times``) and the measured issuing cost, hops between stages taken as
  free (a CPU copy of one microbatch's activation).

The emulated devices share the host's 2 cores, so a stage idling in the lockstep runtime frees a
core for another stage: the bubble the asynchronous runtime removes is not idle hardware here,
and this machine cannot show its gain, only its costs (issuing every action from Python, a
program launch per action, copies between submeshes). The comparison that matters, the
bubble on devices of their own, is a prediction (``benchmarks/megatron_table.py``) until a GPU
run measures it.

    python benchmarks/pipeline_mpmd.py           # 12 configurations (6-8 min on 2 cores)
    python benchmarks/pipeline_mpmd.py --quick   # one small configuration

Writes ``benchmarks/results/pipeline_mpmd.md`` and ``pipeline_mpmd.csv``.
"""
from __future__ import annotations

import statistics
import time

import _common
import jax
import numpy as np

import autopar
from autopar.models import gpt
from autopar.pipeline import measured
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import schedules as S

RUNTIMES = ("lockstep", "mpmd")


def _mesh(p: int):
    return jax.sharding.Mesh(np.array(jax.devices()[:p]), ("stage",))


def _issue_s(run, state, batch) -> float:
    """Host seconds per action of the MPMD issuing loop (not waiting for the devices)."""
    st, bt = run.in_shardings_of(state, batch)
    state, batch = jax.device_put(state, st), jax.device_put(batch, bt)
    jax.block_until_ready((state, batch))
    per = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = run.runner.loss_and_grads(state["params"], batch)
        per.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return statistics.median(per) / len(S.dispatch_order(run.runner.sch))


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    if args.quick:
        cfg = gpt.GPTConfig(vocab=64, seq=16, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
        configs, rounds = [(2, "1f1b", 2)], 2
        traced = {(2, "1f1b", 2)}
    else:
        cfg = gpt.GPTConfig(vocab=256, seq=64, d_model=128, heads=4, d_ff=512, layers=8,
                            scan=True)
        configs = [(p, name, m) for p in (2, 4) for name in ("1f1b", "eager_1f1b", "gpipe")
                   for m in (p, 4 * p)]
        rounds = 9
    traced = {(2, "1f1b", 8), (2, "gpipe", 8), (4, "1f1b", 16), (4, "eager_1f1b", 16),
              (2, "1f1b", 2)}
    step, init = PM.gpt_train_step(cfg)
    state, batch = init(jax.random.PRNGKey(0), rows_n(args)), gpt.make_batch(cfg, rows_n(args))
    rows, bubbles, t_start, load = [], [], time.perf_counter(), _common.machine_load()
    for p, name, m in configs:
        mesh = {"stage": p}
        runs, plans = {}, {}
        for rt in RUNTIMES:
            plans[rt] = autopar.plan(step, state, batch, mesh=mesh, hardware="cpu",
                                     pipeline={"schedule": name, "microbatches": m,
                                               "virtual_stages": 1, "layer_ranges": "equal",
                                               "runtime": rt}, time_limit_s=5.0)
            runs[rt] = PL.executable(plans[rt], step, _mesh(p))
            jax.block_until_ready(runs[rt](state, batch))          # build and warm up
        times = {rt: [] for rt in RUNTIMES}
        for _ in range(rounds):
            for rt in RUNTIMES:
                t0 = time.perf_counter()
                jax.block_until_ready(runs[rt](state, batch))
                times[rt].append(time.perf_counter() - t0)
        issue = _issue_s(runs["mpmd"], state, batch)
        for rt in RUNTIMES:
            pp = plans[rt].pipeline
            meas = statistics.median(times[rt])
            rows.append(dict(stages=p, schedule=name, microbatches=m, runtime=rt,
                             predicted_ms=pp.step_time_s * 1e3, measured_ms=meas * 1e3,
                             pred_over_meas=pp.step_time_s / meas,
                             predicted_bubble=pp.bubble_fraction,
                             issue_ms=issue * 1e3 if rt == "mpmd" else float("nan")))
        if (p, name, m) in traced:
            bubbles.append(_bubble(runs["mpmd"], state, batch, p, name, m, issue))
        print(f"P={p} {name} M={m}: " + ", ".join(
            f"{r['runtime']} pred {r['predicted_ms']:.1f} ms meas {r['measured_ms']:.1f} ms"
            for r in rows[-2:]), flush=True)
    _write(args, cfg, rows, bubbles, rounds, time.perf_counter() - t_start, load)


def _bubble(run, state, batch, p: int, name: str, m: int, issue: float) -> list:
    """[P, schedule, M, predicted bubble, measured bubble, predicted makespan ms, measured
    makespan ms]: the measured from a trace, the predicted from the programs timed alone."""
    sch = S.build(name, p, 1, m)
    times = run.action_times(state, batch, runs=5 if m > 2 else 3)
    last = sch.chunks - 1
    pred = S.price_async(sch, lambda a: 0.0 if a.kind == "F" and a.chunk == last
                         else times[(a.kind, sch.stage_of(a.chunk))], issue_s=issue)
    meas = measured.measure_mpmd(run, state, batch)
    return [p, name, m, pred.bubble_fraction, meas.bubble_fraction,
            pred.makespan_s * 1e3, meas.loop_s[0] * 1e3]


def _span(xs) -> str:
    """``lo-hi (median m)`` of ``xs``."""
    return f"{min(xs):.2f}-{max(xs):.2f} (median {statistics.median(xs):.2f})"


def rows_n(args) -> int:
    return 8 if args.quick else 32


def _write(args, cfg, rows, bubbles, rounds, wall_s, load: str) -> None:
    header = ["stages", "schedule", "microbatches", "runtime", "predicted_ms", "measured_ms",
              "pred_over_meas", "predicted_bubble", "issue_ms"]
    _common.write_csv(_common.out_dir(args) / "pipeline_mpmd.csv", header,
                      [[r[h] for h in header] for r in rows])
    pairs = []
    for i in range(0, len(rows), 2):
        lock, mp = rows[i], rows[i + 1]
        pairs.append([lock["stages"], lock["schedule"], lock["microbatches"],
                      mp["predicted_ms"] / lock["predicted_ms"],
                      mp["measured_ms"] / lock["measured_ms"], mp["issue_ms"]])
    issue = statistics.median(r["issue_ms"] for r in rows if r["runtime"] == "mpmd")
    errors = {rt: statistics.median(abs(r["pred_over_meas"] - 1) for r in rows
                                    if r["runtime"] == rt) for rt in RUNTIMES}
    text = "\n".join([
        "# Pipeline runtimes on CPU devices: lockstep against MPMD",
        "",
        _common.environment(),
        "",
        f"`python benchmarks/pipeline_mpmd.py{' --quick' if args.quick else ''}`: GPT "
        f"d_model={cfg.d_model}, layers={cfg.layers}, seq={cfg.seq}, "
        f"batch {rows_n(args)}, {{stage: P}} on P CPU devices, "
        f"medians of {rounds} interleaved rounds; {wall_s:.0f} s ({load} at the start, "
        f"the stamp above is at the end).",
        "",
        _common.md_table(["P", "schedule", "M", "runtime", "predicted ms", "measured ms",
                          "pred / meas", "predicted bubble", "issue ms / action"],
                         [[r[h] for h in header] for r in rows]),
        "",
        "MPMD against lockstep, same configuration (below 1: MPMD faster):",
        "",
        _common.md_table(["P", "schedule", "M", "predicted MPMD / lockstep",
                          "measured MPMD / lockstep", "issue ms / action"], pairs),
        "",
        f"MPMD / lockstep predicted {_span([r[3] for r in pairs])}, measured "
        f"{_span([r[4] for r in pairs])}; predicted over measured ratio "
        f"{_span([r[3] / r[4] for r in pairs])}.",
        "",
        "The MPMD step's bubble inside the real step (three traced steps, medians) against "
        "the asynchronous timeline over its programs timed alone:",
        "",
        _common.md_table(["P", "schedule", "M", "predicted bubble", "measured bubble",
                          "predicted makespan ms", "measured makespan ms"], bubbles),
        "",
        f"Bubble |predicted - measured|: median "
        f"{statistics.median(abs(b[3] - b[4]) for b in bubbles):.3f}, at most "
        f"{max(abs(b[3] - b[4]) for b in bubbles):.3f}. The measured busy time is the union of "
        "the stage programs' launches on each device (a launch from its first instruction to "
        "its last, as a program timed alone counts it).",
        "",
        f"Median |predicted / measured - 1|: lockstep {errors['lockstep']:.2f}, MPMD "
        f"{errors['mpmd']:.2f}. Median issuing cost {issue:.2f} ms an action (the cpu "
        f"profile's pipeline_issue_s).",
        "",
        "On 2 shared cores a lockstep stage's idle time is another stage's compute time, so the "
        "bubble MPMD removes is not idle hardware here; these rows measure what MPMD costs "
        "(issuing, launches, copies between submeshes) and whether the planner prices it.",
        "",
    ])
    _common.write_md(args, "pipeline_mpmd.md", text)


if __name__ == "__main__":
    main()
