"""The README's quickstart runs as written (conftest already gives 8 CPU devices)."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_block(after: str, name: str) -> None:
    """Executes, as written, the first python block of README.md after the text ``after``
    (``name`` labels its frames in a traceback: ``README.md#name``)."""
    part = (ROOT / "README.md").read_text().split(after, 1)[1]
    code = re.search(r"```python\n(.*?)```", part, re.S).group(1)
    exec(compile(code, f"README.md#{name}", "exec"), {"__name__": "readme"})


def test_readme_opens_with_the_two_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:20])
    assert "make demo" in head and "make test" in head


def test_quickstart_runs_as_written(capsys):
    run_block("## Quickstart", "quickstart")
    out = capsys.readouterr().out
    assert "autopar plan" in out and "step " in out


def test_models_load_on_first_use():
    """``autopar.models.mlp.make(...)`` works after ``import autopar`` alone (a fresh
    interpreter: in this one other tests have imported the model modules already)."""
    code = ("import autopar\n"
            "step, state, batch = autopar.models.mlp.make(16, 32, 1, 8)\n"
            "print(sorted(batch))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "['x', 'y']", run.stderr[-2000:]
