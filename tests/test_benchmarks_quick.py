"""Each benchmark script's ``--quick`` mode runs and writes result files with rows.

Results go to a temporary directory (``--out``) so the committed ones are never overwritten.
"""
from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

CASES = {
    "plan_time.py": ("plan_time.md", "plan_time.csv"),
    "handwritten_vs_auto.py": ("handwritten_vs_auto.md", "handwritten_vs_auto.csv",
                               "handwritten_vs_auto_plans.csv", "handwritten_vs_auto.png"),
    "cpu_measured.py": ("cpu_measured.md", "cpu_measured.csv", "cpu_measured.png"),
    "time_limit.py": ("time_limit.md", "time_limit.csv"),
    "checkpoint.py": ("checkpoint.md", "checkpoint.csv"),
    "verify_matrix.py": ("verify_matrix.md", "verify_matrix.csv"),
    "pipeline_cpu.py": ("pipeline_cpu.md", "pipeline_cpu.csv"),
    "pipeline_fsdp.py": ("pipeline_fsdp.md", "pipeline_fsdp.csv"),
    "pipeline_mpmd.py": ("pipeline_mpmd.md", "pipeline_mpmd.csv"),
    "pipeline_zero_bubble.py": ("pipeline_zero_bubble.md", "pipeline_zero_bubble.csv"),
    "hbm_depth.py": ("hbm_depth.md", "hbm_depth.csv"),
    "zoo.py": ("zoo.md", "zoo.csv"),
    "recompute.py": ("recompute.md",),
    "nnx_call.py": ("nnx_call.md", "nnx_call.csv"),
    "call_overhead.py": ("call_overhead.md",),
    "megatron_table.py": ("megatron_table.md", "megatron_table.csv"),
    "mesh_choice.py": ("mesh_choice.md", "mesh_choice.csv"),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_quick(script, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out", str(tmp_path)],
                          cwd=BENCH.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in CASES[script]:
        f = tmp_path / name
        assert f.exists() and f.stat().st_size > 0, f"{script} did not write {name}"
        if name.endswith(".csv"):
            with open(f) as fh:
                rows = list(csv.reader(fh))
            assert len(rows) >= 2, f"{name} has no data rows"
            assert all(len(r) == len(rows[0]) for r in rows)
        if name.endswith(".md"):
            assert "|" in f.read_text(), f"{name} has no table"
    if script == "plan_time.py":
        with open(tmp_path / "plan_time.csv") as fh:
            row = next(csv.DictReader(fh))
        assert not row["status"].startswith("error") and float(row["total_s"]) > 0, row
        # the whole plan call holds its build and solve, and then the Plan's assembly
        assert float(row["plan_s"]) >= float(row["build_s"]) + float(row["solve_s"]), row
    if script == "megatron_table.py":     # the 39.1B row: both sides planned at the paper's mesh
        with open(tmp_path / "megatron_table.csv") as fh:
            row = next(csv.DictReader(fh))
        hand, auto = float(row["megatron_3d TFLOP/s"]), float(row["auto TFLOP/s"])
        assert row["row"] == "39.1B" and 0 < hand <= auto * 1.001, row


def test_pipeline_cpu_pads_a_chunk_as_the_runtime_does(monkeypatch):
    """``pipeline_cpu``'s padded action (what it times against ``planning.padded_slot_s``)
    computes what the unpadded chunk computes: the same forward, input cotangent and
    gradient of the real layer, and zeros in the padded slots' accumulators."""
    import jax
    import numpy as np

    monkeypatch.syspath_prepend(str(BENCH))
    import pipeline_cpu as B

    from autopar.models import gpt
    from autopar.pipeline import model as PM

    cfg = gpt.GPTConfig(vocab=64, seq=8, d_model=16, heads=2, d_ff=32, layers=4, scan=True)
    step, init = PM.gpt_train_step(cfg)
    model = PM.staged_model_of(step)
    params = init(jax.random.PRNGKey(0), 4)["params"]
    micro = jax.tree_util.tree_map(lambda a: a[:2], gpt.make_batch(cfg, 4))
    ranges = ((0, 3), (3, 4))
    plain = B._action_calls(model, params, micro, ranges)
    padded = B._padded_calls(model, params, micro, ranges)
    assert set(padded) == {("Fpad", False, True, 1), ("Bpad", False, True, 1)}

    def run(calls, key):
        fn, args = calls[key]
        return fn(*args)

    for x, y in zip(jax.tree.leaves(run(plain, ("F", False, True, 1))),
                    jax.tree.leaves(run(padded, ("Fpad", False, True, 1)))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    dp, dr, dh = run(plain, ("B", False, True, 1))
    acc, dr2, dh2 = run(padded, ("Bpad", False, True, 1))
    for g, a in zip(jax.tree.leaves(dp), jax.tree.leaves(acc)):
        assert a.shape == (1, 3, *g.shape[1:])
        np.testing.assert_allclose(a[0, :1], g, rtol=1e-5, atol=1e-6)
        assert not np.asarray(a[0, 1:]).any()
    np.testing.assert_allclose(dh, dh2, rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(dr), jax.tree.leaves(dr2)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
