"""Find repeated blocks ("layers") in a graph, so the planner can solve one and reuse the answer.

What it finds:
  * a top-level ``scan`` op is one layer: ``kind="scan"``, ``repeats`` = trip count, ``op_ids``
    the scan op followed by its body ops (pre-order). flax ``nn.scan`` gives one such layer for
    the forward scan and one for the backward (transpose) scan.
  * unrolled blocks: top-level ops are grouped by the first module-path segment of their name
    stack that ends in an index (``layer_3``, ``Dense_1``, ``block_12``), transforms such as
    ``jvp(...)``/``transpose(...)`` stripped, so a block's forward, rematerialised and backward
    ops form one group. Each group's op sequence is hashed (prims, shapes, params, and which
    earlier op of the group feeds each input); groups with equal hashes get equal
    ``signature`` and, being equal sequences, list op ids in corresponding order.

What it misses: blocks without an indexed module name (hand-written jnp loops, auto-named
modules that do not repeat), blocks whose ops differ only in an edge layer (e.g. the first layer
skipping an input gradient: it gets its own signature), nested repetition below the first
indexed segment, and optimizer ops (their name stack carries no module path).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Sequence

from ir.graph import Graph, Layer, Op, Region

_TRANSFORM = re.compile(r"^[\w.-]+\((.*)\)$")
_INDEXED = re.compile(r"^(.+)_(\d+)$")
# Name-stack segments that transforms insert, not modules (remat re-enters the module path).
_NOT_MODULES = frozenset({"rematted_computation", "checkpoint", "remat", "jit", "pjit", ""})


def find_layers(graph: Graph) -> Graph:
    """Returns ``graph`` with ``layers`` filled and each member op's ``layer`` set."""
    layers: list[Layer] = []
    for op in graph.ops:
        if op.prim == "scan":
            layers.append(_scan_layer(graph, len(layers), op))
    for key, ops in _indexed_groups(graph.ops):
        layers.append(Layer(len(layers), key, tuple(o.id for o in ops), _signature(graph, ops)))
    return _assign(graph, tuple(layers))


def _scan_layer(graph: Graph, index: int, op: Op) -> Layer:
    body = tuple(_walk(op.regions[0].ops))
    return Layer(index, f"{op.name or 'scan'}#{op.id}", (op.id,) + tuple(o.id for o in body),
                 _signature(graph, (op,) + body), kind="scan", repeats=op.trip_count)


def _walk(ops: Iterable[Op]) -> Iterable[Op]:
    for op in ops:
        yield op
        for region in op.regions:
            yield from _walk(region.ops)


def block_key(name: str) -> tuple[str, int] | None:
    """``"transpose(jvp(GPT))/layer_3/mlp"`` -> ``("GPT/layer", 3)``; ``None`` if no index.

    Transform wrappers and remat segments are dropped and a repeated module name collapses, so
    ``"transpose(jvp(GPT))/jvp(GPT)/rematted_computation/layer_3"`` gives the same key.
    """
    path: list[str] = []
    for seg in name.split("/"):
        while (m := _TRANSFORM.match(seg)) is not None:
            seg = m.group(1)
        m = _INDEXED.match(seg)
        if m is not None:
            return "/".join(path + [m.group(1)]), int(m.group(2))
        if seg not in _NOT_MODULES and (not path or path[-1] != seg):
            path.append(seg)
    return None


def _indexed_groups(ops: Sequence[Op]) -> list[tuple[str, list[Op]]]:
    """Groups ops by indexed block; keeps only block families with at least two members."""
    keys: dict[str, tuple[str, int] | None] = {}
    groups: dict[str, dict[int, list[Op]]] = {}
    for op in ops:
        if op.name not in keys:
            keys[op.name] = block_key(op.name)
        key = keys[op.name]
        if key is not None:
            groups.setdefault(key[0], {}).setdefault(key[1], []).append(op)
    return [(f"{base}_{i}", members[i]) for base, members in groups.items() if len(members) > 1
            for i in sorted(members)]


def _signature(graph: Graph, ops: Sequence[Op]) -> str:
    """Hash of the op sequence: prims, params, trip counts, shapes and internal wiring."""
    local: dict[int, str] = {}
    h = hashlib.sha1()
    for j, op in enumerate(ops):
        wiring = tuple(local.get(v, "x") for v in op.ins)
        types = tuple(str(graph.values[v]) for v in op.ins + op.outs)
        body = tuple(o.prim for r in op.regions for o in r.ops)
        h.update(repr((op.prim, op.params, op.trip_count, wiring, types, body)).encode())
        for k, v in enumerate(op.outs):
            local[v] = f"{j}.{k}"
    return h.hexdigest()[:16]


def _assign(graph: Graph, layers: tuple[Layer, ...]) -> Graph:
    """Sets ``Op.layer`` (nested ops too) by rebuilding only the ops that change."""
    owner = {op_id: layer.index for layer in layers for op_id in layer.op_ids}
    if not owner:
        return dataclasses.replace(graph, layers=layers)
    return dataclasses.replace(graph, ops=_relabel(graph.ops, owner), layers=layers)


def _relabel(ops: tuple[Op, ...], owner: dict[int, int]) -> tuple[Op, ...]:
    out = []
    for op in ops:
        regions = tuple(_relabel_region(r, owner) for r in op.regions)
        layer = owner.get(op.id, op.layer)
        if layer != op.layer or any(a is not b for a, b in zip(regions, op.regions)):
            op = dataclasses.replace(op, layer=layer, regions=regions)
        out.append(op)
    return tuple(out)


def _relabel_region(region: Region, owner: dict[int, int]) -> Region:
    ops = _relabel(region.ops, owner)
    same = all(a is b for a, b in zip(ops, region.ops))
    return region if same else dataclasses.replace(region, ops=ops)
