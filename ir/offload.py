"""Host offload of a step's carried state: which arguments may live in host memory between steps,
and the rewrite that streams them through the device one group at a time.

ZeRO-Offload keeps Adam's moments in host memory; so can a JAX step, with its arguments and
results in ``memory_kind="pinned_host"`` and ``jax.device_put`` between memory spaces inside it.
What may move is read off the traced step (``flat(closed, inline=is_call)``, every jit call
inlined):

  * a **candidate** is a floating argument the step returns updated (its result is computed
    from it: the planner's output pairs), every one of whose readers, transitively, is
    update arithmetic: no loop, call, matmul or convolution reads it. Adam's moments are
    candidates; parameters, which the forward pass reads, are not;
  * candidates whose update equations meet (one equation reads values of both) form one
    ``Group`` and move together (``clip_by_global_norm`` of the updates would join them all).

``apply(closed, groups)`` returns the step with every equation that reads no offloaded argument
first, in the traced order, then each group in turn: its arguments moved to the device
(``device_put`` to ``Space.Device``), its update equations, its updated state moved back to the
host (``device_put`` to ``Space.Host``), which the step returns. Only one group's state is on the
device at a time in that order, which is the order the memory model walks. XLA's schedulers do
not keep it by themselves (XLA:CPU's moves an argument's copy to the top of the step), so codegen
makes each group's move wait for the previous group's results, or, for the first group, for the
values its equations read from the rest of the step (``holds``, applied with
``jax.lax.optimization_barrier``).

Partial, on purpose for now: parameters (ZeRO-Infinity) and saved activations are not offloaded;
the update runs on the device (XLA's host compute is not used), so every group pays a round trip
over the host link, priced without overlap with compute.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from ir import replay
from ir.fusion import FUSIBLE

# readers that make an argument part of the step's computation rather than of its update
_BLOCKING = frozenset({"dot_general", "conv_general_dilated", "ragged_dot"})
HOST, DEVICE = "Host", "Device"     # ``MemorySpace`` names, as ``ir.params`` keeps them
HOST_MEMORY = "pinned_host"         # the memory kind offloaded arguments and results have


@dataclasses.dataclass(frozen=True)
class Group:
    """Arguments that move to the host together, with the equations that update them."""

    inputs: tuple[int, ...]      # flat argument positions
    outputs: tuple[int, ...]     # flat result positions of their updated values
    eqns: tuple[int, ...]        # top-level equations (of the inlined step) that read them
    nbytes: int                  # their bytes, whole (one copy of each argument)


def _space():
    return jax.memory.Space


def _is_float(aval) -> bool:
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.floating)   # PRNG keys are not numpy types


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _blocking(eqn) -> bool:
    return (eqn.primitive.name in _BLOCKING
            or any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) or
                   (isinstance(v, (tuple, list)) and v and
                    isinstance(v[0], (jcore.Jaxpr, jcore.ClosedJaxpr)))
                   for v in eqn.params.values()))


def _depends(jaxpr, sources: Mapping) -> tuple[list[frozenset], set]:
    """Per equation, the candidates (``sources``: invar -> candidate) it depends on; and the
    candidates a blocking equation depends on."""
    dep: dict = {v: frozenset((k,)) for v, k in sources.items()}
    per_eqn, blocked = [], set()
    empty = frozenset()
    for eqn in jaxpr.eqns:
        ds = empty
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                ds = ds | dep.get(v, empty)
        per_eqn.append(ds)
        if ds:
            if _blocking(eqn):
                blocked |= ds
            for v in eqn.outvars:
                dep[v] = ds
    return per_eqn, blocked


def find_groups(closed: jcore.ClosedJaxpr, pairs: Mapping[int, int]) -> tuple[Group, ...]:
    """The groups of candidates of ``closed`` (inlined: ``flat(closed, inline=is_call)``);
    ``pairs``: result position -> the argument position it replaces."""
    jaxpr = closed.jaxpr
    invars, outvars = jaxpr.invars, jaxpr.outvars
    produced = {v for e in jaxpr.eqns for v in e.outvars}
    result_of = {}
    for j, k in pairs.items():
        if (k < len(invars) and _is_float(invars[k].aval)
                and outvars[j] in produced and k not in result_of):
            result_of[k] = j
    cands = {invars[k]: k for k in result_of}
    _, blocked = _depends(jaxpr, cands)
    cands = {v: k for v, k in cands.items() if k not in blocked}
    per_eqn, _ = _depends(jaxpr, cands)
    parent = {k: k for k in cands.values()}

    def root(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for ds in per_eqn:
        first, *rest = sorted(ds) or [None]
        for k in rest:
            parent[root(k)] = root(first)
    # a result computed from another candidate's values moves with it (not this one's own)
    out_dep = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            out_dep[v] = per_eqn[i]
    members: dict[int, list[int]] = {}
    for k in sorted(cands.values()):
        if k in out_dep.get(outvars[result_of[k]], ()):
            members.setdefault(root(k), []).append(k)
    groups = []
    for ks in members.values():
        r = {root(k) for k in ks}
        eqns = tuple(i for i, ds in enumerate(per_eqn) if ds and root(next(iter(ds))) in r)
        groups.append(Group(tuple(ks), tuple(result_of[k] for k in ks), eqns,
                            sum(_nbytes(invars[k].aval) for k in ks)))
    # a group holding an argument whose update cone meets an unchosen candidate's is still
    # whole: the union above joined every candidate an equation reads
    return tuple(sorted(groups, key=lambda g: g.eqns[0] if g.eqns else 0))


def apply(closed: jcore.ClosedJaxpr, groups: Sequence[Group]) -> jcore.ClosedJaxpr:
    """``closed`` (inlined, as ``find_groups`` read it) with ``groups``' arguments in host
    memory, streamed through the device in turn (see the module docstring)."""
    jaxpr = closed.jaxpr
    moved = {i for g in groups for i in g.eqns}
    rest = [e for i, e in enumerate(jaxpr.eqns) if i not in moved]
    space = _space()

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in rest:
            _eval(env, eqn)
        host = {}
        for g in groups:
            for k in g.inputs:
                env[jaxpr.invars[k]] = jax.device_put(args[k], space.Device)
            for i in g.eqns:
                _eval(env, jaxpr.eqns[i])
            for j in g.outputs:
                host[j] = jax.device_put(replay.read(env, jaxpr.outvars[j]), space.Host)
        return [host[j] if j in host else replay.read(env, v)
                for j, v in enumerate(jaxpr.outvars)]

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in closed.in_avals]
    return jax.make_jaxpr(run)(*specs)


def _eval(env, eqn) -> None:
    outs = replay.replay(eqn, [replay.read(env, v) for v in eqn.invars])
    for v, x in zip(eqn.outvars, outs):
        if not isinstance(v, jcore.DropVar):
            env[v] = x


def _moves(eqn, space: str) -> bool:
    return (eqn.primitive.name == "device_put"
            and tuple(getattr(d, "name", d) for d in eqn.params.get("devices", ())) == (space,))


def holds(closed: jcore.ClosedJaxpr) -> dict[int, tuple]:
    """Equation index of each move of an offloaded argument to the device in ``apply``'s step
    -> the variables it must wait for: the previous group's results moved to the host, or, for
    the first group, what its equations read from the rest of the step."""
    jaxpr = closed.jaxpr
    invars = set(jaxpr.invars)
    eqns = jaxpr.eqns
    starts: list[list[int]] = []
    for i, e in enumerate(eqns):
        if _moves(e, DEVICE) and e.invars and e.invars[0] in invars:
            if starts and starts[-1][-1] == i - 1:
                starts[-1].append(i)
            else:
                starts.append([i])
    out: dict[int, tuple] = {}
    for n, run in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(eqns)
        if n:
            prev = range(starts[n - 1][0], run[0])
            deps = tuple(v for i in prev if _moves(eqns[i], HOST) for v in eqns[i].outvars)
        else:
            before = {v for e in eqns[:run[0]] for v in e.outvars}
            seen: dict = {}
            for e in eqns[run[-1] + 1:end]:
                for v in e.invars:
                    if not isinstance(v, jcore.Literal) and v in before:
                        seen.setdefault(v)
            deps = tuple(seen)
        for i in run:
            out[i] = deps
    return out


def host_values(graph, inputs: Sequence[int]) -> frozenset[int]:
    """Value ids of ``graph`` (traced from ``apply``'s step) held in host memory: the offloaded
    arguments (flat positions ``inputs``) and what the step moves to the host."""
    vals = {graph.inputs[k] for k in inputs}
    for op in graph.ops:
        if op.prim == "device_put" and tuple(op.param("devices", ())) == (HOST,):
            vals.update(op.outs)
    return frozenset(vals)


def updates_when_ready(graph):
    """``graph`` (traced from ``apply``'s step, its host values marked) with its top-level ops
    reordered so that each offloaded group's update runs where its operands are ready, as
    XLA:CPU runs it, rather than after the rest of the step, as ``apply`` writes it.

    Measured on XLA:CPU (an unrolled GPT, 1x8 and 2x4): its host memory is its device memory,
    so a group's moves are no copies and its update reads the host arguments in place; the
    ``optimization_barrier`` that ``holds`` puts on each move is removed before XLA:CPU
    schedules the step (no ordering of it survives in the compiled HLO), and the scheduler runs
    each instruction once its operands exist. Each group's update (its moments' and its
    parameter's) then runs right after its parameter's gradient is made, inside the backward
    pass, and writes its results there. The moved ops: those that read an offloaded argument,
    transitively, and the elementwise and layout ops (``ir.fusion.FUSIBLE``) whose results only
    they read (the optimizer's scaling of a gradient, its step count and bias corrections, a
    gradient's reshape), each placed after the last of its operands' producers; a loop or
    branch op is not moved, nor a contraction or reduction, which keeps the backward pass in
    its traced order. Every other op keeps its place; the op ids, origins and the jaxpr are
    ``graph``'s (the order is topological again). ``graph`` itself when it holds nothing in
    host memory."""
    if not graph.host:
        return graph
    ops = graph.ops
    host_in = graph.host & set(graph.inputs)
    moved = [False] * len(ops)
    reads_host = set(host_in)
    for t, op in enumerate(ops):
        if not op.regions and any(v in reads_host for v in op.ins):
            moved[t] = True
            reads_host.update(op.outs)
    readers: dict[int, list[int]] = {}
    for t, op in enumerate(ops):
        for v in op.ins:
            readers.setdefault(v, []).append(t)
    for t in range(len(ops) - 1, -1, -1):   # ops that only the moved ones read
        op = ops[t]
        if moved[t] or op.prim not in FUSIBLE or not op.outs:
            continue
        rs = [r for v in op.outs for r in readers.get(v, ())]
        if rs and all(moved[r] for r in rs):
            moved[t] = True
    made = {v: t for t, op in enumerate(ops) for v in op.outs}
    waiting: dict[int, list[int]] = {}
    missing = [0] * len(ops)
    for t, op in enumerate(ops):
        if moved[t]:
            deps = {v for v in op.ins if v in made}
            missing[t] = len(deps)
            for v in deps:
                waiting.setdefault(v, []).append(t)
    order: list[int] = []
    ready = sorted(t for t in range(len(ops)) if moved[t] and not missing[t])

    def emit(t: int) -> None:
        order.append(t)
        for v in ops[t].outs:
            for w in waiting.get(v, ()):
                missing[w] -= 1
                if not missing[w]:
                    bisect.insort(ready, w)

    def drain() -> None:
        while ready:
            emit(ready.pop(0))

    drain()
    for t in range(len(ops)):
        if not moved[t]:
            emit(t)
            drain()
    assert len(order) == len(ops), "a moved op waits for a value no op makes"
    return dataclasses.replace(graph, ops=tuple(ops[t] for t in order))
