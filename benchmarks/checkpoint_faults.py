"""Faults injected into ``autopar.checkpoint`` as an operator of a long run meets them: each one
either restores the state bit-exact (the step it says) or raises a clear ``AutoparError``, never
garbage and never a raw error from orbax or tensorstore.

A tiny GPT (adamw state) trains on a 2x4 mesh and saves steps 1 and 2 with their plan. Each
fault copies that pristine checkpoint, damages the copy deterministically (fixed files, chosen
by their role and size, and fixed byte offsets), restores, and classifies what happened:

* ``exact``: the state restored equals the saved step's bit for bit (and is the step expected);
* ``clear error``: an ``AutoparError`` whose message names the checkpoint directory, the step and
  (for damaged files) the file;
* ``silently wrong``, ``raw error``, ``unexpected``: failures of the checkpointing (counted, and
  ``tests/test_checkpoint_faults.py`` fails on any).

Kills during a save are simulated by leaving what a killed save leaves (orbax writes a step into
``<step>.orbax-checkpoint-tmp`` and renames it into place last), at several points of the write;
one fault kills a real saving process with SIGKILL inside the integrity callback, after every
file and the record are written and before the rename.

    python benchmarks/checkpoint_faults.py     # writes benchmarks/results/checkpoint_faults.md
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable

import _common
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import checkpoint
from autopar.models import gpt

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=1)
ROWS = 8
OUTCOMES = ("exact", "clear error", "silently wrong", "raw error", "unexpected")


# ---- the run whose checkpoint is damaged ---------------------------------------------------------
@dataclasses.dataclass
class Run:
    pristine: pathlib.Path        # steps 1 and 2, never damaged
    like: object
    batch: object
    want: dict                    # step -> host copy of the state
    mesh: Mesh
    step8: Callable               # the autoparallel step on the 2x4 mesh
    step4: Callable               # the same step on 4 devices
    train_step: Callable


def mesh_of(shape, names) -> Mesh:
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def prepare(work: pathlib.Path) -> Run:
    train_step, state, batch = gpt.concrete(CFG, ROWS)
    mesh = mesh_of((2, 4), ("data", "model"))
    step8 = autopar.autoparallel(train_step, mesh=mesh, hardware="h100", time_limit_s=1,
                                 donate_argnums=0, deterministic=True)
    step4 = autopar.autoparallel(train_step, mesh=mesh_of((4,), ("data",)), hardware="h100",
                                 time_limit_s=1, deterministic=True)
    pristine = work / "pristine"
    want = {}
    with checkpoint.Checkpointer(pristine, max_to_keep=None) as ckpt:
        for k in (1, 2):
            state, _ = step8(state, gpt.make_batch(CFG, ROWS, seed=k))
            want[k] = jax.tree.map(np.asarray, state)
            ckpt.save(k, state, plan=step8.plan)
    like = jax.eval_shape(lambda: want[1])
    return Run(pristine, like, batch, want, mesh, step8, step4, train_step)


# ---- damaging files ------------------------------------------------------------------------------
def flip(path: pathlib.Path, n: int, at: float = 0.5) -> None:
    """Invert ``n`` bytes from the fraction ``at`` of the file."""
    data = bytearray(path.read_bytes())
    start = max(0, min(len(data) - n, int(len(data) * at)))
    for i in range(start, min(len(data), start + n)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: pathlib.Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def remove(path: pathlib.Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def edit_json(path: pathlib.Path, edit: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def reseal(step_dir: pathlib.Path) -> None:
    """Write the integrity record again over the files as they are: a deliberate edit made
    consistent, which only the cross-checks behind the record can catch."""
    from etils import epath

    from autopar.checkpoint import integrity

    integrity.write_record(epath.Path(step_dir))


def data_files(step_dir: pathlib.Path, values: bool = True) -> list[pathlib.Path]:
    """process 0's OCDBT files that hold array chunks over 1 KiB (``values``), or else its own
    b-tree nodes (which orbax's merged index does not read), largest first."""
    from etils import epath

    from autopar.checkpoint import integrity

    d = step_dir / "state" / "ocdbt.process_0" / "d"
    rel = [f"ocdbt.process_0/d/{f.name}" for f in d.iterdir()]
    held = integrity.arrays_in(epath.Path(step_dir / "state"), rel)
    files = [step_dir / "state" / f for f in rel if bool(held[f]) == values]
    return sorted(files, key=lambda f: (-f.stat().st_size, f.name))


def index_node(step_dir: pathlib.Path) -> pathlib.Path:
    """The merged b-tree root of the state (``state/d/*``; it also holds small chunks)."""
    return sorted((step_dir / "state" / "d").iterdir())[0]


def killed_save(step_dir: pathlib.Path, keep: Callable[[pathlib.Path], None]) -> None:
    """What a save killed before its rename leaves: the step under orbax's temporary name,
    reduced by ``keep`` to what had been written, and no step directory."""
    tmp = step_dir.parent / (step_dir.name + ".orbax-checkpoint-tmp")
    step_dir.rename(tmp)
    keep(tmp)


def only(*names: str) -> Callable[[pathlib.Path], None]:
    def keep(tmp: pathlib.Path) -> None:
        for child in list(tmp.iterdir()):
            if child.name not in names:
                remove(child)
    return keep


# ---- restoring -----------------------------------------------------------------------------------
def by_shardings(run: Run, ckpt, **kw):
    return ckpt.restore(run.like, shardings=NamedSharding(run.mesh, P()), **kw)


def by_step(run: Run, ckpt, **kw):
    return ckpt.restore(run.like, train_step=run.step8, args=(run.batch,), **kw)


def by_step4(run: Run, ckpt, **kw):
    return ckpt.restore(run.like, train_step=run.step4, args=(run.batch,), **kw)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: ``damage(step 2's directory)``, then ``restore(run, checkpointer)``
    must restore step ``step`` exactly (``error`` None) or raise ``error`` with ``says`` in its
    message (and the directory, and "step 2" unless ``whole`` names every step)."""

    name: str
    damage: Callable[[pathlib.Path], None]
    restore: Callable = by_shardings
    step: int = 2
    error: type | None = None
    says: tuple[str, ...] = ()
    note: str = ""            # a fragment Restored.notes must hold
    replanned: bool | None = None


def _error(cls, *says):
    return {"error": cls, "says": says}


E = autopar.checkpoint.CheckpointError


def _flips(files: Callable, label: str) -> list[Fault]:
    out = []
    for n in (1, 8, 64):
        for at in (0.0, 0.5, 1.0):
            out.append(Fault(f"flip {n} B at {at:.0%} of {label}",
                             lambda d, n=n, at=at: flip(files(d), n, at),
                             **_error(E, "holds other bytes", "it holds arrays")))
    return out


def catalogue() -> list[Fault]:
    """Every fault, in a fixed order (the results table's)."""
    largest, smallest = (lambda d: data_files(d)[0]), (lambda d: data_files(d)[-1])
    own_node = (lambda d: data_files(d, values=False)[0])
    faults = _flips(largest, "the largest data file")
    faults += [
        Fault("flip 8 B in the smallest data file", lambda d: flip(smallest(d), 8),
              **_error(E, "holds other bytes", "it holds arrays")),
        Fault("flip 8 B in process 0's own b-tree node",
              lambda d: flip(own_node(d), 8), **_error(E, "holds other bytes", "index")),
        Fault("truncate the largest data file to half", lambda d: truncate(largest(d), 0.5),
              **_error(E, "truncated or extended", "it holds arrays")),
        Fault("truncate the largest data file to 0 bytes", lambda d: truncate(largest(d), 0.0),
              **_error(E, "truncated or extended")),
        Fault("delete the largest data file", lambda d: remove(largest(d)),
              **_error(E, "is missing")),
        Fault("flip 8 B in the b-tree root (index)", lambda d: flip(index_node(d), 8),
              **_error(E, "part of the state's index")),
        Fault("flip 1 B in the OCDBT manifest", lambda d: flip(d / "state/manifest.ocdbt", 1),
              **_error(E, "state/manifest.ocdbt", "index")),
        Fault("empty the OCDBT manifest", lambda d: truncate(d / "state/manifest.ocdbt", 0.0),
              **_error(E, "state/manifest.ocdbt")),
        Fault("flip 1 B in process 0's manifest",
              lambda d: flip(d / "state/ocdbt.process_0/manifest.ocdbt", 1),
              **_error(E, "ocdbt.process_0/manifest.ocdbt")),
        Fault("cut orbax's _METADATA in half", lambda d: truncate(d / "state/_METADATA", 0.5),
              **_error(E, "state/_METADATA")),
        Fault("flip 8 B in orbax's _sharding", lambda d: flip(d / "state/_sharding", 8),
              **_error(E, "state/_sharding")),
        Fault("flip 8 B in array_metadatas", lambda d: flip(
            d / "state/array_metadatas/process_0", 8), **_error(E, "array_metadatas")),
        Fault("delete the state item", lambda d: remove(d / "state"), **_error(E, "is missing")),
        Fault("cut autopar's meta JSON in half", lambda d: truncate(d / "meta/metadata", 0.5),
              **_error(E, "meta/metadata", "step counter")),
        Fault("delete autopar's meta", lambda d: remove(d / "meta"), **_error(E, "meta/metadata")),
        Fault("edit the step counter 2 -> 7",
              lambda d: edit_json(d / "meta/metadata", lambda m: m.update(step=7)),
              **_error(E, "meta/metadata", "holds other bytes")),
        Fault("edit the step counter 2 -> 7 and reseal",
              lambda d: (edit_json(d / "meta/metadata", lambda m: m.update(step=7)), reseal(d)),
              **_error(E, "says the state has seen 7 steps, but it is saved as step 2")),
        Fault("edit a saved shape and reseal", lambda d: (edit_json(
            d / "meta/metadata", lambda m: m["shapes"].__setitem__(1, [3])), reseal(d)),
            **_error(autopar.AutoparError, "`like` has shape/dtype")),
        Fault("delete the integrity record", lambda d: remove(d / checkpoint.RECORD),
              **_error(E, "has no integrity record")),
        Fault("flip 4 B in the integrity record", lambda d: flip(d / checkpoint.RECORD, 4, 0.3),
              **_error(E, "integrity record")),
        Fault("delete the integrity record, fallback=True", lambda d: remove(d / checkpoint.RECORD),
              restore=lambda r, c: by_shardings(r, c, fallback=True), step=1,
              note="restored step 1 instead"),
        Fault("flip 64 B in the largest data file, fallback=True",
              lambda d: flip(largest(d), 64),
              restore=lambda r, c: by_shardings(r, c, fallback=True), step=1,
              note="restored step 1 instead"),
        Fault("both steps damaged, fallback=True",
              lambda d: (flip(largest(d), 8), flip(largest(d.parent / "1"), 8)),
              restore=lambda r, c: by_shardings(r, c, fallback=True),
              **_error(E, "no intact step", "step 2", "step 1")),
    ]
    faults += _plan_faults() + _kill_faults()
    return faults


def _plan_faults() -> list[Fault]:
    def cut_plan(d):
        truncate(d / "plan/metadata", 0.5)

    def bad_axis(d):
        edit_json(d / "plan/metadata", lambda p: p["plan"]["input_shardings"].__setitem__(
            0, [["zz"]] + [[]] * (len(p["plan"]["input_shapes"][0]) - 1)))
        reseal(d)

    def other_version(d):
        edit_json(d / "plan/metadata", lambda p: p["plan"].update(format_version=1))
        reseal(d)

    def moved_layout(d):    # a valid layout edit (a whole input split over 'data', or a split
        def edit(p):        # one made whole): only the record can tell
            layouts, shapes = p["plan"]["input_shardings"], p["plan"]["input_shapes"]
            k = next(k for k, s in enumerate(shapes) if s and s[0] % 2 == 0)
            layouts[k] = [[] for _ in shapes[k]] if any(layouts[k]) else (
                [["data"]] + [[] for _ in shapes[k][1:]])
        edit_json(d / "plan/metadata", edit)

    return [
        Fault("cut the plan JSON in half (default replan)", cut_plan, restore=by_step,
              note="saved plan was not used", replanned=True),
        Fault("cut the plan JSON in half, replan=False", cut_plan,
              restore=lambda r, c: by_step(r, c, replan=False),
              **_error(autopar.AutoparError, "replan=False", "plan/metadata")),
        Fault("cut the plan JSON in half, shardings=", cut_plan),
        Fault("delete plan/ (default replan)", lambda d: remove(d / "plan"), restore=by_step,
              note="saved plan was not used", replanned=True),
        Fault("delete plan/, replan=False", lambda d: remove(d / "plan"),
              restore=lambda r, c: by_step(r, c, replan=False),
              **_error(autopar.AutoparError, "replan=False", "is missing")),
        Fault("plan names an unknown axis, resealed", bad_axis, restore=by_step,
              note="names mesh axis 'zz'", replanned=True),
        Fault("plan of another format version, resealed", other_version, restore=by_step,
              note="format_version 1", replanned=True),
        Fault("plan layout edited but valid", moved_layout, restore=by_step,
              note="is damaged: file plan/metadata", replanned=True),
        Fault("intact plan: restore on the same mesh", lambda d: None, restore=by_step,
              replanned=False),
        Fault("restore onto 4 devices (re-plans)", lambda d: None, restore=by_step4,
              note="axis names differ", replanned=True),
        Fault("restore onto 4 devices, replan=False", lambda d: None,
              restore=lambda r, c: by_step4(r, c, replan=False),
              **_error(autopar.PlanError, "axis names differ", "(data=2, model=4)")),
        Fault("plan= for another axis order", lambda d: None,
              restore=lambda r, c: c.restore(r.like, plan=c.saved_plan(2),
                                             mesh=mesh_of((4, 2), ("model", "data"))),
              **_error(autopar.ShardingError, "axis order differs")),
        Fault("plan= for another mesh onto 4 devices", lambda d: None,
              restore=lambda r, c: by_step4(r, c, plan=c.saved_plan(2)),
              **_error(autopar.PlanError, "plan= does not fit", "axis names differ")),
    ]


def _kill_faults() -> list[Fault]:
    def unrenamed(*names):
        return lambda d: killed_save(d, only(*names))

    kw = dict(step=1, note="")
    return [
        Fault("killed before any file was written", unrenamed(), **kw),
        Fault("killed after orbax's step metadata", unrenamed("_CHECKPOINT_METADATA"), **kw),
        Fault("killed with the state half written", unrenamed("_CHECKPOINT_METADATA", "state"),
              **kw),
        Fault("killed after every item, before the record",
              unrenamed("_CHECKPOINT_METADATA", "state", "meta", "plan"), **kw),
        Fault("killed after the record, before the rename",
              unrenamed("_CHECKPOINT_METADATA", "state", "meta", "plan", checkpoint.RECORD),
              **kw),
    ]


# ---- one fault -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Outcome:
    name: str
    outcome: str          # one of OUTCOMES
    detail: str
    seconds: float


def run_fault(fault: Fault, run: Run, work: pathlib.Path, index: int = 0) -> Outcome:
    d = work / f"fault{index}"
    shutil.copytree(run.pristine, d)
    fault.damage(d / "2")
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = checkpoint.Checkpointer(d, max_to_keep=None)
            try:
                got = fault.restore(run, ckpt)
            finally:
                ckpt.close()
    except Exception as e:  # noqa: BLE001 - every kind is classified
        return Outcome(fault.name, *_judge_error(fault, e, d), time.perf_counter() - t0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return Outcome(fault.name, *_judge_state(fault, run, got), time.perf_counter() - t0)


def _judge_error(fault: Fault, e: Exception, d: pathlib.Path) -> tuple[str, str]:
    text = f"{type(e).__name__}: {e}"
    if not isinstance(e, autopar.AutoparError):
        return "raw error", text
    if fault.error is None or not isinstance(e, fault.error):
        return "unexpected", text
    must = list(fault.says) + [str(d)] + (["step 2"] if "no intact step" not in str(e) else [])
    missing = [m for m in must if m not in str(e)]
    return ("clear error", text) if not missing else ("unexpected", f"lacks {missing}: {text}")


def _judge_state(fault: Fault, run: Run, got) -> tuple[str, str]:
    want = run.want[got.step] if got.step in run.want else None
    same = want is not None and all(_bits(a) == _bits(b) for a, b in
                                    zip(jax.tree.leaves(got.state), jax.tree.leaves(want)))
    detail = f"step {got.step}, replanned={got.replanned}, notes={list(got.notes)}"
    if not same:
        return "silently wrong", detail
    if fault.error is not None or got.step != fault.step:
        return "unexpected", "restored where an error was expected: " + detail
    if fault.note and not any(fault.note in n for n in got.notes):
        return "unexpected", f"no note {fault.note!r}: {detail}"
    if fault.replanned is not None and got.replanned != fault.replanned:
        return "unexpected", detail
    return "exact", detail


def _bits(x) -> tuple:
    x = np.asarray(x)
    return x.shape, str(x.dtype), x.tobytes()


# ---- a real kill ---------------------------------------------------------------------------------
KILLED_SAVER = textwrap.dedent("""
    import os, signal, sys
    import jax, numpy as np
    from autopar import checkpoint
    from autopar.checkpoint import integrity
    state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(8, np.int32)}
    with checkpoint.Checkpointer(sys.argv[1], max_to_keep=None) as ckpt:
        ckpt.save(1, state, wait=True)
        write = integrity.write_record
        def die(step_dir):
            write(step_dir)
            os.kill(os.getpid(), signal.SIGKILL)   # after the record, before orbax's rename
        integrity.write_record = die
        ckpt.save(2, {k: v * 2 for k, v in state.items()})
        ckpt.wait()
    print("not killed")
""")


def real_kill(work: pathlib.Path) -> Outcome:
    """SIGKILL a saving process after the step's files and record, before the rename."""
    d = work / "killed"
    t0 = time.perf_counter()
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVER, str(d)], env=env,
                          capture_output=True, text=True, timeout=120)
    name = "SIGKILL in a real save, after the record, before the rename"
    if proc.returncode != -9:
        return Outcome(name, "unexpected", f"exit {proc.returncode}: {proc.stderr[-500:]}",
                       time.perf_counter() - t0)
    with checkpoint.Checkpointer(d, max_to_keep=None) as ckpt:
        steps = ckpt.steps()
        r = ckpt.restore({"w": np.zeros((64, 64), np.float32), "b": np.zeros(8, np.int32)},
                         shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    exact = (steps == [1] and r.step == 1 and np.array_equal(
        np.asarray(r.state["w"]), np.arange(4096, dtype=np.float32).reshape(64, 64)))
    left = sorted(p.name for p in d.iterdir())
    return Outcome(name, "exact" if exact else "silently wrong",
                   f"steps {steps}, directory holds {left}", time.perf_counter() - t0)


# ---- report --------------------------------------------------------------------------------------
def run_all(work: pathlib.Path, faults: list[Fault] | None = None) -> list[Outcome]:
    run = prepare(work)
    outcomes = [run_fault(f, run, work, k) for k, f in enumerate(faults or catalogue())]
    return outcomes + [real_kill(work)]


def main(argv=None):
    args = _common.parser(__doc__).parse_args(argv)
    out = _common.out_dir(args)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-faults-") as work:
        faults = catalogue()[:6] if args.quick else None
        outcomes = run_all(pathlib.Path(work), faults)
    counts = {k: sum(o.outcome == k for o in outcomes) for k in OUTCOMES}
    rows = [(o.name, o.outcome, f"{o.seconds:.2f}", _short(o.detail, work)) for o in outcomes]
    text = [
        "# Checkpoint fault injection",
        "",
        "`benchmarks/checkpoint_faults.py` (the same faults as `tests/test_checkpoint_faults.py`):",
        "a tiny GPT (adamw) on a 2x4 mesh saves steps 1 and 2 with its plan; each fault damages",
        "a copy of step 2 (or simulates a save killed before orbax's rename) and restores.",
        "`exact`: restored bit for bit (the step named); `clear error`: an `AutoparError` naming",
        "the directory, the step and the file. Anything else is a failure.",
        "",
        f"**{len(outcomes)} faults: " + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES) + "**",
        "",
        _common.md_table(("fault", "outcome", "seconds", "what happened"), rows),
        "",
        f"Wall time {time.perf_counter() - t0:.0f} s. Environment: {_common.environment()}.",
        "",
        "Reproduce: `python benchmarks/checkpoint_faults.py`.",
        "",
    ]
    (out / "checkpoint_faults.md").write_text("\n".join(text))
    print("\n".join(text[8:9]))
    return outcomes


def _short(text: str, work: str) -> str:
    """One table cell: the scratch directory written WORK, pipes and brackets escaped (an
    argument path like ``['opt_state'][0]`` would otherwise read as a markdown reference link)."""
    text = " ".join(text.replace(work, "WORK").split())
    text = text if len(text) <= 220 else text[:217] + "..."
    for c in "|[]":
        text = text.replace(c, "\\" + c)
    return text


if __name__ == "__main__":
    main()
