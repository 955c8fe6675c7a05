"""Pipeline schedules on CPU devices: measured step time, bubble and peak memory against prediction.

A scanned GPT is pipelined over two CPU devices (``{"stage": 2}``) with every schedule. The
emulated devices share the host's cores: whether the two stages really run side by side is
measured (``parallel``; on the shared 2-core machine they took turns, parallel ~1). For each:

* **actions**: the forward and the backward (recompute + vjp, as the runtime runs it) of one
  chunk on one microbatch, jitted alone on one device and timed (medians): first chunk (with
  the embedding), last (with the head and loss), and middle ones when there are;
* **calibration** (a separate staged model whose actions do next to nothing, never the
  configurations below): the slope of its step time over the schedule's ticks, fitted as
  ``pipeline_tick_s + copies x carry / hbm_bytes_per_s`` (the fixed cost of a tick and the
  copies of the state it threads through its switches); the cpu profile's ``pipeline_tick_s``
  comes from such a run;
* **parallel**: how many stages this machine runs side by side at the speed of an action timed
  alone (one matmul chain on one device against the same on both at once, in the same rounds);
* **predicted** step and bubble: ``planning.loop_timeline`` over the measured action times
  (each tick at least its stages' summed work / parallel, plus ``planning.tick_overhead_s``)
  plus ``planning.after_loop_s``; ``timeline_only``: the bare timeline, the earlier prediction;
* **measured** step: the median wall time of the pipelined step (one ``jax.jit``);
* **bubble**, measured inside the real step: the same rounds (actions and step) run again under
  ``jax.profiler``; ``autopar.pipeline.measured`` reads the trace (XLA:CPU records every HLO
  instruction it executes with its device) and takes per device the tick loop's wall time
  (first to last instruction of the loop) and its busy time (the union of the instructions
  inside the forward and backward branches of the action switches; not the tick's own work,
  the collective-permutes' waits or idle time); ``1 - sum busy / sum loop``. The prediction
  is ``planning.loop_timeline``'s ``1 - sum busy / (P T)`` over the action times timed alone
  in that same traced window (so tracing costs and load touch both sides alike);
* **memory**: ``memory_analysis()`` of the compiled step (arguments + outputs + temporaries,
  per device) against the planner's predicted per-device peak of the busiest stage
  (``planning.price``: ``stage_bytes``).

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
from autopar import hlo
from autopar.models import gpt
from autopar.pipeline import measured as MP
from autopar.pipeline import model as PM
from autopar.pipeline import planning as PL
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

PADDED: list[str] = []    # the padded slots' report lines, filled in by _measure

HEADER = ("schedule", "virtual", "microbatches", "layers", "ticks", "parallel",
          "timeline_only_ms", "predicted_step_ms", "measured_step_ms", "step_ratio",
          "predicted_loop_ms", "traced_loop_ms", "busy_ratio", "predicted_bubble",
          "measured_bubble", "stage_bubbles", "trace_cost", "predicted_peak_MiB",
          "measured_peak_MiB", "memory_ratio", "in_flight")


def _interleaved_medians(calls: dict, rounds: int) -> dict:
    """name -> median seconds of ``calls[name] = (fn, args)``, timed in ``rounds`` rounds that
    each call every one once (so a change of the machine's load touches them all alike)."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict = {k: [] for k in calls}
    for _ in range(rounds):
        for k, (fn, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _action_calls(model, params, micro, ranges) -> dict:
    """(kind, first?, last?, layers) -> (jitted fn, args): one chunk's action on one
    microbatch, one device, for every distinct chunk of ``ranges``."""
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

        out[("F", first, last, b - a)] = (jax.jit(f), (p_v, rest, x))
        out[("B", first, last, b - a)] = (jax.jit(bwd), (p_v, rest, x))
    return out


def _padded_calls(model, params, micro, ranges) -> dict:
    """("Fpad" / "Bpad", first?, last?, layers) -> (jitted fn, args): a chunk shorter than the
    longest as the runtime runs it (``runtime.Actions``): its slots padded to the longest chunk
    with the last layer repeated, each slot a ``lax.cond`` on whether it is a layer, and the
    backward's gradients added into ``(1, Lmax)`` accumulators. Against the same chunk's
    unpadded action it measures what ``planning.padded_slot_s`` predicts."""
    layers, rest = model.split(params)
    x = jax.eval_shape(model.embed, rest, micro)
    x = jnp.zeros(x.shape, x.dtype)
    longest = max(b - a for a, b in ranges)
    out = {}
    for c, (a, b) in enumerate(ranges):
        first, last = c == 0, c == len(ranges) - 1
        if b - a == longest or ("Fpad", first, last, b - a) in out:
            continue
        index = np.minimum(np.arange(a, a + longest), b - 1)
        p_v = jax.tree_util.tree_map(lambda t, i=index: t[i], layers)
        valid = jnp.arange(longest) < b - a

        def layer(y, lp_ok):
            lp, ok = lp_ok
            return jax.lax.cond(ok, model.layer, lambda _, h: h, lp, y), None

        def f(p, r, h, first=first, last=last, valid=valid):
            h = model.embed(r, micro) if first else h
            h, _ = jax.lax.scan(layer, h, (p, valid))
            return h, (model.head_loss(r, h, micro) if last else jnp.zeros(()))

        def bwd(p, r, h, acc, f=f):
            _, vjp = jax.vjp(f, p, r, h)
            dp, dr, dh = vjp((jnp.ones_like(x), jnp.ones(())))
            return jax.tree_util.tree_map(lambda g, d: g.at[0].add(d), acc, dp), dr, dh

        acc = jax.tree_util.tree_map(lambda t: jnp.zeros((1, *t.shape), t.dtype), p_v)
        out[("Fpad", first, last, b - a)] = (jax.jit(f), (p_v, rest, x))
        out[("Bpad", first, last, b - a)] = (jax.jit(bwd), (p_v, rest, x, acc))
    return out


def _padded_text(model, params, ranges, t: dict) -> list[str]:
    """The padded slots' measured seconds against ``planning.padded_slot_s``."""
    longest = max(b - a for a, b in ranges)
    hw = cost_models.hardware("cpu")
    layer_bytes, _ = PL._param_bytes(model, params, {"stage": 2})
    slot = PL.padded_slot_s(hw, layer_bytes)
    lines = []
    for key in sorted(k for k in t if isinstance(k, tuple) and k[0] == "Fpad"):
        _, first, last, n = key
        for kind in ("F", "B"):
            meas = (t[(kind + "pad", first, last, n)] - t[(kind, first, last, n)]) / (longest - n)
            lines.append(f"* {n}-layer chunk padded to {longest}, {kind}: per padded slot "
                         f"predicted {slot[kind] * 1e3:.3f} ms ({PL.PADDED_SLOT_PASSES[kind]} "
                         f"passes over a layer's {layer_bytes / 2**20:.2f} MiB of parameters at "
                         f"the cpu profile's {hw.hbm_bytes_per_s / 1e9:.2f} GB/s), measured "
                         f"{meas * 1e3:.3f} ms (the padded action's median minus the unpadded "
                         "one's, over the padded slots)")
    return lines


# ---- the per-tick calibration (a separate model: never the plans evaluated below) ------------
def _tick_model(width: int):
    """A staged model whose actions do next to nothing: layer ``x * a + big[0]``, where the
    dummy parameter ``big`` (``width`` floats per layer) only sizes the gradient accumulators
    every tick carries."""
    import optax

    def layer(p, x):
        return x * p["a"] + p["big"][0]

    model = PM.StagedModel(lambda r, b: b["x"] * r["w"], layer,
                           lambda r, x, b: jnp.mean(x * r["w"]), "layers", 2, optax.sgd(0.0))
    params = {"w": jnp.ones((8,)), "layers": {"a": jnp.ones((2, 8)),
                                              "big": jnp.zeros((2, width))}}
    return model, {"params": params, "opt_state": model.tx.init(params)}


def _calibration_runs(mesh, widths, counts, rounds: int):
    """Step seconds (medians over ``rounds`` interleaved rounds) of the tick model per (width,
    schedule, microbatches), with its tick count and per-stage carry bytes."""
    runs = []
    for width in widths:
        for name in ("gpipe", "1f1b"):
            for m in counts:
                model, state = _tick_model(width)
                sch = S.build(name, 2, 1, m)
                step = R.build_step(model, mesh, sch)
                batch = {"x": jnp.ones((m, 4, 8))}
                placed = tuple(jax.device_put(x, s) for x, s in zip(
                    (state, batch), step.in_shardings_of(state, batch)))
                fn = step.jitted(*placed)
                jax.block_until_ready(fn(*placed))
                carry = PL.tick_carry_bytes(sch, 4 * (width + 8), 1, 8.0 * 4, 4 * 8 * 4)
                runs.append(dict(width=width, name=name, m=m, ticks=len(sch.ticks),
                                 carry=carry, fn=fn, args=placed, times=[]))
    for _ in range(rounds):
        for r in runs:
            t0 = time.perf_counter()
            jax.block_until_ready(r["fn"](*r["args"]))
            r["times"].append(time.perf_counter() - t0)
    return [(r["width"], r["name"], r["m"], r["ticks"], r["carry"],
             statistics.median(r["times"])) for r in runs]


def calibrate(mesh, widths=(8, 100_000, 400_000), counts=(4, 16), rounds: int = 9):
    """(fixed seconds per tick, passes over the carry per tick, the runs): per (width,
    schedule), the slope of step time over ticks between the two microbatch counts (the
    step's fixed costs cancel), fitted by least squares as ``tick_s + passes x carry /
    hbm_bytes_per_s``."""
    runs = _calibration_runs(mesh, widths, counts, rounds)
    hw = cost_models.hardware("cpu")
    xs, ys = [], []
    for (*_, t0, c0, s0), (*_, t1, c1, s1) in zip(runs[::2], runs[1::2]):
        xs.append((c0 + c1) / 2 / hw.hbm_bytes_per_s)
        ys.append((s1 - s0) / (t1 - t0))
    (passes, tick_s), *_ = np.linalg.lstsq(np.stack([xs, np.ones(len(xs))], 1), np.array(ys),
                                           rcond=None)
    return float(tick_s), float(passes), runs, ys


def _parallel_calls(mesh) -> dict:
    """The same matmul chain on one device alone and on both devices at once (a separate
    workload): ``2 x alone / pair`` is how many stages this machine runs side by side at the
    speed an action timed alone has."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def work(x, w):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    w = jnp.full((512, 512), 1e-3)
    pair = jax.shard_map(lambda x, w: work(x[0], w)[None], mesh=mesh,
                         in_specs=(P("stage"), P()), out_specs=P("stage"))
    both = jax.device_put(jnp.ones((2, 256, 512)), NamedSharding(mesh, P("stage")))
    return {"alone": (jax.jit(work), (jnp.ones((256, 512)), w)),
            "pair": (jax.jit(pair), (both, w))}


def _compiled_step(cfg, rows: int, name: str, virtual: int, m: int, ranges):
    step, init = PM.gpt_train_step(cfg)
    model = PM.staged_model_of(step)
    state, batch = init(jax.random.PRNGKey(0), rows), gpt.make_batch(cfg, rows)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    sch = S.build(name, 2, virtual, m)
    ranges = ranges or PL.equal_ranges(cfg.layers, sch.chunks)
    pstep = R.build_step(model, mesh, sch, ranges=ranges)
    placed = tuple(jax.device_put(x, s) for x, s in zip((state, batch),
                                                        pstep.in_shardings_of(state, batch)))
    compiled = pstep.jitted(*placed).lower(*placed).compile()
    return model, state, batch, mesh, sch, ranges, placed, compiled


def _timeline(model, params, sch, ranges, t: dict, act_bytes: float, cores: float):
    """planning.loop_timeline over the action times ``t`` (and the bare timeline)."""
    last = sch.chunks - 1

    def duration(a):
        return t[(a.kind, a.chunk == 0, a.chunk == last, ranges[a.chunk][1] - ranges[a.chunk][0])]

    return (S.price(sch, duration),
            PL.loop_timeline(model, params, {"stage": 2}, "stage", cost_models.hardware("cpu"),
                             sch, ranges, duration, act_bytes, cores))


def _measure(cfg, rows: int, name: str, virtual: int, m: int, repeats: int, ranges=None):
    model, state, batch, mesh, sch, ranges, placed, compiled = _compiled_step(
        cfg, rows, name, virtual, m, ranges)
    micro = jax.tree_util.tree_map(lambda a: a[: rows // m], batch)
    calls = {**_action_calls(model, state["params"], micro, ranges), "step": (compiled, placed)}
    t = _interleaved_medians({**calls, **_parallel_calls(mesh),
                              **_padded_calls(model, state["params"], micro, ranges)}, repeats)
    PADDED.extend(_padded_text(model, state["params"], ranges, t))
    cores = 2 * t["alone"] / t["pair"]
    in_trace: dict = {}                   # the same rounds again, under jax.profiler
    traced = MP.trace(compiled, mesh, lambda: in_trace.update(_interleaved_medians(calls,
                                                                                   repeats)))
    sizes, hw = {"stage": 2}, cost_models.hardware("cpu")
    costs = PL.stage_costs(model, state["params"], batch, rows // m, sizes, "stage", hw)
    bare, timeline = _timeline(model, state["params"], sch, ranges, t, costs.act_bytes, cores)
    _, window = _timeline(model, state["params"], sch, ranges, in_trace, costs.act_bytes, cores)
    pred_step = timeline.makespan_s + PL.after_loop_s(model, state["params"], sizes, "stage",
                                                      hw, ranges)
    predicted = PL.price(model, state["params"], costs, sizes, "stage", hw, name, virtual, m,
                         ranges)
    pred_mib = max(predicted.stage_memory_bytes) / 2**20
    meas_mib = hlo.memory(compiled)["peak"] / 2**20
    return (name, virtual, m, "+".join(str(b - a) for a, b in ranges), len(sch.ticks), cores,
            bare.makespan_s * 1e3, pred_step * 1e3, t["step"] * 1e3, t["step"] / pred_step,
            window.makespan_s * 1e3, statistics.mean(traced.loop_s) * 1e3,
            "/".join(f"{b / w:.2f}" for b, w in zip(traced.busy_s, window.busy_s)),
            window.bubble_fraction,
            traced.bubble_fraction, "/".join(f"{traced.stage_bubble(s):.2f}" for s in range(2)),
            in_trace["step"] / t["step"], pred_mib, meas_mib, meas_mib / pred_mib,
            "/".join(map(str, S.in_flight(sch))))


def _calibration_text(mesh, quick: bool) -> list[str]:
    tick_s, passes, runs, slopes = (calibrate(mesh, (8, 100_000), (2, 4), 3) if quick
                                    else calibrate(mesh))
    hw = cost_models.hardware("cpu")
    rows = [(w, n, m, t, c, s * 1e3) for w, n, m, t, c, s in runs]
    return [
        "## Per-tick calibration (a separate model)", "",
        "A staged model whose actions do next to nothing (layer x * a + big[0]; the dummy "
        "`big` sizes the gradient accumulators each tick carries), two microbatch counts per "
        "schedule and size: the slope of step time over ticks "
        f"({', '.join(f'{x * 1e3:.3f}' for x in slopes)} ms per tick) fitted as tick_s + "
        f"copies x carry / hbm_bytes_per_s gives tick_s = {tick_s * 1e3:.3f} ms and copies = "
        f"{passes:.2f} (the predictions use planning.TICK_CARRY_COPIES = "
        f"{PL.TICK_CARRY_COPIES:g}). The predictions below use the "
        f"cpu profile's pipeline_tick_s = {hw.pipeline_tick_s * 1e3:.3f} ms, from such a run.",
        "", _common.md_table(("width", "schedule", "microbatches", "ticks", "carry_bytes",
                              "step_ms"), rows), ""]


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
    calibration = _calibration_text(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",)),
                                     args.quick)
    rows_out = [_measure(cfg, rows, name, v, m, repeats, r) for name, v, m, r in runs]
    _common.write_csv(out / "pipeline_cpu.csv", HEADER, rows_out)
    text = [
        "# Pipeline schedules on 2 CPU devices: predicted vs measured", "",
        f"GPT (scan) {cfg.layers} layers, d_model {cfg.d_model}, seq {cfg.seq}, vocab "
        f"{cfg.vocab}, batch {rows} rows, mesh {{stage: 2}}; medians of {repeats} rounds, "
        "each round timing every action, the step and its tick loop once (interleaved, so a "
        "change of load touches them alike).", "",
        "* timeline_only: the schedule's lockstep timeline over the action times measured "
        "alone (the earlier prediction: no runtime overhead, nothing after the loop).",
        "* parallel: how many of the two stages this machine runs side by side at the speed "
        "of an action timed alone, measured in the same rounds (2 x one matmul chain alone / "
        "the same chain on both devices at once; 1: the two emulated devices take turns).",
        "* predicted_step: planning.loop_timeline over the same action times, its ticks "
        "lasting at least their stages' summed work / parallel, each tick "
        "adding planning.tick_overhead_s (the profile's pipeline_tick_s, the two "
        "collective-permutes' bytes and the copies of the tick's carry), plus "
        "planning.after_loop_s (gradient reductions, the optimizer, unequal ranges' moves).",
        "* bubble: the same rounds (actions and step) run again under jax.profiler. "
        "measured_bubble = 1 - sum busy / sum loop over the two devices, read from the trace "
        "by autopar.pipeline.measured: loop, a device's first to last instruction of the tick "
        "loop (traced_loop_ms, their mean); busy, the union of the instructions it executes "
        "inside the forward and backward branches of the action switches (not the tick's own "
        "work, the collective-permutes and their waits, nor idle time); stage_bubbles, "
        "1 - busy / loop per device. predicted_bubble = 1 - sum busy / (2 T) of "
        "planning.loop_timeline (T: predicted_loop_ms) over the actions timed alone in that "
        "same traced window; busy_ratio: measured over predicted busy time per stage; "
        "trace_cost: the traced step's median over the untraced one's.",
        "* memory: memory_analysis() (arguments + outputs + temporaries - aliased) against the "
        "planner's predicted peak of the busiest stage (planning.stage_bytes: 6 copies of the "
        "stage's parameters, the arguments' and the results', the gradient accumulators living "
        "in the results' buffers; the schedule's buffer slots; the residuals a chunk's forward "
        "scan stacks for its backward loop; one layer's backward working set; V > 1 and "
        "unequal ranges add the layer moves); 3+1 runs unequal ranges, padded to the longest "
        "chunk.", "",
        "Caveat: the devices are emulated on a shared 2-core machine. When its load exceeds its "
        "cores (see the environment line) the same configuration's step and action times vary "
        "up to 2x between runs, so the step and bubble columns are not conclusive there; the "
        "memory columns do not depend on load.", "",
        _common.md_table(HEADER, rows_out), "",
        "Padded slots (unequal ranges): the timeline adds planning.padded_slot_s per padded "
        "slot of a chunk shorter than the longest; the same chunk timed alone, padded as the "
        "runtime runs it and not:", "", *(PADDED or ["* no unequal ranges in this run"]), "",
        *calibration,
        f"Wall time {time.perf_counter() - t0:.0f} s. Environment: {_common.environment()}.", ""]
    (out / "pipeline_cpu.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
