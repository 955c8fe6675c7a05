"""``megatron_3d``: Megatron-LM's hand-written tensor x pipeline x data parallelism.

The step's layers are cut into equal pipeline stages over the ``stage`` axis (one slice of that
axis per stage), each stage splits its layers' kernels over the ``model`` axis as Megatron-LM
does (heads of the attention projections, the hidden dim of the MLP: ``StagedModel.tensor_dims``)
and its microbatches' rows over every other axis (data parallel). Microbatches default to
Megatron-LM's one row per data shard; the schedule to 1F1B (``virtual_stages > 1``: interleaved),
run asynchronously as Megatron-LM runs it (``autopar.pipeline.mpmd``; interleaved chunks on the
lockstep runtime, ``runtime=`` pins one).

It runs through the same pipeline codegen as ``autopar.plan(..., pipeline=...)``
(``autopar.pipeline.runtime``); what it pins, the planner's ``pipeline="auto"`` would search. Its
stage costs come from sub-plans whose inputs are pinned to exactly the layouts the runtime gives
them (``StageLayouts``), so its prediction prices what runs.

    >>> plan = autopar.plan(step, state, batch, mesh={"stage": 2, "data": 2, "model": 2},
    ...                     strategy="megatron_3d")
    >>> m3d = autopar.strategies.get("megatron_3d", microbatches=8, schedule="1f1b")
    >>> run = autopar.autoparallel(step, mesh=mesh, strategy=m3d)      # plans on its first call
    >>> autopar.compare(step, state, batch, mesh=..., strategies=("megatron_3d", "auto"))
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax

import ir
from autopar.errors import ShardingError
from autopar.pipeline.model import tensor_dim
from autopar.pipeline.runtime import data_axes
from autopar.strategies import register_pipelined
from autopar.strategies.roles import path_keys


@dataclasses.dataclass(frozen=True)
class StageLayouts:
    """Input layouts of one stage's sub-plans (a layer, the embedding, the head): the layer
    kernels ``tensor_dims`` names split over ``tensor_axis``, and, as Megatron-LM lays them
    out, the embedding table and every other 2-D parameter with a vocabulary-sized dimension
    (an untied output layer) split over the vocabulary; everything else replicated. The
    sub-plans are one data shard's rows on the tensor axis alone (``planning.stage_costs``).
    (Kept whole, the embedding and head of GPT-145.6B and 310.1B held 25-34 GiB more a device
    than Megatron-LM's layout: no plan fitted 80 GiB at the SC'21 table's meshes.)"""

    tensor_dims: Mapping[str, int]
    tensor_axis: str = "model"
    name: str = "megatron_3d stage"
    vocabulary: int | None = None   # the embedding table's rows (``stage_layouts``): split

    def fix_inputs(self, graph, mesh: Mapping[str, int]) -> dict[int, tuple]:
        out = {}
        t = mesh.get(self.tensor_axis, 1)
        vocab = self.vocabulary
        for k, path in enumerate(graph.input_paths):
            shape = graph.values[graph.inputs[k]].shape
            dims: list[tuple] = [()] * len(shape)
            keys = path_keys(path)
            if keys[:1] == ("0",):
                d = tensor_dim(self.tensor_dims, keys)     # as the runtime looks it up
                if d is None and vocab and len(shape) == 2 and vocab in shape:
                    d = shape.index(vocab)
                if d is not None and t > 1 and d < len(shape) and shape[d] % t == 0:
                    dims[d] = (self.tensor_axis,)
            out[k] = tuple(dims)
        return out


def stage_layouts(model, params, batch) -> StageLayouts:
    """``StageLayouts`` of a staged model, its vocabulary read off its embedding (traced on
    ``params`` and ``batch``, arrays or shapes): the sub-plans of the backward ends never read
    the table (its gradient is a scatter into zeros), so they cannot find it themselves."""
    _, rest = model.split(params)
    vocab = _vocabulary(ir.trace(model.embed, rest, batch))
    return StageLayouts(dict(model.tensor_dims), vocabulary=vocab)


def _vocabulary(graph) -> int | None:
    """The rows of the embedding table: a 2-D argument of the parameters (the first argument)
    that a gather reads as its operand (through a cast); None when there is none."""
    first = {v for v, path in zip(graph.inputs, graph.input_paths)
             if path_keys(path)[:1] == ("0",) and len(graph.values[v].shape) == 2}
    for op in graph.all_ops():
        if op.prim in _CASTS and op.ins and op.ins[0] in first:   # a bfloat16 model's table
            first.update(op.outs)
        if op.prim == "gather" and op.ins and op.ins[0] in first:
            return graph.values[op.ins[0]].shape[0]
    return None


_CASTS = ("convert_element_type", "copy", "reduce_precision")


@dataclasses.dataclass(frozen=True)
class Megatron3D:
    """Tensor (``model`` axis) x pipeline (``stage_axis``) x data (the other axes)."""

    stage_axis: str = "stage"
    microbatches: int | None = None       # None: one row per data shard per microbatch
    schedule: str = "1f1b"
    virtual_stages: int = 1
    name: str = "megatron_3d"
    # what runs the stages: None, as Megatron-LM does, asynchronously (the MPMD runtime) where
    # it can (one chunk per stage) and the lockstep runtime for interleaved chunks
    runtime: str | None = None

    def fix_inputs(self, graph, mesh):
        raise ShardingError("strategy 'megatron_3d' pipelines the step, so it is not planned "
                            "from one traced graph: plan it with autopar.plan(step, state, batch, "
                            "mesh=..., strategy='megatron_3d') (or autoparallel, or compare), "
                            "with a step that declares its layers "
                            "(autopar.pipeline.model.gpt_train_step)")

    def pipeline(self, sizes: Mapping[str, int], rows: int) -> dict:
        """The ``pipeline=`` options this strategy pins on a mesh of ``sizes``."""
        if self.stage_axis not in sizes:
            raise ShardingError(f"megatron_3d pipelines over mesh axis {self.stage_axis!r}, which"
                                f" the mesh {dict(sizes)} lacks; add it (e.g. {{'stage': 2, "
                                f"**mesh}}) or pass stage_axis= naming one of {list(sizes)}")
        shards = math.prod(sizes[a] for a in data_axes(sizes, self.stage_axis))
        m = self.microbatches or max(rows // shards, 1)
        return {"axis": self.stage_axis, "stages": sizes[self.stage_axis], "microbatches": m,
                "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "layer_ranges": "equal", "fsdp": False,      # data parallel inside a stage
                "runtime": self.runtime or ("mpmd" if self.virtual_stages == 1 else "lockstep")}

    def plan(self, fn, state, batch, *, mesh, hardware=None, memory_budget=None,
             time_limit_s: float = 30.0):
        """The ``autopar.Plan`` of this strategy (``plan.pipeline`` its pipeline); run it with
        ``autopar.pipeline.planning.executable(plan, fn, mesh)``."""
        from autopar.mesh import axis_sizes
        from autopar.pipeline import planning
        from autopar.pipeline.model import staged_model_of

        rows = jax.tree_util.tree_leaves(batch)[0].shape[0]
        stacked, shapes = planning.stacked_args(fn, (state, batch))   # an unrolled model's too
        model = staged_model_of(fn)
        stage = stage_layouts(model, model.params_of(stacked), shapes)
        return planning.plan(fn, (state, batch), mesh, hardware=hardware,
                             memory_budget=memory_budget, time_limit_s=time_limit_s,
                             pipeline=self.pipeline(axis_sizes(mesh), rows),
                             stage_strategy=stage, name=self.name)


def make(*, stage_axis: str = "stage", microbatches: int | None = None, schedule: str = "1f1b",
         virtual_stages: int = 1, runtime: str | None = None) -> Megatron3D:
    return Megatron3D(stage_axis, microbatches, schedule, virtual_stages, runtime=runtime)


register_pipelined("megatron_3d", make)
