"""Human-readable views of an ``ir.Graph``: a listing, a summary, and a networkx export.

A listing line reads ``%12 = dot_general(%3, %7) f32[8,64] flops=8.2K @ model.py:31``; region
bodies are indented under their op. Long listings are cut after ``limit`` lines with a note.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ir.graph import Graph, Op

_SHORT_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                 "int32": "i32", "int64": "i64", "int8": "i8", "uint32": "u32", "uint8": "u8",
                 "bool": "bool"}


def human(x: float) -> str:
    """``1234567`` -> ``"1.23M"``."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def type_str(graph: Graph, vid: int) -> str:
    t = graph.values[vid]
    return f"{_SHORT_DTYPES.get(t.dtype, t.dtype)}[{','.join(map(str, t.shape))}]"


def op_line(graph: Graph, op: Op, indent: int = 0, literals: dict[int, Any] | None = None) -> str:
    """One op as ``%out = prim(%in, ...) type flops=... @ source``."""
    lits = literals if literals is not None else dict(graph.literals)
    outs = ", ".join(f"%{v}" for v in op.outs)
    ins = ", ".join(repr(lits[v]) if v in lits else f"%{v}" for v in op.ins)
    types = " ".join(type_str(graph, v) for v in op.outs[:3]) + (" ..." if len(op.outs) > 3 else "")
    extra = f" x{op.trip_count}" if op.trip_count != 1 else ""
    extra += " [fallback]" if op.param("fallback") else ""
    where = f" @ {op.source}" if op.source else ""
    return (f"{'  ' * indent}{outs} = {op.prim}({ins}) {types} flops={human(op.flops)}"
            f"{extra}{where}  #{op.id}")


def _lines(graph: Graph, ops: Iterable[Op], indent: int, lits: dict[int, Any]) -> Iterable[str]:
    for op in ops:
        yield op_line(graph, op, indent, lits)
        for k, region in enumerate(op.regions):
            ins = ", ".join(f"%{v}" for v in region.inputs)
            yield f"{'  ' * (indent + 1)}region {k} ({ins}):"
            yield from _lines(graph, region.ops, indent + 2, lits)
            outs = ", ".join(f"%{v}" for v in region.outputs)
            yield f"{'  ' * (indent + 2)}return {outs}"


def listing(graph: Graph, limit: int = 200) -> str:
    """The graph as text, one op per line, cut after ``limit`` lines."""
    ins = ", ".join(f"%{v}: {type_str(graph, v)}" for v in graph.inputs[:8])
    more = f", ... ({len(graph.inputs)} inputs)" if len(graph.inputs) > 8 else ""
    out = [f"graph({ins}{more}):"]
    lits = dict(graph.literals)
    for n, line in enumerate(_lines(graph, graph.ops, 1, lits)):
        if n >= limit:
            out.append(f"  ... cut after {limit} lines ({len(graph.all_ops())} ops in all; "
                       f"use ir.printer.listing(graph, limit=...) for more)")
            break
        out.append(line)
    else:
        out.append(f"  return {', '.join(f'%{v}' for v in graph.outputs[:16])}"
                   + (" ..." if len(graph.outputs) > 16 else ""))
    return "\n".join(out)


def window(graph: Graph, op_id: int, radius: int = 10) -> str:
    """The ``radius`` ops either side of ``op_id`` in pre-order, the op marked ``>>``."""
    ops = graph.all_ops()
    pos = next((i for i, op in enumerate(ops) if op.id == op_id), 0)
    lits = dict(graph.literals)
    lines = []
    for op in ops[max(pos - radius, 0): pos + radius + 1]:
        mark = ">> " if op.id == op_id else "   "
        lines.append(mark + op_line(graph, op, 0, lits))
    return "\n".join(lines)


def _donated_bytes(graph: Graph) -> int:
    return sum(graph.values[v].nbytes for v, d in zip(graph.inputs, graph.donated) if d)


def summary(graph: Graph) -> str:
    """Op counts by primitive, FLOPs, input bytes, layers."""
    ops = graph.all_ops()
    counts = Counter(op.prim for op in ops)
    fallback = sorted({op.prim for op in ops if op.param("fallback")})
    lines = [
        f"ir.Graph: {len(graph.ops)} top-level ops ({len(ops)} counting region bodies), "
        f"{len(graph.values)} values, {len(graph.inputs)} inputs, {len(graph.outputs)} outputs",
        f"  total flops: {human(graph.total_flops)}  transcendentals: "
        f"{human(sum(op.transcendentals for op in graph.ops))}",
        f"  input bytes: {human(graph.input_bytes)}B  "
        f"(donated {human(_donated_bytes(graph))}B)",
        "  ops: " + ", ".join(f"{p} {n}" for p, n in counts.most_common()),
    ]
    if fallback:
        lines.append(f"  fallback (no cost rule): {', '.join(fallback)}")
    lines += _layer_lines(graph)
    return "\n".join(lines)


def _layer_lines(graph: Graph) -> list[str]:
    if not graph.layers:
        return ["  layers: none found"]
    by_sig = Counter(layer.signature for layer in graph.layers)
    lines = [f"  layers: {len(graph.layers)} ({len(by_sig)} distinct signatures)"]
    for layer in graph.layers[:12]:
        lines.append(f"    [{layer.index}] {layer.name}: {layer.kind} x{layer.repeats}, "
                     f"{len(layer.op_ids)} ops, sig {layer.signature[:8]} "
                     f"(shared by {by_sig[layer.signature]})")
    if len(graph.layers) > 12:
        lines.append(f"    ... {len(graph.layers) - 12} more")
    return lines


def to_networkx(graph: Graph) -> Any:
    """``nx.DiGraph`` of top-level op ids; an edge per consumed value (``value``, ``shape``,
    ``dtype``, ``bytes``). Nodes carry ``prim``, ``flops``, ``name``. Graph inputs, consts and
    literals are not nodes."""
    import networkx as nx

    g = nx.DiGraph()
    producer: dict[int, int] = {}
    for op in graph.ops:
        g.add_node(op.id, prim=op.prim, flops=op.flops, name=op.name)
        for v in op.ins:
            if v in producer:
                t = graph.values[v]
                g.add_edge(producer[v], op.id, value=v, shape=t.shape, dtype=t.dtype,
                           bytes=t.nbytes)
        for v in op.outs:
            producer[v] = op.id
    return g
