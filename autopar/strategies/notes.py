"""What a hand-written strategy could not place, and why: the lines ``plan.summary()`` shows and
``autopar.plan`` warns with, so a strategy never plans something else silently under its name.

    megatron: 2 parameters x ['vit']['embeddings']['patch_embeddings']['projection']['kernel']
      (8, 8, 3, 64): conv kernel (convolution kernel), not split over 'model': tensor
      parallelism splits only recognised kernels, embeddings and heads
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from autopar.sharding import Sharding
from ir import Graph

_TP_ROLES = {"attn_in": "heads", "attn_out": "heads", "mlp_in": "mlp", "mlp_out": "mlp",
             "head": "vocab", "embedding": "vocab"}
_KERNELS = ("conv", "unknown")


def placement_notes(strategy, graph: Graph, mesh: Mapping[str, int],
                    layouts: Mapping[int, Sharding]) -> tuple[str, ...]:
    from autopar.strategies import annotate

    info = annotate(graph)
    axes = strategy.axes(mesh)
    found: dict[str, list[str]] = {}
    for k, a in enumerate(info):
        if a.kind != "param":
            continue
        shape = graph.values[graph.inputs[k]].shape
        for why in _param_notes(strategy, axes, mesh, a, shape, layouts[k]):
            key = f"{_pattern(graph.input_paths[k])} {shape}: {why}"
            found.setdefault(key, []).append(graph.input_paths[k])
    lines = [f"{strategy.name}: {_count(paths)}{key}" for key, paths in found.items()]
    lines += _missing(strategy, info, axes)
    lines += _unsplit_batches(strategy, graph, mesh, info, layouts, axes["data"])
    return tuple(lines)


def _unsplit_batches(strategy, graph: Graph, mesh, info, layouts, data) -> list[str]:
    """Batch inputs the data axis does not split (their batch dim is not divisible by it): every
    device then computes the whole batch, which is not data parallelism."""
    if data is None or mesh.get(data, 1) == 1:
        return []
    out = []
    for k, a in enumerate(info):
        dims = [i for i, n in enumerate(a.names) if n == "batch"]
        if a.kind != "batch" or not dims or any(data in dim for dim in layouts[k]):
            continue
        shape, i = graph.values[graph.inputs[k]].shape, dims[0]
        out.append(f"{strategy.name}: batch input {graph.input_paths[k]} {shape}: dim {i} "
                   f"(batch, size {shape[i]}) is not divisible by {data!r} (size {mesh[data]}), "
                   f"so it stays whole and every device computes the whole batch; use a batch "
                   f"divisible by {mesh[data]}")
    return out


def _param_notes(strategy, axes, mesh, a, shape, layout: Sharding) -> list[str]:
    out = []
    used = {ax for dim in layout for ax in dim}
    model, data = axes["model"], axes["data"]
    if strategy.tensor_parallel:
        want = _TP_ROLES.get(a.role)
        if want is not None and (model is None or model not in used):
            out.append(f"{a.role} ({a.why}), not split over {model!r}: "
                       f"{_why_not(a.names, shape, want, model, mesh)}")
        elif a.role in _KERNELS and len(shape) >= 2:
            out.append(f"{a.role} kernel ({a.why}), not split over {model!r}: tensor "
                       f"parallelism splits only recognised kernels, embeddings and heads")
    if strategy.experts and a.role.startswith("expert") and axes["expert"] not in used:
        out.append(f"{a.role}, not split over {axes['expert']!r}: "
                   f"{_why_not(a.names, shape, 'expert', axes['expert'], mesh)}")
    if strategy.shard_params and data is not None and mesh.get(data, 1) > 1 and data not in used:
        out.append(f"{a.role or 'parameter'}, not split over {data!r}: no dim of {shape} is "
                   f"divisible by {mesh[data]} (with the axes it already has)")
    return out


def _why_not(names, shape, want: str, axis, mesh) -> str:
    if axis is None or mesh.get(axis, 1) == 1:
        return f"the mesh {dict(mesh)} has no axis of size > 1 for it"
    dims = [i for i, n in enumerate(names) if n == want]
    if not dims:
        return f"no dim is named {want!r} (logical names {names})"
    i = dims[0]
    if shape[i] % mesh[axis]:
        return (f"dim {i} ({want}, size {shape[i]}) is not divisible by {axis!r} (size "
                f"{mesh[axis]}); it stays replicated")
    return f"{axis!r} is already used by another dim"


def _missing(strategy, info, axes) -> list[str]:
    """Whole families a strategy needs that the model does not have."""
    roles = {a.role for a in info if a.kind == "param"}
    out = []
    if strategy.experts and not any(r.startswith("expert") for r in roles):
        out.append(f"{strategy.name}: no expert parameters found (no contraction batches over a "
                   f"parameter dim), so nothing is split over {axes['expert']!r}: this plan is "
                   f"data parallel")
    if strategy.tensor_parallel and not roles & set(_TP_ROLES):
        out.append(f"{strategy.name}: no attention, MLP, embedding or head parameters found, so "
                   f"nothing is split over {axes['model']!r}")
    if strategy.sequence_parallel and not any(a.kind == "batch" and "seq" in a.names
                                              for a in info):
        out.append(f"{strategy.name}: no batch input has a sequence dim, so nothing is split "
                   f"over {axes['model']!r} along sequences")
    return out


def _pattern(path: str) -> str:
    """A parameter path with its layer indices as ``#``, to report repeated layers once (the
    leading argument index stays)."""
    head, sep, rest = path.partition("]")
    return head + sep + _INDEX.sub(lambda m: "_#']" if m.group(3) else "[#]", rest)


_INDEX = re.compile(r"\[(\d+)\]|\['(\d+)'\]|_(\d+)'\]")


def _count(paths: list[str]) -> str:
    return f"{len(paths)} parameters x " if len(paths) > 1 else ""
