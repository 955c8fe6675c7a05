"""Imports run one way (``../DESIGN.md``'s layers): a module imports only from its own layer or
below. Every import statement of every module is read, lazy ones inside functions included, so
an upward edge cannot hide in a function body. A new module must be given a layer here."""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ir", "cost_models", "autopar")

# (layer, what lives there, module patterns). Lower layers never import higher ones.
LAYERS = (
    (0, "the traced program; example models (user code)",
     (r"ir(\..*)?", r"autopar\.models(\..*)?")),
    (1, "hardware knowledge", (r"cost_models(\..*)?",)),
    (2, "shared vocabulary: errors, layouts, meshes, options, HLO reading, processes",
     (r"autopar\.(errors|sharding|mesh|jsonread|options|hlo|distributed)",)),
    (3, "the plan as data: Plan, its JSON and views, its pipeline record",
     (r"autopar\.(plan|explain)", r"autopar\.pipeline\.record")),
    (4, "the planner and the kernels it chooses", (r"autopar\.(planner|kernels)(\..*)?",)),
    (5, "hand-written strategies: pins and starts for the planner",
     (r"autopar\.strategies(\..*)?",)),
    (6, "the request (options checked once) and codegen",
     (r"autopar\.(request|mesh_search|validate|codegen|substitute|verify|executable|tune)",)),
    (7, "pipelines: stage search above the planner, their runtime",
     (r"autopar\.pipeline(\..*)?",)),
    (8, "the user's entry points", (r"autopar", r"autopar\.(api|compare|arguments|launch)",
                                    r"autopar\.checkpoint(\..*)?")),
)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def layer(module: str) -> int | None:
    for rank, _, patterns in LAYERS:
        if any(re.fullmatch(p, module) for p in patterns):
            return rank
    return None


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The project's modules ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:           # the longest module a target names
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
                break
    return out


def test_every_module_has_a_layer():
    assert [m for m in _modules() if layer(m) is None] == []


def test_imports_run_one_way():
    modules = _modules()
    upward = sorted(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
                    for m, path in modules.items() for t in _imports(m, path, modules)
                    if layer(t) is not None and layer(m) is not None and layer(t) > layer(m))
    assert upward == [], "\n".join(upward)


def test_the_reader_sees_lazy_imports(tmp_path):
    """The check is not vacuous: an import inside a function body is an edge, a relative one
    resolves to its module, and an upward one is reported."""
    modules = _modules()
    assert "autopar.explain" in _imports("autopar.plan", ROOT / "autopar" / "plan.py", modules)
    src = tmp_path / "plan.py"
    src.write_text("def f():\n    from autopar.api import plan_graph\n    from . import hlo\n")
    found = _imports("autopar.plan", src, modules)
    assert found == {"autopar.api", "autopar.hlo"}
    assert layer("autopar.api") > layer("autopar.plan")
