"""Kernel substitution: codegen runs a plan's fused kernels in place of the ops they replace.

``KernelTable(graph, plan, mesh)`` finds each ``plan.kernels`` entry's matches again
(``ir.patterns``; the plan was made for this graph, so they are the same) and tells the replay
in ``autopar.codegen`` what to do at each equation path:

  * a replaced equation is not evaluated. The values it reads that the kernel needs are
    recorded (by graph value id) as the replay passes them; the values it makes that the rest
    of the step reads are the kernel's outputs: the first one needed fires the kernel's half
    (forward or backward, in ``shard_map`` with the plan's per-shard specs,
    ``autopar.kernels.halves``), and each is constrained to the plan's layout (its ``out`` pin);
  * every other value a replaced equation makes is dead (``DEAD``): only other replaced
    equations, or equations the graph's dead-code elimination dropped, read it;
  * ``jit`` calls that hold replaced equations are entered, so each equation is seen alone.

The forward half returns the residuals its backward reads (attention's log-sum-exp, a norm's
row statistics, the cross-entropy's log-sum-exp), handed over here. The planner offers only
sites where this is sound (``planner.kernel_sites``).

Before/after, for an attention forward and backward::

    s = dot_general q k ; ... ; o = transpose(dot_general p v)      o, lse = attention_fwd(q, k, v)
    ... (the 20 ops of its backward) ... dq dk dv                   dq, dk, dv = attention_bwd(
                                                                        q, k, v, o, lse, do)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from autopar.errors import PlanError
from autopar.kernels import AdamWHyper, Masks
from autopar.kernels import halves as kh
from autopar.kernels.sharded import adamw_sharded
from autopar.planner.kernel_rules import RULES
from ir.graph import Graph, Op
from ir.patterns import Match, find_patterns
from ir.rules_attention import mask_order

DEAD = type("Dead", (), {"__repr__": lambda self: "DEAD"})()


def _axes(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class _Site:
    kernel: str
    fwd: Match
    bwd: Match | None
    split: dict


class KernelTable:
    """What the replay does at each path (see the module docstring); ``start()`` gives the
    per-trace state."""

    def __init__(self, graph: Graph, plan, mesh):
        self.graph, self.mesh = graph, mesh
        self.sites = _sites(graph, plan)
        self.replaced: dict[tuple[int, ...], Op] = {}
        self.wanted: set[int] = set()
        self.made_by: dict[int, tuple[int, str]] = {}     # value -> (site, half)
        for n, s in enumerate(self.sites):
            rule = RULES[s.kernel]
            for m, reads, writes, half in ((s.fwd, rule.reads, rule.writes_fwd, "fwd"),
                                           (s.bwd, rule.cotangents, rule.writes_bwd, "bwd")):
                if m is None:
                    continue
                self.wanted.update(v for r, v in m.inputs if r in reads)
                self.made_by.update((v, (n, half)) for r, v in m.outputs if r in writes)
                for i in m.op_ids:
                    op = graph.op(i)
                    self.replaced[tuple(op.origin)] = op
        self.producers = self._producers(graph)
        self.prefixes = {p[:k] for p in list(self.replaced) + list(self.producers)
                         for k in range(1, len(p))}

    def _producers(self, graph: Graph) -> dict[tuple[int, ...], Op]:
        """Top-level equations that make a value some kernel reads (recorded as they run)."""
        out = {}
        top = {op.id for op in graph.ops}
        for op in graph.all_ops():
            if op.id in top and not op.scope and self.wanted.intersection(op.outs) and \
                    tuple(op.origin) not in self.replaced:
                out[tuple(op.origin)] = op
        return out

    def start(self, pins) -> _Run:
        """The state of one trace; ``pins`` (``codegen.PinTable``) constrains the outputs."""
        return _Run(self, pins)


class Pending:
    """A kernel output not computed yet: the half runs when something else reads it."""

    def __init__(self, site: int, half: str, value: int, here: tuple[int, ...], index: int):
        self.site, self.half, self.value, self.here, self.index = site, half, value, here, index


class _Run:
    """One trace of the step: recorded inputs, fired halves, their outputs and residuals."""

    def __init__(self, table: KernelTable, pins):
        self.t, self.pins = table, pins
        self.by_id: dict[int, object] = {}
        self.results: dict[int, object] = {}
        self.residuals: dict[int, tuple] = {}
        self.fired: set[tuple[int, str]] = set()

    def inputs(self, flat, consts) -> None:
        """Records the step's arguments and top-level constants that some kernel reads."""
        g = self.t.graph
        ids = tuple(g.inputs) + tuple(g.consts[:len(consts)])
        for v, x in zip(ids, tuple(flat) + tuple(consts)):
            if v in self.t.wanted:
                self.by_id[v] = x

    def after(self, here: tuple[int, ...], outs) -> None:
        """Records what the equation at ``here`` made, if a kernel reads it."""
        op = self.t.producers.get(here)
        if op is not None:
            for v, x in zip(op.outs, outs):
                if v in self.t.wanted:
                    self.by_id.setdefault(v, x)

    def visit(self, here: tuple[int, ...], eqn, env: dict, read: Callable) -> bool:
        """Handles equation ``eqn`` at ``here`` when it is replaced or dead (True), else readies
        its operands (kernel outputs it reads are computed now) and leaves it to the replay."""
        op = self.t.replaced.get(here)
        if op is not None:
            self._replace(op, here, eqn, env, read)
            return True
        if here in self.t.prefixes:       # an entered jit call: its equations decide
            return False
        vals = [read(env, v) for v in eqn.invars]
        if any(x is DEAD for x in vals):
            for v in eqn.outvars:
                env[v] = DEAD
            return True
        for var, x in zip(eqn.invars, vals):
            if isinstance(x, Pending):
                env[var] = self.resolve(x)
        return False

    def _replace(self, op: Op, here, eqn, env: dict, read: Callable) -> None:
        for k, var in enumerate(eqn.invars):
            if op.ins[k] in self.t.wanted and (x := read(env, var)) is not DEAD:
                self.by_id.setdefault(op.ins[k], x)
        for k, var in enumerate(eqn.outvars):
            made = self.t.made_by.get(op.outs[k])
            env[var] = DEAD if made is None else Pending(*made, op.outs[k], here, k)

    def results_of(self, outs) -> list:
        """The step's results with every kernel output computed."""
        outs = [self.resolve(o) for o in outs]
        if any(o is DEAD for o in outs):
            raise PlanError("kernel substitution left a result of the step uncomputed (a value "
                            "only replaced ops make); plan again with kernels='never' and "
                            "report this")
        return outs

    def resolve(self, x):
        """The value of a kernel output (its half run if needed), in the plan's layout."""
        if not isinstance(x, Pending):
            return x
        self.fire(x.site, x.half)
        return self.pins.constrain(self.results[x.value], x.here, "out", x.index)

    def fire(self, n: int, half: str) -> None:
        """Runs site ``n``'s forward or backward half (the forward first, if it has not run)."""
        if (n, half) in self.fired:
            return
        self.fired.add((n, half))
        site = self.t.sites[n]
        if half == "bwd":
            self.fire(n, "fwd")
            outs, m = BACKWARD[site.kernel](self, site, self.residuals[n]), site.bwd
        else:
            (outs, self.residuals[n]), m = FORWARD[site.kernel](self, site), site.fwd
        for role, v in m.outputs:
            if role in outs:
                t = self.t.graph.values[v]
                self.results[v] = jnp.reshape(outs[role], t.shape).astype(t.dtype)

    def get(self, m: Match, role: str, default=None):
        """The value of ``m``'s input ``role`` (``default`` when the match has none)."""
        if role not in m.roles():
            return default
        v = m.input(role)
        if v not in self.by_id:
            raise PlanError(f"kernel substitution: the {m.pattern} at {m.sources[:1]} runs "
                            f"before its input {role} (%{v}) is computed; plan again with "
                            f"kernels='never' and report this")
        self.by_id[v] = self.resolve(self.by_id[v])
        return self.by_id[v]


def _sites(graph: Graph, plan) -> list[_Site]:
    """The plan's kernels, each with its forward and backward match in ``graph``."""
    if not plan.kernels:
        return []
    matches = find_patterns(graph)
    by_ops = {m.op_ids: i for i, m in enumerate(matches)}
    backward = {m.forward: m for m in matches if m.forward is not None}
    out = []
    for use in plan.kernels:
        i = by_ops.get(tuple(use.op_ids))
        bwd = backward.get(i) if i is not None else None
        if i is None or (bwd.op_ids if bwd is not None else ()) != tuple(use.bwd_op_ids):
            raise PlanError(f"the plan's {use.kernel} kernel at {use.sources[:1]} replaces ops "
                            f"{list(use.op_ids[:4])}... that do not form one {use.kernel} "
                            f"pattern of this step; was the plan made for another program? "
                            f"Plan again")
        out.append(_Site(use.kernel, matches[i], bwd, dict(use.split)))
    return out


# ---- each kernel's halves ---------------------------------------------------------------------
def _attn_axes(site: _Site) -> dict:
    return {r: _axes(site.split[r]) for r in ("batch", "seq", "heads")}


def _attention_fwd(run: _Run, site: _Site):
    m = site.fwd
    q, k, v = (run.get(m, r) for r in ("q", "k", "v"))
    q4 = jnp.reshape(q, q.shape[:2] + (-1, q.shape[-1]))        # (B, S, K, G, D) -> (B, S, H, D)
    masks = _attention_masks(run, m)
    out, lse = kh.attention_fwd_sharded(q4, k, v, mesh=run.t.mesh, causal=bool(m.attr("causal")),
                                        scale=m.attr("scale"), masks=masks, **_attn_axes(site))
    return {"out": out}, (q4, k, v, out, lse, masks)


def _attention_masks(run: _Run, m: Match) -> Masks:
    """The match's masks read as data, in the scores' (B, H, Sq, Sk) order (``ir.rules_attention``
    says how its attrs describe them)."""
    def scores_order(role: str):
        x = run.get(m, role)
        if x is None:
            return None
        x = jnp.transpose(x, mask_order(m.attr(f"{role}_dims")))    # (B, H[, G], Sq, Sk)
        if x.ndim == 5:        # grouped queries' heads: (H, G) -> H * G, or 1 if broadcast
            heads = x.shape[1] * x.shape[2]
            if heads > 1:
                q = run.get(m, "q")
                x = jnp.broadcast_to(x, x.shape[:1] + q.shape[2:4] + x.shape[3:])
            x = jnp.reshape(x, (x.shape[0], -1) + x.shape[3:])
        return x

    bias, keep = scores_order("bias"), scores_order("keep")
    if bias is not None:
        bias = bias.astype(jnp.float32) * m.attr("bias_scale", 1.0)
    if keep is not None:
        keep = keep if m.attr("keep_true", True) else jnp.logical_not(keep)
    return Masks(bias, keep, float(m.attr("fill", 0.0)))


def _attention_bwd(run: _Run, site: _Site, res):
    q4, k, v, out, lse, masks = res
    dout = jnp.reshape(run.get(site.bwd, "dout"), out.shape)
    dq, dk, dv = kh.attention_bwd_sharded(q4, k, v, out, lse, dout, mesh=run.t.mesh,
                                          causal=bool(site.fwd.attr("causal")),
                                          scale=site.fwd.attr("scale"), masks=masks,
                                          **_attn_axes(site))
    return {"dq": dq, "dk": dk, "dv": dv}


def _rows(site: _Site, n: int) -> tuple:
    return tuple(_axes(site.split[f"rows{i}"]) for i in range(n))


def _norm_fwd(run: _Run, site: _Site):
    m = site.fwd
    x, scale = run.get(m, "x"), run.get(m, "scale") + m.attr("scale_offset", 0.0)
    bias, residual = run.get(m, "bias"), run.get(m, "residual")
    rows = _rows(site, x.ndim - 1)
    y, h, mean, rstd = kh.norm_fwd_sharded(m.attr("kind"), x, scale, bias, residual,
                                           mesh=run.t.mesh, rows=rows, eps=m.attr("eps"))
    return {"y": y, "h": h}, (h, scale, mean, rstd, rows, bias is not None)


def _norm_bwd(run: _Run, site: _Site, res):
    h, scale, mean, rstd, rows, has_bias = res
    dy, dh = run.get(site.bwd, "dy"), run.get(site.bwd, "dh")
    dx, dscale, dbias = kh.norm_bwd_sharded(site.fwd.attr("kind"), h, scale, mean, rstd, dy, dh,
                                            mesh=run.t.mesh, rows=rows, bias=has_bias,
                                            eps=site.fwd.attr("eps"))
    return {"dx": dx, "dscale": dscale, "dbias": dbias}


def _xent_fwd(run: _Run, site: _Site):
    m = site.fwd
    h, w, t = (run.get(m, r) for r in ("h", "w", "targets"))
    split = {"rows": _rows(site, t.ndim), "vocab": _axes(site.split["vocab"])}
    loss, lse = kh.xent_fwd_sharded(h, w, t, mesh=run.t.mesh, **split)
    sign = m.attr("loss_sign", 1.0)     # -1: the match's output is the picked log-probability
    return {"loss": sign * loss}, (h, w, t, lse, split, sign)


def _xent_bwd(run: _Run, site: _Site, res):
    h, w, t, lse, split, sign = res
    dloss = sign * jnp.reshape(run.get(site.bwd, "dloss"), t.shape)
    dh, dw = kh.xent_bwd_sharded(h, w, t, lse, dloss, mesh=run.t.mesh, **split)
    return {"dh": dh, "dw": dw}


def _adamw(run: _Run, site: _Site):
    m = site.fwd
    p, g, mu, nu, bc1, bc2 = (run.get(m, r) for r in ("param", "grad", "mu", "nu", "bc1", "bc2"))
    # optax multiplies the update by -lr: a traced learning rate arrives negated.
    lr = -run.get(m, "lr") if "lr" in m.roles() else m.attr("lr")
    hyper = AdamWHyper(*(float(m.attr(a)) for a in ("b1", "b2", "eps", "eps_root",
                                                    "weight_decay")))
    spec = P(*(_axes(site.split[f"dim{i}"]) for i in range(p.ndim)))
    p2, mu2, nu2 = adamw_sharded(p, g, mu, nu, mesh=run.t.mesh, spec=spec, lr=lr, bc1=bc1,
                                 bc2=bc2, hyper=hyper)
    return {"param": p2, "mu": mu2, "nu": nu2}, ()


FORWARD = {"attention": _attention_fwd, "norm": _norm_fwd, "xent": _xent_fwd, "adamw": _adamw}
BACKWARD = {"attention": _attention_bwd, "norm": _norm_bwd, "xent": _xent_bwd}
