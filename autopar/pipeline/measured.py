"""A pipelined step's per-stage busy time and bubble, measured with ``jax.profiler``.

The runtime (``autopar.pipeline.runtime``) runs the schedule as one ``lax.scan`` over ticks; in
each tick every device takes one branch of two ``lax.switch`` es over (nothing, forward,
backward). In the compiled HLO that is one ``while`` (the *tick loop*) whose body holds
conditionals of three branch computations (the *action switches*).

XLA's thunk runtime (XLA:CPU here; GPU traces carry the same stats on its device planes)
records every HLO instruction it executes as a trace event whose stats name the module
(``hlo_module``), the instruction (``hlo_op``), the device (``device_ordinal``) and the
execution (``run_id``). So per device and run:

  * **loop**: from the first to the last event of an instruction of the tick loop (its body,
    condition and everything they call): the wall time of the loop on that device;
  * **busy**: the union of the intervals of the events of instructions inside the forward and
    backward branches of the action switches (everything those branches call, inner loops and
    collectives of a tensor-parallel stage included): the time the device spends executing
    its own actions. Not busy: the "nothing" branch, the tick's own work (reading the tables,
    the collective-permutes and their rendezvous waits, writing the inboxes), the gaps between
    thunks and idle time;
  * **bubble** ``= 1 - sum_s busy_s / sum_s loop_s``: the planner's definition
    (``schedules.Timeline.bubble_fraction``, ``1 - sum_s busy_s / (P T)``) with the measured
    loop in place of ``T`` (the two agree when every device's loop lasts the same, as a
    lockstep loop does up to its first and last tick).

Control-flow thunks (``while``, ``conditional``) may complete asynchronously, so their own
events do not span their work; the leaf instructions' events do (they run synchronously).
Tracing costs each thunk about a microsecond; ``MeasuredPipeline.step_s`` is the traced step's
wall time, to set against an untraced one. The traces record no Python calls (``options``:
``python_tracer_level=0``): the MPMD runtime's controller is a Python loop, and recording its
calls slowed it enough to starve the devices (a 4-stage ZB-V step at 16 microbatches, 384
actions: 685 ms traced with Python calls, 447 ms without, 525 ms untraced, at load 3.5 on 2
cores; its measured bubble 0.77 against 0.44), so the bubble measured the tracer, not the step.

Reading the trace needs only ``jax.profiler.ProfileData`` (in jaxlib), no TensorBoard.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import statistics
import tempfile
import time

import jax
import numpy as np

from autopar import hlo
from autopar.errors import AutoparError
from autopar.pipeline.runtime import BWD, FWD

ACTIONS = {FWD: "forward", BWD: "backward"}      # the action switches' branch index -> kind


def options():
    """The profiler options of every trace here: XLA's thunks and the host's annotations,
    no Python calls (module docstring)."""
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    return opts


@dataclasses.dataclass(frozen=True)
class LoopOps:
    """The instructions of the compiled step's tick loop, and those of each action kind."""

    module: str                         # the HLO module's name (events carry it)
    loop: frozenset                     # every instruction the tick loop executes
    actions: dict                       # "forward" / "backward" -> its branches' instructions


@dataclasses.dataclass(frozen=True)
class OpEvent:
    device: int
    run: int
    op: str
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class MeasuredPipeline:
    """Per stage (medians over the traced runs; a stage of several devices: their mean):
    the tick loop's wall time, the busy time and its forward and backward parts."""

    loop_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    bubble_fraction: float              # the median over runs of 1 - sum busy / sum loop
    runs: int
    step_s: float = 0.0                 # median wall time of a traced step

    def stage_bubble(self, s: int) -> float:
        return 1.0 - self.busy_s[s] / self.loop_s[s]


# ---- the compiled program ---------------------------------------------------------------------
def _reachable(module: hlo.Module, roots) -> set[str]:
    seen, todo = set(), [r for r in roots if r in module.computations]
    while todo:
        comp = todo.pop()
        if comp in seen:
            continue
        seen.add(comp)
        todo += [c for ins in module.computations[comp] for _, c in hlo.callees(ins)
                 if c in module.computations]
    return seen


def _switches(module: hlo.Module, body: str) -> list[hlo.Instruction]:
    """The three-way conditionals in ``body`` and the computations it calls outside control
    flow (a ``call``)."""
    comps, out = [body], []
    for comp in comps:
        for ins in module.computations.get(comp, ()):
            if ins.opcode == "conditional" and len(hlo.callees(ins)) == len(ACTIONS) + 1:
                out.append(ins)
            elif ins.opcode == "call":
                comps += [c for _, c in hlo.callees(ins)]
    return out


def _names(module: hlo.Module, comps) -> frozenset:
    return frozenset(i.name for c in comps for i in module.computations[c])


def loop_ops(hlo_text: str) -> LoopOps:
    """The tick loop of ``compiled.as_text()``: the outermost ``while`` whose body holds the
    action switches."""
    module = hlo.parse(hlo_text)
    name = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
    loops = [(ins, sw) for instrs in module.computations.values() for ins in instrs
             if ins.opcode == "while"
             for sw in [_switches(module, dict(hlo.callees(ins)).get("body", ""))] if sw]
    inner = set().union(*(_reachable(module, [c for _, c in hlo.callees(w)]) for w, _ in loops))
    outer = [(w, sw) for w, sw in loops
             if not any(w in module.computations[c] for c in inner)]
    if len(outer) != 1 or name is None:
        raise AutoparError(f"expected one pipeline tick loop (a while whose body switches over "
                           f"nothing/forward/backward) in the compiled step, found "
                           f"{len(outer)}; measure a step built by "
                           f"autopar.pipeline.runtime.build_step")
    w, switches = outer[0]
    actions = {kind: _names(module, _reachable(module, [
        hlo.callees(sw)[k][1] for sw in switches])) for k, kind in ACTIONS.items()}
    return LoopOps(name.group(1), _names(module, _reachable(module, [
        c for _, c in hlo.callees(w)])), actions)


# ---- the trace --------------------------------------------------------------------------------
def read_events(log_dir, module: str) -> list[OpEvent]:
    """Every executed instruction of ``module`` in the newest trace under ``log_dir``."""
    from jax.profiler import ProfileData

    files = sorted(pathlib.Path(log_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise AutoparError(f"no *.xplane.pb under {log_dir}: was jax.profiler.trace run there?")
    out = []
    for plane in ProfileData.from_file(str(files[-1])).planes:
        for line in plane.lines:
            for e in line.events:
                st = dict(e.stats)
                if st.get("hlo_module") == module and "hlo_op" in st and "device_ordinal" in st:
                    out.append(OpEvent(int(st["device_ordinal"]), int(st.get("run_id", 0)),
                                       st["hlo_op"], e.start_ns * 1e-9,
                                       (e.start_ns + e.duration_ns) * 1e-9))
    return out


def union_s(intervals) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals."""
    total, reach = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _per_device(events, ops: LoopOps) -> dict:
    """(run, device) -> (loop, busy, forward, backward) seconds."""
    groups: dict = {}
    for e in events:
        groups.setdefault((e.run, e.device), []).append(e)
    out = {}
    for key, evs in groups.items():
        inside = [e for e in evs if e.op in ops.loop]
        if not inside:
            continue
        loop = max(e.end_s for e in inside) - min(e.start_s for e in inside)
        parts = {k: [(e.start_s, e.end_s) for e in inside if e.op in names]
                 for k, names in ops.actions.items()}
        out[key] = (loop, union_s(parts["forward"] + parts["backward"]),
                    union_s(parts["forward"]), union_s(parts["backward"]))
    return out


def summarise(events, ops: LoopOps, stage_of: dict) -> MeasuredPipeline:
    """``stage_of``: device ordinal -> its stage (``stages_of``)."""
    per = _per_device(events, ops)
    runs = sorted({r for r, _ in per})
    p = max(stage_of.values()) + 1
    table = np.zeros((len(runs), p, 4))
    count = np.zeros((len(runs), p, 1))
    for (r, d), vals in per.items():
        if d in stage_of:
            table[runs.index(r), stage_of[d]] += vals
            count[runs.index(r), stage_of[d]] += 1
    if not runs or (count == 0).any():
        seen = sorted({d for _, d in per})
        raise AutoparError(f"the trace has tick-loop events of devices {seen} in {len(runs)} "
                           f"runs; expected every stage's devices {sorted(stage_of)} in every "
                           f"run (trace the step after it is compiled and warm)")
    table /= count
    med = np.median(table, axis=0)
    bubbles = 1 - table[:, :, 1].sum(1) / table[:, :, 0].sum(1)
    return MeasuredPipeline(*(tuple(float(x) for x in med[:, i]) for i in range(4)),
                            float(np.median(bubbles)), len(runs))


def stages_of(mesh, axis: str) -> dict:
    """Device ordinal -> its index along the mesh axis ``axis``."""
    k = mesh.axis_names.index(axis)
    return {d.local_hardware_id if d.local_hardware_id is not None else d.id: idx[k]
            for idx, d in np.ndenumerate(mesh.devices)}


def trace(compiled, mesh, run, axis: str = "stage", log_dir=None) -> MeasuredPipeline:
    """Trace ``run()``, which calls ``compiled`` (a compiled pipelined step, or its jitted loop)
    and may time other work in the same window, and measure the stages' busy time and bubble
    over the step's executions in it (module docstring)."""
    ops = loop_ops(compiled.as_text())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(log_dir or tmp, profiler_options=options()):
            run()
        return summarise(read_events(log_dir or tmp, ops.module), ops, stages_of(mesh, axis))


def measure(compiled, args, mesh, axis: str = "stage", runs: int = 3,
            log_dir=None) -> MeasuredPipeline:
    """``trace`` of ``runs`` calls of ``compiled(*args)`` after one untraced warm-up, with
    their median wall time as ``step_s``."""
    jax.block_until_ready(compiled(*args))
    walls = []

    def run():
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            walls.append(time.perf_counter() - t0)

    measured = trace(compiled, mesh, run, axis, log_dir)
    return dataclasses.replace(measured, step_s=statistics.median(walls))


# ---- the MPMD runtime -------------------------------------------------------------------------
MPMD_PREFIX = "jit_autopar_mpmd_"      # the module names of autopar.pipeline.mpmd's programs
STEP_MARK = "autopar_mpmd_step"


def _mpmd_kind(module: str) -> str | None:
    """"forward" / "backward" for an MPMD stage program's module, else None."""
    if not module.startswith(MPMD_PREFIX):
        return None
    kind = module[len(MPMD_PREFIX):].split("_")[0]
    return kind if kind in ("forward", "backward") else None


def read_mpmd(log_dir) -> tuple[list, list]:
    """(the MPMD stage programs' launches, as (device, kind, start, end): each launch from its
    first instruction's start to its last one's end on that device, gaps between its
    instructions included, as a program timed alone counts them; the host's step windows, as
    (start, end)) in the newest trace under ``log_dir``."""
    from jax.profiler import ProfileData

    files = sorted(pathlib.Path(log_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise AutoparError(f"no *.xplane.pb under {log_dir}: was jax.profiler.trace run there?")
    launches, steps = {}, []
    for plane in ProfileData.from_file(str(files[-1])).planes:
        for line in plane.lines:
            for e in line.events:
                start, end = e.start_ns * 1e-9, (e.start_ns + e.duration_ns) * 1e-9
                if e.name == STEP_MARK:
                    steps.append((start, end))
                    continue
                st = dict(e.stats)
                kind = _mpmd_kind(str(st.get("hlo_module", "")))
                if kind and "hlo_op" in st and "device_ordinal" in st:
                    key = (int(st["device_ordinal"]), kind, st.get("run_id"),
                           str(st["hlo_module"]))
                    a, b = launches.get(key, (start, end))
                    launches[key] = (min(a, start), max(b, end))
    events = [(d, kind, a, b) for (d, kind, _, _), (a, b) in launches.items()]
    return events, sorted(steps)


def summarise_mpmd(events, steps, stage_of: dict) -> MeasuredPipeline:
    """Per step window: per device the union of its stage programs' launches (busy, and its
    forward and backward parts) and the window's makespan (first to last launch of any stage
    program); a stage of several devices: their mean; bubble
    ``1 - sum busy / (P makespan)`` (the planner's definition), medians over the steps."""
    p = max(stage_of.values()) + 1
    rows, bubbles = [], []
    for a, b in steps:
        inside = [e for e in events if a <= e[2] and e[3] <= b]
        if not inside:
            continue
        span = max(e[3] for e in inside) - min(e[2] for e in inside)
        table, count = np.zeros((p, 4)), np.zeros((p, 1))
        for d in {e[0] for e in inside}:
            if d not in stage_of:
                continue
            mine = [(e[2], e[3], e[1]) for e in inside if e[0] == d]
            parts = {k: [(s, t) for s, t, kind in mine if kind == k]
                     for k in ("forward", "backward")}
            table[stage_of[d]] += (span, union_s(parts["forward"] + parts["backward"]),
                                   union_s(parts["forward"]), union_s(parts["backward"]))
            count[stage_of[d]] += 1
        if (count == 0).any():
            raise AutoparError(f"a traced MPMD step has no stage-program events on stage(s) "
                               f"{[s for s in range(p) if not count[s, 0]]}; trace the step "
                               f"after it is warm (MpmdStep builds its programs on its first "
                               f"call)")
        table /= count
        rows.append(table)
        bubbles.append(1 - table[:, 1].sum() / (p * span))
    if not rows:
        raise AutoparError("the trace has no MPMD step windows with stage-program events; "
                           "measure with autopar.pipeline.measured.measure_mpmd")
    med = np.median(np.stack(rows), axis=0)
    return MeasuredPipeline(*(tuple(float(x) for x in med[:, i]) for i in range(4)),
                            float(np.median(bubbles)), len(rows))


def measure_mpmd(step, state, batch, axis: str = "stage", runs: int = 3,
                 log_dir=None) -> MeasuredPipeline:
    """An MPMD pipelined step (``autopar.pipeline.mpmd.build_step``) traced over ``runs``
    steps after an untraced warm-up: per stage its busy time (the union of its forward and
    backward programs' launches on its devices), the step's makespan and the bubble, as
    ``measure`` gives them for the lockstep step; ``step_s`` the traced steps' median wall
    time."""
    jax.block_until_ready(step(state, batch))
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(log_dir or tmp, profiler_options=options()):
            for _ in range(runs):
                t0 = time.perf_counter()
                with jax.profiler.TraceAnnotation(STEP_MARK):
                    jax.block_until_ready(step(state, batch))
                walls.append(time.perf_counter() - t0)
        events, steps = read_mpmd(log_dir or tmp)
    measured = summarise_mpmd(events, steps, stages_of(step.mesh, axis))
    return dataclasses.replace(measured, step_s=statistics.median(walls))
