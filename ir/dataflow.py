"""Small dataflow questions the pattern recognisers ask of an ``ir.patterns.Index``: follow a
value up through layout ops, find the reduce under a max-subtraction, split a binary op into its
operand and scalar constant, name a match's inputs by role. All of them look only inside the
anchor op's region and never raise on graphs they do not recognise.
"""
from __future__ import annotations

from collections.abc import Callable

from ir.consteval import NotConstant
from ir.graph import Op
from ir.patterns import Index, externals

LAYOUT = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "squeeze",
                    "expand_dims", "stop_gradient"})
OUTPUT_LAYOUT = frozenset({"transpose", "reshape", "convert_element_type"})


def strip(index: Index, v: int, anchor: Op, prims: frozenset[str] = LAYOUT) -> int:
    """Follows ``v`` up through single-operand ops in ``prims`` (same region)."""
    while (p := index.local_producer(v, anchor)) is not None and p.prim in prims:
        v = p.ins[0]
    return v


def producer(index: Index, v: int, anchor: Op, prim: str) -> Op | None:
    p = index.local_producer(v, anchor)
    return p if p is not None and p.prim == prim else None


def split_literal(index: Index, op: Op) -> tuple[int, float] | None:
    """``(other operand, literal)`` of a binary op with one scalar-constant operand."""
    for i in (0, 1):
        c = index.eval.scalar(op.ins[i]) if not index.shape(op.ins[i]) else None
        if c is not None:
            return op.ins[1 - i], c
    return None


def consumers(index: Index, v: int, prim: str, anchor: Op) -> list[Op]:
    return [c for c in index.consumers.get(v, ()) if c.prim == prim
            and index.scope[c.id] == index.scope[anchor.id]]


def reduce_max_of(index: Index, v: int, anchor: Op) -> Op | None:
    """The ``reduce_max`` under a softmax's max-subtraction (through broadcasts, stop_gradient,
    and ``max(-inf, .)``)."""
    while True:
        v = strip(index, v, anchor, LAYOUT | {"transpose"})
        p = index.local_producer(v, anchor)
        if p is None:
            return None
        if p.prim == "reduce_max":
            return p
        if p.prim == "select_n" and len(p.ins) == 3:      # where(isfinite(m), m, 0)
            live = [i for i in p.ins[1:] if not is_constant(index, i)]
            if len(live) != 1:
                return None
            v = live[0]
            continue
        if p.prim != "max" or (lit := split_literal(index, p)) is None:
            return None
        v = lit[0]


def shifted_softmax_input(index: Index, exp: Op) -> tuple[int, int, list[Op]] | None:
    """For ``exp(x - max(x))``: ``(x, reduced axis in x's layout, [sub, reduce_max])``; ``x``
    may be a transpose of what the max reduced (``jax.nn.dot_product_attention`` does that)."""
    sub = producer(index, exp.ins[0], exp, "sub")
    if sub is None:
        return None
    rmax = reduce_max_of(index, sub.ins[1], exp)
    axes = rmax.param("axes") if rmax is not None else None
    if axes is None or len(axes) != 1:
        return None
    axis = axes[0]
    if rmax.ins[0] != sub.ins[0]:
        t = producer(index, sub.ins[0], exp, "transpose")
        if t is None or t.ins[0] != rmax.ins[0]:
            return None
        axis = t.param("permutation").index(axis)
    return sub.ins[0], axis, [sub, rmax]


def sum_of(index: Index, v: int, anchor: Op) -> Op | None:
    """The ``reduce_sum`` that ``v`` is (up to broadcasts and reshapes)."""
    return producer(index, strip(index, v, anchor), anchor, "reduce_sum")


def mean_arg(index: Index, v: int, anchor: Op) -> int | None:
    """``u`` when ``v`` is ``sum(u) / n`` (or ``sum(u) * (1/n)``) up to broadcasts."""
    p = index.local_producer(strip(index, v, anchor), anchor)
    if p is None or p.prim not in ("div", "mul") or (lit := split_literal(index, p)) is None:
        return None
    s = sum_of(index, lit[0], anchor)
    return s.ins[0] if s is not None else None


def square_arg(index: Index, v: int, anchor: Op) -> int | None:
    p = index.local_producer(strip(index, v, anchor), anchor)
    if p is None:
        return None
    if p.prim == "square" or (p.prim == "integer_pow" and p.param("y") == 2):
        return p.ins[0]
    if p.prim == "mul" and p.ins[0] == p.ins[1]:
        return p.ins[0]
    return None


def contracting(dot: Op, operand: int) -> tuple[int, ...]:
    (lc, rc), _ = dot.param("dimension_numbers")
    return tuple(lc if operand == 0 else rc)


def free_dims(dot: Op, operand: int, rank: int) -> list[int]:
    (lc, rc), (lb, rb) = dot.param("dimension_numbers")
    taken = set(lc) | set(lb) if operand == 0 else set(rc) | set(rb)
    return [d for d in range(rank) if d not in taken]


def role_inputs(index: Index, ops: set[int], named: dict[int, str], other: str = "const",
                allow: Callable[[int], bool] | None = None) -> list[tuple[str, int]] | None:
    """Roles of the match's inputs: ``named`` ones by name, the rest ``other`` if ``allow``s
    them (default: constants); ``None`` when an unexpected value feeds the match."""
    roles = []
    for v in externals(index, ops):
        if v in named:
            roles.append((named[v], v))
        elif (allow or (lambda x: is_constant(index, x)))(v):
            roles.append((other, v))
        else:
            return None
    return roles


def is_constant(index: Index, v: int) -> bool:
    try:
        index.eval.element(v, (0,) * len(index.shape(v)))
    except (NotConstant, ArithmeticError, IndexError, KeyError, TypeError, ValueError):
        return False
    return True


def layout_tail(index: Index, v: int, anchor: Op) -> int:
    """Extends an output through transposes/reshapes that are its only use."""
    while len(users := index.consumers.get(v, ())) == 1 and users[0].prim in OUTPUT_LAYOUT \
            and index.scope[users[0].id] == index.scope[anchor.id]:
        v = users[0].outs[0]
    return v

