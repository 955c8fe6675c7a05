"""The metadata saved with each step: the step counter, the mesh and program of the saved plan,
the plan's argument the state is, and every leaf's path, shape and dtype; and the checks that
hold it against the directory, the saved plan and the ``like`` of a restore."""
from __future__ import annotations

import json
import re

import jax
import numpy as np
from etils import epath

from autopar import validate
from autopar.checkpoint import layouts
from autopar.errors import AutoparError
from autopar.plan import Plan

# 2: an integrity record (every file's size and block checksums) and the state's argument of the
#    plan.
FORMAT_VERSION = 2


def step_number(step) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise AutoparError(f"step={step!r}: the step counter must be an integer >= 0 (the "
                           f"number of training steps applied to the state)")
    return int(step)


def state_argnum(plan: Plan | None, state) -> int | None:
    """The argument of ``plan`` that ``state`` is (its leaves and shapes), checked at save so
    that a checkpoint never holds a plan of another step."""
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise AutoparError(f"save(plan={validate.short(plan)}): plan= takes an autopar.Plan (the "
                           f"plan of the step the state feeds: step.plan), or None")
    have = layouts.shapes(state)
    argnums = sorted({int(p[1:p.index("]")]) for p in plan.input_paths if p.startswith("[")})
    whys = []
    for k in argnums:
        why = validate.state_difference(plan, have, k)
        if why is None:
            return k
        whys.append(f"argument {k}: {why}")
    raise AutoparError(f"save(plan=...): the plan's arguments do not include this state "
                       f"({'; '.join(whys[:2]) or 'it has no inputs'}); pass the plan of the step "
                       f"the state feeds (step.plan), or none")


def build(step: int, state, plan: Plan | None, argnum: int | None) -> dict:
    leaves = layouts.leaves(state)
    return {"format_version": FORMAT_VERSION, "step": step,
            "num_processes": jax.process_count(), "num_devices": jax.device_count(),
            "mesh": None if plan is None else dict(plan.mesh),
            "graph_fingerprint": None if plan is None else plan.graph_fingerprint,
            "state_argnum": argnum,
            "paths": [p for p, _ in leaves], "shapes": [list(np.shape(x)) for _, x in leaves],
            "dtypes": [str(dtype(x)) for _, x in leaves]}


def problem(meta) -> str | None:
    """What is malformed in a metadata object (hand-edited or damaged without a record)."""
    if not isinstance(meta, dict):
        return f"a JSON object was expected, got {type(meta).__name__}"
    for key in ("format_version", "step"):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return f"{key} is {v!r}, not an integer >= 0"
    lists = [meta.get(k) for k in ("paths", "shapes", "dtypes")]
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:
        return "paths, shapes and dtypes must be lists of one length"
    if not all(isinstance(s, list) and all(isinstance(n, int) for n in s) for s in lists[1]):
        return "shapes must be lists of integers"
    mesh = meta.get("mesh")
    if mesh is not None and not (isinstance(mesh, dict) and all(
            isinstance(k, str) and isinstance(v, int) for k, v in mesh.items())):
        return f"mesh is {mesh!r}, not null or an object of axis sizes"
    argnum = meta.get("state_argnum")
    if argnum is not None and (isinstance(argnum, bool) or not isinstance(argnum, int)):
        return f"state_argnum is {argnum!r}, not null or an integer"
    if not isinstance(meta.get("graph_fingerprint", ""), (str, type(None))):
        return "graph_fingerprint must be null or a string"
    return None


def plan_mismatch(plan: Plan, meta: dict) -> str | None:
    """How the saved plan contradicts the saved state's metadata, or None."""
    saved_mesh = meta.get("mesh")
    if saved_mesh is not None and list(dict(saved_mesh).items()) != list(plan.mesh):
        return f"it is for mesh {dict(plan.mesh)}, the state was saved from {saved_mesh}"
    fp = meta.get("graph_fingerprint")
    if fp is not None and fp != plan.graph_fingerprint:
        return (f"its program fingerprint is {plan.graph_fingerprint}, the state was saved "
                f"with {fp}")
    argnum = meta.get("state_argnum", 0 if meta["format_version"] == 1 else None)
    if argnum is None:
        return None
    return validate.state_difference(plan, [(p, tuple(s)) for p, s in
                                            zip(meta["paths"], meta["shapes"])], argnum)


def raw_version(step_dir: epath.Path):
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text()).get("format_version")
    except Exception:  # noqa: BLE001 - unreadable: not a format-1 step
        return None


def user_paths(step_dir: epath.Path) -> dict[str, str]:
    """orbax's dotted array names -> the state's pytree paths (from the metadata, if it reads)."""
    try:
        paths = json.loads((step_dir / "meta" / "metadata").read_text())["paths"]
        return {".".join(g for m in re.finditer(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", p)
                         for g in m.groups() if g is not None): p for p in paths}
    except Exception:  # noqa: BLE001 - damaged metadata: orbax's names will do
        return {}


def dtype(x):
    """A leaf's dtype without moving it (python scalars included)."""
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def check_like(like, meta: dict, where: str) -> None:
    """Raise unless ``like`` has the saved leaves, shapes and dtypes (orbax's own error would
    come from deep inside tensorstore)."""
    saved = {p: (tuple(s), d) for p, s, d in zip(meta["paths"], meta["shapes"], meta["dtypes"])}
    given = {p: (tuple(np.shape(x)), str(dtype(x))) for p, x in layouts.leaves(like)}
    where = f"checkpoint {where}"
    missing, extra = sorted(saved.keys() - given.keys()), sorted(given.keys() - saved.keys())
    if missing or extra:
        raise AutoparError(
            f"`like` does not have the saved state's structure ({where}): saved but not in "
            f"`like`: {missing[:5]}, in `like` but not saved: {extra[:5]}; pass the abstract "
            f"state of the model and optimizer that were saved (jax.eval_shape of their init)")
    for path, want in saved.items():
        if given[path] != want:
            raise AutoparError(
                f"{path}: `like` has shape/dtype {given[path]}, the {where} holds {want}; "
                f"restore with the model configuration that was saved")
