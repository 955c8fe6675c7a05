"""Per-device peak memory of a chosen plan, counted the way XLA allocates it.

XLA gives a step's arguments and results buffers of their own for the whole execution (a
result that aliases a donated argument shares its buffer) and serves every other buffer from
one pool of temporaries, whose size is the largest set of temporaries live at once. So the
footprint ``memory_analysis()`` reports is arguments + results + temporaries - aliases, and
that is what ``estimate`` predicts:

  * resident: the per-device bytes of arguments, constants and non-aliased results under the
    chosen layouts; a result that replaces an argument leaves the step in that argument's layout
    (``_result_sizer``), so its buffer has the argument's size;
  * temporaries, walked over the top-level schedule: every value a kernel writes to memory
    (``ir.fusion``; fused intermediates never exist) from its producer to its last reader, in
    its chosen layout; every broadcast buffer XLA:CPU writes for a reduction
    (``Fusion.broadcasts``); every resharded copy a transition makes (a value moved to the
    layout a reader needs, shared by all readers that need the same layout, as XLA shares
    identical reshards) from its first to its last reader, but for a local slice of a value no
    kernel writes, read by fusing kernels (``_never_written``); at a loop's position, the values
    live at the peak of its body, and the buffers of the body's reductions
    (``_loop_reductions``); on XLA:CPU, the transposed operand copies its convolution
    canonicalization makes (``_conv_transposes``: a kernel gradient's input, from the value's
    first reader) and its layout assignment makes of a dot's operand whose dimensions are not in
    the order the dot emitter takes (``_dot_transposes``: from the value's first reader, or as
    soon as the resharded copy it reads exists), which replace the kernel's read of the value or
    of its resharded copy;
    not the values XLA computes only in slices of them (``_recomputed_in_slices``), nor the
    broadcast buffers no other reader makes alike (another layout, or another buffer of the
    broadcast operand: ``_unshared_broadcasts``);
  * results' buffers reused: XLA's buffer assignment puts a temporary into a result's buffer
    when it fits and dies before the result is written (``_pooled``), so only the rest count
    towards the pool. A loop's results are placed the same way: XLA colocates a loop's result
    with its carry, and that buffer goes into a result's allocation when it fits (a scanned
    model's stacked forward activations share the updated parameters' buffers).

Measured by ``autopar.verify`` over the matrix of ``benchmarks/verify_matrix.py`` (results in
``benchmarks/results/verify_matrix.md``). What the memory checks showed, read from XLA's buffer
assignments: a layer norm's ``x - mean`` is recomputed in its readers, the residual stream and
the row statistics stay (``ir.fusion``'s rules); a reduction's broadcast buffer exists only when
XLA:CPU's library fusion runs the reduction (``_fused_broadcasts``). Known gaps: XLA's own
schedule is not modelled (ours is the traced order), nor collectives' buffers outside loop bodies
beyond the resharded copies. Among those: XLA's combiners merge the top-level reductions of one
level over one device group into one call that runs once its last operand is written, so a
backward pass's weight gradients stay whole (unreduced) until its end; the model frees each at
its op. Where weights outweigh activations (``make demo``'s GPT, d_model 128, d_ff 512, 2x4)
that under-predicts zero3 at 0.81 of XLA's peak and auto at 0.89 (the "GPT wide unrolled" rows
of ``benchmarks/results/verify_matrix.md``). Counting it (tried and withdrawn: each operand
from its op to the merged call) brings them to 0.99 but needs the ILP's memory
constraint to see it too, and over-counts where XLA's schedule computes a gradient just before
the merged call (scanned GPT 1x8 zero3: 1.09 -> 1.12).
The unrolled GPT's auto plan on 1x8 was under-predicted by 11% for want
of the dots' layout copies (``_dot_transposes``): at XLA's peak (the lm_head's gradients) its weight
gradient reads the gathered (16, 16, vocab) loss cotangent as a transposed copy (128 KiB), XLA holds
the attention's q, k and v only as copies in the attention dots' order and each attention output
kernel transposed for its input gradient, from the top of the step to the backward (here from their
first reader): 0.888 -> 0.938, 2x4 auto 0.94 -> 0.98. What remains at that peak is a third 128 KiB
copy, not modelled: XLA:CPU lays out an all-gather with its gathered dimension most major (the
devices' shards are its contiguous blocks: a gather along dimension 1 of that cotangent has layout
{2,0,1}, of a (64, 3, 4, 16) kernel along its last, {2,1,0,3}, after a copy of the shard into that
layout), so a dot that reads a gather along a later dimension reads a row-major copy of it, and the
gathered cotangent, the input gradient's row-major copy and the weight gradient's transposed one are
live together. The gathered buffer dies as its copies are made, and which of those transients meet
is XLA's schedule: counted beside every copy, they put transients that XLA runs one after another at
one position of ours (two gathers of one MoE activation: 2x2x2 megatron 1.13); counted only beside
two or more copies, the MoE 2x2x2 zero3 plan falls to 0.87. Also not modelled: XLA:CPU's scheduler
runs an instruction whose operands are all arguments or constants at the top of the step, so the
zero buffer of the embedding gradient's scatter-add lives from there to the backward (32 KiB of
XLA's peak in the 4x2 and 2x2x2 auto plans, 0.95 and 0.93; 64 KiB in 2x4 megatron, whose loss's
one-hot scatter runs there too), as do the dots' copies of parameters. XLA:CPU writes a layer norm's
broadcast buffers in the 2x4 zero3 and megatron plans only where a forward product and the backward
reduction broadcast the same buffer to the same per-device shape
(``_unshared_broadcasts``): those plans gather the row statistic over 'data' for the forward
product (made whole, then sliced) while the backward reduction reads it in place, so XLA's CSE
sees two broadcasts of two buffers and the library fusion computes the reduction's in place; the
scale, which both read in one layout, keeps its buffer (XLA's buffers of 2x4 zero3: one broadcast
of the gathered scale per ln2; none for ln1 and ln_f, whose forward products are made in other
layouts). Counted, the row statistics' buffers put zero3 at 1.10 and megatron at 1.12 (1.07 and
1.04 without them). A reduction that broadcasts a local slice of its operand keeps its buffer:
XLA fuses the slice and the broadcast into a loop fusion that writes it (the MoE 2x4 megatron
plan's routing products, 40 KiB each: 0.81 of XLA's peak without them). Those plans also make
a layer norm's ``rsqrt * scale`` unsplit (ln2 in megatron; ln1 and ln_f in zero3) and its forward
and backward products read it split over 'data': a local slice of a value no kernel writes, which
XLA fuses with the value's producer into each reader (``_never_written``). Held as a copy from
the forward pass to the backward, 32 KiB a layer norm that XLA's buffers do not have, it put
megatron at 1.04 and zero3 at 1.07 (0.99 and 1.03 without). An MoE's dispatch and combine
tensors (G, S, E, C), built
elementwise from per-token gates and slots, are never written whole when every kernel that reads
them takes a local slice (the expert dots read them split over more axes than the plan makes
them): XLA fuses the elementwise chain into one dynamic-slice fusion per reader, which computes
its part from the (G, S, E) and (G, S) operands. This model holds the whole tensors: the 2x4
auto plan 1.36 (six 80 KiB tensors at its peak; XLA's buffers hold 20 KiB slices and no
(G, S, E, C) tensor), 2x2x2 auto 1.15, zero3 1.10, dp 1.09. ``_recomputed_in_slices`` drops
such values: 2x4 auto 0.96, 2x2x2 auto 0.94, but 2x2x2 zero3 0.83 and megatron 0.90: there the
over-count hid copies XLA:CPU's scheduler makes early (below; ~150 KiB of backward reshards made
in the forward pass at the zero3 plan's peak). With the early copies held from their source as
well every MoE row is within 10% (zero3 0.92, megatron 1.02, auto 1.07). The conv net's auto
plans (channels split over all 8 devices, the image whole on each) were under-predicted by
19-24% for want of the kernel gradients' transposed inputs (``_conv_transposes``): on 1x8 XLA
holds the image's (48 KiB) from before the forward pass to the end and the gathered pooled
activation's (32 KiB) from the forward pass to the second kernel gradient. With them every conv
net row is within 10%; the auto plans' 0.91 (1x8, 2x4, 4x2) is 252 KiB of temporaries live at
XLA's peak (the first pool's argmax) against our 236 KiB. The all-gather of the pooled
activation along channels, which XLA:CPU lays out with the gathered dimension major, makes it
compute the first pool's operand a second time in that layout (16 KiB; 32 KiB on 2x2x2, 0.93),
not modelled; XLA's pool packs its 252 KiB into 264. ``_pool_gradient_expansion`` counts
XLA:CPU's rewrite of the max-pool gradient. On the 2x2x2 mesh unrolled GPT was under-predicted
by up to 17% (dp 0.89, zero3 0.86, megatron 0.83): those plans split the batch over 'data' and
'expert' and gather forward activations for the backward's weight gradients (the attention
output to the whole batch, 64 KiB a layer in dp; the MLP's hidden activation over 'expert', 64
KiB), and XLA:CPU's scheduler (``BFSMemoryScheduler``: an instruction runs once its operands
have) makes each gather right after its source in the forward pass and holds it to the backward,
where the model made it at its reader. At the dp plan's peak (the lm_head's weight gradient)
XLA's pool held four such gathers (256 KiB) of its 452 KiB; the model held 192 KiB in all.
``_reshard_copies`` now holds a copy that runs a collective from where its source is written
(dp 1.03, zero3 1.04, megatron 1.06; 0.99, 0.98, 0.98 with ``_unshared_broadcasts``, which
also moves their 4x2 rows from 1.02-1.08 to 0.97-1.01). That exposed an over-count on the
2x2x2 auto plan (1.11; temporaries 800 KiB against XLA's 657): the model held two (16, 16, 64)
broadcast buffers per layer norm (10 x 16 KiB, 4096 elements per device) that XLA's buffers do
not have: its backward reductions' library fusions broadcast the row statistic and the scale
in place. The forward readers of those broadcasts make their results in other layouts than the
backward reductions, so no CSE merges them (``_unshared_broadcasts``; 0.99). ``cut_at`` (the
ILP's copy cuts) still counts a copy from its first reader.

The ILP's memory constraint (the layouts family's ``memory`` terms, ``families/layouts.py``)
is the linear part of this model: it checks the live values at the heaviest points of the
schedule (every broadcast buffer included, so it errs on the safe side for small reductions).
Resharded copies exist only for some pairs of two groups' choices, so they enter lazily: when
a solution's full estimate exceeds the budget, ``make_plan`` adds a ``CopyCut`` at its peak
(the values live there and, per copy any plan could hold there, a 0-1 variable that the
source's and readers' choices force on) and solves again, a few rounds at most; it says so
when no round fits.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import Counter

import numpy as np

from autopar.planner.first_fit import Slots
from autopar.planner.problem import Problem, phantoms_at, schedule_of, value_bytes
from autopar.planner.reshard import reshard_steps
from autopar.sharding import shard_factor
from ir.fusion import ABSORBING, FUSIBLE


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    resident: float          # arguments, constants and non-aliased results, per device
    temporaries: float       # the peak of the temporaries' pool, per device
    peak_position: int       # top-level schedule position of that peak

    @property
    def peak(self) -> float:
        return self.resident + self.temporaries


def estimate(prob: Problem, choice) -> MemoryEstimate:
    """The per-device memory of ``prob`` under ``choice`` (group id -> strategy index)."""
    g = prob.graph
    nbytes = _sizer(prob, choice)
    whole = _result_sizer(prob, nbytes)
    resident = sum(whole(v) for v in prob.const_values)
    temps, inner = _schedule(prob)
    if g.host and prob.reshard.cm.hw.platform == "cpu":
        in_place = _memo(prob, "_moved_in_place", lambda: _moved_in_place(g))
        temps = [t for t in temps if t[0] not in in_place]
    fused = _fused_broadcasts(prob, nbytes) | _unshared_broadcasts(prob, choice)
    last = _last_untransposed_reads(prob)
    sliced, held = _recomputed_in_slices(prob, choice)
    temps = [(v, a, max(min(b, last.get(v, b)), held.get(v, -1))) for v, a, b in temps
             if v not in sliced]
    looped = [(a, b, nbytes(v)) for v, a, b in temps if g.ops[a].regions]
    spans = [(a, b, nbytes(v)) for v, a, b in temps if not g.ops[a].regions and v not in fused]
    # a folded graph's removed copies' values live across the gap: a buffer each (ir.fold)
    # ... but for those XLA computes only in slices or never writes, as of the kept copies
    spans += [(a, b, nbytes(v)) for v, a, b, copies in prob.phantoms
              if v not in sliced and v not in fused for _ in range(copies)]
    live = np.zeros(len(g.ops) + 1)
    copies, made = _copy_spans(prob, choice)
    for a, b, size in _pooled(looped + spans + copies
                              + _transposed_operands(prob, choice, nbytes, made),
                              _output_slots(prob, whole)):
        live[a: b + 1] += size
    for t, (ids, _) in inner.items():
        live[t] += sum(nbytes(v) for v in ids if v not in fused)
    for t, size in _loop_reductions(prob, choice).items():
        live[t] += size
    for a, b, size in _pool_gradient_expansion(prob, nbytes):
        live[a: b + 1] += size
    t = int(live.argmax()) if len(live) else 0
    return MemoryEstimate(float(resident), float(live[t]) if len(live) else 0.0, t)


# XLA:CPU hands a reduction to its library (YNNPACK) fusion only when the reduced operand has at
# least this many elements, whatever its type (measured on f32 and bf16 row sums and layer norms);
# a smaller one runs in XLA's own loop fusion, which computes a broadcast operand in place.
LIBRARY_REDUCTION_ELEMENTS = 4096


def _fused_broadcasts(prob: Problem, nbytes) -> set[int]:
    """The broadcast buffers (``Fusion.broadcasts``) XLA:CPU does not write under the plan: those
    whose reduction reads fewer than ``LIBRARY_REDUCTION_ELEMENTS`` elements per device (the
    buffer has the reduced operand's shape). Only ``platform="cpu"``: the buffers are XLA:CPU's."""
    if prob.reshard.cm.hw.platform != "cpu":
        return set()
    f = prob.fusion
    return {v for v, _ in f.broadcasts if v not in f.materialized
            and _elements(prob, v, nbytes) < LIBRARY_REDUCTION_ELEMENTS}


def _unshared_broadcasts(prob: Problem, choice) -> set[int]:
    """The broadcast buffers (``Fusion.broadcasts``) of several readers that XLA:CPU does not
    write under the plan: no other reader makes the reduction's broadcast alike. The single
    buffer is XLA's CSE of identical broadcasts, and two broadcasts are identical only when
    they broadcast the same operand buffer to the same per-device shape: when every other
    reader (a layer norm's forward ``rsqrt * scale``) makes its result in another layout than
    the backward reduction that reads the same broadcast, or reads the broadcast operand in
    another layout (a resharded copy of the row statistic is another buffer), nothing merges
    them, and XLA:CPU's library fusion computes the reduction's own broadcast in place. The
    2x2x2 auto plan of unrolled GPT: XLA writes none of its ten layer-norm buffers, 16 KiB
    each, whose forward readers are split over 'data' or not at all and the backward
    reductions over 'data' and 'expert'; the 2x4 megatron plan gathers each layer norm's row
    statistic over 'data' for the forward product and reads it in place for the backward one:
    XLA writes the scale's broadcasts, which both read in one layout, and none of the row
    statistic's. Not a reduction that broadcasts a local slice of its operand: XLA fuses the
    dynamic-slice and the broadcast into a loop fusion, which writes the buffer (the MoE 2x4
    megatron plan's routing products). A buffer of one reader alone is still counted (the
    loss's (16, 16, vocab) buffers are written). Only ``platform="cpu"``."""
    if prob.reshard.cm.hw.platform != "cpu":
        return set()
    g, gov = prob.graph, prob.group_of_value
    reading = _reading_edges(prob)

    def layout(v: int):
        gid = gov.get(v)
        return None if gid is None else prob.groups[gid].shard[v][choice[gid]]

    def read(op_id: int, u: int):
        """The layout the reader ``op_id`` reads the broadcast operand ``u`` in."""
        hit = reading.get((op_id, u))
        return layout(u) if hit is None else hit[1].need[choice[hit[1].dst]]

    out = set()
    for v, readers, operands in _broadcast_operands(prob):
        mine = layout(v)
        if mine is None:
            continue
        own = next(o for o in readers if g.op(o).outs and g.op(o).outs[0] == v)
        key = (mine, tuple(read(own, u) for u in operands))
        if any(src is not None and need != src and not _communicates(src, need, prob.mesh)
               for src, need in zip((layout(u) for u in operands), key[1])):
            continue    # the reduction broadcasts a local slice: a loop fusion writes it
        others = [o for o in readers if o != own]
        if others and all((w := layout(g.op(o).outs[0])) is not None
                          and (w, tuple(read(o, u) for u in operands)) != key for o in others):
            out.add(v)
    return out


def _broadcast_operands(prob: Problem) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(buffer value, reader op ids, the operands they all broadcast) of each broadcast buffer
    (``Fusion.broadcasts``: readers are grouped by the operand they broadcast and the result
    shape, so every reader reads it; plan-independent)."""
    def make():
        g = prob.graph
        out = []
        for v, readers in prob.fusion.broadcasts:
            shape = g.values[v].shape
            common = set.intersection(*(set(g.op(o).ins) for o in readers))
            operands = tuple(sorted(u for u in common if (have := g.values[u].shape) != shape
                                    and len(have) == len(shape)
                                    and any(a == 1 < b for a, b in zip(have, shape))))
            out.append((v, tuple(readers), operands))
        return out

    return _memo(prob, "_broadcast_operands", make)


def _reading_edges(prob: Problem) -> dict:
    """(reader op id, value) -> (its edge set, the edge) of each top-level or nested read that
    moves a value between groups (plan-independent)."""
    return _memo(prob, "_reading_edges", lambda: {
        (e.op, e.value): (es, e) for es in prob.edge_sets() for e in es if e.op >= 0})


def _recomputed_in_slices(prob: Problem, choice) -> tuple[set[int], dict[int, int]]:
    """(temporaries XLA never writes whole, value -> the position its reads extend to).

    A reader that needs a value split where the plan makes it whole (a transition that is only
    a local slice) reads a dynamic-slice, and XLA fuses the value's producer kernel into that
    slice when the producer is elementwise and every kernel that reads it from memory is such a
    slice or itself fused away: each slice computes only its own part, from the producer's
    operands, and the whole value never exists (an MoE's dispatch and combine tensors, built
    from per-token gates and slots and read split by the expert dots: the 2x4 auto plan's
    480 KiB of whole tensors are 20 KiB slices in XLA's buffers). The producer's operands are
    then read where the slices are made: they live until the last of them."""
    cands, writes = _slice_candidates(prob)
    sliced = set(cands)
    changed = True
    while changed:        # drop values some reader needs whole, until none is left to drop
        changed = False
        for v in list(sliced):
            if not all(_reads_a_slice(prob, choice, v, edges) or kernels and all(
                    writes.get(k) and writes[k] <= sliced for k in kernels)
                    for _, kernels, edges in cands[v][1]):
                sliced.discard(v)
                changed = True
    return sliced, _held_for_slices(sliced, cands, writes)


def _slice_candidates(prob: Problem):
    """The plan-independent part of ``_recomputed_in_slices``: (top-level temporary whose
    producer's kernel has only fusible ops -> (that kernel, its readers in other kernels as
    (position, their kernels, the edges that move the value to them), the values the kernel
    reads), kernel of only fusible top-level ops -> the values it writes). A reader inside a
    loop body has neither kernels nor edges here: it reads the value whole."""
    def make():
        g, f = prob.graph, prob.fusion
        ops_of: dict[int, list] = {}
        for op in g.ops:
            ops_of.setdefault(f.kernel_of.get(op.id), []).append(op)
        fusible = {k for k, ops in ops_of.items() if all(o.prim in FUSIBLE for o in ops)}
        writes = {k: frozenset(w for o in ops_of[k] for w in f.writes.get(o.id, ()))
                  for k in fusible}
        producer = {v: op for op in g.ops for v in op.outs}
        edges: dict[tuple[int, int], list] = {}
        for es in prob.edge_sets():
            for e in es:
                edges.setdefault((e.op, e.value), []).append(e)
        top, pos = {op.id for op in g.ops}, _positions(prob)
        temps, _ = _schedule(prob)
        reads = {k: frozenset(u for o in ops_of[k] for u in f.reads.get(o.id, ()))
                 for k in fusible}
        cands = {v: (k, [], reads[k]) for v, _, _ in temps if v in producer
                 and (k := f.kernel_of.get(producer[v].id)) in fusible}
        for o in g.all_ops():
            for v in set(o.ins) & cands.keys():
                kernels = tuple(f.duplicated.get(o.id) or (f.kernel_of.get(o.id),))
                if o.id not in top:
                    cands[v][1].append((pos[o.id], (), []))
                elif kernels != (cands[v][0],):
                    cands[v][1].append((pos[o.id], kernels, edges.get((o.id, v), [])))
        return cands, writes

    return _memo(prob, "_slice_candidates", make)


def _reads_a_slice(prob: Problem, choice, v: int, edges) -> bool:
    """Every move of ``v`` to the reader (``edges``) is a local slice (no collective)."""
    if not edges:
        return False
    src = prob.groups[edges[0].src].shard[v][choice[edges[0].src]]
    needs = {e.need[choice[e.dst]] for e in edges}
    return src not in needs and all(step.kind == "slice" for n in needs
                                    for step in reshard_steps(src, n, prob.mesh))


def _held_for_slices(sliced: set[int], cands, writes) -> dict[int, int]:
    """Value -> the last position a slice of a value in ``sliced`` reads it: the operands of
    those values' producer kernels, read where each slice is made (a slice of a value read by
    another such kernel is made where that kernel's own slices are)."""
    last: dict[int, int] = {}

    def last_read(v: int) -> int:
        if v not in last:
            at = [0]
            for t, kernels, _ in cands[v][1]:
                made = [w for k in kernels for w in writes.get(k, ()) if w in sliced]
                at += [last_read(w) for w in made] if made else [t]
            last[v] = max(at)
        return last[v]

    held: dict[int, int] = {}
    for v in sliced:
        for u in cands[v][2] - sliced:
            held[u] = max(held.get(u, -1), last_read(v))
    return held


def _moved_in_place(g) -> set[int]:
    """XLA:CPU's host memory is its device memory: a move between the two (``ir.offload``) is
    no copy. A value moved to the device is read where it lies in the host buffer, and a value
    moved to the host is written into the host buffer by its producer: neither is a
    temporary."""
    out = set()
    for op in g.ops:
        if op.prim == "device_put" and op.ins[0] in g.host:
            out.update(op.outs)
        elif op.prim == "device_put" and op.outs[0] in g.host:
            out.add(op.ins[0])
    return out


def _output_slots(prob: Problem, nbytes) -> list[tuple[float, int, int]]:
    """(per-device bytes, schedule position that writes it, last position it is busy before)
    of each result with a buffer of its own (not an argument, constant or a donated argument's
    buffer), largest first."""
    def written_at():
        g = prob.graph
        resident = set(prob.const_values).intersection(g.outputs) - set(g.inputs) - set(g.consts)
        host, busy = set(), {}
        if g.host and prob.reshard.cm.hw.platform == "cpu":
            # XLA:CPU's host memory is its device memory: a result moved to the host is a buffer
            # its pool fills like any other; one that takes a donated argument's buffer, from
            # where the argument was last read (moved to the device) on
            donated = {g.outputs[j]: g.inputs[k] for j, k in prob.output_pairs.items()
                       if g.donated[k]}
            host = (g.host & set(g.outputs)) - set(g.inputs)
            resident |= host
            # ... read in place where its moved copy is (``_moved_in_place``)
            alias = {op.outs[0]: op.ins[0] for op in g.ops
                     if op.prim == "device_put" and op.ins[0] in g.host}
            last = {}
            for t, op in enumerate(g.ops):
                for v in op.ins:
                    last[alias.get(v, v)] = t
            busy = {v: last.get(donated[v], 0) for v in host if v in donated}
        # a folded graph's results stand for their removed twins too (``problem.Problem.gap``:
        # ``const_values`` repeats them): one buffer each, written where the kept one is
        copies = Counter(prob.const_values)
        copies.update(host)
        at = {v: t for t, op in enumerate(g.ops) for v in op.outs}
        for op in g.ops:   # XLA:CPU writes a value it moves to the host into the host buffer
            if op.prim == "device_put" and op.outs[0] in host and op.ins[0] in at:
                at[op.outs[0]] = at[op.ins[0]]
        return [(v, at[v], busy.get(v, -1)) for op in g.ops for v in op.outs
                if v in resident for _ in range(copies[v])]

    memo = _memo(prob, "_written_at", written_at)
    return sorted(((nbytes(v), t, b) for v, t, b in memo), key=lambda s: -s[0])


_REDUCING = ("all-reduce", "reduce-scatter")


def _loop_reductions(prob: Problem, choice) -> dict[int, float]:
    """Top-level position of a loop -> bytes of the reduction buffers its body holds at once.

    XLA:CPU runs a reduce-scatter as an all-reduce and a local slice, and an all-reduce writes
    a buffer of its own: a reduction holds its unreduced operand and its reduced result, both at
    the full per-device size (the comm's bytes). XLA's all-reduce combiner merges the body's
    independent reductions (a backward body's weight gradients) into one, so their buffers are
    live together at the end of the body. (A problem ``restrict`` made keeps no members: its
    groups' leaders stand for them.)"""
    out: dict[int, float] = {}
    for gid, t, strategies in _nested_members(prob):
        comms = strategies[choice[gid]].comms
        # a sum over several split dims is all-reduced dim by dim (rules._all_reduces), each
        # reading the last: one operand and one result buffer at a time
        size = 2 * max((c.nbytes for c in comms if c.kind in _REDUCING), default=0.0)
        if size:
            out[t] = out.get(t, 0.0) + size
    return out


def _nested_members(prob: Problem) -> list[tuple[int, int, tuple]]:
    """(group id, top-level position of its loop, per-strategy list) of each group member that
    runs inside a loop body, in group and member order (plan-independent: an unrolled model's
    tens of thousands of top-level members are skipped once, not per estimate)."""
    def nested():
        g, where = prob.graph, _positions(prob)
        out = []
        for grp in prob.groups:
            for op_id, strategies in (grp.members or {grp.leader: grp.strategies}).items():
                t = where.get(op_id)
                if t is not None and g.ops[t].regions and g.ops[t].id != op_id:
                    out.append((grp.id, t, strategies))
        return out

    return _memo(prob, "_nested_members", nested)


def _pool_gradient_expansion(prob: Problem, nbytes) -> list[tuple[int, int, float]]:
    """(first, last position, per-device bytes) of the buffers XLA:CPU adds for a max-pool's
    gradient, read from its buffer assignment on the conv net.

    XLA:CPU has no select-and-scatter kernel: it rewrites one into a variadic reduce-window that
    finds each window's argmax (over the values and one s32 iota per operand dimension) and a
    scatter of the cotangent into a zero-filled buffer at those indices. The iotas read nothing,
    so its scheduler starts them at the top of the step and they live until the argmax, which
    runs where the forward pool does; the zero buffer likewise lives until the scatter; the
    argmax's s32 indices (one per dimension, the pooled shape in the forward pool's layout, not
    the cotangent's: on 2x2x2 the auto plan's cotangent is split over one more axis) are
    short-lived. Only top-level ops, and only for ``platform="cpu"`` hardware: GPU backends have
    their own select-and-scatter kernel (not measured here)."""
    if prob.reshard.cm.hw.platform != "cpu":
        return []
    g = prob.graph
    pooled_at = {}
    for t, op in enumerate(g.ops):
        if op.prim == "reduce_window_max":
            pooled_at.setdefault(op.ins[0], (t, op.outs[0]))
    spans = []
    for t, op in enumerate(g.ops):
        if op.prim != "select_and_scatter_add":
            continue
        source, operand = op.ins[0], op.ins[1]
        forward, pooled = pooled_at.get(operand, (t, source))
        rank = len(g.values[operand].shape)
        spans.append((0, forward, rank * 4 * _elements(prob, operand, nbytes)))
        spans.append((0, t, nbytes(operand)))
        spans.append((forward, forward, rank * 4 * _elements(prob, pooled, nbytes)))
    return spans


def _elements(prob: Problem, v: int, nbytes) -> float:
    """Per-device element count of value ``v`` under the plan (``nbytes`` over its item size)."""
    val = prob.graph.values[v]
    whole = float(val.nbytes)
    return nbytes(v) / whole * math.prod(val.shape) if whole else 0.0


def _result_sizer(prob: Problem, nbytes):
    """``nbytes`` for the buffers the step holds whole: a result that replaces an argument
    (``output_pairs``) leaves the executable in that argument's layout (the plan's
    ``out_layout``, which codegen passes as ``out_shardings``), so XLA sizes its buffer by the
    argument's layout, however the value was sharded where it was computed."""
    g = prob.graph
    paired = {g.outputs[j]: g.inputs[k] for j, k in prob.output_pairs.items()}
    return lambda v: nbytes(paired.get(v, v))


def _pooled(spans, slots) -> list[tuple[int, int, float]]:
    """The temporaries (first, last position, bytes) XLA serves from its pool of temporaries.

    XLA's buffer assignment visits buffers largest first and puts a temporary into the buffer
    of a result when the buffer is at least as large, the result is written only after the
    temporary's last reader, and no other temporary placed there is live at the same time; only
    the rest share the pool. ``slots``: ``_output_slots``.

    First fit over a bitset index of the buffers (``first_fit.Slots``: one query costs the log
    of the schedule's length, not the number of buffers): an unrolled model's thousands of result
    buffers, tested one by one for each temporary, made this walk grow with the square of the
    depth."""
    smaller = [-cap for cap, _, _ in slots]  # ascending: the slots that fit a size are a prefix
    index = Slots([w for _, w, _ in slots], max([b for _, b, _ in spans], default=0) + 1)
    for k, (_, _, busy) in enumerate(slots):   # a donated argument's buffer, until its last read
        if busy >= 0:
            index.place(k, 0, min(busy, index.size - 1))
    pooled = []
    # a run of equal temporaries (a folded graph's removed copies' value, once per copy) takes
    # the lowest free slots at once: what placing them one by one, first fit, would give
    for (a, b, size), run in itertools.groupby(sorted(spans, key=lambda s: (-s[2], s[0]))):
        n = sum(1 for _ in run)
        free = index.free(a, b, bisect.bisect_right(smaller, -size))
        mask, taken = 0, 0
        while free and taken < n:
            low = free & -free
            free ^= low
            mask |= low
            taken += 1
        if mask:
            index.place_bits(mask, a, b)
        pooled += [(a, b, size)] * (n - taken)
    return pooled


def _sizer(prob: Problem, choice):
    from autopar.planner.scatter import scattered_values

    split = scattered_values(prob, choice)   # all-reduces XLA makes reduce-scatters of

    def nbytes(v: int) -> float:
        if v in prob.group_of_value:
            return float(value_bytes(prob, v)[choice[prob.group_of_value[v]]]) / split.get(v, 1)
        return float(prob.graph.values[v].nbytes)
    return nbytes


def _positions(prob: Problem) -> dict[int, int]:
    """Op id -> the top-level schedule position it runs at (nested ops: their loop's)."""
    def positions():
        where = {}
        for t, op in enumerate(prob.graph.ops):
            stack = [op]
            while stack:
                o = stack.pop()
                where[o.id] = t
                stack.extend(x for r in o.regions for x in r.ops)
        return where

    return _memo(prob, "_positions", positions)


def _schedule(prob: Problem):
    """The plan-independent part: top-level temporaries and loop-body peaks (cached on the
    graph, ``problem.schedule_of``)."""
    return schedule_of(prob.graph, prob.fusion)


def _memo(prob: Problem, key: str, make):
    """A plan-independent fact about ``prob``, computed on first use and kept in its memo
    (``problem.Memo.memory``)."""
    facts = prob.memo.memory
    if key not in facts:
        facts[key] = make()
    return facts[key]


def _copies(prob: Problem, choice):
    """Each resharded copy the plan makes: (its edge set, the source layout, the layout made,
    the reading edges that need it, their schedule positions). XLA makes one copy per layout
    a value's readers need, read where they run."""
    where = _positions(prob)
    for es in prob.edge_sets():
        src = prob.groups[es[0].src].shard[es[0].value][choice[es[0].src]]
        readers: dict = {}
        for e in es:
            need = e.need[choice[e.dst]]
            if need != src and e.op >= 0:
                readers.setdefault(need, []).append(e)
        for need, edges in readers.items():
            yield es, src, need, edges, [where[e.op] for e in edges]


def _reshard_copies(prob: Problem, choice) -> list[tuple[int, int, float]]:
    """(first, last position, per-device bytes) of each resharded copy the plan makes
    (``_copy_spans``)."""
    return _copy_spans(prob, choice)[0]


def _copy_spans(prob: Problem, choice) -> tuple[list[tuple[int, int, float]], dict]:
    """((first, last position, per-device bytes) of each resharded copy the plan makes, held
    from where its source is written (``_written``) to its last reader; (reader op id, value)
    -> where the copy it reads is made, for the readers that read a copy of that copy). A
    convolution or dot that takes the copy in another order reads a transposed copy of it
    instead (``_transposed_operands``). A convolution's is made where the copy's first reader
    runs, and the copy is held to that reader; a dot's is made from the copy as soon as it
    exists (``made``), which does not hold the copy past that.

    On XLA:CPU a copy is made as soon as its source exists, not where its first reader runs:
    its scheduler (``BFSMemoryScheduler``, XLA:CPU's default, optimised for concurrency) runs
    each instruction once its operands have run, in the order they became ready, and the
    collective or slice that makes a copy reads the source alone. A weight gradient that
    reads a forward activation in another layout has the copy made in the forward pass and
    held to the backward (``planner.memory``'s docstring has the figures). Only copies of
    values the step computes, read by top-level ops that are not loops: a copy read inside a
    loop body is made there, each iteration, and a copy of an argument or read by a loop keeps
    its first reader (XLA makes some of those early too; not measured). A copy of a loop's
    result is made after the loop (``_written``). A local slice, which
    XLA fuses into its readers' kernels where it can, stays at its first reader, and so does
    every copy on other platforms (their schedulers were not measured)."""
    moved = _transposed_reads(prob)
    written = _written(prob) if prob.reshard.cm.hw.platform == "cpu" else {}
    fused = _never_written(prob)
    g = prob.graph
    out, made = [], {}
    for es, src, need, edges, at in _copies(prob, choice):
        if es[0].value in fused and not _communicates(src, need, prob.mesh) and all(
                g.op(e.op).prim in ABSORBING for e in edges):
            continue
        dots = [e for e in edges if (e.op, e.value) in moved
                and g.op(e.op).prim == "dot_general"]
        kept = [t for e, t in zip(edges, at) if (e.op, e.value) not in moved]
        first = min(at)
        top = all(g.ops[t].id == e.op and not g.ops[t].regions for e, t in zip(edges, at))
        early = bool(written) and top and _communicates(src, need, prob.mesh)
        if early:
            first = min(first, written.get(es[0].value, first))
        size = g.values[es[0].value].nbytes / shard_factor(need, prob.mesh)
        out.append((first, max(kept, default=first if dots else min(at)), size))
        made.update(((e.op, e.value), first) for e in dots)
        if prob.gap is not None:
            out += _gap_copies(prob, es[0].value, edges,
                               [e for e in edges if (e.op, e.value) not in moved], early, size)
    return out, made


def _gap_copies(prob: Problem, v: int, edges, kept, early: bool, size: float) -> list:
    """The copy of ``v`` each removed copy of a folded graph's representative makes
    (``problem.Gap``), as ``_copy_spans`` places the representative's own: made where the
    removed copies' first reader of it runs (``Gap.made``), or where they make ``v`` for a
    copy XLA:CPU makes as soon as its source exists (``early``); held to where their last
    reader other than a transposing dot (``kept``) runs. Only a copy made inside the gap
    (by a forward or backward op of the layer) is one per removed layer live at once; and
    one made and read inside the gap is live at no kept op: none. (Placing every copy where
    the removed layers make its source, or where they first read an argument, held a
    backward-only weight's gathered copy and each backward-only activation copy once per
    removed layer at the gap's edge: 3.5 GiB on transformers' Llama-7B at one sequence a
    device, and up to 15% of a 16-layer GPT's zero3 peak, that the full graph never holds.)"""
    gap = prob.gap
    producer = prob.graph.producer(v)
    w = _removed_copies(prob, v, edges)
    inside = [gap.made(e.op) for e in edges if gap.in_layer(e.op)]
    if early and producer is not None:
        inside.append(gap.born(producer.id))
    if not w or not inside:
        return []
    lo = min(inside)
    hi = max((gap.read(e.op) for e in kept), default=lo)
    return [(lo, hi, size)] * w if lo <= hi else []


def _removed_copies(prob: Problem, v: int, readers) -> int:
    """How many removed layers of a folded graph each make a copy of ``v``: the weight of its
    producer when a forward or backward op of the layer makes it, of its readers for an
    argument; 0 when no removed layer makes one."""
    gap = prob.gap
    producer = prob.graph.producer(v)
    if producer is None:
        return max((gap.weight.get(e.op, 0) for e in readers), default=0)
    return gap.weight[producer.id] if gap.born(producer.id) is not None else 0


def _gap_cut_copies(prob: Problem, es, position: int) -> list:
    """The possible copies of ``es``'s value that a folded graph's removed layers would hold at
    ``position`` (``_gap_copies``, per layout a reader may need), as ``CopyCut.copies``, each
    once for all its removed copies (its bytes times their number): live where the source
    makes another layout, a reader of the layer made it in the gap at or before the position
    and one reads it at or after (XLA:CPU's early copies are not seen, as ``cut_at`` does not
    see them of the kept ops). Without them a cut at a folded plan's peak could not see what
    holds it there (transformers' Llama-7B at one sequence a device: 14 GiB of resharded
    activations across the gap, and six cut rounds left the plan where it was)."""
    gap, g = prob.gap, prob.graph
    v = es[0].value
    readers = [e for e in es if e.op >= 0]
    w = _removed_copies(prob, v, readers)
    if not w:
        return []
    have = prob.groups[es[0].src].shard[v]
    out = []
    for need in dict.fromkeys(n for e in readers for n in e.need):
        other = frozenset(i for i, h in enumerate(have) if h != need)
        ix = [(e, frozenset(j for j, n in enumerate(e.need) if n == need)) for e in readers]
        before = tuple((e.dst, i) for e, i in ix
                       if i and gap.in_layer(e.op) and gap.made(e.op) <= position)
        after = tuple((e.dst, i) for e, i in ix if i and gap.read(e.op) >= position)
        if other and before and after:
            out.append((w * g.values[v].nbytes / shard_factor(need, prob.mesh), es[0].src,
                        other, before, after))
    return out


def _never_written(prob: Problem) -> frozenset[int]:
    """Values no kernel writes (fused into every kernel that reads them: ``ir.fusion``), not
    arguments or constants. A local slice of one, read by kernels that fuse their operands
    (``ir.fusion.ABSORBING``), is a dynamic-slice XLA fuses into them with the value's
    producer: each computes its own part, and the slice has no buffer (the 2x4 megatron plan
    makes a layer norm's ``rsqrt * scale`` unsplit and its forward and backward products read
    it split over 'data': held from the one to the other, 32 KiB a layer norm that XLA's
    buffers do not have). A scatter reads its operand's slice from a buffer of its own."""
    def make():
        g, f = prob.graph, prob.fusion
        return frozenset(range(len(g.values))) - f.materialized - set(g.inputs) - set(g.consts)

    return _memo(prob, "_never_written", make)


def _communicates(src, need, mesh) -> bool:
    """Whether resharding ``src`` to ``need`` runs a collective; a local slice (``need`` only
    adds axes) is a dynamic-slice XLA fuses into its readers' kernels where it can."""
    return any(step.kind != "slice" for step in reshard_steps(src, need, mesh))


def _written(prob: Problem) -> dict[int, int]:
    """Value -> the first top-level position where it exists: its producer's, and the next one
    for a value a loop makes (a result or a body's value): a loop writes its results when its
    body has run for the last time, so a copy of one is made after the loop, when the body's
    temporaries are dead, not beside them at the loop's position (the scanned zero3 plan on
    1x8 gathers a (16, 16, 64) cotangent the backward loop makes, 64 KiB, for the embedding
    gradient: held at the loop's position it put the peak 15% over XLA's). Arguments and
    constants have none."""
    def make():
        g, pos = prob.graph, _positions(prob)
        return {v: pos[o.id] + bool(g.ops[pos[o.id]].regions)
                for o in g.all_ops() for v in o.outs}

    return _memo(prob, "_written", make)


def _non_canonical_conv_operands(op) -> tuple[int, ...]:
    """The operands (0: input, 1: kernel) of convolution ``op`` whose dimension order is not
    the one XLA:CPU's convolution kernel takes: input (batch, spatial..., feature), kernel
    (spatial..., in feature, out feature); in jax's ``ConvDimensionNumbers`` (batch or out
    feature, feature or in feature, spatial...) that is ``(0, n-1, 1, ..., n-2)`` and
    ``(n-1, n-2, 0, ..., n-3)`` for rank ``n``. A forward NHWC/HWIO convolution has none; its
    kernel gradient both (input and cotangent read with batch as the contracted feature); its
    input gradient the kernel (in and out swapped)."""
    specs = op.param("dimension_numbers")
    if not specs:
        return ()
    lhs, rhs = tuple(specs[0]), tuple(specs[1])
    n = len(lhs)
    canonical = ((0, n - 1, *range(1, n - 1)), (n - 1, n - 2, *range(n - 2)))
    return tuple(k for k, (spec, want) in enumerate(zip((lhs, rhs), canonical)) if spec != want)


def _conv_transposes(prob: Problem) -> list[tuple[int, int, int, int]]:
    """(operand value, conv op id, first position, conv position) of each transposed operand
    copy XLA:CPU makes for a top-level convolution (plan-independent).

    XLA:CPU's ``ConvCanonicalization`` rewrites every top-level convolution its Eigen kernel
    cannot take (``PotentiallyImplementedAsEigenConvolution``) into transposes of the input and
    kernel to the canonical order, a canonical convolution and a transpose of its result back
    (identity transposes are dropped; the result's fuses into its readers). A transposed operand
    reads nothing else, and XLA's scheduler makes it where the value's first reader runs, not
    where the convolution does: read from the conv net's buffer assignment (1x8 auto plan), the
    image's transpose for the first kernel gradient is made before the forward convolution and
    held to the end of the backward pass (48 KiB there), the gathered pooled activation's from
    the forward pass to the second kernel gradient (32 KiB). An operand the convolution alone
    reads, computed by the step, is written transposed by its producer's kernel (the first
    kernel gradient's cotangent): no second buffer. Only ``platform="cpu"``: the
    canonicalization is XLA:CPU's (elsewhere every convolution reads its operands in place)."""
    def make():
        g = prob.graph
        if prob.reshard.cm.hw.platform != "cpu":
            return []
        pos = _positions(prob)
        readers: dict[int, list[tuple[int, int]]] = {}
        for o in g.all_ops():
            for v in o.ins:
                readers.setdefault(v, []).append((o.id, pos[o.id]))
        held = set(g.inputs) | set(g.consts)
        out = []
        for t, op in enumerate(g.ops):
            if op.prim != "conv_general_dilated":
                continue
            for k in _non_canonical_conv_operands(op):
                v = op.ins[k]
                others = [r for r in readers.get(v, ()) if r[0] != op.id]
                if v in held or others:
                    out.append((v, op.id, min(p for _, p in readers[v]), t))
        return out

    return _memo(prob, "_conv_transposes", make)


def _dot_transposes(prob: Problem) -> list[tuple[int, int, int, int]]:
    """(operand value, dot op id, first position, dot position) of each layout copy XLA:CPU
    makes of a top-level dot's operand (plan-independent).

    XLA:CPU's dot emitter takes each operand row-major with its dimensions in one order (batch,
    then free then contracting dims on the left, contracting then free on the right; a 2-D
    operand either way round), and layout assignment gives an operand in another order a copy
    in that order (``Fusion.copies``, which leaves out the operand a fused producer writes in
    that order for this dot alone). Like a convolution's transposed operands
    (``_conv_transposes``), a copy reads the value alone and is made where the value's first
    reader runs, and the dot reads the copy instead of the value: an attention's q, k and v
    (whose readers all read transposed copies: the value dies once they are made) and a
    projection's kernel transposed for the backward's input gradient, from the forward pass to
    the backward, and a cotangent that a weight gradient reads with its batch dimensions
    contracted. Only ``platform="cpu"``: the copies are XLA:CPU's layout assignment's."""
    def make():
        g = prob.graph
        if prob.reshard.cm.hw.platform != "cpu":
            return []
        first: dict[int, int] = {}
        for t, op in enumerate(g.ops):
            for v in op.ins:
                first.setdefault(v, t)
        return [(v, op.id, first[v], t) for t, op in enumerate(g.ops)
                for v in prob.fusion.copies.get(op.id, ())]

    return _memo(prob, "_dot_transposes", make)


def _operand_transposes(prob: Problem) -> list[tuple[int, int, int, int]]:
    """Every transposed operand copy: ``_conv_transposes`` and ``_dot_transposes``."""
    return _memo(prob, "_operand_transposes",
                 lambda: _conv_transposes(prob) + _dot_transposes(prob))


def _transposed_reads(prob: Problem) -> set[tuple[int, int]]:
    """(op id, value) of each read ``_operand_transposes`` redirects to a transposed copy."""
    return _memo(prob, "_transposed_reads",
                 lambda: {(op_id, v) for v, op_id, _, _ in _operand_transposes(prob)})


def _last_untransposed_reads(prob: Problem) -> dict[int, int]:
    """Temporary value -> its last top-level reader other than the convolutions and dots that
    read a transposed copy of it (at least where that copy is made), for the values whose last
    reader is such a kernel: XLA frees them once the copy is made."""
    def make():
        g, moved = prob.graph, _transposed_reads(prob)
        made = {}
        for v, _, first, _ in _operand_transposes(prob):
            made[v] = min(made.get(v, first), first)
        pos = _positions(prob)
        last: dict[int, int] = {}
        plain: dict[int, int] = {}
        for o in g.all_ops():   # pre-order: positions never decrease
            t = pos[o.id]
            for v in o.ins:
                last[v] = t
                if v in made and (o.id, v) not in moved:
                    plain[v] = t
        return {v: max(plain.get(v, first), first) for v, first in made.items()
                if last.get(v) is not None and last[v] > plain.get(v, -1)}

    return _memo(prob, "_last_untransposed_reads", make)


def _transposed_operands(prob: Problem, choice, nbytes,
                         made=None) -> list[tuple[int, int, float]]:
    """(first, last position, per-device bytes) of each transposed operand copy
    (``_operand_transposes``), sized in the layout the convolution or dot reads (a resharded
    copy's when it reads one, made as soon as that copy is: ``made``, from
    ``_reshard_copies``). XLA makes one per (value, layout, order)."""
    g = prob.graph
    reading = _reading_edges(prob)
    spans: dict[tuple, tuple[int, int]] = {}
    made = made or {}
    for v, op_id, first, t in _operand_transposes(prob):
        first = made.get((op_id, v), first)
        hit = reading.get((op_id, v))
        size = nbytes(v)
        layout = None
        if hit is not None:
            _, e = hit
            layout = e.need[choice[e.dst]]
            size = g.values[v].nbytes / shard_factor(layout, prob.mesh)
        op = g.op(op_id)
        k = 0 if op.ins[0] == v else 1
        order = (_dot_operand_order(op, k, len(g.values[v].shape)) if op.prim == "dot_general"
                 else tuple(op.param("dimension_numbers")[k]))
        key = (v, layout, op.prim, order, size)
        a, b = spans.get(key, (first, t))
        spans[key] = (min(a, first), max(b, t))
    return [(a, b, key[-1]) for key, (a, b) in spans.items()]


def _dot_operand_order(op, side: int, rank: int) -> tuple[int, ...]:
    """The dimension order XLA:CPU's dot emitter takes operand ``side`` of ``op`` in: batch
    dims, then free then contracting dims (left) or contracting then free (right)."""
    (lc, rc), (lb, rb) = op.param("dimension_numbers")
    contract, batch = (tuple(lc), tuple(lb)) if side == 0 else (tuple(rc), tuple(rb))
    free = tuple(d for d in range(rank) if d not in contract and d not in batch)
    return batch + (free + contract if side == 0 else contract + free)


@dataclasses.dataclass(frozen=True)
class CopyCut:
    """A lazy memory constraint for the ILP (``ilp.solve``'s ``cuts``): at top-level schedule
    position ``position``, the bytes of the values ``live`` plus those of every resharded copy
    any plan could hold there stay within the budget. A possible copy is (per-device bytes,
    source group, the source's strategy indices that make another layout, readers before,
    readers after), a reader (group, its strategy indices that need the copied layout): the
    copy is live at the position when the source makes another layout, a reader at or before
    the position needs it and one at or after does (XLA makes one copy per needed layout, held
    from its first reader to its last). Indices are the full problem's."""

    position: int
    live: tuple[int, ...]
    copies: tuple[tuple[float, int, frozenset, tuple, tuple], ...]


def cut_at(prob: Problem, position: int) -> CopyCut:
    """The ``CopyCut`` at top-level schedule position ``position``."""
    where = _positions(prob)
    copies = []
    for es in prob.edge_sets():
        at = [where[e.op] if e.op >= 0 else None for e in es]
        if not any(t is not None and t <= position for t in at) or not any(
                t is not None and t >= position for t in at):
            continue
        have = prob.groups[es[0].src].shard[es[0].value]
        nbytes = prob.graph.values[es[0].value].nbytes
        for need in dict.fromkeys(n for e in es for n in e.need):
            other = frozenset(i for i, h in enumerate(have) if h != need)
            readers = [(e.dst, frozenset(j for j, n in enumerate(e.need) if n == need), t)
                       for e, t in zip(es, at) if t is not None]
            before = tuple((d, ix) for d, ix, t in readers if ix and t <= position)
            after = tuple((d, ix) for d, ix, t in readers if ix and t >= position)
            if other and before and after:
                copies.append((nbytes / shard_factor(need, prob.mesh), es[0].src, other,
                               before, after))
    if prob.gap is not None:
        for es in prob.edge_sets():
            copies += _gap_cut_copies(prob, es, position)
    intervals, inner = _schedule(prob)
    live = [v for v, a, b in intervals if a <= position <= b] + list(
        inner.get(position, ((), 0))[0])
    live += phantoms_at(prob.phantoms, position)
    return CopyCut(position, tuple(live), tuple(copies))
