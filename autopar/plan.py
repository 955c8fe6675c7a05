"""``autopar.Plan``: what the planner decided, what it predicts, and how to print and save it.

A plan is immutable and serialises to JSON (never pickle). It keeps the graph's fingerprint so a
loaded plan is applied only to the function it was made for.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

from autopar.sharding import Sharding, to_spec

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Collective:
    where: str                 # "op17 dot_general @ model.py:31" or "edge op12:arg1"
    kind: str
    axes: tuple[str, ...]
    nbytes: float              # per device, cost_models conventions
    time_s: float              # including the op's multiplier (a scan body's trip count)


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    step_time_s: float
    compute_s: float
    comm_s: float              # collectives the ops issue (partial sums, reductions)
    transition_s: float        # resharding between ops
    peak_memory_bytes: float
    memory_budget_bytes: float | None
    comm_by_kind: tuple[tuple[str, float], ...]
    dispatch_s: float = 0.0    # launching the step's program, once

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {_ms(t)}" for k, t in self.comm_by_kind) or "none"
        launch = f" + launch {_ms(self.dispatch_s)}" if self.dispatch_s else ""
        return (f"step {_ms(self.step_time_s)} = compute {_ms(self.compute_s)} + collectives "
                f"{_ms(self.comm_s)} + resharding {_ms(self.transition_s)}{launch}; peak memory "
                f"{_gib(self.peak_memory_bytes)}/device; communication by kind: {kinds}")


@dataclasses.dataclass(frozen=True)
class SolverStats:
    status: str
    gap: float
    solve_s: float
    build_s: float
    trace_s: float
    num_groups: int
    num_vars: int
    num_constraints: int
    candidates: int = 0      # > 0: solved over at most this many strategies per decision group


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sharding plan for one function and one abstract signature.

    ``input_shardings``/``output_shardings`` are flat, in the order of the flattened arguments
    and results; ``input_specs``/``output_specs`` give them as pytrees of ``PartitionSpec``.
    ``pins`` are the sharding constraints codegen places inside the step: (equation path, output
    index, layout).
    """

    mesh: tuple[tuple[str, int], ...]
    hardware: str
    strategy: str
    graph_fingerprint: str
    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_shardings: tuple[Sharding, ...]
    output_shardings: tuple[Sharding, ...]
    pins: tuple[tuple[tuple[int, ...], int, Sharding], ...]
    choices: tuple[tuple[int, str, str, str], ...]      # (op id, prim, source, strategy name)
    collectives: tuple[Collective, ...]
    cost: CostBreakdown
    solver: SolverStats
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    notes: tuple[str, ...] = ()   # what a hand-written strategy could not place, and why

    # ---- views ------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def input_specs(self):
        """Pytree (like the arguments) of ``PartitionSpec``; a path->spec dict without a tree."""
        return _spec_tree(self.input_shardings, self.in_tree, self.input_paths)

    @property
    def output_specs(self):
        """Pytree (like the results) of ``PartitionSpec``; a path->spec dict without a tree."""
        return _spec_tree(self.output_shardings, self.out_tree, self.output_paths)

    def spec_of(self, path_fragment: str):
        """The spec of the one input whose pytree path contains ``path_fragment``."""
        hits = [k for k, p in enumerate(self.input_paths) if path_fragment in p]
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} inputs match {path_fragment!r}; inputs are e.g. "
                           f"{list(self.input_paths[:5])}")
        return to_spec(self.input_shardings[hits[0]])

    def collective_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    # ---- text -------------------------------------------------------------------------------
    def summary(self, max_rows: int = 40) -> str:
        from autopar.explain import summary

        return summary(self, max_rows)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from autopar.explain import html

        return html(self)

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("in_tree"), d.pop("out_tree")
        d["format_version"] = FORMAT_VERSION
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        d.pop("format_version", None)
        t = _tuplify
        return cls(
            mesh=tuple((a, int(n)) for a, n in d["mesh"]), hardware=d["hardware"],
            strategy=d["strategy"], graph_fingerprint=d["graph_fingerprint"],
            input_paths=tuple(d["input_paths"]), output_paths=tuple(d["output_paths"]),
            input_shapes=t(d["input_shapes"]), input_shardings=t(d["input_shardings"]),
            output_shardings=t(d["output_shardings"]),
            pins=tuple((tuple(p), int(k), t(s)) for p, k, s in d["pins"]),
            choices=tuple(tuple(c) for c in d["choices"]),
            collectives=tuple(Collective(c["where"], c["kind"], tuple(c["axes"]), c["nbytes"],
                                         c["time_s"]) for c in d["collectives"]),
            cost=CostBreakdown(**{**d["cost"], "comm_by_kind": t(d["cost"]["comm_by_kind"])}),
            solver=SolverStats(**d["solver"]),
            notes=tuple(d.get("notes", ())),
        )

    def with_trees(self, in_tree, out_tree) -> Plan:
        return dataclasses.replace(self, in_tree=in_tree, out_tree=out_tree)


def _spec_tree(shardings, tree, paths):
    specs = [to_spec(s) for s in shardings]
    if tree is None:   # a plan loaded from JSON before it was applied to its function
        return dict(zip(paths, specs))
    return jax.tree_util.tree_unflatten(tree, specs)


def _tuplify(x):
    if isinstance(x, list):
        return tuple(_tuplify(e) for e in x)
    return x


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"
