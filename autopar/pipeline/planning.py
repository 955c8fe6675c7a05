"""Planning a pipeline: stage costs from the intra-op planner, schedules priced, choices searched.

Costs are analytic, never profiled. The ops of one layer, of the embedding and of the head are
traced at one data shard's rows of a microbatch and planned by the existing ILP on the tensor
axis alone (the runtime's data axes are manual: a device runs its rows with no data-axis
collective), forward and backward (the backward recomputes the forward: ``jax.vjp``, as the
runtime does). A chunk's action costs its layers' sums; the schedule's lockstep ticks
(``schedules.price``) add the collective-permute of each tick's activations and cotangents on
the pipeline axis' link. The step adds the gradient reductions the runtime makes once, after
the tick loop (the embedding's and head's over stage and data axes, the layers' over the data
axes) and the optimizer's pass over the stage's parameters.

Per-device memory of stage ``s`` (``stage_bytes``): its parameters and Adam moments and the
step's new ones (``STATE_COPIES = 6 x`` its parameter bytes; the gradient accumulators live in
the new state's buffers), the buffers its schedule needs (stash and inboxes: ``slots x`` one
microbatch's activation) and the working set of one backward action: the residuals the chunk's
forward scan stacks for its backward loop (``jax.vjp``'s residuals of one layer that grow with
the rows, times the chunk's layers; a one-layer chunk has no loop, XLA removes it) and one
layer's backward (the intra-op plan's peak for one layer's vjp, less that layer's parameters
and gradients, which the state counts). With ``V > 1`` virtual stages, or unequal ranges, the
runtime moves the layers into the chunk layout and the gradients back
(``_layout_overheads``).

A chunk shorter than the longest runs padded; its padded slots skip the layer but not the
slicing and gradient copies (``padded_slot_s``), which its actions pay.

The tick loop also pays the runtime's own cost of every tick (``tick_overhead_s``: the
profile's ``pipeline_tick_s``, the collective-permutes' bytes and a copy of the state each tick
threads through its switches), which the step and the bubble include. Where the profile's
devices share their compute (the cpu profile's emulated devices: ``compute_pool``), a tick's
actions, all run by one SPMD program, last their summed work over that pool rather than the
slowest one's time, as the MPMD timeline shares the pool among the stages busy at each moment.

FSDP inside a stage (``pipeline={"fsdp": True}``; searched where a stage has data shards): the
state holds each layer's parameters and moments sharded over the data axes (``fsdp_bytes``);
every layer of a forward action gathers them once, of a backward twice (the chunk's recompute
and the layer's ``jax.checkpoint``), and a backward runs the layer forward once more and
reduce-scatters its gradient (``fsdp_layer_s``); the layers' gradients are then not
all-reduced after the loop; the backward keeps each layer's input instead of its residuals and
holds one layer's gathered parameters (``stage_bytes``).

``pipeline="auto"`` enumerates schedules, virtual stages and microbatch counts, each with equal
layer ranges (where the layers split so) and, with one chunk per stage, the layer-range DP's
best split (``dp``, ``layer_split``), priced by ``price(..., ranges=...)`` on the same timeline
with the runtime's padding overheads (``_layout_overheads``), and keeps the fastest that fits
the memory budget; its ``why`` lists the runners-up. Per-boundary links: ``boundary_hops_s``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

import cost_models
import ir
from autopar.errors import AutoparError
from autopar.mesh import without_mesh
from autopar.pipeline import dp
from autopar.pipeline import schedules as S
from autopar.pipeline.model import StagedModel, key_names
from autopar.pipeline.mpmd import supports as mpmd_supports
from autopar.pipeline.record import RUNTIMES, PipelinePlan, placement
from autopar.pipeline.runtime import TENSOR_AXIS, data_axes, equal_ranges, rows_split
from autopar.pipeline.split import split_layer
from autopar.strategies.roles import path_keys

OPTIONS = ("axis", "stages", "microbatches", "schedule", "virtual_stages", "layer_ranges",
           "fsdp", "runtime")
LAYER_RANGES = ("auto", "equal")     # equal chunks or the layer-range DP's split; equal only
# Per-device copies of a stage's parameters XLA holds for the whole step (the runtime donates
# nothing): the arguments (parameters and Adam's two moments) and the results (the same, new).
# The gradient accumulators the tick loop carries live in the results' buffers: each dies when
# the update writes its parameter, and XLA's buffer assignment reuses a result's buffer for a
# temporary that dies before the result is written (benchmarks/pipeline_cpu.py's memory column).
STATE_COPIES = 6


@dataclasses.dataclass(frozen=True)
class Pins:
    axis: str
    stages: int
    microbatches: int | None
    schedule: str | None
    virtual_stages: int | None
    layer_ranges: str = "auto"
    fsdp: bool | None = None        # None: searched where the stage has data shards
    runtime: str | None = None      # "lockstep" or "mpmd"; None: both priced where both run


def parse(pipeline, sizes: dict, model: StagedModel, rows: int) -> Pins:
    """``pipeline=`` checked against the mesh and the model; ``"auto"`` pins only the axis."""
    if pipeline == "auto":
        pipeline = {}
    if not isinstance(pipeline, dict):
        raise AutoparError(f"pipeline={pipeline!r:.60} must be 'auto' or a dict of {OPTIONS}, "
                           f"e.g. pipeline={{'axis': 'stage', 'microbatches': 8, "
                           f"'schedule': '1f1b'}}")
    unknown = sorted(set(pipeline) - set(OPTIONS))
    if unknown:
        raise AutoparError(f"pipeline= got unknown keys {unknown}; use some of {OPTIONS}")
    axis = pipeline.get("axis", "stage")
    if axis not in sizes:
        raise AutoparError(f"pipeline axis {axis!r} is not an axis of the mesh {sizes}; add it "
                           f"to the mesh (e.g. {{'stage': 4, **mesh}}) or name one of "
                           f"{sorted(sizes)} with pipeline={{'axis': ...}}")
    stages = pipeline.get("stages", sizes[axis])
    if stages != sizes[axis]:
        raise AutoparError(f"pipeline stages={stages!r} but mesh axis {axis!r} has {sizes[axis]} "
                           f"devices: each stage is one slice of that axis; use "
                           f"stages={sizes[axis]} or resize the axis")
    fsdp = pipeline.get("fsdp")
    if fsdp not in (None, True, False):
        raise AutoparError(f"pipeline fsdp={fsdp!r:.40} must be True (shard each layer's "
                           f"parameters over the data axes inside its stage), False, or left "
                           f"out (searched)")
    runtime = pipeline.get("runtime")
    if runtime not in (None, *RUNTIMES):
        raise AutoparError(f"pipeline runtime={runtime!r:.40} must be one of {RUNTIMES} or left "
                           f"out (both priced)")
    pins = Pins(axis, stages, pipeline.get("microbatches"), pipeline.get("schedule"),
                pipeline.get("virtual_stages"), _layer_ranges(pipeline, model, stages), fsdp,
                runtime)
    v = pins.virtual_stages or S.default_virtual(pins.schedule)
    if runtime == "mpmd":
        probe = pins.schedule if pins.schedule in S.ALL + tuple(S.ALIASES) else (
            "zb_v" if v == 2 else "gpipe")          # the schedule, or one the runtime might run
        why = mpmd_supports(S.build(probe, stages, v, stages * v), model.num_layers,
                            fsdp=bool(fsdp))
        if why:
            raise AutoparError(f"pipeline runtime='mpmd' cannot run this pipeline ({why}); "
                               f"leave runtime out (both priced) or use runtime='lockstep'")
    if pins.schedule is not None or pins.microbatches is not None:
        S.check(pins.schedule or "1f1b", stages, v, pins.microbatches or stages * v)
    name = S.check(pins.schedule, stages, v, stages * v) if pins.schedule is not None else None
    if name in S.V_SHAPED and model.num_layers % (stages * v):
        raise AutoparError(f"pipeline schedule={pins.schedule!r} runs {v} equal chunks per stage "
                           f"in a V, and {model.num_layers} layers do not split into "
                           f"{stages * v}; use a stage count whose double divides "
                           f"{model.num_layers}, or schedule='zb_h1' (one chunk per stage)")
    if name in S.SPLIT:
        why = ("the lockstep runtime does not run it" if runtime == "lockstep" else
               mpmd_supports(S.build(name, stages, v, stages * v), model.num_layers,
                             fsdp=bool(fsdp)))
        if why:
            raise AutoparError(f"pipeline schedule={pins.schedule!r} splits each backward into "
                               f"input and weight halves and runs on the MPMD runtime only "
                               f"({why}); choose one of {S.SCHEDULES}")
    if pins.microbatches is not None:
        _check_rows(rows, pins.microbatches, sizes, axis)
    if v > 1 and model.num_layers % (stages * v):
        raise AutoparError(f"{model.num_layers} layers do not split into stages x virtual_stages"
                           f" = {stages * v} equal chunks (virtual stages need equal ones); "
                           f"choose virtual_stages so that {stages} x it divides "
                           f"{model.num_layers}, or virtual_stages=1 (unequal ranges)")
    if model.num_layers < stages:
        raise AutoparError(f"{model.num_layers} layers cannot fill {stages} stages (each needs "
                           f"at least one); use a pipeline axis of at most {model.num_layers}")
    return pins


def _layer_ranges(pipeline: dict, model: StagedModel, stages: int) -> str:
    """``pipeline["layer_ranges"]`` checked: ``"auto"`` (equal chunks or the layer-range DP's
    split, the faster) or ``"equal"`` (equal chunks only, which the layers must allow)."""
    how = pipeline.get("layer_ranges", "auto")
    if how not in LAYER_RANGES:
        raise AutoparError(f"pipeline layer_ranges={how!r:.40} must be one of {LAYER_RANGES}")
    if how == "equal" and model.num_layers % stages:
        raise AutoparError(f"pipeline layer_ranges='equal' but {model.num_layers} layers do not "
                           f"split into {stages} equal stages; use layer_ranges='auto' or a "
                           f"stage count dividing {model.num_layers}")
    return how


def _data_shards(sizes: dict, axis: str) -> int:
    return math.prod(sizes[a] for a in data_axes(sizes, axis))


def _check_rows(rows: int, m: int, sizes: dict, axis: str) -> None:
    shards = _data_shards(sizes, axis)
    if not rows_split(rows, m, shards):
        raise AutoparError(f"a batch of {rows} rows does not split into microbatches={m} of "
                           f"whole rows on each of {shards} data shards; choose microbatches "
                           f"dividing {rows // shards if rows % shards == 0 else rows}")


# ---- stage costs ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds and bytes of one microbatch's pieces, per device of a stage."""

    layer_f: float
    layer_b: float
    embed_f: float
    embed_b: float
    head_f: float
    head_b: float
    layer_peak_bytes: float
    act_bytes: float
    solve_s: float
    residual_bytes: float = 0.0     # what jax.vjp keeps of one layer that grows with the rows
    # ((path below the layer's parameters, layout), ...) and the same for the rest (embedding,
    # head): the parameter layouts every sub-plan was priced with, which the runtime places
    layer_layouts: tuple = ()
    rest_layouts: tuple = ()
    # the data axes each layer's parameters are split over inside its stage (FSDP; (): none):
    # the state holds a shard of them, each action gathers them per layer (module docstring)
    fsdp: tuple = ()
    # with fsdp, per device, one layer's parameters: whole on the data axes, and the
    # (state, gathered, unsharded) bytes of ``fsdp_bytes``, computed once by ``with_fsdp``
    layer_bytes: float = 0.0
    sharded_bytes: tuple = ()
    # a split schedule's layer backward (``autopar.pipeline.split``): the weight half's share of
    # ``layer_b`` by FLOPs, and the bytes of one layer's frontier per device (held from a
    # ``B`` to its ``W``); None where the layer's backward could not be split
    weight_fraction: float | None = None
    frontier_bytes: float = 0.0


def with_fsdp(costs: Costs, model: StagedModel, params, sizes: dict, axes: tuple) -> Costs:
    """``costs`` with the layers FSDP-sharded over ``axes`` (() for none)."""
    if not axes:
        return dataclasses.replace(costs, fsdp=(), layer_bytes=0.0, sharded_bytes=())
    whole = fsdp_bytes(model, params, sizes, dataclasses.replace(costs, fsdp=()))[0]
    sharded = fsdp_bytes(model, params, sizes, dataclasses.replace(costs, fsdp=tuple(axes)))
    return dataclasses.replace(costs, fsdp=tuple(axes), layer_bytes=whole,
                               sharded_bytes=sharded)


def _spec(a, lead=None):
    shape = a.shape if lead is None else (lead, *a.shape[1:])
    return jax.ShapeDtypeStruct(shape, a.dtype)


def _sub_plan(fn, args, submesh: dict, hardware, time_limit_s: float, strategy="auto"):
    from autopar.request import plan_graph

    with without_mesh():
        graph = ir.trace(fn, *args)
    # every input of a sub-plan is on the device: the parameters are the runtime's state and
    # the activations arrive from the previous stage (priced on the timeline), not the host
    return plan_graph(graph, submesh, hardware=hardware, time_limit_s=time_limit_s,
                      deterministic=True, strategy=strategy, host_inputs=False)


def stage_costs(model: StagedModel, params, batch, rows: int, sizes: dict, axis: str,
                hardware, time_limit_s: float = 10.0, strategy="auto") -> Costs:
    """Per-microbatch costs of ``rows`` rows (the whole microbatch, over every data shard), as
    one device of a stage runs them: the data axes are manual in the runtime's shard_map, so a
    device computes its data shard's ``rows / shards`` rows with no data-axis collective (the
    gradients are reduced once per step, after the tick loop: ``price``), planned by the ILP
    (``strategy="auto"``) or a hand-written strategy on the tensor axis alone.

    One set of parameter layouts is priced, the one the runtime places (``Costs.layer_layouts``
    and ``rest_layouts``, recorded in ``PipelinePlan``): the layer's are those its backward
    action's plan (recompute and backward, the bigger action) chooses, the embedding's and head's
    those one plan of both their backward actions chooses; the other sub-plans (the forward
    actions and, for the rest, each backward alone) are then planned with those parameters
    pinned (``ArgLayouts``) and only their activations free."""
    layers, rest = model.split(params)
    layer = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    shard_rows = _shard_rows(rows, sizes, axis)
    mb = jax.tree_util.tree_map(lambda a: _spec(a, shard_rows), batch)
    x = jax.eval_shape(model.embed, rest, mb)
    sub = {a: n for a, n in sizes.items() if a == TENSOR_AXIS} or {"data": 1}
    plan = functools.partial(_sub_plan, submesh=sub, hardware=hardware,
                             time_limit_s=time_limit_s)
    layer_b, embed_b, head_b = _backward_actions(model)
    lb = plan(layer_b, (layer, x, x), strategy=strategy)
    ends = plan(lambda r, b, h, dy: (embed_b(r, b, dy), head_b(r, h, b)), (rest, mb, x, x),
                strategy=strategy)
    layer_layouts, rest_layouts = arg_layouts(lb), arg_layouts(ends)
    auto = strategy == "auto"          # a hand-written stage strategy pins its own layouts
    pin_layer = ArgLayouts(layer_layouts) if auto else strategy
    pin_rest = ArgLayouts(rest_layouts) if auto else strategy
    lf = plan(model.layer, (layer, x), strategy=pin_layer)
    ef = plan(model.embed, (rest, mb), strategy=pin_rest)
    eb = plan(embed_b, (rest, mb, x), strategy=pin_rest)
    hf = plan(model.head_loss, (rest, x, mb), strategy=pin_rest)
    hb = plan(head_b, (rest, x, mb), strategy=pin_rest)
    plans = (lf, lb, ef, eb, hf, hb, ends)
    act = x.size * x.dtype.itemsize
    tensor = sizes.get(TENSOR_AXIS, 1)
    halves = layer_halves(model, layer, x)
    return Costs(*(p.cost.step_time_s for p in plans[:6]), lb.cost.peak_memory_bytes, act,
                 sum(p.solver.solve_s + p.solver.build_s for p in plans),
                 residual_bytes(model.layer, layer, x) / tensor,
                 layer_layouts, rest_layouts,
                 weight_fraction=halves and halves.weight_fraction,
                 frontier_bytes=halves.frontier_bytes / tensor if halves else 0.0)


def layer_halves(model: StagedModel, layer, x):
    """The layer's backward split for zero-bubble schedules (``autopar.pipeline.split``) at
    one layer's parameters and a microbatch's activation, or None where it cannot be cut
    (split schedules are then not candidates: ``runs_on``)."""
    try:
        return split_layer(model.layer, layer, x)
    except Exception:       # noqa: BLE001 - any layer jax traces; only the split is lost
        return None


def runs_on(runtime: str, sch: S.Schedule, layers: int, costs: Costs | None = None) -> bool:
    """Whether ``runtime`` runs ``sch``: the lockstep runtime every schedule but the split
    ones; the MPMD runtime what ``mpmd.supports`` allows, a split schedule only where the
    layer's backward was split (``costs.weight_fraction``)."""
    split = sch.name in S.SPLIT
    if runtime == "lockstep":
        return not split
    fsdp = bool(costs.fsdp) if costs is not None else False
    return not mpmd_supports(sch, layers, fsdp=fsdp) and not (
        split and costs is not None and costs.weight_fraction is None)


# Sub-plans per microbatch size: the six actions' and the one of both backward ends (layouts).
SUB_PLANS = 7


def _backward_actions(model: StagedModel):
    """The runtime's backward actions as functions of (parameters, inputs, cotangent): a layer's
    (its recomputed forward and ``jax.vjp``), the embedding's and the head's (loss gradient
    with respect to the rest and the head's input)."""
    def layer_b(p, h, dy):
        return jax.vjp(model.layer, p, h)[1](dy)

    def embed_b(r, b, dy):
        return jax.vjp(lambda r_: model.embed(r_, b), r)[1](dy)

    return layer_b, embed_b, jax.grad(model.head_loss, argnums=(0, 1))


# ---- stage layouts ----------------------------------------------------------------------------
def arg_layouts(plan) -> tuple:
    """``((path, layout), ...)`` of a sub-plan's first argument (a layer's parameters, or the
    embedding's and head's), each leaf by its key path below that argument ("attn/qkv/kernel")."""
    return tuple((key, layout) for key, layout in
                 zip(map(_below_first_arg, plan.input_paths), plan.input_shardings)
                 if key is not None)


def _below_first_arg(path: str) -> str | None:
    """``"[0]['attn']['qkv']['kernel']"`` -> ``"attn/qkv/kernel"``; None for other arguments."""
    keys = path_keys(path)
    return "/".join(keys[1:]) if keys[:1] == ("0",) else None


@dataclasses.dataclass(frozen=True)
class ArgLayouts:
    """A sub-plan's strategy: the first argument's leaves take ``layouts`` (``arg_layouts``),
    every other input and every activation is the ILP's."""

    layouts: tuple
    name: str = "stage parameter layouts"

    def fix_inputs(self, graph, mesh) -> dict[int, tuple]:
        want = dict(self.layouts)
        keys = map(_below_first_arg, graph.input_paths)
        return {k: want[key] for k, key in enumerate(keys) if key in want}


def residual_bytes(layer_fn, layer, x) -> float:
    """Bytes of what ``jax.vjp(layer_fn, layer, x)`` keeps for the backward that grow with the
    rows of ``x``: the difference at twice the rows (the parameters it keeps by reference do
    not grow). Per device of a tensor-parallel stage it is divided by the tensor size
    (``stage_costs``), as Megatron splits a layer's big activations (attention heads, the MLP's
    hidden); the residual stream's, which stay whole there, are under-counted."""
    def kept(h):
        return jax.tree_util.tree_leaves(jax.vjp(layer_fn, layer, h)[1])

    two = jax.ShapeDtypeStruct((2 * x.shape[0], *x.shape[1:]), x.dtype)
    return _bytes(jax.eval_shape(kept, two)) - _bytes(jax.eval_shape(kept, x))


def _shard_rows(rows: int, sizes: dict, axis: str) -> int:
    shards = _data_shards(sizes, axis)
    if not rows_split(rows, 1, shards):
        raise AutoparError(f"a microbatch of {rows} rows does not split over the {shards} data "
                           f"shards of the mesh {sizes}; use fewer microbatches or a batch whose "
                           f"microbatches are a multiple of {shards} rows")
    return rows // shards


# ---- a candidate priced -----------------------------------------------------------------------
def _bytes(tree, layouts=(), sizes=None) -> float:
    """Bytes of ``tree``'s leaves; with ``layouts`` (``arg_layouts``), per device of ``sizes``'
    mesh: each leaf divided by the sizes of the axes its layout splits it over."""
    want = dict(layouts)

    def split(path) -> int:
        return math.prod(sizes[a] for d in want.get("/".join(key_names(path)), ()) for a in d)

    return float(sum(a.size * a.dtype.itemsize / (split(path) if want else 1)
                     for path, a in jax.tree_util.tree_leaves_with_path(tree)))


def price(model: StagedModel, params, costs: Costs, sizes: dict, axis: str, hw,
          schedule: str, virtual: int, microbatches: int, ranges=None,
          runtime: str = "lockstep") -> PipelinePlan:
    """The ``PipelinePlan`` of one choice, with its predicted time and memory; ``ranges``: the
    layers of each chunk (default equal chunks; unequal ones add the runtime's padding and
    layer moves, ``_layout_overheads``); ``runtime``: the lockstep tick loop or the
    asynchronous MPMD runtime (``mpmd_timeline``)."""
    p = sizes[axis]
    sch = S.build(schedule, p, virtual, microbatches)
    k = sch.chunks
    ranges = equal_ranges(model.num_layers, k) if ranges is None else tuple(map(tuple, ranges))
    length = [b - a for a, b in ranges]

    per_layer = fsdp_layer_s(model, params, costs, sizes, axis, hw)

    split = sch.name in S.SPLIT
    if split and not runs_on(runtime, sch, model.num_layers, costs):
        raise AutoparError(f"schedule {sch.name!r} runs on the MPMD runtime only, and only "
                           f"where the layer's backward splits into input and weight halves "
                           f"(runtime={runtime!r}, split: {costs.weight_fraction is not None})")
    w = costs.weight_fraction or 0.0

    def duration(a: S.Action) -> float:
        if a.kind == "W":                   # the weight half of the layers' backward
            return length[a.chunk] * per_layer["B"] * w
        ends = ((costs.embed_f if a.kind == "F" else costs.embed_b) * (a.chunk == 0)
                + (costs.head_f if a.kind == "F" else costs.head_b) * (a.chunk == k - 1))
        share = 1.0 - w if split and a.kind == "B" else 1.0
        return length[a.chunk] * per_layer[a.kind] * share + ends

    layer_bytes, rest_bytes = _param_bytes(model, params, sizes, costs)
    on = [[length[c] for c in sch.chunks_on(s)] for s in range(p)]  # chunk lengths of stage s
    working = None
    if runtime == "mpmd":
        timeline = mpmd_timeline(sch, sizes, axis, hw, duration, costs.act_bytes)
        # a split schedule's frontiers, each of a whole chunk's layers, weighed in activations
        # and held at the same moments as the stash and inboxes, and each action's working set
        # while it runs (``split_working``), in place of one backward's at every moment
        front = max(length) * costs.frontier_bytes / costs.act_bytes if split else 0.0
        working = split_working(costs, max(length), layer_bytes) if split else None
        slots = S.held_async(timeline, k, p, front, working)
        # in a V the runtime copies each chunk's layers to its stage for the whole step
        # (mpmd._Runner._chunk_view): a stage's share of the stack once more; joining their
        # gradients back (_per_stage) comes after the loop has freed its buffers
        pad = layer_bytes * model.num_layers / p if sch.virtual > 1 else 0.0
    else:
        timeline = loop_timeline(model, params, sizes, axis, hw, sch, ranges, duration,
                                 costs.act_bytes, costs=costs)
        slots = _buffer_slots(sch)
        pad = _layout_overheads(stage_cost_model(hw, sizes), ranges, p, layer_bytes, axis,
                                model.num_layers)[1]
    whole = model.num_layers % p != 0        # the runtime keeps the stack whole on each stage
    memory = tuple(stage_bytes(model.num_layers if whole else sum(n), max(n), layer_bytes,
                               rest_bytes, slot, costs, backward=working is None) + pad
                   for n, slot in zip(on, slots))
    return PipelinePlan(axis, p, ranges, microbatches, sch.name, virtual,
                        timeline.bubble_fraction, timeline.busy_s, memory, S.in_flight(sch),
                        timeline.makespan_s + after_loop_s(model, params, sizes, axis, hw,
                                                           ranges, costs, sch.place),
                        costs.act_bytes, costs.layer_f, costs.layer_b, fsdp=bool(costs.fsdp),
                        runtime=runtime)


def mpmd_timeline(sch: S.Schedule, sizes: dict, axis: str, hw, duration,
                  act_bytes: float) -> S.Timeline:
    """``sch`` run by the MPMD runtime (``autopar.pipeline.mpmd``), priced asynchronously
    (``schedules.price_async``): ``duration(action)`` seconds per action, except the last
    chunk's forward, which only keeps its input (its backward recomputes it); a hop to the
    neighbouring stage on the link its boundary crosses (``boundary_hops_s``: half of one
    activation forward and one cotangent back); the controller's ``pipeline_issue_s`` per
    action; where the profile's devices share their compute (``compute_pool``), the stages
    busy at each moment share it."""
    hops = boundary_hops_s(sizes, axis, hw, act_bytes)
    last = sch.chunks - 1

    def hop(a: S.Action) -> float:
        """The hop of producer ``a``'s result to the stage of the chunk that reads it (only
        called across stages: the V's turn stays on its stage)."""
        here = sch.stage_of(a.chunk)
        there = sch.stage_of(a.chunk + 1 if a.kind == "F" else a.chunk - 1)
        return hops[min(here, there)] / 2

    return S.price_async(sch, lambda a: 0.0 if a.kind == "F" and a.chunk == last
                         else duration(a), hop, hw.pipeline_issue_s,
                         compute_pool(hw, sizes, axis))


def compute_pool(hw, sizes: dict, axis: str) -> float | None:
    """The stages' shared compute in stages at the speed the sub-plans price
    (``schedules.price_async``'s ``pool``), or None where each device computes on its own: the
    profile's ``shared_compute_devices`` (emulated CPU devices, whose rates were measured with
    that many busy) over the devices of one stage (``sizes`` less ``axis``), all of which
    compute when their stage does. Both runtimes' timelines share it: the MPMD one among the
    stages busy at each moment (``mpmd_timeline``), the lockstep one among a tick's busy stages
    (``loop_timeline``: one SPMD program runs them all, so the tick lasts their summed work
    over the pool, not its slowest stage's)."""
    shared = hw.shared_compute_devices
    if shared <= 1:
        return None
    return shared / (math.prod(sizes.values()) // sizes[axis])


def fsdp_layer_s(model: StagedModel, params, costs: Costs, sizes: dict, axis: str,
                 hw) -> dict[str, float]:
    """Seconds one layer adds to a forward ("F") and a backward ("B") action. Without FSDP its
    sub-plans' times. With it, a forward also gathers the layer's sharded parameters over the
    data axes; a backward (``jax.vjp`` of the chunk, each layer under ``jax.checkpoint``) runs
    the layer forward twice (the chunk's recompute, then the checkpoint's), gathers twice and
    reduce-scatters the gradient."""
    if not costs.fsdp:
        return {"F": costs.layer_f, "B": costs.layer_b}
    cm = stage_cost_model(hw, sizes)
    gathered = costs.sharded_bytes[1]
    gather = cm.collective_time_s("all-gather", gathered, costs.fsdp)
    scatter = cm.collective_time_s("reduce-scatter", gathered, costs.fsdp)
    return {"F": costs.layer_f + gather,
            "B": costs.layer_b + costs.layer_f + 2 * gather + scatter}


def fsdp_bytes(model: StagedModel, params, sizes: dict,
               costs: Costs) -> tuple[float, float, float]:
    """(state bytes, gathered bytes, unsharded bytes) of one layer's parameters per device of a
    stage, in the layouts ``runtime.state_specs`` places with ``costs.fsdp``'s data shards: what
    the state holds, what a layer gathers (those leaves whole over the data axes) and what
    stays unsharded (all-reduced after the loop)."""
    from autopar.pipeline.runtime import state_specs

    layers, _ = model.split(params)
    data = {a: sizes[a] for a in costs.fsdp}
    layouts = (costs.layer_layouts, costs.rest_layouts) if (
        costs.layer_layouts or costs.rest_layouts) else None
    specs = model.split(state_specs(model, params, None, TENSOR_AXIS if TENSOR_AXIS in sizes
                                    else None, 1, sizes.get(TENSOR_AXIS, 1), layouts,
                                    data or None))[0]
    state = gathered = unsharded = 0.0
    for leaf, spec in zip(jax.tree_util.tree_leaves(layers), jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        axes = [a for d in tuple(spec)[1:] if d is not None
                for a in (d if isinstance(d, tuple) else (d,))]
        whole = leaf.size * leaf.dtype.itemsize / model.num_layers
        tensor = math.prod(sizes[a] for a in axes if a not in data)
        split = math.prod(sizes[a] for a in axes if a in data)
        state += whole / tensor / split
        if split > 1:
            gathered += whole / tensor
        else:
            unsharded += whole / tensor
    return state, gathered, unsharded


# Copies of the tick's carry (tick_carry_bytes) per tick at hbm_bytes_per_s (XLA copies the
# state threaded through the per-tick lax.switch es): benchmarks/pipeline_cpu.py's calibration
# fitted 0.38 to 1.9 in five runs on the loaded, shared 2-core CPU (median 0.88); not measured on
# GPUs, where the same one copy is assumed.
TICK_CARRY_COPIES = 1.0


def loop_timeline(model: StagedModel, params, sizes: dict, axis: str, hw, sch: S.Schedule,
                  ranges, duration, act_bytes: float, cores: float | None = None,
                  costs: Costs | None = None) -> S.Timeline:
    """The tick loop of ``sch`` priced: ``duration(action)`` seconds per action on its stage
    plus, for a chunk shorter than the longest, its padded slots (``padded_slot_s``), and on
    every tick the runtime's overhead (``tick_overhead_s``) for the busiest stage's
    state (the longest chunk's accumulators). A tick's actions last as long as its slowest
    stage's where each device computes on its own; where the profile's devices share their
    compute (``compute_pool``), as long as their summed work over the pool (``schedules.price``'s
    ``pool``), as the MPMD timeline shares it. ``cores``: for ``duration``s timed one stage
    alone (``benchmarks/pipeline_cpu.py``), how many stages compute at once at that speed, in
    place of the profile's pool; ``costs``: the stage costs whose parameter layouts size the
    state (``_param_bytes``)."""
    layer_bytes, rest_bytes = _param_bytes(model, params, sizes, costs)
    lengths = [b - a for a, b in ranges]
    longest = max(lengths)
    carry = tick_carry_bytes(sch, layer_bytes, longest, rest_bytes, act_bytes)
    slot = padded_slot_s(hw, layer_bytes)

    def padded(a: S.Action) -> float:
        return duration(a) + (longest - lengths[a.chunk]) * slot[a.kind]

    return S.price(sch, padded, cores=cores,
                   tick_s=tick_overhead_s(stage_cost_model(hw, sizes), axis, act_bytes,
                                          carry),
                   pool=None if cores is not None else compute_pool(hw, sizes, axis))


# Passes over one layer's parameters (each a read or a write at hbm_bytes_per_s) that a padded
# slot of a chunk (unequal ranges run padded to the longest chunk, runtime.Actions._layer) still
# makes though it skips the layer, counted from the ops a jax.profiler trace of a 3 + 1 step
# shows per slot (dynamic slices, dynamic-update-slices, the accumulating add). Forward: the
# scan's slice of the slot's parameters (read, write). Backward: that slice for the recomputed
# forward and again for the backward loop (4), the zero gradient the skipped branch writes and
# its write into the chunk's stacked gradient (2), and the accumulation into the (V, Lmax)
# accumulators (read both, write one: 3). benchmarks/pipeline_cpu.py times a padded chunk
# against the unpadded one; per-op launch costs are not counted (they dominate at small widths).
PADDED_SLOT_PASSES = {"F": 2, "B": 9}


def stage_cost_model(hw, sizes: dict, device_nodes=None) -> cost_models.CostModel:
    """The cost model the stage pricing prices its collectives and hops by: ``hw`` on the mesh
    ``sizes``. The pricing sees mesh sizes only (the search prices meshes it has no devices
    for), so the devices' nodes are inferred row-major from ``hw.devices_per_node``, as
    ``boundary_hops_s`` infers them, unless ``device_nodes`` gives them."""
    return cost_models.CostModel(hw, sizes, device_nodes=device_nodes)


def padded_slot_s(hw, layer_bytes: float) -> dict[str, float]:
    """Seconds one padded slot adds to a chunk's forward ("F") and backward ("B") action."""
    return {k: n * layer_bytes / hw.hbm_bytes_per_s for k, n in PADDED_SLOT_PASSES.items()}


def tick_overhead_s(cm, axis: str, act_bytes: float, carry_bytes: float) -> float:
    """Seconds each tick of the runtime costs beyond its actions' work, whatever runs in it:
    the profile's fixed ``pipeline_tick_s`` (the switches' dispatch, the launch of the two
    collective-permutes, measured by ``benchmarks/pipeline_cpu.py``'s calibration on CPU), the
    bytes of those collective-permutes (an activation on, a cotangent back: the runtime sends
    both every tick, zeros when a stage has nothing to send) and ``TICK_CARRY_COPIES`` copies
    of the state the tick threads through its switches (``tick_carry_bytes``)."""
    hw = cm.hw
    permute = (cm.collective_time_s("collective-permute", act_bytes, axis)
               - cm.collective_time_s("collective-permute", 1.0, axis))
    return (hw.pipeline_tick_s + 2 * permute
            + TICK_CARRY_COPIES * carry_bytes / hw.hbm_bytes_per_s)


def after_loop_s(model: StagedModel, params, sizes: dict, axis: str, hw, ranges,
                 costs: Costs | None = None, place: tuple[int, ...] | None = None) -> float:
    """Seconds the step spends after the tick loop: the gradient reductions, the optimizer's
    pass over the busiest stage's parameters and, for unequal ranges or chunks off their
    stage's own layers, the layer moves (parameters in ``costs``' layouts: ``_param_bytes``);
    ``place``: chunk -> stage (``Schedule.place``; default interleaved, ``k % P``)."""
    p = sizes[axis]
    cm = stage_cost_model(hw, sizes)
    length = [b - a for a, b in ranges]
    place = place or placement("1f1b", p, len(ranges) // p)
    on = [[n for n, s_ in zip(length, place) if s_ == s] for s in range(p)]
    layer_bytes, rest_bytes = _param_bytes(model, params, sizes, costs)
    # FSDP-sharded leaves were reduce-scattered in the loop: only the rest is all-reduced here
    synced = costs.sharded_bytes[2] if costs is not None and costs.fsdp else layer_bytes
    sync = _gradient_sync_s(cm, sizes, axis, rest_bytes, synced * max(sum(n) for n in on))
    move_s = _layout_overheads(cm, ranges, p, layer_bytes, axis, model.num_layers)[0]
    optimizer = 12 * max(layer_bytes * sum(n) + rest_bytes for n in on) / hw.hbm_bytes_per_s
    return sync + optimizer + move_s


def _gradient_sync_s(cm, sizes: dict, axis: str, rest_bytes: float, stage_layer_bytes: float):
    """The runtime's gradient reductions after the tick loop: the embedding's and head's over
    the stage and data axes, each stage's layers' over the data axes."""
    data = data_axes(sizes, axis)
    t = cm.collective_time_s("all-reduce", rest_bytes, (axis, *data))
    return t + (cm.collective_time_s("all-reduce", stage_layer_bytes, data) if data else 0.0)


def _layout_overheads(cm, ranges, p: int, layer_bytes: float, axis: str, layers: int):
    """(seconds, bytes per device) the runtime spends moving layers between the state's (L, ...)
    layout (stage ``s`` holds the ``s``-th ``L / P`` layers) and the chunks' (V, Lmax) slots.
    Unequal ranges: each step moves the layers to their stages' padded slots (a
    collective-permute of a stage's share) and gathers the gradients back (an all-reduce of
    the stack over the stage axis); the padded slots' parameters and gradient accumulators and
    the gathered gradients are the extra bytes. Equal ranges with ``V > 1`` chunks per stage:
    chunk ``v P + s`` is not among stage ``s``'s own layers, so the layers go to their chunks
    and the gradients come back by all-to-alls over the stage axis, each a stage's share of
    the stack held as a temporary. Equal ranges, ``V = 1``: a reshape, nothing extra."""
    lengths = [b - a for a, b in ranges]
    stack = layer_bytes * layers
    if len(set(lengths)) == 1:
        if len(ranges) == p:
            return 0.0, 0.0
        return 2 * cm.collective_time_s("all-to-all", stack / p, axis), 2 * stack / p
    move = (cm.collective_time_s("collective-permute", stack / p, axis)
            + cm.collective_time_s("all-reduce", stack, axis))
    return move, 2 * layer_bytes * max(lengths) * len(ranges) / p + stack


def _param_bytes(model: StagedModel, params, sizes: dict,
                 costs: Costs | None = None) -> tuple[float, float]:
    """(bytes of one layer's parameters per device of a stage, bytes of the rest's), in the
    layouts ``costs`` records (``stage_costs``); costs without them (hand-made ones) take the
    layers split over the tensor axis and the rest whole."""
    layers, rest = model.split(params)
    if costs is None or not (costs.layer_layouts or costs.rest_layouts):
        layer, rest_bytes = (_bytes(layers) / model.num_layers / sizes.get(TENSOR_AXIS, 1),
                             _bytes(rest))
    else:
        layer, rest_bytes = (_bytes(layers, costs.layer_layouts, sizes) / model.num_layers,
                             _bytes(rest, costs.rest_layouts, sizes))
    if costs is not None and costs.fsdp:        # the state holds a shard of each layer
        layer = costs.sharded_bytes[0]
    return layer, rest_bytes


def split_working(costs: Costs, longest: int, layer_bytes: float) -> dict:
    """A split schedule's working sets, in activations, while each action runs: ``B`` the
    residuals its forward scan stacks and the frontiers it writes (it computes no weight
    gradient, so no layer's full backward); ``W`` one layer's frontier and gradient (measured
    on CPU: benchmarks/results/pipeline_zero_bubble.md); ``layer_bytes``: one layer's
    parameters per device (``_param_bytes``)."""
    b = longest * (costs.residual_bytes * (longest > 1) + costs.frontier_bytes)
    return {"B": b / costs.act_bytes,
            "W": (costs.frontier_bytes + layer_bytes) / costs.act_bytes}


def stage_bytes(n_layers, longest, layer_bytes: float, rest_bytes: float, slots: int,
                costs: Costs, backward: bool = True):
    """Per-device bytes of a stage holding ``n_layers`` layers (numpy arrays broadcast): its
    parameters and Adam state, old and new, the schedule's buffer slots of one microbatch's
    activation, and the working set of its longest chunk's backward: the residuals its forward
    scan stacks (a one-layer chunk runs without a loop) and one layer's backward beyond the
    parameters and gradients the state counts (module docstring); ``backward=False``: not
    that working set (``slots`` holds the actions' own, ``split_working``)."""
    stacked = longest * costs.residual_bytes * (np.asarray(longest) > 1)
    one_layer = max(costs.layer_peak_bytes - 2 * layer_bytes, 0.0)
    if costs.fsdp:
        # checkpointed layers keep only their inputs for the backward; a layer's backward holds
        # its gathered parameters, not its whole gradient (each weight's is reduce-scattered as
        # it is made): measured on CPU, tests/test_pipeline_plan.py
        stacked = longest * costs.act_bytes * (np.asarray(longest) > 1)
        one_layer = max(costs.layer_peak_bytes - costs.layer_bytes, 0.0)
    if not backward:
        stacked = one_layer = 0.0
    return (STATE_COPIES * (layer_bytes * n_layers + rest_bytes)
            + slots * costs.act_bytes + stacked + one_layer)


def tick_carry_bytes(sch: S.Schedule, layer_bytes: float, longest: int, rest_bytes: float,
                     act_bytes: float) -> float:
    """Per-device bytes of the state each tick of the runtime threads through its two
    ``lax.switch`` es: the stage's gradient accumulators (``V x Lmax`` layer slots and the
    embedding's and head's) and the schedule's buffers (stash and inboxes)."""
    slots = _buffer_slots(sch)[0]
    return layer_bytes * sch.virtual * longest + rest_bytes + slots * act_bytes


def _buffer_slots(sch: S.Schedule) -> tuple[int, ...]:
    """Per stage, the slots the runtime allocates: every stage gets the most any stage needs."""
    n = sum(max(S.allocate(iv).count, 1) for iv in (
        S.stash_intervals(sch), S.inbox_intervals(sch, "F"), S.inbox_intervals(sch, "B")))
    return (n,) * sch.stages


# ---- layer ranges (autopar.pipeline.dp) -------------------------------------------------------
def boundary_hops_s(sizes: dict, axis: str, hw, nbytes: float) -> tuple[float, ...]:
    """Per boundary between stages ``k`` and ``k + 1``: one activation forward and one cotangent
    back on the link that boundary crosses (inter-node when a device of stage ``k`` and its
    partner in stage ``k + 1`` sit in different nodes, devices numbered in mesh order)."""
    ids = np.arange(math.prod(sizes.values())).reshape(tuple(sizes.values()))
    nodes = np.moveaxis(ids, list(sizes).index(axis), 0) // hw.devices_per_node
    cm = stage_cost_model(hw, sizes)
    out = []
    for k in range(sizes[axis] - 1):
        link = hw.inter_node if np.any(nodes[k] != nodes[k + 1]) else hw.intra_node
        out.append(2 * cm.collective_on_link_s("collective-permute", nbytes, 2, link))
    return tuple(out)


def layer_split(model: StagedModel, params, costs: Costs, sizes: dict, axis: str, hw,
                schedule: str, microbatches: int, budget: float, equal: bool = True):
    """The DP's layer ranges for one range per stage (``virtual_stages=1``) under ``schedule``'s
    buffers, or ``None`` when none fits ``budget``. ``equal``: only equal chunks; ``False``
    searches every contiguous split (the runtime runs them padded to the longest chunk)."""
    p, n = sizes[axis], model.num_layers
    slots = _buffer_slots(S.build(schedule, p, 1, microbatches))[0]
    layer_bytes, rest_bytes = _param_bytes(model, params, sizes, costs)
    fb = sum(fsdp_layer_s(model, params, costs, sizes, axis, hw).values())

    def time_of(i, j):
        return ((j - i) * fb + (costs.embed_f + costs.embed_b) * (i == 0)
                + (costs.head_f + costs.head_b) * (j == n))

    def memory_of(k, i, j):
        return stage_bytes(j - i, j - i, layer_bytes, rest_bytes, slots, costs) + 0 * k

    problem = dp.build(n, p, microbatches, time_of, memory_of, budget,
                       boundary_hops_s(sizes, axis, hw, costs.act_bytes),
                       dp.equal_lengths(n, p) if equal else None)
    return dp.solve(problem)


# ---- the search -------------------------------------------------------------------------------
def candidates(pins: Pins, model: StagedModel, rows: int, sizes: dict):
    """(schedule, virtual stages, microbatches) the runtime can run under ``pins``."""
    p = pins.stages
    shards = _data_shards(sizes, pins.axis)
    ms = [pins.microbatches] if pins.microbatches else [
        m for m in (p, 2 * p, 4 * p, 8 * p) if rows_split(rows, m, shards)]
    # the MPMD runtime runs two chunks per stage only in a V (zb_v); the lockstep one up to 4
    vs = [pins.virtual_stages] if pins.virtual_stages else [
        v for v in ((1, 2) if pins.runtime == "mpmd" else (1, 2, 4))
        if (v == 1 and pins.layer_ranges == "auto") or model.num_layers % (p * v) == 0]
    names = [S.check(pins.schedule, p, S.default_virtual(pins.schedule), p)] if pins.schedule \
        else list(S.SCHEDULES if pins.runtime == "lockstep" else S.ALL)
    out = [(n, v, m) for n in names for v in vs for m in ms if S.allows(n, p, v, m)]
    if not out:
        raise AutoparError(f"no pipeline of {p} stages fits a batch of {rows} rows on "
                           f"{shards} data shards and {model.num_layers} layers: the batch "
                           f"needs a multiple of {p * shards} rows; pin microbatches= or "
                           f"change the batch")
    return out


def sub_plan_limit_s(time_limit_s: float, cands) -> float:
    """``SUB_PLANS`` sub-plans per microbatch size share the time limit (the solver's
    deterministic clock scales with it, so the same limit gives the same stage costs)."""
    return max(1.0, time_limit_s / (SUB_PLANS * len({m for _, _, m in cands})))


def choose(model: StagedModel, params, batch, pins: Pins, sizes: dict, hw, budget: float,
           time_limit_s: float = 30.0, stage_strategy="auto") -> PipelinePlan:
    """The fastest candidate that fits ``budget`` bytes per device (else the leanest); stage
    costs from sub-plans under ``stage_strategy`` (the ILP's ``"auto"`` or a hand-written one).
    Each candidate's layer ranges: equal chunks where the layers split so, and with one chunk
    per stage also the layer-range DP's best split (``layer_split``), which the runtime runs
    padded to its longest chunk; both are priced on the schedule's timeline."""
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
    priced = []
    costs_by_rows: dict[int, Costs] = {}
    cands = candidates(pins, model, rows, sizes)
    each_s = sub_plan_limit_s(time_limit_s, cands)
    for name, v, m in cands:
        if rows // m not in costs_by_rows:
            costs_by_rows[rows // m] = stage_costs(model, params, batch, rows // m, sizes,
                                                   pins.axis, hw, each_s, stage_strategy)
        for sharded in _fsdp_choices(pins, sizes, costs_by_rows[rows // m]):
            costs = with_fsdp(costs_by_rows[rows // m], model, params, sizes, sharded)
            priced += _layer_choices(model, params, costs, sizes, pins.axis, hw, name, v, m,
                                     budget, pins.layer_ranges == "auto",
                                     (pins.runtime,) if pins.runtime else RUNTIMES)
    fits = [c for c in priced if max(c.stage_memory_bytes) <= budget]
    best = (min(fits, key=lambda c: (c.step_time_s, max(c.stage_memory_bytes))) if fits
            else min(priced, key=lambda c: (max(c.stage_memory_bytes), c.step_time_s)))
    costs = costs_by_rows[rows // best.microbatches]
    return dataclasses.replace(best, why=_why(best, priced, fits, budget),
                               layer_layouts=costs.layer_layouts,
                               rest_layouts=costs.rest_layouts)


def _fsdp_choices(pins: Pins, sizes: dict, costs: Costs) -> list[tuple]:
    """The data axes FSDP may shard the layers over: none, and (unless pinned off) all of
    them when there is more than one shard and the stage splits no layer over the tensor
    axis. With a tensor split, GSPMD gathers each parameter's tensor-split dims before the
    runtime's manual all-gather over the data axes (XLA:CPU's HLO: all-gathers over the model
    groups at every FSDP gather), so the layers would run whole on the tensor axis, which
    nothing here prices (benchmarks/results/pipeline_fsdp.md: 2.00x measured against 1.27x
    predicted before this was refused)."""
    data = data_axes(sizes, pins.axis)
    sharded = math.prod(sizes[a] for a in data) > 1
    tensor = sorted({k for k, lay in costs.layer_layouts for d in lay for a in d
                     if a == TENSOR_AXIS})
    if pins.fsdp and not sharded:
        raise AutoparError(f"pipeline fsdp=True needs data shards inside a stage, and the mesh "
                           f"{sizes} has none beside the pipeline and tensor axes; add a data "
                           f"axis or drop fsdp")
    if pins.fsdp and tensor:
        raise AutoparError(f"pipeline fsdp=True with layers split over {TENSOR_AXIS!r} inside a "
                           f"stage ({', '.join(tensor[:4])}{' ...' if len(tensor) > 4 else ''}) "
                           f"is not supported: the runtime's all-gather over the data axes makes "
                           f"GSPMD gather the {TENSOR_AXIS!r} split first; drop fsdp, or plan "
                           f"on a mesh without {TENSOR_AXIS!r}")
    if pins.fsdp:
        return [data]
    if pins.fsdp is False or pins.runtime == "mpmd" or not sharded or tensor:
        return [()]
    return [(), data]


def _layer_choices(model, params, costs: Costs, sizes: dict, axis: str, hw, name: str,
                   v: int, m: int, budget: float, split: bool = True,
                   runtimes=RUNTIMES) -> list[PipelinePlan]:
    """One candidate priced with its layer ranges: equal chunks when the layers split into
    them, on each of ``runtimes`` that runs them (the MPMD runtime: ``mpmd.supports``), and
    (one chunk per stage, ``split``) the layer-range DP's best split when it differs (lockstep
    only: it pads unequal chunks)."""
    out = []
    if model.num_layers % (sizes[axis] * v) == 0:
        for runtime in runtimes:
            sch = S.build(name, sizes[axis], v, m)
            if runs_on(runtime, sch, model.num_layers, costs):
                out.append(price(model, params, costs, sizes, axis, hw, name, v, m,
                                 runtime=runtime))
    if v == 1 and split and name not in S.SPLIT:
        free = (layer_split(model, params, costs, sizes, axis, hw, name, m, budget, equal=False)
                or layer_split(model, params, costs, sizes, axis, hw, name, m, math.inf,
                               equal=False))
        if "lockstep" in runtimes and free is not None and not any(
                c.layer_ranges == free.ranges for c in out):
            out.append(price(model, params, costs, sizes, axis, hw, name, 1, m, free.ranges))
    return out


def _why(best: PipelinePlan, priced, fits, budget: float) -> str:
    def row(c):
        layers = "+".join(str(b - a) for a, b in c.layer_ranges)
        return (f"{c.schedule} V={c.virtual_stages} M={c.microbatches} layers {layers}"
                f"{' FSDP' if c.fsdp else ''} ({c.runtime}): step "
                f"{c.step_time_s * 1e3:.3f} ms, bubble {c.bubble_fraction:.1%}, peak "
                f"{max(c.stage_memory_bytes) / 2**30:.3f} GiB")
    head = (f"chose {row(best)}" + ("" if fits else f"; nothing fits {budget / 2**30:.3f} GiB, "
                                    "so the leanest"))
    others = sorted((c for c in priced if c is not best), key=lambda c: c.step_time_s)[:4]
    return head + "".join(f"\n  vs {row(c)}" for c in others)


# ---- the plan ---------------------------------------------------------------------------------
def plan(fn, args, mesh, *, hardware=None, memory_budget=None, pipeline="auto",
         time_limit_s: float = 30.0, strategy="auto", donate_argnums=(), stage_strategy="auto",
         name: str = "pipeline"):
    """``autopar.plan(fn, state, batch, mesh=..., pipeline=...)``: an ``autopar.Plan`` whose
    layouts are the pipelined step's and whose ``pipeline`` is the chosen ``PipelinePlan``.
    ``stage_strategy``: what plans a stage's sub-plans (``megatron_3d`` pins the runtime's
    layouts); ``name``: the plan's ``strategy``."""
    import time

    from autopar.mesh import axis_sizes, hardware_for
    from autopar.pipeline.model import staged_model_of

    t0 = time.perf_counter()
    if strategy not in (None, "auto") or donate_argnums:
        given = "strategy=" if strategy not in (None, "auto") else "donate_argnums="
        raise AutoparError(f"pipeline= does not combine with {given} yet: the stages' layouts "
                           f"are the pipeline's own and the pipelined step donates nothing; "
                           f"drop {given} or drop pipeline=")
    model = staged_model_of(fn, args)
    state, batch = stacked_args(fn, args)
    sizes = axis_sizes(mesh)
    hw = hardware_for(hardware, mesh)
    rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
    pins = parse(pipeline, sizes, model, rows)
    from autopar.validate import memory_budget as parse_budget

    budget = parse_budget(memory_budget)
    budget = hw.memory_bytes if budget is None else budget
    pp = choose(model, model.params_of(state), batch, pins, sizes, hw, budget, time_limit_s,
                stage_strategy)
    if model.stacking is not None:       # the plan's graph: the user's step, stacked layout
        from autopar.pipeline.unrolled import stacked_step

        fn = stacked_step(model.stacking, fn)
    with without_mesh():
        graph = ir.trace(fn, state, batch)
    return _assemble(model, graph, state, batch, pp, sizes, hw, budget,
                     time.perf_counter() - t0, name)


def stacked_args(fn, args, *, run: bool = False):
    """``(state, batch)`` of a pipelined step as shapes in the stacked layout its runtime takes.
    An unrolled model's own layout is converted (shapes only), except when ``run``: then the
    step refuses it and names the conversion (``step.stack_state``)."""
    from autopar.pipeline.model import staged_model_of
    from autopar.pipeline.unrolled import require_stacked, stacked_state

    if len(args) != 2:
        raise AutoparError(f"a pipelined step takes (state, batch); got {len(args)} arguments")
    stacking = staged_model_of(fn, args).stacking
    if run:
        require_stacked(stacking, args[0])
        return args
    state, batch = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tuple(args))
    return stacked_state(stacking, state, abstract=True), batch


def _assemble(model, graph, state, batch, pp: PipelinePlan, sizes, hw, budget, spent_s,
              name: str = "pipeline"):
    from autopar.pipeline.runtime import batch_spec, state_specs
    from autopar.plan import Collective, CostBreakdown, Plan, SolverStats

    tensor = TENSOR_AXIS if TENSOR_AXIS in sizes else None
    fsdp = {a: sizes[a] for a in data_axes(sizes, pp.axis)} if pp.fsdp else None
    specs = (state_specs(model, state, pp.axis, tensor, pp.stages, sizes.get(tensor, 1),
                         pp.stage_layouts(), fsdp),
             jax.tree_util.tree_map(lambda a: batch_spec(a.ndim, sizes, pp.axis), batch))
    ins = tuple(_sharding(s, len(v.shape)) for s, v in zip(
        jax.tree_util.tree_leaves(specs, is_leaf=_is_spec),
        jax.tree_util.tree_leaves((state, batch))))
    outs = ins[:len(jax.tree_util.tree_leaves(state))] + ((),)
    busy = max(pp.stage_time_s)
    comm = pp.step_time_s - busy
    p2p = Collective(f"activations and cotangents between stages ({pp.schedule})",
                     "collective-permute", (pp.axis,), pp.p2p_bytes, comm)
    cost = CostBreakdown(pp.step_time_s, busy, comm, 0.0, max(pp.stage_memory_bytes), budget,
                         (("collective-permute", comm),),
                         comm_bytes_by_kind=(("collective-permute", pp.p2p_bytes),))
    return Plan(tuple(sizes.items()), hw.name, name, graph.fingerprint(),
                graph.input_paths, graph.output_paths,
                tuple(graph.values[v].shape for v in graph.inputs), ins, outs, (), (), (p2p,),
                cost, SolverStats("PIPELINE", 0.0, spent_s, 0.0, 0.0, 0, 0, 0),
                pipeline=pp).with_trees(graph.in_tree, graph.out_tree)


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _sharding(spec, rank: int):
    dims = tuple(spec) + (None,) * (rank - len(spec))
    return tuple(() if d is None else ((d,) if isinstance(d, str) else tuple(d)) for d in dims)


def executable(plan, fn, mesh):
    """The pipelined step that runs ``plan`` (made by ``autopar.plan(..., pipeline=...)``)."""
    from autopar.mesh import concrete_mesh
    from autopar.pipeline.model import staged_model_of
    from autopar.pipeline.runtime import build_step

    pp = plan.pipeline
    if pp is None:
        raise AutoparError("this plan has no pipeline; make it with autopar.plan(..., "
                           "pipeline=...) or run it with autopar.autoparallel(plan=...)")
    sch = S.build(pp.schedule, pp.stages, pp.virtual_stages, pp.microbatches)
    if pp.runtime == "mpmd":
        from autopar.pipeline import mpmd

        return mpmd.build_step(staged_model_of(fn), concrete_mesh(mesh), sch, pp.axis,
                               ranges=pp.layer_ranges, layouts=pp.stage_layouts())
    return build_step(staged_model_of(fn), concrete_mesh(mesh), sch, pp.axis,
                      ranges=pp.layer_ranges, layouts=pp.stage_layouts(), fsdp=pp.fsdp)
