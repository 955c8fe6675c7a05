"""Choosing among plans the cost model cannot tell apart, by timing them (``autoparallel(tune=)``).

The cost model ranks plans; on a machine or model where its error is larger than the gap between
its best plans, the ranking is a guess. On the 8 emulated CPU devices the profile's error is a
median 7-70% per model and mesh on models this project did not write, while auto's plan and the
runners-up are often predicted within 2% of each other: the zoo's worst row (a flax linen LM on
2 x 4 devices) is dp predicted 11.02 ms and measured 10.8 ms against the user's own layout
predicted 11.23 ms and measured 8.5 ms (``benchmarks/results/zoo.md``).

A tuned step therefore, on its first call with arrays on the mesh's devices:

1. plans auto and every hand-written strategy (``request.STARTS``) and the layout the arguments
   are committed to, each as ``autopar.plan(strategy=...)`` plans it, auto held against them
   (``seed_plans``: it is never predicted slower than any); the committed layout is also a
   candidate as the user's own ``jax.jit`` runs it (``xla_layouts``: no pins, XLA's
   propagation lays out the activations), which the cost model does not price;
2. keeps those predicted within ``within`` of auto's step (``tune=True``: ``band``, how far
   the cost model's ranking has been measured wrong on the hardware, at least 10%);
3. lowers each, and compiles each distinct program once (plans of equal lowered text are one);
4. runs each on the call's own arguments (copies placed in its layout, nothing donated; kept
   placed for the whole timing up to ``RESIDENT_BYTES``, else placed afresh before each run), a
   warm-up and then ``ROUNDS`` rounds, the order rotated each round (an executable timed right
   after another runs measurably slower on the CPU devices, whichever it is);
5. keeps auto's plan unless another's median is at least ``MARGIN`` faster.

Under ``jax.distributed`` every process times its own devices and the medians are combined
(the slowest process's, ``distributed.agreed_times``), so every process chooses alike.

What it costs: each hand-written strategy's plan (within the time limit, as ``compare`` plans
it), one compile per distinct near-equal program, and ``ROUNDS + 1`` runs of each, once per
argument signature. The measured times are kept in ``Plan.tuned``.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Mapping

import jax

from autopar import codegen, distributed
from autopar.errors import AutoparError
from autopar.mesh import hardware_for
from autopar.plan import Plan, TunedCandidate
from autopar.request import STARTS, plan_graph

# Timed rounds after one warm-up; a candidate's time is its median. Five misjudged two plans of
# the zoo's linen LM (bf16, 2 x 4) by 16% against the zoo's own 21 rounds.
ROUNDS = 11
# Arguments up to this many bytes a candidate (all candidates' copies together) stay placed
# for the whole timing, as compare and the zoo time them; larger ones are placed afresh before
# each run, so only one candidate's copy of the state is on the devices at a time.
RESIDENT_BYTES = 2**30
MARGIN = 0.02      # another plan replaces auto's only when measured at least 2% faster
# tune=True times the plans predicted within this of auto's step at least; more where the
# hardware profile has measured its cost model's ranking further off (``band``).
WITHIN = 0.10


def band(hw) -> float:
    """The fraction of auto's predicted step within which ``tune=True`` times other plans on
    hardware ``hw``: its profile's ``ranking_error`` (how far a plan predicted slower has been
    measured faster: 0.25 on the CPU devices, from the zoo) and at least ``WITHIN``. A plan
    predicted further off than the cost model has been measured wrong is not worth a compile."""
    return max(WITHIN, float(hw.ranking_error))


def candidates(graph, mesh, options: Mapping, *, trace_s: float, user_layout,
               within: float) -> tuple[Plan, list[tuple[str, Plan]], list[TunedCandidate]]:
    """``(auto's plan, [(name, plan)] of the others predicted within ``within`` of it, the rows
    of those left out: planned slower, or not plannable, and why)``."""
    opts = {k: v for k, v in options.items() if k != "strategy"}
    hand: list[tuple[str, Plan]] = []
    left: list[TunedCandidate] = []
    named = [(name, name) for name in STARTS]
    if user_layout is not None:
        named.append(("user", "user"))
    with warnings.catch_warnings():     # a strategy's placement notes: in its plan, not printed
        warnings.simplefilter("ignore", UserWarning)
        for name, strategy in named:
            try:
                hand.append((name, plan_graph(graph, mesh, strategy=strategy, trace_s=trace_s,
                                              user_layout=user_layout, **opts)))
            except AutoparError as e:   # the step or mesh does not take it, or it does not fit
                left.append(TunedCandidate(name, 0.0, None, "", "not planned: " + _line(e)))
    auto = plan_graph(graph, mesh, strategy="auto", trace_s=trace_s, user_layout=user_layout,
                      seed_plans=tuple(p for _, p in hand), **opts)
    hand += [(XLA_LAYOUTS, xla_layouts(p)) for n, p in hand if n == "user"]
    bar = auto.cost.step_time_s * (1.0 + within)
    near = [(n, p) for n, p in hand if p.cost.step_time_s <= bar]
    auto_s = auto.cost.step_time_s
    left += [TunedCandidate(n, float(p.cost.step_time_s), None, "",
                            f"not timed: predicted {p.cost.step_time_s / auto_s:.2f}x auto's "
                            f"step (over {1 + within:.2f}x)")
             for n, p in hand if p.cost.step_time_s > bar]
    return auto, near, left


# The user's own program as their jax.jit runs it: the user's layout of the inputs (and of
# the step's constraints), every other layout left to XLA's sharding propagation.
XLA_LAYOUTS = "user-xla"


def xla_layouts(user: Plan) -> Plan:
    """``user``'s plan with no pins: codegen then lays out the inputs and outputs as the user's
    layout does and keeps the step's own sharding constraints, and XLA's sharding propagation
    chooses every other layout, as under the user's own ``jax.jit(in_shardings=...)``. A
    candidate the cost model cannot price (it does not model XLA's propagation): its figures
    are the user plan's, and its notes say so."""
    note = ("XLA's sharding propagation lays out every activation (no pins: the inputs in the "
            "user's layout, the step's own constraints kept, as under the user's jax.jit); the "
            "predicted figures are those of the user's layout planned by autopar, whose "
            "activation layouts this program does not pin")
    return dataclasses.replace(user, strategy=XLA_LAYOUTS, pins=(), notes=(*user.notes, note))


def choose(graph, mesh, options: Mapping, args: tuple, abstract: tuple, *, trace_s: float,
           user_layout, within: float | bool,
           timer: Callable | None = None) -> tuple[Plan, object | None]:
    """The plan a tuned step runs for ``args`` (arrays on ``mesh``'s devices) and, where it was
    compiled without donation as the step will be, its executable (else None). ``within``: the
    fraction of auto's predicted step within which others are timed, True for ``band``.

    ``timer(runs: {name: thunk}, rounds) -> {name: median seconds}`` times the candidates
    (default ``interleaved``); tests pass their own to fix the outcome."""
    if within is True:      # tune=True: as far as the cost model has been measured wrong
        within = band(hardware_for(options.get("hardware"), mesh))
    auto, near, left = candidates(graph, mesh, options, trace_s=trace_s,
                                  user_layout=user_layout, within=within)
    named = [("auto", auto), *near]
    programs: dict[str, tuple] = {}     # name -> (plan, compiled, input shardings)
    same: dict[str, str] = {}           # name -> the first name of its program
    seen: dict[str, str] = {}           # lowered text -> name
    for name, plan in named:
        try:
            jitted, shardings = codegen.build(graph, plan, mesh, ())
            lowered = jitted.lower(*abstract)
            text = lowered.as_text()
            if text in seen:
                same[name] = seen[text]
                continue
            seen[text] = same[name] = name
            programs[name] = (plan, lowered.compile(), shardings)
        except Exception as e:  # noqa: BLE001 - XLA raises several error types; keep the rest
            if name == "auto":
                raise
            left.append(TunedCandidate(name, float(plan.cost.step_time_s), None, "",
                                       "not compiled: " + _line(e)))
    if len(programs) == 1:      # nothing to choose between: auto's plan, untimed
        only = TunedCandidate("auto", float(auto.cost.step_time_s), None, "",
                              f"not timed: no other program predicted within {within:.0%} of "
                              f"its step")
        return (dataclasses.replace(auto, tuned=(only, *_shared(named, same), *left)),
                programs["auto"][1])
    size = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(args))
    resident = size * len(programs) <= RESIDENT_BYTES
    runs = {name: _runner(exe, args, shardings, resident)
            for name, (_, exe, shardings) in programs.items()}
    medians = (timer or interleaved)(runs, ROUNDS)
    medians = dict(zip(medians, distributed.agreed_times(list(medians.values()))))
    best = pick(medians)
    plan, exe, _ = programs[best]
    rows = [TunedCandidate(name, float(p.cost.step_time_s), float(medians[same[name]]),
                           "" if same[name] == name else same[name])
            for name, p in named if name in same]
    rows.sort(key=lambda r: (r.strategy != best, r.measured_s))
    chosen = dataclasses.replace(plan, tuned=tuple(rows) + tuple(left))
    return chosen, exe


def pick(medians: Mapping[str, float]) -> str:
    """The candidate to run: the fastest median, unless it beats auto's by less than
    ``MARGIN`` (then auto, whose plan the cost model ranked first)."""
    best = min(medians, key=medians.get)
    return best if medians[best] <= medians["auto"] * (1.0 - MARGIN) else "auto"


def _shared(named, same) -> list[TunedCandidate]:
    """Rows of the candidates that compiled to auto's one program (when nothing was timed)."""
    return [TunedCandidate(n, float(p.cost.step_time_s), None, same[n],
                           "not timed: the same program as auto's")
            for n, p in named if n != "auto" and n in same]


def _runner(exe, args, shardings, resident: bool) -> Callable[[], float]:
    """One timed run of ``exe``. ``resident``: on arguments placed once and kept; else placed
    first (untimed) and dropped after, so only one candidate's copy of the state is on the
    devices at a time."""
    kept = jax.block_until_ready(jax.device_put(args, shardings)) if resident else None

    def run() -> float:
        placed = kept if kept is not None else jax.block_until_ready(
            jax.device_put(args, shardings))
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*placed))
        return time.perf_counter() - t0
    return run


def interleaved(runs: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median seconds of each of ``runs`` (thunks returning their own run's seconds) over
    ``rounds`` rounds after a warm-up round, each round running every one once, starting one
    later each round: which one follows which is spread evenly over the rounds."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for name in rotated(names, r):
            t = runs[name]()
            if r:
                times[name].append(t)
    return {n: statistics.median(ts) for n, ts in times.items()}


def rotated(names: list, r: int) -> list:
    """``names`` starting at the ``r``-th (mod their count): round ``r``'s order. On the CPU
    devices an executable timed right after another measures 0.3-0.5 ms slower, whichever it
    is (the zoo's linen LM: the same HLO timed twice in a row, both orders tried)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def _line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
