"""The autopar IR: an immutable DAG of ops over tensor values, lowered from a jaxpr.

Identity: ops and values are referred to by integer id, never by object identity, so that plans
that name them can be saved to disk. Ids are global across the whole graph, nested regions
included: a scan body's values have ids distinct from the enclosing graph's.

Structure:
  * ``Graph.values[v]`` is the ``TensorType`` of value ``v`` (every value, nested ones too).
  * ``Graph.ops`` holds the top-level ops in topological order. An op with a loop or branch
    (``scan``, ``while``, ``cond``) keeps its body as ``Region``s, each again a topologically
    ordered tuple of ops; a scan body is *not* unrolled: its costs count ``trip_count`` times.
  * ``jit`` calls are inlined. ``remat2``, ``custom_jvp_call`` and ``custom_vjp_call`` are inlined
    too, with the marker kept in each inlined op's ``scope``.
  * ``origin`` of an op is the path that leads to its equation from the top-level jaxpr: an
    equation index per level, and after a loop or branch equation the index of its region
    (``(12, 3)``: equation 3 of the jaxpr called by top-level equation 12; ``(7, 0, 4)``:
    equation 4 of the body (region 0) of the scan at top-level equation 7). Codegen uses it to
    find the equation again when it re-evaluates the jaxpr.

A pass returns a new Graph; nothing here is edited in place.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from ir.analyses import Analyses


@dataclasses.dataclass(frozen=True)
class TensorType:
    """Shape and dtype of one value."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype name: "float32", "bfloat16", "int32", "bool", ...

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        """Computed once per type (the planner asks for it per value, per layout, per check)."""
        return self.size * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@functools.cache
def _itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    if dtype.startswith("float8"):
        return 1
    if dtype.startswith("key<"):  # a PRNG key: threefry keys are 2 x uint32
        return 8
    if dtype == "token" or "float0" in dtype:  # float0: gradients of ints, no data
        return 0
    return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Region:
    """A nested body (scan/while body, a cond branch): its ops and boundary value ids.

    ``inputs`` are the body's parameters in jaxpr order; ``outputs`` its results in order.
    """

    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Op:
    """One primitive application.

    Attributes:
      id: unique op id in the graph.
      prim: primitive name (``"dot_general"``, ``"scan"``, ...).
      ins: input value ids (a literal constant is a value too; see ``Graph.literals``).
      outs: output value ids.
      params: the primitive's parameters, reduced to hashable plain data (ints, strs, tuples);
        sub-jaxprs are dropped (they live in ``regions``).
      flops: floating-point operations of one execution (a scan's op: body flops x trip count).
      transcendentals: exp/log/tanh/sqrt/... evaluations, which XLA counts apart from flops.
      bytes_accessed: bytes read plus written by one execution (same multiplication rule).
      source: the user's source location, ``"file.py:123 (function)"``, or ``""``.
      site: the innermost frame outside jax itself, ``"attention.py:47"``: the library line
        (flax, transformers) or user line that made the equation. Finer than ``source`` when
        the model is a library's: every op of a transformers model has the user's one calling
        line as ``source``. A backward equation keeps its forward equation's ``site``.
      name: the name stack (flax module path and transforms), e.g. ``"jvp(GPT)/layer_0/mlp/fc1"``.
      scope: markers of inlined wrappers, outermost first, e.g. ``("remat2",)``.
      origin: equation-index path from the top-level jaxpr (see module docstring).
      regions: nested bodies (scan/while: ``(body,)``; while also its cond as the 2nd; cond:
        branches).
      trip_count: how often the regions run per execution of this op (scan length; 1 if unknown).
      layer: index into ``Graph.layers`` or ``None``.
    """

    id: int
    prim: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()
    flops: float = 0.0
    bytes_accessed: float = 0.0
    source: str = ""
    name: str = ""
    scope: tuple[str, ...] = ()
    origin: tuple[int, ...] = ()
    regions: tuple[Region, ...] = ()
    trip_count: int = 1
    layer: int | None = None
    transcendentals: float = 0.0
    site: str = ""

    def param(self, key: str, default: Any = None) -> Any:
        for k, v in self.params:
            if k == key:
                return v
        return default


@dataclasses.dataclass(frozen=True)
class Layer:
    """A repeated block. Layers with equal ``signature`` are structurally identical and list their
    op ids in corresponding order, so ``a.op_ids[j]`` plays the role of ``b.op_ids[j]``.
    A scan body is one layer (``kind="scan"``, ``repeats`` = trip count)."""

    index: int
    name: str
    op_ids: tuple[int, ...]
    signature: str
    kind: str = "unrolled"  # "unrolled" | "scan"
    repeats: int = 1


@dataclasses.dataclass(frozen=True)
class Graph:
    """An immutable DAG of ops. See the module docstring for the id conventions."""

    ops: tuple[Op, ...]
    values: tuple[TensorType, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    input_paths: tuple[str, ...]         # pytree paths: "[0]['params']['wte']['embedding']"
    output_paths: tuple[str, ...]
    donated: tuple[bool, ...]            # per input
    literals: tuple[tuple[int, Any], ...] = ()   # (value id, python scalar) for literal constants
    consts: tuple[int, ...] = ()         # value ids of closed-over constants (not user inputs)
    layers: tuple[Layer, ...] = ()
    # value ids held in host memory (``ir.offload``): offloaded arguments, what moves to the host
    host: frozenset[int] = frozenset()
    # Not part of identity: the traced jaxpr and pytree structure, for codegen. Never serialised.
    jaxpr: Any = dataclasses.field(default=None, compare=False, repr=False, hash=False)
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False, hash=False)
    out_tree: Any = dataclasses.field(default=None, compare=False, repr=False, hash=False)
    # What is computed about this graph and reused (``ir.analyses``): made with the graph, so a
    # graph made by ``dataclasses.replace`` starts with fresh analyses.
    analyses: Analyses = dataclasses.field(init=False, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "analyses", Analyses(self))   # construction, not a cache

    # ---- navigation -------------------------------------------------------------------------
    def all_ops(self) -> tuple[Op, ...]:
        """Every op, nested ones included, in a pre-order walk (a region op before its body)."""
        out: list[Op] = []

        def walk(ops: tuple[Op, ...]) -> None:
            for op in ops:
                out.append(op)
                for r in op.regions:
                    walk(r.ops)

        walk(self.ops)
        return tuple(out)

    def op(self, op_id: int) -> Op:
        return self.analyses.op_index[op_id]

    def producer(self, value_id: int) -> Op | None:
        return self.analyses.producers.get(value_id)

    def type(self, value_id: int) -> TensorType:
        return self.values[value_id]

    # ---- totals -----------------------------------------------------------------------------
    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    @property
    def input_bytes(self) -> int:
        return sum(self.values[v].nbytes for v in self.inputs)

    @property
    def fallbacks(self) -> tuple[int, ...]:
        """Ids of ops costed by the conservative fallback (primitive without a FLOP rule)."""
        return tuple(op.id for op in self.all_ops() if op.param("fallback"))

    # ---- views (implemented in ir.printer) ----------------------------------------------------
    def summary(self) -> str:
        from ir.printer import summary

        return summary(self)

    def __str__(self) -> str:
        from ir.printer import listing

        return listing(self)

    def to_networkx(self) -> Any:
        from ir.printer import to_networkx

        return to_networkx(self)

    def fingerprint(self) -> str:
        """A stable hash of everything that makes the program: each op's primitive, parameters
        (``sum(0)`` is not ``sum(1)``), wiring, scope and trip count, every value's type, the
        literal constants, the inputs and outputs with their pytree paths, and donation. Source
        lines and names are left out: moving code does not change the program. Computed once
        per graph (``Graph.analyses``)."""
        return self.analyses.fingerprint


def fingerprint(graph: Graph) -> str:
    """``Graph.fingerprint``, computed (a 50k-op graph takes a tenth of a second to hash)."""
    import hashlib

    h = hashlib.sha256()
    reprs: dict = {}   # repeated layers repeat a few parameter tuples and value types
    parts = []
    for op in graph.all_ops():
        params = reprs.get(op.params)
        if params is None:
            params = reprs[op.params] = repr(op.params)
        parts.append(f"{op.id}:{op.prim}:{op.ins}:{op.outs}:{op.trip_count}:{op.scope}:"
                     f"{params};")
    h.update("".join(parts).encode())
    types = {v: f"{v};" for v in set(graph.values)}
    h.update("".join(types[v] for v in graph.values).encode())
    h.update(repr((graph.inputs, graph.outputs, graph.input_paths, graph.output_paths,
                   graph.donated, graph.literals, graph.consts)).encode())
    return h.hexdigest()[:16]
