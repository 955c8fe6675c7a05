"""What is computed about one ``Graph`` and reused: its ``Analyses``.

Every plan of a graph asks the same questions of it (``autopar.compare`` plans it once per
strategy): its op and producer indices, its fingerprint, the kernels XLA makes of it
(``ir.fusion``), the structural roles and node graph of its ops (``ir.layers``), its fold
(``ir.fold``). Each is a named slot here, computed on first use and kept; the functions that
compute them stay in their modules (``ir.fusion.fuse`` is ``graph.analyses.fusion``).

Why a field of the graph, not an argument passed down: the questions are asked at every layer
(ir passes, the planner's problem build, the strategies, codegen's fingerprint check) through
dozens of call paths that only hold the graph; threading a second object through all of them
would pair every graph with an Analyses that could belong to another graph. ``Graph.analyses``
is a dataclass field (``init=False, compare=False, hash=False, repr=False``) made in
``Graph.__post_init__``, so it is of exactly one graph: ``dataclasses.replace`` runs
``__init__`` again and a derived graph starts with fresh analyses. A pass that knows an
analysis holds for the graph it derives says so with ``carry`` (``ir.layers.find_layers`` hands
on the node graph: op and value ids do not change; ``ir.fold`` gives the folded graph the full
graph's roles).

Upper layers: ir imports nothing above it, so the planner's and the strategies' facts about a
graph cannot be slots here. Each such layer keeps one class of named slots of its own
(``autopar.planner.problem.GraphFacts``, ``autopar.strategies.logical.StrategyFacts``), made once
per graph by ``attached(cls)`` as ``cls(graph)``: one generic entry point, keyed by the class,
rather than string-keyed memos spread over the planner.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ir.fold import Folded
    from ir.fusion import Fusion
    from ir.graph import Graph, Op
    from ir.layers import Roles

T = TypeVar("T")

# the slots a pass may hand on to a graph it derives (``carry``)
CARRIED = frozenset({"node_graph", "roles"})


class Analyses:
    """The analyses of one graph; each slot is computed once, on first use. Treat what a slot
    returns as read only: it is shared by every caller."""

    def __init__(self, graph: Graph):
        self._graph = graph
        self._attached: dict[type, Any] = {}

    # ---- navigation -------------------------------------------------------------------------
    @functools.cached_property
    def op_index(self) -> Mapping[int, Op]:
        """Op id -> op, nested ops included."""
        return {op.id: op for op in self._graph.all_ops()}

    @functools.cached_property
    def producers(self) -> Mapping[int, Op]:
        """Value id -> the op that makes it, nested ops included."""
        return {v: op for op in self._graph.all_ops() for v in op.outs}

    @functools.cached_property
    def fingerprint(self) -> str:
        """``Graph.fingerprint`` (a 50k-op graph takes a tenth of a second to hash)."""
        from ir.graph import fingerprint

        return fingerprint(self._graph)

    # ---- structure --------------------------------------------------------------------------
    @functools.cached_property
    def fusion(self) -> Fusion:
        """``ir.fusion.fuse``: the kernels XLA makes of the graph."""
        from ir.fusion import _fuse

        return _fuse(self._graph)

    @functools.cached_property
    def node_graph(self) -> tuple:
        """``ir.layers.node_graph``: structural labels and labelled edges of the top level."""
        from ir.layers import _build_node_graph

        return _build_node_graph(self._graph)

    @functools.cached_property
    def roles(self) -> Roles:
        """``ir.layers.roles`` at the default number of refinement rounds."""
        from ir.layers import ROLE_ROUNDS, _roles

        return _roles(self._graph, ROLE_ROUNDS)

    @functools.cached_property
    def fold(self) -> Folded | None:
        """``ir.fold.fold`` with its default parameters."""
        from ir.fold import KEEP_HEAD, MIN_COPIES, _fold

        return _fold(self._graph, KEEP_HEAD, MIN_COPIES)

    # ---- carrying and upper layers ----------------------------------------------------------
    def computed(self, name: str) -> bool:
        """Whether slot ``name`` has been computed (or carried) already."""
        return name in vars(self)

    def carry(self, **given: Any) -> None:
        """Give this graph slots known from the graph it was derived from, before any is
        computed here: the deriving pass vouches that they hold (see the module docstring)."""
        for name, value in given.items():
            if name not in CARRIED:
                raise ValueError(f"Analyses.carry: {name!r} is not one of {sorted(CARRIED)}")
            if self.computed(name):
                raise ValueError(f"Analyses.carry: {name!r} was already computed on this graph")
            setattr(self, name, value)

    def attached(self, cls: type[T]) -> T:
        """The one ``cls(graph)`` of this graph: an upper layer's own slots (see the module
        docstring)."""
        hit = self._attached.get(cls)
        if hit is None:
            hit = self._attached[cls] = cls(self._graph)
        return hit
