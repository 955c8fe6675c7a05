# The two commands README.md opens with. Both set up .venv on a fresh machine first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Test workers: one per core (pytest-xdist), files kept whole so module fixtures are built once
# (but for files whose tests share nothing: tests/conftest.py's scheduler).
JOBS ?= auto

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VPY) benchmarks/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(VPY) -m pytest -n $(JOBS) --dist loadfile --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
