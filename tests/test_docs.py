"""The docs site builds with warnings as errors, and every ```python block of every page runs.

Pages are found by globbing ``docs/**/*.md`` (pages other engineers add are run without
editing this file). A page's blocks run in order in one fresh namespace, with conftest's 8
emulated CPU devices, in a temporary working directory. ``--8<-- "path"`` lines (pymdownx
snippets, paths from the repository root) are expanded first, as the site shows them.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
SNIPPET = re.compile(r'^-{2,}8<-{2,}[ \t]+"([^"]+)"[ \t]*$', re.M)


def expanded(text: str) -> str:
    """The page's markdown with its snippet lines replaced by the files they name."""
    return SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), text)


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """``(first line, code)`` of each python block, lines counted in the expanded page."""
    text = expanded(page.read_text())
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)
RUNNABLE = [p for p in PAGES if python_blocks(p)]


def test_pages_found():
    assert DOCS / "index.md" in PAGES and len(RUNNABLE) >= 5, [p.name for p in RUNNABLE]


def test_site_builds_strict(tmp_path):
    for module in ("mkdocs", "mkdocstrings_handlers.python", "material"):
        pytest.importorskip(module)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "autopar" / "index.html").exists()


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)          # pages may write checkpoints or plans
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a real module, so that classes the page defines (flax modules are dataclasses) find it
    module = types.ModuleType("docs_page")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    name = str(page.relative_to(ROOT))
    environ = dict(os.environ)           # pages set XLA_FLAGS for readers; later tests keep ours
    try:
        for line, code in python_blocks(page):
            # pad so a traceback's line numbers are the page's own
            exec(compile("\n" * (line - 1) + code, name, "exec"), module.__dict__)
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_readme_links_into_the_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links, "the README links into docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
