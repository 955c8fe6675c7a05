"""The cost model the planner queries: op times, collective times, per-device bytes on a mesh.

Mesh layout: ``mesh_shape`` is an ordered mapping axis name -> size laid row-major over device
ids, so axis ``i`` has stride ``s_i = prod(sizes of later axes)``. A group along axis ``i`` covers
``s_i * size_i`` consecutive devices; when that exceeds ``devices_per_node`` its devices sit in
several nodes and the group pays ``hw.inter_node`` (``axis_link``). A group over several axes pays
the slowest link among them (``group_link``).

Row-major ids are a guess about a cluster that is not present. For a real mesh, pass
``device_nodes``: the node (host) of every device in mesh order, e.g. from each device's
``process_index``. An axis then pays ``hw.inter_node`` exactly when one of its groups holds
devices of two nodes, whatever the device ids or ``devices_per_node`` say.

Collectives use the ring formulas of ``cost_models.collectives`` with bandwidth
``B = link bandwidth * collective_efficiency * kind efficiency``, plus the fixed
``collective_launch_s`` (``collective_time_s``).
Compute uses the roofline of ``cost_models.compute`` (``compute_time_s``, ``op_time_s``).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cost_models.collectives import COLLECTIVE_RULES
from cost_models.compute import CONV_PRIMS, MATMUL_PRIMS, roofline_time_s
from cost_models.hardware import FALLBACK_DTYPE, CostModelError, Hardware, Link, hardware
from ir.graph import Op, TensorType

# Op params that name the op's result dtype, in the order they are consulted.
_DTYPE_PARAMS: tuple[str, ...] = ("preferred_element_type", "new_dtype", "dtype")

AxisSpec = Sequence[str] | str | None


@dataclasses.dataclass(frozen=True, init=False)
class CostModel:
    """Hardware plus a mesh. Reads no module state.

    Attributes:
      hw: the hardware profile.
      mesh_shape: ``((axis name, size), ...)`` in row-major device order.
      device_nodes: the node id of every device in mesh (row-major) order, or ``None`` to infer
        nodes from device ids and ``hw.devices_per_node``.
    """

    hw: Hardware
    mesh_shape: tuple[tuple[str, int], ...]
    device_nodes: tuple[int, ...] | None = None
    _inter_axes: frozenset[str] | None = dataclasses.field(default=None, repr=False)

    def __init__(
        self,
        hw: Hardware | str,
        mesh_shape: Mapping[str, int] | Sequence[tuple[str, int]] = (),
        device_nodes: Sequence[int] | None = None,
    ) -> None:
        pairs = tuple(mesh_shape.items()) if isinstance(mesh_shape, Mapping) else tuple(mesh_shape)
        for name, size in pairs:
            if int(size) < 1:
                raise CostModelError(
                    f"mesh_shape {dict(pairs)}: axis {name!r} has size {size}; sizes must be >= 1."
                )
        pairs = tuple((str(k), int(v)) for k, v in pairs)
        object.__setattr__(self, "hw", hardware(hw))
        object.__setattr__(self, "mesh_shape", pairs)
        nodes = None if device_nodes is None else tuple(int(n) for n in device_nodes)
        object.__setattr__(self, "device_nodes", nodes)
        spans = None if nodes is None else _inter_axes(pairs, nodes)
        object.__setattr__(self, "_inter_axes", spans)

    # ---- mesh -------------------------------------------------------------------------------
    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh_shape)

    @property
    def num_devices(self) -> int:
        return math.prod(size for _, size in self.mesh_shape)

    def axis_size(self, axis: str) -> int:
        sizes = self.axis_sizes
        if axis not in sizes:
            raise CostModelError(
                f"axis {axis!r} is not in the mesh {sizes}; use one of {list(sizes)}."
            )
        return sizes[axis]

    def axis_stride(self, axis: str) -> int:
        """Device-id distance between neighbours along ``axis`` (row-major layout)."""
        self.axis_size(axis)
        names = [name for name, _ in self.mesh_shape]
        return math.prod(size for _, size in self.mesh_shape[names.index(axis) + 1 :])

    def axis_spans_nodes(self, axis: str) -> bool:
        """True when one group along ``axis`` covers devices of more than one node: from
        ``device_nodes`` when given, else from the row-major layout and ``devices_per_node``."""
        if self._inter_axes is not None:
            self.axis_size(axis)
            return axis in self._inter_axes
        return self.axis_stride(axis) * self.axis_size(axis) > self.hw.devices_per_node

    def axis_link(self, axis: str) -> Link:
        """The link a group along ``axis`` pays: intra-node unless its devices span nodes."""
        return self.hw.inter_node if self.axis_spans_nodes(axis) else self.hw.intra_node

    def group_size(self, axes: Sequence[str]) -> int:
        return math.prod(self.axis_size(a) for a in axes)

    def group_link(self, axes: Sequence[str]) -> Link:
        """The slowest link among the axes of a group (``axes`` must be non-empty)."""
        return min((self.axis_link(a) for a in axes), key=lambda link: link.bandwidth_bytes_per_s)

    # ---- compute ----------------------------------------------------------------------------
    def compute_time_s(
        self,
        flops: float,
        bytes_accessed: float,
        dtype: str = FALLBACK_DTYPE,
        is_matmul: bool = True,
        conv: bool = False,
        transcendentals: float = 0.0,
        conv_features: float = math.inf,
    ) -> float:
        """Roofline time of one kernel on one device.

        ``max(flops / (peak(dtype) * matmul_efficiency * c), bytes / (hbm * memory_efficiency))``,
        ``c`` being ``conv_efficiency`` for a convolution (``conv``), times
        ``min(1, conv_features / conv_min_features) ** conv_narrow_power`` (``conv_features``:
        the geometric mean of its input and output features per device), else 1, and
        ``transcendentals * transcendental_s`` added to the FLOP term,
        plus the kernel's fixed cost ``hw.launch_s(bytes_accessed)`` (``kernel_launch_s``, and
        ``kernel_floor_s`` from ``kernel_floor_bytes`` up); 0 when both counts are 0.
        """
        return roofline_time_s(flops, bytes_accessed, self.hw, dtype, is_matmul, conv,
                               transcendentals, conv_features)

    def op_time_s(self, op: Op, shard_factor: float = 1, dtype: str | None = None) -> float:
        """Time of one execution of ``op`` when its work is split ``shard_factor`` ways.

        Args:
          op: an IR op; its ``flops`` and ``bytes_accessed`` are divided by ``shard_factor``.
          shard_factor: how many devices share the op's work evenly.
          dtype: the op's compute dtype. ``ir.Op`` keeps value ids, not types, so pass
            ``graph.type(op.outs[0]).dtype``; when ``None`` the op's dtype params
            (``preferred_element_type``, ``new_dtype``, ``dtype``) are read, else float32.

        Returns:
          Seconds; ``dot_general`` and ``conv_general_dilated`` use the matmul peak.
        """
        dt = dtype if dtype is not None else _op_dtype(op)
        return self.compute_time_s(
            op.flops / shard_factor,
            op.bytes_accessed / shard_factor,
            dtype=dt,
            is_matmul=op.prim in MATMUL_PRIMS,
            conv=op.prim in CONV_PRIMS,
            transcendentals=op.transcendentals / shard_factor,
        )

    # ---- communication ----------------------------------------------------------------------
    def collective_time_s(self, kind: str, nbytes: float, axes: Sequence[str] | str) -> float:
        """Time of one collective over the group spanned by ``axes``.

        Args:
          kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
            ``"collective-permute"``.
          nbytes: all-reduce: the per-device buffer; all-gather: the per-device OUTPUT (gathered)
            bytes; reduce-scatter: the per-device INPUT bytes; all-to-all: the per-device buffer;
            collective-permute: the bytes each device sends.
          axes: mesh axis names whose product forms the group (a single name is accepted).

        Returns:
          Seconds of the ring model (see ``cost_models.collectives``) plus
          ``hw.collective_launch_s``; 0.0 for ``()`` or a group of one device.
        """
        if kind not in COLLECTIVE_RULES:
            raise CostModelError(
                f"collective kind {kind!r} is unknown; use one of {sorted(COLLECTIVE_RULES)}."
            )
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        n = self.group_size(axes_t) if axes_t else 1
        if n <= 1:
            return 0.0
        return self.collective_on_link_s(kind, nbytes, n, self.group_link(axes_t))

    def collective_on_link_s(self, kind: str, nbytes: float, n: int, link) -> float:
        """``collective_time_s`` of a group of ``n`` devices on a given ``link`` (``Link``), for
        callers that know which link a group crosses (a pipeline's stage boundaries)."""
        bw = (
            link.bandwidth_bytes_per_s
            * self.hw.collective_efficiency
            * self.hw.kind_efficiency(kind)
        )
        return COLLECTIVE_RULES[kind](nbytes, n, bw, link.latency_s) + self.hw.collective_launch_s

    # ---- memory -----------------------------------------------------------------------------
    def tensor_bytes_per_device(self, ttype: TensorType, sharding: Sequence[AxisSpec]) -> int:
        """Bytes of the shard of ``ttype`` one device holds.

        Args:
          ttype: the global type.
          sharding: per dimension, the mesh axes that split it, e.g. ``(("data",), (), ("model",))``
            (a bare axis name or ``None`` are accepted too). Unsharded trailing dims may be left
            out. A dim that does not divide evenly is padded up, as XLA does.

        Returns:
          ``nbytes / prod(sizes of all axes used)`` when every dim divides evenly.
        """
        dims = _normalise_sharding(sharding, ttype)
        used = [a for axes in dims for a in axes]
        if len(used) != len(set(used)):
            raise CostModelError(
                f"sharding {dims} of {ttype} uses a mesh axis on two dims; each axis may split "
                f"at most one dim."
            )
        shard_shape = [
            -(-size // self.group_size(axes)) for size, axes in zip(ttype.shape, dims)
        ]
        return math.prod(shard_shape) * ttype.itemsize


def _inter_axes(pairs: tuple[tuple[str, int], ...], nodes: tuple[int, ...]) -> frozenset[str]:
    """The axes with a group (a line of the mesh along the axis) whose devices sit in two nodes.

    A group over several axes spans nodes exactly when one of its axes does: were every line
    along each of its axes on one node, every device of the group would be on one node.
    """
    sizes = [n for _, n in pairs]
    if len(nodes) != math.prod(sizes):
        raise CostModelError(
            f"device_nodes has {len(nodes)} entries but the mesh {dict(pairs)} has "
            f"{math.prod(sizes)} devices; give one node id per device, in mesh order."
        )
    grid = np.asarray(nodes, dtype=np.int64).reshape(sizes)
    spans = set()
    for i, (name, size) in enumerate(pairs):
        lines = np.moveaxis(grid, i, -1).reshape(-1, size)
        if size > 1 and bool((lines != lines[:, :1]).any()):
            spans.add(name)
    return frozenset(spans)


def _normalise_sharding(sharding: Sequence[AxisSpec], ttype: TensorType) -> list[tuple[str, ...]]:
    dims = [(s,) if isinstance(s, str) else tuple(s or ()) for s in sharding]
    if len(dims) > len(ttype.shape):
        raise CostModelError(
            f"sharding {tuple(dims)} has {len(dims)} dims but {ttype} has {len(ttype.shape)}; "
            f"give one entry per dim."
        )
    return dims + [()] * (len(ttype.shape) - len(dims))


def _op_dtype(op: Op) -> str:
    for key in _DTYPE_PARAMS:
        value: Any = op.param(key)
        if value is not None:
            return str(value)
    return FALLBACK_DTYPE
