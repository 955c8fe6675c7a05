"""Multi-controller runs on ``jax.distributed``: start-up, which devices share a node, one plan for
every process, and host-local batches as global arrays.

Every process runs the same script. ``initialize()`` joins the job (coordinator address, process
count and id from its arguments, else from the environment the launcher or the scheduler set),
and records which processes share a node. ``@autoparallel`` then does on every process what the
others do: it traces the same step, makes the same (deterministic) plan, and checks with a
collective that the traced graph and the plan's layouts are the same everywhere, raising
``AutoparError`` where they are not. Arguments named in ``host_local_argnums`` hold this
process's rows of the global batch (process 0's rows first); they become one global array in the
plan's layout with ``jax.make_array_from_process_local_data``.

Environment (read here and nowhere else):
  ``JAX_COORDINATOR_ADDRESS``  host:port of process 0's coordinator (jax reads it too)
  ``AUTOPAR_NUM_PROCESSES``    how many processes the job has
  ``AUTOPAR_PROCESS_ID``       this process's id, 0 .. n-1
  ``AUTOPAR_INIT_TIMEOUT_S``   seconds to wait for every process to join (default 300)
  ``AUTOPAR_NODE``             a name for this process's node; default the host name (the local
                               launcher gives every process its own, to stand for one host each)
  ``AUTOPAR_RESTART``          how many times the launcher has restarted the job (0 at first)

Set by nothing, a run is one process; ``initialize(detect=True)`` lets jax find a SLURM, Open MPI
or Kubernetes job itself.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import zlib
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.errors import AutoparError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "AUTOPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOPAR_PROCESS_ID"
ENV_INIT_TIMEOUT = "AUTOPAR_INIT_TIMEOUT_S"
ENV_NODE = "AUTOPAR_NODE"
ENV_RESTART = "AUTOPAR_RESTART"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands in the job.

    Attributes:
      process_id: ``jax.process_index()``.
      num_processes: ``jax.process_count()``.
      local_devices: devices this process drives.
      global_devices: devices of the whole job.
      process_nodes: node id of every process (processes on one node share an id, numbered by
        their first process).
      restart: how many times the launcher restarted the job before this run.
    """

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    process_nodes: tuple[int, ...]
    restart: int = 0


_cluster: Cluster | None = None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, detect: bool = False,
               timeout_s: int | None = None, heartbeat_timeout_s: int = 100) -> Cluster:
    """Join the multi-process job through ``jax.distributed.initialize`` and map its nodes.

    Arguments left ``None`` come from the environment (see the module doc). With nothing given
    this is a one-process job, unless ``detect=True`` lets jax find the cluster itself (SLURM,
    Open MPI, Kubernetes, Cloud TPU). If jax.distributed is already initialized, only the node
    map is made. Call it before anything else touches jax devices, on every process.
    """
    global _cluster
    address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    count = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    timeout = timeout_s if timeout_s is not None else (_env_int(ENV_INIT_TIMEOUT) or 300)
    wanted = detect or (address, count, pid) != (None, None, None)
    if wanted and count != 1 and not jax.distributed.is_initialized():
        try:
            jax.distributed.initialize(address, count, pid, initialization_timeout=int(timeout),
                                       heartbeat_timeout_seconds=int(heartbeat_timeout_s))
        except Exception as e:  # noqa: BLE001 - jax raises several runtime error types
            raise AutoparError(
                f"joining the job failed (coordinator {address!r}, {count} processes, this is "
                f"process {pid}, {timeout} s timeout): {type(e).__name__}: {str(e)[:300]}; give "
                f"every process the same {ENV_COORDINATOR} and {ENV_NUM_PROCESSES} and its own "
                f"{ENV_PROCESS_ID} (autopar.launch does), start process 0, and call initialize "
                f"before any other jax call") from e
    _cluster = Cluster(jax.process_index(), jax.process_count(), jax.local_device_count(),
                       jax.device_count(), _process_nodes(), _env_int(ENV_RESTART) or 0)
    return _cluster


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text in (None, ""):
        return None
    try:
        return int(text)
    except ValueError:
        raise AutoparError(f"environment variable {name}={text!r} is not an integer") from None


def _process_nodes() -> tuple[int, ...]:
    """Node id of every process: processes whose node names (``AUTOPAR_NODE`` or the host name)
    hash alike share a node. One collective; every process must call it."""
    if not is_multiprocess():
        return (0,)
    name = os.environ.get(ENV_NODE) or socket.gethostname()
    mine = np.array([zlib.crc32(name.encode()) & 0x7FFFFFFF], dtype=np.int32)
    keys = [int(k) for k in _allgather(mine).reshape(-1)]
    first = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def cluster() -> Cluster:
    """The job this process is in (one process when ``initialize`` was not called)."""
    if _cluster is not None and _cluster.num_processes == jax.process_count():
        return _cluster
    return Cluster(jax.process_index(), jax.process_count(), jax.local_device_count(),
                   jax.device_count(), tuple(range(jax.process_count())))


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def device_nodes(mesh) -> tuple[int, ...] | None:
    """The node of every device of a concrete ``Mesh`` in mesh order (for ``CostModel``), from
    each device's process and the process->node map; ``None`` for a mesh without devices."""
    if not isinstance(mesh, Mesh):
        return None
    nodes = cluster().process_nodes
    return tuple(nodes[d.process_index] if d.process_index < len(nodes) else d.process_index
                 for d in mesh.devices.flat)


# ---- one plan everywhere ----------------------------------------------------------------------
def _allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def _digest(text: str) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], dtype=np.int32).copy()


def agree(what: str, text: str, fix: str) -> None:
    """Raise ``AutoparError`` unless every process passes the same ``text`` (one collective)."""
    if not is_multiprocess():
        return
    everyone = _allgather(_digest(text)).reshape(jax.process_count(), -1)
    groups: dict[bytes, list[int]] = {}
    for p, row in enumerate(everyone):
        groups.setdefault(row.tobytes(), []).append(p)
    if len(groups) > 1:
        parts = "; ".join(f"processes {ps} have {row.hex()[:12]}" for row, ps in groups.items())
        raise AutoparError(f"{what} differs across processes ({parts}; this is process "
                           f"{jax.process_index()} with {text[:80]!r}); {fix}")


def agreed_times(seconds: Sequence[float]) -> list[float]:
    """Each of ``seconds`` (this process's timings of the same runs, in the same order on every
    process) as the slowest process measured it: one collective, so every process that compares
    them chooses alike (``autopar.tune``); unchanged in a one-process job."""
    if not is_multiprocess():
        return [float(s) for s in seconds]
    everyone = _allgather(np.asarray(seconds, dtype=np.float32)).reshape(jax.process_count(), -1)
    return [float(x) for x in everyone.max(axis=0)]


def plan_layouts(plan) -> str:
    """The part of a plan every process must share to run one program: mesh, layouts, pins,
    kernels."""
    return json.dumps([plan.graph_fingerprint, plan.mesh, plan.input_shardings,
                       plan.output_shardings, [dataclasses.astuple(p) for p in plan.pins],
                       [dataclasses.astuple(k) for k in plan.kernels]])


def check_same_graph(graph) -> None:
    """Every process traced the same step (checked before planning, so no process solves for
    a graph the others do not have)."""
    agree("the traced step", graph.fingerprint(),
          "every process must trace the same step with the same argument shapes and dtypes "
          "(host-local batches must have the same number of rows on every process)")


def check_same_plan(plan) -> None:
    """Every process holds the same plan layouts."""
    agree("the plan", plan_layouts(plan),
          "plans are deterministic for equal inputs, so the processes run different autopar, "
          "ortools or jax versions or options, or were given different plans; make the plan "
          "once (plan.to_json()) and pass plan=autopar.Plan.from_json(text) on every process")


# ---- host-local batches -----------------------------------------------------------------------
def global_args(args: tuple, argnums: Sequence[int]) -> tuple:
    """``args`` with the host-local ones replaced by ``ShapeDtypeStruct``s of the global batch
    (first dim times the process count); unchanged in a one-process job."""
    if not argnums or not is_multiprocess():
        return args
    n = jax.process_count()
    out = list(args)
    for i in argnums:
        out[i] = jax.tree_util.tree_map_with_path(
            lambda path, x, i=i: jax.ShapeDtypeStruct(_global_shape(x, n, i, path), x.dtype),
            args[i])
    return tuple(out)


def _global_shape(x, n: int, argnum: int, path) -> tuple[int, ...]:
    where = f"host-local argument {argnum}{jax.tree_util.keystr(path)}"
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise AutoparError(f"{where} is already a global array ({x.shape} over "
                           f"{len(x.sharding.device_set)} devices); pass this process's rows "
                           f"(a numpy array) or leave the argument out of host_local_argnums")
    shape = tuple(np.shape(x))
    if not shape:
        raise AutoparError(
            f"{where} is a scalar; host-local arguments are split over processes along their "
            f"first dim, so pass batches there and leave scalars out of host_local_argnums")
    return (shape[0] * n,) + shape[1:]


def place_host_local(args: tuple, argnums: Sequence[int], shardings: tuple) -> tuple:
    """The host-local arguments as global arrays in their planned layouts."""
    if not argnums or not is_multiprocess():
        return args
    out = list(args)
    for i in argnums:
        out[i] = jax.tree_util.tree_map(to_global, args[i], shardings[i])
    return tuple(out)


def local_value(x, sharding):
    """What to hand ``jax.device_put`` for ``sharding``: an array held by this process's devices
    that must reach other processes' devices goes through its host copy (jax refuses to move a
    committed one). Every process must pass the same value, as for any argument that is not
    host-local (a state made from the same seed, or already global, e.g. a restored one)."""
    if (isinstance(x, jax.Array) and x.is_fully_addressable
            and not sharding.is_fully_addressable):
        return np.asarray(x)
    return x


def to_global(local, sharding: NamedSharding) -> jax.Array:
    """This process's rows ``local`` of a global array stacked over processes in process order,
    laid out as ``sharding``. When the layout gives each process exactly its own rows they are
    placed directly; otherwise they are placed split by process and moved on the devices."""
    local = np.asarray(local)
    n, p = jax.process_count(), jax.process_index()
    shape = (local.shape[0] * n,) + local.shape[1:]
    if _rows_of_process(sharding, shape) == (p * local.shape[0], (p + 1) * local.shape[0]):
        return jax.make_array_from_process_local_data(sharding, local, shape)
    staged = jax.make_array_from_process_local_data(_by_process(sharding.mesh), local, shape)
    return jax.device_put(staged, sharding)


def _rows_of_process(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The first-dim rows this process's devices hold under ``sharding`` as one range
    ``(start, stop)``, or ``None`` when they are not one contiguous range."""
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        spans.add((rows.start or 0, shape[0] if rows.stop is None else rows.stop))
    start, stop = min(a for a, _ in spans), min(a for a, _ in spans)
    for a, b in sorted(spans):
        if a > stop:
            return None
        stop = max(stop, b)
    return start, stop


def _by_process(mesh: Mesh) -> NamedSharding:
    """A sharding over ``mesh``'s devices that splits the first dim into one block per process,
    in process order, each block replicated over the process's devices."""
    devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(jax.process_count(), -1)
    return NamedSharding(Mesh(grid, ("_processes", "_local")), PartitionSpec("_processes"))
