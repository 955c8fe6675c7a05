"""The mesh's shape as a planner decision.

``mesh=`` may leave the shape open: a device count (``mesh=8``), a list of devices, or a dict
whose open axes are ``None`` (``{"data": None, "model": None}``, or ``{"data": 2, "model":
None}`` with some fixed). Counts and device lists open the axes ``data`` and ``model``; a dict
shares the devices present (``jax.device_count()``) among its open axes once its fixed ones are
taken.

Every way of giving the open axes sizes that multiply to the devices left is a candidate, except
where the last axis would cross a node boundary: the mesh's devices are laid out in order, so
the minor axis holds consecutive devices, and it is where tensor parallelism's frequent
collectives go: its size must divide the hardware profile's ``devices_per_node``, as Megatron-LM
keeps its tensor-parallel groups on NVLink. With ``pipeline=`` a count opens ``stage`` (at
least 2), ``data`` and ``model``, and each shape is planned by the pipeline planner. The step
is traced once and each candidate is planned on it (the call's time limit shared among them);
the fastest plan that fits the memory budget wins (a pipelined step is traced per shape).
``Plan.mesh`` is the shape it chose; ``Plan.mesh_candidates`` every shape tried, with its
predicted step and peak or why it has no plan, and the summary shows them.

A count or a device list opens an ``expert`` axis too (between ``data`` and ``model``:
``EXPERT_AXES``) when the step has a mixture of experts' stacked expert weights, so the planner
picks the expert-parallel degree with the others; a dict opens the axes it names. A pipeline's
open mesh (``stage``, ``data``, ``model``) has no expert axis. ``compare`` and ``megatron_3d``
take a mesh of fixed shape.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from autopar.errors import AutoparError, BudgetError, PlanError, ShardingError
from autopar.plan import MeshCandidate, Plan

OPEN_AXES = ("data", "model")
EXPERT_AXES = ("data", "expert", "model")     # what a count opens for a mixture of experts


@dataclasses.dataclass(frozen=True)
class OpenMesh:
    """A mesh whose shape is left to the planner: ``axes`` in mesh order, ``None`` where open;
    ``devices`` how many devices it spans; ``device_list`` the devices to lay it over (``None``:
    the ones present, in order)."""

    axes: tuple[tuple[str, int | None], ...]
    devices: int
    device_list: tuple | None = None

    def shapes(self, devices_per_node: int, at_least: Mapping[str, int] | None = None
               ) -> list[dict]:
        """Every shape the planner may choose, in a fixed order (first axis largest first);
        ``at_least``: open axes' smallest sizes (a pipeline's stage axis: 2)."""
        fixed = math.prod(n for _, n in self.axes if n is not None)
        if self.devices % fixed:
            raise ShardingError(f"mesh={dict(self.axes)}: its fixed axes take {fixed} devices, "
                                f"which do not divide the {self.devices} there are; fix sizes "
                                f"that divide {self.devices} or leave them open (None)")
        open_axes = [a for a, n in self.axes if n is None]
        out = []
        for sizes in _factorisations(self.devices // fixed, len(open_axes)):
            chosen = dict(zip(open_axes, sizes))
            shape = {a: chosen.get(a, n) for a, n in self.axes}
            minor = list(shape.values())[-1]
            if devices_per_node % minor == 0 and all(
                    chosen.get(a, n) >= n for a, n in (at_least or {}).items()):
                out.append(shape)
        if not out:
            raise ShardingError(f"mesh={dict(self.axes)} over {self.devices} devices: every shape "
                                f"puts its last axis across a node boundary "
                                f"({devices_per_node} devices per node) or leaves a pipeline "
                                f"fewer than 2 stages; open more axes, or fix the last one to "
                                f"a size that divides {devices_per_node}")
        return out


def is_open(mesh) -> bool:
    """Whether ``mesh`` leaves its shape to the planner (see the module docstring)."""
    if isinstance(mesh, (bool, np.bool_)):
        return False
    if isinstance(mesh, (int, np.integer)):
        return True
    if isinstance(mesh, Mapping):
        return any(v is None for v in mesh.values())
    return isinstance(mesh, (list, tuple)) and bool(mesh) and all(
        isinstance(d, jax.Device) for d in mesh)


def open_mesh(mesh, axes: Sequence[str] = OPEN_AXES) -> OpenMesh:
    """``mesh`` (an open form, ``is_open``) checked and made an ``OpenMesh``; ``axes``: the
    axes a count or a device list opens."""
    if isinstance(mesh, (int, np.integer)):
        if mesh < 1:
            raise ShardingError(f"mesh={mesh}: a device count is an integer >= 1, e.g. mesh=8")
        return OpenMesh(tuple((a, None) for a in axes), int(mesh))
    if isinstance(mesh, Mapping):
        for name, n in mesh.items():
            if not isinstance(name, str) or not name:
                raise ShardingError(f"mesh axis name {name!r} in {dict(mesh)} must be a "
                                    f"non-empty string")
            if n is not None and (isinstance(n, (bool, np.bool_)) or not isinstance(
                    n, (int, np.integer)) or n < 1):
                raise ShardingError(f"mesh axis {name!r} has size {n!r}; give an integer >= 1, "
                                    f"or None to leave it to the planner")
        return OpenMesh(tuple((a, None if n is None else int(n)) for a, n in mesh.items()),
                        jax.device_count())
    if len({id(d) for d in mesh}) != len(mesh):
        raise ShardingError(f"mesh= lists {len(mesh)} devices with repeats; give each device "
                            f"once")
    return OpenMesh(tuple((a, None) for a in axes), len(mesh), tuple(mesh))


def concrete(mesh, sizes: Mapping[str, int]):
    """The device mesh of the shape the search chose for the open ``mesh``, with Auto axes (see
    ``mesh.concrete_mesh``): over the listed devices, or the ones present."""
    from autopar.mesh import concrete_mesh

    if not isinstance(mesh, (list, tuple)):
        return concrete_mesh(dict(sizes))
    devices = np.array(mesh, dtype=object).reshape(tuple(sizes.values()))
    return concrete_mesh(jax.sharding.Mesh(devices, tuple(sizes)))


def checked(mesh, hardware, axes: Sequence[str] = OPEN_AXES,
            at_least: Mapping[str, int] | None = None):
    """``(hardware profile, shapes)`` of the open ``mesh``: its form checked, the profile
    resolved (``hardware``), every shape the planner may choose (``OpenMesh.shapes``)."""
    om = open_mesh(mesh, axes)
    hw = hardware_of(hardware, om)
    return hw, om.shapes(hw.devices_per_node, at_least)


def hardware_of(hardware, om: OpenMesh):
    """The hardware profile: ``hardware`` if given, else that of the devices the mesh is laid
    over (the listed ones, or the present ones when they number the count), else H100's."""
    from autopar.mesh import hardware_for

    devices = om.device_list
    if devices is None and om.devices == jax.device_count():
        devices = tuple(jax.devices())
    if hardware is not None or devices is None:
        return hardware_for(hardware, {"data": om.devices})
    return hardware_for(None, jax.sharding.Mesh(np.array(devices, dtype=object), ("all",)))


def _factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ``k``-tuple of positive integers whose product is ``n``, first entry descending."""
    if k == 0:
        return [()] if n == 1 else []
    if k == 1:
        return [(n,)]
    out = []
    for d in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        out += [(d, *rest) for rest in _factorisations(n // d, k - 1)]
    return out


def plan_over_shapes(shapes: Sequence[dict], plan_one: Callable[[dict, float], Plan],
                     time_limit_s: float) -> Plan:
    """Plan every shape (``plan_one(sizes, time_limit_s)``, the limit shared evenly) and return
    the fastest plan that fits, carrying every candidate (``Plan.mesh_candidates``), fastest
    first, then the shapes without a plan. ``BudgetError`` when none fits a budget,
    ``PlanError`` when no shape could be planned at all."""
    share = max(time_limit_s / len(shapes), 1.0)
    tried: list[tuple[dict, Plan | None, str]] = []
    for sizes in shapes:
        try:
            tried.append((sizes, plan_one(sizes, share), ""))
        except AutoparError as e:      # this shape has no plan (or takes no pipeline); others may
            tried.append((sizes, None, f"{type(e).__name__}: {e}"))
    planned = [(s, p) for s, p, _ in tried if p is not None]
    if not planned:
        lines = "\n  ".join(f"{s}: {err[:300]}" for s, _, err in tried)
        error = (BudgetError if all(err.startswith("BudgetError") for *_, err in tried)
                 else PlanError)
        raise error(f"no mesh shape has a plan:\n  {lines}")
    ranked = sorted(planned, key=lambda sp: sp[1].cost.step_time_s)
    candidates = tuple(
        MeshCandidate(tuple(s.items()), float(p.cost.step_time_s),
                      float(p.cost.peak_memory_bytes), "")
        for s, p in ranked) + tuple(
        MeshCandidate(tuple(s.items()), None, None, err[:500]) for s, p, err in tried
        if p is None)
    return dataclasses.replace(ranked[0][1], mesh_candidates=candidates)


def check_not_open(mesh, where: str) -> None:
    """Refuse an open mesh where the shape cannot be a decision (yet)."""
    if is_open(mesh):
        raise AutoparError(f"{where} takes a mesh of fixed shape; mesh={mesh!r} leaves it to "
                           f"the planner, which autopar.plan decides (and autoparallel without "
                           f"pipeline=). Give the sizes, e.g. mesh={{'data': 2, 'model': 4}}")
