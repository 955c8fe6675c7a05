"""The README's quickstart runs as written (conftest already gives 8 CPU devices)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_two_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:20])
    assert "make demo" in head and "make test" in head


def test_quickstart_runs_as_written(capsys):
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
    exec(compile(code, "README.md#quickstart", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "autopar plan" in out and "step " in out
