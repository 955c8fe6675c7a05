"""The layout a user already has, as a strategy: what a plain ``jax.jit`` user passes as
``in_shardings`` or commits arrays to, or what flax's logical partitioning metadata says under
``nn.logical_axis_rules`` (MaxText-style).

    >>> autopar.compare(step, params, opt_state, batch, mesh=mesh,
    ...                 strategies=("dp", autopar.strategies.user(in_shardings), "auto"))
    >>> autopar.plan(step, params, opt_state, batch, mesh=mesh, strategy="user")  # committed

``user(in_shardings)`` takes a pytree prefix of the step's arguments (as ``jax.jit`` does) whose
leaves are ``PartitionSpec``s, ``NamedSharding``s, ``None`` (the planner decides that input) or
flax ``Partitioned`` boxes (``jax.eval_shape(model.init, ...)``'s boxed variables: their
``names`` are used; an unboxed variable among them is replicated, as flax's
``nn.get_partition_spec`` has it); with ``rules`` (flax ``logical_axis_rules``) the specs'
names are logical and map to mesh axes as flax maps them. ``from_arrays(*args)`` reads the
layouts the arguments are committed to (``jax.Array``s on a ``NamedSharding``, or
``ShapeDtypeStruct``s carrying one); ``strategy="user"`` does this for the arguments of the
call.

The inputs are pinned, and so are the values the step's own ``with_sharding_constraint`` calls
constrain (flax's ``nn.with_logical_constraint`` makes them under a mesh): the planner fills in
every other activation under the same cost model, so the row is the user's layout, the step as
written, with the planner's best layouts where the user left them open. A step whose only
layout is its constraints (arguments not committed) has ``constraints_only()`` as its user
layout. Auto is held against it (``autopar.compare`` hands
it to auto; ``autopar.plan``/``autoparallel`` hold auto against the arguments' committed layouts
when they have any), takes it as a start, and is not bound by it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.errors import ShardingError
from autopar.sharding import Sharding
from ir import Graph

__all__ = ["FROM_ARGUMENTS", "UserLayout", "constraints_only", "from_arrays", "user"]


@dataclasses.dataclass(frozen=True)
class UserLayout:
    """A pytree prefix of the step's arguments with a spec (or None) per subtree."""

    in_shardings: Any
    rules: tuple = ()
    name: str = "user"
    # the step's own with_sharding_constraint calls are part of the user's layout: planned as
    # written (``autopar.planner.constraints``)
    keeps_constraints = True

    def fix_inputs(self, graph: Graph, mesh: Mapping[str, int]) -> dict[int, Sharding]:
        """Input index -> layout for every input the user's layout names (None: left open)."""
        specs = _flat_specs(self.in_shardings, graph)
        out = {}
        for k, spec in enumerate(specs):
            if spec is None:
                continue
            shape = graph.values[graph.inputs[k]].shape
            out[k] = _layout(spec, shape, mesh, self.rules, f"{self.name}: input "
                             f"{graph.input_paths[k]} of shape {shape}")
        return out

    def bind(self, graph: Graph, mesh: Mapping[str, int]) -> UserLayout:
        return self

    @property
    def notes(self) -> tuple[str, ...]:
        return ()


class _FromArguments:
    """``strategy="user"`` before the arguments are seen (``autopar.api`` resolves it)."""

    name = "user"

    def fix_inputs(self, graph, mesh):
        raise ShardingError("strategy='user' takes the layouts the arguments are committed to, "
                            "but none was given here; plan with the arguments "
                            "(autopar.plan(fn, *args, strategy='user')) or pass "
                            "autopar.strategies.user(in_shardings)")


FROM_ARGUMENTS = _FromArguments()


def resolve(strategy, args) -> Any:
    """``strategy`` with ``"user"`` (``FROM_ARGUMENTS``) read off ``args``' committed layouts."""
    if strategy != "user" and strategy is not FROM_ARGUMENTS:
        return strategy
    found = from_arrays(*args)
    if found is None:
        raise ShardingError("strategy='user' takes the layouts the arguments are committed to, "
                            "but no argument is on a NamedSharding of more than one device; "
                            "jax.device_put them onto your layout first, or pass "
                            "strategy=autopar.strategies.user(in_shardings)")
    return found


def constraints_only(name: str = "user") -> UserLayout:
    """The user's layout of a step whose arguments carry none: the step's own sharding
    constraints, every input left to the planner."""
    return UserLayout(None, (), name)


def user(in_shardings: Any, *, rules=None, name: str = "user") -> UserLayout:
    """The layout in ``in_shardings`` (see the module docstring) as a strategy named ``name``."""
    return UserLayout(in_shardings, tuple(tuple(r) for r in (rules or ())), name)


def from_arrays(*args: Any, name: str = "user") -> UserLayout | None:
    """The layouts ``args`` are committed to; None when no leaf is on a ``NamedSharding``."""
    leaves = jax.tree_util.tree_leaves(args)
    specs = [_committed(x) for x in leaves]
    if not any(s is not None for s in specs):
        return None
    flat = jax.tree_util.tree_structure(args)
    return UserLayout(jax.tree_util.tree_unflatten(flat, specs), (), name)


def _committed(x) -> PartitionSpec | None:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding.spec
    return None


def _is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding)) or _is_box(x)


def _is_box(x) -> bool:
    return hasattr(x, "names") and hasattr(x, "unbox")    # flax nn.Partitioned and kin


def _flat_specs(prefix: Any, graph: Graph) -> list:
    """One spec (or None) per graph input: ``prefix`` broadcast over the arguments' tree."""
    if graph.in_tree is None:
        raise ShardingError("a user layout needs the step's argument tree; plan the step with "
                            "autopar.plan(fn, *args, ...) rather than a bare graph")
    full = jax.tree_util.tree_unflatten(graph.in_tree, [0] * graph.in_tree.num_leaves)
    try:
        per_leaf = jax.tree_util.tree_map(
            lambda spec, sub: [spec] * len(jax.tree_util.tree_leaves(sub)), prefix, full,
            is_leaf=_is_spec_leaf)
    except ValueError as e:
        raise ShardingError(
            f"user layout: in_shardings is not a prefix of the step's arguments ({e}); give "
            f"one spec per argument, or a tree with the arguments' structure, as jax.jit's "
            f"in_shardings") from None
    flat = [s for group in jax.tree_util.tree_leaves(
        per_leaf, is_leaf=lambda x: isinstance(x, list)) for s in group]
    return [_spec_of(s) for s in flat]


def _spec_of(x) -> PartitionSpec | None:
    if isinstance(x, NamedSharding):
        return x.spec
    if _is_box(x):
        return PartitionSpec(*x.names)
    if hasattr(x, "shape") and hasattr(x, "dtype"):   # an unboxed variable beside boxed ones:
        return PartitionSpec()                       # replicated, as nn.get_partition_spec has it
    return x


def _layout(spec: PartitionSpec, shape, mesh: Mapping[str, int], rules, where: str) -> Sharding:
    if rules:
        from flax.linen import logical_to_mesh_axes

        spec = logical_to_mesh_axes(spec, rules)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if len(entries) > len(shape):
        raise ShardingError(f"{where}: spec {spec} has {len(spec)} entries for {len(shape)} "
                            f"dims; give at most one entry per dim")
    out, used = [], set()
    for size, e in zip(shape, entries):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        for a in axes:
            if a not in mesh:
                raise ShardingError(f"{where}: spec {spec} names mesh axis {a!r}, but the mesh "
                                    f"has axes {dict(mesh)}; name mesh axes (or pass rules= "
                                    f"to map logical names)")
            if a in used:
                raise ShardingError(f"{where}: spec {spec} uses mesh axis {a!r} twice")
            used.add(a)
        axes = tuple(a for a in axes if mesh[a] > 1)
        if size % math.prod(mesh[a] for a in axes):
            raise ShardingError(f"{where}: spec {spec} splits a dim of {size} over {axes} "
                                f"({math.prod(mesh[a] for a in axes)} devices), which does not "
                                f"divide it; pick axes that divide the dim")
        out.append(axes)
    return tuple(out)
