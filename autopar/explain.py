"""Readable views of a plan: the text summary and the notebook HTML."""
from __future__ import annotations

import html as _html
from collections import defaultdict

from autopar.sharding import to_spec


def param_rows(plan):
    """(path, shape, spec) per input, in argument order."""
    return [(p, tuple(s), str(to_spec(sh)))
            for p, s, sh in zip(plan.input_paths, plan.input_shapes, plan.input_shardings)]


def collective_rows(plan):
    """(kind, axes, count, total time) aggregated."""
    agg = defaultdict(lambda: [0, 0.0])
    for c in plan.collectives:
        key = (c.kind, ",".join(c.axes))
        agg[key][0] += 1
        agg[key][1] += c.time_s
    return sorted(((k, a, n, t) for (k, a), (n, t) in agg.items()), key=lambda r: -r[3])


def gap_text(stats) -> str:
    """``gap 0.00%``, or why the gap is unknown."""
    if stats.gap is not None:
        return f"gap {stats.gap:.2%}"
    if stats.candidates:
        return "gap unknown (only candidates were searched)"
    return "gap unknown (a start's plan beat the solver's)"


def _over(stats) -> str:
    n = getattr(stats, "candidates", 0)
    folded = getattr(stats, "folded", 0)
    return ((f" over the best {n} candidate strategies of each group" if n else "")
            + (f", with {folded} copies of a repeated layer folded into one (ir.fold)"
               if folded else ""))


def kernel_rows(plan):
    """(kernel, split, per-shard specs, predicted kernel ms, XLA ms, speedup, source) per kernel."""
    rows = []
    for k in plan.kernels:
        split = ", ".join(f"{n}={'+'.join(a)}" for n, a in k.split if a) or "whole"
        specs = "; ".join(f"{a} {s} {tuple(shape)}" for a, s, shape in k.specs)
        speed = f"{k.xla_s / k.kernel_s:.1f}x" if k.kernel_s else "-"
        rows.append((k.kernel, split, specs, k.kernel_s * 1e3, k.xla_s * 1e3, speed,
                     k.sources[0] if k.sources else ""))
    return rows


def _kernel_lines(plan, max_rows: int) -> list[str]:
    """Kernels with the same kernel, split and source line on one row (``xN``), their times
    summed; the specs of the first."""
    if not plan.kernels:
        return []
    groups: dict[tuple, list] = {}
    for name, split, specs, k_ms, x_ms, _, src in kernel_rows(plan):
        g = groups.setdefault((name, split, src), [0, 0.0, 0.0, specs])
        g[0] += 1
        g[1] += k_ms
        g[2] += x_ms
    lines = ["", f"{'kernel':<14} {'split':<28} {'kernel':>10} {'XLA ops':>10} {'gain':>6}  "
                 f"source / per-shard specs"]
    for (name, split, src), (n, k_ms, x_ms, specs) in list(groups.items())[:max_rows]:
        label = f"{name} x{n}" if n > 1 else name
        gain = f"{x_ms / k_ms:.1f}x" if k_ms else "-"
        lines.append(f"{label:<14} {split[:28]:<28} {k_ms:>7.3f} ms {x_ms:>7.3f} ms {gain:>6}  "
                     f"{src}")
        lines.append(f"{'':<14} {specs}")
    if len(groups) > max_rows:
        lines.append(f"... {len(groups) - max_rows} more kernel rows")
    return lines


def summary(plan, max_rows: int = 40) -> str:
    lines = [f"autopar plan  strategy={plan.strategy}  mesh={dict(plan.mesh)}  "
             f"hardware={plan.hardware}",
             f"predicted: {plan.cost}",
             f"solver: {plan.solver.status}, {gap_text(plan.solver)}{_over(plan.solver)}, "
             f"{plan.solver.num_groups} decision groups, trace {plan.solver.trace_s:.2f}s + "
             f"build {plan.solver.build_s:.2f}s + solve {plan.solver.solve_s:.2f}s", ""]
    header = f"{'input':<64} {'shape':<22} spec"
    lines += mesh_candidate_lines(plan)
    lines += tuned_lines(plan)
    lines += constraint_lines(plan)
    if plan.notes:
        lines += ["not placed as the strategy intends:"] + [f"  {n}" for n in plan.notes] + [""]
    rows = param_rows(plan)
    lines.append(header)
    for p, s, spec in rows[:max_rows]:
        lines.append(f"{p[:64]:<64} {str(s):<22} {spec}")
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more inputs")
    lines += ["", f"{'collective':<16} {'axes':<14} {'count':>6} {'time':>12}"]
    for kind, axes, n, t in collective_rows(plan):
        lines.append(f"{kind:<16} {axes:<14} {n:>6} {t * 1e3:>9.3f} ms")
    lines += _recompute_lines(plan)
    lines += _offload_lines(plan)
    lines += _kernel_lines(plan, max_rows)
    lines += _rejected_lines(plan, max_rows)
    lines += _fallback_lines(plan, max_rows)
    return "\n".join(lines)


def mesh_candidate_lines(plan) -> list[str]:
    """The mesh shapes tried where ``mesh=`` left the shape open, the chosen one first."""
    if not plan.mesh_candidates:
        return []
    lines = [f"mesh chosen among {len(plan.mesh_candidates)} shapes (predicted step, peak):"]
    for k, c in enumerate(plan.mesh_candidates):
        shape = " x ".join(f"{a}={n}" for a, n in c.mesh)
        if c.step_time_s is None:
            what = f"no plan: {c.error.splitlines()[0][:100]}"
        else:
            what = (f"{c.step_time_s * 1e3:.3f} ms, {c.peak_memory_bytes / 2**20:.2f} MiB"
                    + ("   <- chosen" if k == 0 else
                       f"   ({c.step_time_s / plan.mesh_candidates[0].step_time_s:.2f}x)"))
        lines.append(f"  {shape:<28} {what}")
    return lines + [""]


def constraint_lines(plan) -> list[str]:
    """The step's own sharding constraints (``Plan.constraints``): how many the plan follows,
    and each one it does not, with the layout it runs instead."""
    if not plan.constraints:
        return []
    other = [c for c in plan.constraints if not c.followed]
    lines = [f"the step's own sharding constraints: {len(plan.constraints) - len(other)} of "
             f"{len(plan.constraints)} followed" + (", not followed (asked -> planned):"
                                                    if other else "")]
    lines += [f"  {c.source}: {c.asked} -> {c.planned}" for c in other]
    return lines + [""]


def tuned_lines(plan) -> list[str]:
    """The plans a tuned step timed before choosing (``autoparallel(tune=...)``), chosen first."""
    if not plan.tuned:
        return []
    timed = [c for c in plan.tuned if c.measured_s is not None]
    programs = sum(not c.same_as for c in timed)
    lines = [f"chosen by timing {len(timed)} plans ({programs} programs) on the step's "
             f"arguments (predicted, measured median):" if timed else
             "tuned: no other plan was near enough to time (predicted):"]
    for k, c in enumerate(plan.tuned):
        if c.measured_s is None:        # a strategy that did not plan has no step
            what = ((f"{c.step_time_s * 1e3:.3f} ms, " if c.step_time_s > 0 else "")
                    + c.error.splitlines()[0][:100])
        else:
            what = (f"{c.step_time_s * 1e3:.3f} ms, {c.measured_s * 1e3:.3f} ms"
                    + ("   <- chosen" if k == 0 else
                       f"   ({c.measured_s / plan.tuned[0].measured_s:.2f}x)")
                    + (f"   same program as {c.same_as}" if c.same_as else ""))
        lines.append(f"  {c.strategy:<14} {what}")
    return lines + [""]


def rejected_rows(plan):
    """(kernel, reason, count, module path, source) per kind of match the plan left to XLA
    (``Plan.rejected_kernels``; reasons alike but for op and value ids are one kind, shown by
    its first), most frequent first."""
    groups: dict[tuple[str, str], list] = {}
    for r in plan.rejected_kernels:
        g = groups.setdefault((r.kernel, _generic(r.reason)), [0, r])
        g[0] += 1
    rows = [(k, first.reason, n, first.module, first.sources[0] if first.sources else "")
            for (k, _), (n, first) in groups.items()]
    return sorted(rows, key=lambda row: -row[2])


def _generic(reason: str) -> str:
    """A reason without the op and value ids that differ from layer to layer."""
    import re

    return re.sub(r"%\d+", "%N", re.sub(r"\bop\d+( [\w-]+)?", "opN", reason))


def _rejected_lines(plan, max_rows: int) -> list[str]:
    rows = rejected_rows(plan)
    if not rows:
        return []
    lines = ["", f"{len(plan.rejected_kernels)} kernel sites left to XLA's ops:",
             f"{'kernel':<14} {'count':>5}  where (first) / why"]
    for kernel, why, n, module, src in rows[:max_rows]:
        lines.append(f"{kernel:<14} {n:>5}  {module or '(no module path)'} @ "
                     f"{src or '(no source)'}")
        lines.append(f"{'':<21}{why}")
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more rows")
    return lines


def fallback_rows(plan):
    """(primitive, source, reason, count, op ids) per kind of op run replicated for want of a
    way to shard it (``Plan.replicated_fallbacks``), most frequent first."""
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for op_id, prim, src, reason in plan.replicated_fallbacks:
        groups[(prim, src, reason)].append(op_id)
    return sorted(((p, s, r, len(ids), tuple(ids)) for (p, s, r), ids in groups.items()),
                  key=lambda row: -row[3])


def _fallback_lines(plan, max_rows: int) -> list[str]:
    rows = fallback_rows(plan)
    if not rows:
        return []
    n = sum(r[3] for r in rows)
    lines = ["", f"{n} ops run replicated for want of a sharding (every input gathered, every "
                 f"output whole):", f"{'primitive':<24} {'count':>5}  {'reason':<30} source"]
    for prim, src, reason, count, _ in rows[:max_rows]:
        lines.append(f"{prim:<24} {count:>5}  {reason:<30} {src or '(no source)'}")
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more rows")
    return lines


def _recompute_lines(plan) -> list[str]:
    """The memory decisions (``Plan.recompute``): what the backward pass recomputes."""
    lines = []
    ruled = plan.solver.ruled_out
    if ruled is not None:
        lines = ["", f"the memory budget binds: the {ruled[0]!r} start is predicted "
                     f"{plan.cost.step_time_s / ruled[1]:.2f}x faster than this plan but needs "
                     f"{ruled[2] / 2**30:.3f} GiB per device"]
    if not plan.recompute:
        return lines
    budget = plan.cost.memory_budget_bytes
    traded = budget is not None and all(
        r.no_recompute_peak_bytes is not None and r.no_recompute_peak_bytes <= budget
        for r in plan.recompute)
    why = ("faster than the best plan without it, whose layouts the budget bound" if traded
           else "the plan does not fit its budget without")
    return lines + ["", f"recomputed in the backward pass ({why}):"] + [
        f"  {r}" for r in plan.recompute]


def offload_text(plan, max_rows: int = 8) -> list[str]:
    """The host offload decision (``Plan.offload``), one line per group and a total."""
    if not plan.offload:
        return []
    rows = [str(o) for o in plan.offload]
    host = sum(o.host_bytes for o in plan.offload)
    moved = sum(o.transfer_s for o in plan.offload)
    before = plan.offload[0].no_offload_peak_bytes
    head = (f"held in host memory between steps (the plan does not fit its budget without"
            f"{'' if before is None else f'; its best peak without is {before / 2**30:.3g} GiB'}"
            f"): {sum(len(o.inputs) for o in plan.offload)} arguments in {len(rows)} groups, "
            f"{host / 2**30:.3g} GiB/device, moved in and out in {moved * 1e3:.3f} ms per step")
    more = [f"  ... {len(rows) - max_rows} more groups"] if len(rows) > max_rows else []
    return [head] + [f"  {r}" for r in rows[:max_rows]] + more


def _offload_lines(plan) -> list[str]:
    lines = offload_text(plan)
    return [""] + lines if lines else []


def html(plan) -> str:
    """The plan as an HTML table; every piece of text is escaped (a plan may come from a file)."""
    esc = _esc
    rows = "".join(f"<tr><td><code>{esc(p)}</code></td><td>{esc(s)}</td><td><code>{esc(spec)}"
                   f"</code></td></tr>" for p, s, spec in param_rows(plan))
    coll = "".join(f"<tr><td>{esc(k)}</td><td>{esc(a)}</td><td>{esc(n)}</td>"
                   f"<td>{esc(f'{t * 1e3:.3f}')} ms</td></tr>"
                   for k, a, n, t in collective_rows(plan))
    kern = "".join(f"<tr><td>{esc(n)}</td><td>{esc(sp)}</td><td><code>{esc(specs)}</code></td>"
                   f"<td>{esc(f'{k:.3f}')} ms</td><td>{esc(f'{x:.3f}')} ms</td><td>{esc(g)}</td>"
                   f"<td>{esc(src)}</td></tr>"
                   for n, sp, specs, k, x, g, src in kernel_rows(plan))
    kern = (f"<table><tr><th>kernel</th><th>split</th><th>per-shard specs</th><th>kernel</th>"
            f"<th>XLA ops</th><th>gain</th><th>source</th></tr>{kern}</table>" if kern else "")
    left = "".join(f"<tr><td>{esc(k)}</td><td>{esc(n)}</td><td><code>{esc(m)}</code> "
                   f"{esc(src)}</td><td>{esc(why)}</td></tr>"
                   for k, why, n, m, src in rejected_rows(plan))
    kern += (f"<table><tr><th>left to XLA</th><th>count</th><th>where (first)</th><th>why</th>"
             f"</tr>{left}</table>" if left else "")
    again = "".join(f"<li>{esc(r)}</li>" for r in plan.recompute)
    again = f"recomputed in the backward pass:<ul>{again}</ul>" if again else ""
    host = offload_text(plan)
    if host:
        again += (f"{esc(host[0])}<ul>" + "".join(f"<li>{esc(r.strip())}</li>" for r in host[1:])
                  + "</ul>")
    for shapes in (mesh_candidate_lines(plan), tuned_lines(plan), constraint_lines(plan)):
        if shapes:
            again += (f"{esc(shapes[0])}<ul>" + "".join(f"<li>{esc(r.strip())}</li>"
                                                        for r in shapes[1:] if r) + "</ul>")
    return (f"<div><b>autopar plan</b> strategy={esc(plan.strategy)} mesh={esc(dict(plan.mesh))} "
            f"hardware={esc(plan.hardware)}<br>{esc(plan.cost)}<br>{again}"
            f"<table><tr><th>input</th><th>shape</th><th>spec</th></tr>{rows}</table>"
            f"<table><tr><th>collective</th><th>axes</th><th>count</th><th>time</th></tr>{coll}"
            f"</table>{kern}</div>")


def _esc(x) -> str:
    return _html.escape(str(x), quote=True)
