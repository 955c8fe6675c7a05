"""Meshes as users give them (``jax.sharding.Mesh``, ``AbstractMesh``, a dict of axis sizes)."""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from autopar.errors import ShardingError


def axis_sizes(mesh) -> dict[str, int]:
    """Ordered axis name -> size of any accepted mesh form."""
    if isinstance(mesh, Mapping):
        sizes = dict(mesh)
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
        sizes = dict(mesh.shape)
    else:
        raise ShardingError(f"mesh={mesh!r} is not a jax.sharding.Mesh, AbstractMesh or dict of "
                            f"axis sizes; pass e.g. mesh={{'data': 2, 'model': 4}}")
    for name, n in sizes.items():
        if not isinstance(name, str) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ShardingError(f"mesh axis {name!r} has size {n!r}; axis names are strings and "
                                f"sizes positive integers, e.g. {{'data': 2, 'model': 4}}")
    return {k: int(v) for k, v in sizes.items()}


def concrete_mesh(mesh) -> Mesh:
    """A device mesh with Auto axes for codegen; dicts are laid over the local devices."""
    if isinstance(mesh, Mesh):
        devices = mesh.devices
        names = mesh.axis_names
    else:
        sizes = axis_sizes(mesh)
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
