# Two commands on a fresh machine: `make demo` and `make test` install what they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo lint bench clean

install: $(STAMP)

# pip (not uv/poetry): it finds the CPU torch wheel through this machine's find-links (ENV-NOTES).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m resilient.tools.demo

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/ckpt_bench.py

clean:
	rm -rf $(VENV) runs .pytest_cache
