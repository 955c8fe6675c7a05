"""The README's quickstart runs as written (conftest already gives 8 CPU devices)."""
import pathlib
import re

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
