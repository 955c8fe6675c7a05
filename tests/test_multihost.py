"""Multi-process runs on jax.distributed over localhost (gloo): 2 processes x 4 CPU devices match
one process with 8, survive a killed process by restarting on the devices left, and refuse to
run when processes disagree. Also: the cost model's device->node map and the elastic launcher.

Every multi-process run goes through ``autopar.launch`` with a fresh coordinator port, a
timeout per attempt, and every child stopped before it returns.
"""
from __future__ import annotations

import json
import os
import pathlib
import textwrap

import _multihost_worker as worker
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import autopar
import cost_models
from autopar import checkpoint, distributed
from autopar.launch import launch
from autopar.models import gpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = str(pathlib.Path(worker.__file__).resolve())
STEPS, SAVE_EVERY, KILL_AT = 4, 2, 3
# Parameters after several adamw steps on another device count: a gradient element near zero
# turns rounding differences into updates of up to lr (1e-3); 2% of lr, as in test_planner.
PARAM_ATOL = 2e-5


def _env() -> dict[str, str]:
    """The children import this checkout's autopar and skip the planner's debug checks."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "AUTOPAR_CHECKS": "0"}


# ---- the cost model knows which axes cross nodes ------------------------------------------
def test_explicit_device_nodes_decide_which_axes_cross_nodes():
    sizes = {"data": 2, "model": 4}
    row_major = cost_models.CostModel("h100", sizes)          # 8 devices fit one 8-GPU node
    assert not row_major.axis_spans_nodes("data") and not row_major.axis_spans_nodes("model")
    # Two 4-device hosts whose devices alternate along "model": model groups cross hosts.
    across = cost_models.CostModel("h100", sizes, device_nodes=[0, 1, 0, 1, 0, 1, 0, 1])
    assert across.axis_spans_nodes("model") and not across.axis_spans_nodes("data")
    assert across.axis_link("model") == across.hw.inter_node
    assert (across.collective_time_s("all-reduce", 2**20, "model")
            > row_major.collective_time_s("all-reduce", 2**20, "model"))
    # One host per row: only "data" crosses, whatever devices_per_node says.
    rows = cost_models.CostModel("h100", sizes, device_nodes=[0] * 4 + [1] * 4)
    assert rows.axis_spans_nodes("data") and not rows.axis_spans_nodes("model")
    with pytest.raises(cost_models.CostModelError, match="one node id per device"):
        cost_models.CostModel("h100", sizes, device_nodes=[0, 1])


def test_concrete_meshes_plan_with_the_process_map(monkeypatch):
    """plan_graph hands the mesh's device->node map to the cost model: with every device on its
    own node the same step is predicted slower than on one node (abstract meshes keep
    devices_per_node)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    assert distributed.device_nodes(mesh) == (0,) * 8          # one process: one node
    assert distributed.device_nodes({"data": 8}) is None
    cfg = gpt.GPTConfig(vocab=1024, seq=128, d_model=512, heads=8, d_ff=2048, layers=1)
    fn, state, batch = gpt.abstract(cfg, 64)        # big enough that splitting it pays
    kw = dict(mesh=mesh, hardware="h100", time_limit_s=0.5)
    one_node = autopar.plan(fn, state, batch, **kw)
    assert one_node.cost.comm_s > 0
    monkeypatch.setattr(distributed, "device_nodes", lambda m: tuple(range(8)))
    eight_nodes = autopar.plan(fn, state, batch, **kw)
    assert eight_nodes.cost.step_time_s > one_node.cost.step_time_s


# ---- the launcher --------------------------------------------------------------------------
FLAKY = textwrap.dedent("""
    import json, os, sys
    keys = ("JAX_COORDINATOR_ADDRESS", "AUTOPAR_NUM_PROCESSES", "AUTOPAR_PROCESS_ID",
            "AUTOPAR_RESTART", "AUTOPAR_NODE", "XLA_FLAGS")
    env = {k: os.environ.get(k) for k in keys}
    name = os.path.join(sys.argv[1], f"{env['AUTOPAR_RESTART']}.{env['AUTOPAR_PROCESS_ID']}")
    with open(name + ".part", "w") as f:       # the launcher may stop a process mid-write:
        json.dump(dict(env, pid=os.getpid()), f)
    os.replace(name + ".part", name)           # a record is whole or absent
    if env["AUTOPAR_RESTART"] == "0" and env["AUTOPAR_PROCESS_ID"] == "1":
        sys.exit(3)
    if sys.argv[2:] == ["hang"]:
        import time; time.sleep(120)
""")


def test_launcher_restarts_on_the_processes_left(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    result = launch([str(script), str(tmp_path)], num_processes=3, devices_per_process=2,
                    max_restarts=2, timeout_s=60)
    assert result.ok
    assert [a.num_processes for a in result.attempts] == [3, 2]
    assert result.attempts[0].failed == (1,) and result.attempts[0].exit_codes[1] == 3
    seen = {f.name: json.loads(f.read_text()) for f in tmp_path.iterdir()
            if f.suffix not in (".py", ".part")}
    assert {"0.1", "1.0", "1.1"} <= set(seen)    # attempt 0's others may be stopped unstarted
    assert seen["0.1"]["JAX_COORDINATOR_ADDRESS"] != seen["1.0"]["JAX_COORDINATOR_ADDRESS"]
    assert seen["1.1"]["AUTOPAR_NUM_PROCESSES"] == "2"
    assert len({seen[k]["AUTOPAR_NODE"] for k in ("1.0", "1.1")}) == 2
    assert seen["1.0"]["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")


def test_launcher_stops_a_hung_job_and_leaves_no_process(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(FLAKY)
    result = launch([str(script), str(tmp_path), "hang"], num_processes=1, max_restarts=3,
                    timeout_s=2)
    assert not result.ok and len(result.attempts) == 1 and result.attempts[0].timed_out
    pid = json.loads((tmp_path / "0.0").read_text())["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# ---- 2 processes x 4 devices, a kill, and a restart on 4 devices ---------------------------
@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run: one process, 8 devices, the workers' step and batches."""
    train_step, init = gpt.make_train_step(worker.CFG)
    state0 = init(jax.random.PRNGKey(0), worker.ROWS)
    step = worker.make_step(train_step)
    state, losses, states = state0, [], {}
    for i in range(STEPS):
        state, loss = step(state, gpt.make_batch(worker.CFG, worker.ROWS, seed=i))
        losses.append(float(loss))
        states[i + 1] = jax.tree.map(np.asarray, state)
    return state0, losses, states


def test_two_processes_match_one_and_restart_on_the_devices_left(tmp_path, reference):
    state0, losses, states = reference
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    with checkpoint.Checkpointer(ckpt) as c:
        c.save(0, state0)
    argv = [WORKER, "train", "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--kill-at", str(KILL_AT)]
    result = launch(argv, num_processes=2, devices_per_process=4, max_restarts=1,
                    timeout_s=240, log_dir=str(tmp_path / "logs"), env=_env())
    assert result.ok, _logs(tmp_path / "logs")
    assert [a.num_processes for a in result.attempts] == [2, 1]
    assert result.attempts[0].failed == (1,)          # process 1 was killed, 0 was stopped

    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    first = [r for r in rows if r["restart"] == 0]
    again = [r for r in rows if r["restart"] == 1]
    assert [r["step"] for r in first][:KILL_AT] == list(range(KILL_AT))
    assert all(r["processes"] == 2 and r["devices"] == 8 and r["sharded"] for r in first)
    last_saved = KILL_AT // SAVE_EVERY * SAVE_EVERY
    assert [r["step"] for r in again] == list(range(last_saved, STEPS))
    assert again[0]["restored"] == last_saved and again[0]["replanned"]
    assert (again[0]["saved_mesh"], again[0]["mesh"]) == ({"data": 8}, {"data": 4})
    assert again[0]["saved_processes"] == 2 and again[0]["devices"] == 4
    for r in rows:   # one trajectory: no step lost, none applied twice
        np.testing.assert_allclose(r["loss"], losses[r["step"]], rtol=1e-5, err_msg=str(r))

    final = np.load(out / "params.npz")
    want = {jax.tree_util.keystr(p): x
            for p, x in jax.tree_util.tree_leaves_with_path(states[STEPS]["params"])}
    assert set(final.files) == set(want)
    for k, x in want.items():
        np.testing.assert_allclose(final[k], x, rtol=1e-5, atol=PARAM_ATOL, err_msg=k)
    _check_two_process_checkpoint(ckpt, state0, states, last_saved)


def _check_two_process_checkpoint(ckpt, like, states, step):
    """The checkpoint the two processes wrote restores in this process onto 8 devices."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    with checkpoint.Checkpointer(ckpt) as c:
        r = c.restore(like, step=step, plan=c.saved_plan(step), mesh=mesh)
    assert r.meta["num_processes"] == 2 and r.step == step
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(r.state),
                                 jax.tree.leaves(states[step])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=PARAM_ATOL,
                                   err_msg=jax.tree_util.keystr(path))


def _logs(log_dir: pathlib.Path) -> str:
    """The tail of every child's log, for the assertion message."""
    if not log_dir.is_dir():
        return "no logs"
    return "\n".join(f"--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-25:])
                     for f in sorted(log_dir.iterdir()))


# ---- processes that disagree ------------------------------------------------------------------
def test_processes_that_trace_or_plan_differently_get_a_clear_error(tmp_path):
    result = launch([WORKER, "agree", "--out", str(tmp_path)], num_processes=2,
                    devices_per_process=4, max_restarts=0, timeout_s=180,
                    log_dir=str(tmp_path / "logs"), env=_env())
    assert result.ok, _logs(tmp_path / "logs")
    for p in (0, 1):
        got = json.loads((tmp_path / f"agree.{p}.json").read_text())
        assert got["nodes"] == [0, 1]        # the launcher gives each process its own node
        assert "the traced step differs across processes" in got["graph"]
        assert "same number of rows on every process" in got["graph"]
        assert "the plan differs across processes" in got["plan"]
        assert "plan=autopar.Plan.from_json" in got["plan"]
        assert got["global"] == [True, True, True]
    # tune= under jax.distributed: each process timed the candidates on its own devices, and
    # one candidate was skewed 0.5x on process 0 and 2x on process 1; the slowest process's
    # times decide (distributed.agreed_times), so both chose alike and hold the same rows.
    tuned = [json.loads((tmp_path / f"agree.{p}.json").read_text())["tuned"] for p in (0, 1)]
    assert tuned[0]["error"] is None and tuned[1]["error"] is None, tuned
    assert tuned[0]["skewed"] == tuned[1]["skewed"] and len(tuned[0]["skewed"]) == 1
    assert tuned[0]["rows"] == tuned[1]["rows"] and tuned[0]["strategy"] == tuned[1]["strategy"]
    timed = {name: s for name, s in tuned[0]["rows"] if s is not None}
    assert len(timed) >= 2 and tuned[0]["skewed"][0] in timed
    assert tuned[0]["strategy"] != tuned[0]["skewed"][0]     # process 1's doubled time counted


class _Spans:
    """A stand-in sharding whose devices hold the given first-dim row ranges."""

    def __init__(self, spans):
        self.spans = spans

    def addressable_devices_indices_map(self, shape):
        return {k: (slice(a, b),) for k, (a, b) in enumerate(self.spans)}


def test_host_local_rows_go_straight_in_only_when_contiguous():
    assert distributed._rows_of_process(_Spans([(6, 8), (4, 6), (4, 6)]), (8,)) == (4, 8)
    assert distributed._rows_of_process(_Spans([(0, 2), (6, 8)]), (8,)) is None
    with pytest.raises(autopar.AutoparError, match=r"argument 1\['n'\] is a scalar"):
        distributed._global_shape(np.float32(1), 2, 1, (jax.tree_util.DictKey("n"),))


def test_single_process_runs_need_no_set_up():
    """Without a coordinator, initialize() is a one-process job and the checks are no-ops."""
    info = distributed.initialize()
    assert (info.process_id, info.num_processes, info.process_nodes) == (0, 1, (0,))
    assert distributed.is_multiprocess() is False


# ---- an MPMD pipeline, each process issuing its own stage -----------------------------------
def test_each_process_drives_its_own_pipeline_stage(tmp_path):
    """2 processes x 4 devices, {stage: 2, data: 4}: each process issues its stage's programs,
    activations and cotangents cross between the processes as collective-permutes, the rest's
    gradients and the loss are summed over the stages by one program both run. 1F1B and ZB-H1
    give the unsharded step's loss, Adam moment and parameters."""
    from numerics import assert_params, assert_scaled

    from autopar.pipeline import model as PM

    result = launch([WORKER, "pipelined", "--out", str(tmp_path)], num_processes=2,
                    devices_per_process=4, max_restarts=0, timeout_s=240,
                    log_dir=str(tmp_path / "logs"), env=_env())
    assert result.ok, _logs(tmp_path / "logs")
    got = np.load(tmp_path / "pipelined.npz")
    step, init = PM.gpt_train_step(worker.PIPE_CFG, 1e-3)
    state, batch = init(jax.random.PRNGKey(0), 8), gpt.make_batch(worker.PIPE_CFG, 8)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    ref = {"params": ref_state["params"], "mu": ref_state["opt_state"][0].mu}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ref)]
    tree = jax.tree_util.tree_structure(ref)
    for name in worker.PIPE_SCHEDULES:
        np.testing.assert_allclose(float(got[f"{name}/loss"]), float(ref_loss), rtol=1e-6)
        mine = jax.tree_util.tree_unflatten(tree, [got[f"{name}/{p}"] for p in paths])
        assert_scaled(mine["mu"], ref["mu"], rel=1e-5)
        assert_params(mine["params"], ref["params"], 1e-3, grads=ref["mu"])
