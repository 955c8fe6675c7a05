"""Helpers shared by the benchmark scripts: environment, argument parsing, result files.

Import this module before jax: it asks XLA for 8 emulated CPU devices (unless XLA_FLAGS already
sets a count), so every script sees the same 8 devices on a laptop or in CI.
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
from collections.abc import Sequence  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help="one small configuration (seconds)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="directory for the result files (default benchmarks/results)")
    return p


def out_dir(args) -> pathlib.Path:
    d = args.out if args.out is not None else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_md(args, name: str, text: str) -> None:
    """Writes a report ``name`` into the output directory (``out_dir``) and prints it."""
    (out_dir(args) / name).write_text(text)
    print(text)


def write_csv(path: pathlib.Path, header: Sequence[str], rows: Sequence[Sequence]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow([_csv_cell(x) for x in r])


def _csv_cell(x) -> str:
    if isinstance(x, float):
        return "-" if x != x else f"{x:.7g}"
    return str(x)


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(x) for x in r) + " |")
    return "\n".join(lines)


def _cell(x) -> str:
    if isinstance(x, float):
        if x != x:  # nan
            return "-"
        if x == 0:
            return "0"
        if abs(x) >= 1000 or abs(x) < 0.01:
            return f"{x:.4g}"
        return f"{x:.3f}"
    return str(x)


def git_commit() -> str:
    """The commit the benchmark ran on (``+dirty`` when the tree had uncommitted changes)."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        # results files a run rewrites do not make the code it ran dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)benchmarks/results"],
                               cwd=root, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def machine_load() -> str:
    """Load averages over 1, 5 and 15 minutes against the host's cores."""
    if not hasattr(os, "getloadavg"):
        return "load unknown"
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"


def environment() -> str:
    """One line for every results file: commit, machine load, software and devices, date."""
    import jax

    return (f"commit {git_commit()}, {machine_load()}, jax {jax.__version__}, "
            f"{len(jax.devices())} x {jax.devices()[0].platform} devices, "
            f"python {platform.python_version()}, {datetime.date.today().isoformat()}")


def mesh_str(mesh: dict) -> str:
    return "x".join(f"{k}{v}" for k, v in mesh.items())


def auto_losses(rows: Sequence[dict], key, time_field: str):
    """(group key, auto row, best hand-written row) for every group of ``rows`` (by ``key(row)``)
    where auto is predicted more than 0.1% slower than the best hand-written strategy. Rows whose
    time is NaN (failed plans) take no part."""
    out = []
    for k in dict.fromkeys(key(r) for r in rows):
        group = [r for r in rows if key(r) == k and r[time_field] == r[time_field]]
        auto = next((r for r in group if r["strategy"] == "auto"), None)
        hand = [r for r in group if r["strategy"] != "auto"]
        best = min(hand, key=lambda r: r[time_field]) if hand else None
        if auto and best and auto[time_field] > best[time_field] * 1.001:
            out.append((k, auto, best))
    return out
