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
    "hbm_depth.py": ("hbm_depth.md", "hbm_depth.csv"),
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

