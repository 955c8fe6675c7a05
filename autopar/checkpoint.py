"""Sharded, asynchronous checkpoints of a training state through orbax, with the plan beside it.

    ckpt = autopar.checkpoint.Checkpointer("ckpt/")
    ckpt.save(100, state, plan=step.plan)       # returns once the arrays are copied off the devices
    ...
    r = ckpt.restore(abstract_state, train_step=step, args=(batch,))   # on any mesh
    state, done = r.state, r.step               # `done` steps were applied to `state`

Each saved step is one directory ``<path>/<step>/`` holding three orbax items: ``state`` (every
array written shard by shard by the processes that hold it; OCDBT/tensorstore), ``plan`` (the
plan's JSON) and ``meta`` (the step counter, the mesh and process count it was saved from, and
every leaf's path, shape and dtype). A step directory appears only once every process has
finished writing it, so a job killed mid-save leaves the previous step as the latest.

``restore`` reads each array straight into the layout it will be used in: the layouts of a given
plan, of the saved plan when the mesh has not changed, or of a new plan that the training step
makes for the mesh it now runs on (fewer devices after a failure, another cluster). No process
ever holds a whole array it does not need.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from autopar.errors import AutoparError, ShardingError
from autopar.mesh import axis_sizes
from autopar.plan import Plan

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore`` read.

    Attributes:
      state: the state pytree (shaped like ``like``), each array in its planned layout.
      step: the step counter saved with it: how many steps had been applied to ``state``.
      plan: the plan whose layouts the arrays were read into (``None`` for ``shardings=``).
      replanned: True when ``plan`` was made for this mesh rather than taken from the checkpoint
        or the caller.
      saved_plan: the plan stored in the checkpoint (``None`` if none was saved).
      meta: the checkpoint's metadata (saved mesh, process and device counts, leaf shapes).
    """

    state: Any
    step: int
    plan: Plan | None
    replanned: bool
    saved_plan: Plan | None
    meta: dict


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


class Checkpointer:
    """Checkpoints under one directory: ``save`` (asynchronous), ``restore``, ``latest_step``.

    Every process of a multi-process job must create it and call its methods alike (the
    writes and reads are collective). Use it as a context manager, or call ``close()``, so that
    the last asynchronous save is finished before the process exits.

    Args:
      directory: where the step directories live (created if absent).
      max_to_keep: how many most recent steps to keep (``None``: all).
      async_save: write in a background thread; ``save`` returns once the arrays are on the host.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = True):
        ocp = _orbax()
        self.directory = _normpath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        handlers = {"state": ocp.StandardCheckpointHandler(), "plan": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=handlers)

    # ---- writing ----------------------------------------------------------------------------
    def save(self, step: int, state, *, plan: Plan | None = None, wait: bool = False) -> None:
        """Save ``state`` as step ``step`` (the number of steps applied to it), with ``plan``.

        Returns once the arrays are copied to host memory: the state may be donated or changed
        at once. The files are written in the background; ``wait()`` blocks until they are.
        """
        ocp = _orbax()
        step = _step_number(step)
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise AutoparError(
                f"step {step} is not after the latest saved step {latest} in {self.directory}; "
                f"steps must increase: restore the latest step and go on from it, or save to a "
                f"new directory")
        saved_plan = None if plan is None else json.loads(plan.to_json())
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(_meta(step, state, plan)),
            plan=ocp.args.JsonSave({"plan": saved_plan})))
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the last asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading ----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps whose checkpoints are complete, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def meta(self, step: int | None = None) -> dict:
        """The metadata saved with ``step`` (default the latest)."""
        return self._read_json(self._pick(step), "meta")

    def saved_plan(self, step: int | None = None) -> Plan | None:
        """The plan saved with ``step`` (default the latest), or ``None``."""
        d = self._read_json(self._pick(step), "plan")["plan"]
        return None if d is None else Plan.from_json(json.dumps(d))

    def restore(self, like, *, step: int | None = None, train_step=None, args: Sequence = (),
                state_argnum: int = 0, plan: Plan | None = None, replan: bool | None = None,
                mesh=None, shardings=None) -> Restored:
        """Read a saved state straight into the layouts it will run in.

        Args:
          like: the state's structure: a pytree of arrays or ``jax.ShapeDtypeStruct``s (e.g.
            ``jax.eval_shape(init, ...)``), matched against the saved paths, shapes and dtypes.
          step: which step (default the latest complete one).
          train_step: the ``@autoparallel`` step the state feeds; its mesh and options decide
            the layouts. ``args`` are the step's other arguments (arrays or ShapeDtypeStructs,
            a host-local batch as the step receives it); the state goes in at ``state_argnum``.
          plan: use this plan's layouts (on ``train_step``'s mesh, else ``mesh``) without solving.
          replan: with ``train_step`` and no ``plan``: ``None`` reuses the saved plan when it was
            made for a mesh of the same axis sizes and re-plans otherwise; ``True`` always
            re-plans; ``False`` always takes the saved plan.
          shardings: a pytree like ``like`` of ``jax.sharding.Sharding`` (or one for every leaf)
            instead of a plan.

        Returns:
          ``Restored`` (state, step counter, the plan used, whether it was re-planned).
        """
        step = self._pick(step)
        meta = self._read_json(step, "meta")
        _check_like(like, meta, self.directory, step)
        saved = self.saved_plan(step)
        target, used, replanned = _targets(like, saved, train_step, tuple(args), state_argnum,
                                           plan, replan, mesh, shardings)
        ocp = _orbax()
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s), like, target)
        got = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))
        return Restored(got["state"], int(meta["step"]), used, replanned, saved, meta)

    def _pick(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise AutoparError(f"no complete checkpoint in {self.directory}; save one first (or "
                               f"start from a fresh state when latest_step() is None)")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise AutoparError(f"step {step} is not saved in {self.directory}; saved steps are "
                               f"{steps}")
        return step

    def _read_json(self, step: int, item: str):
        ocp = _orbax()
        got = self._manager.restore(step, args=ocp.args.Composite(
            **{item: ocp.args.JsonRestore()}))
        return got[item]


# ---- module-level shortcuts: one Checkpointer per directory -----------------------------------
_open: dict[str, Checkpointer] = {}


def _normpath(path) -> str:
    """An absolute local path; a URL (``gs://...``, which orbax also takes) as given."""
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def _checkpointer(path) -> Checkpointer:
    key = _normpath(path)
    if key not in _open:
        _open[key] = Checkpointer(key)
    return _open[key]


def save(step: int, state, path, *, plan: Plan | None = None, wait: bool = False) -> Checkpointer:
    """``Checkpointer(path).save(step, state, plan=plan)`` on a checkpointer kept per directory
    (so asynchronous saves to one directory queue up); call ``wait(path)`` before exiting."""
    ckpt = _checkpointer(path)
    ckpt.save(step, state, plan=plan, wait=wait)
    return ckpt


def restore(path, like, **kwargs) -> Restored:
    """``Checkpointer(path).restore(like, **kwargs)``; see ``Checkpointer.restore``."""
    ckpt = _checkpointer(path)
    ckpt.wait()
    return ckpt.restore(like, **kwargs)


def wait(path=None) -> None:
    """Finish the asynchronous saves to ``path`` (default: to every directory)."""
    for key, ckpt in list(_open.items()):
        if path is None or key == _normpath(path):
            ckpt.wait()


# ---- helpers ------------------------------------------------------------------------------------
def _step_number(step) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise AutoparError(f"step={step!r}: the step counter must be an integer >= 0 (the "
                           f"number of training steps applied to the state)")
    return int(step)


def _leaves(tree) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _meta(step: int, state, plan: Plan | None) -> dict:
    leaves = _leaves(state)
    return {"format_version": FORMAT_VERSION, "step": step,
            "num_processes": jax.process_count(), "num_devices": jax.device_count(),
            "mesh": None if plan is None else dict(plan.mesh),
            "graph_fingerprint": None if plan is None else plan.graph_fingerprint,
            "paths": [p for p, _ in leaves], "shapes": [list(np.shape(x)) for _, x in leaves],
            "dtypes": [str(_dtype(x)) for _, x in leaves]}


def _dtype(x):
    """A leaf's dtype without moving it (python scalars included)."""
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _check_like(like, meta: dict, directory: str, step: int) -> None:
    """Raise unless ``like`` has the saved leaves, shapes and dtypes (orbax's own error would
    come from deep inside tensorstore)."""
    saved = {p: (tuple(s), d) for p, s, d in zip(meta["paths"], meta["shapes"], meta["dtypes"])}
    given = {p: (tuple(np.shape(x)), str(_dtype(x))) for p, x in _leaves(like)}
    where = f"checkpoint {directory}/{step}"
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


def _targets(like, saved: Plan | None, train_step, args: tuple, argnum: int, plan: Plan | None,
             replan: bool | None, mesh, shardings):
    """(sharding pytree like ``like``, plan used, re-planned?)."""
    if shardings is not None:
        if isinstance(shardings, jax.sharding.Sharding):
            return jax.tree.map(lambda _: shardings, like), None, False
        return shardings, None, False
    if train_step is not None:
        return _from_step(like, saved, train_step, args, argnum, plan, replan)
    if plan is None:
        raise AutoparError("restore needs to know the layouts: pass train_step= (the "
                           "@autoparallel step, which plans for its mesh), plan= with mesh=, or "
                           "shardings=")
    if mesh is None:
        raise AutoparError("restore(plan=...) without train_step= needs mesh= (the "
                           "jax.sharding.Mesh the plan's layouts are laid over)")
    return _from_plan(like, plan, mesh, argnum), plan, False


def _from_step(like, saved, train_step, args, argnum, plan, replan):
    if replan is False and plan is None and saved is None:
        raise AutoparError("restore(replan=False) takes the saved plan, but this checkpoint was "
                           "saved without one (save(..., plan=step.plan)); allow a re-plan or "
                           "pass plan=")
    full = args[:argnum] + (like,) + args[argnum:]
    given = plan
    if given is None and replan is not True and saved is not None:
        same_mesh = dict(saved.mesh) == axis_sizes(train_step.mesh)
        given = saved if (same_mesh or replan is False) else None
    try:
        shardings = train_step.input_shardings(*full, plan=given)
    except ShardingError:
        if plan is not None or replan is False:
            raise
        shardings, given = train_step.input_shardings(*full), None   # the step changed: re-plan
    return shardings[argnum], train_step.plan, given is None


def _from_plan(like, plan: Plan, mesh, argnum: int):
    from autopar.mesh import concrete_mesh
    from autopar.sharding import to_spec

    mesh = concrete_mesh(mesh)
    if dict(plan.mesh) != axis_sizes(mesh):
        raise ShardingError(f"the plan is for mesh {dict(plan.mesh)}, restore was given "
                            f"{axis_sizes(mesh)}; pass the mesh the plan was made for, or "
                            f"train_step= to re-plan")
    prefix = f"[{argnum}]"
    layout = {p[len(prefix):]: s for p, s in zip(plan.input_paths, plan.input_shardings)
              if p.startswith(prefix)}
    out = []
    for path, _ in _leaves(like):
        if path not in layout:
            raise ShardingError(f"the plan has no input {prefix}{path}; it was made for another "
                                f"step or state (state_argnum={argnum}?)")
        out.append(jax.sharding.NamedSharding(mesh, to_spec(layout[path])))
    return jax.tree_util.tree_unflatten(jax.tree.structure(like), out)
