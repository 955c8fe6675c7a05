"""``autopar.verify``: hold a compiled executable to the plan it was built from.

    report = autopar.verify(step.plan, step.lower(state, batch).compile())
    print(report)            # predicted against measured, per collective kind, memory, HBM bytes
    assert report.ok, report.deviations

What is compared (all per device, per step):

  * bytes moved by each collective kind, read from the compiled HLO (``autopar.hlo``): a
    collective inside a loop counts its trip count times, sized as HLO sizes it (result shape
    for all-reduce, all-gather, all-to-all and collective-permute; operand shape for
    reduce-scatter), a backend-decomposed reduce-scatter (all-reduce + local slice) as the
    reduce-scatter it is. The plan's ``cost.comm_bytes_by_kind`` counts the same way.
  * peak memory: XLA's ``memory_analysis()`` arguments + outputs + temporaries - donated aliases
    (what the executable holds at once) against ``cost.peak_memory_bytes``; for a plan that
    recomputes (``Plan.recompute``) that is the rewritten step's, as codegen builds it.
  * host memory, where the plan holds state there (``Plan.offload``) or the executable does:
    the arguments and results in ``pinned_host`` memory (``hlo.memory``'s ``host``) against
    the offload decisions' ``host_bytes``.
  * HBM traffic: ``cost_analysis()["bytes accessed"]`` against ``cost.hbm_bytes``. XLA counts a
    loop body once, whatever its trip count; the comparison says so when the step has loops.

A check passes when ``|predicted - measured| <= tolerance * measured``; a kind the plan never
predicted passes only if what XLA moves of it stays under ``tolerance`` of all measured
collective bytes (and symmetrically). Each failed collective check names the ops that deviate
most: the module path both sides share (``hlo.scope_key``) and the source line of the user's
code the plan attributes it to.
"""
from __future__ import annotations

import dataclasses
import html
from collections import defaultdict

from autopar import hlo
from autopar.plan import Plan

COMM_TOLERANCE = 0.25
MEMORY_TOLERANCE = 0.10
HBM_TOLERANCE = 0.20


@dataclasses.dataclass(frozen=True)
class Check:
    """One predicted figure against its measured counterpart."""

    metric: str              # "all-gather bytes", "peak memory", "host memory", "HBM bytes"
    predicted: float
    measured: float
    tolerance: float
    ok: bool | None          # None: not comparable (the note says why); it does not pass
    note: str = ""

    @property
    def error(self) -> float:
        """(predicted - measured) / measured; inf when only the prediction is non-zero."""
        if self.measured:
            return (self.predicted - self.measured) / self.measured
        return 0.0 if not self.predicted else float("inf")


@dataclasses.dataclass(frozen=True)
class Deviation:
    """Where a collective kind's bytes differ: one module path, predicted and measured bytes."""

    kind: str
    scope: str
    predicted: float
    measured: float
    source: str


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    checks: tuple[Check, ...]
    deviations: tuple[Deviation, ...]
    collectives: tuple[hlo.HloCollective, ...]
    memory: dict

    @property
    def ok(self) -> bool:
        """Every comparable check passed (a check that cannot be compared is listed, not
        passed)."""
        return all(c.ok for c in self.checks if c.ok is not None)

    def check(self, metric: str) -> Check:
        return next(c for c in self.checks if c.metric == metric)

    def __str__(self) -> str:
        lines = [f"autopar.verify: {'OK' if self.ok else 'DEVIATES'}",
                 f"{'metric':<28} {'predicted':>12} {'measured':>12} {'error':>8}  tolerance"]
        for c in self.checks:
            err = "-" if c.error == float("inf") else f"{c.error:+.1%}"
            flag = _FLAG[c.ok]
            lines.append(f"{c.metric:<28} {_size(c.predicted):>12} {_size(c.measured):>12} "
                         f"{err:>8}  {c.tolerance:.0%} {flag} {c.note}".rstrip())
        if self.deviations:
            lines.append("largest deviations (kind, module path, predicted, measured, source):")
            for d in self.deviations:
                lines.append(f"  {d.kind:<18} {d.scope[:48]:<48} {_size(d.predicted):>10} "
                             f"{_size(d.measured):>10}  {d.source}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(c.metric)}</td><td>{_size(c.predicted)}</td>"
            f"<td>{_size(c.measured)}</td><td>{_FLAG[c.ok]}</td>"
            f"<td>{html.escape(c.note)}</td></tr>" for c in self.checks)
        return (f"<div><b>autopar.verify</b> {'OK' if self.ok else 'DEVIATES'}<table><tr>"
                f"<th>metric</th><th>predicted</th><th>measured</th><th>check</th><th>note</th>"
                f"</tr>{rows}</table></div>")


_FLAG = {True: "ok", False: "FAIL", None: "not compared"}


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _relative_ok(pred: float, meas: float, tol: float, floor: float = 0.0) -> bool:
    if meas:
        return abs(pred - meas) <= tol * meas
    return pred <= floor


def _comm_checks(plan: Plan, colls, tol: float) -> list[Check]:
    predicted = dict(plan.cost.comm_bytes_by_kind)
    measured = hlo.bytes_by_kind(colls)
    total = sum(measured.values()) + sum(predicted.values())
    out = []
    for kind in hlo.COLLECTIVE_KINDS:
        p, m = predicted.get(kind, 0.0), measured.get(kind, 0.0)
        if not p and not m:
            continue
        # a kind only one side has passes while it stays a small share of all the bytes
        ok = _relative_ok(p, m, tol) or (min(p, m) == 0 and max(p, m) <= tol * 0.1 * total)
        out.append(Check(f"{kind} bytes", p, m, tol, ok))
    return out


def _deviations(plan: Plan, colls, failed: set[str], top: int) -> list[Deviation]:
    pred: dict[tuple[str, str], float] = defaultdict(float)
    meas: dict[tuple[str, str], float] = defaultdict(float)
    where: dict[tuple[str, str], str] = {}
    for c in plan.collectives:
        key = (c.kind, hlo.scope_key(c.name))
        pred[key] += c.nbytes * c.count
        where.setdefault(key, c.source)
    for c in colls:
        key = (c.kind, hlo.scope_key(c.op_name, hlo_op_name=True))
        meas[key] += c.nbytes * c.count
        where.setdefault(key, c.source)
    keys = [k for k in set(pred) | set(meas) if k[0] in failed]
    keys.sort(key=lambda k: -abs(pred[k] - meas[k]))
    return [Deviation(k[0], k[1] or "(step inputs/outputs)", pred[k], meas[k], where.get(k, ""))
            for k in keys[:top] if abs(pred[k] - meas[k]) > 0]


def verify(plan: Plan, compiled, *, comm_tolerance: float = COMM_TOLERANCE,
           memory_tolerance: float = MEMORY_TOLERANCE, hbm_tolerance: float = HBM_TOLERANCE,
           top: int = 8) -> VerifyReport:
    """Compare ``compiled`` (``jax.stages.Compiled``, e.g. ``step.lower(...).compile()``) with
    ``plan``. See the module docstring for what is compared and how."""
    module = hlo.parse(compiled.as_text())
    colls = tuple(hlo.collectives(module))
    checks = _comm_checks(plan, colls, comm_tolerance)
    mem = hlo.memory(compiled)
    if mem:
        p, m = plan.cost.peak_memory_bytes, mem["peak"]
        checks.append(Check("peak memory", p, m, memory_tolerance,
                            _relative_ok(p, m, memory_tolerance)))
        p, m = sum(o.host_bytes for o in plan.offload), mem["host"]
        if p or m:
            checks.append(Check("host memory", p, m, memory_tolerance,
                                _relative_ok(p, m, memory_tolerance)))
    measured_hbm = hlo.cost(compiled).get("bytes accessed", 0.0)
    if any(ins.opcode == "while" for comp in module.computations.values() for ins in comp):
        checks.append(Check("HBM bytes", plan.cost.hbm_bytes, measured_hbm, hbm_tolerance, None,
                            "XLA's cost_analysis counts a loop body once"))
    else:
        checks.append(Check("HBM bytes", plan.cost.hbm_bytes, measured_hbm, hbm_tolerance,
                            _relative_ok(plan.cost.hbm_bytes, measured_hbm, hbm_tolerance)))
    failed = {c.metric.removesuffix(" bytes") for c in checks if c.ok is False}
    return VerifyReport(tuple(checks), tuple(_deviations(plan, colls, failed, top)), colls, mem)
