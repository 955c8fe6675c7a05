"""mkdocs hook: publishes the committed benchmark results as pages of the site.

Every ``benchmarks/results/*.md`` (and the ``*.png`` plots they show) becomes
``results/<name>`` in the site, read from the committed file at build time, so the docs link to
the numbers the benchmarks wrote instead of copies that go stale.
"""
from __future__ import annotations

import pathlib

from mkdocs.structure.files import File

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".md", ".png"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files
