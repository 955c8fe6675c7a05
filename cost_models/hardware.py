"""Hardware profiles: the figures the cost model reads, as frozen, JSON-serialisable data.

A ``Hardware`` describes one kind of device and how devices are wired:

  * ``peak_flops_by_dtype``: dense peak FLOP/s of one device per dtype (data sheet, or measured).
  * ``hbm_bytes_per_s``: device memory bandwidth; ``memory_bytes``: device memory capacity.
  * ``devices_per_node``: devices joined by the fast ``intra_node`` link; groups that span
    several nodes pay the ``inter_node`` link.
  * ``*_efficiency``: the fraction of a peak reached in practice (fitted by ``profile()``).
  * ``dispatch_s``: launching one whole compiled program on every device (paid once per step);
  * ``kernel_launch_s``: fixed cost of one kernel; ``collective_launch_s``: fixed cost of one
    collective on top of its per-ring-step ``latency_s`` (host-side synchronisation dominates it
    on CPU devices; near 0 on GPUs, where NCCL's per-step latency is the whole alpha term).
  * ``citations``: for each figure, the document (or measurement) it comes from.

Shipped profiles live in ``cost_models/profiles/<name>.json``; ``hardware(name)`` loads one.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

PROFILE_NAMES: tuple[str, ...] = ("a100", "h100", "h200", "cpu")
# Dtype whose figure stands in for dtypes a profile does not list (see peak_flops_per_s).
FALLBACK_DTYPE = "float32"


class CostModelError(ValueError):
    """A cost-model input is malformed: unknown profile, axis, collective kind or dtype table."""


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Link:
        return Link(str(d["name"]), float(d["bandwidth_bytes_per_s"]), float(d["latency_s"]))


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
    kernel_launch_s: float = 5e-6
    collective_launch_s: float = 0.0
    dispatch_s: float = 0.0          # launching one compiled program (once per step, not per op)
    source: str = ""
    citations: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
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
        kw = dict(d)
        kw["peak_flops_by_dtype"] = _pairs(kw["peak_flops_by_dtype"], float)
        kw["collective_kind_efficiency"] = _pairs(kw.get("collective_kind_efficiency", {}), float)
        kw["citations"] = _pairs(kw.get("citations", {}), str)
        kw["intra_node"] = Link.from_dict(kw["intra_node"])
        kw["inter_node"] = Link.from_dict(kw["inter_node"])
        kw["memory_bytes"] = int(kw["memory_bytes"])
        kw["devices_per_node"] = int(kw["devices_per_node"])
        names = {f.name for f in dataclasses.fields(Hardware)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise CostModelError(
                f"Hardware JSON has unknown fields {unknown}; known fields: {sorted(names)}."
            )
        return Hardware(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @staticmethod
    def from_json(text: str) -> Hardware:
        return Hardware.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Hardware:
        with open(path) as f:
            return Hardware.from_json(f.read())

    def is_finite(self) -> bool:
        """True when every number in the profile is finite and positive (latencies may be 0)."""
        rates = [v for _, v in self.peak_flops_by_dtype] + [self.hbm_bytes_per_s]
        rates += [self.intra_node.bandwidth_bytes_per_s, self.inter_node.bandwidth_bytes_per_s]
        rest = [self.intra_node.latency_s, self.inter_node.latency_s, self.kernel_launch_s]
        rest.append(self.collective_launch_s)
        return all(math.isfinite(v) and v > 0 for v in rates) and all(
            math.isfinite(v) and v >= 0 for v in rest
        )


def _pairs(m: Mapping[str, Any], cast: type) -> tuple[tuple[str, Any], ...]:
    return tuple((str(k), cast(v)) for k, v in m.items())


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
    text = os.fspath(spec)
    if text.lower() in PROFILE_NAMES:
        data = resources.files("cost_models").joinpath(f"profiles/{text.lower()}.json")
        return Hardware.from_json(data.read_text())
    if os.path.isfile(text):
        return Hardware.load(text)
    raise CostModelError(
        f"hardware({text!r}): not a profile name and not a file. Known profiles: "
        f"{list(PROFILE_NAMES)}; or pass the path of a JSON file written by Hardware.save()."
    )
