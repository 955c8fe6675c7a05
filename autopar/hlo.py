"""Reading a compiled executable's per-device HLO text: collectives, loop trip counts, sources.

``parse(text)`` turns ``compiled.as_text()`` into ``Module``: computations of instructions, each
with its name, result type, opcode, operand names and attributes. ``collectives(module)`` lists
every collective with the bytes HLO sizes it by (result shape for all-reduce, all-gather,
all-to-all and collective-permute; operand shape for reduce-scatter), how often it runs per step
(the ``known_trip_count`` of every enclosing while loop multiplied) and the user source line in
its metadata.

Backends rewrite some collectives: XLA:CPU decomposes a reduce-scatter into an all-reduce whose
only user dynamic-slices this device's part (GPU's ``ReduceScatterCreator`` turns the same
pattern back into a reduce-scatter). Such a pair is reported as the reduce-scatter it is.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5,
             "u4": 0.5, "token": 0}
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_HEAD = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLS = re.compile(r"\b(to_apply|calls|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PRED_BRANCHES = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str           # "f32[8,16]{1,0}" or a tuple "(f32[8]{0}, f32[8]{0})"
    opcode: str
    operands: tuple[str, ...]
    attrs: str          # everything after the operand list
    args: str = ""      # the operand list as written ("0" for parameter(0))

    @property
    def nbytes(self) -> float:
        return type_bytes(self.type)


@dataclasses.dataclass(frozen=True)
class Module:
    computations: Mapping[str, tuple[Instruction, ...]]
    entry: str
    frames: Mapping[int, str]        # stack_frame_id -> "file.py:LINE"


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective instruction of the executable."""

    kind: str
    nbytes: float        # per device, HLO's convention (see module docstring)
    count: float         # executions per step
    group_size: int
    op_name: str         # the jax op it came from (metadata op_name)
    source: str          # "file.py:LINE" of the user's code, or ""
    name: str            # the instruction's name


def type_bytes(t: str) -> float:
    """Bytes of an HLO type; a tuple sums its elements."""
    return float(sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dt, 4)
                     for dt, dims in _ARRAY.findall(t) if dt in _ITEMSIZE))


def _split_type(rest: str) -> tuple[str, str]:
    """(type, remainder) of ``rest`` that starts with the instruction's result type."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _parse_instruction(line: str) -> Instruction | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    typ, rest = _split_type(line[m.end():])
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
        return None
    depth, i = 0, op.end() - 1
    for i in range(op.end() - 1, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            break
    args = rest[op.end(): i]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return Instruction(m.group(1), typ, op.group(1), operands, rest[i + 1:], args)


def parse(text: str) -> Module:
    """Parse ``compiled.as_text()``."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head is not None:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        if current is not None and line.strip() == "}":
            current = None
            continue
        if current is not None:
            ins = _parse_instruction(line)
            if ins is not None:
                comps[current].append(ins)
    return Module({k: tuple(v) for k, v in comps.items()}, entry, _frames(text))


def _frames(text: str) -> dict[int, str]:
    """stack_frame_id -> "file.py:LINE" of the frame jax recorded (its innermost non-jax frame,
    which may be a library such as flax; attribution to the user's model goes by op name)."""
    files = dict(re.findall(r'^(\d+) "([^"]*)"$', _section(text, "FileNames"), re.M))
    locs = {lid: f"{files.get(fid, '?').rsplit('/', 1)[-1]}:{line}" for lid, fid, line in
            re.findall(r"^(\d+) \{file_name_id=(\d+) .*?line=(\d+)",
                       _section(text, "FileLocations"), re.M)}
    return {int(sid): locs.get(lid, "") for sid, lid in
            re.findall(r"^(\d+) \{file_location_id=(\d+)", _section(text, "StackFrames"), re.M)}


def _section(text: str, name: str) -> str:
    m = re.search(rf"^{name}\n((?:\d+ .*\n)*)", text, re.M)
    return m.group(1) if m else ""


def trip_counts(module: Module) -> dict[str, float]:
    """computation -> executions per step (entry 1; a while body times its known trip count)."""
    mult = {module.entry: 1.0}
    order = [module.entry]
    for comp in order:
        for ins in module.computations.get(comp, ()):
            n = _known_trip_count(ins) if ins.opcode == "while" else 1
            for key, child in callees(ins):
                factor = n if key == "body" else (n + 1 if key == "condition" else 1)
                if child in module.computations and child not in mult:
                    mult[child] = mult[comp] * factor
                    order.append(child)
    return mult


def callees(ins: Instruction) -> list[tuple[str, str]]:
    """(role, computation) of every computation ``ins`` calls: ``to_apply``, ``calls``,
    ``body``, ``condition``, and ``branch`` for each of a conditional's branches, in order
    (a predicated conditional's true branch first)."""
    out = [(k, c) for k, c in _CALLS.findall(ins.attrs)]
    out += [("branch", c) for c in _PRED_BRANCHES.findall(ins.attrs)]
    for group in _BRANCHES.findall(ins.attrs):
        out += [("branch", c.strip().lstrip("%")) for c in group.split(",")]
    return out


def _known_trip_count(ins: Instruction) -> float:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return float(m.group(1)) if m else 1.0


def _group_size(attrs: str) -> int:
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return 1


def _metadata(module: Module, attrs: str) -> tuple[str, str]:
    name = re.search(r'op_name="([^"]*)"', attrs)
    frame = re.search(r"stack_frame_id=(\d+)", attrs)
    source = module.frames.get(int(frame.group(1)), "") if frame else ""
    return (name.group(1) if name else ""), source


def _kind(ins: Instruction) -> str | None:
    op = ins.opcode.removesuffix("-start")
    return op if op in COLLECTIVE_KINDS else None


_PASS_THROUGH = ("bitcast", "copy", "reshape")


def _only_sliced(body: tuple[Instruction, ...], name: str) -> bool:
    """Every use of ``name`` in ``body`` (through bitcasts and copies) is a dynamic-slice of it."""
    uses = [i for i in body if name in i.operands]
    if not uses:
        return False
    for use in uses:
        if use.opcode in _PASS_THROUGH:
            if not _only_sliced(body, use.name):
                return False
        elif not (use.opcode == "dynamic-slice" and use.operands[:1] == (name,)):
            return False
    return True


def _is_local_slice(module: Module, ins: Instruction, value: str) -> bool:
    """``ins`` only takes a dynamic-slice of ``value`` (an all-reduce result): this device's
    part, directly or inside a fusion."""
    if ins.opcode == "dynamic-slice":
        return ins.operands[:1] == (value,)
    if ins.opcode != "fusion":
        return False
    body = module.computations.get(dict(_CALLS.findall(ins.attrs)).get("calls"), ())
    params = {i.args.strip(): i.name for i in body if i.opcode == "parameter"}
    return all(_only_sliced(body, params.get(str(k), "")) for k, o in enumerate(ins.operands)
               if o == value)


def collectives(module: Module) -> list[HloCollective]:
    """Every collective of the executable (see the module docstring). A combined all-reduce
    (one instruction over a tuple of buffers) is reported per buffer."""
    return _collectives_in(module, module.computations)


def _collectives_in(module: Module, comps, kinds=None) -> list[HloCollective]:
    """The collectives (of ``kinds``; None: all) in the computations ``comps``."""
    mult = trip_counts(module)
    out = []
    for comp in comps:
        instrs = module.computations[comp]
        users: dict[str, list[Instruction]] = {}
        for ins in instrs:
            for o in ins.operands:
                users.setdefault(o, []).append(ins)
        by_name = {i.name: i for i in instrs}
        for ins in instrs:
            kind = _kind(ins)
            if kind is not None and (kinds is None or kind in kinds):
                out += _collective(module, ins, kind, users, by_name, mult.get(comp, 1.0))
    return out


def in_branches(module: Module, kinds=("collective-permute",)) -> list[HloCollective]:
    """The collectives of ``kinds`` that run inside a conditional's branches (and whatever those
    branches call), where only the devices that took the branch reach them."""
    inside, todo = set(), [c for ins in (i for body in module.computations.values()
                                         for i in body)
                           for role, c in callees(ins) if role == "branch"]
    while todo:
        comp = todo.pop()
        if comp in inside or comp not in module.computations:
            continue
        inside.add(comp)
        todo += [c for ins in module.computations[comp] for _, c in callees(ins)]
    return _collectives_in(module, sorted(inside), kinds)


def _parts(ins: Instruction, users) -> list[tuple[str, list[tuple[Instruction, str]]]]:
    """(type, [(user, the name it reads)]) of each buffer an all-reduce reduces: the tuple
    elements of a combined one, each with the users of its get-tuple-element."""
    if not ins.type.startswith("("):
        return [(ins.type, [(u, ins.name) for u in users.get(ins.name, [])])]
    types = [t.strip() for t in re.findall(r"[a-z]\w*\[[\d,]*\](?:\{[^}]*\})?", ins.type)]
    parts: list[tuple[str, list]] = [(t, []) for t in types]
    for u in users.get(ins.name, []):
        k = re.search(r"index=(\d+)", u.attrs)
        if u.opcode == "get-tuple-element" and k and int(k.group(1)) < len(parts):
            parts[int(k.group(1))][1].extend((g, u.name) for g in users.get(u.name, []))
    return parts


def _collective(module, ins, kind, users, by_name, count) -> list[HloCollective]:
    op_name, source = _metadata(module, ins.attrs)
    group = _group_size(ins.attrs)

    def make(k, nbytes):
        return HloCollective(k, nbytes, count, group, op_name, source, ins.name)

    if kind == "all-reduce":   # a backend-decomposed reduce-scatter is an all-reduce + local slice
        return [make("reduce-scatter" if u and all(_is_local_slice(module, g, v) for g, v in u)
                     else "all-reduce", type_bytes(t)) for t, u in _parts(ins, users)]
    if kind == "reduce-scatter":
        return [make(kind, sum(by_name[o].nbytes for o in ins.operands if o in by_name))]
    if ins.opcode.endswith("-start") and ins.type.startswith("("):
        return [make(kind, type_bytes(ins.type[1:-1].rsplit(", ", 1)[-1]))]  # (in, out): out
    return [make(kind, ins.nbytes)]


def bytes_by_kind(colls) -> dict[str, float]:
    """Per-device bytes moved per step, by collective kind."""
    out = {k: 0.0 for k in COLLECTIVE_KINDS}
    for c in colls:
        out[c.kind] += c.nbytes * c.count
    return out


def memory(compiled) -> dict[str, float]:
    """XLA's memory_analysis() figures plus ``peak``: what the executable holds at once per
    device (arguments + outputs + temporaries - donated aliases; XLA:CPU's own
    ``peak_memory_in_bytes`` leaves the temporaries out), and ``host``: what its arguments and
    results hold in host memory (``memory_kind="pinned_host"``). Where XLA reports no host
    figures (XLA:CPU counts host buffers among the device's), they are read off the entry
    computation's layout (memory space ``S(5)``) and taken out of the device's."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    d = {k: float(getattr(m, f"{k}_size_in_bytes", 0)) for k in
         ("argument", "output", "temp", "alias", "generated_code")}
    host = {k: float(getattr(m, f"host_{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias")}
    if not any(host.values()):
        host = _entry_host_bytes(compiled)
        for k in host:
            d[k] -= host[k]
    d["host"] = host["argument"] + host["output"] - host["alias"]
    d["peak"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d


_ALIAS = re.compile(r"\{(\d+)\}: \((\d+), \{\}")


def _entry_host_bytes(compiled) -> dict[str, float]:
    """Bytes of the entry computation's parameters and results in host memory (layout memory
    space 5), and of the donated pairs among them."""
    zero = {"argument": 0.0, "output": 0.0, "alias": 0.0}
    try:
        head = compiled.as_text().split("\n", 1)[0]
    except Exception:   # an executable without text: no host buffers to find
        return zero
    if "S(5)" not in head or "entry_computation_layout={" not in head:
        return zero
    layout = head.split("entry_computation_layout={", 1)[1]
    params, _, results = layout.partition(")->")
    results = (_split_type(results)[0][1:-1] if results.startswith("(")
               else results.split("}", 1)[0] + "}")

    def host(part: str) -> list[float]:
        return [type_bytes(t) if "S(5)" in t else 0.0 for t in _top_level(part)]
    ins, outs = host(params[1:]), host(results)
    aliased = sum(outs[int(j)] for j, k in _ALIAS.findall(head.split("entry_computation", 1)[0])
                  if int(j) < len(outs) and int(k) < len(ins) and outs[int(j)] and ins[int(k)])
    return {"argument": sum(ins), "output": sum(outs), "alias": aliased}


def _top_level(text: str) -> list[str]:
    """``text``'s comma-separated entries outside brackets and braces."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def cost(compiled) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict (jax returns a list of one on some versions)."""
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    return {k: float(v) for k, v in (c or {}).items() if isinstance(v, (int, float))}


__all__ = ["COLLECTIVE_KINDS", "HloCollective", "Instruction", "Module", "bytes_by_kind",
           "callees", "collectives", "cost", "memory", "parse", "trip_counts", "type_bytes"]


_WRAPPED = re.compile(r"^[\w.\-]+\((.*)\)$")
_NOT_SCOPES = frozenset({"while", "body", "cond", "rematted_computation", "checkpoint", "remat",
                         "jit", "pjit", "scan", "closed_call", ""})


def scope_key(name: str, *, hlo_op_name: bool = False) -> str:
    """A module path both sides agree on: ``ir`` op names (``transpose(jvp(GPT))/layer_0/mlp``)
    and HLO ``op_name`` metadata (``jit(step)/jvp(GPT)/layer_0/mlp/dot_general``, whose first
    segment is the jitted function and last the primitive) lose transform wrappers, loop and
    remat segments, and repeats."""
    segs = name.split("/")
    if hlo_op_name:
        segs = segs[1:-1] if segs and segs[0].startswith(("jit(", "pjit(")) else segs[:-1]
    out: list[str] = []
    for seg in segs:
        while (m := _WRAPPED.match(seg)) is not None:
            seg = m.group(1)
        if seg not in _NOT_SCOPES and (not out or out[-1] != seg):
            out.append(seg)
    return "/".join(out)
