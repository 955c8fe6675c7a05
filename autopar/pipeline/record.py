"""``PipelinePlan``: the pipeline a plan chose, what it predicts, and its JSON form.

``plan.pipeline`` of a plan made with ``autopar.plan(..., pipeline=...)``. Chunk ``k`` of
``layer_ranges`` (layers ``[start, end)``) runs on stage ``k % stages``; per-stage figures are
per device of that stage and per step.
"""
from __future__ import annotations

import dataclasses
import numbers

from autopar.errors import PlanError

FIELDS_INT = ("stages", "microbatches", "virtual_stages")
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

    def summary(self) -> str:
        ms = ", ".join(f"{t * 1e3:.3f}" for t in self.stage_time_s)
        gib = ", ".join(f"{b / 2**30:.3f}" for b in self.stage_memory_bytes)
        return (f"pipeline over {self.axis!r}: {self.stages} stages x {self.virtual_stages} "
                f"virtual, {self.microbatches} microbatches, {self.schedule}; predicted bubble "
                f"{self.bubble_fraction:.1%}, step {self.step_time_s * 1e3:.3f} ms; per-stage "
                f"busy ms [{ms}], peak GiB [{gib}], microbatches in flight "
                f"{list(self.in_flight)}")


def from_dict(d, mesh: dict) -> PipelinePlan | None:
    """The ``PipelinePlan`` ``dataclasses.asdict`` wrote, checked; ``None`` stays ``None``."""
    if d is None:
        return None
    names = [f.name for f in dataclasses.fields(PipelinePlan)]
    if not isinstance(d, dict) or sorted(d) != sorted(names):
        raise PlanError(f"pipeline must be null or an object with fields {names}; got "
                        f"{d!r:.120}")
    if d["axis"] not in mesh:
        raise PlanError(f"pipeline.axis {d['axis']!r} is not an axis of the mesh {mesh}")
    for n in FIELDS_INT:
        if isinstance(d[n], bool) or not isinstance(d[n], int) or d[n] < 1:
            raise PlanError(f"pipeline.{n} must be an integer >= 1; got {d[n]!r}")
    for n in FIELDS_NUM:
        _num(d[n], f"pipeline.{n}")
    ranges = tuple(_pair(r, f"pipeline.layer_ranges[{k}]")
                   for k, r in enumerate(_list(d["layer_ranges"], "pipeline.layer_ranges")))
    if len(ranges) != d["stages"] * d["virtual_stages"]:
        raise PlanError(f"pipeline.layer_ranges has {len(ranges)} chunks, not stages x "
                        f"virtual_stages = {d['stages'] * d['virtual_stages']}")
    per_stage = {n: tuple(_list(d[n], f"pipeline.{n}")) for n in
                 ("stage_time_s", "stage_memory_bytes", "in_flight")}
    for n, v in per_stage.items():
        if len(v) != d["stages"]:
            raise PlanError(f"pipeline.{n} has {len(v)} entries, one per stage ({d['stages']}) "
                            f"expected")
        for k, x in enumerate(v):
            _num(x, f"pipeline.{n}[{k}]")
    if not isinstance(d["schedule"], str) or not isinstance(d["why"], str):
        raise PlanError("pipeline.schedule and pipeline.why must be strings")
    return PipelinePlan(**{**d, "layer_ranges": ranges, **per_stage})


def _list(x, where: str) -> list:
    if not isinstance(x, list):
        raise PlanError(f"{where} must be a JSON list; got {x!r:.80}")
    return x


def _pair(x, where: str) -> tuple[int, int]:
    v = _list(x, where)
    if len(v) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in v) \
            or not 0 <= v[0] < v[1]:
        raise PlanError(f"{where} must be [start, end) with 0 <= start < end; got {x!r}")
    return v[0], v[1]


def _num(x, where: str) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not x >= 0:
        raise PlanError(f"{where} must be a number >= 0; got {x!r:.80}")
