"""Logical axis names for a step's inputs, found from each input's pytree path, rank and dtype.

A parameter's dims are named by the first rule in ``LOGICAL_RULES`` whose path pattern matches
its path below ``['params']`` and whose rank equals the parameter's rank (or one less: a stacked
``nn.scan`` parameter gets a leading ``"layers"`` dim). This is flax's ``logical_axis_rules``
idea read from the outside: the model need not annotate anything.

    params/layer_0/mlp/fc1/kernel  (64, 128)         -> ("embed", "mlp")
    params/layers/attn/qkv/kernel  (2, 64, 3, 4, 16) -> ("layers", "embed", None, "heads", "kv")
    opt_state/0/mu/layer_0/mlp/fc1/kernel            -> its parameter's names
    batch/tokens (8, 16) int32                       -> ("batch", "seq")

Unmatched 2-D ``kernel`` parameters (a plain MLP's ``layer_0``, ``layer_1``, ``head``) alternate
column ("embed", "mlp") and row ("mlp", "embed") in the order the step first uses them (pytree
order is alphabetical, not the model's), so tensor parallelism pairs them the Megatron way; their
``bias`` follows the kernel's output dim.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from ir import Graph

Names = tuple["str | None", ...]

_MLP_IN = r"(fc1|wi|wi_0|wi_1|w1|w3|up_proj|gate_proj|c_fc|dense_h_to_4h|intermediate/dense)"
_MLP_OUT = r"(fc2|wo|w2|down_proj|c_proj|dense_4h_to_h|output/dense|mlp/out)"
_QKV = r"(qkv|c_attn|query_key_value|in_proj)"
_Q_K_V = r"(query|key|value|q_proj|k_proj|v_proj|wq|wk|wv|q|k|v)"
_ATT_OUT = r"(out|o_proj|wo|o|c_proj|dense|output/dense)"

# (path pattern searched in the slash-joined path below 'params', names per dim). Rank picks
# between rules that share a pattern; the first match wins.
LOGICAL_RULES: tuple[tuple[str, Names], ...] = (
    (rf"{_QKV}/kernel$", ("embed", None, "heads", "kv")),       # DenseGeneral (D, 3, H, Dh)
    (rf"{_QKV}/kernel$", ("embed", "heads")),                   # fused (D, 3*H*Dh)
    (rf"{_QKV}/bias$", (None, "heads", "kv")),
    (rf"{_QKV}/bias$", ("heads",)),
    (rf"(^|/){_Q_K_V}/kernel$", ("embed", "heads", "kv")),      # (D, H, Dh)
    (rf"(^|/){_Q_K_V}/kernel$", ("embed", "heads")),            # (D, H*Dh)
    (rf"(^|/){_Q_K_V}/bias$", ("heads", "kv")),
    (rf"(^|/){_Q_K_V}/bias$", ("heads",)),
    (rf"(^|/){_ATT_OUT}/kernel$", ("heads", "kv", "embed")),       # DenseGeneral (H, Dh, D)
    (rf"(^|/)(attn|attention|self_attn)/{_ATT_OUT}/kernel$", ("heads", "embed")),  # (H*Dh, D)
    (r"(^|/)(w_in|wi)$", ("expert", "embed", "mlp")),     # MoE (E, D, F)
    (r"(^|/)(w_out|wo)$", ("expert", "mlp", "embed")),   # MoE (E, F, D)
    (rf"(^|/){_MLP_IN}/kernel$", ("embed", "mlp")),
    (rf"(^|/){_MLP_IN}/bias$", ("mlp",)),
    (rf"(^|/){_MLP_OUT}/kernel$", ("mlp", "embed")),
    (r"(^|/)(router|gate|gating)/kernel$", ("embed", None)),
    (r"(^|/)(wte|embed|embedding|embed_tokens|word_embeddings|tok_embeddings)(/embedding)?$",
     ("vocab", "embed")),
    (r"(^|/)(wpe|pos_embed|pos_embedding|position_embeddings)(/embedding)?$", ("pos", "embed")),
    (r"(^|/)(lm_head|unembed|embed_out|output_projection)/kernel$", ("embed", "vocab")),
    (r"(^|/)(scale|bias)$", ("norm",)),
)

_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)")


@dataclasses.dataclass(frozen=True)
class InputAxes:
    """What one graph input is and the logical name of each of its dims."""

    kind: str                   # "param", "opt_state", "batch" or "scalar"
    names: Names                # one per dim; None: no logical name (stays replicated)
    param: int | None = None    # opt_state: the input index of the parameter it follows


def path_keys(path: str) -> tuple[str, ...]:
    """``"[0]['opt_state'][0].mu['wte']"`` -> ``("0", "opt_state", "0", "mu", "wte")``."""
    return tuple(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))


def names_for(param_path: Sequence[str], rank: int) -> Names | None:
    """The logical names of a parameter's dims by ``LOGICAL_RULES``, or None when none match."""
    text = "/".join(param_path)
    for stacked in (0, 1):
        for pattern, names in LOGICAL_RULES:
            if len(names) + stacked == rank and re.search(pattern, text):
                return ("layers",) * stacked + names
    return None


def _first_use(graph: Graph) -> dict[int, int]:
    """Input index -> position of the first op (in execution order) that reads it."""
    index = {v: k for k, v in enumerate(graph.inputs)}
    first: dict[int, int] = {}
    for pos, op in enumerate(graph.all_ops()):
        for v in op.ins:
            if v in index:
                first.setdefault(index[v], pos)
    return first


def _alternate(graph: Graph, params: dict[int, tuple[str, ...]], shapes,
               names: dict[int, Names]) -> None:
    """Unmatched 2-D kernels alternate column/row; their biases follow (see module docstring)."""
    first = _first_use(graph)
    kernels = sorted((k for k, p in params.items()
                      if k not in names and len(shapes[k]) == 2 and p[-1] == "kernel"),
                     key=lambda k: (first.get(k, math.inf), k))
    bias_of = {p[:-1]: k for k, p in params.items() if p[-1] == "bias" and len(shapes[k]) == 1}
    for j, k in enumerate(kernels):
        names[k] = ("embed", "mlp") if j % 2 == 0 else ("mlp", "embed")
        b = bias_of.get(params[k][:-1])
        if b is not None and names.get(b) in (None, ("norm",)):
            names[b] = (names[k][1],)


def _batch_names(shape: Sequence[int], dtype: str) -> Names:
    """(batch, seq, ...) for token ids and (B, S, D) activations; (batch, None) for features."""
    if len(shape) >= 3 or (len(shape) == 2 and not dtype.startswith(("float", "bfloat"))):
        return ("batch", "seq") + (None,) * (len(shape) - 2)
    return ("batch",) + (None,) * (len(shape) - 1)


def _param_paths(graph: Graph) -> dict[int, tuple[str, ...]]:
    """Input index -> path below 'params' for every parameter input (rank >= 1)."""
    out = {}
    for k, path in enumerate(graph.input_paths):
        keys = path_keys(path)
        if "params" in keys and graph.values[graph.inputs[k]].shape:
            out[k] = keys[len(keys) - keys[::-1].index("params"):]
    return out


def annotate(graph: Graph) -> tuple[InputAxes, ...]:
    """Name the dims of every input of ``graph`` (see the module docstring)."""
    shapes = [graph.values[v].shape for v in graph.inputs]
    params = _param_paths(graph)
    names: dict[int, Names] = {}
    for k, p in params.items():
        found = names_for(p, len(shapes[k]))
        if found is not None:
            names[k] = found
    _alternate(graph, params, shapes, names)
    by_suffix = {p: k for k, p in params.items()}
    out = []
    for k, path in enumerate(graph.input_paths):
        shape = shapes[k]
        if not shape:
            out.append(InputAxes("scalar", ()))
        elif k in params:
            out.append(InputAxes("param", names.get(k, (None,) * len(shape))))
        else:
            out.append(_opt_or_batch(k, path_keys(path), shape, graph, by_suffix, shapes, names))
    return tuple(out)


def _opt_or_batch(k, keys, shape, graph, by_suffix, shapes, names) -> InputAxes:
    """An optimizer-state leaf ends with a parameter's path and has its shape; else a batch."""
    for start in range(len(keys)):
        p = by_suffix.get(tuple(keys[start:]))
        if p is not None and shapes[p] == shape:
            return InputAxes("opt_state", names.get(p, (None,) * len(shape)), p)
    dtype = graph.values[graph.inputs[k]].dtype
    return InputAxes("batch", _batch_names(shape, dtype))
