# Two commands on a fresh machine: `make demo` and `make test` install what they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install check test demo lint bench clean

install: $(STAMP)

# pip (not uv/poetry): it finds the CPU torch wheel through this machine's find-links (ENV-NOTES).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The loop while working: unit and single-process tests over two xdist workers (a few minutes here).
# Multi-process tests (gloo worlds, torchrun, launchers) are marked `dist` or `e2e` and left out.
FAST := -m "not dist and not e2e"
check: install
	$(PY) -m pytest -q -n 2 $(FAST) --durations=10

# Everything: the fast set over two workers, then the multi-process tests one at a time (they time
# heartbeats and kills, and each already uses both cores).
test: install
	$(PY) -m pytest -q -n 2 $(FAST) --durations=10
	$(PY) -m pytest -q -m "dist or e2e" --durations=20

demo: install
	$(PY) -m resilient.tools.demo

lint: install
	$(VENV)/bin/ruff check .

# The S3 case needs moto_server (the dev extra installs it): included whenever the venv has it.
bench: install
	$(PY) benchmarks/ckpt_bench.py $$(test -x $(VENV)/bin/moto_server && echo --s3)

clean:
	rm -rf $(VENV) runs .pytest_cache
