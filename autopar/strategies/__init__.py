"""Hand-written parallelism strategies (DP, ZeRO-1/2/3, FSDP, Megatron, sequence parallel, EP).

A strategy is what a practitioner writes by hand: layouts for the *inputs* of the step, found
from each input's role in the graph, never its name (``logical.annotate`` over
``roles.analyse``: a kernel whose output feeds another kernel is ``("embed", "mlp")``, one whose
output feeds attention ``("embed", "heads")``, a gathered table ``("vocab", "embed")``, a token
batch ``("batch", "seq")``), then a map of logical names to mesh axes, like flax's
``logical_axis_rules``:

    strategy    logical name -> mesh axis                optimizer state   reduce-scatter
    dp          batch -> data                            like its param    allowed
    zero1       batch -> data                            data, largest dim forbidden on dots
    zero2       batch -> data                            data, largest dim allowed
    zero3/fsdp  batch -> data; params: data, largest dim like its param    allowed
    megatron    batch -> data; mlp, heads, vocab -> model like its param   allowed
    megatron_sp megatron + seq -> model                  like its param    allowed
    fsdp_tp     megatron on model + fsdp on data         like its param    allowed
    ep          batch -> data; expert -> expert axis     like its param    allowed

**Only the inputs are pinned.** A strategy returns ``fix_inputs(graph, mesh) -> {input index:
Sharding}`` for every input (parameters, optimizer state, batch) and vetoes op strategies with
``allows(op, strategy)``: every contraction splits its work over the data axis (each worker runs
its slice of the batch) and ZeRO-1 forbids reduce-scatter outputs. The planner's ILP then fills in
every activation with the cheapest layouts consistent with those, under the same cost model as
``strategy="auto"``, and the same codegen runs it. So "megatron" here is Megatron's parameter
layout with the planner's best activation layouts, which may differ from the paper's hand-placed
collectives (e.g. it may gather a head-sharded kernel rather than run attention head-parallel).

Every layout is one the planner accepts: a dim holds at most two mesh axes, in mesh order, an
axis of size 1 is dropped, and a dim the axes do not divide stays replicated (never an error).

``bind(graph, mesh)`` applies a strategy to one step: its layouts, an op filter that knows the
step's parameters, and ``notes``: what it cannot place as it intends, and why (``autopar.plan``
warns with them and ``plan.summary()`` lists them).

    >>> autopar.plan(step, state, batch, mesh={"data": 2, "model": 4}, strategy="megatron")
    >>> autopar.plan(..., strategy=autopar.strategies.get("fsdp", data_axis="x"))
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from autopar.errors import ShardingError
from autopar.sharding import Sharding
from autopar.strategies.logical import InputAxes, annotate
from autopar.strategies.user import from_arrays, user
from ir import Graph

__all__ = ["NAMES", "PIPELINED", "Bound", "HandWritten", "annotate", "from_arrays", "get",
           "user"]

_MODEL_FIRST = ("megatron", "megatron_sp")     # a one-axis mesh is their model axis
_TP_NAMES = ("mlp", "heads", "vocab")          # Megatron's sharded logical dims
_CONTRACTIONS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class HandWritten:
    """A hand-written strategy: logical-axis rules plus the ZeRO/FSDP knobs.

    Axis knobs left ``None`` are resolved against the mesh: ``"data"``/``"model"`` if the mesh
    has them, else its first/last axis; a one-axis mesh is the data axis, except for Megatron
    where it is the model axis. ``expert_axis`` defaults to the model axis, else the data axis.
    """

    name: str
    data_axis: str | None = None
    model_axis: str | None = None
    expert_axis: str | None = None
    tensor_parallel: bool = False    # mlp/heads/vocab -> model
    sequence_parallel: bool = False  # seq -> model
    shard_params: bool = False       # params (and so their optimizer state) on data (FSDP)
    shard_opt_state: bool = False    # optimizer state on data, params replicated (ZeRO-1/2)
    experts: bool = False            # expert -> expert axis
    reduce_scatter: bool = True      # False: gradients are all-reduced (ZeRO-1)

    def axes(self, mesh: Mapping[str, int]) -> dict[str, str | None]:
        """The data, model and expert mesh axes this strategy uses on ``mesh``."""
        names = list(mesh)
        for knob in (self.data_axis, self.model_axis, self.expert_axis):
            if knob is not None and knob not in mesh:
                raise ShardingError(
                    f"strategy {self.name!r} was given mesh axis {knob!r}, but the mesh has axes "
                    f"{dict(mesh)}; pass data_axis=/model_axis= naming one of {names}")
        model_first = self.name in _MODEL_FIRST
        data = self.data_axis or _default(mesh, "data", names[0], not model_first)
        model = self.model_axis or _default(mesh, "model", names[-1], model_first)
        if data == model and model_first and self.data_axis is None:
            data = None
        elif data == model and self.model_axis is None:
            model = None
        expert = self.expert_axis or model or data
        return {"data": data, "model": model, "expert": expert}

    def logical_rules(self, mesh: Mapping[str, int]) -> dict[str, str]:
        """Logical dim name -> mesh axis, in the manner of flax's ``logical_axis_rules``."""
        ax = self.axes(mesh)
        rules: dict[str, str | None] = {"batch": ax["data"]}
        if self.tensor_parallel:
            rules.update({n: ax["model"] for n in _TP_NAMES})
        if self.sequence_parallel:
            rules["seq"] = ax["model"]
        if self.experts:
            rules["expert"] = ax["expert"]
        return {k: v for k, v in rules.items() if v is not None}

    def fix_inputs(self, graph: Graph, mesh: Mapping[str, int]) -> dict[int, Sharding]:
        """Input index -> layout for every input of ``graph`` (see the module docstring)."""
        rules = self.logical_rules(mesh)
        data = self.axes(mesh)["data"]
        out: dict[int, Sharding] = {}
        seen: dict[tuple, Sharding] = {}   # repeated layers' inputs: a few (names, shape) pairs
        for k, info in enumerate(annotate(graph)):
            shape = graph.values[graph.inputs[k]].shape
            key = (info.kind, info.names, shape)    # all that the layout reads of the input
            layout = seen.get(key)
            if layout is None:
                dims = _map_names(info, shape, rules, mesh)
                if self._on_data(info):
                    _add_to_largest(dims, shape, data, mesh)
                layout = seen[key] = _normalize(dims, shape, mesh)
            out[k] = layout
        return out

    def _on_data(self, info: InputAxes) -> bool:
        if info.kind == "param":
            return self.shard_params
        return info.kind == "opt_state" and (self.shard_params or self.shard_opt_state)

    def bind(self, graph: Graph, mesh: Mapping[str, int]) -> Bound:
        """This strategy applied to one step: its input layouts, an op filter that knows which
        inputs are parameters (from the graph, not their names) and what it could not place."""
        layouts = self.fix_inputs(graph, mesh)
        info = annotate(graph)
        params = frozenset(graph.input_paths[k] for k, a in enumerate(info) if a.kind == "param")
        experts = frozenset(graph.input_paths[k] for k, a in enumerate(info)
                            if a.kind == "param" and "expert" in a.names)
        notes = self.notes(graph, mesh, layouts)
        return Bound(self, graph, layouts, params, notes, experts)

    def notes(self, graph: Graph, mesh: Mapping[str, int],
              layouts: Mapping[int, Sharding] | None = None) -> tuple[str, ...]:
        """One line per kind of parameter this strategy means to split but cannot (a role it does
        not recognise, a dim its axis does not divide, no such parameter at all), with why.
        Parameters of repeated layers are reported once, with their count."""
        layouts = self.fix_inputs(graph, mesh) if layouts is None else layouts
        from autopar.strategies.notes import placement_notes

        return placement_notes(self, graph, mesh, layouts)

    def allows(self, op, strategy, origins=(), params: frozenset | None = None,
               experts: frozenset = frozenset()) -> bool:
        """Contractions split their work over the data axis, as every data-parallel worker runs
        its own slice of the batch (without this the planner may gather a small batch and compute
        replicated); a parameter is never split over the data axis where it is used (FSDP/ZeRO-3
        all-gather it first, data parallelism splits only the batch); tensor-parallel families
        use their weights split over the model axis as stored; ZeRO-1 all-reduces
        gradients, so no reduce-scatter outputs. ``origins`` (from the planner) names the input
        each operand comes from; ``params`` and ``experts`` (from ``bind``) are the input paths
        of the parameters and of the expert kernels, found from the graph.

        The planner ignores a veto that leaves an op nothing, so a mesh without the data axis
        (resolved here as ``data_axis or "data"``: ``allows`` does not see the mesh) is
        unconstrained.
        """
        if op.prim not in _CONTRACTIONS:
            return True
        if not self.reduce_scatter and "|RS" in strategy.name:
            return False
        data = self.data_axis or "data"
        model = self.model_axis or "model"
        for origin, s in zip(origins, strategy.ins):
            is_param = origin and (origin in params if params is not None
                                   else "['params']" in origin)
            if not (is_param and s):
                continue
            if any(data in dim for dim in s):
                return False
            # tensor parallelism computes with its model-split weights as stored, never gathered
            if self.tensor_parallel and not any(model in dim for dim in s):
                return False
            # expert parallelism keeps each expert's weights on its devices
            if self.experts and origin in experts and not any(
                    (self.expert_axis or model) in dim for dim in s):
                return False
        return any(data in dim for s in strategy.ins if s for dim in s)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A hand-written strategy bound to one graph and mesh (``HandWritten.bind``)."""

    strategy: HandWritten
    graph: Graph = dataclasses.field(repr=False, compare=False)
    layouts: Mapping[int, Sharding] = dataclasses.field(repr=False)
    params: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()
    experts: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return self.strategy.name

    def fix_inputs(self, graph: Graph, mesh: Mapping[str, int]) -> dict[int, Sharding]:
        if graph is not self.graph:
            return self.strategy.fix_inputs(graph, mesh)
        return dict(self.layouts)

    def allows(self, op, strategy, origins=()) -> bool:
        return self.strategy.allows(op, strategy, origins, self.params, self.experts)


def _default(mesh: Mapping[str, int], want: str, fallback: str, one_axis_ok: bool) -> str | None:
    if want in mesh:
        return want
    return fallback if len(mesh) > 1 or one_axis_ok else None


def _map_names(info: InputAxes, shape: Sequence[int], rules: Mapping[str, str],
               mesh: Mapping[str, int]) -> list[list[str]]:
    """Each dim's mesh axes by its logical name; an axis already used or not dividing is skipped."""
    dims: list[list[str]] = [[] for _ in shape]
    used: set[str] = set()
    for i, name in enumerate(info.names):
        axis = rules.get(name) if name is not None else None
        if axis is None or axis in used or shape[i] % mesh[axis]:
            continue
        dims[i].append(axis)
        used.add(axis)
    return dims


def _add_to_largest(dims: list[list[str]], shape: Sequence[int], axis: str | None,
                    mesh: Mapping[str, int]) -> None:
    """Shard on ``axis`` along the largest dim it divides, preferring dims not yet sharded."""
    if axis is None or mesh[axis] == 1 or any(axis in d for d in dims):
        return
    order = sorted(range(len(shape)), key=lambda i: (bool(dims[i]), -shape[i], i))
    for i in order:
        if len(dims[i]) < 2 and shape[i] % (math.prod(mesh[a] for a in dims[i]) * mesh[axis]) == 0:
            dims[i].append(axis)
            return


def _normalize(dims: list[list[str]], shape: Sequence[int], mesh: Mapping[str, int]) -> Sharding:
    """A layout the planner enumerates: axes in mesh order, size-1 axes dropped, dims divisible."""
    rank = {a: i for i, a in enumerate(mesh)}
    out = []
    for d, size in zip(dims, shape):
        axes = sorted((a for a in d if mesh[a] > 1), key=rank.__getitem__)
        ok = len(axes) <= 2 and size % math.prod(mesh[a] for a in axes) == 0
        out.append(tuple(axes) if ok else ())
    return tuple(out)


def _make(name: str, **flags):
    def factory(*, data_axis: str | None = None, model_axis: str | None = None,
                expert_axis: str | None = None) -> HandWritten:
        return HandWritten(name, data_axis, model_axis, expert_axis, **flags)

    factory.__name__ = name
    return factory


_FACTORIES = {
    "dp": _make("dp"),
    "zero1": _make("zero1", shard_opt_state=True, reduce_scatter=False),
    "zero2": _make("zero2", shard_opt_state=True),
    "zero3": _make("zero3", shard_params=True),
    "fsdp": _make("fsdp", shard_params=True),
    "megatron": _make("megatron", tensor_parallel=True),
    "megatron_sp": _make("megatron_sp", tensor_parallel=True, sequence_parallel=True),
    "fsdp_tp": _make("fsdp_tp", tensor_parallel=True, shard_params=True),
    "ep": _make("ep", experts=True),
}
NAMES: tuple[str, ...] = tuple(_FACTORIES)
# Pipelined strategies plan a step that declares its layers (autopar.pipeline.model) through the
# pipeline codegen, not one traced graph: autopar.compare and Megatron3D.plan take them.
PIPELINED: tuple[str, ...] = ("megatron_3d",)
# Their factories live with the pipeline codegen, a layer above this one (imports run one way):
# ``autopar.pipeline.megatron_3d`` registers its own when ``autopar`` is imported.
_PIPELINED_FACTORIES: dict[str, Callable] = {}


def pipelined(strategy):
    """The pipelined strategy object ``strategy`` names or is (one of ``PIPELINED``: it plans and
    runs through the pipeline codegen, not one traced graph), else ``None``."""
    if isinstance(strategy, str):
        return get(strategy) if strategy in PIPELINED else None
    return strategy if callable(getattr(strategy, "pipeline", None)) else None


def register_pipelined(name: str, factory: Callable) -> None:
    """Make the pipelined strategy ``name`` (one of ``PIPELINED``) available to ``get``."""
    if name not in PIPELINED:
        raise ValueError(f"{name!r} is not one of the pipelined strategies {PIPELINED}")
    _PIPELINED_FACTORIES[name] = factory


def get(name: str, **knobs) -> HandWritten:
    """The hand-written strategy ``name`` (one of ``NAMES``) with knobs ``data_axis``,
    ``model_axis`` and ``expert_axis``.

    Raises:
      ShardingError: for an unknown name, listing the valid ones.
    """
    if name in _PIPELINED_FACTORIES:
        try:
            return _PIPELINED_FACTORIES[name](**knobs)
        except TypeError as e:
            raise ShardingError(f"strategy {name!r} got knobs {sorted(knobs)}; it takes "
                                f"stage_axis, microbatches, schedule and virtual_stages "
                                f"({e})") from None
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ShardingError(f"unknown strategy {name!r}; hand-written strategies are "
                            f"{', '.join(NAMES + PIPELINED)} (or strategy='auto' for the "
                            f"planner's choice)")
    try:
        return factory(**knobs)
    except TypeError as e:
        raise ShardingError(f"strategy {name!r} got knobs {sorted(knobs)}; it takes data_axis, "
                            f"model_axis and expert_axis ({e})") from None
