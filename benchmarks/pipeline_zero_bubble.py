"""ZB-H1 and ZB-V against 1F1B on the MPMD runtime, on CPU devices: step, bubble, memory and
the split of the backward, predicted and measured.

A scanned GPT is pipelined over 2 and 4 CPU devices (``{"stage": P}``) at two microbatch counts.
For each, 1F1B (the backward one program), ZB-H1 (the backward split into its input half ``B``
and its weight half ``W``, ``autopar.pipeline.split``) and ZB-V (split too, two chunks per
stage in a V: ``schedules.placement``) run on the same state and batch:

* **predicted**: ``autopar.plan(..., pipeline={schedule, microbatches, runtime: "mpmd"})`` on
  the cpu profile: step, bubble and peak, the weight half's share of a backward
  (``Costs.weight_fraction``, by the halves' FLOPs). The profile's 8 devices share the host's
  compute (``shared_compute_devices``), so the timeline shares it among the stages busy at each
  moment (``schedules.price_async``'s ``pool``);
* **measured**: the step's median wall time over interleaved rounds (1F1B, ZB-H1, 1F1B, ...),
  in one process; the bubble inside the real step (``measured.measure_mpmd``: a profiler trace
  of the named stage programs, without Python calls, which slowed the controller); the peak
  by running the step one action at a time (``MpmdStep.measure_peak``); the weight half's
  share from the stage programs timed alone (``MpmdStep.action_times``: ``W / (B + W)`` per
  chunk, the 1F1B backward being ``B + W``'s work);
* **timeline over measured programs**: ``schedules.price_async`` over the programs timed alone
  and the controller's measured issuing cost per action, the bubble the schedule gives those
  times with each stage at its programs' alone speed (no sharing of the host: the programs
  timed alone do not fill it, so the pool they would share is not known).

The emulated devices share the host's 2 cores, so a stage's idle time is another's compute time:
the bubble ZB-H1 and ZB-V remove is not idle hardware here, and their measured steps show their
costs (a third program launch per microbatch and chunk, the frontier written and read back;
ZB-V twice the launches, of half the layers, and each step's copies of the chunks' layers to the
stages of the V). The gain on devices of their own is a prediction
(``benchmarks/megatron_table.py``).

    python benchmarks/pipeline_zero_bubble.py           # 4 configurations (~5 min on 2 cores)
    python benchmarks/pipeline_zero_bubble.py --quick   # one small configuration

Writes ``benchmarks/results/pipeline_zero_bubble.md`` and ``pipeline_zero_bubble.csv``.
"""
from __future__ import annotations

import statistics
import time

import _common
import jax
from pipeline_mpmd import _issue_s, _mesh

import autopar
from autopar.models import gpt
from autopar.pipeline import measured
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import schedules as S

SCHEDULES = ("1f1b", "zb_h1", "zb_v")


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    if args.quick:
        cfg = gpt.GPTConfig(vocab=64, seq=16, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
        configs, rounds, rows_n = [(2, 2)], 2, 8
    else:
        cfg = gpt.GPTConfig(vocab=256, seq=64, d_model=128, heads=4, d_ff=512, layers=8,
                            scan=True)
        configs, rounds, rows_n = [(2, 2), (2, 8), (4, 4), (4, 16)], 9, 32
    step, init = PM.gpt_train_step(cfg)
    state, batch = init(jax.random.PRNGKey(0), rows_n), gpt.make_batch(cfg, rows_n)
    rows, t_start = [], time.perf_counter()
    for p, m in configs:
        runs, plans = {}, {}
        for name in SCHEDULES:
            plans[name] = autopar.plan(step, state, batch, mesh={"stage": p}, hardware="cpu",
                                       pipeline={"schedule": name, "microbatches": m,
                                                 "runtime": "mpmd"}, time_limit_s=5.0)
            runs[name] = PL.executable(plans[name], step, _mesh(p))
            jax.block_until_ready(runs[name](state, batch))        # build and warm up
        times = {name: [] for name in SCHEDULES}
        for _ in range(rounds):
            for name in SCHEDULES:
                t0 = time.perf_counter()
                jax.block_until_ready(runs[name](state, batch))
                times[name].append(time.perf_counter() - t0)
        for name in SCHEDULES:
            pp, run = plans[name], runs[name]
            acts = run.action_times(state, batch, runs=3)
            sch = S.build(name, p, S.default_virtual(name), m)
            alone = _timeline(sch, acts, _issue_s(run, state, batch))
            meas = measured.measure_mpmd(run, state, batch)
            w_meas = (statistics.median(acts[("W", c)] / (acts[("B", c)] + acts[("W", c)])
                                        for c in range(sch.chunks))
                      if name in S.SPLIT else float("nan"))
            costs_w = _weight_fraction(step, state, batch, m) if name in S.SPLIT \
                else float("nan")
            peak = run.measure_peak(state, batch) if not args.quick else float("nan")
            pp = pp.pipeline
            rows.append(dict(
                stages=p, microbatches=m, schedule=name,
                predicted_ms=pp.step_time_s * 1e3,
                measured_ms=statistics.median(times[name]) * 1e3,
                predicted_bubble=pp.bubble_fraction, timeline_bubble=alone.bubble_fraction,
                measured_bubble=meas.bubble_fraction,
                predicted_peak_mib=max(pp.stage_memory_bytes) / 2**20,
                measured_peak_mib=peak / 2**20,
                predicted_w_share=costs_w, measured_w_share=w_meas))
            r = rows[-1]
            print(f"P={p} M={m} {name}: pred {r['predicted_ms']:.1f} ms meas "
                  f"{r['measured_ms']:.1f} ms, bubble pred {r['predicted_bubble']:.3f} "
                  f"timeline {r['timeline_bubble']:.3f} meas {r['measured_bubble']:.3f}",
                  flush=True)
    _write(args, cfg, rows, rounds, rows_n, time.perf_counter() - t_start)


def _timeline(sch: S.Schedule, acts: dict, issue_s: float) -> S.Timeline:
    """``sch`` priced asynchronously over its programs timed alone, per chunk (the last
    chunk's forward does nothing on this runtime)."""
    last = sch.chunks - 1
    return S.price_async(sch, lambda a: 0.0 if a.kind == "F" and a.chunk == last
                         else acts[(a.kind, a.chunk)], issue_s=issue_s)


def _weight_fraction(step, state, batch, m: int) -> float:
    """The planner's ``Costs.weight_fraction`` for a microbatch of this configuration."""
    model = PM.staged_model_of(step)
    layers, rest = model.split(state["params"])
    layer = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0] // m
    mb = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype),
                                batch)
    x = jax.eval_shape(model.embed, rest, mb)
    return PL.layer_halves(model, layer, x).weight_fraction


def _write(args, cfg, rows, rounds, rows_n, wall_s) -> None:
    header = ["stages", "microbatches", "schedule", "predicted_ms", "measured_ms",
              "predicted_bubble", "timeline_bubble", "measured_bubble", "predicted_peak_mib",
              "measured_peak_mib", "predicted_w_share", "measured_w_share"]
    _common.write_csv(_common.out_dir(args) / "pipeline_zero_bubble.csv", header,
                      [[r[h] for h in header] for r in rows])
    pairs = []
    by = {(r["stages"], r["microbatches"], r["schedule"]): r for r in rows}
    for (p, m, name), zb in by.items():
        if name == "1f1b":
            continue
        one = by[(p, m, "1f1b")]
        pairs.append([p, m, name,
                      zb["predicted_ms"] / one["predicted_ms"],
                      zb["measured_ms"] / one["measured_ms"],
                      one["predicted_bubble"] - zb["predicted_bubble"],
                      one["timeline_bubble"] - zb["timeline_bubble"],
                      one["measured_bubble"] - zb["measured_bubble"]])
    peaks = [r["predicted_peak_mib"] / r["measured_peak_mib"] for r in rows
             if r["measured_peak_mib"] == r["measured_peak_mib"]]
    gaps = [abs(r["predicted_bubble"] - r["measured_bubble"]) for r in rows]
    close = [f"P={r['stages']} M={r['microbatches']} {r['schedule']}" for r, g in zip(rows, gaps)
             if g <= 0.05]
    steps = [r["predicted_ms"] / r["measured_ms"] for r in rows]
    text = "\n".join([
        "# ZB-H1 and ZB-V against 1F1B on the MPMD runtime, CPU devices",
        "",
        _common.environment(),
        "",
        f"`python benchmarks/pipeline_zero_bubble.py{' --quick' if args.quick else ''}`: GPT "
        f"d_model={cfg.d_model}, layers={cfg.layers}, seq={cfg.seq}, batch {rows_n}, "
        f"{{stage: P}} on P CPU devices, medians of {rounds} interleaved rounds; "
        f"{wall_s:.0f} s.",
        "",
        _common.md_table(["P", "M", "schedule", "predicted ms", "measured ms",
                          "predicted bubble", "timeline over measured programs",
                          "measured bubble", "predicted peak MiB", "measured peak MiB",
                          "predicted W share", "measured W share"],
                         [[r[h] for h in header] for r in rows]),
        "",
        "Each zero-bubble schedule against 1F1B, same configuration (step: below 1, the "
        "zero-bubble one faster; bubble: 1F1B's minus its):",
        "",
        _common.md_table(["P", "M", "schedule", "predicted step ZB / 1F1B",
                          "measured step ZB / 1F1B",
                          "predicted bubble gain", "timeline bubble gain",
                          "measured bubble gain"], pairs),
        "",
        (f"Predicted / measured peak: {min(peaks):.3f}-{max(peaks):.3f}." if peaks else
         "Peaks are not measured in --quick mode."),
        f"Predicted bubble within 0.05 of the measured one on {len(close)} of {len(rows)} rows"
        f"{' (' + ', '.join(close) + ')' if close else ''}; |predicted - measured| median "
        f"{statistics.median(gaps):.3f}, at most {max(gaps):.3f}. Predicted / measured step: "
        f"{min(steps):.2f}-{max(steps):.2f} (median {statistics.median(steps):.2f}).",
        "The W share is the weight half's part of a recomputing backward's time (W / (B + W) "
        "of the programs timed alone); the prediction counts the halves' dot FLOPs.",
        "",
        "On 2 shared cores a stage's idle time is another stage's compute time, so the bubble "
        "ZB-H1 and ZB-V remove is not idle hardware here; the measured step shows what "
        "splitting (and, for ZB-V, twice the program launches and the copies of the chunks' "
        "layers to the V's stages) costs. The bubble (predicted and measured) counts a stage "
        "busy while its program is in flight, slowed by the others sharing the host or not; "
        "the host's load from other work, which the prediction cannot see, slows the Python "
        "controller and the programs alike.",
        "",
    ])
    _common.write_md(args, "pipeline_zero_bubble.md", text)


if __name__ == "__main__":
    main()
