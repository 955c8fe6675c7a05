"""One process of the multi-process tests, started by ``autopar.launch`` (see test_multihost.py).

``train``: an elastic GPT training loop. It plans for the devices it finds, restores the latest
checkpoint (the test saves step 0; a restart finds a later one), re-planning when the mesh
changed, and trains to ``--steps``, saving every ``--save-every`` steps. Each process feeds its
own rows of every batch. On the first attempt process 1 kills itself (SIGKILL) before step
``--kill-at``. Process 0 appends one JSON line per step to ``--out``/losses.jsonl and writes the
final parameters to ``--out``/params.npz.

``agree``: processes that trace different steps, or hold different plans, get an AutoparError
from the plan check; each writes what it got to ``--out``/agree.<process>.json. Then a tuned
step (``tune=``) times its candidates for real, each process's times skewed the other way for
one candidate, and records the plan it chose and its timed rows.

``pipelined``: each process drives its own stage of an MPMD pipeline (``pipelined``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import jax
import numpy as np

import autopar
from autopar import checkpoint, distributed
from autopar.api import _place
from autopar.models import gpt

T0 = time.time()
CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=2, d_ff=64, layers=1)
ROWS = 8                     # global batch rows, split evenly over the processes


def make_step(train_step, **kw):
    n = jax.device_count()
    solve = {} if "plan" in kw else dict(hardware="cpu", time_limit_s=0.3)  # a plan is not solved
    return autopar.autoparallel(train_step, mesh={"data": n}, host_local_argnums=(1,), **solve,
                                **kw)


def local_rows(batch: dict) -> dict:
    """This process's rows of a global batch: process 0 holds the first block."""
    k, n = jax.process_index(), jax.process_count()
    per = ROWS // n
    return {name: np.asarray(x)[k * per:(k + 1) * per] for name, x in batch.items()}


def host_params(state) -> dict:
    """Every parameter as a whole numpy array on every process."""
    from jax.experimental import multihost_utils

    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    whole = multihost_utils.process_allgather(flat, tiled=True)
    return {k: np.asarray(v) for k, v in whole.items()}


def train(a) -> None:
    info = distributed.initialize(timeout_s=60)
    train_step, init = gpt.make_train_step(CFG)
    step = make_step(train_step, strategy="zero3")    # parameters split across processes
    like = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), ROWS))
    ckpt = checkpoint.Checkpointer(a.ckpt, max_to_keep=None)
    first = local_rows(gpt.make_batch(CFG, ROWS, seed=0))
    r = ckpt.restore(like, train_step=step, args=(first,))
    state, start = r.state, r.step
    log = {"restart": info.restart, "processes": info.num_processes,
           "devices": jax.device_count(), "restored": r.step, "replanned": r.replanned,
           "saved_mesh": r.meta["mesh"], "mesh": dict(r.plan.mesh),
           "saved_processes": r.meta["num_processes"], "t_restored": time.time() - T0}
    for i in range(start, a.steps):
        if info.restart == 0 and info.process_id == 1 and i == a.kill_at:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        state, loss = step(state, local_rows(gpt.make_batch(CFG, ROWS, seed=i)))
        _log(a.out, dict(log, step=i, loss=float(loss), sharded=_sharded(state),
                         t=time.time() - T0))
        if (i + 1) % a.save_every == 0:
            ckpt.save(i + 1, state, plan=step.plan)
    ckpt.close()
    params = host_params(state["params"])
    if info.process_id == 0:
        np.savez(os.path.join(a.out, "params.npz"), **params)


def _sharded(state) -> bool:
    """Whether some parameter is split across processes (no process holds all of it)."""
    return any(not x.is_fully_addressable and not x.is_fully_replicated
               for x in jax.tree.leaves(state["params"]))


def _log(out: str, row: dict) -> None:
    if jax.process_index() == 0:
        with open(os.path.join(out, "losses.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def agree(a) -> None:
    info = distributed.initialize(timeout_s=60)
    train_step, state, _ = gpt.concrete(CFG, ROWS)     # the checks come before any placement
    batch = gpt.make_batch(CFG, ROWS)
    got = {"nodes": list(info.process_nodes)}
    rows = local_rows(batch)
    if info.process_id == 1:      # one process traces another batch size
        rows = {k: v[:-1] for k, v in rows.items()}
    got["graph"] = _error_of(lambda: make_step(train_step)(state, rows))
    strategy = "dp" if info.process_id == 0 else "zero3"    # two different plans
    plan = autopar.plan(train_step, state, batch, mesh={"data": 8}, hardware="cpu",
                        strategy=strategy, time_limit_s=0.3)
    got["plan"] = _error_of(lambda: make_step(train_step, plan=plan)(state, local_rows(batch)))
    got["global"] = _global_arrays(batch)
    got["tuned"] = _tuned(train_step, state, batch)
    with open(os.path.join(a.out, f"agree.{info.process_id}.json"), "w") as f:
        json.dump(got, f)


PIPE_CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=4, scan=True)
PIPE_SCHEDULES = ("1f1b", "zb_h1")


def pipelined(a) -> None:
    """An MPMD pipeline over {stage: 2, data: 4}, process p's devices being stage p: each
    process issues its own stage's programs, the hops between them are collectives. One step
    under each of ``PIPE_SCHEDULES``; process 0 writes the loss, parameters and Adam's first
    moment to ``--out``/pipelined.npz."""
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from autopar.pipeline import model as PM
    from autopar.pipeline import mpmd
    from autopar.pipeline import schedules as S

    distributed.initialize(timeout_s=60)
    step, init = PM.gpt_train_step(PIPE_CFG, 1e-3)
    state = jax.tree_util.tree_map(np.asarray, init(jax.random.PRNGKey(0), 8))
    batch = jax.tree_util.tree_map(np.asarray, gpt.make_batch(PIPE_CFG, 8))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "data"))
    out = {}
    for name in PIPE_SCHEDULES:
        run = mpmd.build_step(PM.staged_model_of(step), mesh, S.build(name, 2, 1, 2))
        new, loss = run(state, batch)
        whole = multihost_utils.process_allgather(
            {"params": new["params"], "mu": new["opt_state"][0].mu}, tiled=True)
        out[f"{name}/loss"] = np.asarray(loss.addressable_data(0))
        for path, x in jax.tree_util.tree_leaves_with_path(whole):
            out[f"{name}/{jax.tree_util.keystr(path)}"] = np.asarray(x)
    if jax.process_index() == 0:
        np.savez(os.path.join(a.out, "pipelined.npz"), **out)


def _tuned(train_step, state, batch) -> dict:
    """A tuned step on the global batch: every candidate timed for real, then the last one's
    time halved on process 0 and doubled on process 1, so each process alone would choose
    differently. What it chose and its timed rows (the same on every process if the times were
    agreed before choosing)."""
    from autopar import tune

    real = tune.interleaved
    skewed = []

    def timer(runs, rounds):
        medians = real(runs, rounds)
        skewed.append(list(medians)[-1])
        medians[skewed[-1]] *= 0.5 if jax.process_index() == 0 else 2.0
        return medians

    tune.interleaved = timer
    tune.STARTS = ("dp", "zero3")    # two strategies: the agreement is the same for nine, and
    #                                  each one more is a plan and a compile in both processes
    step = autopar.autoparallel(train_step, mesh={"data": jax.device_count()}, hardware="cpu",
                                time_limit_s=0.3, tune=10)      # every plan within 11x: timed
    error = _error_of(lambda: step(state, batch))
    plan = step.plan if error is None else None
    return {"error": error, "skewed": skewed,
            "strategy": plan and plan.strategy,
            "rows": plan and [[r.strategy, r.measured_s] for r in plan.tuned]}


def _error_of(fn) -> str | None:
    try:
        fn()
    except autopar.AutoparError as e:
        return str(e)
    return None


def _global_arrays(batch) -> list[bool]:
    """Host-local rows placed as global arrays in a process-split and a replicated layout, and a
    committed local array placed like the state, hold the global batch."""
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))
    want = np.asarray(batch["tokens"])
    out = []
    for spec in (PartitionSpec("data"), PartitionSpec()):
        g = distributed.to_global(local_rows(batch)["tokens"], NamedSharding(mesh, spec))
        whole = multihost_utils.process_allgather(g, tiled=True)
        out.append(bool(np.array_equal(np.asarray(whole), want)))
    # A whole array committed to one local device, placed the way the step places its state.
    committed = jax.device_put(batch["tokens"], jax.local_devices()[0])
    g = _place(committed, NamedSharding(mesh, PartitionSpec("data")))
    out.append(bool(np.array_equal(np.asarray(multihost_utils.process_allgather(g, tiled=True)),
                                   want)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("train", "agree", "pipelined"))
    p.add_argument("--ckpt")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=3)
    a = p.parse_args()
    {"train": train, "agree": agree, "pipelined": pipelined}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
