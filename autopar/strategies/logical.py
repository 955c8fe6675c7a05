"""Logical axis names for a step's inputs, found from the graph (``autopar.strategies.roles``).

Each parameter's dims are named by its role in the forward pass, never by its pytree path, so
HF GPT-2's fused ``c_attn`` Conv1D kernel (stored output-major), Llama's q/k/v/o and gate/up/down
projections, T5-style encoders, ViT and a plain dict of arrays all get names. This is flax's
``logical_axis_rules`` idea read from the outside: the model need not annotate anything.

    attn/qkv kernel (64, 3, 4, 16), feeds attention      -> ("embed", None, "heads", "kv")
    h/0/attn/c_attn kernel (192, 64), feeds attention    -> ("heads", "embed")
    mlp/fc2 kernel (256, 64), input from fc1             -> ("mlp", "embed")
    stacked nn.scan kernel (2, 64, 256)                  -> ("layers", "embed", "mlp")
    opt_state/0/mu/... (a parameter's Adam moment)       -> its parameter's names
    batch tokens (8, 16) int32                           -> ("batch", "seq")
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from autopar.strategies.roles import Analysis, ParamRole, analyse, path_keys
from ir import Graph

Names = tuple["str | None", ...]

__all__ = ["InputAxes", "annotate", "path_keys"]


@dataclasses.dataclass(frozen=True)
class InputAxes:
    """What one graph input is and the logical name of each of its dims."""

    kind: str                   # "param", "opt_state", "batch" or "scalar"
    names: Names                # one per dim; None: no logical name (stays replicated)
    param: int | None = None    # opt_state: the input index of the parameter it follows
    role: str = ""              # a parameter's role (see roles.ParamRole), "" otherwise
    why: str = ""               # how the role was found


def _batch_names(shape: Sequence[int], dtype: str) -> Names:
    """(batch, seq, ...) for token ids and (B, S, D) activations; (batch, None) for features."""
    if len(shape) >= 3 or (len(shape) == 2 and not dtype.startswith(("float", "bfloat"))):
        return ("batch", "seq") + (None,) * (len(shape) - 2)
    return ("batch",) + (None,) * (len(shape) - 1)


def annotate(graph: Graph) -> tuple[InputAxes, ...]:
    """Name the dims of every input of ``graph`` (see the module docstring); computed once per
    graph (``StrategyFacts``)."""
    return facts(graph).input_axes


def facts(graph: Graph) -> StrategyFacts:
    """The strategies' facts about ``graph``, kept with its analyses (``ir.analyses``)."""
    return graph.analyses.attached(StrategyFacts)


class StrategyFacts:
    """What the hand-written strategies find in one graph and reuse: one per graph, made by
    ``graph.analyses.attached`` (``ir`` cannot hold the strategies' slots itself)."""

    def __init__(self, graph: Graph):
        self._graph = graph

    @functools.cached_property
    def analysis(self) -> Analysis:
        """``roles.analyse``: kinds of the inputs, roles of the parameters."""
        return analyse(self._graph)

    @functools.cached_property
    def input_axes(self) -> tuple[InputAxes, ...]:
        """``annotate``."""
        return _annotate(self._graph, self.analysis)


def _annotate(graph: Graph, found: Analysis) -> tuple[InputAxes, ...]:
    out = []
    for k, kind in enumerate(found.kinds):
        t = graph.values[graph.inputs[k]]
        if kind == "param":
            role: ParamRole = found.params[k]
            out.append(InputAxes("param", role.names, None, role.role, role.why))
        elif kind == "opt_state":
            p = found.param_of.get(k)
            role = found.params.get(p) if p is not None else None
            names = role.names if role is not None else (None,) * len(t.shape)
            out.append(InputAxes("opt_state", names, p, role.role if role else "",
                                 "its parameter's names" if role else "no parameter matches"))
        elif kind == "batch":
            out.append(InputAxes("batch", _batch_names(t.shape, t.dtype)))
        else:
            out.append(InputAxes("scalar", ()))
    return tuple(out)
