"""Recomputing a scanned model's saved values in its backward loop: the step rewritten.

A training step whose layers run in a ``lax.scan`` (``nn.scan``, ``eqx.filter_vmap``-stacked
layers under ``lax.scan``, a hand-written loop) is differentiated by jax into two loops: the
forward loop, which also returns, stacked over the layers, every value the backward pass will
read (its *residuals*: matmul outputs, softmax probabilities, norm statistics, activations),
and the backward loop, which reads them one layer at a time. Those stacked residuals are live
from the end of the forward loop to the backward loop's use of them: at depth they are most of a
step's activation memory.

A *site* is such a pair of loops. Recomputing a residual means the forward loop no longer
returns it: the backward loop computes it again, layer by layer, from the layer's input (the
forward loop's carry at that layer, then stacked instead) and the layer's own inputs (its slice
of the stacked parameters, the loop's constants), which is what ``jax.checkpoint`` around the
layer does, applied after differentiation to the step as traced. Values the forward loop still
returns are read, not recomputed, when the recomputation passes through them (a saved matmul
output stops the recomputation of what follows it), as a ``jax.checkpoint`` policy does.

Policies, in increasing recomputation (``POLICIES``):

* ``"none"``: the step as traced;
* ``"selective"``: only the attention core is recomputed (the saved values quadratic in a
  dimension of the layer's input: scores, probabilities, their masks), from the saved
  queries and keys; everything else stays saved (Megatron-LM's selective recomputation);
* ``"save_dots"``: matmul outputs (``dot_general``) stay saved; everything else (norm
  statistics and outputs, softmax, activations, elementwise results) is recomputed, like
  ``jax.checkpoint_policies.dots_saveable`` and close to Megatron-LM's selective recomputation
  (which also recomputes the attention scores' matmul);
* ``"save_weight_dots"``: only the outputs of matmuls without batch dimensions (a layer's
  matmuls with its weights) stay saved; the attention's batched matmuls, its softmax and
  everything elementwise are recomputed, like
  ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` (MaxText's and many users'
  choice for Megatron-LM-style selective recomputation: nothing quadratic in the sequence is
  kept);
* ``"full"``: only each layer's input stays saved (``nothing_saveable``: full recomputation).

Residuals that are a loop input already (a parameter slice the forward loop passes through)
are read from that input instead under every policy but ``"none"``: the copy was free memory.

XLA cannot merge the recomputation back into the forward loop: the two are different loops.
Loops whose body has side effects are left alone. The unrolled (not scanned) case is not
rewritten: recomputed equations there would sit beside the originals, which XLA's common
subexpression elimination merges (jax uses optimization barriers for that; not done here).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.extend import core as jcore

from ir import recompute_unrolled, replay
from ir.flops import op_cost
from ir.fold import largest_family
from ir.from_jaxpr import graph_of, tensor_type

POLICIES = ("none", "selective", "save_dots", "save_weight_dots", "full")
# What a saved value is: the layer's input (never recomputed: recomputation starts from it), a
# loop input passed through (free to read again), the attention core (quadratic in a dimension
# of the layer's input, e.g. (batch, heads, seq, seq) scores), a matmul output, the rest.
CLASSES = ("layer_input", "input", "attention", "matmul", "other")
_CALLS = ("jit", "pjit", "closed_call", "core_call")


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value the forward loop saves for the backward loop (stacked over its iterations)."""
    index: int           # position among the forward loop's stacked outputs (after the carry)
    cls: str             # one of CLASSES
    primitive: str       # what computes it in the loop body ("" for a loop input)
    nbytes: int          # global bytes of the stacked value
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Site:
    """A forward loop and the backward loop that reads its residuals (top-level equations)."""
    fwd: int             # equation index of the forward scan
    bwd: int             # equation index of the backward scan
    length: int
    where: str           # the forward loop's name stack and source line
    residuals: tuple[Residual, ...]

    def recomputed(self, policy: str) -> tuple[Residual, ...]:
        """The saved values ``policy`` drops (recomputes) at this site."""
        if policy == "none":
            return ()
        if policy == "selective":
            return tuple(r for r in self.residuals if r.cls in ("attention", "input"))
        return self.residuals


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _where(eqn) -> str:
    """The loop's name stack and the file (base name) and line that made it."""
    stack = str(getattr(eqn.source_info, "name_stack", ""))
    try:
        from jax._src import source_info_util as siu
        frame = siu.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001 - private module: the name is a courtesy
        frame = None
    if frame is None:
        return stack
    return f"{stack} ({frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line})"


def _call_body(eqn):
    """The (closed or open) jaxpr a jit-like call equation runs, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    return eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")


def _open(sub):
    return getattr(sub, "jaxpr", sub)


def _holds_scan(eqn) -> bool:
    """Whether ``eqn`` is a call whose body (at any depth of calls) runs a loop."""
    sub = _call_body(eqn)
    return sub is not None and any(e.primitive.name == "scan" or _holds_scan(e)
                                   for e in _open(sub).eqns)


def flat(closed: jcore.ClosedJaxpr, inline=None) -> jcore.ClosedJaxpr:
    """``closed`` with the jit calls that hold loops inlined (a ``jax.jit``-decorated step keeps
    its loops one call down), so a site's two loops are top-level equations; ``inline``: which
    call equations to inline instead (``ir.offload`` inlines every call)."""
    inline = inline or _holds_scan
    if not any(inline(e) for e in closed.jaxpr.eqns):
        return closed

    def run(*args):
        return _eval_inlined(closed.jaxpr, closed.consts, args, inline)

    return jax.make_jaxpr(run)(*_specs(closed))


def is_call(eqn) -> bool:
    """Whether ``eqn`` is a jit-like call (``flat(closed, inline=is_call)`` inlines them all)."""
    return _call_body(eqn) is not None


def _eval_inlined(jaxpr, consts, args, inline):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [replay.read(env, v) for v in eqn.invars]
        if inline(eqn):
            sub = _call_body(eqn)
            outs = _eval_inlined(_open(sub), getattr(sub, "consts", ()), invals, inline)
        else:
            outs = replay.replay(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            if not replay.is_drop(v):
                env[v] = x
    return [replay.read(env, v) for v in jaxpr.outvars]


def _specs(closed):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
            for a in closed.in_avals]


def find_sites(closed: jcore.ClosedJaxpr) -> tuple[Site, ...]:
    """The forward/backward loop pairs of ``closed`` (top level; see ``flat``) with at least one
    residual only the backward loop reads."""
    return _sites(closed.jaxpr)


def has_sites(closed: jcore.ClosedJaxpr) -> bool:
    """Whether ``closed`` has a loop pair to rewrite, at its top level or inside one jit call
    (a ``jax.jit``-decorated step), without ``flat``'s retrace: cheap enough for every plan.
    A pair whose two loops sit in different calls is not seen here."""
    def any_in(jaxpr) -> bool:
        return bool(_sites(jaxpr)) or any(any_in(_open(_call_body(e))) for e in jaxpr.eqns
                                          if _holds_scan(e))
    return any_in(closed.jaxpr)


def _sites(jaxpr) -> tuple[Site, ...]:
    uses: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for k, v in enumerate(eqn.invars):
            if isinstance(v, jcore.Var):
                uses.setdefault(v, []).append((i, k))
    outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    sites, taken = [], set()
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan" or eqn.params["jaxpr"].jaxpr.effects:
            continue
        p = eqn.params
        body = p["jaxpr"].jaxpr
        nk = p["num_carry"]
        core = _attention_core(body, p["num_consts"], nk)
        by_bwd: dict[int, list[Residual]] = {}
        for j, v in enumerate(eqn.outvars[nk:]):
            if replay.is_drop(v) or v in outs or v not in uses:
                continue
            where = {u for u, _ in uses[v]}
            if len(where) != 1:
                continue
            b = next(iter(where))
            beqn = jaxpr.eqns[b]
            if (b in taken or beqn.primitive.name != "scan" or beqn.params["length"] != p["length"]
                    or beqn.params["jaxpr"].jaxpr.effects):
                continue
            first_x = beqn.params["num_consts"] + beqn.params["num_carry"]
            if any(k < first_x for _, k in uses[v]):
                continue
            cls, prim = _class_of(body, nk + j, p["num_consts"], nk)
            if cls in ("matmul", "other") and body.outvars[nk + j] in core:
                cls = "attention"
            if cls is None:
                continue
            by_bwd.setdefault(b, []).append(
                Residual(j, cls, prim, _nbytes(v.aval), tuple(v.aval.shape)))
        if not by_bwd:
            continue
        # a loop that saves only its layer input is recomputed already (the user's remat)
        by_bwd = {k: rs for k, rs in by_bwd.items() if any(r.cls != "layer_input" for r in rs)}
        if not by_bwd:
            continue
        b = max(by_bwd, key=lambda k: sum(r.nbytes for r in by_bwd[k]))
        taken.add(b)
        sites.append(Site(i, b, p["length"], _where(eqn), tuple(by_bwd[b])))
    return tuple(sites)


def _attention_core(body, nc: int, nk: int) -> set:
    """The body's attention-core values: the output of a matmul of two activations (both
    computed from the layer's input, not a weight) whose last two dimensions are equal, e.g.
    (batch, heads, seq, seq) scores, and what elementwise ops (same shape) make of it: the
    softmax's exponentials and probabilities, a mask or dropout applied to them."""
    act = set(body.invars[nc:nc + nk])
    core: set = set()
    for eqn in body.eqns:
        ins = [v for v in eqn.invars if isinstance(v, jcore.Var)]
        outs = [v for v in eqn.outvars if not replay.is_drop(v)]
        if any(v in act for v in ins):
            act.update(outs)
        if not outs:
            continue
        shape = tuple(outs[0].aval.shape)
        if (eqn.primitive.name == "dot_general" and len(ins) == 2
                and all(v in act for v in ins) and len(shape) >= 2 and shape[-1] == shape[-2]):
            core.update(outs)
        elif any(v in core and tuple(v.aval.shape) == shape for v in ins):
            core.update(outs)
    return core


def _class_of(body, out: int, nc: int, nk: int) -> tuple[str | None, str]:
    v = body.outvars[out]
    if isinstance(v, jcore.Literal):
        return None, ""
    if v in body.invars:
        k = body.invars.index(v)
        return ("layer_input" if nc <= k < nc + nk else "input"), ""
    for eqn in body.eqns:
        if v in eqn.outvars:
            name = eqn.primitive.name
            return ("matmul" if name == "dot_general" else "other"), name
    return None, ""


def apply(closed: jcore.ClosedJaxpr, decisions: Mapping[int, str]) -> jcore.ClosedJaxpr:
    """``closed`` (already ``flat``) with site ``k`` of ``find_sites(closed)`` rewritten under
    policy ``decisions[k]``; the same function of the same inputs."""
    sites = find_sites(closed)
    chosen = {}
    for k, policy in decisions.items():
        if policy not in POLICIES:
            raise ValueError(f"recompute policy {policy!r} is not one of {POLICIES}")
        if not 0 <= k < len(sites):
            raise ValueError(f"recompute site {k} does not exist: the step has {len(sites)}")
        if policy != "none":
            chosen[k] = policy
    if not chosen:
        return closed
    fwd = {sites[k].fwd: (sites[k], pol) for k, pol in chosen.items()}
    bwd = {sites[k].bwd: (sites[k], pol) for k, pol in chosen.items()}
    jaxpr = closed.jaxpr

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        handed: dict[int, _Handoff] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            # a recomputed residual has no value: only its backward loop reads it, as None
            invals = [env.get(v) if isinstance(v, jcore.Var) else v.val for v in eqn.invars]
            if i in fwd:
                site, pol = fwd[i]
                outs, handed[site.bwd] = _forward(eqn, invals, site, pol, jaxpr.eqns[site.bwd])
            elif i in bwd:
                outs = _backward(eqn, invals, handed.pop(i))
            else:
                outs = replay.replay(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                if x is not None and not replay.is_drop(v):
                    env[v] = x
        return [replay.read(env, v) for v in jaxpr.outvars]

    return jax.make_jaxpr(run)(*_specs(closed))


@dataclasses.dataclass
class _Handoff:
    """What the rewritten forward loop hands its backward loop."""
    fwd: object                       # the forward scan equation
    cone: tuple                       # forward-body equations to replay, in order
    consts: list                      # the forward loop's constants (outer values)
    seeds: list                       # (forward-body var, stacked outer value) the replay reads


def saved_vars(body, policy: str) -> set:
    """The forward-body values a policy keeps (stacked) for the recomputation to start from,
    beyond the layer's inputs: ``"save_dots"`` the matmul outputs, ``"save_weight_dots"``
    those of matmuls without batch dimensions, ``"full"`` none."""
    if policy in ("save_dots", "save_weight_dots"):
        return {v for e in body.eqns if e.primitive.name == "dot_general"
                and (policy == "save_dots" or not replay.batched_dot(e))
                for v in e.outvars if not replay.is_drop(v)}
    return set()


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a policy does at a site: the residuals dropped, the values stacked instead, and
    the forward-body equations the backward loop replays."""
    again: frozenset                  # residual indices (among the forward ys) recomputed
    kept: tuple[int, ...]             # residual indices still returned
    given: dict                       # forward-body var -> ys index, kept and read by ``bwd``
    cone: tuple                       # forward-body equations replayed, in order
    reached: frozenset                # inputs and saved values the replay reads
    stacked: tuple                    # forward-body vars newly stacked (layer inputs first)
    dropped_bytes: int                # global bytes of the residuals no longer stacked
    stacked_bytes: int                # global bytes of the values stacked instead
    replayed_flops: float             # rough: 2 x the replayed matmuls' MACs, per step


def choose(fwd, bwd, site: Site, policy: str) -> Choice:
    """``policy`` at ``site`` (``fwd``/``bwd``: its two scan equations)."""
    p = fwd.params
    bj = p["jaxpr"].jaxpr
    nc, nk = p["num_consts"], p["num_carry"]
    n_ys = len(bj.outvars) - nk
    again = frozenset(r.index for r in site.recomputed(policy))
    kept = tuple(j for j in range(n_ys) if j not in again)
    targets = {bj.outvars[nk + j] for j in again}
    # recomputation stops at the policy's saved values and at residuals ``bwd`` still reads
    read = set(bwd.invars[bwd.params["num_consts"] + bwd.params["num_carry"]:])
    given = {bj.outvars[nk + j]: j for j in kept
             if isinstance(bj.outvars[nk + j], jcore.Var) and fwd.outvars[nk + j] in read}
    stop = (saved_vars(bj, policy) | set(given)) - set(bj.invars)
    cone, reached = _cone(bj, targets, stop)
    stacked = [v for v in bj.invars[nc:nc + nk] if v in reached]          # layer inputs
    made_at = {v: k for k, e in enumerate(bj.eqns) for v in e.outvars}
    stacked += sorted((v for v in reached if v in stop and v not in given),
                      key=made_at.__getitem__)                             # saved values
    length = p["length"]
    return Choice(again, kept, given, tuple(cone), frozenset(reached), tuple(stacked),
                  sum(r.nbytes for r in site.recomputed(policy)),
                  sum(_nbytes(v.aval) * length for v in stacked),
                  float(sum(_dot_flops(e) for e in cone) * length))


def _dot_flops(eqn) -> float:
    """A matmul's FLOPs by ``ir.flops``' rule (XLA's count); 0 for any other equation."""
    if eqn.primitive.name != "dot_general":
        return 0.0
    types = [[tensor_type(v.aval) for v in vs] for vs in (eqn.invars, eqn.outvars)]
    return op_cost("dot_general", *types, eqn.params).flops


def _forward(eqn, invals, site: Site, policy: str, bwd):
    p = eqn.params
    body = p["jaxpr"]
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    bj = body.jaxpr
    n_ys = len(bj.outvars) - nk
    c = choose(eqn, bwd, site, policy)
    kept, given, reached, stacked = c.kept, c.given, c.reached, c.stacked

    def step(carry, x):
        env = _eval(bj, body.consts, [*consts, *carry, *x], keep=True)
        outs = [replay.read(env, v) for v in bj.outvars]
        return outs[:nk], [outs[nk + j] for j in kept] + [env[v] for v in stacked]

    new_carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p.get("unroll", 1))
    outs: list = list(new_carry) + [None] * n_ys
    for j, y in zip(kept, ys):
        outs[nk + j] = y
    seeds = list(zip(stacked, ys[len(kept):]))
    seeds += [(v, x) for v, x in zip(bj.invars[nc + nk:], xs) if v in reached]   # param slices
    # given residuals: read from the backward loop's own inputs (the same stacked arrays)
    for v, j in given.items():
        if v in reached:
            seeds.append((v, outs[nk + j]))
    fconsts = [(v, x) for v, x in zip(bj.invars[:nc], consts) if v in reached]
    return outs, _Handoff(eqn, c.cone, fconsts, seeds)


def _cone(body, targets: set, stop: set) -> tuple[list, set]:
    """The body equations that compute ``targets`` from the body's inputs, stopping at ``stop``
    (values saved), and the inputs and saved values they read."""
    want = set(targets)
    reached = {v for v in targets if v in stop or v in body.invars}
    picked = []
    for eqn in reversed(body.eqns):
        if not any(v in want and v not in stop for v in eqn.outvars):
            continue
        picked.append(eqn)
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                if v in stop or v in body.invars or v in body.constvars:
                    reached.add(v)
                if v not in stop:
                    want.add(v)
    return list(reversed(picked)), reached


def _eval(jaxpr, consts, args, env=None, eqns=None, keep=False):
    env = dict(env or {})
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in (jaxpr.eqns if eqns is None else eqns):
        outs = replay.replay(eqn, [replay.read(env, v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs):
            if not replay.is_drop(v):
                env[v] = x
    if keep or eqns is not None:
        return env
    return [replay.read(env, v) for v in jaxpr.outvars]


def _backward(eqn, invals, h: _Handoff):
    p = eqn.params
    body = p["jaxpr"]
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    fbody = h.fwd.params["jaxpr"]
    fj = fbody.jaxpr
    fnk = h.fwd.params["num_carry"]
    ys_of = {v: j for j, v in enumerate(h.fwd.outvars[fnk:])}
    # each of the backward loop's xs: a value it is given, or a recomputed residual's body var
    slots = []
    for k, v in enumerate(eqn.invars[nc + nk:]):
        j = ys_of.get(v) if isinstance(v, jcore.Var) else None
        body_var = fj.outvars[fnk + j] if j is not None else None
        slots.append(("again", body_var) if xs[k] is None else ("given", k))
    given = [xs[k] for kind, k in slots if kind == "given"]
    seed_vars = [v for v, _ in h.seeds]
    consts_env = dict(h.consts)

    def step(carry, x):
        got, more = x
        env = dict(consts_env)
        env.update(zip(seed_vars, more))
        env = _eval(fj, fbody.consts, [], env=env, eqns=h.cone)
        it = iter(got)
        full = [next(it) if kind == "given" else replay.read(env, k) for kind, k in slots]
        outs = _eval(body.jaxpr, body.consts, [*consts, *carry, *full])
        return outs[:nk], outs[nk:]

    new_carry, ys = jax.lax.scan(step, list(init), (given, [x for _, x in h.seeds]),
                                 length=p["length"], reverse=p["reverse"],
                                 unroll=p.get("unroll", 1))
    return list(new_carry) + list(ys)


def rewrite_graph(graph, decisions: Mapping[int, str]):
    """``graph`` traced again from its jaxpr rewritten under ``decisions`` (``apply``; a step
    without loop pairs: its unrolled layers, ``ir.recompute_unrolled``, as site 0)."""
    closed = flat(graph.jaxpr)
    if find_sites(closed):
        return graph_of(apply(closed, decisions), graph)
    found = unrolled_site(graph)
    if found is None or set(decisions) - {0}:
        raise ValueError(f"recompute sites {sorted(decisions)} do not exist: the step has "
                         f"{0 if found is None else 1}")
    closed, site = found
    policy = decisions.get(0, "none")
    if policy == "none":
        return graph
    return graph_of(recompute_unrolled.apply(closed, site, policy), graph)


def sites_of(graph) -> tuple:
    """``find_sites`` of ``graph``'s step (its jit calls holding loops inlined); a step without
    loop pairs: its one ``ir.recompute_unrolled.UnrolledSite``, or none."""
    sites = find_sites(flat(graph.jaxpr))
    if sites:
        return sites
    found = unrolled_site(graph)
    return () if found is None else (found[1],)


def has_unrolled_layers(graph) -> bool:
    """Whether ``graph`` has a family of at least two repeated unrolled layers (cheap: read off
    ``graph.layers``); ``unrolled_site`` says whether their forward saves anything."""
    return len(largest_family(graph)) >= 2


def unrolled_site(graph, inlined=None):
    """``(flat jaxpr, ir.recompute_unrolled.UnrolledSite)`` of ``graph``'s unrolled layers (every
    call inlined), or None; ``inlined``: that flat jaxpr, where the caller has it."""
    if not has_unrolled_layers(graph):
        return None
    closed = inlined if inlined is not None else flat(graph.jaxpr, inline=is_call)
    site = recompute_unrolled.find_site(closed, graph_of(closed, graph, dce=False))
    return None if site is None else (closed, site)


def describe(closed: jcore.ClosedJaxpr, site: Site, policy: str) -> str:
    """One line: what ``policy`` recomputes at ``site`` of ``closed`` (``flat``) and the bytes
    it moves."""
    eqns = closed.jaxpr.eqns
    c = choose(eqns[site.fwd], eqns[site.bwd], site, policy)
    what = {"selective": "from the saved queries and keys, all else kept",
            "save_dots": "from the layer input and the matmul outputs, kept",
            "save_weight_dots": "from the layer input and the weight matmuls' outputs, kept",
            "full": "from the layer input alone"}.get(policy, "")
    return (f"{policy} at the {site.length}-iteration loop {site.where}: {len(c.again)} saved "
            f"values ({c.dropped_bytes / 2**20:.1f} MiB over all devices) recomputed {what} "
            f"({c.stacked_bytes / 2**20:.1f} MiB), {len(c.cone)} equations replayed per "
            f"iteration, about {c.replayed_flops / 1e9:.3g} GFLOP of matmuls per step")
