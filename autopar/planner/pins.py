"""Pins: every layout the plan decides, addressed so codegen can enforce it.

A pin is ``Pin(path, slot, index, chain)``: at the equation (or region) ``path`` (see
``ir.graph``'s ``origin``), the value in ``slot`` number ``index`` takes the layouts of ``chain``
in turn, the last one being the plan's:

  ``out``  output ``index`` of the equation: the layout its op produces under the plan;
  ``in``   input ``index`` of the equation: the layout the op needs when it differs from what its
           producer made; ``chain`` is the staged transition (``reshard.reshard_steps``);
  ``arg``  parameter ``index`` of the region at ``path`` (a loop body): the body's input layout;
  ``res``  result ``index`` of the region: a loop-carried value returns in its carry-in layout.

Every op the planner decided gets its ``out`` pins and the ``in`` pins where a transition is
costed, so XLA's sharding propagation has nothing left to choose; inside ``scan`` bodies, remat and
custom-derivative calls too (codegen retraces those bodies with the pins in place).
"""
from __future__ import annotations

from autopar.plan import Pin
from autopar.planner import problem
from autopar.planner.reshard import reshard_steps
from autopar.sharding import Sharding
from ir import Op


class _Pins:
    def __init__(self, prob: problem.Problem, choice):
        self.p, self.choice, self.out = prob, choice, []
        self.chains: dict = {}   # (have, need) -> staged transition: layers repeat the same few

    def layout(self, v: int) -> Sharding | None:
        g = self.p.group_of_value.get(v)
        if g is None:
            return None
        return self.p.groups[g].shard[v][self.choice[g]]

    def add(self, path, slot: str, index: int, have: Sharding | None, need: Sharding) -> None:
        if slot in ("in", "res"):
            if have is None or have == need:
                return
            chain = self.chains.get((have, need))
            if chain is None:
                chain = self.chains[(have, need)] = tuple(
                    s.layout for s in reshard_steps(have, need, self.p.mesh))
        else:
            chain = (need,)
        self.out.append(Pin(tuple(path), slot, index, chain))

    def op(self, op: Op) -> None:
        """``in`` pins where the op needs a layout its operand does not have, ``out`` pins of its
        results (``layout``'s look-ups inlined: this runs once per op of an unrolled model's
        tens of thousands)."""
        p, choice = self.p, self.choice
        g = p.group_of_op.get(op.id)
        if g is None or g < 0:
            return
        per_i = p.groups[g].members.get(op.id)
        if per_i is None:
            return
        st, of_value, groups, origin = per_i[choice[g]], p.group_of_value, p.groups, op.origin
        for k, v in enumerate(op.ins):
            need = st.ins[k] if k < len(st.ins) else None
            h = of_value.get(v) if need is not None else None
            if h is not None and groups[h].shard[v][choice[h]] != need:
                self.add(origin, "in", k, groups[h].shard[v][choice[h]], need)
        for k, v in enumerate(op.outs):
            h = of_value.get(v)
            if h is not None:
                self.out.append(Pin(tuple(origin), "out", k, (groups[h].shard[v][choice[h]],)))

    def scan(self, op: Op) -> None:
        body = op.regions[0]
        nc, ncarry = op.param("num_consts", 0), op.param("num_carry", 0)
        region = tuple(op.origin) + (0,)
        for k, (outer, inner) in enumerate(zip(op.ins, body.inputs)):
            inside = self.layout(inner)
            if inside is None:
                continue
            need = inside if k < nc + ncarry else ((),) + inside
            self.add(op.origin, "in", k, self.layout(outer), need)
            self.add(region, "arg", k, None, inside)
        for k, inner in enumerate(body.outputs):
            if k < ncarry:
                self.add(region, "res", k, self.layout(inner), self.layout(body.inputs[nc + k]))
        for k, v in enumerate(op.outs):
            s = self.layout(v)
            if s is not None:
                self.add(op.origin, "out", k, None, s)
        self.walk(body.ops)

    def walk(self, ops) -> None:
        for op in ops:
            if op.prim == "scan" and op.regions:
                self.scan(op)
            else:   # while / cond are one op that runs replicated (rules.fallback_rule)
                self.op(op)


def pins(prob: problem.Problem, choice) -> tuple[Pin, ...]:
    """Every pin of the plan ``choice`` (group id -> strategy index) of ``prob``."""
    builder = _Pins(prob, choice)
    builder.walk(prob.graph.ops)
    return tuple(builder.out)
