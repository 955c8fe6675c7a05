"""``PipelinePlan``: the pipeline a plan chose, what it predicts, and its JSON form.

``plan.pipeline`` of a plan made with ``autopar.plan(..., pipeline=...)``. Chunk ``k`` of
``layer_ranges`` (layers ``[start, end)``) runs on stage ``chunk_stages()[k]``, the schedule's
placement (``placement``: ``k % stages``, or a V for ``zb_v``); per-stage figures are per device
of that stage and per step.
"""
from __future__ import annotations

import dataclasses

from autopar import jsonread as J
from autopar.errors import PlanError

RUNTIMES = ("lockstep", "mpmd")
FIELDS_INT = ("stages", "microbatches", "virtual_stages")
V_SHAPED = ("zb_v",)            # schedules whose two chunks per stage sit in a V
LAYOUTS = ("layer_layouts", "rest_layouts")     # absent in plans written before them: ()
FIELDS_NUM = ("bubble_fraction", "step_time_s", "p2p_bytes", "layer_forward_s",
              "layer_backward_s")


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    axis: str
    stages: int
    layer_ranges: tuple[tuple[int, int], ...]
    microbatches: int
    schedule: str
    virtual_stages: int
    bubble_fraction: float          # predicted: 1 - busy / (stages x makespan)
    stage_time_s: tuple[float, ...]        # per stage: busy seconds of its actions
    stage_memory_bytes: tuple[float, ...]  # per stage: predicted peak bytes per device
    in_flight: tuple[int, ...]             # per stage: microbatches held at once
    step_time_s: float                     # makespan + gradient sync + optimizer
    p2p_bytes: float                       # per device per hop: one microbatch's activation
    layer_forward_s: float                 # one layer on one microbatch, from the intra-op plan
    layer_backward_s: float                # its recompute + backward
    why: str = ""
    # The parameter layouts inside a stage, on the tensor axis (the stage axis splits the layer
    # stack on top): ((path below one layer's parameters, layout), ...) and ((path below the
    # params without the layers, layout), ...); what the stage costs priced and the runtime
    # places (``planning.stage_costs``, ``runtime.state_specs``).
    layer_layouts: tuple = ()
    rest_layouts: tuple = ()
    # the layers' parameters and Adam moments also sharded over the data axes inside a stage,
    # gathered per layer (runtime.build_step(fsdp=True)); older plans read as False
    fsdp: bool = False
    # what runs it: "lockstep" (one SPMD program, ticks: autopar.pipeline.runtime) or "mpmd"
    # (each stage its own programs, issued asynchronously: autopar.pipeline.mpmd); older plans
    # read as "lockstep"
    runtime: str = "lockstep"

    def chunk_stages(self) -> tuple[int, ...]:
        """Chunk ``k`` -> the stage holding its layers (``placement``)."""
        return placement(self.schedule, self.stages, self.virtual_stages)

    def stage_layouts(self):
        """``(layer_layouts, rest_layouts)`` for ``runtime.state_specs``, or None for a plan
        written before they were recorded (its stages ran the model's Megatron layouts)."""
        if not (self.layer_layouts or self.rest_layouts):
            return None
        return self.layer_layouts, self.rest_layouts

    def summary(self) -> str:
        ms = ", ".join(f"{t * 1e3:.3f}" for t in self.stage_time_s)
        gib = ", ".join(f"{b / 2**30:.3f}" for b in self.stage_memory_bytes)
        return (f"pipeline over {self.axis!r}: {self.stages} stages x {self.virtual_stages} "
                f"virtual, {self.microbatches} microbatches, {self.schedule} on the "
                f"{self.runtime} runtime"
                f"{', FSDP inside stages' if self.fsdp else ''}; predicted bubble "
                f"{self.bubble_fraction:.1%}, step {self.step_time_s * 1e3:.3f} ms; per-stage "
                f"busy ms [{ms}], peak GiB [{gib}], microbatches in flight "
                f"{list(self.in_flight)}")


def from_dict(d, mesh: dict) -> PipelinePlan | None:
    """The ``PipelinePlan`` ``dataclasses.asdict`` wrote, checked; ``None`` stays ``None``."""
    if d is None:
        return None
    J.fields(d, "pipeline", [f.name for f in dataclasses.fields(PipelinePlan)],
             optional=(*LAYOUTS, "fsdp", "runtime"))
    if not isinstance(d.get("fsdp", False), bool):
        raise PlanError(f"pipeline.fsdp must be true or false; got {d['fsdp']!r:.40}")
    if d.get("runtime", "lockstep") not in RUNTIMES:
        raise PlanError(f"pipeline.runtime must be one of {RUNTIMES}; got {d['runtime']!r:.40}")
    if d["axis"] not in mesh:
        raise PlanError(f"pipeline.axis {d['axis']!r} is not an axis of the mesh {mesh}")
    for n in FIELDS_INT:
        J.integer(d[n], f"pipeline.{n}", lo=1)
    for n in FIELDS_NUM:
        J.number(d[n], f"pipeline.{n}")
    ranges = tuple(_range(r, f"pipeline.layer_ranges[{k}]")
                   for k, r in enumerate(J.seq(d["layer_ranges"], "pipeline.layer_ranges")))
    if len(ranges) != d["stages"] * d["virtual_stages"]:
        raise PlanError(f"pipeline.layer_ranges has {len(ranges)} chunks, not stages x "
                        f"virtual_stages = {d['stages'] * d['virtual_stages']}")
    per_stage = {n: tuple(J.number(x, f"pipeline.{n}[{k}]")
                          for k, x in enumerate(J.seq(d[n], f"pipeline.{n}", d["stages"])))
                 for n in ("stage_time_s", "stage_memory_bytes", "in_flight")}
    J.text(d["schedule"], "pipeline.schedule")
    J.text(d["why"], "pipeline.why")
    layouts = {n: _layouts(d.get(n, []), mesh, f"pipeline.{n}") for n in LAYOUTS}
    return PipelinePlan(**{**d, "layer_ranges": ranges, **per_stage, **layouts})


def _layouts(x, mesh: dict, where: str) -> tuple:
    from autopar.sharding import layout

    out = []
    for k, item in enumerate(J.seq(x, where)):
        path, value = J.seq(item, f"{where}[{k}]", 2)
        out.append((J.text(path, f"{where}[{k}]"),
                    layout(value, mesh, f"{where}[{k}] ({path})", PlanError)))
    return tuple(out)


def _range(x, where: str) -> tuple[int, int]:
    start, end = (J.integer(i, where) for i in J.seq(x, where, 2))
    if not start < end:
        raise PlanError(f"{where} must be [start, end) with 0 <= start < end; got {x!r}")
    return start, end


def placement(schedule: str, stages: int, virtual: int) -> tuple[int, ...]:
    """Chunk ``k`` -> the stage that holds it under the canonical ``schedule`` name: ``k % P``
    (each stage's virtual stages interleaved), or for a V-shaped schedule (``V_SHAPED``,
    ``V = 2``) ``k`` for ``k < P`` and ``2 P - 1 - k`` after, so the model goes down the stages
    and back up, and the turn (chunks ``P - 1`` and ``P``) and the ends (chunks ``0`` and
    ``2 P - 1``) share a stage. Here, below the schedules (``autopar.pipeline.schedules``), as
    the plan's record reads it too."""
    if schedule in V_SHAPED:
        return tuple(k if k < stages else 2 * stages - 1 - k for k in range(stages * virtual))
    return tuple(k % stages for k in range(stages * virtual))
