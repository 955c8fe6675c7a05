"""A plan made on a folded graph (``ir.fold``), mapped back onto the full graph.

The folded plan decides every kept op and input; a removed op runs as the kept copy it stands
for (``Folded.op_of``) and a removed input or result is laid out as its kept twin. Its cost,
collectives and memory are already the full graph's (the folded problem weighs what each kept
op, input and result stands for), so only what names the full graph changes: its fingerprint,
argument and result paths and layouts, and the pins, one set per removed op, copied from its
kept copy's with the removed op's equation path.
"""
from __future__ import annotations

import dataclasses

from autopar.plan import Pin, Plan
from ir.fold import Folded


def unfold(plan: Plan, folded: Folded) -> Plan:
    """``plan`` (of ``folded.graph``) as a plan of ``folded.full``."""
    full = folded.full
    ops = full.analyses.op_index
    by_path: dict[tuple, list[Pin]] = {}
    for pin in plan.pins:
        by_path.setdefault(pin.path, []).append(pin)
    pins = list(plan.pins)
    for removed, kept in folded.op_of.items():
        path = tuple(ops[removed].origin)
        pins += [Pin(path, p.slot, p.index, p.chain)
                 for p in by_path.get(tuple(ops[kept].origin), ())]
    return dataclasses.replace(
        plan, graph_fingerprint=full.fingerprint(), input_paths=full.input_paths,
        output_paths=full.output_paths, input_shapes=tuple(full.values[v].shape
                                                           for v in full.inputs),
        input_shardings=tuple(plan.input_shardings[j] for j in folded.input_of),
        output_shardings=tuple(plan.output_shardings[i] for i in folded.output_of),
        pins=tuple(pins), in_tree=full.in_tree, out_tree=full.out_tree,
        solver=dataclasses.replace(plan.solver, folded=folded.removed))
