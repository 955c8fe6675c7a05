"""Sharded, asynchronous checkpoints of a training state through orbax, with the plan beside it,
checked end to end.

    ckpt = autopar.checkpoint.Checkpointer("ckpt/")
    ckpt.save(100, state, plan=step.plan)       # returns once the arrays are copied off the devices
    ...
    r = ckpt.restore(abstract_state, train_step=step, args=(batch,))   # on any mesh
    state, done = r.state, r.step               # `done` steps were applied to `state`

Each saved step is one directory ``<path>/<step>/`` holding three orbax items: ``state`` (every
array written shard by shard by the processes that hold it; OCDBT/tensorstore), ``plan`` (the
plan's JSON) and ``meta`` (the step counter, the mesh and process count it was saved from, the
argument of the plan the state is, and every leaf's path, shape and dtype), plus the integrity
record: every file's size and block checksums (``autopar.checkpoint.integrity``). A step
directory appears only once every process has finished writing it and the record is written, so
a job killed mid-save leaves the previous step as the latest.

``restore`` checks the step's files against the record (index and metadata first, the array
chunks while orbax reads them), the step counter against the directory and the saved plan
against the state it describes, and reads each array straight into the layout it will be used
in: the layouts of a given plan, of the saved plan where it fits the mesh, or of a new plan that
the training step makes for the mesh it now runs on (fewer devices after a failure, another
cluster). No process ever holds a whole array it does not need. Any
damage is a ``CheckpointError`` naming the directory, the step, the file and the arrays in it;
``fallback=True`` takes the newest intact step instead. A missing or damaged saved plan never
blocks an intact state: the step plans again (or, with ``replan=False``, refuses clearly).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from autopar import validate
from autopar.checkpoint import integrity, layouts
from autopar.checkpoint import meta as stepmeta
from autopar.checkpoint.integrity import RECORD
from autopar.checkpoint.meta import FORMAT_VERSION
from autopar.errors import AutoparError, CheckpointError, PlanError
from autopar.plan import Plan

__all__ = ["FORMAT_VERSION", "RECORD", "CheckpointError", "Checkpointer", "Restored", "restore",
           "save", "wait"]

_MAX_LINES = 5          # damaged files named in one message
_FIX = ("restore another step (steps() lists them; restore(..., fallback=True) takes the newest "
        "intact one), or save again from a live run")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore`` read.

    Attributes:
      state: the state pytree (shaped like ``like``), each array in its planned layout.
      step: the step counter saved with it: how many steps had been applied to ``state``.
      plan: the plan whose layouts the arrays were read into (``None`` for ``shardings=``).
      replanned: True when ``plan`` was made for this mesh rather than taken from the checkpoint
        or the caller.
      saved_plan: the plan stored in the checkpoint (``None`` if none was saved, if it was
        damaged or did not describe the state, as ``notes`` says, or if the restore did not
        need it: ``plan=`` or ``shardings=``).
      meta: the checkpoint's metadata (saved mesh, process and device counts, leaf shapes).
      notes: what ``restore`` did that the caller did not ask for: a damaged step skipped for an
        older one (``fallback=True``), the saved plan set aside and why, an unverified step.
      verified: every file of the step matched its recorded size and checksums (False only for
        steps saved by autopar before checkpoints carried checksums).
    """

    state: Any
    step: int
    plan: Plan | None
    replanned: bool
    saved_plan: Plan | None
    meta: dict
    notes: tuple[str, ...] = ()
    verified: bool = True


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
        With False, ``save`` returns once the step is on disk.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = True):
        ocp = _orbax()
        self.directory = _normpath(directory)
        self._async = validate.flag("async_save", async_save)
        self._pending: int | None = None
        # Always orbax's asynchronous path: its post-finalization callback is where the
        # integrity record is written, after every file and before the step is renamed in place.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_record))
        handlers = {"state": ocp.StandardCheckpointHandler(), "plan": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=handlers)

    # ---- writing ----------------------------------------------------------------------------
    def save(self, step: int, state, *, plan: Plan | None = None, wait: bool = False) -> None:
        """Save ``state`` as step ``step`` (the number of steps applied to it), with ``plan``
        (the plan of the step the state feeds: ``step.plan``).

        Returns once the arrays are copied to host memory: the state may be donated or changed
        at once. The files are written in the background; ``wait()`` blocks until they are.
        """
        ocp = _orbax()
        step = stepmeta.step_number(step)
        argnum = stepmeta.state_argnum(plan, state)
        self.wait()     # the record callback reads _pending
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise AutoparError(
                f"step {step} is not after the latest saved step {latest} in {self.directory}; "
                f"steps must increase: restore the latest step and go on from it, or save to a "
                f"new directory")
        saved_plan = None if plan is None else json.loads(plan.to_json())
        self._pending = step
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave(stepmeta.build(step, state, plan, argnum)),
            plan=ocp.args.JsonSave({"plan": saved_plan})))
        if wait or not self._async:
            self.wait()

    def _write_record(self) -> None:
        """orbax's post-finalization callback (primary process, background thread): every
        process has written its files and the index is merged; the directory is not yet in
        place."""
        root = epath.Path(self.directory)
        tmp = root / f"{self._pending}{_orbax().path.atomicity_types.TMP_DIR_SUFFIX}"
        step_dir = tmp if tmp.exists() else root / str(self._pending)  # commit-file storage
        if not step_dir.exists():
            raise CheckpointError(f"checkpoint {self.directory}: step {self._pending} was "
                                  f"written, but neither {tmp} nor {step_dir} exists to record "
                                  f"its checksums in")
        integrity.write_record(step_dir)

    def wait(self) -> None:
        """Block until the last asynchronous save is on disk; ``CheckpointError`` if writing it
        failed (the step is then not committed: the previous one stays the latest)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax re-raises its writer thread's error
            raise CheckpointError(
                f"checkpoint {self._where(self._pending)}: saving failed ({type(e).__name__}: "
                f"{str(e)[:300]}); the step was not committed, so the latest complete step is "
                f"still {self.latest_step()}. Free space or fix the storage, then save again"
                ) from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
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
        """The metadata saved with ``step`` (default the latest); ``CheckpointError`` if it is
        damaged."""
        step = self._pick(step)
        return self._checked_meta(step)

    def saved_plan(self, step: int | None = None) -> Plan | None:
        """The plan saved with ``step`` (default the latest), or ``None`` if none was saved;
        ``CheckpointError`` if it is damaged or does not describe the saved state."""
        step = self._pick(step)
        record = self._record(step)
        plan_files = {"files": {f: v for f, v in (record or {"files": {}})["files"].items()
                                if f.startswith("plan/")}}
        damage = integrity.damaged_files(self._step_dir(step), plan_files)   # all plan files
        plan, why = self._checked_plan(step, self._checked_meta(step), damage)
        if why is not None:
            raise CheckpointError(f"checkpoint {self._where(step)}: the saved plan {why}")
        return plan

    def restore(self, like, *, step: int | None = None, train_step=None, args: Sequence = (),
                state_argnum: int = 0, plan: Plan | None = None, replan: bool | None = None,
                mesh=None, shardings=None, fallback: bool = False) -> Restored:
        """Check a saved step and read its state straight into the layouts it will run in.

        Args:
          like: the state's structure: a pytree of arrays or ``jax.ShapeDtypeStruct``s (e.g.
            ``jax.eval_shape(init, ...)``), matched against the saved paths, shapes and dtypes.
          step: which step (default the latest complete one).
          train_step: the ``@autoparallel`` step the state feeds; its mesh and options decide
            the layouts. ``args`` are the step's other arguments (arrays or ShapeDtypeStructs,
            a host-local batch as the step receives it); the state goes in at ``state_argnum``.
          plan: use this plan's layouts (on ``train_step``'s mesh, else ``mesh``) without
            solving; it must have been made for that mesh (axis names, sizes and order) and
            this state's shapes.
          replan: with ``train_step`` and no ``plan``: ``None`` reuses the saved plan where it
            is intact and fits the step's mesh and state, and plans again otherwise (``notes``
            says why); ``True`` always plans again; ``False`` takes the saved plan and refuses
            (with what differs) where it is missing, damaged or does not fit.
          shardings: a pytree like ``like`` of ``jax.sharding.Sharding`` (or one for every leaf)
            instead of a plan.
          fallback: when the step is damaged or incomplete, restore the newest older step that
            is intact instead (``Restored.step`` and ``notes`` say which) rather than raising.

        Returns:
          ``Restored`` (state, step counter, the plan used, whether it was re-planned, notes).

        Raises:
          CheckpointError: the step's files are damaged, missing or contradict each other (the
            message names the directory, step, file and arrays), and ``fallback`` is off or no
            older step is intact.
          AutoparError: ``like``, the plan or the layouts do not fit the saved state.
        """
        if replan not in (None, True, False):
            raise AutoparError(f"replan={replan!r} must be None (reuse the saved plan where it "
                               f"fits), True (always plan again) or False (only the saved plan)")
        validate.flag("fallback", fallback)
        first = self._pick(step)
        tried: list[str] = []
        for s in [first] + ([t for t in reversed(self.steps()) if t < first] if fallback else []):
            try:
                got = self._restore_step(s, like, train_step, tuple(args), state_argnum, plan,
                                         replan, mesh, shardings)
            except CheckpointError as e:
                if not fallback:
                    raise
                tried.append(str(e))
                continue
            if tried:
                note = (f"steps after {s} are damaged; restored step {s} instead:\n  "
                        + "\n  ".join(tried))
                warnings.warn(f"autopar.checkpoint: {note}", UserWarning, stacklevel=2)
                got = dataclasses.replace(got, notes=(note,) + got.notes)
            return got
        raise CheckpointError(f"no intact step in {self.directory} (fallback=True tried "
                              f"{len(tried)}):\n  " + "\n  ".join(tried) + "\nStart from a fresh "
                              "state, or restore a copy of the checkpoint")

    def _restore_step(self, step: int, like, train_step, args: tuple, argnum: int,
                      plan: Plan | None, replan: bool | None, mesh, shardings) -> Restored:
        """Check the step's index and metadata files, then read the state while its array
        chunks are checked in a background thread; the state is returned only if they match
        their record (a damaged read is discarded for the damage's error)."""
        record = self._record(step)
        plan_damage = {} if record is None else self._verify(step, record, bulk=False)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            chunks = None if record is None else pool.submit(
                integrity.damaged_files, self._step_dir(step), record,
                integrity.share([f for f in record["files"] if integrity.bulk(f)],
                                integrity.part()))
            got = self._restore_checked(step, like, train_step, args, argnum, plan, replan, mesh,
                                        shardings, plan_damage, record, chunks)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return got

    def _restore_checked(self, step, like, train_step, args, argnum, plan, replan, mesh,
                         shardings, plan_damage, record, chunks) -> Restored:
        meta = self._checked_meta(step)
        stepmeta.check_like(like, meta, self._where(step))
        needed = shardings is None and plan is None and train_step is not None
        saved, why = self._checked_plan(step, meta, plan_damage) if needed else (None, None)
        target, used, replanned, notes = layouts.targets(
            like, saved, why and f"it {why}", train_step, args, argnum, plan, replan, mesh,
            shardings, self._where(step))
        if record is None:
            notes += (f"step {step} was saved without checksums (checkpoint format "
                      f"{meta.get('format_version')}); its files were not verified",)
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(np.shape(x), stepmeta.dtype(x), sharding=s), like,
            target)
        try:
            state = self._read_state(step, abstract)
        except CheckpointError:
            if chunks is not None:    # a read that failed on damage says which file
                self._raise_damage(step, chunks.result(), record)
            raise
        if chunks is not None:
            self._raise_damage(step, chunks.result(), record)
        return Restored(state, int(meta["step"]), used, replanned, saved, meta, notes,
                        record is not None)

    def _raise_damage(self, step: int, bad: dict[str, str], record: dict) -> None:
        """Raise for the chunk files any process found damaged (a collective)."""
        bad = integrity.gathered(bad, [f for f in record["files"] if integrity.bulk(f)])
        if bad:
            raise CheckpointError(self._damage(step, bad))

    # ---- checks -----------------------------------------------------------------------------
    def _where(self, step: int) -> str:
        return f"{self.directory}, step {step}"

    def _step_dir(self, step: int) -> epath.Path:
        return epath.Path(self.directory) / str(step)

    def _record(self, step: int) -> dict | None:
        """The step's integrity record; None for a step saved before there were records."""
        step_dir = self._step_dir(step)
        try:
            return integrity.read_record(step_dir)
        except integrity.RecordProblem as e:
            if stepmeta.raw_version(step_dir) == 1:    # saved before checkpoints had records
                return None
            raise CheckpointError(
                f"checkpoint {self._where(step)}: {e}, so its files cannot be checked (a step "
                f"written by this autopar always has one: the record was deleted, or the step "
                f"was copied in part); {_FIX}") from None

    def _verify(self, step: int, record: dict, bulk: bool) -> dict[str, str]:
        """Check the recorded files that are (``bulk``) or are not array chunks, each process
        its share; returns the damaged files of the saved plan, raises for any other."""
        files = [f for f in record["files"] if integrity.bulk(f) == bulk]
        bad = integrity.gathered(integrity.damaged_files(
            self._step_dir(step), record, integrity.share(files, integrity.part())), files)
        plan_bad = {f: why for f, why in bad.items() if f.startswith("plan/")}
        other = {f: why for f, why in bad.items() if f not in plan_bad}
        if other:
            raise CheckpointError(self._damage(step, other))
        return plan_bad

    def _damage(self, step: int, bad: dict[str, str]) -> str:
        state = self._step_dir(step) / "state"
        held = integrity.arrays_in(state, [f[len("state/"):] for f in bad if
                                           f.startswith("state/")])
        names = stepmeta.user_paths(self._step_dir(step))
        lines = []
        for f, why in sorted(bad.items())[:_MAX_LINES]:
            arrays = None if held is None else {names.get(a, a) for a in
                                                held.get(f[len("state/"):], ())}
            lines.append(f"file {f} {why}; {integrity.describe(f, arrays)}")
        if len(bad) > _MAX_LINES:
            lines.append(f"and {len(bad) - _MAX_LINES} more files")
        return (f"checkpoint {self._where(step)} is damaged: " + "\n  ".join(lines) + f"\n{_FIX}")

    def _checked_meta(self, step: int) -> dict:
        """The step's metadata, checked: readable, of a known format, and its step counter the
        step directory's."""
        path = self._step_dir(step) / "meta" / "metadata"
        where = f"checkpoint {self._where(step)}: meta/metadata"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{where} is missing; {_FIX}") from None
        except (ValueError, UnicodeDecodeError, OSError) as e:
            raise CheckpointError(f"{where} is not readable JSON ({e}); {_FIX}") from None
        problem = stepmeta.problem(meta)
        if problem is not None:
            raise CheckpointError(f"{where} is damaged: {problem}; {_FIX}")
        if meta["format_version"] > FORMAT_VERSION:
            raise CheckpointError(f"{where} has format_version {meta['format_version']}; this "
                                  f"autopar reads up to {FORMAT_VERSION}: restore with the "
                                  f"autopar that saved it")
        if meta["step"] != step:
            raise CheckpointError(
                f"{where} says the state has seen {meta['step']} steps, but it is saved as step "
                f"{step}: the metadata was edited or copied from another step, and a resumed "
                f"run would skip or repeat steps; {_FIX}")
        return meta

    def _checked_plan(self, step: int, meta: dict, damage: dict[str, str]):
        """(saved plan, None), (None, None) when none was saved, or (None, why it is unusable):
        its files damaged, unreadable, or a plan of another state or mesh than the saved one."""
        if damage:
            f, why = min(damage.items(), key=lambda kv: (kv[0] != "plan/metadata", kv[0]))
            return None, f"is damaged: file {f} {why}"
        path = self._step_dir(step) / "plan" / "metadata"
        try:
            d = json.loads(path.read_text())["plan"]
        except FileNotFoundError:
            return None, "is missing (no plan/metadata)"
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, OSError) as e:
            return None, f"is unreadable (plan/metadata: {type(e).__name__}: {e})"
        if d is None:
            return None, None
        try:
            plan = Plan.from_json(json.dumps(d))
        except PlanError as e:
            return None, f"cannot be loaded: {e}"
        mismatch = stepmeta.plan_mismatch(plan, meta)
        if mismatch is not None:
            return None, f"does not describe the saved state: {mismatch}"
        return plan, None

    def _read_state(self, step: int, abstract):
        ocp = _orbax()
        try:
            got = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            raise CheckpointError(self._read_failure(step, e)) from None
        return got["state"]

    def _read_failure(self, step: int, e: Exception) -> str:
        """A failed orbax read as a message naming the step's files the error mentions."""
        text = str(e)
        root = str(self._step_dir(step))
        files = sorted({m for m in integrity.paths_in(text) if m.startswith(root)})
        named = ", ".join(os.path.relpath(f, root) for f in files[:3]) or "state/"
        return (f"checkpoint {self._where(step)}: reading the state from {named} failed "
                f"({type(e).__name__}: {text[:300]}); {_FIX}")

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


