"""autopar.checkpoint on one process: sharded asynchronous saves with the plan beside the state,
restores straight into the layouts of the saved plan, a given plan, or a new plan for fewer
devices, and clear errors for what does not fit."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar import checkpoint
from autopar.models import gpt
from autopar.sharding import to_spec

CFG = gpt.GPTConfig(vocab=64, seq=8, d_model=32, heads=4, d_ff=64, layers=1)
ROWS = 8
# Parameters after an adamw step on another mesh: see test_planner.PARAM_ATOL.
PARAM_ATOL = 1e-5


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_tree_close(got, want, **tol):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), b, err_msg=jax.tree_util.keystr(path), **tol)


def assert_in_plan_layouts(state, plan, mesh):
    """Every leaf of ``state`` lies in the layout ``plan`` gives it on ``mesh``."""
    specs = dict(zip(plan.input_paths, plan.input_shardings))
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        want = NamedSharding(mesh, to_spec(specs["[0]" + jax.tree_util.keystr(path)]))
        assert x.sharding.is_equivalent_to(want, x.ndim), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A ZeRO-3 step on 8 devices (state split 8 ways; the step donates it), saved
    asynchronously, then one more step that donates the saved arrays while the files are still
    being written."""
    directory = tmp_path_factory.mktemp("ckpt")
    train_step, state0, batch = gpt.concrete(CFG, ROWS)
    mesh = mesh_of((8,), ("data",))
    step = autopar.autoparallel(train_step, mesh=mesh, hardware="h100", time_limit_s=1,
                                strategy="zero3", donate_argnums=0)
    state1, _ = step(state0, batch)
    want1 = host(state1)
    ckpt = checkpoint.Checkpointer(directory, max_to_keep=None)
    ckpt.save(1, state1, plan=step.plan)                       # returns before the write ends
    batch2 = gpt.make_batch(CFG, ROWS, seed=1)
    state2, loss2 = step(state1, batch2)                       # donates state1's buffers
    ckpt.wait()
    like = jax.eval_shape(lambda: state0)
    return dict(ckpt=ckpt, dir=directory, train_step=train_step, step=step, mesh=mesh,
                like=like, want1=want1, batch=batch, batch2=batch2, loss2=float(loss2),
                want2=host(state2))


def test_saved_files_hold_state_plan_and_step_counter(saved):
    ckpt, step = saved["ckpt"], saved["step"]
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1
    assert sorted(p.name for p in (saved["dir"] / "1").iterdir() if p.is_dir()) == [
        "meta", "plan", "state"]
    meta = ckpt.meta()
    assert (meta["step"], meta["num_processes"], meta["num_devices"]) == (1, 1, 8)
    assert meta["mesh"] == {"data": 8}
    assert ckpt.saved_plan(1).to_json() == step.plan.to_json()
    split = [p for p, s in zip(step.plan.input_paths, step.plan.input_shardings) if any(s)]
    assert any(p.startswith("[0]['params']") for p in split), "each device wrote its piece"


def test_restore_on_the_same_mesh_takes_the_saved_plan(saved):
    again = autopar.autoparallel(saved["train_step"], mesh=saved["mesh"], hardware="h100",
                                 time_limit_s=1, strategy="zero3", donate_argnums=0)
    r = checkpoint.restore(saved["dir"], saved["like"], train_step=again, args=(saved["batch"],))
    assert (r.step, r.replanned) == (1, False)
    assert r.plan.to_json() == saved["step"].plan.to_json()
    # What was saved, although the next step donated those buffers during the write.
    assert_tree_close(r.state, saved["want1"], rtol=0, atol=0)
    assert_in_plan_layouts(r.state, r.plan, saved["mesh"])
    state2, loss2 = again(r.state, saved["batch2"])
    np.testing.assert_allclose(float(loss2), saved["loss2"], rtol=1e-6)


def test_restore_on_fewer_devices_replans_and_continues_the_run(saved):
    mesh4 = mesh_of((4,), ("data",))
    step4 = autopar.autoparallel(saved["train_step"], mesh=mesh4, hardware="h100",
                                 time_limit_s=1)
    r = saved["ckpt"].restore(saved["like"], train_step=step4, args=(saved["batch"],))
    assert r.replanned and r.plan.mesh_shape == {"data": 4}
    assert r.saved_plan.mesh_shape == {"data": 8}
    assert_tree_close(r.state, saved["want1"], rtol=0, atol=0)
    assert_in_plan_layouts(r.state, r.plan, mesh4)
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(r.state))
    state2, loss2 = step4(r.state, saved["batch2"])
    np.testing.assert_allclose(float(loss2), saved["loss2"], rtol=1e-5)
    assert_tree_close(state2["params"], saved["want2"]["params"], rtol=1e-5, atol=PARAM_ATOL)


def test_restore_with_a_given_plan_or_shardings(saved):
    ckpt, plan, mesh = saved["ckpt"], saved["step"].plan, saved["mesh"]
    r = ckpt.restore(saved["like"], plan=plan, mesh=mesh)
    assert r.plan is plan and not r.replanned
    assert_in_plan_layouts(r.state, plan, mesh)
    replicated = NamedSharding(mesh_of((2,), ("x",)), P())
    r = ckpt.restore(saved["like"], shardings=replicated)
    assert all(x.sharding == replicated for x in jax.tree.leaves(r.state))
    assert_tree_close(r.state, saved["want1"], rtol=0, atol=0)


def test_step_counter_must_increase_and_old_steps_go(tmp_path):
    state = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    with checkpoint.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, jax.tree.map(lambda x, s=step: x * s, state))
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        with pytest.raises(autopar.AutoparError, match="not after the latest saved step 3"):
            ckpt.save(3, state)
        with pytest.raises(autopar.AutoparError, match="integer >= 0"):
            ckpt.save(-1, state)
        r = ckpt.restore(state, step=2, shardings=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))
        np.testing.assert_array_equal(r.state["w"], state["w"] * 2)
        assert r.saved_plan is None and r.meta["mesh"] is None
        with pytest.raises(autopar.AutoparError, match=r"step 1 is not saved .* \[2, 3\]"):
            ckpt.restore(state, step=1, shardings=r.state["w"].sharding)


def test_mismatched_state_and_missing_layouts_are_clear_errors(saved, tmp_path):
    ckpt, like = saved["ckpt"], saved["like"]
    wider = gpt.abstract(gpt.GPTConfig(vocab=64, seq=8, d_model=48, heads=4, d_ff=64, layers=1),
                         ROWS)[1]
    with pytest.raises(autopar.AutoparError, match=r"`like` has shape/dtype \(\(48,\)"):
        ckpt.restore(wider, shardings=NamedSharding(saved["mesh"], P()))
    with pytest.raises(autopar.AutoparError, match="saved but not in `like`"):
        ckpt.restore({"params": like["params"]}, shardings=NamedSharding(saved["mesh"], P()))
    with pytest.raises(autopar.AutoparError, match="pass train_step="):
        ckpt.restore(like)
    with pytest.raises(autopar.AutoparError, match="no complete checkpoint"):
        checkpoint.Checkpointer(tmp_path / "empty").restore(like)


def test_a_step_saved_before_checkpoints_had_checksums_restores_unverified(tmp_path):
    """Format 1 (no integrity record, no state_argnum): read, and said to be unverified."""
    import json

    state = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    (tmp_path / "1" / checkpoint.RECORD).unlink()
    meta = tmp_path / "1" / "meta" / "metadata"
    old = json.loads(meta.read_text())
    old.pop("state_argnum")
    meta.write_text(json.dumps({**old, "format_version": 1}))
    r = checkpoint.Checkpointer(tmp_path).restore(
        state, shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    np.testing.assert_array_equal(r.state["w"], state["w"])
    assert not r.verified and "were not verified" in r.notes[-1]


def test_a_failed_write_is_a_checkpoint_error_and_commits_nothing(tmp_path, monkeypatch):
    from autopar.checkpoint import integrity

    state = {"w": np.ones((4, 4), np.float32)}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, wait=True)

        def full(step_dir):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(integrity, "write_record", full)
        ckpt.save(2, state)
        with pytest.raises(autopar.AutoparError, match=r"step 2: saving failed .*No space left.*"
                                                       r"latest complete step is still 1"):
            ckpt.wait()
        assert ckpt.steps() == [1]


def test_the_block_checksum_notices_every_flipped_byte_and_swapped_words():
    from autopar.checkpoint import integrity

    data = bytes(range(256)) * 4 + b"tail"        # 1028 bytes: a partial last word
    weights = integrity._weights(len(data))
    base = integrity._sum64(memoryview(data), weights)
    for i in range(len(data)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[i] ^= flip
            assert integrity._sum64(memoryview(damaged), weights) != base, (i, flip)
    swapped = data[8:16] + data[:8] + data[16:]
    assert integrity._sum64(memoryview(swapped), weights) != base
    assert integrity._sum64(memoryview(data[:-1]), weights) != base   # sizes are recorded too
