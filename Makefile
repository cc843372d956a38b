# Set-up, demo, tests and benchmarks. Everything installs itself into .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench graphviz clean

setup: $(STAMP) graphviz

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build first, pinned: an unpinned torch would pull a multi-gigabyte CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,examples]'
	touch $(STAMP)

graphviz:
	@command -v dot >/dev/null || { \
	  echo "installing Graphviz (dot) for the stage pictures"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq graphviz >/dev/null; }

demo: setup
	$(PY) examples/unet.py --svg unet.svg

# The suite, then the types of everything (the library, its tests, benchmarks and examples).
test: setup
	$(PY) -m pytest -q
	$(PY) -m mypy fxpipe passes tests benchmarks examples

bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/schedules.py --gantt docs/gantt_zb_h1.svg
	$(PY) benchmarks/balance.py
	$(PY) benchmarks/distributed.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
