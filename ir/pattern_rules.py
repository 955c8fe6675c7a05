"""The pattern registry of ``ir.patterns``: the forward recogniser of each anchor primitive and
the role naming of each backward match. See ``ir.patterns`` for what the roles mean."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ir.dataflow import LAYOUT, OUTPUT_LAYOUT, strip, sum_of
from ir.graph import Op
from ir.patterns import Index, Match, backward_inputs, backward_outputs
from ir.rules_attention import find_attention
from ir.rules_norm import find_norm
from ir.rules_xent_adamw import find_adamw, find_xent


def _marking_recompute(rule: Callable[[Index, Op], Match | None]):
    """Adds ``recompute=True`` to matches whose ops a ``jax.checkpoint`` (remat) re-runs in
    the backward pass."""
    def apply(index: Index, op: Op) -> Match | None:
        m = rule(index, op)
        if m is None or not all("remat2" in index.ops[index.order[i]].scope for i in m.op_ids):
            return m
        return dataclasses.replace(m, attrs=m.attrs + (("recompute", True),))
    return apply


def _first_of(*rules: Callable[[Index, Op], Match | None]):
    """The first match of ``rules`` at one anchor (``sqrt`` is Adam's and transformers'
    RMSNorm's)."""
    def apply(index: Index, op: Op) -> Match | None:
        return next((m for rule in rules if (m := rule(index, op)) is not None), None)
    return apply


FORWARD_RULES: dict[str, Callable[[Index, Op], Match | None]] = {
    prim: _marking_recompute(rule) for prim, rule in
    (("exp", find_attention), ("rsqrt", find_norm), ("log", find_xent),
     ("sqrt", _first_of(find_adamw, find_norm)))}


# ---- backward roles ---------------------------------------------------------------------------
def _grad_dot_operand(index: Index, v: int, ops: set[int]) -> list[int]:
    """The operands of the matmul that produces ``v`` (through layout ops and the sum that
    undoes a head repeat), inside ``ops``."""
    while (p := index.producer.get(v)) is not None and p.id in ops:
        if p.prim == "dot_general":
            return [index.origin(i) for i in p.ins]
        if p.prim not in OUTPUT_LAYOUT | LAYOUT | {"reduce_sum"}:
            return []
        v = p.ins[0]
    return []


def _attention_roles(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    inputs = [("dout" if r == "cotangent" else r, v)
              for r, v in backward_inputs(index, fwd, ops, touched)]
    q = index.origin(fwd.input("q"))
    k = {index.origin(fwd.input("k")), index.origin(fwd.attr("k_dot", fwd.input("k")))}

    def name(v: int) -> str:
        operands = _grad_dot_operand(index, v, ops)
        return "dq" if k.intersection(operands) else "dk" if q in operands else \
            "dv" if operands else "other"

    return inputs, backward_outputs(index, ops, name)


def _norm_roles(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    inputs = []
    for r, v in backward_inputs(index, fwd, ops, touched):
        if r == "cotangent":
            accumulates = any(c.prim == "add_any" and c.id in ops
                              for c in index.consumers.get(v, ()))
            r = "dh" if accumulates else "dy"
        inputs.append((r, v))
    cotangents = {v for r, v in inputs if r in ("dy", "dh")}
    x_shape = index.shape(fwd.output("y"))

    def name(v: int) -> str:
        if index.shape(v) == x_shape:
            return "dx"
        s = sum_of(index, v, index.producer[v])
        return "dbias" if s is not None and strip(index, s.ins[0], s) in cotangents else "dscale"

    return inputs, backward_outputs(index, ops, name)


def _xent_roles(index: Index, fwd: Match, ops: set[int], touched: set[int]):
    inputs = [("dloss" if r == "cotangent" else r, v)
              for r, v in backward_inputs(index, fwd, ops, touched)]
    h_shape, w_shape = index.shape(fwd.input("h")), index.shape(fwd.input("w"))

    def name(v: int) -> str:
        shape = index.shape(v)
        return "dh" if shape == h_shape else "dw" if sorted(shape) == sorted(w_shape) else "other"

    return inputs, backward_outputs(index, ops, name)


BACKWARD_ROLES = {"attention_bwd": _attention_roles, "norm_bwd": _norm_roles,
                  "xent_bwd": _xent_roles}
