# The two commands README.md opens with. Both set up .venv on a fresh machine first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VPY) benchmarks/demo.py

test: $(STAMP)
	$(VPY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
