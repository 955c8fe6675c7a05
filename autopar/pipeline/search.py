"""Pipelines over mesh shapes: stage counts x tensor degrees x microbatches x schedules.

Alpa's outer loop, analytic: for ``n`` devices, every mesh ``{stage: S, data: n / (S T), model:
T}`` with ``T`` inside one node and ``2 <= S <= L``; for each, microbatches of ``b`` rows per data
shard (``M = B / (d b)``, at least ``S``), every schedule and virtual-stage count the runtime
runs. A candidate's stage costs come from ``planning.stage_costs`` (the intra-op plan of one layer,
the embedding and the head on the submesh ``{data: d, model: T}``), its layer ranges from the
layer-range DP (``planning.layer_split``: equal chunks, and separately the best unrestricted
split, which the runtime runs padded to its longest chunk) and its time and memory from
``planning.price``.
Used by ``benchmarks/pipeline_3d.py``; ``autopar.plan(..., pipeline=...)`` plans one given mesh.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from autopar.pipeline import planning as PL
from autopar.pipeline import schedules as S
from autopar.pipeline.record import RUNTIMES, PipelinePlan


@dataclasses.dataclass(frozen=True)
class Choice:
    """One candidate: its mesh, the equal-chunk plan (``None`` when the layers do not split
    equally) and, for ``virtual_stages=1``, the DP's best unequal split on the same costs
    (``None`` when it equals the equal one), which the runtime runs padded."""

    mesh: tuple[tuple[str, int], ...]
    plan: PipelinePlan | None
    unequal: PipelinePlan | None = None

    @property
    def sizes(self) -> dict:
        return dict(self.mesh)


def meshes(devices: int, layers: int, devices_per_node: int, tensor: Iterable[int] = (2, 4, 8),
           axis: str = "stage") -> list[dict]:
    """``{axis: S, "data": d, "model": T}`` with ``S d T = devices``, ``T`` within a node."""
    out = []
    for t in tensor:
        if t > devices_per_node or devices % t:
            continue
        for s in range(2, min(layers, devices // t) + 1):
            if (devices // t) % s == 0:
                out.append({axis: s, "data": devices // (t * s), "model": t})
    return out


def fits_parameters(model, params, sizes: dict, budget: float, axis: str = "stage") -> bool:
    """False when a stage's parameters and Adam state alone exceed ``budget`` (a cheap lower
    bound that skips planning hopeless meshes), every parameter split over the tensor axis as
    the stage's plan may split it: the rest too (the ILP lays the embedding and the head out
    vocabulary-parallel). Counting the rest whole refused GPT-310.1B at Megatron-LM's
    (t, p, d) = (8, 16, 15), whose plans fit 80 GiB at 61 GiB."""
    layer_bytes, rest_bytes = PL._param_bytes(model, params, sizes)
    rest_bytes /= sizes.get(PL.TENSOR_AXIS, 1)
    per_stage = layer_bytes * -(-model.num_layers // sizes[axis]) + rest_bytes
    return PL.STATE_COPIES * per_stage <= budget


def microbatch_counts(rows: int, sizes: dict, rows_per_shard: Iterable[int],
                      axis: str = "stage") -> list[int]:
    d = sizes["data"]
    return [rows // (d * b) for b in rows_per_shard
            if rows % (d * b) == 0 and rows // (d * b) >= sizes[axis]]


def evaluate(model, params, costs: PL.Costs, sizes: dict, hw, budget: float, schedule: str,
             virtual: int, microbatches: int, axis: str = "stage",
             runtimes=RUNTIMES) -> Choice | None:
    """One candidate priced: ``plan`` with equal chunks when the layers split so, else
    ``None``, on the faster of ``runtimes`` that runs it (that fits ``budget``, where one
    does; where none of them can, the lockstep runtime); ``unequal`` the DP's best split when
    it differs (``virtual_stages=1`` only, on the lockstep runtime); ``None`` when neither
    exists."""
    p = sizes[axis]
    if not S.allows(schedule, p, virtual, microbatches) or (
            virtual > 1 and model.num_layers % (p * virtual)):
        return None
    plan = None
    if model.num_layers % (p * virtual) == 0:
        sch = S.build(schedule, p, virtual, microbatches)
        usable = ([rt for rt in runtimes if PL.runs_on(rt, sch, model.num_layers, costs)]
                  or ["lockstep"] * (schedule not in S.SPLIT))
        priced = [PL.price(model, params, costs, sizes, axis, hw, schedule, virtual,
                           microbatches, runtime=rt) for rt in usable]
        fits = [c for c in priced if max(c.stage_memory_bytes) <= budget] or priced
        plan = min(fits, key=lambda c: c.step_time_s, default=None)
    unequal = None
    if virtual == 1 and schedule not in S.SPLIT:
        free = PL.layer_split(model, params, costs, sizes, axis, hw, schedule, microbatches,
                              budget, equal=False)
        if free is not None and (plan is None or free.ranges != plan.layer_ranges):
            unequal = PL.price(model, params, costs, sizes, axis, hw, schedule, 1, microbatches,
                               free.ranges)
    if plan is None and unequal is None:
        return None
    return Choice(tuple(sizes.items()), plan, unequal)


def best(choices: Iterable[Choice | None], budget: float,
         key: Callable[[Choice], PipelinePlan] = lambda c: c.plan) -> Choice | None:
    """The fastest choice whose plan (``key``) exists and fits ``budget``."""
    fits = [c for c in choices if c is not None and key(c) is not None
            and max(key(c).stage_memory_bytes) <= budget]
    return min(fits, key=lambda c: (key(c).step_time_s, max(key(c).stage_memory_bytes)),
               default=None)
