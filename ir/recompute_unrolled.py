"""Recomputing an unrolled model's saved values in its backward pass: the step rewritten.

A step whose layers are unrolled (a Python loop over blocks: Flax NNX's ``nnx.List``,
transformers' Flax models, Equinox lists of layers) is differentiated by jax into one straight
program: every layer's forward equations, then, transposed, every layer's backward equations.
A forward value the backward reads (a *residual*) is live from where the forward made it to
where the backward last reads it; at depth the residuals are most of a step's activation memory.

A *site* here is a family of repeated layers (``ir.layers``: the unrolled layers of the
signature that covers most ops). Under a policy (``ir.recompute.POLICIES``), each layer of the
family keeps some of its residuals and drops the others; a dropped residual is computed again
just before the backward's first read of it, from what the layer keeps (its inputs: the
previous layer's output, the parameters, the mask; under ``"save_dots"`` and
``"save_weight_dots"`` also its matmul outputs; under ``"selective"`` everything but the
attention core). A value another layer's forward reads (the layer's output) is always kept, as
``jax.checkpoint`` keeps a checkpointed function's inputs.

The recomputed equations read their inputs through ``jax.lax.optimization_barrier`` (one per
input), so XLA's common subexpression elimination cannot merge them back into the forward ones;
that is how ``jax.checkpoint`` keeps its recomputation too (``prevent_cse``). Where XLA then
schedules the recomputation is XLA's choice; its schedulers place it near its use, which the
measured memory in the tests and ``benchmarks/recompute.py`` checks.

Forward and backward equations are told apart by jax's name stack: the backward's carry
``transpose(``. A step traced without name stacks has no site.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jcore

from ir import replay
from ir.flops import op_cost
from ir.fold import largest_family
from ir.from_jaxpr import tensor_type

_WEIGHTLESS = ("broadcast_in_dim", "iota")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One unrolled layer of a site: its forward equations (indices into the flat jaxpr) and
    what a policy may drop."""
    fwd: tuple[int, ...]              # forward equation indices, in order
    residuals: tuple                  # jaxpr vars the layer makes that the backward reads
    outputs: frozenset                # vars it makes that a forward equation outside it reads
    core: frozenset                   # its attention-core values (``ir.recompute`` sense)


@dataclasses.dataclass(frozen=True)
class UnrolledSite:
    """A family of repeated unrolled layers, all rewritten under one policy."""
    where: str
    layers: tuple[Layer, ...]
    first: int                        # index of the backward's first equation

    @property
    def length(self) -> int:
        return len(self.layers)


def _backward(eqn) -> bool:
    return "transpose(" in str(getattr(eqn.source_info, "name_stack", ""))


def find_site(closed: jcore.ClosedJaxpr, graph) -> UnrolledSite | None:
    """The site of ``closed`` (a flat jaxpr: every call inlined) whose graph is ``graph``
    (``ir.from_jaxpr.graph_of(closed, ..., dce=False)``), or None: no family of at least two
    unrolled layers whose forward saves a value the backward reads."""
    family = largest_family(graph)
    if len(family) < 2:
        return None
    eqns = closed.jaxpr.eqns
    first = next((i for i, e in enumerate(eqns) if _backward(e)), None)
    if first is None:
        return None
    read_bwd: set = set()
    for e in eqns[first:]:
        read_bwd.update(v for v in e.invars if isinstance(v, jcore.Var))
    out_vars = {v for v in closed.jaxpr.outvars if isinstance(v, jcore.Var)}
    readers: dict = {}                # forward value -> the forward equations that read it
    for i, e in enumerate(eqns[:first]):
        for v in e.invars:
            if isinstance(v, jcore.Var):
                readers.setdefault(v, set()).add(i)
    layers = []
    for lay in family:
        idx = sorted({graph.op(o).origin[0] for o in lay.op_ids if graph.op(o).origin})
        fwd = tuple(i for i in idx if i < first)
        if not fwd:
            continue
        own = set(fwd)
        made = {v: i for i in fwd for v in eqns[i].outvars if not replay.is_drop(v)}
        outside = {v for v in made if readers.get(v, own) - own} | (set(made) & out_vars)
        residuals = tuple(v for v in made if v in read_bwd)
        if not residuals:
            continue
        layers.append(Layer(fwd, residuals, frozenset(outside),
                            frozenset(_core(eqns, fwd))))
    if len(layers) < 2:
        return None
    return UnrolledSite(family[0].name, tuple(layers), first)


def _core(eqns, fwd) -> set:
    """Attention-core values among a layer's forward values: the output of a matmul with batch
    dimensions (attention's per-head matmuls have them; a layer's matmuls with its weights do
    not) with a free dimension of each operand of the same size, e.g. the queries' and the
    keys' sequence in (batch, heads, seq, seq) scores, and what
    equations of as many elements make of it (the softmax's exponentials and probabilities, a
    mask applied, a reshape)."""
    core: set = set()
    for i in fwd:
        e = eqns[i]
        outs = [v for v in e.outvars if not replay.is_drop(v)]
        if not outs:
            continue
        if e.primitive.name == "dot_general" and replay.batched_dot(e) and _quadratic(e):
            core.update(outs)
        elif any(isinstance(v, jcore.Var) and v in core and v.aval.size == outs[0].aval.size
                 for v in e.invars):
            core.update(outs)
    return core


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a policy does to one layer: the residuals dropped, and the forward equations the
    backward replays for them (in order), and the values those read."""
    dropped: tuple
    cone: tuple[int, ...]
    reads: tuple


def layer_plan(eqns, layer: Layer, policy: str) -> Plan:
    """``policy`` applied to ``layer``."""
    made = {v: i for i in layer.fwd for v in eqns[i].outvars if not replay.is_drop(v)}
    keep = set(layer.outputs)
    if policy == "selective":
        keep |= set(layer.residuals) - layer.core
    elif policy in ("save_dots", "save_weight_dots"):
        for i in layer.fwd:
            e = eqns[i]
            if e.primitive.name == "dot_general" and (
                    policy == "save_dots" or not replay.batched_dot(e)):
                keep.update(v for v in e.outvars if not replay.is_drop(v))
    elif policy != "full":
        raise ValueError(f"recompute policy {policy!r} is not one of selective, save_dots, "
                         f"save_weight_dots, full")
    # values of weights alone (a parameter's cast, a broadcast bias) are kept: recomputing them
    # frees nothing the parameters do not already hold
    dropped = tuple(v for v in layer.residuals if v not in keep
                    and eqns[made[v]].primitive.name not in _WEIGHTLESS)
    want, picked, reads = set(dropped), set(), []
    for i in reversed(layer.fwd):
        e = eqns[i]
        if not any(v in want for v in e.outvars if not replay.is_drop(v)):
            continue
        picked.add(i)
        for v in e.invars:
            if not isinstance(v, jcore.Var):
                continue
            if v in made and v not in keep:
                want.add(v)
            elif v not in reads:
                reads.append(v)
    return Plan(dropped, tuple(sorted(picked)), tuple(reads))


def _quadratic(eqn) -> bool:
    """Whether a ``dot_general``'s two operands each have a free dimension of one size > 1."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    free_l = {n for d, n in enumerate(lhs) if d not in lc and d not in lb and n > 1}
    free_r = {n for d, n in enumerate(rhs) if d not in rc and d not in rb and n > 1}
    return bool(free_l & free_r)


def apply(closed: jcore.ClosedJaxpr, site: UnrolledSite, policy: str) -> jcore.ClosedJaxpr:
    """``closed`` with every layer of ``site`` rewritten under ``policy``: the same function
    of the same inputs."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    plans = [layer_plan(eqns, lay, policy) for lay in site.layers]
    owner = {v: k for k, p in enumerate(plans) for v in p.dropped}

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        again: dict = {}                 # dropped var -> its recomputed value
        for i, e in enumerate(eqns):
            if i >= site.first:
                for k in {owner[v] for v in e.invars if isinstance(v, jcore.Var)
                          and v in owner and v not in again}:
                    _replay(eqns, plans[k], env, again)
                invals = [again[v] if isinstance(v, jcore.Var) and v in again
                          else replay.read(env, v) for v in e.invars]
            else:
                invals = [replay.read(env, v) for v in e.invars]
            for v, x in zip(e.outvars, replay.replay(e, invals)):
                if not replay.is_drop(v):
                    env[v] = x
        return [again[v] if v in again else replay.read(env, v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                      weak_type=getattr(a, "weak_type", False))
                                 for a in closed.in_avals])


def _replay(eqns, plan: Plan, env: dict, again: dict) -> None:
    """The layer's dropped values computed again from its kept ones, each read through its own
    optimization barrier (no CSE with the forward's)."""
    local = {v: jax.lax.optimization_barrier(env[v]) for v in plan.reads}
    for i in plan.cone:
        e = eqns[i]
        outs = replay.replay(e, [local[v] if isinstance(v, jcore.Var) and v in local
                                 else replay.read(env, v) for v in e.invars])
        for v, x in zip(e.outvars, outs):
            if not replay.is_drop(v):
                local[v] = x
    for v in plan.dropped:
        again[v] = local[v]


def replayed_flops(closed: jcore.ClosedJaxpr, site: UnrolledSite, policy: str) -> float:
    """Matmul FLOPs the backward replays per step (all devices)."""
    eqns = closed.jaxpr.eqns
    total = 0.0
    for lay in site.layers:
        for i in layer_plan(eqns, lay, policy).cone:
            e = eqns[i]
            if e.primitive.name == "dot_general":
                types = [[tensor_type(v.aval) for v in vs] for vs in (e.invars, e.outvars)]
                total += op_cost("dot_general", *types, e.params).flops
    return total


def dropped_bytes(closed: jcore.ClosedJaxpr, site: UnrolledSite, policy: str) -> int:
    """Global bytes of the residuals ``policy`` drops over the site's layers."""
    eqns = closed.jaxpr.eqns
    return sum(tensor_type(v.aval).nbytes for lay in site.layers
               for v in layer_plan(eqns, lay, policy).dropped)


def kept_bytes(closed: jcore.ClosedJaxpr, site: UnrolledSite, policy: str) -> int:
    """Global bytes of the values the recomputation reads that the backward did not read
    already (the layers' inputs, kept for it)."""
    eqns = closed.jaxpr.eqns
    read = {v for e in eqns[site.first:] for v in e.invars if isinstance(v, jcore.Var)}
    top = set(closed.jaxpr.invars)
    extra = {v for lay in site.layers for v in layer_plan(eqns, lay, policy).reads
             if v not in read and v not in top}
    return sum(tensor_type(v.aval).nbytes for v in extra)
