"""Meshes as users give them (``jax.sharding.Mesh``, ``AbstractMesh``, a dict of axis sizes)."""
from __future__ import annotations

import contextlib
import contextvars
import math
from collections import Counter
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from autopar.errors import ShardingError

_EXAMPLE = "e.g. mesh={'data': 2, 'model': 4} or jax.make_mesh((2, 4), ('data', 'model'))"


def axis_sizes(mesh) -> dict[str, int]:
    """Ordered axis name -> size of any accepted mesh form, checked: names are distinct non-empty
    strings, sizes integers >= 1 (a repeated name would silently merge two axes), and a device
    mesh's devices distinct."""
    if isinstance(mesh, Mapping):
        pairs = list(mesh.items())
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "axis_sizes"):
        pairs = list(zip(mesh.axis_names, mesh.axis_sizes))
    else:
        raise ShardingError(f"mesh={mesh!r} ({type(mesh).__name__}) is not a jax.sharding.Mesh, "
                            f"AbstractMesh or dict of axis sizes; {_EXAMPLE}")
    if not pairs:
        raise ShardingError(f"mesh={mesh!r} has no axes; a single device is mesh={{'data': 1}}")
    twice = [n for n, c in Counter(name for name, _ in pairs).items() if c > 1]
    if twice:
        raise ShardingError(f"mesh {pairs} repeats the axis name {twice[0]!r}; each axis needs "
                            f"its own name, {_EXAMPLE}")
    for name, n in pairs:
        if not isinstance(name, str) or not name:
            raise ShardingError(f"mesh axis name {name!r} in {pairs} must be a non-empty string; "
                                f"{_EXAMPLE}")
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ShardingError(f"mesh axis {name!r} has size {n!r}; sizes are integers >= 1, "
                                f"{_EXAMPLE}")
    sizes = {k: int(v) for k, v in pairs}
    if isinstance(mesh, Mesh):
        _check_distinct_devices(mesh.devices, sizes)
    return sizes


def concrete_mesh(mesh) -> Mesh:
    """A device mesh with Auto axes for codegen; dicts are laid over the local devices."""
    sizes = axis_sizes(mesh)   # the same checks as a planned mesh: distinct names, sizes >= 1
    if isinstance(mesh, Mesh):
        devices = mesh.devices
        names = mesh.axis_names
    else:
        n = math.prod(sizes.values())
        have = jax.devices()
        if n != len(have):
            raise ShardingError(
                f"mesh {sizes} has {n} devices but {len(have)} are present "
                f"({have[0].platform}); to run, give a mesh whose sizes multiply to {len(have)}, "
                f"or use autopar.plan(...) to plan for a cluster that is not here")
        devices = np.array(have).reshape(tuple(sizes.values()))
        names = tuple(sizes)
    # The plan, not sharding-in-types, decides every layout: run on Auto axes, where sharding
    # constraints steer XLA's partitioner (Explicit axes would ask for out_sharding on every dot).
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _check_distinct_devices(devices: np.ndarray, sizes: dict[str, int]) -> None:
    """A device listed twice would hold two shards at once (jax fails deep inside with a
    ``safe_zip`` length error): name it and where it repeats."""
    seen: dict[int, tuple[int, ...]] = {}
    for index, d in np.ndenumerate(devices):
        if d.id in seen:
            raise ShardingError(
                f"mesh {sizes} lists device {d.id} ({d.platform}) twice, at positions "
                f"{seen[d.id]} and {index}: each position of a mesh is its own device; build it "
                f"from distinct devices, e.g. Mesh(np.array(jax.devices()[:n]).reshape(shape), "
                f"names)")
        seen[d.id] = index


# While autopar itself holds a context mesh (``on_mesh``): the caller's context mesh as it was
# when autopar set its own, the one a trace takes its axes from (``caller_axes``).
_OUTSIDE = object()
_CALLER_MESH = contextvars.ContextVar("autopar_caller_mesh", default=_OUTSIDE)


@contextlib.contextmanager
def on_mesh(mesh: Mesh):
    """Lower and run under ``mesh`` (Auto axes) as the context mesh, whatever mesh the caller set
    with ``jax.set_mesh``: under an Explicit context mesh jax rejects the plan's Auto-axis values
    ("context mesh should match the aval mesh")."""
    token = _CALLER_MESH.set(_callers())
    try:
        with _context(mesh):
            yield
    finally:
        _CALLER_MESH.reset(token)


def _callers():
    """The caller's context mesh: the one in force, unless autopar set it (``on_mesh``)."""
    held = _CALLER_MESH.get()
    return jax.sharding.get_abstract_mesh() if held is _OUTSIDE else held


def without_mesh():
    """Trace with no context mesh: the caller's ``jax.set_mesh`` would otherwise bake its
    shardings into the traced ops, and the plan (not the context) decides every layout."""
    return _context(None)


@contextlib.contextmanager
def caller_axes():
    """Trace under the axes of the caller's context mesh (``jax.set_mesh``), all of them Auto,
    or under none where the caller set none: the step's own sharding constraints are then traced
    as the caller's ``jax.jit`` would see them (flax's ``nn.with_logical_constraint`` makes one
    only under a mesh), while no Explicit sharding is baked into the traced types. The plan
    still decides every layout: codegen runs the plan's in place of each constraint
    (``autopar.planner.constraints``)."""
    outer = _callers()
    with _context(None):
        if outer is None or outer.empty:
            yield
            return
        auto = jax.sharding.AbstractMesh(tuple(outer.axis_sizes), tuple(outer.axis_names),
                                         axis_types=(AxisType.Auto,) * len(
                                             outer.axis_names))
        with jax.sharding.use_abstract_mesh(auto):
            yield


def _context(mesh: Mesh | None):
    try:
        return jax.set_mesh(mesh)
    except ValueError as e:   # jax allows set_mesh only outside of traced functions
        raise ShardingError(f"autopar was called inside a traced function (jax.jit, grad, vmap, "
                            f"...): {e}. Plan and call the autoparallel step outside them, or "
                            f"transform the function first, e.g. autoparallel(jax.grad(loss), "
                            f"mesh=...)") from None


def hardware_for(hardware, mesh):
    """The ``cost_models.Hardware`` of ``hardware`` (a name or profile), or by default the one
    of ``mesh``'s devices (``default_hardware``)."""
    import cost_models

    return cost_models.hardware(hardware if hardware is not None else default_hardware(mesh))


def default_hardware(mesh) -> str:
    if isinstance(mesh, Mesh):
        kind = str(mesh.devices.flat[0].device_kind).lower()
        platform = mesh.devices.flat[0].platform
        if platform == "cpu":
            return "cpu"
        for name in ("h200", "h100", "a100"):
            if name in kind:
                return name
    return "h100"
