"""No plan autopar emits makes XLA replicate a tensor to reshard it.

XLA's SPMD partitioner logs "Involuntary full rematerialization" (on stderr, from C++) when it
cannot move a value between two layouts directly and replicates it instead: a transition the
planner priced as a cheap collective would then cost a full gather and the memory of the whole
tensor. ``autopar.planner.reshard`` plans only transitions XLA performs directly, and codegen
stages the others through intermediate layouts; this test compiles the plans of every
hand-written strategy and auto on the test meshes, captures XLA's log at the file-descriptor
level, and fails on that warning. A positive control proves the capture sees it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.models import gpt, moe

WARNING = "Involuntary full rematerialization"
CFG = gpt.GPTConfig(vocab=128, seq=16, d_model=64, heads=4, d_ff=128, layers=2)
MESHES = {"1x8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model")),
          "4x2": ((4, 2), ("data", "model")), "2x2x2": ((2, 2, 2), ("data", "model", "expert"))}


@contextlib.contextmanager
def xla_log():
    """Everything written to file descriptor 2 (XLA's C++ logging) inside the block."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace"))


def _mesh(name: str) -> jax.sharding.Mesh:
    shape, axes = MESHES[name]
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), axes)


def test_the_capture_sees_the_warning():
    """Positive control: a transition XLA cannot do directly on 2x4 (a first dim split over
    `model` moved to a second dim split over `data`) logs the warning, and the capture has it."""
    mesh = _mesh("2x4")
    f = jax.jit(lambda y: y * 1.0, in_shardings=NamedSharding(mesh, P("model")),
                out_shardings=NamedSharding(mesh, P(None, "data")))
    with xla_log() as log:
        f.lower(jax.ShapeDtypeStruct((16, 16, 16), jnp.float32)).compile()
    assert WARNING in log[0]


def _compile_log(model, mesh_name: str, strategy: str) -> str:
    step, state, batch = model
    run = autopar.autoparallel(step, mesh=_mesh(mesh_name), hardware="h100", strategy=strategy,
                               time_limit_s=1)
    with xla_log() as log:
        run.lower(state, batch).compile()
    return log[0]


# Every hand-written family and auto on 2x4, the transposed 4x2 and 3-D meshes for the plans
# with most transitions, a scanned body and expert parallelism (about 20 s of CPU each).
CASES = ([("gpt", "2x4", s) for s in ("dp", "zero3", "megatron", "fsdp_tp", "auto")]
         + [("gpt", "4x2", s) for s in ("megatron_sp", "auto")]
         + [("gpt", "2x2x2", "auto"), ("gpt_scan", "2x4", "zero3"), ("moe", "2x2x2", "ep")])


@pytest.fixture(scope="module")
def models():
    return {"gpt": gpt.abstract(CFG, 8),
            "gpt_scan": gpt.abstract(dataclasses.replace(CFG, scan=True), 8),
            "moe": moe.abstract(moe.MoEConfig(), 8)}


@pytest.mark.parametrize("model, mesh_name, strategy", CASES,
                         ids=[f"{a}-{b}-{c}" for a, b, c in CASES])
def test_plan_compiles_without_involuntary_rematerialization(models, model, mesh_name, strategy):
    log = _compile_log(models[model], mesh_name, strategy)
    assert WARNING not in log, "\n".join(ln for ln in log.splitlines() if WARNING in ln)[:2000]
