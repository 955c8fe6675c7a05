"""The pipelined training step: one ``jax.jit`` program over the whole mesh.

``build_step(model, mesh, schedule)`` returns ``step(state, batch) -> (state, loss)`` computing
what the unpipelined step computes (``state = {"params", "opt_state"}``, ``loss`` the batch
mean):

  * the batch is cut into ``M`` microbatches (row ``i`` goes to microbatch ``i % M``);
  * the layer stack is cut into ``K = P V`` chunks of consecutive layers (``L / K`` each, or
    any contiguous ``ranges``, padded to the longest chunk ``Lmax`` with slots that run as the
    identity: ``ChunkLayout``); chunk ``k`` lives on stage ``k % P`` (its ``(P, V, Lmax, ...)``
    view is sharded over the stage axis);
    the embedding and the head live on every stage, run only on the first and last chunk's
    stage, and their gradients are summed over the stage axis;
  * inside ``jax.shard_map`` (manual over the stage and data axes, automatic over the tensor
    axis, so the layouts inside a stage follow the parameters' layouts, ``state_specs``: a
    plan's, else Megatron's; activations are XLA's choice there; each device holds its
    data shard's rows of every microbatch and computes local means), a ``lax.scan`` walks
    the schedule's ticks (``autopar.pipeline.schedules``). Per tick each device reads its row of
    the schedule's tables and runs at most two actions, each a ``lax.switch`` over {nothing,
    forward, backward}, so a device executes only its own branch; then activations move one
    stage on and cotangents one stage back with ``lax.ppermute``;
  * a forward stores its chunk's input in a stash slot; the backward recomputes the chunk from
    it under ``jax.vjp`` (activation memory: one chunk input per microbatch in flight) and
    accumulates the parameter gradients;
  * after the loop, and only there, gradients and loss are averaged over the data axes (equal
    shards: the mean of local means is the batch mean), one all-reduce per gradient per step;
  * the optimizer updates every parameter where it lives: each stage its layers.

``fsdp=True`` also shards each layer's parameters and Adam moments over the data axes inside
its stage (ZeRO-3 / FSDP; ``state_specs`` picks the largest dim the tensor axis leaves whole that
the data shards divide): a layer gathers its parameters (``all_gather`` over the data axes) just
before it runs, under ``jax.checkpoint`` so that the gathered copy is not kept for the backward
but gathered again there, and its gradient leaves the backward reduce-scattered (the
``all_gather``'s transpose), so it is summed over the data shards per microbatch instead of
all-reduced after the loop. The embedding's and head's parameters are not sharded.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autopar import validate
from autopar.errors import AutoparError
from autopar.pipeline import schedules as S
from autopar.pipeline.model import StagedModel, key_names, tensor_dim

NONE, FWD, BWD = 0, 1, 2
FIELDS = ("kind", "mb", "virtual", "chunk", "in_slot", "stash_slot")


@dataclasses.dataclass(frozen=True)
class Tables:
    """The schedule as arrays: ``act[f]`` (T, 2, P) per field of ``FIELDS`` for the tick's two
    action places; ``recv_f``/``recv_b`` (T, P): the inbox slot where what arrives at the end of
    the tick goes (-1: nothing); and the slot counts of the three buffers."""

    act: dict
    recv_f: np.ndarray
    recv_b: np.ndarray
    stash_slots: int
    inbox_f_slots: int
    inbox_b_slots: int


def tables(sch: S.Schedule) -> Tables:
    stash = S.allocate(S.stash_intervals(sch))
    inf, inb = S.allocate(S.inbox_intervals(sch, "F")), S.allocate(S.inbox_intervals(sch, "B"))
    n, p, k_last = len(sch.ticks), sch.stages, sch.chunks - 1
    act = {f: np.full((n, 2, p), -1 if f.endswith("slot") else 0, np.int32) for f in FIELDS}
    recv_f, recv_b = np.full((n, p), -1, np.int32), np.full((n, p), -1, np.int32)
    for t, row in enumerate(sch.ticks):
        for s, acts in enumerate(row):
            for i, a in enumerate(acts):
                key = (s, (a.mb, a.chunk))
                fwd = a.kind == "F"
                vals = dict(kind=FWD if fwd else BWD, mb=a.mb, virtual=a.chunk // p,
                            chunk=a.chunk, stash_slot=stash.slot[key])
                if fwd and a.chunk > 0:
                    vals["in_slot"] = inf.slot[key]
                if not fwd and a.chunk < k_last:
                    vals["in_slot"] = inb.slot[key]
                for f, v in vals.items():
                    act[f][t, i, s] = v
                nxt = a.chunk + (1 if fwd else -1)
                if 0 <= nxt <= k_last:
                    dest = sch.stage_of(nxt)
                    box, recv = (inf, recv_f) if fwd else (inb, recv_b)
                    recv[t, dest] = box.slot[(dest, (a.mb, nxt))]
    return Tables(act, recv_f, recv_b, max(stash.count, 1), max(inf.count, 1),
                  max(inb.count, 1))


# ---- layouts ----------------------------------------------------------------------------------
def state_specs(model: StagedModel, state, axis: str, tensor_axis: str | None,
                stages: int = 1, tensor_size: int = 1, layouts=None, fsdp: dict | None = None):
    """PartitionSpecs of the state: the stacked layers (and their optimizer moments) split over
    the stage axis on the layer dim (whole on every stage when ``stages`` does not divide the
    layer count), and inside a stage each parameter (and its moments) in its layout on the
    tensor axis:

      * ``layouts``: a plan's ``(layer_layouts, rest_layouts)`` (``PipelinePlan``), the layouts
        its stage costs priced, a layer's leaves by their key path below the layer, the others
        by theirs below the params (the longest that ends the leaf's path);
      * None: the dim ``model.tensor_dims`` names (by the leaf's last three or two path keys)
        over the tensor axis when its ``tensor_size`` divides it (else whole, as the stage costs
        price it: ``autopar.pipeline.megatron_3d.StageLayouts``), everything else replicated;
      * ``fsdp``: ``{data axis: size}``: each layer leaf also split over those axes on its
        largest dim that stays whole otherwise and that their product divides (``fsdp_dim``)."""
    layer_want = dict(layouts[0]) if layouts is not None else None
    rest_want = ({tuple(k.split("/")): v for k, v in layouts[1]} if layouts is not None
                 else {})

    def spec(path, leaf):
        names = key_names(path)
        if not getattr(leaf, "ndim", 0):
            return P()
        below = _below(names, model._path())
        if below is None:
            return P(*map(_axes, _longest_suffix(names, rest_want) or ()))
        dims = [axis if leaf.shape[0] % stages == 0 else None] + [None] * (leaf.ndim - 1)
        if layer_want is not None:
            for i, d in enumerate(layer_want.get("/".join(below), ())):
                dims[1 + i] = _axes(d)
        else:
            d = tensor_dim(model.tensor_dims, names)
            if tensor_axis is not None and d is not None and \
                    leaf.shape[1 + d] % tensor_size == 0:
                dims[1 + d] = tensor_axis
        if fsdp:
            f = fsdp_dim(leaf.shape[1:], dims[1:], math.prod(fsdp.values()))
            if f is not None:
                dims[1 + f] = tuple(fsdp) if len(fsdp) > 1 else next(iter(fsdp))
        return P(*dims)

    return jax.tree_util.tree_map_with_path(spec, state)


def fsdp_dim(shape: tuple, taken: list, shards: int) -> int | None:
    """The dim of a layer's parameter (``shape``, without the layer axis) its FSDP shards split:
    the largest one no other axis splits (``taken``) that ``shards`` divides; None: none."""
    free = [i for i, n in enumerate(shape) if taken[i] is None and n % shards == 0 and n > 1]
    return max(free, key=lambda i: (shape[i], -i)) if free and shards > 1 else None


def _below(names: tuple, path: tuple) -> tuple | None:
    """The keys of ``names`` after the first run of ``path`` in it, or None when absent."""
    n = len(path)
    for i in range(len(names) - n + 1):
        if names[i:i + n] == path:
            return names[i + n:]
    return None


def _longest_suffix(names: tuple, want: dict):
    for n in range(len(names), 0, -1):
        if names[-n:] in want:
            return want[names[-n:]]
    return None


def _axes(dim: tuple):
    """A layout's dim (a tuple of mesh axes) as a PartitionSpec entry."""
    return None if not dim else dim[0] if len(dim) == 1 else tuple(dim)


TENSOR_AXIS = "model"      # the axis a stage's parameter layouts split (build_step's default)


def data_axes(names, axis: str, tensor_axis: str | None = TENSOR_AXIS) -> tuple[str, ...]:
    """The mesh axes (of ``names``) a batch's rows are split over: all but the pipeline and
    tensor axes."""
    return tuple(a for a in names if a not in (axis, tensor_axis))


def batch_spec(rank: int, sizes: dict, axis: str, tensor_axis: str | None = TENSOR_AXIS):
    """Batch inputs: rows over every axis but the pipeline and tensor axes."""
    return P(data_axes(sizes, axis, tensor_axis) or None) if rank else P()


def equal_ranges(layers: int, chunks: int) -> tuple[tuple[int, int], ...]:
    lc = layers // chunks
    return tuple((c * lc, (c + 1) * lc) for c in range(chunks))


# ---- chunks of the layer stack -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where the layers sit in the staged ``(P, V, Lmax, ...)`` view: chunk ``k = v P + s``
    (layers ``ranges[k]``) on stage ``s``, place ``v``, padded to the longest chunk ``Lmax``.
    ``index[s, v, i]``: the layer at slot ``i`` (padding repeats the chunk's last layer, or
    layer 0 for an empty chunk); ``valid[s, v, i]``: whether slot ``i`` is a real layer (padding
    runs as the identity and gets zero gradients); ``slot[l]``: layer ``l``'s flat slot."""

    index: np.ndarray
    valid: np.ndarray
    slot: np.ndarray
    equal: bool

    @staticmethod
    def of(layers: int, sch: S.Schedule, ranges=None) -> ChunkLayout:
        p, v, k = sch.stages, sch.virtual, sch.chunks
        ranges = equal_ranges(layers, k) if ranges is None else ranges
        longest = max(max(b - a for a, b in ranges), 1)
        index = np.zeros((p, v, longest), np.int32)
        valid = np.zeros((p, v, longest), bool)
        slot = np.zeros(layers, np.int32)
        for c, (a, b) in enumerate(ranges):
            s, j = c % p, c // p
            index[s, j] = np.minimum(a + np.arange(longest), max(b - 1, 0))
            valid[s, j, : b - a] = True
            slot[a:b] = (s * v + j) * longest + np.arange(b - a)
        return ChunkLayout(index, valid, slot, bool(valid.all()))

    def to_stages(self, x):
        """(L, ...) -> (P, V, Lmax, ...). Equal chunks: a reshape, which moves no data between
        stages when ``V = 1``; with ``V > 1`` chunk ``v P + s`` is not among the layers stage
        ``s`` holds in the ``(L, ...)`` layout, so XLA moves them every step (an all-to-all over
        the stage axis, and another for the gradients: ``planning._layout_overheads``)."""
        p, v, lc = self.index.shape
        if self.equal:
            return jnp.swapaxes(x.reshape(v, p, lc, *x.shape[1:]), 0, 1)
        return jnp.take(x, jnp.asarray(self.index), axis=0)

    def from_stages(self, g):
        """(P, V, Lmax, ...) -> (L, ...), the padding's slots dropped."""
        if self.equal:
            return jnp.swapaxes(g, 0, 1).reshape(len(self.slot), *g.shape[3:])
        return jnp.take(g.reshape(-1, *g.shape[3:]), jnp.asarray(self.slot), axis=0)


# ---- the step ---------------------------------------------------------------------------------
def build_step(model: StagedModel, mesh, schedule: S.Schedule, axis: str = "stage",
               tensor_axis: str | None = TENSOR_AXIS, donate: bool = False, ranges=None,
               layouts=None, fsdp: bool = False):
    """A jitted ``step(state, batch) -> (state, loss)`` running ``schedule`` over ``axis``;
    ``ranges``: the layers ``[start, end)`` of each chunk (default equal chunks); ``layouts``:
    the parameters' layouts inside a stage (``state_specs``; default Megatron's); ``fsdp``:
    the layers' parameters and Adam moments sharded over the data axes too (module
    docstring)."""
    _check(model, mesh, schedule, axis, ranges)
    if schedule.name in S.SPLIT:
        raise AutoparError(f"schedule {schedule.name!r} splits each backward into input and "
                           f"weight halves, which the lockstep runtime's ticks do not run; "
                           f"build it with autopar.pipeline.mpmd.build_step (runtime='mpmd' "
                           f"in pipeline=), or choose one of {S.SCHEDULES}")
    lay = ChunkLayout.of(model.num_layers, schedule, ranges)
    tensor_axis = tensor_axis if tensor_axis in mesh.axis_names else None
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    data = {a: sizes[a] for a in data_axes(sizes, axis, tensor_axis)}
    sharded = data if fsdp and math.prod(data.values()) > 1 else None

    def specs(tree):
        return state_specs(model, tree, axis, tensor_axis, schedule.stages,
                           sizes.get(tensor_axis, 1), layouts, sharded)

    def loss_and_grads(params, batch):
        _check_rows(batch, schedule.microbatches, data)
        layers, rest = model.split(params)
        gathered = _gathered_dims(model.split(specs(params))[0], tuple(data)) if sharded \
            else None
        grads = _grads_fn(model, mesh, schedule, axis, data, tables(schedule), lay, gathered)
        micro = jax.tree_util.tree_map(
            lambda x: _microbatches(x, schedule.microbatches, mesh, tuple(data)), batch)
        g_layers, g_rest, loss = grads(jax.tree_util.tree_map(lay.to_stages, layers), rest,
                                       micro)
        return loss, model.join(jax.tree_util.tree_map(lay.from_stages, g_layers), g_rest)

    def step(state, batch):
        params = model.params_of(state)
        loss, g = loss_and_grads(params, batch)
        if model.post is not None:      # the user's own step after its value_and_grad
            return model.post(state, batch, loss, g)
        updates, opt_state = model.tx.update(g, state["opt_state"], params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, loss

    def shardings(state, batch):
        st = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs(state))
        bt = jax.tree_util.tree_map(
            lambda x: NamedSharding(mesh, batch_spec(x.ndim, sizes, axis, tensor_axis)), batch)
        return st, bt

    return PipelinedStep(step, shardings, mesh, donate, loss_and_grads, model.stacking)


@dataclasses.dataclass(frozen=True)
class PipelinedStep:
    """The pipelined step: ``jitted(state, batch)`` places its arguments in the step's layouts
    (``in_shardings(state, batch)``) and runs one ``jax.jit`` program, built once per argument
    signature (tree structure, shapes, dtypes), so a training loop traces the step once."""

    fn: object
    in_shardings_of: object
    mesh: object
    donate: bool
    loss_and_grads: object      # (params, batch) -> (loss, grads), for tests and measurements
    stacking: object = None     # an unrolled model's layer stacking (autopar.pipeline.unrolled)
    built: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def _entry(self, state, batch):
        """((state, batch) shardings, the jitted step) for the arguments' signature; an
        unrolled model's state must be in the stacked layout (``stack_state``)."""
        from autopar.pipeline.unrolled import require_stacked

        require_stacked(self.stacking, state)
        key = validate.signature((state, batch), jax.tree_util.tree_leaves((state, batch)))
        if key not in self.built:
            st, bt = self.in_shardings_of(state, batch)
            self.built[key] = (st, bt), jax.jit(
                self.fn, in_shardings=(st, bt), out_shardings=(st, NamedSharding(self.mesh, P())),
                donate_argnums=(0,) if self.donate else ())
        return self.built[key]

    def jitted(self, state, batch):
        return self._entry(state, batch)[1]

    def __call__(self, state, batch):
        (st, bt), fn = self._entry(state, batch)
        state, batch = jax.device_put(state, st), jax.device_put(batch, bt)
        return self._compiled(fn, state, batch)(state, batch)

    def _compiled(self, fn, state, batch):
        """The executable, compiled once per signature (what ``jax.jit`` would do on the first
        call) and checked before it first runs (``check_branches``)."""
        key = ("compiled", validate.signature((state, batch),
                                              jax.tree_util.tree_leaves((state, batch))))
        if key not in self.built:
            compiled = fn.lower(state, batch).compile()
            check_branches(compiled, self.mesh)
            self.built[key] = compiled
        return self.built[key]

    def stack_state(self, state):
        """An unrolled model's state in the stacked layout this step runs on, placed in the
        step's layouts (each stage its own layers); a stacked state as it is."""
        from autopar.pipeline.unrolled import stacked_state

        shapes = stacked_state(self.stacking, jax.eval_shape(lambda s: s, state), abstract=True)
        st, _ = self.in_shardings_of(shapes, {})
        return jax.jit(lambda s: stacked_state(self.stacking, s, abstract=False),
                       out_shardings=st)(state)

    def unstack_state(self, state):
        """The state in the model's own (unrolled) layout, for checkpoints and evaluation."""
        return state if self.stacking is None else jax.jit(self.stacking.unstack_state)(state)


def check_branches(compiled, mesh) -> None:
    """Refuse (on CPU) or warn about an executable with collective-permutes inside the tick's
    per-stage branches. Only the devices of the stages that took a branch reach its
    collectives. An all-reduce meets per replica group (one stage's tensor group), but XLA:CPU's
    collective-permute is one rendezvous over every device its pairs name, including those of
    stages that took another branch, so the step hangs (seen with HF GPT-2's fused q, k, v split
    contiguously over the tensor axis, which GSPMD realigns with collective-permutes). Other
    runtimes are not known to hang on it, and are warned."""
    from autopar import hlo

    found = hlo.in_branches(hlo.parse(compiled.as_text()))
    if not found:
        return
    first = found[0]
    where = first.op_name + (f" ({first.source})" if first.source else "")
    platform = mesh.devices.flat[0].platform
    msg = (f"the pipelined step's layouts inside a stage make XLA move values with "
           f"{len(found)} collective-permute(s) inside the per-stage branches of the tick loop "
           f"(first: {where}); a collective-permute there waits for devices of stages that "
           f"took another branch. Keep the parameter whose split needs it whole on the tensor "
           f"axis: run a plan of strategy 'megatron_3d', or one on a mesh without a tensor "
           f"axis, or declare a StagedModel whose stacked layout gives the split dim its own "
           f"axis (as autopar.pipeline.hf does for GPT-2's fused q, k, v)")
    if platform == "cpu":
        raise AutoparError(msg + "; on XLA:CPU this hangs, so it is not run")
    import warnings

    warnings.warn(msg + f"; on {platform} this is not known to hang, and runs", stacklevel=3)


def _microbatches(x, m: int, mesh, axes):
    """(B, ...) -> (M, B / M, ...), row ``i`` to microbatch ``i % M``; rows stay on their data
    shards."""
    x = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
    spec = P(None, axes or None, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _check(model: StagedModel, mesh, schedule: S.Schedule, axis: str, ranges) -> None:
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if axis not in sizes:
        raise AutoparError(f"pipeline axis {axis!r} is not an axis of the mesh {sizes}; name one "
                           f"of {sorted(sizes)} in pipeline={{'axis': ...}}")
    if sizes[axis] != schedule.stages:
        raise AutoparError(f"pipeline stages={schedule.stages} but mesh axis {axis!r} has "
                           f"{sizes[axis]} devices; use stages={sizes[axis]}")
    if schedule.stages < 2:
        raise AutoparError("a pipeline needs stages >= 2; plan without pipeline= for one stage")
    if ranges is None and model.num_layers % schedule.chunks:
        raise AutoparError(f"{model.num_layers} layers do not split into stages x "
                           f"virtual_stages = {schedule.chunks} equal chunks; choose stages and "
                           f"virtual_stages whose product divides {model.num_layers}, or give "
                           f"ranges= (the layers of each chunk)")
    if ranges is not None:
        _check_ranges(tuple(map(tuple, ranges)), model.num_layers, schedule.chunks)


def _check_ranges(ranges: tuple, layers: int, chunks: int) -> None:
    ends = [0] + [b for _, b in ranges]
    if (len(ranges) != chunks or any(a != e or b < a for (a, b), e in zip(ranges, ends))
            or ends[-1] != layers):
        raise AutoparError(f"ranges={list(ranges)} must be {chunks} contiguous layer ranges "
                           f"[start, end), one per chunk (stages x virtual_stages), from 0 to "
                           f"{layers}, e.g. {[(0, layers - 1), (layers - 1, layers)]} for two")


def rows_split(rows: int, m: int, shards: int) -> bool:
    """``rows`` split into ``m`` microbatches of whole rows on each of ``shards`` data shards."""
    return rows % m == 0 and (rows // m) % shards == 0


def _check_rows(batch, m: int, data: dict) -> None:
    shards = math.prod(data.values())
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        rows = x.shape[0] if x.ndim else 0
        if x.ndim and not rows_split(rows, m, shards):
            raise AutoparError(
                f"batch{jax.tree_util.keystr(path)} has {rows} rows, which do not split into "
                f"microbatches={m} of equal row counts on each of the {shards} data shards "
                f"(mesh axes {data}); use a batch of a multiple of {m * shards} rows or fewer "
                f"microbatches")


def _grads_fn(model: StagedModel, mesh, sch: S.Schedule, axis: str, data: dict, tab: Tables,
              lay: ChunkLayout, gathered=None):
    """``(staged layers, rest, microbatches) -> (layer grads, rest grads, loss)`` as a
    ``shard_map`` manual over ``axis`` and the ``data`` axes (each device gets its rows of every
    microbatch), automatic over the tensor axis; its body walks the ticks on local rows and
    averages gradients and loss over ``data`` once, after the loop. ``gathered``: per layer
    leaf, the dim its FSDP shards split over the data axes (-1: not sharded), which the
    staged ``(P, V, Lmax, ...)`` layers and their gradients keep."""
    body = functools.partial(_pipeline_body, model, sch, axis, tuple(data),
                             math.prod(data.values()), tab, lay, gathered)
    rows = P(None, tuple(data) or None)
    layers = P(axis)
    if gathered is not None:
        layers = jax.tree_util.tree_map(
            lambda d: P(axis) if d < 0 else P(axis, None, None, *(None,) * d, tuple(data)),
            gathered)
    return jax.shard_map(body, mesh=mesh, in_specs=(layers, P(), rows),
                         out_specs=(layers, P(), P()), axis_names=frozenset({axis, *data}),
                         check_vma=False)


def _gathered_dims(layer_specs, data: tuple):
    """Per stacked layer leaf's spec: the dim (of one layer's leaf) split over the data axes,
    -1 for none."""
    want = {data, data[0] if len(data) == 1 else data}

    def dim(spec):
        return next((i for i, d in enumerate(tuple(spec)[1:])
                     if (tuple(d) if isinstance(d, (tuple, list)) else d) in want), -1)

    return jax.tree_util.tree_map(dim, layer_specs, is_leaf=lambda x: isinstance(x, P))


def _pipeline_body(model: StagedModel, sch: S.Schedule, axis: str, data: tuple, shards: int,
                   tab: Tables, lay: ChunkLayout, gathered, layers, rest, micro):
    """Runs on every device: ``layers`` its stage's (1, V, Lmax, ...) view, ``micro`` its data
    shard's rows of every microbatch (M, b, ...)."""
    layers = jax.tree_util.tree_map(lambda a: a[0], layers)                 # (V, Lmax, ...)
    s = jax.lax.axis_index(axis)
    mb0 = jax.tree_util.tree_map(lambda x: x[0], micro)
    x_aval = jax.eval_shape(model.embed, rest, mb0)                           # (b, S, D)
    valid = None if lay.equal else jnp.asarray(lay.valid)[s]                  # (V, Lmax)
    acts = Actions(model, sch, layers, rest, micro, valid, gathered, data)
    zeros = functools.partial(jnp.zeros, dtype=x_aval.dtype)
    carry = (zeros((tab.stash_slots, *x_aval.shape)), zeros((tab.inbox_f_slots, *x_aval.shape)),
             zeros((tab.inbox_b_slots, *x_aval.shape)),
             jax.tree_util.tree_map(jnp.zeros_like, layers),
             jax.tree_util.tree_map(jnp.zeros_like, rest), jnp.zeros((), jnp.float32))
    p = sch.stages
    fwd_perm = [(i, (i + 1) % p) for i in range(p)]
    bwd_perm = [(i, (i - 1) % p) for i in range(p)]

    def tick(carry, row):
        act, recv_f, recv_b = row
        mine = {f: act[f][:, s] for f in FIELDS}                              # (2,) each
        send_f = send_b = zeros(x_aval.shape)
        for i in range(2):
            a = {f: mine[f][i] for f in FIELDS}
            carry, send_f, send_b = jax.lax.switch(
                a["kind"], (acts.nothing, acts.forward, acts.backward), carry, send_f, send_b, a)
        got_f = jax.lax.ppermute(send_f, axis, fwd_perm)
        got_b = jax.lax.ppermute(send_b, axis, bwd_perm)
        st, inf, inb, *rest_c = carry
        inf = _put(inf, recv_f[s], got_f)
        inb = _put(inb, recv_b[s], got_b)
        return (st, inf, inb, *rest_c), None

    xs = ({f: jnp.asarray(v) for f, v in tab.act.items()}, jnp.asarray(tab.recv_f),
          jnp.asarray(tab.recv_b))
    carry, _ = jax.lax.scan(tick, carry, xs)
    *_, g_layers, g_rest, loss = carry
    return _reduce(g_layers, g_rest, loss, axis, data, shards, gathered)


def _reduce(g_layers, g_rest, loss, axis: str, data: tuple, shards: int, gathered=None):
    """The step's only gradient collectives: local means averaged over the data shards (equal
    row counts, so the mean of their means is the batch mean); the embedding's and head's
    gradients and the loss also summed over the stages (each came from one stage). FSDP-sharded
    layer gradients were summed over the data shards by their reduce-scatters already."""
    def mean(tree, axes):
        summed = jax.lax.psum(tree, axes) if axes else tree
        return jax.tree_util.tree_map(lambda x: x / shards, summed)

    if gathered is None:
        g_layers = mean(g_layers, data)
    else:
        g_layers = jax.tree_util.tree_map(
            lambda g, d: (jax.lax.psum(g, data) if d < 0 and data else g) / shards,
            g_layers, gathered)
    g_layers = jax.tree_util.tree_map(lambda g: g[None], g_layers)
    return g_layers, mean(g_rest, (axis, *data)), mean(loss, (axis, *data))


def _put(buf, slot, x):
    """``buf[slot] = x`` when ``slot >= 0``."""
    i = jnp.maximum(slot, 0)
    return buf.at[i].set(jnp.where(slot >= 0, x, buf[i]))


class Actions:
    """The forward and backward of one (microbatch, chunk) on this device, as ``lax.switch``
    branches over the carry ``(stash, inbox_f, inbox_b, layer grads, rest grads, loss)``."""

    def __init__(self, model: StagedModel, sch: S.Schedule, layers, rest, micro, valid=None,
                 gathered=None, data: tuple = ()):
        self.model, self.layers, self.rest, self.micro = model, layers, rest, micro
        self.valid = valid          # (V, Lmax) bools, None: every slot is a layer
        self.last, self.m = sch.chunks - 1, sch.microbatches
        self.gathered, self.data = gathered, data   # FSDP: per leaf, its dim split over data
        self._apply = model.layer
        if gathered is not None:    # the gathered copy is not kept for the backward
            self._apply = jax.checkpoint(self._gather_apply,
                                         policy=jax.checkpoint_policies.nothing_saveable)

    def _gather_apply(self, lp, h):
        lp = jax.tree_util.tree_map(
            lambda x, d: x if d < 0 else jax.lax.all_gather(x, self.data, axis=d, tiled=True),
            lp, self.gathered)
        return self.model.layer(lp, h)

    def nothing(self, carry, send_f, send_b, a):
        return carry, send_f, send_b

    def _chunk_fn(self, a):
        """``f(layer params of the chunk, rest, stashed input) -> (output, loss)``."""
        model = self.model
        batch = jax.tree_util.tree_map(lambda x: x[a["mb"]], self.micro)

        def f(p_v, rest, x_in):
            x = jax.lax.cond(a["chunk"] == 0, lambda: model.embed(rest, batch), lambda: x_in)
            y, _ = jax.lax.scan(self._layer, x, p_v if self.valid is None else (
                p_v, self.valid[a["virtual"]]))
            loss = jax.lax.cond(a["chunk"] == self.last,
                                lambda: model.head_loss(rest, y, batch).astype(jnp.float32),
                                lambda: jnp.zeros((), jnp.float32))
            return y, loss

        return f

    def _layer(self, h, lp):
        """One slot of the chunk; a padding slot (``valid`` False) is the identity."""
        if self.valid is None:
            return self._apply(lp, h), None
        lp, ok = lp
        return jax.lax.cond(ok, self._apply, lambda _, x: x, lp, h), None

    def _params(self, a):
        return jax.tree_util.tree_map(lambda x: x[a["virtual"]], self.layers)

    def forward(self, carry, send_f, send_b, a):
        stash, inf, inb, gl, gr, loss = carry
        x_in = inf[jnp.maximum(a["in_slot"], 0)]
        y, mb_loss = self._chunk_fn(a)(self._params(a), self.rest, x_in)
        x_used = jnp.where(a["chunk"] == 0, jnp.zeros_like(x_in), x_in)
        stash = stash.at[a["stash_slot"]].set(x_used)
        return (stash, inf, inb, gl, gr, loss + mb_loss / self.m), y, send_b

    def backward(self, carry, send_f, send_b, a):
        stash, inf, inb, gl, gr, loss = carry
        last = a["chunk"] == self.last
        dy = jnp.where(last, 0, inb[jnp.maximum(a["in_slot"], 0)])
        dl = jnp.where(last, 1.0 / self.m, 0.0).astype(jnp.float32)
        _, vjp = jax.vjp(self._chunk_fn(a), self._params(a), self.rest, stash[a["stash_slot"]])
        dp, dr, dx = vjp((dy.astype(stash.dtype), dl))
        gl = jax.tree_util.tree_map(lambda g, d: g.at[a["virtual"]].add(d), gl, dp)
        gr = jax.tree_util.tree_map(jnp.add, gr, dr)
        return (stash, inf, inb, gl, gr, loss), send_f, dx
