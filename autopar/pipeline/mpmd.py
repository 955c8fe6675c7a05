"""The pipelined training step as MPMD: each stage its own programs on its own devices, issued
asynchronously, with no lockstep ticks.

``build_step(model, mesh, schedule)`` returns a step with the interface of
``runtime.PipelinedStep`` (``step(state, batch) -> (state, loss)``, ``in_shardings_of``,
``stack_state``, ``unstack_state``, ``loss_and_grads``) computing what the unpipelined step
computes. Where the lockstep runtime is one SPMD program whose every hop between stages costs
a tick of the slowest stage (``schedules`` explains why plain 1F1B then idles in its steady
state), here:

  * stage ``s`` is the submesh at index ``s`` of the pipeline axis (the other axes: its data and
    tensor axes). Its forward, backward and gradient reduction are ``jax.jit`` programs on that
    submesh (inside, ``jax.shard_map`` manual over the data axes and automatic over the tensor
    axis, as in the lockstep runtime, so a device runs its rows and gradients are summed over
    the data shards once, after the last microbatch);
  * one Python loop issues every stage's actions in ``schedules.dispatch_order``. JAX
    dispatches asynchronously, so issuing returns at once; each device runs its programs in the
    order issued and waits only for its inputs. Activations and cotangents move between
    submeshes with ``jax.device_put`` as soon as they are made;
  * the state keeps the lockstep runtime's layout (``runtime.state_specs``: the stacked layers
    split over the pipeline axis, the rest whole on every stage), so plans, ``stack_state`` and
    checkpoints are the same. A stage reads its layers as a view of its own devices' shards of
    the state (``jax.make_array_from_single_device_arrays``, no copy), and its layer gradients
    become the state-shaped gradient the same way; the embedding's and head's gradients (made
    on the first and last stage) are summed on the first and copied to every stage. The user's
    optimizer then runs as one program over the whole mesh, so transformations that look at
    every gradient (a global-norm clip) see them all;
  * the last stage's forward only keeps its input: its backward recomputes the chunk (and the
    loss) from it under ``jax.vjp``, as every backward does, so that forward has nothing to do
    (``planning`` prices it at zero);
  * a zero-bubble schedule (``schedules.SPLIT``) runs each backward as two programs
    (``autopar.pipeline.split``): ``B`` recomputes the chunk, keeps what each layer's ``jax.vjp``
    saves, and runs only the equations of the input gradient (the embedding's and head's
    gradients too); it returns the cotangent for the stage before and the layers' frontiers.
    ``W`` runs the remaining equations on the frontiers, the layers' weight gradients, when
    the schedule says.

Under ``jax.distributed`` (multi-controller) every process walks the same dispatch order and
issues the programs of the stages that have a device of its own; a hop between stages of
different processes is a collective-permute over the two submeshes stacked, which both
processes issue at the same point of the order (so the collectives pair up), and the rest's
gradients and the loss are summed over the stages by one program over the whole mesh that
every process runs, as the optimizer is. Within one process a hop is a ``jax.device_put``.

Runs one chunk per stage (``virtual_stages=1``), equal layer ranges and no FSDP inside stages:
the state's layout gives stage ``s`` exactly layers ``[s L / P, (s + 1) L / P)`` then. It also
runs two chunks per stage placed in a V (``schedules.V_SHAPED``: ``zb_v``): programs,
accumulators of the layers' gradients, stashes and inboxes are per chunk, on the stage
``schedule.stage_of(chunk)`` (the embedding's and head's gradients and the loss per stage);
a hop goes to the stage of the chunk that reads it, none at the V's turn. The state's layout
stays the same, so each step copies every chunk's layers from the stage holding them to the
stage of its V and joins their gradients back (``_chunk_view``, ``_per_stage``); within one
process only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from autopar import validate
from autopar.errors import AutoparError
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S
from autopar.pipeline import split as SP
from autopar.pipeline.model import StagedModel

# per program kind, the arguments it donates (the stage's gradient and loss accumulators)
DONATED = {"bwd": (6, 7, 8), "bin": (6, 7), "wgrad": (2,)}
KINDS = {"fwd": "F", "bwd": "B", "bin": "B", "wgrad": "W"}


def supports(schedule: S.Schedule, layers: int, ranges=None, fsdp: bool = False) -> str:
    """Why this runtime cannot run the choice, or ``""`` when it can: one chunk per stage, or
    two in a V (``schedules.V_SHAPED``), of equal layers."""
    if schedule.virtual != 1 and schedule.name not in S.V_SHAPED:
        return (f"virtual_stages={schedule.virtual}: the state's layout holds a stage's own "
                f"layers, not chunks v P + s (two chunks per stage run in a V: zb_v)")
    if layers % schedule.stages:
        return f"{layers} layers do not split into {schedule.stages} equal stages"
    if layers % schedule.chunks:
        return (f"{layers} layers do not split into {schedule.chunks} equal chunks "
                f"({schedule.virtual} per stage)")
    if ranges is not None and tuple(map(tuple, ranges)) != R.equal_ranges(layers,
                                                                         schedule.chunks):
        return f"unequal layer ranges {list(ranges)}"
    if fsdp:
        return "FSDP inside stages"
    return ""


def build_step(model: StagedModel, mesh, schedule: S.Schedule, axis: str = "stage",
               tensor_axis: str | None = R.TENSOR_AXIS, ranges=None, layouts=None):
    """The MPMD step running ``schedule`` over ``axis`` (module docstring); ``layouts``: the
    parameters' layouts inside a stage (``runtime.state_specs``; default Megatron's)."""
    R._check(model, mesh, schedule, axis, ranges)
    why = supports(schedule, model.num_layers, ranges)
    if why:
        raise AutoparError(f"the MPMD pipeline runtime cannot run this pipeline ({why}); use "
                           f"runtime='lockstep' in pipeline= (or build it with "
                           f"autopar.pipeline.runtime.build_step)")
    tensor_axis = tensor_axis if tensor_axis in mesh.axis_names else None
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    runner = _Runner(model, mesh, schedule, axis, tensor_axis, sizes, layouts)
    if schedule.virtual > 1 and not all(runner.mine):
        raise AutoparError(f"schedule {schedule.name!r} moves each chunk's layers to the stage "
                           f"of its V with device_put, which needs every stage in this process; "
                           f"under jax.distributed use schedule='zb_h1' or '1f1b'")

    def shardings(state, batch):
        st = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), runner.specs(state))
        bt = jax.tree_util.tree_map(
            lambda x: NamedSharding(mesh, R.batch_spec(x.ndim, sizes, axis, tensor_axis)), batch)
        return st, bt

    return MpmdStep(None, shardings, mesh, False, runner.loss_and_grads, model.stacking,
                    runner=runner)


@dataclasses.dataclass(frozen=True)
class MpmdStep(R.PipelinedStep):
    """``runtime.PipelinedStep``'s interface over the MPMD runner: ``step(state, batch)``
    places its arguments in the step's layouts and issues the schedule; there is no one
    program to lower (``jitted`` refuses)."""

    runner: object = None

    def jitted(self, state, batch):
        raise AutoparError("an MPMD pipelined step is many programs, one per stage and action, "
                           "not one jax.jit; lower a lockstep step "
                           "(autopar.pipeline.runtime.build_step) to read its HLO")

    def __call__(self, state, batch):
        from autopar.pipeline.unrolled import require_stacked

        require_stacked(self.stacking, state)
        st, state, batch = self._placed(state, batch)
        loss, grads = self.runner.loss_and_grads(self.runner.model.params_of(state), batch)
        return self.runner.update(state, grads, st, batch=batch, loss=loss)

    def _one_process(self, what: str) -> None:
        if not all(self.runner.mine):
            raise AutoparError(f"MpmdStep.{what} runs every stage's programs one at a time from "
                               f"this process, and stages of this mesh belong to other "
                               f"processes; measure on a mesh of this process's devices")

    def _placed(self, state, batch):
        """(the state's shardings, state and batch placed in the step's layouts)."""
        st, bt = self.in_shardings_of(state, batch)
        return st, jax.device_put(state, st), jax.device_put(batch, bt)

    def issued(self, state, batch):
        """This step with every program built (it runs once on ``state`` and ``batch``), as
        ``compare`` times a compiled plan: ``Issued(state, batch)`` runs the step on arguments
        placed in ``input_shardings[0]``."""
        st, bt = self.in_shardings_of(state, batch)
        jax.block_until_ready(self(state, batch))
        return Issued(self, ((st, bt), {}), self.measure_peak(state, batch))

    def measure_peak(self, state, batch) -> float:
        """The most bytes one device holds during a step, measured: the step runs one action
        at a time, and after each the buffers the step holds on each device (the state, the
        stages' stashes, inboxes and accumulators, the program's arguments and results, each
        buffer once) plus the temporaries XLA's buffer assignment gives the program that ran
        (``memory_analysis``). Slow: for ``compare`` and tests, not for training."""
        self._one_process("measure_peak")
        st, state, batch = self._placed(state, batch)
        peak = [0.0]

        def watch(program, args, outs, held):
            jax.block_until_ready(outs)
            temp = program.lower(*args).compile().memory_analysis().temp_size_in_bytes
            peak[0] = max(peak[0], max(_held_bytes((state, args, outs, held)).values()) + temp)

        loss, grads = self.runner.loss_and_grads(self.runner.model.params_of(state), batch,
                                                 watch=watch)
        new = self.runner.update(state, grads, st, watch=watch, batch=batch, loss=loss)
        jax.block_until_ready(new)
        return peak[0]

    def action_times(self, state, batch, runs: int = 5) -> dict:
        """``{("F", "B" or "W", chunk): seconds}``: each chunk's forward and backward programs
        (a split schedule's input and weight halves as B and W) run alone (the devices
        otherwise idle, each call waited for), the median of ``runs`` calls, on the arguments
        one step gives them. The inputs of ``schedules.price_async`` when it predicts a
        measured step (``benchmarks``)."""
        self._one_process("action_times")
        _, state, batch = self._placed(state, batch)
        out: dict = {}

        def watch(program, args, outs, held):
            what, chunk = self.runner.made(program)
            key = (KINDS[what], chunk)
            if key in out:
                return
            jax.block_until_ready(outs)
            times = []
            for _ in range(runs):
                call = _copied(args, DONATED.get(what, ()))
                jax.block_until_ready(call)
                t0 = time.perf_counter()
                jax.block_until_ready(program(*call))
                times.append(time.perf_counter() - t0)
            out[key] = statistics.median(times)

        jax.block_until_ready(self.runner.loss_and_grads(self.runner.model.params_of(state), batch,
                                                 watch=watch))
        return out


@dataclasses.dataclass(frozen=True)
class Issued:
    """An MPMD step whose programs are built: what ``compare`` times in place of a jax
    ``Compiled`` (there is no one executable, so no XLA memory figure)."""

    step: MpmdStep
    input_shardings: tuple
    peak_bytes: float = 0.0     # MpmdStep.measure_peak

    def __call__(self, state, batch):
        return self.step(state, batch)


class _Runner:
    """The stages' programs (built once per argument signature) and the issuing loop."""

    def __init__(self, model, mesh, sch, axis, tensor_axis, sizes, layouts):
        self.model, self.mesh, self.sch, self.axis = model, mesh, sch, axis
        self.tensor_axis, self.sizes, self.layouts = tensor_axis, sizes, layouts
        self.data = R.data_axes(sizes, axis, tensor_axis)
        self.shards = math.prod(sizes[a] for a in self.data)
        names = tuple(a for a in mesh.axis_names if a != axis)
        at = mesh.axis_names.index(axis)
        self.subs = [Mesh(np.take(mesh.devices, s, axis=at), names)
                     for s in range(sch.stages)]
        me = jax.process_index()
        # the stages this process issues: those with a device of its own (every stage when one
        # process drives the mesh); a hop between stages of other processes is a collective
        self.mine = [any(d.process_index == me for d in sub.devices.flat) for sub in self.subs]
        # the stages whose every device is this process's (a hop between two is a device_put),
        # and each stage's activation layout: read on every hop, so made once
        self.local = [all(d.process_index == me for d in sub.devices.flat) for sub in self.subs]
        self.act_shardings = [NamedSharding(sub, self._rows()) for sub in self.subs]
        self.programs: dict = {}
        self._made: dict = {}           # id(program) -> (kind, stage)
        self._zeros: dict = {}          # a hop's placeholder shards, per device and shape
        self._splits: dict = {}         # a split schedule's layer splits (_layer_split)
        self._traced: dict = {}         # stage -> the split its last traced B program used

    def specs(self, tree):
        return R.state_specs(self.model, tree, self.axis, self.tensor_axis, self.sch.stages,
                             self.sizes.get(self.tensor_axis, 1), self.layouts)

    # ---- views between the whole mesh and a stage's submesh --------------------------------
    def _inner(self, spec) -> P:
        """A whole-mesh spec without the pipeline axis (a stage's view of the same shards)."""
        def drop(d):
            if isinstance(d, tuple):
                rest = tuple(a for a in d if a != self.axis)
                return rest if len(rest) > 1 else (rest[0] if rest else None)
            return None if d == self.axis else d
        return P(*map(drop, tuple(spec)))

    def _view(self, x, s: int):
        """Stage ``s``'s devices' shards of the whole-mesh array ``x`` as an array on its
        submesh (no copy)."""
        spec = x.sharding.spec
        split = len(spec) and (spec[0] == self.axis)
        shape = (x.shape[0] // self.sch.stages, *x.shape[1:]) if split else x.shape
        mine = set(self.subs[s].devices.flat)
        shards = [sh.data for sh in x.addressable_shards if sh.device in mine]
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(self.subs[s], self._inner(spec)), shards)

    def _whole(self, parts, sharding, shape):
        """Arrays on each stage's submesh (stage ``s``'s in ``parts[s]``) as one whole-mesh
        array of ``sharding`` (no copy): each device's shard is the one its stage holds."""
        shards = [sh.data for part in parts for sh in part.addressable_shards]
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)

    # ---- the stages' programs ----------------------------------------------------------------
    def _rows(self) -> P:
        """An activation's (or accumulator's) layout: its leading dim over the data axes."""
        return P(self.data or None)

    def _micro_specs(self, micro):
        """The microbatches' (M, b, ...) layouts: rows over the data axes."""
        return jax.tree_util.tree_map(
            lambda x: P(None, self.data or None) if x.ndim >= 2 else P(), micro)

    def _program(self, kind: str, k: int, args):
        key = (kind, k, validate.signature(args, jax.tree_util.tree_leaves(args)))
        if key not in self.programs:
            self.programs[key] = getattr(self, f"_build_{kind}")(k, args)
            self._made[id(self.programs[key])] = (kind, k)
        return self.programs[key]

    def made(self, program) -> tuple[str, int]:
        """``(kind, chunk)`` of a program ``_program`` built (kind: "fwd", "bwd", ...; the
        chunk is the stage with one chunk per stage)."""
        return self._made[id(program)]

    def _shard_map(self, body, k: int, in_specs, out_specs):
        if not self.data:       # no data axes: the body runs on the whole stage as it is
            return body
        return jax.shard_map(body, mesh=self.subs[self.sch.stage_of(k)], in_specs=in_specs,
                             out_specs=out_specs, axis_names=frozenset(self.data), check_vma=False)

    def _chunk(self, k: int):
        """``f(layers, rest, x_in, micro, m) -> (y, loss)`` of stage ``s``'s chunk on
        microbatch ``m`` of the local rows ``micro`` (M, b, ...)."""
        model, last = self.model, k == self.sch.chunks - 1

        def f(layers, rest, x_in, micro, m):
            batch = jax.tree_util.tree_map(lambda x: x[m], micro)
            x = model.embed(rest, batch) if k == 0 else x_in
            y, _ = jax.lax.scan(lambda h, lp: (model.layer(lp, h), None), x, layers)
            loss = (model.head_loss(rest, y, batch).astype(jnp.float32) if last
                    else jnp.zeros((), jnp.float32))
            return y, loss

        return f

    def _build_fwd(self, k: int, args):
        chunk = self._chunk(k)

        def body(layers, rest, x_in, micro, m):
            return chunk(layers, rest, x_in, micro, m)[0]

        rows = self._rows()
        mapped = self._shard_map(_named(body, f"forward_{k}"), k,
                                 (P(), P(), rows, self._micro_specs(args[3]), P()), rows)
        return jax.jit(mapped)

    def _build_bwd(self, k: int, args):
        chunk = self._chunk(k)
        last, m_count = k == self.sch.chunks - 1, self.sch.microbatches

        def body(layers, rest, x_in, dy, micro, m, g_layers, g_rest, loss):
            (y, mb_loss), vjp = jax.vjp(lambda p, r, x: chunk(p, r, x, micro, m),
                                        layers, rest, x_in)
            dl = jnp.float32(1.0 / m_count if last else 0.0)
            dp, dr, dx = vjp((jnp.zeros_like(y) if last else dy.astype(y.dtype), dl))
            g_layers = jax.tree_util.tree_map(lambda g, d: g + d[None], g_layers, dp)
            g_rest = jax.tree_util.tree_map(lambda g, d: g + d[None], g_rest, dr)
            return dx, g_layers, g_rest, loss + (mb_loss / m_count)[None]

        rows = acc = self._rows()
        mapped = self._shard_map(
            _named(body, f"backward_{k}"), k,
            (P(), P(), rows, rows, self._micro_specs(args[4]), P(), acc, acc, acc),
            (rows, acc, acc, acc))
        return jax.jit(mapped, donate_argnums=DONATED["bwd"])

    def _layer_split(self, k: int, layers, x) -> SP.LayerSplit:
        """Stage ``s``'s layer backward cut into its halves at one layer of ``layers`` and the
        activation ``x`` (traced inside the input-gradient program, so the weight-gradient
        program that follows reads the same frontier)."""
        one = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                     layers)
        key = (k, validate.signature((one, x), jax.tree_util.tree_leaves((one, x))))
        if key not in self._splits:
            self._splits[key] = SP.split_layer(self.model.layer, one, x)
        self._traced[k] = self._splits[key]
        return self._traced[k]

    def _build_bin(self, k: int, args):
        """A split schedule's ``B``: the chunk recomputed, each layer's input gradient (and the
        embedding's and head's whole gradients); returns the cotangent of the chunk's input,
        the layers' frontiers (a leading dim per data shard) and the accumulators."""
        model, last, m_count = self.model, k == self.sch.chunks - 1, self.sch.microbatches

        def body(layers, rest, x_in, dy, micro, m, g_rest, loss):
            batch = jax.tree_util.tree_map(lambda x: x[m], micro)
            if k == 0:
                x, embed_vjp = jax.vjp(lambda r: model.embed(r, batch), rest)
            else:
                x = x_in
            sp = self._layer_split(k, layers, x)
            y, saved = jax.lax.scan(lambda h, p: sp.forward(p, h), x, layers)
            dr = jax.tree_util.tree_map(jnp.zeros_like, rest)
            mb_loss = jnp.zeros((), jnp.float32)
            if last:
                mb_loss, head_vjp = jax.vjp(
                    lambda r, h: model.head_loss(r, h, batch).astype(jnp.float32), rest, y)
                dr, dy = head_vjp(jnp.float32(1.0 / m_count))
            dx, front = jax.lax.scan(lambda d, pf: sp.input_grad(pf[0], pf[1], d),
                                     dy.astype(y.dtype), (layers, saved), reverse=True)
            if k == 0:
                dr = jax.tree_util.tree_map(jnp.add, dr, embed_vjp(dx)[0])
            g_rest = jax.tree_util.tree_map(lambda g, d: g + d[None], g_rest, dr)
            return (dx, [f[None] for f in front], g_rest,
                    loss + (mb_loss / m_count)[None])

        rows = acc = self._rows()
        mapped = self._shard_map(
            _named(body, f"backward_input_{k}"), k,
            (P(), P(), rows, rows, self._micro_specs(args[4]), P(), acc, acc),
            (rows, acc, acc, acc))
        return jax.jit(mapped, donate_argnums=DONATED["bin"])

    def _build_wgrad(self, k: int, args):
        """A split schedule's ``W``: the layers' weight gradients from their frontiers (the
        equations ``_build_bin`` left), added to the stage's accumulator."""
        sp = self._traced[k]

        def body(layers, front, g_layers):
            dp = jax.lax.scan(lambda c, pf: (c, sp.weight_grad(pf[0], pf[1])), None,
                              (layers, [f[0] for f in front]))[1]
            return jax.tree_util.tree_map(lambda g, d: g + d[None], g_layers, dp)

        acc = self._rows()
        mapped = self._shard_map(_named(body, f"backward_weight_{k}"), k, (P(), acc, acc), acc)
        return jax.jit(mapped, donate_argnums=DONATED["wgrad"])

    def _build_zeros(self, k: int, args):
        """Stage ``s``'s accumulators: per data shard (a leading dim split over the data
        axes) a zero gradient of its layers and of the rest, and a zero loss."""
        layers, rest = args
        n = max(self.shards, 1)

        def acc_sharding(x):
            inner = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
            return NamedSharding(self.subs[self.sch.stage_of(k)], P(self.data or None, *inner))

        outs = (jax.tree_util.tree_map(acc_sharding, layers),
                jax.tree_util.tree_map(acc_sharding, rest),
                NamedSharding(self.subs[self.sch.stage_of(k)], P(self.data or None)))
        return jax.jit(lambda: (
            jax.tree_util.tree_map(lambda x: jnp.zeros((n, *x.shape), x.dtype), layers),
            jax.tree_util.tree_map(lambda x: jnp.zeros((n, *x.shape), x.dtype), rest),
            jnp.zeros((n,), jnp.float32)), out_shardings=outs)

    def _build_reduce(self, k: int, args):
        """Accumulators -> the stage's gradients (the mean over the data shards) and loss, in
        the layouts of the stage's views of the state."""
        (g_layers, g_rest, _), (layers, rest) = args
        sub = self.subs[self.sch.stage_of(k)]
        outs = (jax.tree_util.tree_map(lambda x: x.sharding, layers),
                jax.tree_util.tree_map(lambda x: NamedSharding(sub, P(None, *x.sharding.spec)),
                                       rest),
                NamedSharding(sub, P()))
        n = max(self.shards, 1)

        def reduce(acc):
            g_layers, g_rest, loss = jax.tree_util.tree_map(lambda g: g.sum(0) / n, acc)
            return g_layers, jax.tree_util.tree_map(lambda g: g[None], g_rest), loss[None]

        return jax.jit(reduce, out_shardings=(outs[0], outs[1], NamedSharding(sub, P(None))))

    # ---- one step ----------------------------------------------------------------------------
    def loss_and_grads(self, params, batch, watch=None):
        """``(loss, grads)`` of ``params`` (the whole-mesh state layout) on ``batch``, the
        schedule issued chunk by chunk on the chunks' stages; ``watch(program, args, outputs)``,
        when given, is called after each stage program is issued (``MpmdStep.measure_peak``).
        Accumulators: the layers' gradient per chunk, the rest's and the loss per stage."""
        sch, model = self.sch, self.model
        p, last = sch.stages, sch.chunks - 1
        specs = self.specs(params)
        st = jax.tree_util.tree_map(lambda sp: NamedSharding(self.mesh, sp), specs)
        params = jax.device_put(params, st)
        R._check_rows(batch, sch.microbatches, {a: self.sizes[a] for a in self.data})
        micro = _microbatches(batch, sch.microbatches, self.mesh, self.data, self.programs)
        layers, rest = model.split(params)
        mine = [self.mine[sch.stage_of(k)] for k in range(sch.chunks)]     # per chunk
        views = [(jax.tree_util.tree_map(functools.partial(self._chunk_view, k=k), layers),
                  jax.tree_util.tree_map(functools.partial(self._view, s=sch.stage_of(k)), rest))
                 if mine[k] else None for k in range(sch.chunks)]
        micros = [jax.tree_util.tree_map(functools.partial(self._view, s=s), micro)
                  if self.mine[s] else None for s in range(p)]
        acc_l, acc_r = [None] * sch.chunks, [None] * p
        for k in range(sch.chunks):
            if mine[k]:
                g_layers, *g_rest = self._program("zeros", k, views[k])()
                acc_l[k] = g_layers
                acc_r[sch.stage_of(k)] = acc_r[sch.stage_of(k)] or tuple(g_rest)
        aval = jax.eval_shape(  # one microbatch's activation, as a stage's submesh holds it
            model.embed, jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype), rest), jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro))
        inbox_f, inbox_b, stash, fronts = {}, {}, {}, {}
        held = (micro, views, acc_l, acc_r, stash, inbox_f, inbox_b, fronts)
        split = sch.name in S.SPLIT
        act = None
        # (kind, chunk) -> its program: every action of one kind and chunk in a step has the
        # same argument signature, so _program's key (a signature of 20-36 leaves: 0.13 of the
        # issuing loop's 0.45 s under cProfile, 4-stage ZB-V) is made once per step, not per
        # action
        run = functools.partial(self._run, built={})
        for s, a in S.dispatch_order(sch):
            k = a.chunk
            if a.kind == "F" and k < last and (mine[k] or mine[k + 1]):
                y = None
                if mine[k]:
                    x_in = inbox_f.pop((a.mb, k), None)
                    if x_in is None:              # chunk 0 embeds: a placeholder input
                        x_in = act if act is not None else jax.device_put(
                            jnp.zeros(aval.shape, aval.dtype), self._act_sharding(0))
                        act = x_in
                    y = run("fwd", k, (*views[k], x_in, micros[s], np.int32(a.mb)),
                                  watch, held)
                    stash[(a.mb, k)] = x_in
                got = self._move(y, s, sch.stage_of(k + 1), aval)
                if mine[k + 1]:
                    inbox_f[(a.mb, k + 1)] = got
            elif a.kind == "F" and k == last and mine[k]:   # the backward recomputes it all
                stash[(a.mb, k)] = inbox_f.pop((a.mb, k), None)
            elif a.kind == "W" and mine[k]:
                acc_l[k] = run("wgrad", k, (views[k][0], fronts.pop((a.mb, k)), acc_l[k]),
                                     watch, held)
            elif a.kind == "B" and (mine[k] or (k > 0 and mine[k - 1])):
                dx = None
                if mine[k]:
                    x_in = stash.pop((a.mb, k))
                    dy = inbox_b.pop((a.mb, k), None)
                    if dy is None:
                        dy = x_in
                    args = (*views[k], x_in, dy, micros[s], np.int32(a.mb))
                    if split:
                        dx, fronts[(a.mb, k)], *new = run(
                            "bin", k, (*args, *acc_r[s]), watch, held)
                    else:
                        dx, acc_l[k], *new = run("bwd", k, (*args, acc_l[k], *acc_r[s]),
                                                       watch, held)
                    acc_r[s] = tuple(new)
                if k > 0:
                    got = self._move(dx, s, sch.stage_of(k - 1), aval)
                    if mine[k - 1]:
                        inbox_b[(a.mb, k - 1)] = got
        reduced = [self._program("reduce", k, ((acc_l[k], *acc_r[sch.stage_of(k)]), views[k]))(
            (acc_l[k], *acc_r[sch.stage_of(k)])) if mine[k] else None for k in range(sch.chunks)]
        return self._gather(params, st, self._per_stage(layers, reduced))

    def _move(self, x, s: int, t: int, aval):
        """``x`` from stage ``s`` to stage ``t``'s submesh (``_hop``); itself when ``s == t``
        (the turn of a V-shaped schedule)."""
        return x if s == t else self._hop(x, s, t, aval)

    def _chunk_view(self, x, k: int):
        """Chunk ``k``'s layers of the whole-mesh stacked leaf ``x`` on the submesh of the stage
        that runs it. One chunk per stage: that stage's own shards (``_view``, no copy). In a V
        (``schedules.placement``) the state's layout still gives stage ``s`` the ``s``-th
        ``L / P`` layers, two chunks that are not the two it runs: the chunk is sliced from the
        stage holding it and copied over (``planning`` prices the moves and the copies)."""
        sch = self.sch
        s = sch.stage_of(k)
        if sch.chunks == sch.stages:
            return self._view(x, s)
        per, block = x.shape[0] // sch.chunks, x.shape[0] // sch.stages
        owner = k * per // block
        held = self._view(x, owner)
        part = held[k * per - owner * block:(k + 1) * per - owner * block]
        return jax.device_put(part, NamedSharding(self.subs[s], held.sharding.spec))

    def _per_stage(self, layers, reduced) -> list:
        """Per stage ``s`` of this process: ``(its share of the layers' gradient in the state's
        layout, its rest's gradient, its loss)`` from the chunks' ``reduced`` ones: the chunks
        its ``L / P`` layers hold, copied to it and joined in order (themselves with one chunk
        per stage); the rest's and the loss from its first chunk (the stage's accumulators)."""
        sch = self.sch
        out = []
        for s in range(sch.stages):
            if not self.mine[s]:
                out.append(None)
                continue
            first = reduced[sch.chunks_on(s)[0]]
            if sch.chunks == sch.stages:
                out.append(first)
                continue
            owned = range(s * sch.virtual, (s + 1) * sch.virtual)   # its layers' chunks
            joined = jax.tree_util.tree_map(
                lambda x, *g, s=s: jax.device_put(jnp.concatenate(
                    [jax.device_put(d, NamedSharding(self.subs[s], d.sharding.spec))
                     for d in g]), self._view(x, s).sharding),
                layers, *[reduced[c][0] for c in owned])
            out.append((joined, *first[1:]))
        return out

    def _hop(self, x, s: int, t: int, aval):
        """Stage ``s``'s activation or cotangent ``x`` (None where this process does not run
        stage ``s``) as an array on stage ``t``'s submesh. Within one process: a
        ``jax.device_put``. Across processes (``jax.distributed``): a collective-permute over
        the two submeshes stacked, which every process with a device in either issues at the
        same point of the schedule; the devices of ``t`` put in zeros of the shard's shape."""
        src, dst = self.subs[s], self.subs[t]
        me = jax.process_index()
        if self.local[s] and self.local[t]:
            return jax.device_put(x, self.act_shardings[t])
        names = tuple(src.axis_names)
        pair = Mesh(np.stack([src.devices, dst.devices]), ("hop", *names))
        spec = P("hop", self.data or None)
        sharding = NamedSharding(pair, spec)
        shape = (2, *aval.shape)
        key = ("hop", s, t, shape, str(aval.dtype))
        if key not in self.programs:
            self.programs[key] = jax.jit(jax.shard_map(
                lambda v: jax.lax.ppermute(v, "hop", [(0, 1)]), mesh=pair, in_specs=spec,
                out_specs=spec, check_vma=False), out_shardings=sharding)
        local = sharding.shard_shape(shape)
        shards = [] if x is None else [sh.data[None] for sh in x.addressable_shards]
        for d in dst.devices.flat:
            if d.process_index == me:
                zkey = (d, local, str(aval.dtype))
                if zkey not in self._zeros:
                    self._zeros[zkey] = jax.device_put(np.zeros(local, aval.dtype), d)
                shards.append(self._zeros[zkey])
        moved = self.programs[key](jax.make_array_from_single_device_arrays(shape, sharding,
                                                                            shards))
        mine = [sh.data[0] for sh in moved.addressable_shards if sh.index[0] == slice(1, 2)]
        if not mine:
            return None
        return jax.make_array_from_single_device_arrays(aval.shape, self._act_sharding(t), mine)

    def _run(self, kind: str, s: int, args, watch, held, built=None):
        """Stage ``s``'s ``kind`` program on ``args``; with ``watch``, on copies of the
        arguments it donates (the caller keeps these), then ``watch`` sees it. ``built``: the
        programs this step has looked up, by ``(kind, s)``, reused without a new key."""
        program = None if built is None else built.get((kind, s))
        if program is None:
            program = self._program(kind, s, args)
            if built is not None:
                built[(kind, s)] = program
        if not watch:
            return program(*args)
        outs = program(*_copied(args, DONATED.get(kind, ())))
        watch(program, args, outs, held)
        return outs

    def _act_sharding(self, s: int):
        return self.act_shardings[s]

    def _gather(self, params, st, reduced):
        """The stages' gradients as one whole-mesh gradient in the state's layout, and the
        loss: layers assembled from their stages' shards (no copy); the rest (embedding at stage
        0, head at the last, zeros between) and the loss stacked over the stage axis and summed
        over it by one program over the whole mesh, which every process runs."""
        model, p = self.model, self.sch.stages
        layers, rest = model.split(params)
        l_st, r_st = model.split(st)
        here = [r for r in reduced if r is not None]
        g_layers = jax.tree_util.tree_map(
            lambda x, sh, *parts: self._whole(parts, sh, x.shape), layers, l_st,
            *[r[0] for r in here])

        def stacked(x, sh, *parts):
            return self._whole(parts, NamedSharding(self.mesh, P(self.axis, *sh.spec)),
                               (p, *x.shape))

        per_stage = jax.tree_util.tree_map(stacked, rest, r_st, *[r[1] for r in here])
        losses = self._whole([r[2] for r in here], NamedSharding(self.mesh, P(self.axis)), (p,))
        key = ("gather", validate.signature(per_stage, jax.tree_util.tree_leaves(per_stage)))
        if key not in self.programs:
            self.programs[key] = jax.jit(
                lambda g, ls: (jax.tree_util.tree_map(lambda x: x.sum(0), g), ls.sum()),
                out_shardings=(r_st, NamedSharding(self.mesh, P())))
        g_rest, loss = self.programs[key](per_stage, losses)
        return loss, model.join(g_layers, g_rest)

    def update(self, state, grads, st, watch=None, batch=None, loss=None):
        """``(new state, loss)``: the user's optimizer over the whole mesh, in the state's
        layouts (the model's ``post``, the rest of the user's own step, where it has one)."""
        post = self.model.post
        key = ("update", validate.signature((state, batch),
                                            jax.tree_util.tree_leaves((state, batch))))
        if key not in self.programs:
            tx = self.model.tx

            def apply(state, grads, batch, loss):
                if post is not None:
                    return post(state, batch, loss, grads)
                import optax

                updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
                return {"params": optax.apply_updates(state["params"], updates),
                        "opt_state": opt_state}, loss

            self.programs[key] = jax.jit(apply, out_shardings=(st, NamedSharding(self.mesh, P())),
                                         donate_argnums=(1,))
        program = self.programs[key]
        if watch:
            new = program(state, jax.tree_util.tree_map(jnp.copy, grads), batch, loss)
            watch(program, (state, grads, batch, loss), new, ())
            return new
        return program(state, grads, batch, loss)


def _named(fn, what: str):
    """``fn`` named so its program's module is ``jit_autopar_mpmd_<what>``, which
    ``autopar.pipeline.measured.measure_mpmd`` finds in a profiler trace."""
    fn.__name__ = fn.__qualname__ = f"autopar_mpmd_{what}"
    return fn


def _held_bytes(tree) -> dict:
    """Bytes of the buffers of ``tree``'s arrays, per device, each buffer once (a stage's views
    share their buffers with the state)."""
    seen, out = set(), {}
    for a in jax.tree_util.tree_leaves(tree):
        if not isinstance(a, jax.Array):
            continue
        for sh in a.addressable_shards:
            key = (sh.device, sh.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[sh.device] = out.get(sh.device, 0) + sh.data.nbytes
    return out


def _copied(args, donated) -> tuple:
    """``args`` with copies at the positions ``donated``, so a call may consume them."""
    return tuple(jax.tree_util.tree_map(jnp.copy, a) if i in donated else a
                 for i, a in enumerate(args))


def _microbatches(batch, m: int, mesh, data: tuple, programs: dict):
    """(B, ...) -> (M, B / M, ...) on the whole mesh, row ``i`` to microbatch ``i % M`` (as the
    lockstep runtime cuts them), rows over the data axes; one program per batch signature, kept
    in ``programs``."""
    key = ("micro", validate.signature(batch, jax.tree_util.tree_leaves(batch)))
    if key not in programs:
        def cut(x):
            if not x.ndim:
                return x
            return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)

        outs = jax.tree_util.tree_map(lambda x: NamedSharding(mesh, P(
            None, data or None) if x.ndim else P()), batch)
        programs[key] = jax.jit(lambda b: jax.tree_util.tree_map(cut, b), out_shardings=outs)
    return programs[key](batch)
