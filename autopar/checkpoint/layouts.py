"""The layouts a restored state is read into: a given plan's, the saved plan's, a new plan's, or
given shardings. A plan is applied only where it fits: its mesh (axis names, sizes and order)
must be the one the state is restored onto, and its inputs at the state's argument must be the
state's leaves and shapes. Where the saved plan does not fit (or is missing or damaged),
``replan=None`` plans again and says why, ``replan=False`` refuses with what differs.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from autopar import validate
from autopar.errors import AutoparError, PlanError, ShardingError
from autopar.plan import Plan


def leaves(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def shapes(tree) -> list[tuple[str, tuple]]:
    return [(p, tuple(np.shape(x))) for p, x in leaves(tree)]


def targets(like, saved: Plan | None, why_not_saved: str | None, train_step, args: tuple,
            argnum: int, plan: Plan | None, replan: bool | None, mesh, shardings, where: str):
    """(sharding pytree like ``like``, plan used, re-planned?, notes). ``where`` names the
    checkpoint and step for messages; ``why_not_saved`` says why there is no usable saved
    plan."""
    if shardings is not None:
        if isinstance(shardings, jax.sharding.Sharding):
            return jax.tree.map(lambda _: shardings, like), None, False, ()
        return shardings, None, False, ()
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"plan={validate.short(plan)} ({type(plan).__name__}) is not an "
                        f"autopar.Plan; load a saved one with autopar.Plan.from_json(text)")
    if train_step is not None:
        return from_step(like, saved, why_not_saved, train_step, args, argnum, plan, replan,
                         where)
    if plan is None:
        raise AutoparError("restore needs to know the layouts: pass train_step= (the "
                           "@autoparallel step, which plans for its mesh), plan= with mesh=, or "
                           "shardings=")
    if mesh is None:
        raise AutoparError("restore(plan=...) without train_step= needs mesh= (the "
                           "jax.sharding.Mesh the plan's layouts are laid over)")
    return from_plan(like, plan, mesh, argnum, where), plan, False, ()


def _fits(plan: Plan, like, mesh, argnum: int) -> str | None:
    """Why ``plan`` cannot lay out ``like`` at argument ``argnum`` on ``mesh``, or None."""
    diff = validate.mesh_difference(plan.mesh, mesh)
    if diff is None:
        diff = validate.state_difference(plan, shapes(like), argnum)
    return diff


def from_step(like, saved, why_not_saved, train_step, args, argnum, plan, replan, where):
    """Layouts from ``train_step``: ``plan`` if given (it must fit), else the saved plan where it
    fits (``replan=False``: it must), else a new plan for the step's mesh."""
    if plan is not None:
        _require_fit(plan, like, train_step.mesh, argnum, f"restoring checkpoint {where}: plan=")
        return _apply(like, train_step, args, argnum, plan) + ((),)
    if replan is True:
        return _apply(like, train_step, args, argnum, None) + ((),)
    if saved is None:
        why = why_not_saved or "it was saved without one (save(..., plan=step.plan))"
        if replan is False:
            raise AutoparError(f"restore(replan=False) takes the plan saved in checkpoint "
                               f"{where}, but {why}; allow a re-plan (replan=None or True) or "
                               f"pass plan=")
        notes = (f"the saved plan was not used: {why}; planned again for this mesh",) \
            if why_not_saved else ()
        return _apply(like, train_step, args, argnum, None) + (notes,)
    if replan is False:
        _require_fit(saved, like, train_step.mesh, argnum,
                     f"restore(replan=False): the plan saved in checkpoint {where}")
        return _apply(like, train_step, args, argnum, saved) + ((),)
    why = _fits(saved, like, train_step.mesh, argnum)
    if why is None:
        try:
            return _apply(like, train_step, args, argnum, saved) + ((),)
        except (ShardingError, PlanError) as e:   # the step changed (ops, shapes or donation)
            why = str(e)
    note = f"the saved plan does not fit: {why}; planned again for this mesh"
    return _apply(like, train_step, args, argnum, None) + ((note,),)


def _require_fit(plan: Plan, like, mesh, argnum: int, what: str) -> None:
    why = _fits(plan, like, mesh, argnum)
    if why is not None:
        raise PlanError(f"{what} does not fit this restore: {why}. Let the step plan for its "
                        f"mesh (replan=True, or drop plan=), or restore onto the mesh and state "
                        f"the plan was made for")


def _apply(like, train_step, args: Sequence, argnum: int, given: Plan | None):
    """(the state's shardings, the plan used, re-planned?) from ``train_step``."""
    full = tuple(args[:argnum]) + (like,) + tuple(args[argnum:])
    shardings = train_step.input_shardings(*full, plan=given)
    return shardings[argnum], train_step.plan, given is None


def from_plan(like, plan: Plan, mesh, argnum: int, where: str = "?"):
    from autopar.mesh import concrete_mesh
    from autopar.sharding import to_spec

    mesh = concrete_mesh(mesh)
    why = _fits(plan, like, mesh, argnum)
    if why is not None:
        raise ShardingError(f"restoring checkpoint {where}: plan= cannot lay out this state: "
                            f"{why}; pass the mesh and state the plan was made for (state_argnum="
                            f"{argnum}?), or train_step= to plan for this mesh")
    prefix = f"[{argnum}]"
    layout = {p[len(prefix):]: s for p, s in zip(plan.input_paths, plan.input_shardings)
              if p.startswith(prefix)}
    out = [jax.sharding.NamedSharding(mesh, to_spec(layout[path])) for path, _ in leaves(like)]
    return jax.tree_util.tree_unflatten(jax.tree.structure(like), out)
