"""Per-stage busy time and bubble of a pipelined step, measured from a jax.profiler trace."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from autopar.errors import AutoparError
from autopar.pipeline import measured as MP
from autopar.pipeline import model as PM
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S


def test_union_counts_overlaps_once():
    assert MP.union_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)
    assert MP.union_s([]) == 0.0


def test_summarise_follows_the_planner_definition():
    """Two devices, one run: busy is the union of action ops only (the tick's own op and the
    inner op of a forward overlapping it are not double counted), the loop spans first to last
    loop op, and bubble = 1 - sum busy / sum loop."""
    ops = MP.LoopOps("m", frozenset({"tick", "f1", "f2", "b1"}),
                     {"forward": frozenset({"f1", "f2"}), "backward": frozenset({"b1"})})
    ev = [MP.OpEvent(0, 7, "tick", 0.0, 1.0), MP.OpEvent(0, 7, "f1", 1.0, 4.0),
          MP.OpEvent(0, 7, "f2", 3.0, 5.0), MP.OpEvent(0, 7, "tick", 9.0, 10.0),
          MP.OpEvent(1, 7, "b1", 2.0, 8.0), MP.OpEvent(1, 7, "tick", 8.0, 10.0),
          MP.OpEvent(1, 7, "outside", 11.0, 30.0)]
    m = MP.summarise(ev, ops, {0: 0, 1: 1})
    assert m.loop_s == (10.0, 8.0) and m.busy_s == (4.0, 6.0)
    assert m.forward_s == (4.0, 0.0) and m.backward_s == (0.0, 6.0)
    assert m.bubble_fraction == pytest.approx(1 - 10 / 18)
    assert m.stage_bubble(0) == pytest.approx(0.6)
    with pytest.raises(AutoparError, match="every stage"):
        MP.summarise(ev, ops, {0: 0, 1: 1, 2: 2})


def _traced_python_marker():
    return sum(range(3))


def test_traces_record_no_python_calls(tmp_path):
    """The measurement's traces leave the Python controller untraced: recording its calls slows
    an MPMD step's issuing loop, which the bubble would then measure (module docstring)."""
    from jax.profiler import ProfileData

    with jax.profiler.trace(str(tmp_path), profiler_options=MP.options()):
        for _ in range(3):
            _traced_python_marker()
    [pb] = tmp_path.rglob("*.xplane.pb")
    names = [e.name for plane in ProfileData.from_file(str(pb)).planes for line in plane.lines
             for e in line.events]
    assert not [n for n in names if "_traced_python_marker" in n]


def test_loop_ops_needs_a_pipeline():
    text = jax.jit(lambda x: x + 1).lower(np.ones(3, np.float32)).compile().as_text()
    with pytest.raises(AutoparError, match="tick loop"):
        MP.loop_ops(text)


def _matmul_model(width: int, layers: int):
    """A staged model whose layers are all compute (``tanh(x @ w)``), so a stage's busy time
    follows its layer count rather than the runtime's per-op costs; it compiles in seconds."""
    model = PM.StagedModel(lambda r, b: b["x"] * r["s"], lambda p, x: jnp.tanh(x @ p["w"]),
                           lambda r, x, b: jnp.mean(x * r["s"]), "layers", layers,
                           optax.sgd(0.1))
    params = {"s": jnp.ones((width,)), "layers": {"w": jnp.full((layers, width, width), 0.01)}}
    return model, {"params": params, "opt_state": model.tx.init(params)}


def test_unequal_split_is_busier_on_its_long_stage(tmp_path):
    """A 3 + 1 layer split, 1F1B over two devices: the trace attributes the actions to the
    devices, the padded slots of the one-layer stage skip their matmuls (counted in the trace,
    which does not depend on the machine's speed or load), and the stage holding three layers
    is the busier: it executes three times the other's matmuls. Busy *time* is not compared:
    the padded slots still pay the per-slot slicing and gradient-stacking copies, which at this
    width cost about as much as a layer's matmul, so the ratio was ~1.2-1.6x on an idle machine
    and fell to 0.98x on a loaded one (a timing, which belongs in benchmarks/pipeline_cpu.py)."""
    model, state = _matmul_model(256, 4)
    batch = {"x": jnp.ones((4 * 64, 256))}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    pstep = R.build_step(model, mesh, S.build("1f1b", 2, 1, 4), ranges=((0, 3), (3, 4)))
    placed = tuple(jax.device_put(x, s) for x, s in zip((state, batch),
                                                        pstep.in_shardings_of(state, batch)))
    # timed, so compiled as users' programs are (the suite's conftest puts LLVM at -O0)
    compiled = pstep.jitted(*placed).lower(*placed).compile(
        compiler_options={"xla_backend_optimization_level": 2})
    ops = MP.loop_ops(compiled.as_text())
    assert ops.actions["forward"] and ops.actions["backward"]
    assert not ops.actions["forward"] & ops.actions["backward"]
    assert ops.actions["forward"] | ops.actions["backward"] < ops.loop
    m = MP.measure(compiled, placed, mesh, "stage", runs=5, log_dir=tmp_path)
    assert m.runs == 5 and m.step_s > 0
    # executed unfused dots: XLA leaves one per layer and microbatch unfused here (the others
    # become fusions), so 3 layers x 4 microbatches x 5 runs on the long stage and a third of
    # that on the short one, whose padded slots run none
    dots = {0: 0, 1: 0}
    for e in MP.read_events(tmp_path, ops.module):
        if e.op in ops.actions["forward"] | ops.actions["backward"] and (
                e.op == "dot" or e.op.startswith("dot.")):
            dots[e.device] += 1
    assert dots[1] > 0 and dots[0] == 3 * dots[1], dots
    assert all(0 < b < lo for b, lo in zip(m.busy_s, m.loop_s))
    assert all(f > 0 and b > 0 for f, b in zip(m.forward_s, m.backward_s))   # no timing order
    assert 0 < m.bubble_fraction < 1
