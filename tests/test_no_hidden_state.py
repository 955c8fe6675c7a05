"""Nothing is cached by writing into an object (``../DESIGN.md``, "Analyses, explicit"): what is
computed about a graph lives in ``Graph.analyses`` (``ir.analyses``), about a planning problem in
``Problem.memo``. The sources are read with ``ast``, so comments and strings do not count: no
module of ``ir``, ``cost_models`` or ``autopar`` touches an object's ``__dict__``, and
``object.__setattr__`` on a frozen dataclass appears only where the object is being made
(``self`` in its ``__init__`` or ``__post_init__``). The exceptions are listed with their
reasons."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ir", "cost_models", "autopar")
CONSTRUCTORS = ("__init__", "__post_init__")

# (file, enclosing function) -> why it may do what the rule forbids
EXCEPTIONS = {
    ("ir/layers.py", "_with"): "copies an Op without re-running __init__ (tens of thousands of "
                               "ops get their layer set): it fills a new object's __dict__ and "
                               "leaves the original untouched; nothing is cached",
    ("cost_models/hardware.py", "_validate"): "normalises the tables of a Hardware while it "
                                              "is made (called from Hardware.__post_init__)",
}


def _violations(path: pathlib.Path) -> list[tuple[str, int, str]]:
    rel = path.relative_to(ROOT).as_posix()
    out = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            out.append((rel, node.lineno, func, "__dict__"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__setattr__" and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "object"):
            target = node.args[0] if node.args else None
            made_here = (func in CONSTRUCTORS and isinstance(target, ast.Name)
                         and target.id == "self")
            if not made_here:
                out.append((rel, node.lineno, func, "object.__setattr__"))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(path.read_text(), str(path)), "<module>")
    return [(f"{r}:{line}", func, what) for r, line, func, what in out
            if (r, func) not in EXCEPTIONS]


def test_no_state_written_into_objects():
    found = [v for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))
             for v in _violations(f)]
    assert found == [], ("expected no __dict__ use or object.__setattr__ outside construction "
                         f"(keep computed facts in Graph.analyses or Problem.memo), got {found}")


def test_exceptions_are_still_needed():
    """An exception whose code went away is dropped from the list, not kept as a loophole."""
    used = set()
    for rel, func in EXCEPTIONS:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == func:
                text = ast.unparse(node)
                if "__dict__" in text or "object.__setattr__" in text:
                    used.add((rel, func))
    assert used == set(EXCEPTIONS)
