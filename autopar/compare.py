"""``autopar.compare``: hand-written strategies against the planner's own plan, side by side.

    >>> cmp = autopar.compare(step, state, batch, mesh=jax.make_mesh((2, 4), ("data", "model")))
    >>> print(cmp)
    strategy   pred step  pred peak/dev  meas step  XLA peak/dev  collectives           note
    dp          5.506 ms       1.2 MiB    0.913 ms      1.9 MiB  AR 4 AG 20 A2A 6
    ...
    >>> cmp.best().strategy
    'auto'

Each strategy is planned on one traced graph (hand-written ones pin the inputs, see
``autopar.strategies``; ``"auto"`` is planned last, held against every hand-written plan). When
the mesh's devices are here and the arguments are arrays, each plan is compiled (the same codegen as
``autopar.autoparallel(fn, mesh=..., plan=plan)``), XLA's ``memory_analysis()`` peak is read and
the step is timed: once every plan is compiled, each runs once to warm up, then ``runs`` rounds run
every plan once in turn (``block_until_ready`` each), and a plan's time is the median of its
rounds, so no timed run shares the CPU with a compile and the plans see the same load. The
arguments are not donated: every strategy runs on the same arrays. A strategy that fails (does not
fit the memory budget, cannot be planned, fails to compile) becomes a row with its error; the
other rows are unaffected.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import html
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autopar import arguments, hlo, mesh_search, tune, validate
from autopar.api import autoparallel, plan_graph, trace_abstract
from autopar.errors import PlanError
from autopar.mesh import axis_sizes, concrete_mesh, hardware_for
from autopar.plan import Plan
from autopar.strategies import pipelined as pipelined_strategy

__all__ = ["Comparison", "Row", "compare"]

DEFAULT_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "megatron", "megatron_sp", "fsdp_tp",
                      "auto")
_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One strategy's prediction, measurement (``None`` when not measured) or error."""

    strategy: str
    predicted_step_s: float | None = None
    predicted_peak_bytes: float | None = None       # per device, the planner's memory model
    collectives: Mapping[str, int] = dataclasses.field(default_factory=dict)  # kind -> count
    measured_step_s: float | None = None            # median over runs
    measured_peak_bytes: float | None = None        # per device, XLA memory_analysis()
    error: str | None = None
    plan_s: float = 0.0                             # wall time to plan it
    compile_s: float = 0.0                          # wall time to lower and compile it
    plan: Plan | None = dataclasses.field(default=None, repr=False)
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)  # jax Compiled

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The rows of ``autopar.compare``; ``str()`` is a text table, ``_repr_html_`` an HTML one."""

    mesh: Mapping[str, int]
    hardware: str
    rows: tuple[Row, ...]

    def __getitem__(self, strategy: str) -> Row:
        for r in self.rows:
            if r.strategy == strategy:
                return r
        raise KeyError(f"no row {strategy!r}; rows are {[r.strategy for r in self.rows]}")

    def best(self, by: str = "predicted") -> Row:
        """The fastest row without an error, by ``"predicted"`` or ``"measured"`` step time."""
        key = "predicted_step_s" if by == "predicted" else "measured_step_s"
        rows = [r for r in self.rows if r.ok and getattr(r, key) is not None]
        if not rows:
            raise PlanError(f"no strategy has a {by} step time on mesh {dict(self.mesh)}; errors: "
                            f"{ {r.strategy: r.error for r in self.rows} }")
        return min(rows, key=lambda r: getattr(r, key))

    def table(self) -> list[list[str]]:
        """Header and one list of cell texts per row."""
        head = ["strategy", "pred step", "pred peak/dev", "meas step", "XLA peak/dev",
                "collectives", "note"]
        return [head] + [_cells(r) for r in self.rows]

    def __str__(self) -> str:
        t = self.table()
        width = [max(len(row[i]) for row in t) for i in range(len(t[0]) - 1)]
        lines = [f"mesh {dict(self.mesh)}, hardware {self.hardware}"]
        for row in t:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, width)) + "  " + row[-1])
        return "\n".join(line.rstrip() for line in lines)

    def _repr_html_(self) -> str:
        t = self.table()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in t[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in t[1:])
        return (f"<p>mesh {html.escape(str(dict(self.mesh)))}, hardware "
                f"{html.escape(self.hardware)}</p><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>")


def _cells(r: Row) -> list[str]:
    colls = " ".join(f"{_SHORT.get(k, k)} {n}" for k, n in sorted(r.collectives.items()))
    note = "" if r.ok else "error: " + r.error.splitlines()[0][:160]
    pp = getattr(r.plan, "pipeline", None)
    if pp is not None:
        note = (f"{pp.schedule} M={pp.microbatches} V={pp.virtual_stages}, bubble "
                f"{pp.bubble_fraction:.1%}, stage peaks "
                + "/".join(_bytes(b) for b in pp.stage_memory_bytes) + (note and "; " + note))
    return [r.strategy, _ms(r.predicted_step_s), _bytes(r.predicted_peak_bytes),
            _ms(r.measured_step_s), _bytes(r.measured_peak_bytes), colls, note]


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def compare(fn: Callable, *args, mesh, hardware=None,
            strategies: Sequence = DEFAULT_STRATEGIES, measure: bool = True,
            memory_budget: float | None = None, runs: int = 5, time_limit_s: float = 10.0,
            progress: bool = True, seed_auto: bool = True) -> Comparison:
    """Plan (and, when the devices are here, run) ``fn(*args)`` under each strategy.

    Args:
      fn: the training step.
      *args: its arguments, as ``autoparallel`` takes them (arrays, or ShapeDtypeStructs to
        only plan; NNX objects; modules with static leaves). Timing runs the step on copies:
        nothing is written back into the caller's objects.
      mesh: a ``jax.sharding.Mesh`` or a dict of axis sizes, as for ``autopar.plan``.
      hardware: the cost model's profile; default the mesh's devices, else ``"h100"``.
      strategies: names from ``autopar.strategies.NAMES``, strategy objects (the user's own
        layout: ``autopar.strategies.user(in_shardings)``), ``"user"`` (the layouts the
        arguments are committed to) and ``"auto"``.
      measure: compile and time each plan when the mesh's devices are present.
      memory_budget: per-device bytes every plan must fit; default the hardware's memory.
      runs: timed rounds (after one warm-up), each running every plan once; a plan's
        median is reported.
      time_limit_s: the planner's time limit per strategy.
      progress: print one line per strategy to stderr.
      seed_auto: hand this call's hand-written plans to ``"auto"`` as plans to beat (its search
        starts from the cheapest and returns nothing slower; those it would otherwise solve
        itself are not solved again, and strategy objects it does not know, the user's own
        layout among them, join them); False plans it exactly as
        ``autopar.plan(strategy="auto")`` does. Either way auto is never predicted slower than
        the built-in hand-written strategies (``autopar.planner.make_plan``).

    Returns:
      A ``Comparison``; a strategy that failed is a row whose ``error`` says why.
    """
    # Bad input fails here, before tracing, not as one error row per strategy.
    validate.callable_fn(fn, "autopar.compare")
    # What the step takes, parted as autoparallel parts it (NNX objects split, static leaves
    # apart): every strategy plans and times the step as a function of its traced arguments,
    # and the timed runs write nothing back into the caller's objects.
    call = arguments.prepare(args)
    # pipelined strategies plan and run the step as written: its declared layers are attributes
    # of the user's function (autopar.pipeline.model.declare), which the parted one lacks
    user = (fn, args) if not call.nodes else None
    fn, _ = call.function(fn)
    args = call.dynamic
    validate.leaf_types(args, run=False)
    validate.memory_budget(memory_budget)
    validate.time_limit(time_limit_s)
    mesh_search.check_not_open(mesh, "autopar.compare")
    axis_sizes(mesh)
    strategies = validate.strategy_list(strategies, "autopar.compare")
    graph, trace_s = trace_abstract(fn, args)   # as autoparallel traces it, so its plans apply
    run_mesh = _runnable_mesh(mesh, args) if measure else None
    hw = hardware_for(hardware, mesh)
    from autopar.strategies.user import resolve

    strategies = [resolve(s, args) for s in strategies]    # "user": committed layouts
    names = [s if isinstance(s, str) else getattr(s, "name", type(s).__name__)
             for s in strategies]
    # Compiles run on a worker thread while the next strategy is planned (XLA releases the GIL).
    # Timing starts once every compile is done, so no timed run shares the CPU with the planner
    # or a compile, and the plans are timed round robin, so a change in the machine's load
    # during the timing falls on every plan alike.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        rows, compiling = _plan_all(graph, mesh, hw, strategies, names, memory_budget,
                                    time_limit_s, trace_s, progress, seed_auto,
                                    None if run_mesh is None else
                                    lambda plan: pool.submit(_compile, *_step_for(
                                        plan, (fn, args), user), run_mesh, plan),
                                    user or (fn, args))
        ready = {}
        for i, job in compiling.items():
            rows[i], ready[i] = _compiled_row(rows[i], job, args)
    for i, row in _timed(rows, {i: r for i, r in ready.items() if r is not None}, runs).items():
        rows[i] = row
        if progress:
            _report(row, "measured")
    return Comparison(axis_sizes(mesh), hw.name, tuple(rows[i] for i in range(len(names))))


def _plan_all(graph, mesh, hw, strategies, names, memory_budget, time_limit_s, trace_s, progress,
              seed_auto, submit,
              fn_args=None) -> tuple[dict[int, Row], dict[int, concurrent.futures.Future]]:
    """Plan each strategy, "auto" last so it can be held against the hand-written plans."""
    rows: dict[int, Row] = {}
    compiling = {}
    for i in sorted(range(len(names)), key=lambda i: names[i] == "auto"):
        seeds = _seed_plans(rows.values()) if names[i] == "auto" and seed_auto else ()
        rows[i] = _plan_row(graph, mesh, hw, strategies[i], names[i], memory_budget,
                            time_limit_s, trace_s, seeds, fn_args)
        if rows[i].ok and submit is not None:
            compiling[i] = submit(rows[i].plan)
        if progress:
            _report(rows[i], "planned")
    return rows, compiling


def _plan_row(graph, mesh, hw, strategy, name, memory_budget, time_limit_s, trace_s,
              seeds: tuple[Plan, ...] = (), fn_args=None) -> Row:
    t0 = time.perf_counter()
    try:
        pipelined = pipelined_strategy(strategy)
        if pipelined is not None:       # megatron_3d: the pipeline codegen's own planner
            fn, args = fn_args
            plan = pipelined.plan(fn, *args, mesh=mesh, hardware=hw,
                                  memory_budget=memory_budget, time_limit_s=time_limit_s)
        else:
            plan = plan_graph(graph, mesh, hardware=hw, memory_budget=memory_budget,
                              strategy=strategy, time_limit_s=time_limit_s, trace_s=trace_s,
                              seed_plans=seeds)
    except Exception as e:  # noqa: BLE001 - one strategy's failure must not lose the others
        return Row(name, error=_text(e), plan_s=time.perf_counter() - t0)
    return Row(name, float(plan.cost.step_time_s), float(plan.cost.peak_memory_bytes),
               plan.collective_counts(), plan_s=time.perf_counter() - t0, plan=plan)


def _seed_plans(rows) -> tuple[Plan, ...]:
    """The planned hand-written rows' plans (pipelined ones are another program)."""
    return tuple(r.plan for r in rows if r.ok and r.plan is not None and r.plan.pipeline is None)


def _runnable_mesh(mesh, args):
    """The concrete mesh to time on, or None when its devices or the argument values are absent."""
    if not all(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree_util.tree_leaves(args)):
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        here = set(jax.devices())
        return concrete_mesh(mesh) if all(d in here for d in mesh.devices.flat) else None
    if isinstance(mesh, Mapping) and math.prod(axis_sizes(mesh).values()) == jax.device_count():
        return concrete_mesh(mesh)
    return None


def _step_for(plan: Plan, parted: tuple, user: tuple | None) -> tuple:
    """(step, arguments) a plan is compiled for: the user's own for a pipelined plan."""
    return user if plan.pipeline is not None and user is not None else parted


def _compile(fn, args, mesh, plan: Plan):
    """Lower and compile ``plan`` with the codegen ``autopar.autoparallel`` uses: (exe, seconds,
    the arguments it runs on: a pipelined unrolled model's state in its stacked layout)."""
    t0 = time.perf_counter()
    step = autoparallel(fn, mesh=mesh, plan=plan)
    if plan.pipeline is not None:
        args = (step.stack_state(args[0]), *args[1:])
    if plan.pipeline is not None and plan.pipeline.runtime == "mpmd":   # many programs
        from autopar.pipeline.planning import executable

        return (executable(plan, fn, concrete_mesh(mesh)).issued(*args),
                time.perf_counter() - t0, args)
    compiled = step.lower(*args).compile()
    compiled = getattr(compiled, "jax", compiled)   # jax's own: timed without autopar's wrapper
    return compiled, time.perf_counter() - t0, args


def _compiled_row(row: Row, job: concurrent.futures.Future, args) -> tuple[Row, tuple | None]:
    """Wait for the compile and read XLA's memory peak: (the row, (the executable, its placed
    arguments) or None when compiling or placing failed, the row then saying why)."""
    try:
        compiled, compile_s, args = job.result()
        placed = jax.device_put(args, compiled.input_shardings[0])
    except Exception as e:  # noqa: BLE001 - keep the prediction, report the failure
        return dataclasses.replace(row, error="measuring failed: " + _text(e)), None
    return dataclasses.replace(row, measured_peak_bytes=_xla_peak(compiled), compile_s=compile_s,
                               compiled=compiled), (compiled, placed)


def _timed(rows: dict[int, Row], ready: dict[int, tuple], runs: int) -> dict[int, Row]:
    """Each executable of ``ready`` run once to warm up, then ``runs`` rounds that run each once
    (``block_until_ready``), in an order rotated each round (``tune.rotated``); a row's time is
    the median of its rounds."""
    times: dict[int, list[float]] = {i: [] for i in ready}
    failed: dict[int, Row] = {}

    def run(i: int) -> float:
        compiled, placed = ready[i]
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*placed))
        return time.perf_counter() - t0

    for round_ in range(max(1, runs) + 1):     # round 0 warms up; each round starts one later
        for i in tune.rotated(list(times), round_):
            if i in failed:
                continue
            try:
                t = run(i)
            except Exception as e:  # noqa: BLE001 - keep the prediction, report the failure
                failed[i] = dataclasses.replace(rows[i], error="measuring failed: " + _text(e))
                continue
            if round_:
                times[i].append(t)
    return {i: failed.get(i) or dataclasses.replace(rows[i], measured_step_s=statistics.median(ts))
            for i, ts in times.items()}


def _xla_peak(compiled) -> float | None:
    """What the executable holds at once per device, as ``autopar.verify`` reads it
    (``hlo.memory``: arguments + outputs + temporaries - donated aliases); XLA:CPU's own
    ``peak_memory_in_bytes`` leaves the temporaries out. For an MPMD pipelined step, which is
    many executables, and XLA reports none for the whole: its peak is measured by running it
    (``MpmdStep.measure_peak``)."""
    if not hasattr(compiled, "as_text"):      # an MPMD step: its own measure (mpmd.Issued)
        return getattr(compiled, "peak_bytes", None)
    return hlo.memory(compiled).get("peak")


def _text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _report(r: Row, stage: str) -> None:
    if not r.ok:
        what = "error: " + (r.error or "").splitlines()[0][:200]
    elif stage == "planned":
        what = f"predicted {_ms(r.predicted_step_s)} (planned in {r.plan_s:.1f}s)"
    else:
        what = f"measured {_ms(r.measured_step_s)} (compiled in {r.compile_s:.1f}s)"
    print(f"autopar.compare: {stage} {r.strategy:<12} {what}", file=sys.stderr, flush=True)
