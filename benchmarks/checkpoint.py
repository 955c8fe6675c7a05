"""Checkpoint save and restore time and size for GPT training states, and re-planning time.

For each GPT configuration that fits this machine, the training state (parameters and adamw
moments, float32) is laid out by a ZeRO-3 plan over 8 CPU devices (every array split 8 ways) and
saved with ``autopar.checkpoint`` (orbax, asynchronous, OCDBT). Then it is restored

* onto the same 8 devices with the saved plan (``restore(train_step=...)``: traces the step to
  check the plan fits it, solves nothing), and as a bare read given the plan;
* onto 4 devices after a new auto plan for them (the elastic-restart path): the re-plan time and
  the read into the new layouts are reported separately.

With two processes (``autopar.launch``, 2 processes x 4 devices, gloo) the same state is saved
and restored across processes, and this process reads that checkpoint onto 4 devices.

Last, re-planning a big model when a node is lost is timed on abstract inputs: GPT-1.3B and
GPT-6.7B (``nn.scan``) planned for 64 H100s (data 8 x model 8) and again for the 56 left.

Times are medians over ``--repeats`` runs, wall clock on this 2-core machine (shared; the load
is stamped in the results). Writes ``benchmarks/results/checkpoint.md`` and ``checkpoint.csv``.

    python benchmarks/checkpoint.py            # full (a few minutes)
    python benchmarks/checkpoint.py --quick    # one tiny configuration, one process
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import Mesh

import autopar
from autopar import checkpoint, distributed
from autopar.checkpoint import integrity
from autopar.models import gpt

ROWS = 8                 # global batch rows
HEADER = ("config", "processes", "params_M", "state_MB", "disk_MB", "save_return_s",
          "save_total_s", "write_MB_s", "restore_saved_plan_s", "restore_read_s",
          "replan_4dev_s", "restore_4dev_s", "read_MB_s", "record_s", "orbax_save_s",
          "record_pct", "save_extra_pct", "verify_s", "orbax_read_s", "verify_pct",
          "read_extra_pct")
REPLAN_HEADER = ("model", "from", "to", "plan_from_s", "status_from", "replan_s", "status", "gap",
                 "predicted step ms (from)", "predicted step ms (to)")


def configs(quick: bool) -> list[tuple[str, gpt.GPTConfig]]:
    tiny = ("GPT-tiny", gpt.GPTConfig(vocab=256, seq=32, d_model=64, heads=4, d_ff=256, layers=2))
    if quick:
        return [tiny]
    return [tiny,
            ("GPT-5M", gpt.GPTConfig(vocab=8192, seq=128, d_model=256, heads=4, d_ff=1024,
                                     layers=4)),
            ("GPT-59M", gpt.GPTConfig(vocab=32768, seq=256, d_model=512, heads=8, d_ff=2048,
                                      layers=8))]


# ---- one process -------------------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
    train_step: object
    like: object
    batch: object
    step8: object           # the ZeRO-3 step on all devices, its plan made
    state: object


def setup(cfg: gpt.GPTConfig, devices) -> Setup:
    train_step, init = gpt.make_train_step(cfg)
    like = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), ROWS))
    batch = jax.eval_shape(lambda: gpt.make_batch(cfg, ROWS))
    mesh = Mesh(np.array(devices), ("data",))
    step8 = autopar.autoparallel(train_step, mesh=mesh, hardware="cpu", strategy="zero3",
                                 time_limit_s=2)
    layouts = step8.input_shardings(like, batch)[0]
    state = jax.jit(lambda k: _trained_like(init(k, ROWS), k), out_shardings=layouts)(
        jax.random.PRNGKey(0))
    return Setup(train_step, like, batch, step8, jax.block_until_ready(state))


def _trained_like(state, key):
    """Random values in every float array: fresh Adam moments are zeros, which compress to
    nothing on disk; a state in mid-training does not."""
    def noise(k, x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return jax.random.normal(k, x.shape, x.dtype) * 0.02 if floating else x

    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [noise(k, x) for k, x in zip(keys, leaves)])


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(getattr(out, "state", out))
    return time.perf_counter() - t0, out


def save_once(s: Setup, directory: str) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    ckpt = checkpoint.Checkpointer(directory)
    t0 = time.perf_counter()
    ckpt.save(1, s.state, plan=s.step8.plan)
    returned = time.perf_counter() - t0
    ckpt.wait()
    total = time.perf_counter() - t0
    ckpt.close()
    step_dir = epath.Path(directory) / "1"
    t_record, _ = timed(lambda: integrity.record_of(step_dir))   # what the save's callback did
    return {"save_return_s": returned, "save_total_s": total, "record_s": t_record,
            "disk_MB": _disk_bytes(os.path.join(directory, "1")) / 1e6}


def restore_same(s: Setup, directory: str) -> dict:
    """Onto the same devices through a fresh step (saved plan, checked by a trace), and the
    time of checking every file against the integrity record on its own."""
    fresh = autopar.autoparallel(s.train_step, mesh=s.step8.mesh, hardware="cpu",
                                 strategy="zero3", time_limit_s=2)
    with checkpoint.Checkpointer(directory) as ckpt:
        t_plan, r = timed(lambda: ckpt.restore(s.like, train_step=fresh, args=(s.batch,)))
        assert not r.replanned
    del r
    step_dir = epath.Path(directory) / "1"
    record = integrity.read_record(step_dir)
    t_verify, _ = timed(lambda: integrity.damaged_files(
        step_dir, record, integrity.share(record["files"], integrity.part())))
    return {"restore_saved_plan_s": t_plan, "verify_s": t_verify}


# ---- the same save and read through orbax alone (the baseline of the integrity's cost) ----------
def _orbax_handlers():
    import orbax.checkpoint as ocp

    return {"state": ocp.StandardCheckpointHandler(), "plan": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()}


def orbax_save(s: Setup, plain: str) -> dict:
    """The same items (state, plan JSON, a small metadata item) saved by orbax alone, with no
    integrity record; until the files are committed."""
    import orbax.checkpoint as ocp

    shutil.rmtree(plain, ignore_errors=True)
    mgr = ocp.CheckpointManager(plain, options=ocp.CheckpointManagerOptions(create=True),
                                item_handlers=_orbax_handlers())
    t0 = time.perf_counter()
    mgr.save(1, args=ocp.args.Composite(
        state=ocp.args.StandardSave(s.state), meta=ocp.args.JsonSave({"step": 1}),
        plan=ocp.args.JsonSave({"plan": json.loads(s.step8.plan.to_json())})))
    mgr.wait_until_finished()
    t_save = time.perf_counter() - t0
    mgr.close()
    shutil.rmtree(plain, ignore_errors=True)
    return {"orbax_save_s": t_save}


def bare_reads(s: Setup, directory: str, autopar_first: bool) -> dict:
    """The state read into the saved plan's layouts by autopar (its checks included) and by
    orbax alone, back to back from the same files, each through a fresh checkpointer."""
    import orbax.checkpoint as ocp

    layouts = s.step8.input_shardings(s.like, s.batch)[0]
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            s.like, layouts)

    def by_autopar():
        with checkpoint.Checkpointer(directory) as ckpt:
            return ckpt.restore(s.like, plan=s.step8.plan, mesh=s.step8.mesh).state

    def by_orbax():
        mgr = ocp.CheckpointManager(directory, item_handlers={"state": _orbax_handlers()["state"]})
        try:
            return mgr.restore(1, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        finally:
            mgr.close()

    order = [("restore_read_s", by_autopar), ("orbax_read_s", by_orbax)]
    return {name: timed(fn)[0] for name, fn in (order if autopar_first else order[::-1])}


def restore_4(s: Setup, directory: str, devices) -> dict:
    """Onto 4 devices: a new auto plan for them, then the read into its layouts (checked
    against the saved arrays when this process holds them)."""
    mesh4 = Mesh(np.array(devices[:4]), ("data",))
    step4 = autopar.autoparallel(s.train_step, mesh=mesh4, hardware="cpu", time_limit_s=2)
    t_plan, _ = timed(lambda: step4.input_shardings(s.like, s.batch))
    with checkpoint.Checkpointer(directory) as ckpt:
        t_read, r = timed(lambda: ckpt.restore(s.like, plan=step4.plan, mesh=mesh4))
    if s.state is not None:
        _check_equal(r.state, s.state)
    return {"replan_4dev_s": t_plan, "restore_4dev_s": t_read}


def _check_equal(got, want) -> None:
    """The restored arrays hold what was saved (gathered to this host)."""
    if jax.process_count() > 1:
        return
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError("a restored array differs from the saved one")


def _disk_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def _state_bytes(like) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(like))


def _params(like) -> int:
    return sum(x.size for x in jax.tree.leaves(like["params"]))


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def measure(label: str, cfg: gpt.GPTConfig, repeats: int, work: str, four: bool = True) -> dict:
    devices = jax.devices()
    s = setup(cfg, devices)
    # One untimed round first: the first save and read of a new tree compile and allocate
    # (2 s on GPT-59M), which would land on whichever of autopar and orbax came first.
    warm = os.path.join(work, f"{label}.{jax.process_count()}.warm")
    save_once(s, warm)
    orbax_save(s, warm + ".orbax")
    bare_reads(s, warm, True)
    shutil.rmtree(warm, ignore_errors=True)
    runs = []
    for k in range(repeats):
        d = os.path.join(work, f"{label}.{jax.process_count()}.{k}")
        first = k % 2 == 0     # autopar's save and read first in even runs, orbax's in odd
        run = save_once(s, d) if first else orbax_save(s, d + ".orbax")
        run.update(orbax_save(s, d + ".orbax") if first else save_once(s, d))
        run.update(restore_same(s, d))
        run.update(bare_reads(s, d, first))
        if four and jax.process_count() == 1:
            run.update(restore_4(s, d, devices))
        runs.append(run)
    out = median_of(runs)
    out.update(config=label, processes=jax.process_count(), params_M=_params(s.like) / 1e6,
               state_MB=_state_bytes(s.like) / 1e6)
    return out


def finish_row(m: dict) -> tuple:
    m.setdefault("replan_4dev_s", float("nan"))
    m.setdefault("restore_4dev_s", float("nan"))
    m["write_MB_s"] = m["state_MB"] / m["save_total_s"]
    # What autopar's save and read take beyond orbax's own (the record, the checks).
    m["save_extra_pct"] = 100 * (m["save_total_s"] / m["orbax_save_s"] - 1)
    m["read_extra_pct"] = 100 * (m["restore_read_s"] / m["orbax_read_s"] - 1)
    # The integrity work itself against orbax's save and read (an upper bound for the read,
    # whose chunk check overlaps orbax's).
    m["record_pct"] = 100 * m["record_s"] / m["orbax_save_s"]
    m["verify_pct"] = 100 * m["verify_s"] / m["orbax_read_s"]
    read = m["restore_4dev_s"] if m["restore_4dev_s"] == m["restore_4dev_s"] else m[
        "restore_read_s"]
    m["read_MB_s"] = m["state_MB"] / read
    return tuple(m[h] for h in HEADER)


# ---- two processes ----------------------------------------------------------------------------
def worker(argv) -> None:
    """One of the two processes: measure, and process 0 writes the medians as JSON."""
    distributed.initialize(timeout_s=120)
    label, repeats, work, out = argv[0], int(argv[1]), argv[2], argv[3]
    cfg = dict(configs(False))[label]
    m = measure(label, cfg, repeats, work, four=False)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(m, f)


def two_processes(label: str, repeats: int, work: str) -> dict | None:
    from autopar.launch import launch

    out = os.path.join(work, f"{label}.json")
    env = {"PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    result = launch([__file__, "--worker", label, str(repeats), work, out], num_processes=2,
                    devices_per_process=4, max_restarts=0, timeout_s=600, env=env,
                    log_dir=os.path.join(work, "logs"))
    if not result.ok:
        print(f"  two processes, {label}: failed {result.attempts}", flush=True)
        return None
    with open(out) as f:
        m = json.load(f)
    m.update(cross_read(label, work))
    return m


def cross_read(label: str, work: str) -> dict:
    """This process reads the two-process checkpoint onto 4 devices after a re-plan."""
    cfg = dict(configs(False))[label]
    train_step, init = gpt.make_train_step(cfg)
    s = Setup(train_step, jax.eval_shape(lambda: init(jax.random.PRNGKey(0), ROWS)),
              jax.eval_shape(lambda: gpt.make_batch(cfg, ROWS)), None, None)
    return restore_4(s, os.path.join(work, f"{label}.2.0"), jax.devices())


# ---- re-planning a big model after losing a node -----------------------------------------------
def replan_rows(quick: bool) -> list[tuple]:
    if quick:
        return []
    rows = []
    for name in ("1.3B", "6.7B"):
        cfg = dataclasses.replace(gpt.GPT_CONFIGS[name], scan=True)
        fn, state, batch = gpt.abstract(cfg, 224)        # 224 rows split 8 or 7 ways
        before, t_before = _plan(fn, state, batch, {"data": 8, "model": 8})
        after, t_after = _plan(fn, state, batch, {"data": 7, "model": 8})
        rows.append((f"GPT-{name} scan", "64 H100 (data8 x model8)", "56 H100 (data7 x model8)",
                     t_before, _status(before), t_after, _status(after),
                     getattr(after, "solver", None) and after.solver.gap,
                     _step_ms(before), _step_ms(after)))
        print("  " + "  ".join(_common._cell(x) for x in rows[-1]), flush=True)
    return rows


def _plan(fn, state, batch, mesh):
    """(the plan, or the PlanError's first clause when no plan fits; seconds)."""
    t0 = time.perf_counter()
    try:
        p = autopar.plan(fn, state, batch, mesh=mesh, hardware="h100", time_limit_s=10)
    except autopar.PlanError as e:
        least = re.search(r"smallest peak found for any plan is ([\d.]+ GiB)", str(e))
        p = "no plan within 80 GiB" + (f", least found {least.group(1)}" if least else "")
    return p, time.perf_counter() - t0


def _status(p) -> str:
    return p.solver.status if isinstance(p, autopar.Plan) else f"none ({p})"


def _step_ms(p) -> float:
    return p.cost.step_time_s * 1e3 if isinstance(p, autopar.Plan) else float("nan")


# ---- report -------------------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = _common.parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    out = _common.out_dir(args)
    repeats = 1 if args.quick else args.repeats
    work = tempfile.mkdtemp(prefix="autopar-ckpt-bench-")
    t_all = time.perf_counter()
    try:
        rows = _checkpoint_rows(configs(args.quick), repeats, work, not args.quick)
        replans = replan_rows(args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _write(out, rows, replans, repeats, time.perf_counter() - t_all)
    return rows, replans


def _checkpoint_rows(cfgs, repeats: int, work: str, with_two: bool) -> list[tuple]:
    rows = []
    for label, cfg in cfgs:
        rows.append(finish_row(measure(label, cfg, repeats, work)))
        print("  " + "  ".join(_common._cell(x) for x in rows[-1]), flush=True)
        two = two_processes(label, repeats, work) if with_two else None
        if two is not None:
            rows.append(finish_row(two))
            print("  " + "  ".join(_common._cell(x) for x in rows[-1]), flush=True)
    return rows


def _write(out: pathlib.Path, rows, replans, repeats: int, elapsed: float) -> None:
    _common.write_csv(out / "checkpoint.csv", HEADER, rows)
    text = [
        "# Checkpoint save/restore and re-planning",
        "",
        "`autopar.checkpoint` (orbax 0.12, asynchronous, OCDBT) on the training state of GPT",
        "models (parameters + adamw moments, float32), laid out by a ZeRO-3 plan over 8 CPU",
        "devices (one process), or 2 processes x 4 devices on `jax.distributed` (gloo; rows",
        "with processes = 2). `save_return_s`: until `save()` returns (the arrays are copied",
        "off the devices; training may go on); `save_total_s`: until the files are committed.",
        "`restore_saved_plan_s`: `restore(train_step=...)` onto the same mesh, taking the saved",
        "plan (it traces the step to check the plan fits it; nothing is solved);",
        "`restore_read_s`: the bare read given the plan (`restore(plan=..., mesh=...)` through a",
        "fresh `Checkpointer`). `replan_4dev_s`: a new auto plan for 4",
        "devices (trace + solve); `restore_4dev_s`: reading the checkpoint into that plan's",
        "layouts (for processes = 2: this one process reading the two-process checkpoint).",
        "`read_MB_s` is state bytes over the 4-device read (else the same-mesh read).",
        "Integrity: each save records every file's size and block checksums (in orbax's",
        "background thread, before the step is renamed into place), and each restore checks them",
        "(index and metadata first, the array chunks while orbax reads them).",
        "`record_s`: computing the record (timed again on the saved step); `verify_s`: checking",
        "every file (this process's share); `orbax_save_s` / `orbax_read_s`: the same save and",
        "the same read of the state into the same layouts through orbax alone, no record and no",
        "checks; `save_extra_pct` / `read_extra_pct`: `save_total_s` / `restore_read_s` over",
        "them, minus 1 (end to end, so within the shared machine's noise, which can make them",
        "negative); `record_pct` / `verify_pct`: `record_s` / `verify_s` over them, the",
        "integrity work itself (for the read an upper bound: the chunk check overlaps orbax's",
        "read). Medians of " + str(repeats) + " runs, each doing autopar's and",
        "orbax's save, then their reads, back to back (autopar's first in even runs, orbax's in",
        "odd ones), after one untimed round, all in one run of the script. The disk is the",
        "machine's local disk.",
        "",
        _common.md_table(HEADER, rows),
        "",
    ]
    if replans:
        text += [
            "## Re-planning after losing a node (abstract, H100 profile)",
            "",
            "`autopar.plan` on abstract inputs (no memory), `time_limit_s=10`, the models of",
            "`gpt.GPT_CONFIGS` (sequence 1024, bfloat16 compute) with `scan=True`, global batch",
            "224 sequences (divisible by 8 and by 7 data shards). `plan_from_s`: planning for 64",
            "GPUs; `replan_s`: planning again for the 56 left after one 8-GPU node fails (what",
            "an elastic restart pays before it restores).",
            "",
            _common.md_table(REPLAN_HEADER, replans),
            "",
        ]
        _common.write_csv(out / "checkpoint_replan.csv", REPLAN_HEADER, replans)
    text += [f"Wall time {elapsed:.0f} s. Environment: {_common.environment()}.", "",
             "Reproduce: `python benchmarks/checkpoint.py` (`--quick` for one tiny row).", ""]
    (out / "checkpoint.md").write_text("\n".join(text))
    print(f"wrote {out / 'checkpoint.md'}")


if __name__ == "__main__":
    main()
