"""``benchmarks/gpu_kernels.py --quick --interpret`` runs on the CPU and writes a results table
in which every implementation ran (the GPU figures themselves need a GPU)."""
from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _run_interpret(script: str, tmp_path) -> list[dict]:
    """``benchmarks/<script>.py --quick --interpret`` into ``tmp_path``: its CSV rows."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), "--quick", "--interpret", "--out",
         str(tmp_path)], cwd=BENCH.parent, env=dict(os.environ), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / f"{script}_interpret.csv") as fh:
        return list(csv.DictReader(fh))


def test_gpu_kernel_benchmark_runs_in_interpret_mode(tmp_path):
    rows = _run_interpret("gpu_kernels", tmp_path)
    assert {r["kernel"] for r in rows} == {"attention", "norm", "xent", "adamw"}
    assert {r["impl"] for r in rows} == {"pallas", "xla"}
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in rows), rows
    text = (tmp_path / "gpu_kernels_interpret.md").read_text()
    assert "jax " in text and "Device: cpu" in text and "| attention |" in text


def test_gpu_step_benchmark_runs_in_interpret_mode(tmp_path):
    """``benchmarks/gpu_step.py --quick --interpret``: the GPT step without, with all, and with
    the chosen kernels, each timed and set against the plan's prediction."""
    rows = {r["kernels"]: r for r in _run_interpret("gpu_step", tmp_path)}
    assert set(rows) == {"never", "always", "auto"}
    assert all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in rows.values()), rows
    assert rows["never"]["kernels used"] == "none"
    assert all(k in rows["always"]["kernels used"] for k in ("attention", "norm", "xent", "adamw"))
