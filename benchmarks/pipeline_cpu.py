"""Pipeline schedules on CPU devices: measured step time, bubble and peak memory against prediction.

A scanned GPT is pipelined over two CPU devices (``{"stage": 2}``; this machine has two cores,
so the two stages really run side by side) with every schedule. For each:

* **actions**: the forward and the backward (recompute + vjp, as the runtime runs it) of one
  chunk on one microbatch, jitted alone on one device and timed (medians): first chunk (with
  the embedding), last (with the head and loss), and middle ones when there are;
* **predicted** step and bubble: the schedule's lockstep timeline (``schedules.price``) over
  those measured action times, devices dedicated; the bubble is ``1 - busy / (P x makespan)``;
* **measured** step: the median wall time of the pipelined step (one ``jax.jit``); the measured
  bubble is ``1 - busy / (P x measured step)`` with the same busy time (so it also counts the
  runtime's own overheads: switches, buffer copies, collective-permutes, the optimizer);
* **memory**: ``memory_analysis()`` of the compiled step (arguments + outputs + temporaries,
  per device) against the planner's predicted per-device peak of the busiest stage
  (``planning.price``; its working set comes from the intra-op ILP's sub-plans).

Writes ``benchmarks/results/pipeline_cpu.md`` and ``pipeline_cpu.csv``.

    python benchmarks/pipeline_cpu.py            # five schedules (a few minutes)
    python benchmarks/pipeline_cpu.py --quick    # one tiny configuration
"""
from __future__ import annotations

import statistics
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np

import cost_models
from autopar.models import gpt
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

HEADER = ("schedule", "virtual", "microbatches", "layers", "predicted_step_ms", "measured_step_ms",
          "step_ratio", "predicted_bubble", "measured_bubble", "predicted_peak_MiB",
          "measured_peak_MiB", "memory_ratio", "in_flight")


def _median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _action_times(model, params, micro, ranges, repeats: int) -> dict:
    """(kind, first?, last?, layers) -> seconds of one chunk's action on one microbatch, one
    device, for every distinct chunk of ``ranges``."""
    layers, rest = model.split(params)
    x = jax.eval_shape(model.embed, rest, micro)
    x = jnp.zeros(x.shape, x.dtype)
    out = {}
    for c, (a, b) in enumerate(ranges):
        first, last = c == 0, c == len(ranges) - 1
        if ("F", first, last, b - a) in out:
            continue
        p_v = jax.tree_util.tree_map(lambda t, a=a, b=b: t[a:b], layers)

        def f(p, r, h, first=first, last=last):
            h = model.embed(r, micro) if first else h
            h, _ = jax.lax.scan(lambda y, lp: (model.layer(lp, y), None), h, p)
            return h, (model.head_loss(r, h, micro) if last else jnp.zeros(()))

        def bwd(p, r, h, f=f):
            _, vjp = jax.vjp(f, p, r, h)
            return vjp((jnp.ones_like(x), jnp.ones(())))

        out[("F", first, last, b - a)] = _median_s(jax.jit(f), p_v, rest, x, repeats=repeats)
        out[("B", first, last, b - a)] = _median_s(jax.jit(bwd), p_v, rest, x, repeats=repeats)
    return out


def _measure(cfg, rows: int, name: str, virtual: int, m: int, repeats: int, ranges=None):
    step, init = PM.gpt_train_step(cfg)
    model = PM.staged_model_of(step)
    state, batch = init(jax.random.PRNGKey(0), rows), gpt.make_batch(cfg, rows)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    sch = S.build(name, 2, virtual, m)
    ranges = ranges or PL.equal_ranges(cfg.layers, sch.chunks)
    micro = jax.tree_util.tree_map(lambda a: a[: rows // m], batch)
    acts = _action_times(model, state["params"], micro, ranges, repeats)
    last = sch.chunks - 1
    timeline = S.price(sch, lambda a: acts[(a.kind, a.chunk == 0, a.chunk == last,
                                            ranges[a.chunk][1] - ranges[a.chunk][0])])
    pstep = R.build_step(model, mesh, sch, ranges=ranges)
    placed = tuple(jax.device_put(x, s) for x, s in zip((state, batch),
                                                        pstep.in_shardings_of(state, batch)))
    compiled = pstep.jitted(*placed).lower(*placed).compile()
    ma = compiled.memory_analysis()
    measured_peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes
                     + ma.temp_size_in_bytes - ma.alias_size_in_bytes)
    measured = _median_s(compiled, *placed, repeats=repeats)
    sizes = {"stage": 2}
    hw = cost_models.hardware("cpu")
    costs = PL.stage_costs(model, state["params"], batch, rows // m, sizes, "stage", hw)
    predicted = PL.price(model, state["params"], costs, sizes, "stage", hw, name, virtual, m,
                         ranges)
    busy = sum(timeline.busy_s)
    pred_mib, meas_mib = max(predicted.stage_memory_bytes) / 2**20, measured_peak / 2**20
    return (name, virtual, m, "+".join(str(b - a) for a, b in ranges),
            timeline.makespan_s * 1e3, measured * 1e3,
            measured / timeline.makespan_s, timeline.bubble_fraction, 1 - busy / (2 * measured),
            pred_mib, meas_mib, meas_mib / pred_mib, "/".join(map(str, S.in_flight(sch))))


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    out = _common.out_dir(args)
    t0 = time.perf_counter()
    if args.quick:
        cfg = gpt.GPTConfig(vocab=64, seq=16, d_model=32, heads=4, d_ff=64, layers=2, scan=True)
        rows, runs, repeats = 4, [("1f1b", 1, 2, None)], 3
    else:
        cfg = gpt.GPTConfig(vocab=256, seq=64, d_model=128, heads=4, d_ff=512, layers=4,
                            scan=True)
        rows, repeats = 16, 7
        runs = [("gpipe", 1, 4, None), ("1f1b", 1, 4, None), ("eager_1f1b", 1, 4, None),
                ("gpipe", 2, 4, None), ("1f1b", 2, 4, None), ("1f1b", 1, 8, None),
                ("1f1b", 1, 4, ((0, 3), (3, 4)))]
    rows_out = [_measure(cfg, rows, name, v, m, repeats, r) for name, v, m, r in runs]
    _common.write_csv(out / "pipeline_cpu.csv", HEADER, rows_out)
    text = [
        "# Pipeline schedules on 2 CPU devices: predicted vs measured", "",
        f"GPT (scan) {cfg.layers} layers, d_model {cfg.d_model}, seq {cfg.seq}, vocab "
        f"{cfg.vocab}, batch {rows} rows, mesh {{stage: 2}}; medians of {repeats} runs. "
        "Predicted step/bubble: the schedule's lockstep timeline over action times measured "
        "alone; measured bubble: 1 - (the same busy time) / (2 x measured step), so it also "
        "holds the runtime's overheads. Memory: memory_analysis() (arguments + outputs + "
        "temporaries - aliased) against the planner's predicted peak of the busiest stage. "
        "layers: the layers of each chunk; 3+1 runs unequal ranges, padded to the longest "
        "chunk (its predicted memory holds the padding and the layers moved to their stages; "
        "its predicted step, the timeline alone, does not hold those moves).", "",
        "Caveat: the devices are emulated on a shared 2-core machine. When its load exceeds its "
        "cores (see the environment line) the same configuration's step and action times vary "
        "up to 2x between runs, so the step and bubble columns are not conclusive there; the "
        "memory columns do not depend on load.", "",
        _common.md_table(HEADER, rows_out), "",
        f"Wall time {time.perf_counter() - t0:.0f} s. Environment: {_common.environment()}.", ""]
    (out / "pipeline_cpu.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
