"""Hardware profiles: the figures the cost model reads, as frozen, JSON-serialisable data.

A ``Hardware`` describes one kind of device and how devices are wired:

  * ``peak_flops_by_dtype``: dense peak FLOP/s of one device per dtype (data sheet, or measured).
  * ``hbm_bytes_per_s``: device memory bandwidth; ``memory_bytes``: device memory capacity.
  * ``devices_per_node``: devices joined by the fast ``intra_node`` link; groups that span
    several nodes pay the ``inter_node`` link.
  * ``*_efficiency``: the fraction of a peak reached in practice (fitted by ``profile()``).
  * ``conv_efficiency``: a convolution's rate as a factor of the matmul rate of its dtype
    (``peak * matmul_efficiency``); 1.0, the default, prices convolutions as matmuls. Small
    convolutions on CPU devices run below a matmul's rate (``profile()`` measures the ratio).
  * ``conv_min_features`` ``W`` and ``conv_narrow_power`` ``p``: a convolution ``c`` channels
    wide per device (the geometric mean of its input and output features there) runs at
    ``min(1, c / W)^p`` of that rate (a few channels fill few of the vector lanes or tiles;
    splitting a conv's channels over many devices makes them narrow). ``W`` = 1, the default,
    switches the rule off (the GPU data sheets: not measured there). ``profile()`` fits both
    from chained convolutions of 2-64 channels: on 8 CPU devices the rate falls off a cliff
    below 8 channels (``p`` about 3-4).
  * ``transcendental_s``: seconds one device takes per transcendental evaluation (exp, log,
    tanh, sqrt, ...; ``ir.Op.transcendentals``) on top of the op's FLOPs; 0, the default,
    prices them as free (GPU profiles: the special-function units keep pace with memory).
  * ``select_scatter_s`` / ``select_scatter_fixed_s``: a max-pool's gradient
    (``select_and_scatter_add``) costs at least ``select_scatter_fixed_s + n * select_scatter_s``
    on one device, ``n`` the pooled operand's elements there. XLA:CPU has no kernel for it and
    runs an expansion (iotas, an argmax reduce-window, a zero fill, a scatter element loop) that
    ``profile()`` times; 0, the default, leaves the op to the roofline (the GPU profiles).
  * ``dispatch_s``: launching one whole compiled program on every device (paid once per step);
  * ``kernel_launch_s``: fixed cost of one kernel inside a program; ``kernel_floor_s``: what a
    kernel that moves at least ``kernel_floor_bytes`` per device pays on top of it (0 by
    default: the GPU profiles have no such step; on CPU devices XLA runs kernels of a training
    step's size as tasks on a thread pool shared by all devices, see ``cost_models.profile``);
    ``collective_launch_s``:
    fixed cost of one collective inside a program on top of its per-ring-step ``latency_s``
    (host-side synchronisation dominates it on CPU devices; near 0 on GPUs, where NCCL's
    per-step latency is the whole alpha term).
  * ``pipeline_tick_s``: the fixed cost of one tick of a pipelined step's schedule loop
    (``autopar.pipeline``: dispatching its per-stage switches, launching its two
    collective-permutes, its buffer bookkeeping), apart from the actions' work, the bytes sent
    and the state each tick copies (priced from the bandwidths).
  * ``pipeline_issue_s``: the controller's host time to issue one action of an asynchronous
    (MPMD) pipelined step (``autopar.pipeline.mpmd``: one jitted call of a stage's program and
    the ``device_put`` of its result to the next stage); the controller runs ahead of the
    devices, so it costs time only where actions are shorter than it.
  * ``shared_compute_devices``: how many devices compute on one shared pool of processors.
    Emulated CPU devices are threads on the host's cores, and ``profile()`` measures every rate
    with all of them busy at once (``measure._on_every_device``), so a device's figures are its
    share of the host: while only ``k`` of them compute, each gets ``shared_compute_devices /
    k`` of those rates (a program on 1 of 8 CPU devices ran 4.6-8.7x faster than its sub-plan
    priced it; the same matmul on 1, 2, 4 and 8 devices at once took time growing with the
    count). The pipeline timelines share the pool among the stages busy at each moment
    (``autopar.pipeline.schedules``). 1, the default: each device computes on its own (GPUs,
    TPUs).
  * ``host_bytes_per_s``: what one device moves to or from its host's memory per second, per
    direction (the PCIe link on a GPU; a copy within memory on CPU devices): the price of
    ``autopar``'s host offload (``ir.offload``); 0, the default, offers no offload.
    ``host_memory_bytes``: host memory one device may fill with offloaded state (0: not
    bounded).
  * ``ranking_error``: how far this cost model's ranking of two plans has been measured wrong
    on this hardware: a plan predicted up to ``1 + ranking_error`` times another's step was
    measured the faster of the two. ``autoparallel(tune=True)`` times the plans predicted within
    it of auto's (``autopar.tune.band``); 0, the default, where it was not measured.
  * ``citations``: for each figure, the document (or measurement) it comes from.

Shipped profiles live in ``cost_models/profiles/<name>.json``; ``hardware(name)`` loads one.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

from ir.errors import AutoparError

PROFILE_NAMES: tuple[str, ...] = ("a100", "h100", "h200", "cpu")
# Dtype whose figure stands in for dtypes a profile does not list (see peak_flops_per_s).
FALLBACK_DTYPE = "float32"


class CostModelError(AutoparError):
    """A cost-model input is malformed: unknown profile, axis, collective kind, a profile figure
    that is missing, not a number, not finite or out of range."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One interconnect as seen by one device.

    Attributes:
      name: e.g. ``"nvlink4"`` or ``"ib-ndr"``.
      bandwidth_bytes_per_s: per device, per direction (what one ring step moves per second).
      latency_s: the fixed cost of one ring step (alpha in the alpha-beta model).
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        where = f"Link {self.name!r}"
        _check_name(where, "name", self.name)
        _check_rate(where, "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        _check_floor(where, "latency_s", self.latency_s)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "link") -> Link:
        fields = ("name", "bandwidth_bytes_per_s", "latency_s")
        _check_keys(where, d, fields, fields)
        try:
            return Link(d["name"], d["bandwidth_bytes_per_s"], d["latency_s"])
        except CostModelError as e:
            raise CostModelError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Figures of one device kind and its interconnect. See the module docstring.

    ``collective_kind_efficiency`` holds extra bandwidth factors per collective kind on top of
    ``collective_efficiency`` (e.g. ``(("all-to-all", 0.6),)``); kinds not listed use 1.0.
    """

    name: str
    peak_flops_by_dtype: tuple[tuple[str, float], ...]
    memory_bytes: int
    hbm_bytes_per_s: float
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    matmul_efficiency: float = 0.75
    memory_efficiency: float = 0.85
    collective_efficiency: float = 0.8
    collective_kind_efficiency: tuple[tuple[str, float], ...] = ()
    conv_efficiency: float = 1.0     # convolution rate / matmul rate
    conv_min_features: float = 1.0   # channels below which a convolution's rate falls ...
    conv_narrow_power: float = 1.0   # ... as (channels / conv_min_features) ** conv_narrow_power
    transcendental_s: float = 0.0    # seconds per exp/log/tanh/sqrt/... on one device
    select_scatter_s: float = 0.0    # a max-pool gradient: seconds per pooled-operand element
    select_scatter_fixed_s: float = 0.0   # ... and per gradient
    kernel_launch_s: float = 5e-6
    kernel_floor_s: float = 0.0      # extra fixed cost of a kernel of >= kernel_floor_bytes
    kernel_floor_bytes: float = 0.0
    collective_launch_s: float = 0.0
    dispatch_s: float = 0.0          # launching one compiled program (once per step, not per op)
    pipeline_tick_s: float = 0.0     # one tick of a pipelined schedule's loop (autopar.pipeline)
    pipeline_issue_s: float = 0.0    # issuing one action of an MPMD pipeline (host side)
    shared_compute_devices: int = 1  # devices computing on one shared pool (1: each its own)
    host_bytes_per_s: float = 0.0    # device <-> host memory, per direction (0: no host offload)
    host_memory_bytes: float = 0.0   # host memory per device for offloaded state (0: unbounded)
    ranking_error: float = 0.0       # a plan predicted up to 1 + this x another's measured faster
    platform: str = ""               # XLA backend compiling for it: "cpu", "gpu", "tpu" or ""
    source: str = ""
    citations: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _validate(self)
        if not any(d == FALLBACK_DTYPE for d, _ in self.peak_flops_by_dtype):
            raise CostModelError(
                f"Hardware {self.name!r} lists peak FLOP/s for "
                f"{[d for d, _ in self.peak_flops_by_dtype]} but not {FALLBACK_DTYPE!r}, "
                f"which stands in for unlisted dtypes; add a {FALLBACK_DTYPE!r} entry."
            )

    def peak_flops_per_s(self, dtype: str = FALLBACK_DTYPE) -> float:
        """Dense peak FLOP/s for ``dtype``; an unlisted dtype gets the float32 figure."""
        table = dict(self.peak_flops_by_dtype)
        return table.get(dtype, table[FALLBACK_DTYPE])

    def launch_s(self, bytes_accessed: float) -> float:
        """Fixed cost of one kernel that moves ``bytes_accessed`` per device:
        ``kernel_launch_s``, plus ``kernel_floor_s`` from ``kernel_floor_bytes`` up."""
        floor = self.kernel_floor_s if bytes_accessed >= self.kernel_floor_bytes else 0.0
        return self.kernel_launch_s + floor

    def host_transfer_s(self, nbytes: float) -> float:
        """Moving ``nbytes`` one way between one device and its host's memory (inf where the
        profile has no host link)."""
        if self.host_bytes_per_s <= 0:
            return math.inf
        return nbytes / self.host_bytes_per_s + self.kernel_launch_s

    def select_scatter_time_s(self, elements: float) -> float:
        """The measured floor of one max-pool gradient over ``elements`` operand elements per
        device: ``select_scatter_fixed_s + elements * select_scatter_s`` (0 when unmeasured)."""
        if self.select_scatter_s <= 0 and self.select_scatter_fixed_s <= 0:
            return 0.0
        return self.select_scatter_fixed_s + elements * self.select_scatter_s

    def kind_efficiency(self, kind: str) -> float:
        """Extra bandwidth factor of one collective kind (1.0 when not profiled)."""
        return dict(self.collective_kind_efficiency).get(kind, 1.0)

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["peak_flops_by_dtype"] = dict(self.peak_flops_by_dtype)
        d["collective_kind_efficiency"] = dict(self.collective_kind_efficiency)
        d["citations"] = dict(self.citations)
        d["intra_node"] = self.intra_node.to_dict()
        d["inter_node"] = self.inter_node.to_dict()
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Hardware:
        fields = dataclasses.fields(Hardware)
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        _check_keys("Hardware JSON", d, [f.name for f in fields], required)
        kw = dict(d)
        kw["intra_node"] = Link.from_dict(kw["intra_node"], "intra_node")
        kw["inter_node"] = Link.from_dict(kw["inter_node"], "inter_node")
        return Hardware(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @staticmethod
    def from_json(text: str) -> Hardware:
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as e:
            raise CostModelError(f"a Hardware profile must be JSON text (as Hardware.to_json() "
                                 f"writes it); parsing failed: {e}") from None
        return Hardware.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Hardware:
        with open(path) as f:
            text = f.read()
        try:
            return Hardware.from_json(text)
        except CostModelError as e:
            raise CostModelError(f"hardware profile file {os.fspath(path)!r}: {e}") from None

    def is_finite(self) -> bool:
        """True when every number in the profile is finite and positive (latencies may be 0)."""
        rates = [v for _, v in self.peak_flops_by_dtype] + [self.hbm_bytes_per_s]
        rates += [self.intra_node.bandwidth_bytes_per_s, self.inter_node.bandwidth_bytes_per_s]
        rest = [self.intra_node.latency_s, self.inter_node.latency_s, self.kernel_launch_s]
        rest.append(self.collective_launch_s)
        return all(math.isfinite(v) and v > 0 for v in rates) and all(
            math.isfinite(v) and v >= 0 for v in rest
        )


def hardware(spec: str | os.PathLike[str] | Hardware) -> Hardware:
    """Returns a hardware profile.

    Args:
      spec: a ``Hardware`` (returned as is), a shipped profile name (``"a100"``, ``"h100"``,
        ``"h200"``, ``"cpu"``), or the path of a JSON file written by ``Hardware.save``.

    Returns:
      The ``Hardware``.
    """
    if isinstance(spec, Hardware):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise CostModelError(
            f"hardware={spec!r} ({type(spec).__name__}) is not a profile: pass a name "
            f"{list(PROFILE_NAMES)}, the path of a JSON file written by Hardware.save(), or a "
            f"cost_models.Hardware.")
    text = os.fspath(spec)
    if text.lower() in PROFILE_NAMES:
        data = resources.files("cost_models").joinpath(f"profiles/{text.lower()}.json")
        return Hardware.from_json(data.read_text())
    if os.path.isfile(text):
        return Hardware.load(text)
    close = difflib.get_close_matches(text.lower(), PROFILE_NAMES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise CostModelError(
        f"hardware({text!r}): not a profile name and not a file. {hint}Known profiles: "
        f"{list(PROFILE_NAMES)}; or pass the path of a JSON file written by Hardware.save()."
    )


# ---- validation ---------------------------------------------------------------------------------
# Every figure must be a finite real number in range: a negative latency would plan negative step
# times, a zero bandwidth divide by zero and a NaN peak poison every comparison the planner makes.
_RATES = ("hbm_bytes_per_s",)
_FRACTIONS = ("matmul_efficiency", "memory_efficiency", "collective_efficiency")
_FLOORS = ("kernel_launch_s", "kernel_floor_s", "collective_launch_s", "dispatch_s",
           "transcendental_s", "pipeline_tick_s", "pipeline_issue_s", "select_scatter_s",
           "select_scatter_fixed_s")
_COUNTS = ("memory_bytes", "devices_per_node", "shared_compute_devices")
_SIZES = ("kernel_floor_bytes", "host_memory_bytes")
# Plausibility bounds: figures outside them are unit mistakes, and would push predicted times past
# what a float (or the ILP's integer nanoseconds) can hold.
MIN_RATE = 1.0
PLATFORMS = ("", "cpu", "gpu", "tpu")
MIN_EFFICIENCY = 1e-6
MAX_SECONDS = 3600.0


def _validate(hw: Hardware) -> None:
    """Raise CostModelError naming the first malformed field of ``hw``; normalise its tables."""
    where = f"Hardware {hw.name!r}"
    _check_name(where, "name", hw.name)
    if hw.platform not in PLATFORMS:
        raise CostModelError(f"{where}: platform={hw.platform!r} is not one of {PLATFORMS} (the "
                             f"XLA backend that compiles for this hardware; '' when unknown)")
    for field in ("peak_flops_by_dtype", "collective_kind_efficiency", "citations"):
        object.__setattr__(hw, field, _pairs(where, field, getattr(hw, field)))
    for dtype, peak in hw.peak_flops_by_dtype:
        _check_rate(where, f"peak_flops_by_dtype[{dtype!r}]", peak)
    for kind, eff in hw.collective_kind_efficiency:
        _check_factor(where, f"collective_kind_efficiency[{kind!r}]", eff)
    _check_factor(where, "conv_efficiency", hw.conv_efficiency)
    if not _number(where, "conv_min_features", hw.conv_min_features, ">= 1") >= 1:
        raise CostModelError(f"{where}: conv_min_features={hw.conv_min_features!r} must be >= 1 "
                             f"channel (1 switches the narrow-convolution rule off).")
    if not 0 < _number(where, "conv_narrow_power", hw.conv_narrow_power, "> 0") <= 8:
        raise CostModelError(f"{where}: conv_narrow_power={hw.conv_narrow_power!r} must be in "
                             f"(0, 8] (the exponent of a narrow convolution's slowdown).")
    for field in _RATES:
        _check_rate(where, field, getattr(hw, field))
    for field in _FRACTIONS:
        _check_fraction(where, field, getattr(hw, field))
    for field in _FLOORS:
        _check_floor(where, field, getattr(hw, field))
    for field in _COUNTS:
        object.__setattr__(hw, field, _check_count(where, field, getattr(hw, field)))
    if _number(where, "host_bytes_per_s", hw.host_bytes_per_s, ">= 0") != 0:
        _check_rate(where, "host_bytes_per_s", hw.host_bytes_per_s)   # 0: no host link
    if not 0 <= _number(where, "ranking_error", hw.ranking_error, ">= 0") <= 10:
        raise CostModelError(f"{where}: ranking_error={hw.ranking_error!r} must be in [0, 10] (a "
                             f"fraction of a plan's predicted step: 0.25 for 25%).")
    for field in _SIZES:
        if _number(where, field, getattr(hw, field), ">= 0") < 0:
            raise CostModelError(f"{where}: {field}={getattr(hw, field)!r} must be >= 0 bytes.")
    for field in ("intra_node", "inter_node"):
        if not isinstance(getattr(hw, field), Link):
            raise CostModelError(f"{where}: {field}={getattr(hw, field)!r} must be a "
                                 f"cost_models.Link(name, bandwidth_bytes_per_s, latency_s).")


def _number(where: str, field: str, v: Any, rule: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise CostModelError(f"{where}: {field}={v!r} must be a finite number {rule}; fix the "
                             f"{field!r} figure of the profile.")
    return float(v)


def _check_rate(where: str, field: str, v: Any) -> None:
    x = _number(where, field, v, "> 0")
    if x <= 0:
        raise CostModelError(f"{where}: {field}={v!r} must be > 0 (a rate per second; zero or a "
                             f"negative rate would divide by zero or plan negative times).")
    if x < MIN_RATE:
        raise CostModelError(f"{where}: {field}={v!r} is below {MIN_RATE:g} per second, slower "
                             f"than any device; check the unit (FLOP/s and bytes/s, not T or G).")


def _check_fraction(where: str, field: str, v: Any) -> None:
    x = _number(where, field, v, "in (0, 1]")
    if not MIN_EFFICIENCY <= x <= 1:
        raise CostModelError(f"{where}: {field}={v!r} must be in [{MIN_EFFICIENCY:g}, 1]: the "
                             f"fraction of the peak reached in practice, e.g. 0.75 (not a "
                             f"percentage).")


def _check_factor(where: str, field: str, v: Any) -> None:
    x = _number(where, field, v, "> 0")
    if not MIN_EFFICIENCY <= x <= 1 / MIN_EFFICIENCY:
        raise CostModelError(f"{where}: {field}={v!r} must be a bandwidth factor in "
                             f"[{MIN_EFFICIENCY:g}, {1 / MIN_EFFICIENCY:g}], e.g. 0.6.")


def _check_floor(where: str, field: str, v: Any) -> None:
    x = _number(where, field, v, ">= 0")
    if x < 0:
        raise CostModelError(f"{where}: {field}={v!r} must be >= 0 seconds; a negative time "
                             f"would make communication or launches look like a gain.")
    if x > MAX_SECONDS:
        raise CostModelError(f"{where}: {field}={v!r} seconds is over {MAX_SECONDS:g} s, not a "
                             f"latency or launch time; check the unit (seconds, not us or ns).")


def _check_count(where: str, field: str, v: Any) -> int:
    x = _number(where, field, v, ">= 1")
    if x < 1 or x != int(x):
        raise CostModelError(f"{where}: {field}={v!r} must be a whole number >= 1.")
    return int(x)


def _check_name(where: str, field: str, v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise CostModelError(f"{where}: {field}={v!r} must be a non-empty string.")


def _pairs(where: str, field: str, m: Any) -> tuple[tuple[str, Any], ...]:
    """A table given as a mapping or as (key, value) pairs, as a tuple of pairs."""
    items = m.items() if isinstance(m, Mapping) else m
    try:
        pairs = tuple((k, v) for k, v in items)
    except (TypeError, ValueError):
        raise CostModelError(f"{where}: {field}={m!r} must map names to values, e.g. "
                             f"{{'float32': 67e12, 'bfloat16': 989e12}}.") from None
    for k, _ in pairs:
        _check_name(where, f"a key of {field}", k)
    return pairs


def _check_keys(where: str, d: Any, known, required) -> None:
    if not isinstance(d, Mapping):
        raise CostModelError(f"{where} must be a JSON object of fields {list(known)}; got "
                             f"{type(d).__name__} {d!r:.80}.")
    unknown = sorted(set(d) - set(known), key=str)
    if unknown:
        raise CostModelError(f"{where} has unknown fields {unknown}; known fields: "
                             f"{sorted(known)}.")
    missing = [k for k in required if k not in d]
    if missing:
        raise CostModelError(f"{where} lacks the required fields {missing}; see a shipped "
                             f"profile (cost_models/profiles/h100.json) for each one's meaning.")
