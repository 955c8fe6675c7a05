"""Pipeline schedules: which microbatch, chunk and phase each stage runs at each tick.

Notation: ``P`` stages (the devices along the pipeline axis), ``V`` virtual stages per device,
``K = P * V`` chunks of consecutive layers; chunk ``k`` runs on stage ``Schedule.stage_of(k)``,
the schedule's *placement* (``placement``): ``k % P`` as its virtual stage ``v = k // P``
(interleaved), or in a V (``zb_v``: ``k`` for ``k < P``, ``2 P - 1 - k`` after). ``M``
microbatches. An action is ``F(m, k)`` (chunk ``k``'s forward ops on microbatch ``m``) or
``B(m, k)`` (its backward ops). Dependencies: ``F(m, k)`` after ``F(m, k-1)``; ``B(m, k)``
after ``F(m, k)`` and ``B(m, k+1)``. Zero-bubble schedules split
the backward: ``B(m, k)`` is then only the gradient with respect to the chunk's input, and
``W(m, k)``, after ``B(m, k)``, the gradient with respect to its weights
(``autopar.pipeline.split``).

Each stage follows a fixed *order* of its actions (the schedule):

  ``gpipe``   all forwards, then all backwards (with ``V > 1``: the circular pipeline of MaxText,
              microbatches in groups of ``P`` cycling through the virtual stages);
  ``1f1b``    ``P - s - 1`` warm-up forwards on stage ``s``, then one forward and one backward
              in turn, then the remaining backwards (with ``V > 1``: Megatron-LM's interleaved
              1F1B, ``2 (P - s - 1) + (V - 1) P`` warm-up forwards, ``M`` a multiple of ``P``);
  ``eager_1f1b``  1F1B with ``2 (P - s - 1)`` warm-up forwards (Megatron-LM's interleaved
              warm-up at ``V = 1``): at most ``2 (P - s) - 1`` microbatches in flight, but no
              ramp penalty in lockstep (below);
  ``zb_h1``   zero-bubble H1 (Qi et al., ICLR 2024), ``V = 1``: 1F1B's warm-up, then stage ``s``
              defers its first ``s`` weight gradients, so each ``B`` reaches the stage before it
              sooner, and runs the deferred ``W`` s in 1F1B's cool-down, where it would idle.
              1F1B's memory on stage 0; stage ``s`` also holds ``s`` frontiers (what ``W``
              reads). Bubble ``(P - 1)(t_F + t_B - t_W)`` in place of 1F1B's
              ``(P - 1)(t_F + t_B + t_W)``; run by the MPMD runtime only (``SPLIT``).
  ``zb_v``    zero-bubble V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024;
              the ZB-V of the zero-bubble authors' code), ``V = 2`` in a V: stage ``s`` holds
              chunks ``s`` and ``2 P - 1 - s``, so the model runs down the stages and back up,
              the turn needs no hop and stage 0 holds the embedding and the head. Each stage
              warms up with ``2 (P - s) - 1`` forwards of its first chunk, then runs each
              chunk's forward, input gradient and weight gradient in turn, and defers its
              last weight gradients into the cool-down (``_zb_v``). Memory: every stage holds
              ``2 P`` chunk inputs at its peak (``M >= 2 P - 1``), each of ``L / (2 P)``
              layers: in stored activations 1F1B's stage-0 peak, on every stage; this
              runtime stashes a chunk's input only and recomputes the rest (module
              ``runtime``), so that is twice 1F1B's stage-0 stash of chunk inputs, with half
              the backward's working set (chunks of half the layers); stage ``s`` also holds
              up to ``2 s + 1`` half-chunk frontiers. Bubble, asynchronously with free hops
              and equal chunk times ``T_F = T_B = T_W`` (``t = 2 T`` for a whole stage's
              share): ``(P - 1) T_F`` per stage, only the first forward's way down (no
              schedule starts stage ``P - 1`` sooner), half ZB-H1's ``(P - 1)(t_F + t_B -
              t_W)``; so ``(P - 1) / (6 M + P - 1)`` of the step, ``M >= 2 P - 1``
              (``ideal_bubble``). Any ``M >= 1`` runs, with a longer ramp below ``2 P - 1``.
              Run by the MPMD runtime only.

Execution is *lockstep*, as one SPMD program runs it: in every tick each stage walks its order and
runs at most one forward and at most one backward, each only once its inputs arrived in an earlier
tick (an input made on the same stage may come from earlier in the same tick); then activations
move one stage on and cotangents one stage back (collective-permutes), and the next tick starts.
So a tick lasts as long as its busiest stage plus its transfers plus the runtime's own cost of a
tick, ``c`` (``price(..., tick_s=c)``: dispatching its switches, launching its
collective-permutes, copying the state it threads through them; priced by
``planning.tick_overhead_s``):

    T = sum_t ( max_s work(s, t) + transfer(t) + c )      bubble = 1 - sum_s busy_s / (P T)

so the bubble is the fraction of the tick loop a stage is not running its own forward or
backward, the runtime's per-tick overhead included.

Every hop between stages costs a whole tick. GPipe's and interleaved 1F1B's ticks then add up to
the textbook ``(V M + P - 1)(t_F + t_B) / V``. Plain 1F1B does not, once ``P > 2``: a microbatch's
round trip through the stages takes about ``2 P - 1`` ticks, and stage ``s`` holds only
``P - s`` microbatches, so its steady state idles too and the loss grows with ``M``, not only with
the ramp (bare timeline, ``t_B = 2 t_F``: bubble 0.26 at ``P = 3, M = 96``, 0.34 at
``P = 4``, 0.45 at ``P = 8``, against the textbook 0.02-0.07; 0.01 at ``P = 2``). An
asynchronous MPMD runtime overlaps those hops; in one SPMD program ``eager_1f1b`` buys the time
back with memory (0.03 at ``P = 4, M = 96``).

Following the order bounds the microbatches a stage keeps in flight: 1F1B holds at most ``P - s``
on stage ``s`` (``min(M, P - s)``), GPipe all ``M``. ``stash_slots`` allocates the buffers that
hold them (and the received activations and cotangents) and ``Timeline`` gives the Gantt data.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from autopar.errors import AutoparError
from autopar.pipeline import record

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")
SPLIT = ("zb_h1", "zb_v")           # schedules whose backward is split into B and W
V_SHAPED = record.V_SHAPED         # schedules whose two chunks per stage sit in a V
ALL = SCHEDULES + SPLIT
ALIASES = {"interleaved": "1f1b", "circular": "gpipe", "1F1B": "1f1b", "GPipe": "gpipe",
           "zb-h1": "zb_h1", "ZB-H1": "zb_h1", "zero_bubble": "zb_h1",
           "zb-v": "zb_v", "ZB-V": "zb_v", "zbv": "zb_v", "ZBV": "zb_v"}


@dataclasses.dataclass(frozen=True)
class Action:
    """``kind`` ``"F"``, ``"B"`` or ``"W"`` of microbatch ``mb`` through chunk ``chunk``."""

    kind: str
    mb: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule's ticks: ``ticks[t][s]`` is the actions stage ``s`` runs at tick ``t``, in
    order (at most one forward and one backward)."""

    name: str
    stages: int
    virtual: int
    microbatches: int
    ticks: tuple[tuple[tuple[Action, ...], ...], ...]
    # chunk -> the stage that holds its layers and runs its actions (``placement``); () for the
    # schedule's own placement
    place: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.place:
            object.__setattr__(self, "place", placement(self.name, self.stages, self.virtual))

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def stage_of(self, chunk: int) -> int:
        return self.place[chunk]

    def chunks_on(self, stage: int) -> tuple[int, ...]:
        """The chunks stage ``stage`` holds, in model order."""
        return tuple(k for k, s in enumerate(self.place) if s == stage)

    def when(self) -> dict[Action, int]:
        """Action -> tick."""
        return {a: t for t, row in enumerate(self.ticks) for acts in row for a in acts}

    def position(self) -> dict[Action, int]:
        """Action -> ``2 * tick + phase`` (its place in its stage's tick): the clock of the
        buffers, as an action earlier in a tick frees a slot a later one may fill."""
        return {a: 2 * t + i for t, row in enumerate(self.ticks) for acts in row
                for i, a in enumerate(acts)}


def check(name: str, stages: int, virtual: int, microbatches: int) -> str:
    """The canonical schedule name; an ``AutoparError`` naming the fix for a bad combination."""
    canon = ALIASES.get(name, name)
    if canon not in ALL:
        raise AutoparError(f"pipeline schedule {name!r} is unknown; use one of "
                           f"{ALL + tuple(ALIASES)}")
    for what, n in (("stages", stages), ("virtual_stages", virtual),
                    ("microbatches", microbatches)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise AutoparError(f"pipeline {what}={n!r} must be an integer >= 1")
    if canon in V_SHAPED:
        _check_v(canon, stages, virtual, microbatches)
        return canon
    if virtual > 1 and microbatches % stages:
        raise AutoparError(f"a pipeline with virtual_stages={virtual} sends microbatches through "
                           f"the virtual stages in groups of stages={stages}, so microbatches="
                           f"{microbatches} must be a multiple of {stages}; use microbatches="
                           f"{-(-microbatches // stages) * stages}")
    if canon in SPLIT and virtual > 1:
        raise AutoparError(f"pipeline schedule {canon!r} runs one chunk per stage; use "
                           f"virtual_stages=1")
    return canon


def _check_v(name: str, stages: int, virtual: int, microbatches: int) -> None:
    """A V-shaped schedule's own rules: two chunks per stage, at least two stages."""
    if virtual != 2:
        raise AutoparError(f"pipeline schedule {name!r} places two chunks on each stage (chunk "
                           f"k on stage k, then on stage 2 P - 1 - k), so it needs "
                           f"virtual_stages=2, not {virtual}; use virtual_stages=2 (the layer "
                           f"count a multiple of 2 x stages)")
    if stages < 2:
        raise AutoparError(f"pipeline schedule {name!r} needs stages >= 2 (one stage has no V "
                           f"to turn); use a pipeline axis of 2 or more, or schedule='1f1b'")


def default_virtual(name: str | None) -> int:
    """The virtual stages a schedule runs when none are given: 2 for a V-shaped one, else 1."""
    return 2 if ALIASES.get(name, name) in V_SHAPED else 1


def allows(name: str, stages: int, virtual: int, microbatches: int) -> bool:
    """Whether ``check`` accepts the combination (a search's filter; ``check`` says why not)."""
    try:
        check(name, stages, virtual, microbatches)
    except AutoparError:
        return False
    return not (virtual > 1 and ALIASES.get(name, name) == "eager_1f1b")


def placement(name: str, stages: int, virtual: int) -> tuple[int, ...]:
    """Chunk ``k`` -> the stage that holds it (``autopar.pipeline.record.placement`` of the
    canonical name): interleaved, or in a V for ``V_SHAPED`` schedules."""
    return record.placement(ALIASES.get(name, name), stages, virtual)


def orders(name: str, stages: int, virtual: int, microbatches: int) -> list[list[Action]]:
    """Per stage, the order of its actions under schedule ``name``."""
    name = check(name, stages, virtual, microbatches)
    return [_order(name, s, stages, virtual, microbatches) for s in range(stages)]


def _chunk_sequence(s: int, stages: int, virtual: int, microbatches: int, backward: bool):
    """(mb, chunk) in the order stage ``s`` meets them: groups of ``stages`` microbatches go
    through the virtual stages together (Megatron-LM's interleaving; plain order when V = 1)."""
    out = []
    group = stages if virtual > 1 else microbatches
    for g in range(0, microbatches, group):
        vs = range(virtual - 1, -1, -1) if backward else range(virtual)
        for v in vs:
            out += [(m, v * stages + s) for m in range(g, min(g + group, microbatches))]
    return out


def _order(name: str, s: int, stages: int, virtual: int, microbatches: int) -> list[Action]:
    fwd = [Action("F", m, k) for m, k in _chunk_sequence(s, stages, virtual, microbatches, False)]
    bwd = [Action("B", m, k) for m, k in _chunk_sequence(s, stages, virtual, microbatches, True)]
    if name == "zb_h1":
        return _zb_h1(fwd, bwd, s, stages)
    if name == "zb_v":
        return _zb_v(s, stages, microbatches)
    if name == "gpipe":
        return fwd + bwd
    n = len(fwd)
    if virtual > 1 or name == "eager_1f1b":
        warm = 2 * (stages - s - 1) + (virtual - 1) * stages
    else:
        warm = stages - s - 1
    warm = min(warm, n)
    out = fwd[:warm]
    for i in range(n - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[n - warm:]


def _zb_h1(fwd: list[Action], bwd: list[Action], s: int, stages: int) -> list[Action]:
    """Stage ``s``'s ZB-H1 order: ``P - s - 1`` forwards; ``s`` rounds of a forward and an input
    gradient, their weight gradients deferred; then forward, input gradient, the oldest
    deferred weight gradient; the cool-down's input and weight gradients; the ``s`` left."""
    weights = [Action("W", a.mb, a.chunk) for a in bwd]
    n, f, b, w = len(fwd), min(stages - s - 1, len(fwd)), 0, 0
    out = fwd[:f]
    for _ in range(s):
        if f < n:
            out += [fwd[f], bwd[b]]
            f, b = f + 1, b + 1
    while f < n:
        out += [fwd[f], bwd[b], weights[w]]
        f, b, w = f + 1, b + 1, w + 1
    while b < n:
        out += [bwd[b], weights[w]]
        b, w = b + 1, w + 1
    return out + weights[w:]


def _zb_v(s: int, stages: int, microbatches: int) -> list[Action]:
    """Stage ``s``'s ZB-V order over its chunks ``lo = s`` and ``hi = 2 P - 1 - s`` (Qi et al.
    2024's V schedule; the phases as the zero-bubble authors lay them out). Warm-up:
    ``2 (P - s) - 1`` forwards of ``lo``; ``s`` pairs of forwards (``hi``, ``lo``); ``P - s``
    rounds of ``hi``'s forward, input gradient and weight gradient. Steady state: ``lo``'s
    forward, input and weight gradients, then ``hi``'s, until every forward ran. Cool-down:
    ``s`` pairs of input gradients (``lo``, ``hi``) whose weight gradients wait, ``P - s``
    rounds of ``lo``'s input and weight gradients, then the waiting weight gradients (``hi``'s,
    then ``lo``'s). Each step of a phase is skipped once its chunk has nothing left, so fewer
    microbatches than the warm-up's ``2 P - 1`` still make a complete order."""
    lo, hi = s, 2 * stages - 1 - s
    n = {(k, c): 0 for k in "FBW" for c in (lo, hi)}       # actions issued per kind and chunk
    out: list[Action] = []

    def run(kind: str, c: int) -> None:
        before = {"F": microbatches, "B": n[("F", c)], "W": n[("B", c)]}[kind]
        if n[(kind, c)] < before:
            out.append(Action(kind, n[(kind, c)], c))
            n[(kind, c)] += 1

    def phase(times: int, *steps: tuple[str, int]) -> None:
        for _ in range(times):
            for kind, c in steps:
                run(kind, c)

    phase(2 * (stages - s) - 1, ("F", lo))
    phase(s, ("F", hi), ("F", lo))
    phase(stages - s, ("F", hi), ("B", hi), ("W", hi))
    while n[("F", lo)] < microbatches or n[("F", hi)] < microbatches:
        phase(1, ("F", lo), ("B", lo), ("W", lo), ("F", hi), ("B", hi), ("W", hi))
    phase(s, ("B", lo), ("B", hi))
    phase(stages - s, ("B", lo), ("W", lo))
    phase(microbatches, ("B", hi))                  # what is left (fewer microbatches)
    phase(microbatches, ("B", lo))
    phase(microbatches, ("W", hi))
    phase(microbatches, ("W", lo))
    return out


def build(name: str, stages: int, virtual: int = 1, microbatches: int = 1) -> Schedule:
    """The lockstep ticks of schedule ``name`` (see the module docstring)."""
    name = check(name, stages, virtual, microbatches)
    order = orders(name, stages, virtual, microbatches)
    done: dict[Action, int] = {}
    pos = [0] * stages
    ticks = []
    total = sum(len(o) for o in order)
    place = placement(name, stages, virtual)
    while len(done) < total:
        row = tuple(_run_tick(order[s], pos, s, done, len(ticks), place)
                    for s in range(stages))
        if not any(row):
            raise AssertionError(f"schedule {name} deadlocked at tick {len(ticks)}")
        ticks.append(row)
    return Schedule(name, stages, virtual, microbatches, tuple(ticks), place)


def _ready(a: Action, done: Mapping[Action, int], t: int, here: set,
           place: tuple[int, ...]) -> bool:
    """Inputs arrived: from another stage in an earlier tick, from this stage any time before
    (``place``: chunk -> stage)."""
    chunks = len(place)

    def arrived(dep: Action) -> bool:
        if dep in here:
            return True
        return dep in done and (done[dep] < t or place[dep.chunk] == place[a.chunk])

    if a.kind == "F":
        return a.chunk == 0 or arrived(Action("F", a.mb, a.chunk - 1))
    if a.kind == "W":
        return arrived(Action("B", a.mb, a.chunk))
    if not arrived(Action("F", a.mb, a.chunk)):
        return False
    return a.chunk == chunks - 1 or arrived(Action("B", a.mb, a.chunk + 1))


def _run_tick(order: list[Action], pos: list[int], s: int, done: dict[Action, int], t: int,
              place: tuple[int, ...]) -> tuple[Action, ...]:
    ran: list[Action] = []
    here: set[Action] = set()
    while pos[s] < len(order):
        a = order[pos[s]]
        if any(r.kind == a.kind for r in ran) or not _ready(a, done, t, here, place):
            break
        ran.append(a)
        here.add(a)
        done[a] = t
        pos[s] += 1
    return tuple(ran)


# ---- costs ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timeline:
    """A schedule priced: per tick its duration, per stage its busy time, the makespan and the
    bubble, and every action's (stage, start, end) for a Gantt chart."""

    makespan_s: float
    busy_s: tuple[float, ...]                       # per stage
    tick_s: tuple[float, ...]
    transfer_s: float                               # summed over ticks
    spans: tuple[tuple[int, float, float, Action], ...]   # (stage, start, end, action)
    overhead_s: float = 0.0                         # the runtime's per-tick cost, summed

    @property
    def bubble_fraction(self) -> float:
        if not self.makespan_s:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.makespan_s)

    def stage_bubble(self, s: int) -> float:
        return 1.0 - self.busy_s[s] / self.makespan_s if self.makespan_s else 0.0


def price(schedule: Schedule, duration: Callable[[Action], float],
          transfer: Callable[[int, bool, bool], float] = lambda t, f, b: 0.0,
          cores: float | None = None, tick_s: float = 0.0,
          pool: float | None = None) -> Timeline:
    """Lockstep timing of ``schedule``.

    Args:
      duration: seconds of one action on its stage.
      transfer: ``transfer(t, any_forward_sent, any_backward_sent)`` seconds of tick ``t``'s
        collective-permutes.
      tick_s: the runtime's fixed cost of every tick, whatever runs in it.
      cores: when the stages share ``cores`` processors (emulated CPU devices), a tick lasts at
        least its total work over ``cores``; ``None``: each stage has its own.
      pool: when the stages compute on one shared pool worth ``pool`` stages at the speed
        ``duration`` assumes, the busy stages share it (``shared_ends``): a tick's work lasts
        its sum over ``pool``, a stage busy until its own share is done; ``None``: each stage
        its own device.
    """
    spans, busy, ticks = [], [0.0] * schedule.stages, []
    clock = moved = 0.0
    for t, row in enumerate(schedule.ticks):
        work = [sum(duration(a) for a in acts) for acts in row]
        if pool is not None:
            ends = shared_ends(work, pool)
        else:
            longest = max(work)
            if cores is not None:
                longest = max(longest, sum(work) / cores)
            ends = [w * (longest / max(work) if max(work) else 1.0) for w in work]
        longest = max(ends)
        for s, acts in enumerate(row):
            start, stretch = clock, ends[s] / work[s] if work[s] else 1.0
            for a in acts:
                d = duration(a) * stretch
                spans.append((s, start, start + d, a))
                start += d
            busy[s] += ends[s]
        fwd = any(a.kind == "F" and a.chunk < schedule.chunks - 1
                  and schedule.stage_of(a.chunk + 1) != s
                  for s, acts in enumerate(row) for a in acts)
        bwd = any(a.kind == "B" and a.chunk > 0 and schedule.stage_of(a.chunk - 1) != s
                  for s, acts in enumerate(row) for a in acts)
        comm = transfer(t, fwd, bwd) if (fwd or bwd) else 0.0
        ticks.append(longest + comm + tick_s)
        clock += longest + comm + tick_s
        moved += comm
    return Timeline(clock, tuple(busy), tuple(ticks), moved, tuple(spans),
                    tick_s * len(schedule.ticks))


def shared_ends(work: Sequence[float], pool: float) -> list[float]:
    """When each of ``work`` (seconds at a priced speed), started together, ends on one shared
    pool worth ``pool`` workers at that speed: the pool is split evenly among the unfinished
    (processor sharing, ``k`` of them each at ``pool / k`` of the priced speed, faster than it
    while fewer than ``pool`` are busy), so the last ends at ``sum(work) / pool``."""
    order = sorted(range(len(work)), key=lambda i: work[i])
    ends, clock, done = [0.0] * len(work), 0.0, 0.0
    for n, i in enumerate(order):
        clock += (len(order) - n) * (work[i] - done) / pool
        done = work[i]
        ends[i] = clock if work[i] else 0.0
    return ends


# ---- asynchronous (MPMD) execution --------------------------------------------------------------
def _deps(a: Action, chunks: int) -> tuple[Action, ...]:
    """The actions ``a`` waits for: ``F(m, k-1)``; ``F(m, k)`` and ``B(m, k+1)``; ``B(m, k)``."""
    if a.kind == "F":
        return () if a.chunk == 0 else (Action("F", a.mb, a.chunk - 1),)
    if a.kind == "W":
        return (Action("B", a.mb, a.chunk),)
    nxt = () if a.chunk == chunks - 1 else (Action("B", a.mb, a.chunk + 1),)
    return (Action("F", a.mb, a.chunk), *nxt)


def dispatch_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """``(stage, action)`` in the order one controller issues them to an asynchronous runtime
    (``autopar.pipeline.mpmd``): passes over the stages, each stage issuing the next actions of
    its order whose inputs were issued already. Every stage's actions keep their order, and an
    action is issued after what it reads, so the devices run each stage's order as it comes,
    waiting only for their inputs."""
    order = orders(schedule.name, schedule.stages, schedule.virtual, schedule.microbatches)
    pos, issued, out = [0] * schedule.stages, set(), []
    total = sum(map(len, order))
    while len(out) < total:
        moved = False
        for s, acts in enumerate(order):
            while pos[s] < len(acts) and all(d in issued for d in _deps(acts[pos[s]],
                                                                         schedule.chunks)):
                a = acts[pos[s]]
                out.append((s, a))
                issued.add(a)
                pos[s] += 1
                moved = True
        if not moved:
            raise AssertionError(f"schedule {schedule.name} deadlocks when run asynchronously")
    return out


def price_async(schedule: Schedule, duration: Callable[[Action], float],
                hop_s: Callable[[Action], float] = lambda a: 0.0,
                issue_s: float = 0.0, pool: float | None = None) -> Timeline:
    """Asynchronous timing of ``schedule``: each stage runs its order as soon as its inputs are
    there, with no ticks. An action starts when its stage is free, when what it reads has
    arrived (a neighbour's result ``hop_s(producer)`` seconds after the producer ended) and
    when the controller has issued it: the controller issues ``dispatch_order`` one action
    every ``issue_s`` seconds (its host-side cost per action), never waiting for a device.

        start(a) = max(free(stage), max_d end(d) + hop(d), issued(a))

    ``pool``: when the stages compute on one shared pool worth ``pool`` stages at the speed
    ``duration`` assumes (emulated CPU devices, threads on the host's cores), the stages busy
    at a moment share it evenly: ``k`` of them each run at ``pool / k`` of that speed
    (``_price_shared``); ``None``: each stage its own device, running at that speed.

    ``spans`` and ``busy_s`` as for ``price``; ``transfer_s`` sums the hops (overlapped with
    compute: not on the makespan unless on its critical path); ``overhead_s`` is the
    controller's issuing time (likewise)."""
    if pool is not None:
        return _price_shared(schedule, duration, hop_s, issue_s, pool)
    end: dict[Action, float] = {}
    free = [0.0] * schedule.stages
    busy = [0.0] * schedule.stages
    spans = []
    host = moved = 0.0
    for s, a in dispatch_order(schedule):
        host += issue_s
        ready = host
        for d in _deps(a, schedule.chunks):
            hop = hop_s(d) if schedule.stage_of(d.chunk) != s else 0.0
            moved += hop if d.kind == a.kind else 0.0
            ready = max(ready, end[d] + hop)
        start = max(free[s], ready)
        end[a] = free[s] = start + duration(a)
        busy[s] += end[a] - start
        spans.append((s, start, end[a], a))
    return Timeline(max(free), tuple(busy), (), moved, tuple(spans), host)


def _price_shared(schedule: Schedule, duration: Callable[[Action], float],
                  hop_s: Callable[[Action], float], issue_s: float, pool: float) -> Timeline:
    """``price_async`` with the stages on one shared pool: an event simulation, since an
    action's end depends on what else runs meanwhile. Each stage takes its actions in
    ``dispatch_order``; at every moment the running ones advance at ``pool / k`` each
    (``k`` running); a stage starts its next action once it is free, the action issued and its
    inputs arrived, as ``price_async``'s rule says. An action of no work takes no time."""
    p, chunks = schedule.stages, schedule.chunks
    queue: list[list[tuple[Action, float]]] = [[] for _ in range(p)]
    host = 0.0
    for s, a in dispatch_order(schedule):
        host += issue_s
        queue[s].append((a, host))
    pos, end = [0] * p, {}
    running: dict[int, list] = {}              # stage -> [action, start, work left]
    busy, spans = [0.0] * p, []
    moved = now = 0.0

    def ready(s: int) -> float:
        """When stage ``s``'s next action may start (inf while an input is not made yet)."""
        a, issued = queue[s][pos[s]]
        at = issued
        for d in _deps(a, chunks):
            if d not in end:
                return float("inf")
            at = max(at, end[d] + (hop_s(d) if schedule.stage_of(d.chunk) != s else 0.0))
        return at

    def finish(s: int, a: Action, start: float, at: float) -> None:
        end[a] = at
        busy[s] += at - start
        spans.append((s, start, at, a))

    left = sum(map(len, queue))
    while left:
        started = True
        while started:                       # start every action that may start now
            started = False
            for s in range(p):
                if s in running or pos[s] == len(queue[s]) or ready(s) > now:
                    continue
                a = queue[s][pos[s]][0]
                pos[s] += 1
                for d in _deps(a, chunks):
                    if schedule.stage_of(d.chunk) != s and d.kind == a.kind:
                        moved += hop_s(d)
                work = duration(a)
                if work > 0:
                    running[s] = [a, now, work]
                else:
                    finish(s, a, now, now)
                    left -= 1
                started = True
        rate = pool / len(running) if running else 0.0
        done_at = min((now + r[2] / rate for r in running.values()), default=float("inf"))
        waits = [ready(s) for s in range(p) if s not in running and pos[s] < len(queue[s])]
        nxt = min([done_at] + [w for w in waits if w > now])
        if nxt == float("inf"):
            raise AssertionError(f"schedule {schedule.name} deadlocks when run asynchronously")
        for s in list(running):
            a, start, work = running[s]
            if now + work / rate <= nxt:         # ends now (the earliest, or at the same time)
                finish(s, a, start, nxt)
                del running[s]
                left -= 1
            else:
                running[s][2] = work - rate * (nxt - now)
        now = nxt
    return Timeline(max(end.values(), default=0.0), tuple(busy), (), moved, tuple(spans),
                    host)


def held_async(timeline: Timeline, chunks: int, stages: int, frontier: float = 0.0,
               working: Mapping[str, float] | None = None) -> tuple[float, ...]:
    """Per stage, the most activations an asynchronous runtime holds at once in
    ``timeline``: each chunk input from its forward until its backward ends (the stash), and
    each received activation or cotangent from its producer's end until its consumer starts
    (the inboxes); in a split schedule also each weight-gradient frontier from its ``B``'s end
    until its ``W`` ends, counted as ``frontier`` activations (its bytes over an
    activation's), at the same moments; with ``working`` (action kind -> activations), each
    action's own working set too, while it runs."""
    span = {a: (s, t0, t1) for s, t0, t1, a in timeline.spans}
    intervals = []
    for a, (s, t0, t1) in span.items():
        if working and working.get(a.kind):
            intervals.append((s, t0, t1, working[a.kind]))
        if a.kind == "F":
            intervals.append((s, t0, span[Action("B", a.mb, a.chunk)][2], 1.0))
        for d in _deps(a, chunks):
            if span[d][0] != s:
                intervals.append((s, span[d][2], t0, 1.0))
    intervals += [(s, t0, t1, frontier) for s, t0, t1 in _frontier_spans(span)]
    return tuple(_most_held([(t0, t1) for st, t0, t1, _ in intervals if st == s],
                            [w for st, _, _, w in intervals if st == s])
                 for s in range(stages))


def frontiers_async(timeline: Timeline, stages: int) -> tuple[int, ...]:
    """Per stage, the most weight-gradient frontiers (``autopar.pipeline.split``) held at once
    in a split schedule's ``timeline``: each from its ``B``'s end until its ``W`` ends; zeros
    for a schedule without ``W``."""
    spans = _frontier_spans({a: (s, t0, t1) for s, t0, t1, a in timeline.spans})
    return tuple(_most_held([(t0, t1) for st, t0, t1 in spans if st == s])
                 for s in range(stages))


def _frontier_spans(span: Mapping[Action, tuple]) -> list[tuple[int, float, float]]:
    """(stage, from ``B``'s end, to ``W``'s end) of each frontier; ``span``: action -> (stage,
    start, end)."""
    return [(s, span[Action("B", a.mb, a.chunk)][2], t1)
            for a, (s, _, t1) in span.items() if a.kind == "W"]


# ---- buffers ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Slots:
    """Static buffer slots: ``slot[(stage, key)]`` for every item a stage holds, and ``count``,
    the number of slots one buffer needs (the most any stage holds at once)."""

    slot: Mapping[tuple[int, tuple], int]
    count: int


def allocate(intervals: Sequence[tuple[int, tuple, int, int]]) -> Slots:
    """Interval colouring per stage: ``(stage, key, first, last)`` -> a slot free over the whole
    interval (both ends included, in ``Schedule.position`` units)."""
    by_stage: dict[int, list] = {}
    for s, key, a, b in intervals:
        by_stage.setdefault(s, []).append((a, b, key))
    slot: dict[tuple[int, tuple], int] = {}
    count = 0
    for s, items in by_stage.items():
        free_at: list[int] = []          # per slot: the first position it is free again
        for a, b, key in sorted(items, key=lambda x: (x[0], x[1], str(x[2]))):
            k = next((i for i, f in enumerate(free_at) if f <= a), None)
            if k is None:
                k = len(free_at)
                free_at.append(0)
            free_at[k] = b + 1
            slot[(s, key)] = k
        count = max(count, len(free_at))
    return Slots(slot, count)


def stash_intervals(schedule: Schedule, keep: Callable[[int], bool] = lambda k: True):
    """(stage, (mb, chunk), position of F, position of B) for every chunk ``keep`` selects: what
    a stage holds from a forward until its backward (positions: ``Schedule.position``)."""
    pos = schedule.position()
    return [(schedule.stage_of(a.chunk), (a.mb, a.chunk), p, pos[Action("B", a.mb, a.chunk)])
            for a, p in pos.items() if a.kind == "F" and keep(a.chunk)]


def inbox_intervals(schedule: Schedule, kind: str):
    """(stage, (mb, chunk), arrival, use) positions for every activation (``kind="F"``) or
    cotangent (``"B"``) a stage receives from a neighbour: it arrives at the end of the
    producer's tick and is held until the consumer runs."""
    pos = schedule.position()
    out = []
    for a, p in pos.items():
        if a.kind != kind:
            continue
        src = a.chunk - 1 if kind == "F" else a.chunk + 1
        if not 0 <= src < schedule.chunks:
            continue
        if schedule.stage_of(src) == schedule.stage_of(a.chunk):
            continue                     # same stage (one-stage pipelines): no transfer
        sent_tick = pos[Action(kind, a.mb, src)] // 2
        out.append((schedule.stage_of(a.chunk), (a.mb, a.chunk), 2 * sent_tick + 2, p))
    return out


def in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches held between a forward and its backward at once."""
    return _peaks(stash_intervals(schedule), schedule.stages)


def _peaks(intervals, stages: int) -> tuple[int, ...]:
    return tuple(_most_held([(a, b + 1) for st, _, a, b in intervals if st == s])
                 for s in range(stages))


def _most_held(spans, weights=None):
    """The most of ``spans`` ([start, end), an end freeing before a start at the same time
    takes) open at once; with ``weights``, the largest sum of the open spans' weights."""
    weights = [1] * len(spans) if weights is None else weights
    events = sorted([(a, 1, w) for (a, _), w in zip(spans, weights)]
                    + [(b, -1, w) for (_, b), w in zip(spans, weights)])
    now = top = 0
    for _, d, w in events:
        now += d * w
        top = max(top, now)
    return top


def ideal_bubble(name: str, stages: int, virtual: int, microbatches: int) -> float:
    """The textbook bubble with equal forward and backward times: ``(P-1)/(V M + P - 1)``;
    ZB-V's with equal ``F``, ``B`` and ``W`` chunk times, run asynchronously (module
    docstring; ``M >= 2 P - 1``): ``(P - 1)/(6 M + P - 1)``."""
    if ALIASES.get(name, name) in V_SHAPED:
        return (stages - 1) / (6 * microbatches + stages - 1)
    return (stages - 1) / (virtual * microbatches + stages - 1)


def gantt(timeline: Timeline, ax=None, title: str = ""):
    """A Gantt chart of ``timeline`` (matplotlib): one row per stage, forwards light,
    backwards dark (a split backward's weight half darkest), each bar labelled with its
    microbatch; idle time is the bubble."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(timeline.busy_s) + 1))
    colours = {"F": "#9ecae1", "B": "#3182bd", "W": "#08519c"}
    for s, start, end, a in timeline.spans:
        ax.barh(s, end - start, left=start, color=colours[a.kind], edgecolor="white")
        ax.text((start + end) / 2, s, str(a.mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(timeline.busy_s)))
    ax.set_yticklabels([f"stage {s}" for s in range(len(timeline.busy_s))])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title or f"bubble {timeline.bubble_fraction:.1%}")
    return ax
