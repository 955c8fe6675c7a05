"""Every bad input gets a clear ``autopar.AutoparError``; valid but unusual inputs compute what
``jax.jit`` computes.

The corpus is one table per area (meshes, hardware, budgets, options, strategies, arguments,
saved plans, functions). An error case asserts the exact error class and a fragment of the
message (what was given, or where, or the fix). A valid case runs the step sharded on the 2x4
mesh and compares every output with ``jax.jit`` of the same function.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore
from jax.scipy.linalg import cho_solve
from jax.sharding import AbstractMesh, Mesh

import autopar
import cost_models
import ir
from autopar import strategies
from autopar.errors import AutoparError, BudgetError, PlanError, ShardingError
from autopar.plan import FORMAT_VERSION
from cost_models import CostModelError, Hardware, Link

F32 = jnp.float32


def _mesh(shape=(2, 4), names=("data", "model")) -> Mesh:
    n = math.prod(shape)
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _loss(w, x):
    return jnp.tanh(x @ w).sum()


W, X = jax.ShapeDtypeStruct((16, 8), F32), jax.ShapeDtypeStruct((8, 16), F32)


def _plan(**kw):
    """Plan the small step with the options under test (abstract arguments, no memory)."""
    kw = {"mesh": {"data": 2, "model": 4}, "time_limit_s": 1, **kw}
    return autopar.plan(_loss, W, X, **kw)


def _hw(**changes) -> Hardware:
    return dataclasses.replace(cost_models.hardware("h100"), **changes)


def _link(**changes) -> Link:
    return dataclasses.replace(cost_models.hardware("h100").intra_node, **changes)


def _hw_dict(**changes) -> dict:
    d = cost_models.hardware("h100").to_dict()
    d.update(changes)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


def _profile_file(text: str) -> str:
    path = os.path.join(tempfile.mkdtemp(), "profile.json")
    with open(path, "w") as f:
        f.write(text)
    return path


def _mesh_listing_a_device_twice() -> Mesh:
    d = jax.devices()
    return Mesh(np.array([d[0], d[0], d[1], d[2]]).reshape(2, 2), ("a", "b"))


# ---- meshes -------------------------------------------------------------------------------------
MESH_CASES = [
    ("mesh-missing", lambda: _plan(mesh=None), ShardingError, r"needs mesh="),
    ("mesh-list", lambda: _plan(mesh=[2, 4]), ShardingError, r"\[2, 4\] \(list\) is not a jax"),
    ("mesh-count-0", lambda: _plan(mesh=0), ShardingError,
     r"mesh=0: a device count is an integer >= 1"),
    ("mesh-float", lambda: _plan(mesh=8.0), ShardingError, r"mesh=8.0 \(float\) is not"),
    ("mesh-str", lambda: _plan(mesh="data"), ShardingError, r"'data' \(str\) is not"),
    ("mesh-empty", lambda: _plan(mesh={}), ShardingError, r"has no axes.*\{'data': 1\}"),
    ("mesh-size-0", lambda: _plan(mesh={"data": 2, "model": 0}), ShardingError,
     r"axis 'model' has size 0"),
    ("mesh-size-negative", lambda: _plan(mesh={"data": -2}), ShardingError, r"size -2"),
    ("mesh-size-float", lambda: _plan(mesh={"data": 2.0}), ShardingError, r"size 2\.0; sizes"),
    ("mesh-size-bool", lambda: _plan(mesh={"data": True}), ShardingError, r"size True"),
    ("mesh-size-str", lambda: _plan(mesh={"data": "2"}), ShardingError, r"size '2'"),
    ("mesh-name-empty", lambda: _plan(mesh={"": 2}), ShardingError,
     r"name '' .* non-empty string"),
    ("mesh-name-int", lambda: _plan(mesh={3: 2}), ShardingError, r"name 3 .* non-empty string"),
    ("mesh-abstract-repeated-name",
     lambda: _plan(mesh=AbstractMesh((2, 4), ("a", "a"))), ShardingError,
     r"repeats the axis name 'a'"),
    ("mesh-devices-repeated-name",
     lambda: autopar.autoparallel(_loss, mesh=_mesh(names=("x", "x"))), ShardingError,
     r"repeats the axis name 'x'"),
    ("mesh-device-twice", lambda: autopar.autoparallel(_loss, mesh=_mesh_listing_a_device_twice()),
     ShardingError, r"lists device 0 \(cpu\) twice, at positions \(0, 0\) and \(0, 1\)"),
    ("mesh-more-devices-than-present", lambda: autopar.autoparallel(_loss, mesh={"data": 16}),
     ShardingError, r"has 16 devices but 8 are present"),
    ("mesh-fewer-devices-than-present", lambda: autopar.autoparallel(_loss, mesh={"data": 3}),
     ShardingError, r"whose sizes multiply to 8"),
    ("autoparallel-mesh-missing", lambda: autopar.autoparallel(_loss), ShardingError,
     r"autoparallel\(\) needs mesh="),
    ("mesh-positional-instead-of-fn", lambda: autopar.autoparallel({"data": 8}), AutoparError,
     r"needs the step function first; got dict \{'data': 8\}"),
]

# ---- hardware profiles --------------------------------------------------------------------------
HARDWARE_CASES = [
    ("hw-unknown-name", lambda: _plan(hardware="h1000"), CostModelError, r"did you mean 'h100'"),
    ("hw-wrong-type", lambda: _plan(hardware=5), CostModelError, r"hardware=5 \(int\)"),
    ("hw-negative-latency", lambda: _hw(intra_node=_link(latency_s=-1.0)), CostModelError,
     r"latency_s=-1\.0 must be >= 0"),
    ("hw-zero-link-bandwidth", lambda: _hw(inter_node=_link(bandwidth_bytes_per_s=0.0)),
     CostModelError, r"bandwidth_bytes_per_s=0\.0 must be > 0"),
    ("hw-zero-hbm", lambda: _hw(hbm_bytes_per_s=0.0), CostModelError,
     r"'h100': hbm_bytes_per_s=0\.0 must be > 0"),
    ("hw-nan-peak", lambda: _hw(peak_flops_by_dtype=(("float32", math.nan),)), CostModelError,
     r"peak_flops_by_dtype\['float32'\]=nan must be a finite number"),
    ("hw-inf-hbm", lambda: _hw(hbm_bytes_per_s=math.inf), CostModelError,
     r"hbm_bytes_per_s=inf must be a finite"),
    ("hw-string-figure", lambda: _hw(hbm_bytes_per_s="3e12"), CostModelError,
     r"hbm_bytes_per_s='3e12' must be a finite number"),
    ("hw-bool-figure", lambda: _hw(kernel_launch_s=True), CostModelError,
     r"kernel_launch_s=True must be a finite number"),
    ("hw-efficiency-percent", lambda: _hw(matmul_efficiency=75), CostModelError,
     r"matmul_efficiency=75 must be in \[1e-06, 1\].*not a percentage"),
    ("hw-efficiency-zero", lambda: _hw(collective_efficiency=0.0), CostModelError,
     r"collective_efficiency=0\.0 must be in \[1e-06, 1\]"),
    ("hw-memory-zero", lambda: _hw(memory_bytes=0), CostModelError, r"memory_bytes=0 must be"),
    ("hw-memory-fraction", lambda: _hw(memory_bytes=1.5), CostModelError,
     r"memory_bytes=1\.5 must be a whole number"),
    ("hw-devices-per-node-zero", lambda: _hw(devices_per_node=0), CostModelError,
     r"devices_per_node=0"),
    ("hw-empty-name", lambda: _hw(name=""), CostModelError, r"name='' must be a non-empty"),
    ("hw-no-float32-peak", lambda: _hw(peak_flops_by_dtype=(("bfloat16", 1e15),)),
     CostModelError, r"but not 'float32'"),
    ("hw-peaks-not-a-table", lambda: _hw(peak_flops_by_dtype=5), CostModelError,
     r"peak_flops_by_dtype=5 must map names to values"),
    ("hw-negative-kind-efficiency",
     lambda: _hw(collective_kind_efficiency=(("all-to-all", -0.5),)), CostModelError,
     r"collective_kind_efficiency\['all-to-all'\]=-0\.5 must be a bandwidth factor"),
    ("hw-rate-below-one", lambda: _hw(hbm_bytes_per_s=3.35e-3), CostModelError,
     r"hbm_bytes_per_s=0\.00335 is below 1 per second.*check the unit"),
    ("hw-latency-in-microseconds", lambda: _hw(intra_node=_link(latency_s=5000.0)),
     CostModelError, r"latency_s=5000\.0 seconds is over 3600 s.*seconds, not us"),
    ("hw-negative-dispatch", lambda: _hw(dispatch_s=-1e-3), CostModelError,
     r"dispatch_s=-0\.001 must be >= 0"),
    ("hw-link-not-a-link", lambda: _hw(intra_node=None), CostModelError,
     r"intra_node=None must be a cost_models\.Link"),
    ("hw-json-not-json", lambda: Hardware.from_json("{"), CostModelError, r"must be JSON text"),
    ("hw-json-deeply-nested", lambda: Hardware.from_json("[" * 10**5 + "]" * 10**5),
     CostModelError, r"must be JSON text"),
    ("hw-json-list", lambda: Hardware.from_json("[]"), CostModelError,
     r"must be a JSON object of fields"),
    ("hw-json-missing-field", lambda: Hardware.from_dict(_hw_dict(hbm_bytes_per_s=_DROP)),
     CostModelError, r"lacks the required fields \['hbm_bytes_per_s'\]"),
    ("hw-json-unknown-field", lambda: Hardware.from_dict(_hw_dict(hbm_speed=1)),
     CostModelError, r"unknown fields \['hbm_speed'\]"),
    ("hw-json-link-missing-latency",
     lambda: Hardware.from_dict(_hw_dict(intra_node={"name": "x", "bandwidth_bytes_per_s": 1e9})),
     CostModelError, r"intra_node lacks the required fields \['latency_s'\]"),
    ("hw-json-link-negative",
     lambda: Hardware.from_dict(_hw_dict(inter_node={"name": "x", "bandwidth_bytes_per_s": 1e9,
                                                     "latency_s": -1})),
     CostModelError, r"inter_node: Link 'x': latency_s=-1"),
    ("hw-file-not-json", lambda: cost_models.hardware(_profile_file("not json")), CostModelError,
     r"profile\.json'.*must be JSON text"),
    ("hw-file-bad-figure",
     lambda: cost_models.hardware(_profile_file(json.dumps(_hw_dict(hbm_bytes_per_s=-5)))),
     CostModelError, r"profile\.json'.*hbm_bytes_per_s=-5 must be > 0"),
    ("hw-plan-with-bad-profile", lambda: _plan(hardware=_hw_dict()), CostModelError,
     r"hardware=\{.*\(dict\) is not a profile"),
]

# ---- budgets, time limits, options --------------------------------------------------------------
OPTION_CASES = [
    ("budget-nan", lambda: _plan(memory_budget=math.nan), AutoparError,
     r"memory_budget=nan is NaN"),
    ("budget-string", lambda: _plan(memory_budget="1GB"), AutoparError,
     r"'1GB' is a string.*memory_budget=1e9 for 1GB"),
    ("budget-string-gib", lambda: _plan(memory_budget="16GiB"), AutoparError,
     r"memory_budget=1\.71799e10 for 16GiB"),
    ("budget-negative", lambda: _plan(memory_budget=-1), AutoparError, r"must be > 0 bytes"),
    ("budget-zero", lambda: _plan(memory_budget=0), AutoparError, r"memory_budget=0 must be > 0"),
    ("budget-bool", lambda: _plan(memory_budget=True), AutoparError, r"True \(bool\) must be a"),
    ("budget-list", lambda: _plan(memory_budget=[1e9]), AutoparError, r"\(list\) must be a number"),
    ("budget-beyond-any-device", lambda: _plan(memory_budget=1e30), AutoparError,
     r"exceeds any device.*None for no limit"),
    ("budget-too-small", lambda: autopar.plan(_loss, *[jax.ShapeDtypeStruct((512, 512), F32)] * 2,
                                              mesh={"data": 2, "model": 4}, memory_budget=1024),
     BudgetError,
     r"smallest peak found for any plan is .* GiB"),
    ("budget-the-solver-fits-but-the-estimate-does-not",
     lambda: autopar.plan(_loss, *[jax.ShapeDtypeStruct((512, 512), F32)] * 2,
                          mesh={"data": 2, "model": 4}, memory_budget=393216, deterministic=True),
     BudgetError, r"no plan fits a memory budget of .* \(393216 bytes\).* memory_budget=\d+ plans"),
    ("compare-no-strategies", lambda: autopar.compare(_loss, W, X, mesh={"data": 8},
                                                      strategies=(), measure=False),
     AutoparError, r"strategies=\(\)\): there is nothing to compare"),
    ("time-limit-zero", lambda: _plan(time_limit_s=0), AutoparError, r"time_limit_s=0 must be > 0"),
    ("time-limit-negative", lambda: _plan(time_limit_s=-5), AutoparError, r"must be > 0 seconds"),
    ("time-limit-nan", lambda: _plan(time_limit_s=math.nan), AutoparError, r"time_limit_s=nan"),
    ("time-limit-string", lambda: _plan(time_limit_s="10"), AutoparError,
     r"time_limit_s='10' \(str\) must be a number"),
    ("time-limit-none", lambda: _plan(time_limit_s=None), AutoparError, r"time_limit_s=None"),
    ("deterministic-not-bool", lambda: _plan(deterministic="yes"), AutoparError,
     r"deterministic='yes' must be True or False"),
    ("option-typo-time-limit", lambda: _plan(time_limt_s=1), AutoparError,
     r"unknown option time_limt_s=1; did you mean time_limit_s="),
    ("option-typo-budget", lambda: _plan(memory_budgt=1e9), AutoparError,
     r"did you mean memory_budget="),
    ("option-unknown", lambda: _plan(learning_rate=1e-3), AutoparError,
     r"unknown option learning_rate=0\.001; plan takes mesh"),
    ("autoparallel-option-typo", lambda: autopar.autoparallel(_loss, mesh=_mesh(), hardwre="h100"),
     AutoparError, r"autoparallel\(\) got an unknown option hardwre='h100'; did you mean "
                   r"hardware="),
    ("autoparallel-bad-budget-fails-early",
     lambda: autopar.autoparallel(_loss, mesh=_mesh(), memory_budget="8GB"), AutoparError,
     r"'8GB' is a string"),
    ("autoparallel-bad-hardware-fails-early",
     lambda: autopar.autoparallel(_loss, mesh=_mesh(), hardware="tpu"), CostModelError,
     r"hardware\('tpu'\): not a profile name"),
    ("compare-bad-budget", lambda: autopar.compare(_loss, W, X, mesh={"data": 8},
                                                   memory_budget="1GB", measure=False),
     AutoparError, r"memory_budget='1GB' is a string"),
    ("compare-unhashable-static-argument",
     lambda: autopar.compare(_loss, W, {"x"}, mesh={"data": 8}),
     AutoparError, r"argument \[1\] is set \{'x'\}: neither an array, .* nor hashable"),
    ("fn-not-callable", lambda: autopar.plan("loss", W, X, mesh={"data": 8}), AutoparError,
     r"needs the step function first; got str 'loss'"),
    ("autoparallel-fn-not-callable", lambda: autopar.autoparallel(3, mesh=_mesh()), AutoparError,
     r"got int 3, which is not callable"),
    ("donate-negative", lambda: _plan(donate_argnums=-1), AutoparError,
     r"donate_argnums=-1: each entry must be the position"),
    ("donate-string", lambda: _plan(donate_argnums="0"), AutoparError, r"donate_argnums='0'"),
    ("donate-float", lambda: _plan(donate_argnums=(1.5,)), AutoparError, r"donate_argnums=\(1\.5,"),
    ("donate-out-of-range", lambda: _plan(donate_argnums=(5,)), AutoparError,
     r"names argument 5, but the step was called with 2 positional arguments"),
]


def _sharded_structs():
    """Two arguments whose shardings (different splits on two meshes) the plan cannot both
    keep."""
    one = jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec("data"))
    other = jax.sharding.NamedSharding(_mesh((4,), ("x",)), jax.sharding.PartitionSpec(None, "x"))
    return (jax.ShapeDtypeStruct((8, 4), F32, sharding=one),
            jax.ShapeDtypeStruct((8, 4), F32, sharding=other))


# ---- strategies ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Custom:
    """A user-written strategy whose fix_inputs returns ``layouts`` (or ``answer`` as is)."""

    name: str = "custom"
    layouts: tuple = ()
    answer: object = None
    allows: object = None

    def fix_inputs(self, graph, mesh):
        return dict(self.layouts) if self.answer is None else self.answer


STRATEGY_CASES = [
    ("strategy-unknown-name", lambda: _plan(strategy="tp"), ShardingError,
     r"unknown strategy 'tp'.*megatron"),
    ("strategy-int", lambda: _plan(strategy=3), ShardingError, r"strategy=3 \(int\) is not a"),
    ("strategy-dict", lambda: _plan(strategy={"name": "dp"}), ShardingError,
     r"\(dict\) is not a strategy"),
    ("strategy-axis-not-in-mesh", lambda: _plan(strategy=strategies.get("fsdp", data_axis="x")),
     ShardingError, r"mesh axis 'x'"),
    ("strategy-unknown-knob", lambda: strategies.get("dp", batch_axis="data"), ShardingError,
     r"takes data_axis"),
    ("strategy-axis-fails-at-decoration",
     lambda: autopar.autoparallel(_loss, mesh=_mesh(), strategy=strategies.get("dp",
                                                                                data_axis="d")),
     ShardingError, r"was given mesh axis 'd'"),
    ("strategy-time-limit-spent-in-build",
     lambda: _plan(strategy="fsdp", time_limit_s=1e-4, deterministic=False), PlanError,
     r"time_limit_s=0\.0001 ran out while the problem was built.*raise time_limit_s"),
    ("custom-returns-list", lambda: _plan(strategy=_Custom(answer=[])), ShardingError,
     r"fix_inputs returned list; it must return a dict"),
    ("custom-unknown-input", lambda: _plan(strategy=_Custom(layouts=((9, ((), ())),))),
     ShardingError, r"names input 9, but the step has inputs 0\.\.1"),
    ("custom-unknown-axis", lambda: _plan(strategy=_Custom(layouts=((0, (("zz",), ())),))),
     ShardingError, r"input \[0\] of shape \(16, 8\): layout .* names mesh axis 'zz'"),
    ("custom-wrong-rank", lambda: _plan(strategy=_Custom(layouts=((0, (("data",),)),))),
     ShardingError, r"has 1 dims but the shape \(16, 8\) has 2"),
    ("custom-indivisible", lambda: autopar.plan(_loss, jax.ShapeDtypeStruct((6, 8), F32),
                                                jax.ShapeDtypeStruct((8, 6), F32),
                                                mesh={"data": 2, "model": 4},
                                                strategy=_Custom(layouts=((0, (("model",), ())),))),
     ShardingError, r"dim 0 of size 6 is split over \('model',\) \(4 devices\)"),
    ("custom-axis-twice", lambda: _plan(strategy=_Custom(layouts=((0, (("data",), ("data",))),))),
     ShardingError, r"uses mesh axis 'data' twice"),
    ("custom-layout-not-nested", lambda: _plan(strategy=_Custom(layouts=((0, "data"),))),
     ShardingError, r"must give one list of mesh-axis names per dim"),
    ("custom-allows-not-callable", lambda: _plan(strategy=_Custom(allows=5)), ShardingError,
     r"its allows attribute must be callable"),
]


# ---- arguments of a decorated step --------------------------------------------------------------
def _run(fn, *args, **kw):
    return autopar.autoparallel(fn, mesh=_mesh(), time_limit_s=2, **kw)(*args)


def _x():
    return jnp.arange(128, dtype=F32).reshape(8, 16)


def _donated_twice():
    step = autopar.autoparallel(lambda a: a + 1, mesh=_mesh(), donate_argnums=0, time_limit_s=2)
    once = step(_x())
    step(once)          # donates `once`
    return step(once)   # reuses it: must not reach XLA


def _inside_jit():
    step = autopar.autoparallel(lambda a: a * 2, mesh=_mesh(), time_limit_s=2)
    return jax.jit(step)(_x())


def _inside_jit_no_tracer():
    step = autopar.autoparallel(lambda a: a * 2, mesh=_mesh(), time_limit_s=2)
    return jax.jit(lambda a: step(np.ones((8, 4), np.float32)) + a)(1.0)


ARGUMENT_CASES = [
    ("arg-unhashable", lambda: _run(lambda a, s: a, _x(), bytearray(b"abc")), AutoparError,
     r"argument \[1\] is bytearray .* nor hashable, which a static leaf must be .* "
     r"eqx.partition\(model, eqx.is_array\)"),
    ("arg-unhashable-in-dict", lambda: _run(lambda d: d["a"], {"a": _x(), "names": {"w"}}),
     AutoparError, r"argument \[0\]\['names'\] is set"),
    ("arg-object-array", lambda: _run(lambda a, s: a, _x(), np.array([object()])), AutoparError,
     r"argument \[1\] is ndarray"),
    ("arg-string-array", lambda: _run(lambda a, s: a, _x(), np.array(["a", "b"])), AutoparError,
     r"argument \[1\] is ndarray array\(\['a', 'b'\]"),
    ("arg-int-too-large", lambda: _run(lambda a, s: a * s[...], _x(), nnx.Variable(2**40)),
     AutoparError, r"argument \[1\]\.value = 1099511627776: Python int .* too large"),
    ("arg-donated-reused", _donated_twice, AutoparError,
     r"argument \[0\] \(float32\[8, 16\]\) was deleted: donated to an earlier call"),
    ("arg-shape-dtype-struct-to-run", lambda: _run(_loss, W, X), AutoparError,
     r"argument \[0\] is a ShapeDtypeStruct float32\[16, 8\]: running needs arrays"),
    ("arg-tracer-inside-jit", _inside_jit, AutoparError,
     r"argument \[0\] is a jax tracer .* called inside jax\.jit"),
    ("arg-tracer-inside-grad",
     lambda: jax.grad(lambda a: autopar.autoparallel(lambda b: (b * b).sum(),
                                                     mesh=_mesh())(a))(_x()),
     AutoparError, r"is a jax tracer"),
    ("call-inside-jit-without-tracers", _inside_jit_no_tracer, ShardingError,
     r"called inside a traced function"),
    ("call-with-keywords", lambda: autopar.autoparallel(_loss, mesh=_mesh())(w=W, x=X),
     AutoparError, r"_loss\(\) got keyword arguments \['w', 'x'\]; .* positionally"),
    ("lower-with-keywords", lambda: autopar.autoparallel(_loss, mesh=_mesh()).lower(w=W),
     AutoparError, r"got keyword arguments \['w'\]"),
]


# ---- saved plans --------------------------------------------------------------------------------
def _pair(w, x):
    y = x @ w
    return y, y.sum()


PAIR_ARGS = (jnp.ones((16, 8), F32), jnp.arange(96, dtype=F32).reshape(6, 16))


@functools.cache
def _saved() -> str:
    """A plan of _pair on the 2x4 mesh, as JSON (planned once per module)."""
    return autopar.plan(_pair, *PAIR_ARGS, mesh=_mesh(), hardware="h100", time_limit_s=2).to_json()


def _edited(edit) -> str:
    d = json.loads(_saved())
    edit(d)
    return json.dumps(d)


def _load(edit):
    return autopar.Plan.from_json(_edited(edit))


def _apply(edit, fn=_pair, args=PAIR_ARGS):
    plan = autopar.Plan.from_json(_edited(edit))
    return autopar.autoparallel(fn, mesh=_mesh(), plan=plan)(*args)


def _set(path, value):
    def edit(d):
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _drop(key):
    return lambda d: d.pop(key)


def _scaled_pair(w, x):
    y = x @ (w * 2.0)
    return jnp.exp(y), y.sum()


def _apply_with_forged_fingerprint():
    """_pair's plan, its fingerprint replaced by that of another program with the same
    arguments, applied to that program."""
    forged = ir.trace(_scaled_pair, *PAIR_ARGS).fingerprint()
    return _apply(_set(["graph_fingerprint"], forged), fn=_scaled_pair)


PLAN_CASES = [
    ("plan-not-json", lambda: autopar.Plan.from_json("{plan"), PlanError, r"the text is not JSON"),
    ("plan-not-text", lambda: autopar.Plan.from_json(None), PlanError, r"not JSON"),
    ("plan-json-deeply-nested", lambda: autopar.Plan.from_json("[" * 10**5 + "]" * 10**5),
     PlanError, r"not JSON \(maximum recursion depth"),
    ("plan-spec-of-unknown-path", lambda: autopar.Plan.from_json(_saved()).spec_of("kernel"),
     PlanError, r"0 inputs match 'kernel'; give a fragment of exactly one input path"),
    ("plan-json-list", lambda: autopar.Plan.from_json("[]"), PlanError,
     r"a plan is a JSON object; got list"),
    ("plan-no-version", lambda: _load(_drop("format_version")), PlanError,
     r"no format_version field"),
    ("plan-old-version", lambda: _load(_set(["format_version"], 1)), PlanError,
     rf"has format_version 1; this autopar reads version {FORMAT_VERSION}.*plan again with "
     rf"this version"),
    ("plan-version-string", lambda: _load(_set(["format_version"], str(FORMAT_VERSION))),
     PlanError, rf"format_version '{FORMAT_VERSION}' is not {FORMAT_VERSION}"),
    ("plan-unknown-field", lambda: _load(_set(["extra"], 1)), PlanError,
     r"unknown fields \['extra'\]"),
    ("plan-missing-field", lambda: _load(_drop("pins")), PlanError, r"missing fields \['pins'\]"),
    ("plan-mesh-repeated-axis", lambda: _load(_set(["mesh"], [["data", 2], ["data", 4]])),
     PlanError, r"repeats an axis name"),
    ("plan-mesh-size-zero", lambda: _load(_set(["mesh"], [["data", 0], ["model", 4]])),
     PlanError, r"axis 'data' has size 0"),
    ("plan-mesh-not-pairs", lambda: _load(_set(["mesh"], {"data": 2})), PlanError,
     r"mesh must be a JSON list"),
    ("plan-layout-unknown-axis", lambda: _load(_set(["input_shardings", 0], [["zz"], []])),
     PlanError, r"input_shardings\[0\] \(input \[0\]\): layout .* names mesh axis 'zz'"),
    ("plan-layout-wrong-rank", lambda: _load(_set(["input_shardings", 0], [[]])), PlanError,
     r"has 1 dims but the shape \(16, 8\) has 2"),
    ("plan-layout-indivisible", lambda: _load(_set(["input_shardings", 1], [["model"], []])),
     PlanError, r"dim 0 of size 6 is split over \('model',\)"),
    ("plan-layout-axis-twice",
     lambda: _load(_set(["input_shardings", 0], [["data"], ["data"]])), PlanError,
     r"uses mesh axis 'data' twice"),
    ("plan-layout-count", lambda: _load(lambda d: d["input_shardings"].pop()), PlanError,
     r"input_shardings has 1 entries where 2 were expected"),
    ("plan-shape-negative", lambda: _load(_set(["input_shapes", 0], [-16, 8])), PlanError,
     r"input_shapes\[0\]\[0\] must be an integer >= 0; got -16"),
    ("plan-pin-path-type", lambda: _load(_set(["pins"], [{"path": "x", "slot": "out",
                                                            "index": 0, "chain": []}])),
     PlanError, r"pins\[0\].path must be a JSON list"),
    ("plan-cost-nan", lambda: _load(_set(["cost", "step_time_s"], math.nan)), PlanError,
     r"cost\.step_time_s must be a finite number >= 0; got nan"),
    ("plan-cost-negative", lambda: _load(_set(["cost", "compute_s"], -1.0)), PlanError,
     r"cost\.compute_s must be a finite number"),
    ("plan-cost-missing", lambda: _load(lambda d: d["cost"].pop("comm_s")), PlanError,
     r"cost: unknown fields \[\] / missing fields \['comm_s'\]"),
    ("plan-solver-type", lambda: _load(_set(["solver", "num_vars"], "many")), PlanError,
     r"solver\.num_vars must be an integer"),
    ("plan-collective-axis", lambda: _load(lambda d: d["collectives"].append(
        {"where": "x", "kind": "all-reduce", "axes": ["zz"], "nbytes": 1.0, "time_s": 0.0,
         "count": 1.0, "source": "", "name": ""})),
     PlanError, r"names mesh axis 'zz'"),
    ("plan-hardware-type", lambda: _load(_set(["hardware"], 7)), PlanError,
     r"hardware must be a string; got 7"),
    ("plan-choice-arity", lambda: _load(_set(["choices"], [[1, "dot_general"]])), PlanError,
     r"choices\[0\] has 2 entries where 4 were expected"),
    ("plan-error-says-plan-again", lambda: _load(_set(["strategy"], None)), PlanError,
     r"strategy must be a string; got None\. The file is damaged or was edited: plan again and "
     r"save plan\.to_json\(\)"),
    ("plan-applied-to-other-shapes",
     lambda: _apply(lambda d: None, args=(PAIR_ARGS[0], jnp.ones((8, 16), F32))), PlanError,
     r"its input \[1\] has shape \(6, 16\), this call's \[1\] has shape \(8, 16\)"),
    ("plan-applied-to-other-program",
     lambda: _apply(lambda d: None, fn=lambda w, x: (x @ w * 2.0, (x @ w).sum())), PlanError,
     r"input paths and shapes match but the traced program differs"),
    ("plan-pin-edited", lambda: _apply(lambda d: d["pins"][0].__setitem__("path", [999])),
     PlanError, r"pins out 0 of equation \(999,\), which this step does not have"),
    ("plan-output-layout-edited",
     lambda: _apply(_set(["output_shardings", 0], [["model"], []])), PlanError,
     r"plan output \[0\]: dim 0 of size 6 is split over \('model',\)"),
    ("plan-for-other-mesh",
     lambda: autopar.autoparallel(_pair, mesh=_mesh((8,), ("data",)),
                                  plan=autopar.Plan.from_json(_saved())), PlanError,
     r"made for another mesh: the axis names differ: the plan.s mesh is \(data=2, model=4\), "
     r"this one \(data=8\)"),
    ("plan-for-other-axis-order",
     lambda: autopar.autoparallel(_pair, mesh=_mesh((4, 2), ("model", "data")),
                                  plan=autopar.Plan.from_json(_saved())), PlanError,
     r"the axis order differs: the plan.s mesh is \(data=2, model=4\), this one "
     r"\(model=4, data=2\)"),
    ("plan-input-shapes-edited", lambda: _apply(_set(["input_shapes", 1], [12, 16])), PlanError,
     r"its input \[1\] has shape \(12, 16\), this call's \[1\] has shape \(6, 16\)"),
    ("plan-fingerprint-forged", _apply_with_forged_fingerprint, PlanError,
     r"decides op \d+ .* but in this step .*its fingerprint was edited"),
    ("plan-as-text", lambda: autopar.autoparallel(_pair, mesh=_mesh(), plan=_saved()), PlanError,
     r"\(str\) is not an autopar\.Plan.*Plan\.from_json"),
    ("plan-with-ignored-options",
     lambda: autopar.autoparallel(_pair, mesh=_mesh(), strategy="dp", memory_budget=1e9,
                                  plan=autopar.Plan.from_json(_saved())), AutoparError,
     r"memory_budget=, strategy= would be ignored"),
]


# ---- functions ----------------------------------------------------------------------------------
def _mystery_call(x):
    prim = jcore.Primitive("mystery_call")
    prim.def_abstract_eval(lambda x, **_: x)
    return prim.bind(x, body=jax.make_jaxpr(jnp.sin)(jnp.ones(3)))


FUNCTION_CASES = [
    ("fn-unsupported-subjaxpr",
     lambda: autopar.plan(_mystery_call, jax.ShapeDtypeStruct((3,), F32), mesh={"data": 8}),
     ir.UnsupportedPrimitiveError, r"primitive 'mystery_call' at test_bad_inputs\.py:\d+"),
]

ERROR_CASES = (MESH_CASES + HARDWARE_CASES + OPTION_CASES + STRATEGY_CASES + ARGUMENT_CASES
               + PLAN_CASES + FUNCTION_CASES)


@pytest.mark.parametrize("thunk,cls,match", [pytest.param(t, c, m, id=i)
                                             for i, t, c, m in ERROR_CASES])
def test_bad_input_raises_a_clear_autopar_error(thunk, cls, match):
    with pytest.raises(cls, match=match) as info:
        thunk()
    assert isinstance(info.value, AutoparError) and type(info.value) is cls


def test_errors_are_one_hierarchy():
    for cls in (ir.IRError, ir.UnsupportedPrimitiveError, CostModelError, PlanError,
                BudgetError, ShardingError):
        assert issubclass(cls, autopar.AutoparError) and issubclass(cls, ValueError), cls
    # every public name is importable and documented in the docs' API reference
    api = (pathlib.Path(__file__).parents[1] / "docs" / "api" / "autopar.md").read_text()
    for name in autopar.__all__:
        assert hasattr(autopar, name) and f"autopar.{name}" in api, name


# ---- errors of the step itself are jax's own, exactly as under jax.jit --------------------------
STEP_ERRORS = [
    ("shape-mismatch", lambda a, b: a @ b, (_x, _x)),
    ("data-dependent-shape", lambda a: jnp.nonzero(a)[0], (_x,)),
    ("python-error-in-step", lambda a: a.no_such_method(), (_x,)),
]


@pytest.mark.parametrize("fn,make", [pytest.param(f, m, id=i) for i, f, m in STEP_ERRORS])
def test_an_error_in_the_step_is_what_jax_jit_raises(fn, make):
    args = tuple(m() for m in make)
    with pytest.raises(Exception) as want:
        jax.jit(fn)(*args)
    with pytest.raises(type(want.value)) as got:
        _run(fn, *args)
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]


# ---- valid but unusual inputs: the numbers are jax.jit's ----------------------------------------
def _key_normal(k):
    return jax.random.normal(k, (8, 4))


def _well_conditioned():
    return jnp.eye(8, dtype=F32) * 4 + jnp.arange(64, dtype=F32).reshape(8, 8) / 64


def _int_grad(a, i):
    return jax.grad(lambda a, i: (a * i).sum(), argnums=(0, 1), allow_int=True)(a, i)


VALID_CASES = [
    ("python-float", lambda a, s: a * s, lambda: (_x(), 2.5)),
    ("python-int", lambda a, s: a * s, lambda: (_x(), 3)),
    ("python-bool", lambda a, s: jnp.where(s, a, -a), lambda: (_x(), True)),
    ("python-complex", lambda a, s: a * s, lambda: (_x(), 1 + 2j)),
    ("numpy-array", lambda a: a @ a.T, lambda: (np.arange(128, dtype=np.float32).reshape(8, 16),)),
    ("numpy-float64-array", lambda a: a * 2, lambda: (np.ones((8, 4)),)),
    ("numpy-scalar", lambda a, s: a * s, lambda: (_x(), np.float32(2))),
    ("zero-size", lambda a: a * 2, lambda: (jnp.ones((0, 4)),)),
    ("rank-0", lambda a: a * 2, lambda: (jnp.float32(3),)),
    ("prime-dims", lambda a, b: a @ b, lambda: (jnp.ones((7, 13)), jnp.ones((13, 5)))),
    ("rank-5", lambda a: a.sum((1, 3)), lambda: (jnp.ones((2, 2, 2, 2, 4)),)),
    ("bfloat16", lambda a: a @ a.T, lambda: (_x().astype(jnp.bfloat16),)),
    ("float16", lambda a: (a @ a.T).sum(), lambda: (_x().astype(jnp.float16) / 64,)),
    ("int8", lambda a: a * 2 + 1, lambda: (jnp.ones((8, 4), jnp.int8),)),
    ("uint32", lambda a: a >> 1, lambda: (jnp.full((8, 4), 7, jnp.uint32),)),
    ("bool", lambda a: jnp.logical_not(a), lambda: (jnp.ones((8, 4), bool),)),
    ("complex64", lambda a: a * (1 + 2j), lambda: (_x().astype(jnp.complex64),)),
    ("typed-prng-key", _key_normal, lambda: (jax.random.key(0),)),
    ("raw-prng-key", _key_normal, lambda: (jax.random.PRNGKey(0),)),
    ("float0-gradient", _int_grad, lambda: (_x(), jnp.ones((8, 16), jnp.int32))),
    ("returns-none", lambda a: None, lambda: (_x(),)),
    ("identity", lambda a: a, lambda: (_x(),)),
    ("nested-args-with-none", lambda d: d["a"] * d["b"][0],
     lambda: ({"a": _x(), "b": (2.0, None)},)),
    ("partial", functools.partial(lambda s, a: a * s, 3.0), lambda: (_x(),)),
    ("debug-print", lambda a: (jax.debug.print("sum {}", a.sum()), a * 2)[1], lambda: (_x(),)),
    ("pure-callback", lambda a: jax.pure_callback(lambda v: np.asarray(v) * 2,
                                                  jax.ShapeDtypeStruct(a.shape, a.dtype), a),
     lambda: (_x(),)),
    ("cond", lambda a: jax.lax.cond(a.sum() > 0, lambda v: v * 2, lambda v: v - 1, a),
     lambda: (_x(),)),
    ("while", lambda a: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2),
                                           (0, a))[1], lambda: (_x(),)),
    ("scan", lambda a: jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(16), a)[1],
     lambda: (_x(),)),
    ("linalg-inv", jnp.linalg.inv, lambda: (_well_conditioned(),)),
    ("linalg-solve", jnp.linalg.solve, lambda: (_well_conditioned(), _x()[:, :8].T)),
    ("cho-solve", lambda a, b: cho_solve((jnp.linalg.cholesky(a), True), b),
     lambda: (_well_conditioned() @ _well_conditioned().T, _x()[:, :8].T)),
    ("grad-of-solve", jax.grad(lambda a, b: (jnp.linalg.solve(a, b) ** 2).sum()),
     lambda: (_well_conditioned(), _x()[:, :8].T)),
]

VALID_MESHES = [
    ("abstract-mesh", lambda: AbstractMesh((2, 4), ("data", "model"))),
    ("one-device", lambda: _mesh((1,), ("d",))),
    ("size-one-axis", lambda: _mesh((8, 1), ("d", "m"))),
    ("three-axes", lambda: _mesh((2, 2, 2), ("a", "b", "c"))),
    ("dict-mesh", lambda: {"data": 2, "model": 4}),
]


def _same(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        if a.dtype != jax.dtypes.float0:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


@pytest.mark.parametrize("fn,make", [pytest.param(f, m, id=i) for i, f, m in VALID_CASES])
def test_unusual_but_valid_input_matches_jax_jit(fn, make):
    _same(_run(fn, *make()), jax.jit(fn)(*make()))


@pytest.mark.parametrize("make_mesh", [pytest.param(m, id=i) for i, m in VALID_MESHES])
def test_unusual_but_valid_mesh_matches_jax_jit(make_mesh):
    step = autopar.autoparallel(_pair, mesh=make_mesh(), time_limit_s=2)
    _same(step(*PAIR_ARGS), jax.jit(_pair)(*PAIR_ARGS))


def test_python_scalars_are_static_one_executable_per_value():
    """As eqx.filter_jit keeps them (issue 27): a Python scalar is part of the plan's key."""
    step = autopar.autoparallel(lambda a, s: a * s, mesh=_mesh(), time_limit_s=2)
    for s in (2.0, 3.0, 4, 2.0):
        _same(step(_x(), s), jax.jit(lambda a, s: a * s)(_x(), s))
    assert len(step._executables) == 3   # 2.0, 3.0 and 4; the second 2.0 reuses the first


def test_non_array_results_come_back_as_eqx_filter_jit_returns_them():
    eqx = pytest.importorskip("equinox")

    def f(a, name):
        return {"y": a * 2, "scale": 3.0, "name": name + "!", "act": jax.nn.relu, "none": None}

    got = _run(f, _x(), "w")
    want = eqx.filter_jit(f)(_x(), "w")
    assert {k: got[k] for k in ("scale", "name", "act", "none")} == {
        k: want[k] for k in ("scale", "name", "act", "none")}
    assert got["name"] == "w!" and got["act"] is jax.nn.relu
    _same(got["y"], want["y"])


def test_infinite_budget_and_time_limit_mean_no_limit():
    plan = _plan(memory_budget=math.inf, time_limit_s=math.inf)
    assert plan.cost.memory_budget_bytes is None and plan.cost.step_time_s > 0


def test_deleted_array_is_fine_to_plan_from():
    x = jnp.ones((16, 8))
    x.delete()
    assert _plan(mesh={"data": 8}).input_shapes == autopar.plan(
        _loss, x, X, mesh={"data": 8}, time_limit_s=1).input_shapes


# ---- what a hand-written strategy makes of unusual steps, and steps that call the host ----------
def _sgd_only_weights(w, x):
    """A step that returns only the new weights (no loss)."""
    return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)


def test_dp_keeps_whole_the_weights_of_a_step_that_returns_only_them():
    w, x = jnp.ones((16, 8), F32) / 16, jnp.arange(512, dtype=F32).reshape(32, 16) / 512
    step = autopar.autoparallel(_sgd_only_weights, mesh=_mesh(), strategy="dp", time_limit_s=2)
    _same(step(w, x), jax.jit(_sgd_only_weights)(w, x))
    assert step.plan.input_shardings == (((), ()), (("data",), ()))


def test_dp_says_when_the_batch_is_not_divisible_by_the_data_axis():
    with pytest.warns(UserWarning, match=r"batch input \[1\] \(6, 16\): dim 0 \(batch, size 6\) "
                                         r"is not divisible by 'data' \(size 4\)"):
        plan = autopar.plan(_loss, W, jax.ShapeDtypeStruct((6, 16), F32),
                            mesh={"data": 4, "model": 2}, strategy="dp", time_limit_s=1)
    assert any("every device computes the whole batch" in n for n in plan.notes)


def _callback_step(a):
    y = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
    return (y @ y.T).sum()


def test_a_host_callback_in_a_sharded_cpu_step_warns_before_it_runs():
    with pytest.warns(RuntimeWarning, match=r"host callbacks \(pure_callback at "
                                            r"test_bad_inputs\.py:\d+.*aborts the process"):
        got = _run(_callback_step, _x())
    _same(got, jax.jit(_callback_step)(_x()))


# ---- explicit meshes -----------------------------------------------------------------------------
def test_first_call_inside_set_mesh_with_explicit_axes():
    mesh = jax.make_mesh((2, 4), ("data", "model"))   # Explicit axes
    grad = jax.grad(_loss)
    w, x = jnp.ones((16, 8)) / 16, jnp.arange(128, dtype=F32).reshape(8, 16) / 128
    step = autopar.autoparallel(grad, mesh=mesh, time_limit_s=2)
    with jax.set_mesh(mesh):
        first, second = step(w, x), step(w, x)
    _same(first, jax.jit(grad)(w, x))
    _same(second, first)


def test_plan_inside_set_mesh_matches_plan_outside():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    outside = _plan(mesh=mesh)
    with jax.set_mesh(mesh):
        inside = _plan(mesh=mesh)
    assert inside.graph_fingerprint == outside.graph_fingerprint


# ---- fingerprints, saved plans, HTML ----------------------------------------------------------
def test_fingerprint_covers_primitive_parameters():
    x = jax.ShapeDtypeStruct((8, 8), F32)
    fp = [ir.trace(f, x).fingerprint() for f in (lambda a: a.sum(0), lambda a: a.sum(1),
                                                  lambda a: a * 2.0, lambda a: a * 3.0,
                                                  lambda a: a.sum(0))]
    assert len(set(fp[:4])) == 4 and fp[0] == fp[4]


def test_saved_plan_round_trips_and_runs():
    plan = autopar.Plan.from_json(_saved())
    assert plan.to_json() == _saved()
    step = autopar.autoparallel(_pair, mesh=_mesh(), plan=plan)
    _same(step(*PAIR_ARGS), jax.jit(_pair)(*PAIR_ARGS))


def test_an_edited_plan_that_still_fits_runs_to_the_same_numbers():
    """Editing a saved layout into another valid one changes where data lives, never the
    result."""
    plan = _load(_set(["input_shardings", 0], [["data"], ["model"]]))
    step = autopar.autoparallel(_pair, mesh=_mesh(), plan=plan)
    _same(step(*PAIR_ARGS), jax.jit(_pair)(*PAIR_ARGS))


def test_html_escapes_text_from_a_crafted_plan():
    evil = "<script>alert(1)</script>"

    def craft(d):
        d["strategy"] = evil
        d["hardware"] = evil
        d["input_paths"][0] = evil
        d["collectives"].append({"where": evil, "kind": evil, "axes": ["data"], "nbytes": 1.0,
                                 "time_s": 0.0, "count": 1.0, "source": evil, "name": evil})
    page = _load(craft)._repr_html_()
    assert "<script>" not in page and page.count("&lt;script&gt;") == 4


# ---- the time limit bounds the call -------------------------------------------------------------
def test_spent_time_limit_returns_a_valid_plan_and_says_so(caplog):
    """With no time left after tracing (a tiny limit), every stage that can stop does: the plan
    is the cheapest strategy of each group on its own, still correct, and the log says why."""
    step = autopar.autoparallel(_pair, mesh=_mesh(), time_limit_s=1e-4, deterministic=False)
    with caplog.at_level(logging.INFO, logger="autopar"):
        out = step(*PAIR_ARGS)
    _same(out, jax.jit(_pair)(*PAIR_ARGS))
    assert step.plan.solver.status.endswith("(time limit)"), step.plan.solver.status
    assert "time limit" in caplog.text and len(caplog.records) <= 5


def test_deterministic_ignores_the_wall_clock():
    plans = [_plan(time_limit_s=1e-4, deterministic=True) for _ in range(2)]
    assert not plans[0].solver.status.endswith("(time limit)"), plans[0].solver.status
    assert plans[0].input_shardings == plans[1].input_shardings and plans[0].pins == plans[1].pins


def test_many_axes_warn_before_building(caplog):
    mesh = {f"a{i}": 2 for i in range(6)}
    with caplog.at_level(logging.WARNING, logger="autopar"):
        plan = _plan(mesh=mesh, time_limit_s=1e-4, deterministic=False)
    assert "6 axes of size > 1" in caplog.text and plan.mesh_shape == mesh


# ---- the errors guide's two messages are real ---------------------------------------------------
def _guide_messages() -> list[str]:
    from autopar.models import mlp

    step, state, batch = mlp.make(16, 32, 1, 8)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    out = []
    with pytest.raises(AutoparError) as typo:
        autopar.plan(step, state, batch, mesh=mesh, time_limt_s=5)
    out.append(typo.value)
    train = autopar.autoparallel(step, mesh=mesh, donate_argnums=0, time_limit_s=2)
    state, loss = train(state, batch)
    new_state, loss = train(state, batch)
    with pytest.raises(AutoparError) as reused:
        train(state, batch)
    out.append(reused.value)
    return [f"{type(e).__name__}: {e}" for e in out]


def test_errors_guide_shows_real_messages():
    guide = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "errors.md"
    shown = re.findall(r"```text\n(.*?)\n```", guide.read_text(), re.S)
    for message in _guide_messages():
        assert message in shown, message


def test_lower_takes_shape_dtype_structs_carrying_other_shardings():
    """``step.lower`` takes what the step's call takes (issue 27): arguments described in
    another layout than the plan's lower to the plan's layouts, as the call would place them
    (they were jax's raw sharding mismatch error)."""
    step = autopar.autoparallel(lambda a, b: a + b, mesh=_mesh(), time_limit_s=2)
    compiled = step.lower(*_sharded_structs()).compile()
    assert compiled is not None and step.plan is not None
