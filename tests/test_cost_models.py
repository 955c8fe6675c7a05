"""Tests of cost_models: closed forms, mesh-axis links, roofline regimes, profiles, profiling."""
from __future__ import annotations

import dataclasses
import importlib
import math

import pytest

import cost_models
from cost_models import CostModel, CostModelError, Hardware, Link
from cost_models.collectives import COLLECTIVE_RULES, ring_time_s
from cost_models.compute import is_compute_bound
from ir.graph import Op, TensorType

GB = 1e9
INTRA = Link("fast", bandwidth_bytes_per_s=100 * GB, latency_s=1e-6)
INTER = Link("slow", bandwidth_bytes_per_s=10 * GB, latency_s=10e-6)


def toy_hw(**overrides: object) -> Hardware:
    """Round numbers so expected times are easy to derive by hand."""
    fields = dict(
        name="toy",
        peak_flops_by_dtype=(("float32", 100e12), ("bfloat16", 400e12)),
        memory_bytes=16 * 2**30,
        hbm_bytes_per_s=1e12,
        devices_per_node=8,
        intra_node=INTRA,
        inter_node=INTER,
        matmul_efficiency=0.5,
        memory_efficiency=0.5,
        collective_efficiency=0.5,
        kernel_launch_s=1e-6,
    )
    fields.update(overrides)
    return Hardware(**fields)  # type: ignore[arg-type]


# ---- collective closed forms ----------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_formulas_match_closed_forms(n: int) -> None:
    s, bw, a = 64e6, 100 * GB, 1e-6
    expected = {
        "all-reduce": 2 * (n - 1) / n * s / bw + 2 * (n - 1) * a,
        "all-gather": (n - 1) / n * s / bw + (n - 1) * a,
        "reduce-scatter": (n - 1) / n * s / bw + (n - 1) * a,
        "all-to-all": (n - 1) / n * s / bw + (n - 1) * a,
        "collective-permute": s / bw + a,
    }
    for kind, want in expected.items():
        assert COLLECTIVE_RULES[kind](s, n, bw, a) == pytest.approx(want), kind


def test_all_reduce_hand_computed_value() -> None:
    # 8 devices, 1 GB, 100 GB/s, 1 us: 2*7/8 * 0.01 s + 14 us = 0.0175 + 0.000014
    assert ring_time_s("all-reduce", 1e9, 8, 100 * GB, 1e-6) == pytest.approx(0.017514)


def test_collective_time_applies_efficiencies_and_link() -> None:
    hw = toy_hw(collective_kind_efficiency=(("all-to-all", 0.5),), collective_launch_s=2e-6)
    cm = CostModel(hw, {"data": 4, "model": 8})
    # model axis: intra link, B = 100 GB/s * 0.5 = 50 GB/s
    want_ar = 2 * 7 / 8 * 1e9 / 50e9 + 14 * 1e-6 + 2e-6
    assert cm.collective_time_s("all-reduce", 1e9, ("model",)) == pytest.approx(want_ar)
    # data axis: inter link, B = 10 GB/s * 0.5 * 0.5 (all-to-all factor) = 2.5 GB/s
    want_a2a = 3 / 4 * 1e9 / 2.5e9 + 3 * 10e-6 + 2e-6
    assert cm.collective_time_s("all-to-all", 1e9, ("data",)) == pytest.approx(want_a2a)


def test_empty_or_trivial_group_costs_nothing() -> None:
    cm = CostModel(toy_hw(), {"data": 1, "model": 8})
    assert cm.collective_time_s("all-reduce", 1e9, ()) == 0.0
    assert cm.collective_time_s("all-gather", 1e9, ("data",)) == 0.0


def test_unknown_collective_and_axis_raise() -> None:
    cm = CostModel(toy_hw(), {"data": 2})
    with pytest.raises(CostModelError, match="unknown"):
        cm.collective_time_s("broadcast", 1.0, ("data",))
    with pytest.raises(CostModelError, match="not in the mesh"):
        cm.collective_time_s("all-reduce", 1.0, ("model",))


# ---- intra- vs inter-node axes ---------------------------------------------------------------
@pytest.mark.parametrize(
    "mesh, inter_axes",
    [
        ({"data": 4, "model": 8}, {"data"}),
        ({"data": 8, "model": 2}, {"data"}),  # data: stride 2, spans 16 devices
        ({"data": 2, "model": 4}, set()),  # 8 devices: one node
        ({"pipe": 2, "data": 4, "model": 2}, {"pipe"}),  # pipe: stride 8, spans 16
        ({"data": 16}, {"data"}),
        ({"model": 8, "data": 1}, set()),
    ],
)
def test_axis_link_selection(mesh: dict[str, int], inter_axes: set[str]) -> None:
    cm = CostModel(toy_hw(), mesh)
    for axis in mesh:
        want = INTER if axis in inter_axes else INTRA
        assert cm.axis_link(axis) == want, (mesh, axis)


def test_multi_axis_group_pays_slowest_link() -> None:
    cm = CostModel(toy_hw(), {"data": 4, "model": 8})
    both = cm.collective_time_s("all-reduce", 1e9, ("data", "model"))
    # 32 devices over the inter link at 5 GB/s effective
    assert both == pytest.approx(2 * 31 / 32 * 1e9 / 5e9 + 62 * 10e-6)
    assert cm.collective_time_s("all-reduce", 1e9, "model") < both


# ---- roofline --------------------------------------------------------------------------------
def test_roofline_compute_bound_matmul() -> None:
    cm = CostModel(toy_hw(), {})
    flops, nbytes = 2 * 4096**3, 3 * 4096**2 * 2
    want = flops / (400e12 * 0.5) + 1e-6  # bf16 peak at 50%
    assert cm.compute_time_s(flops, nbytes, "bfloat16") == pytest.approx(want)
    assert is_compute_bound(flops, nbytes, cm.hw, "bfloat16", True)


def test_roofline_memory_bound_elementwise() -> None:
    cm = CostModel(toy_hw(), {})
    flops, nbytes = 1e6, 8e6
    want = nbytes / (1e12 * 0.5) + 1e-6
    assert cm.compute_time_s(flops, nbytes, "float32", is_matmul=False) == pytest.approx(want)
    assert not is_compute_bound(flops, nbytes, cm.hw, "float32", False)
    assert cm.compute_time_s(0, 0) == 0.0


def test_op_time_uses_matmul_peak_and_shard_factor() -> None:
    cm = CostModel(toy_hw(), {"model": 4})
    dot = Op(0, "dot_general", (0, 1), (2,), params=(("preferred_element_type", "bfloat16"),),
             flops=8e12, bytes_accessed=1e6)
    assert cm.op_time_s(dot, shard_factor=4) == pytest.approx(2e12 / 200e12 + 1e-6)
    assert cm.op_time_s(dot, dtype="float32") == pytest.approx(8e12 / 50e12 + 1e-6)
    add = Op(1, "add", (0, 1), (2,), flops=1e12, bytes_accessed=1e6)  # vector units: f32 peak
    assert cm.op_time_s(add, dtype="bfloat16") == pytest.approx(1e12 / 50e12 + 1e-6)


def test_kernel_floor_applies_from_its_size() -> None:
    cm = CostModel(toy_hw(kernel_floor_s=40e-6, kernel_floor_bytes=16e3), {})
    small, big = 8e3, 64e3
    assert cm.compute_time_s(0, small, is_matmul=False) == pytest.approx(small / 0.5e12 + 1e-6)
    assert cm.compute_time_s(0, big, is_matmul=False) == pytest.approx(big / 0.5e12 + 41e-6)
    assert cm.hw.launch_s(16e3) == pytest.approx(41e-6)  # the threshold itself pays it
    assert CostModel(toy_hw(), {}).hw.launch_s(1e9) == 1e-6  # default: no floor
    with pytest.raises(CostModelError, match="kernel_floor_s"):
        toy_hw(kernel_floor_s=-1.0)
    with pytest.raises(CostModelError, match="kernel_floor_bytes"):
        toy_hw(kernel_floor_bytes=-1.0)


def test_conv_efficiency_slows_convolutions_only() -> None:
    cm = CostModel(toy_hw(conv_efficiency=0.25), {})
    conv = Op(0, "conv_general_dilated", (0, 1), (2,), flops=1e12, bytes_accessed=1.0)
    dot = Op(1, "dot_general", (0, 1), (2,), flops=1e12, bytes_accessed=1.0)
    assert cm.op_time_s(conv) == pytest.approx(1e12 / (50e12 * 0.25) + 1e-6)
    assert cm.op_time_s(dot) == pytest.approx(1e12 / 50e12 + 1e-6)
    with pytest.raises(CostModelError, match="conv_efficiency"):
        toy_hw(conv_efficiency=0.0)


def test_narrow_convolutions_run_slower_by_their_width() -> None:
    hw = toy_hw(conv_efficiency=0.5, conv_min_features=8.0, conv_narrow_power=2.0)
    cm = CostModel(hw, {})
    wide = cm.compute_time_s(1e12, 1.0, conv=True, conv_features=64.0)
    at_knee = cm.compute_time_s(1e12, 1.0, conv=True, conv_features=8.0)
    narrow = cm.compute_time_s(1e12, 1.0, conv=True, conv_features=2.0)
    assert wide == at_knee == pytest.approx(1e12 / (50e12 * 0.5) + 1e-6)
    assert narrow == pytest.approx(1e12 / (50e12 * 0.5 * (2 / 8) ** 2) + 1e-6)
    # a matmul, or a profile without the rule (W = 1), is not touched by the width
    assert cm.compute_time_s(1e12, 1.0, conv=False, conv_features=2.0) == pytest.approx(
        1e12 / 50e12 + 1e-6)
    assert CostModel(toy_hw(conv_efficiency=0.5), {}).compute_time_s(
        1e12, 1.0, conv=True, conv_features=1.0) == pytest.approx(wide)
    with pytest.raises(CostModelError, match="conv_min_features"):
        toy_hw(conv_min_features=0.5)
    with pytest.raises(CostModelError, match="conv_narrow_power"):
        toy_hw(conv_narrow_power=0.0)


def test_fit_min_features_finds_the_knee_and_its_slope() -> None:
    from cost_models.profile import fit_min_features

    # rates R min(1, c / 8)^3 with R = 10 GFLOP/s, widths 2..64
    rates = {c: 10e9 * min(1.0, c / 8) ** 3 for c in (2, 4, 8, 16, 32, 64)}
    assert fit_min_features(rates) == (8.0, 3.0)
    # flat rates: no knee, no rule; one rate: no fit
    assert fit_min_features({c: 5e9 for c in (2, 8, 32)}) == (1.0, 1.0)
    assert fit_min_features({8: 5e9}) == (1.0, 1.0)


def test_transcendentals_add_to_the_flop_term() -> None:
    cm = CostModel(toy_hw(transcendental_s=1e-9), {"data": 4})
    tanh = Op(0, "tanh", (0,), (1,), transcendentals=4e6, bytes_accessed=8.0)
    assert cm.op_time_s(tanh) == pytest.approx(4e6 * 1e-9 + 1e-6)
    assert cm.op_time_s(tanh, shard_factor=4) == pytest.approx(1e6 * 1e-9 + 1e-6)
    assert cm.compute_time_s(0, 0, transcendentals=1e3) == pytest.approx(1e-6 + 1e-6)
    # memory-bound still wins when the bytes take longer
    assert cm.compute_time_s(0, 1e9, is_matmul=False, transcendentals=1e3) == pytest.approx(
        1e9 / 0.5e12 + 1e-6)
    assert CostModel(toy_hw(), {}).op_time_s(tanh) == pytest.approx(8.0 / 0.5e12 + 1e-6)


def test_select_scatter_floor_is_fixed_plus_per_element() -> None:
    hw = toy_hw(select_scatter_s=50e-9, select_scatter_fixed_s=20e-6)
    assert hw.select_scatter_time_s(4096) == pytest.approx(20e-6 + 4096 * 50e-9)
    assert toy_hw().select_scatter_time_s(4096) == 0.0      # unmeasured: the roofline alone
    assert Hardware.from_json(hw.to_json()) == hw
    with pytest.raises(CostModelError, match="select_scatter_s"):
        toy_hw(select_scatter_s=-1e-9)


def test_unknown_dtype_falls_back_to_float32() -> None:
    assert toy_hw().peak_flops_per_s("int4") == 100e12
    with pytest.raises(CostModelError, match="float32"):
        toy_hw(peak_flops_by_dtype=(("bfloat16", 1.0),))


# ---- bytes per device ------------------------------------------------------------------------
def test_tensor_bytes_per_device() -> None:
    cm = CostModel(toy_hw(), {"data": 2, "model": 4})
    t = TensorType((8, 16, 32), "float32")
    assert cm.tensor_bytes_per_device(t, (("data",), (), ("model",))) == t.nbytes // 8
    assert cm.tensor_bytes_per_device(t, ((), ("data", "model"))) == t.nbytes // 8
    assert cm.tensor_bytes_per_device(t, ("model",)) == t.nbytes // 4
    assert cm.tensor_bytes_per_device(t, ()) == t.nbytes
    odd = TensorType((6,), "bfloat16")  # 6 over 4 pads to 2 per device
    assert cm.tensor_bytes_per_device(odd, (("model",),)) == 4
    with pytest.raises(CostModelError, match="two dims"):
        cm.tensor_bytes_per_device(t, (("data",), ("data",)))


# ---- profiles and JSON -----------------------------------------------------------------------
def test_json_round_trip(tmp_path: object) -> None:
    hw = toy_hw(collective_kind_efficiency=(("all-to-all", 0.7),), citations=(("x", "y"),))
    assert Hardware.from_json(hw.to_json()) == hw
    path = f"{tmp_path}/toy.json"
    hw.save(path)
    assert cost_models.hardware(path) == hw
    assert cost_models.hardware(hw) is hw


@pytest.mark.parametrize(
    "name, bf16, fp32, hbm, mem_gib, intra, inter",
    [
        ("a100", 312e12, 19.5e12, 2.039e12, 80, 300e9, 25e9),
        ("h100", 989.4e12, 66.9e12, 3.35e12, 80, 450e9, 50e9),
        ("h200", 989.4e12, 66.9e12, 4.8e12, 141, 450e9, 50e9),
    ],
)
def test_shipped_profiles_have_cited_figures(
    name: str, bf16: float, fp32: float, hbm: float, mem_gib: int, intra: float, inter: float
) -> None:
    hw = cost_models.hardware(name)
    assert (hw.name, hw.devices_per_node, hw.memory_bytes) == (name, 8, mem_gib * 2**30)
    assert hw.peak_flops_per_s("bfloat16") == bf16
    assert hw.peak_flops_per_s("float32") == fp32
    assert hw.hbm_bytes_per_s == hbm
    assert (hw.intra_node.bandwidth_bytes_per_s, hw.inter_node.bandwidth_bytes_per_s) == (
        intra,
        inter,
    )
    cited = dict(hw.citations)
    assert "Datasheet" in cited["peak_flops_by_dtype"] and "Datasheet" in cited["hbm_bytes_per_s"]
    assert hw.is_finite()


def test_cpu_profile_loads() -> None:
    hw = cost_models.hardware("cpu")
    assert hw.is_finite() and hw.devices_per_node == 8


def test_shared_compute_devices_is_read_and_checked() -> None:
    """The CPU profile's 8 devices compute on the host's shared cores (its rates measured with
    all 8 busy); the GPU sheets' devices each on their own; a profile without the field reads
    as 1; a count below 1 is refused."""
    cpu = cost_models.hardware("cpu")
    assert cpu.shared_compute_devices == 8 and "shared_compute_devices" in dict(cpu.citations)
    assert all(cost_models.hardware(n).shared_compute_devices == 1
               for n in ("a100", "h100", "h200"))
    d = cpu.to_dict()
    del d["shared_compute_devices"]
    assert Hardware.from_dict(d).shared_compute_devices == 1
    assert Hardware.from_json(cpu.to_json()) == cpu
    with pytest.raises(CostModelError, match="shared_compute_devices=0"):
        dataclasses.replace(cpu, shared_compute_devices=0)


def test_unknown_profile_name_raises() -> None:
    with pytest.raises(CostModelError, match="Known profiles"):
        cost_models.hardware("tpu-v9")


# ---- profiling on the emulated CPU devices -------------------------------------------------
def test_profile_quick_is_positive_finite_and_round_trips() -> None:
    hw = cost_models.profile(quick=True)
    assert hw.is_finite()
    assert hw.devices_per_node == 8 and hw.memory_bytes > 0
    assert all(math.isfinite(e) and e > 0 for _, e in hw.collective_kind_efficiency)
    assert Hardware.from_json(hw.to_json()) == hw
    cm = CostModel(hw, {"data": 2, "model": 4})
    assert cm.collective_time_s("all-reduce", 1e6, ("model",)) > 0
    assert cm.compute_time_s(2 * 256**3, 3 * 256**2 * 4) > 0
    # the in-program terms: measured, finite, in range (their values depend on the machine)
    assert hw.kernel_floor_s >= 0 and hw.kernel_floor_bytes >= 0
    if hw.kernel_floor_s == 0:   # no floor measured: no threshold either
        assert hw.kernel_floor_bytes == 0
    assert 0 < hw.conv_efficiency < 1e6
    widths = importlib.import_module("cost_models.profile").QUICK_SWEEP.conv_widths
    assert 1 <= hw.conv_min_features <= max(widths) and 0 < hw.conv_narrow_power <= 8
    assert 0 <= hw.transcendental_s < 1e-3
    assert 0 <= hw.select_scatter_s < 1e-3 and 0 <= hw.select_scatter_fixed_s < 1.0


def test_profile_with_reference_keeps_datasheet_peaks() -> None:
    import jax

    hw = cost_models.profile(devices=jax.devices()[:2], quick=True, reference="h100")
    assert hw.peak_flops_per_s("bfloat16") == 989.4e12
    assert 0 < hw.matmul_efficiency < 1  # a CPU reaches a tiny fraction of an H100
    assert hw.inter_node == cost_models.hardware("h100").inter_node
    assert dataclasses.replace(hw) == hw


def test_readme_section_example_runs() -> None:
    import pathlib
    import re

    text = (pathlib.Path(cost_models.__file__).parent / "README_SECTION.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    exec(compile(code.group(1), "README_SECTION.md", "exec"), {})


def test_a_collective_kind_whose_bytes_term_fits_to_zero_gets_the_median_bandwidth():
    """On a loaded machine a kind's times may not grow with its size beyond the noise; its bytes
    term then fits to zero (bandwidth 1 / tiny) and used to make an invalid profile (a kind factor
    of 1e20). It now gets the median kind's bandwidth, and the profile validates."""
    from cost_models.fit import CollectiveFit
    from cost_models.profile import _link_figures
    fit = CollectiveFit(1e-4, 2e-6, (("all-gather", 2e9), ("all-reduce", 1e9),
                                     ("reduce-scatter", 1e29)))
    intra, coll_eff, kind_eff, launch = _link_figures("cpu", fit, None)
    assert intra.bandwidth_bytes_per_s == 2e9 and coll_eff == pytest.approx(0.75)
    assert dict(kind_eff)["reduce-scatter"] == 1.0
    assert dict(kind_eff)["all-gather"] * coll_eff * 2e9 == pytest.approx(2e9)
    hw = dataclasses.replace(cost_models.hardware("cpu"), intra_node=intra,
                             collective_efficiency=coll_eff, collective_kind_efficiency=kind_eff)
    assert hw.kind_efficiency("reduce-scatter") == 1.0
