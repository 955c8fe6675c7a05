"""Faults injected into a checkpoint (``benchmarks/checkpoint_faults.py`` holds the catalogue):
bit flips, truncations and deletions of data, index and metadata files, edited step counters,
damaged or missing plans, restores onto another mesh, saves killed before their rename (one a
real SIGKILL). Each restores the state bit-exact, as the step it says, or raises a clear
``AutoparError`` naming the checkpoint, the step and the file: never garbage, never a raw error.
"""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import checkpoint_faults as cf  # noqa: E402

FAULTS = cf.catalogue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return cf.prepare(tmp_path_factory.mktemp("faults"))


def test_the_catalogue_has_forty_faults_or_more():
    assert len(FAULTS) + 1 >= 40 and len({f.name for f in FAULTS}) == len(FAULTS)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_restores_exactly_or_fails_clearly(fault, run, tmp_path):
    got = cf.run_fault(fault, run, tmp_path)
    assert got.outcome == ("clear error" if fault.error else "exact"), got.detail


def test_a_save_killed_before_its_rename_leaves_the_last_step(tmp_path):
    got = cf.real_kill(tmp_path)
    assert got.outcome == "exact", got.detail
