"""Structural checks of an ``ir.Graph``; ``verify`` raises ``IRError`` with a windowed listing.

Checked: op ids unique; value ids in range; every op input defined before use (graph inputs,
consts, literals, earlier outputs, enclosing region inputs); every value defined once; region
outputs defined inside the region or its scope; graph outputs defined; ``inputs``,
``input_paths`` and ``donated`` of equal length; layers name existing ops.
"""
from __future__ import annotations

from ir.errors import IRError
from ir.graph import Graph, Op, Region
from ir.printer import window


def verify(graph: Graph) -> Graph:
    """Returns ``graph`` unchanged if it is well formed, else raises ``IRError``."""
    _check_boundary(graph)
    defined = set(graph.inputs) | set(graph.consts) | {v for v, _ in graph.literals}
    if len(defined) != len(graph.inputs) + len(graph.consts) + len(graph.literals):
        raise IRError("graph inputs, consts and literals share a value id; each must be "
                      "defined once. Fix the tracer that built this graph.")
    _check_ops(graph, graph.ops, defined, set())
    missing = [v for v in graph.outputs if v not in defined]
    if missing:
        raise IRError(f"graph outputs {missing[:5]} are never defined; every output must be a "
                      f"graph input, a literal or an op result.")
    _check_layers(graph)
    return graph


def _check_boundary(graph: Graph) -> None:
    n = len(graph.inputs)
    if len(graph.input_paths) != n or len(graph.donated) != n:
        raise IRError(f"{n} inputs but {len(graph.input_paths)} input_paths and "
                      f"{len(graph.donated)} donated flags; give one of each per input.")


def _check_ops(graph: Graph, ops: tuple[Op, ...], defined: set[int], seen_ops: set[int]) -> None:
    """Walks ops in order; ``defined`` grows as results appear (shared with nested scopes)."""
    for op in ops:
        if op.id in seen_ops:
            _fail(graph, op, f"op id {op.id} is used twice; op ids must be unique")
        seen_ops.add(op.id)
        for v in op.ins:
            if v not in defined:
                _fail(graph, op, f"input %{v} is used before it is defined (not a graph input, "
                                 f"literal, const or earlier result): ops must be in "
                                 f"topological order")
        for region in op.regions:
            _check_region(graph, op, region, defined, seen_ops)
        for v in op.outs:
            if v in defined or not 0 <= v < len(graph.values):
                _fail(graph, op, f"output %{v} is defined twice or has no entry in "
                                 f"graph.values; each value id must be defined exactly once")
            defined.add(v)


def _check_region(graph: Graph, op: Op, region: Region, defined: set[int],
                  seen_ops: set[int]) -> None:
    for v in region.inputs:
        if v in defined:
            _fail(graph, op, f"region input %{v} is already defined outside the region; a "
                             f"region's inputs must be fresh values")
        defined.add(v)
    _check_ops(graph, region.ops, defined, seen_ops)
    bad = [v for v in region.outputs if v not in defined]
    if bad:
        _fail(graph, op, f"region outputs {bad[:5]} are not defined in the region or around it")


def _check_layers(graph: Graph) -> None:
    known = {op.id for op in graph.all_ops()}
    for layer in graph.layers:
        unknown = [i for i in layer.op_ids if i not in known]
        if unknown:
            raise IRError(f"layer {layer.index} ({layer.name}) lists unknown op ids "
                          f"{unknown[:5]}; rebuild the layers with ir.layers.find_layers.")


def _fail(graph: Graph, op: Op, why: str) -> None:
    raise IRError(f"op #{op.id} ({op.prim}, {op.source or 'unknown source'}): {why}.\n"
                  f"{window(graph, op.id, radius=10)}")
