# Set-up, demo, tests and benchmarks. Everything installs itself into .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench graphviz clean gpu-wheels gpu-check

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
# mypy reads no package-dir mapping: passes/ is linked in where the package installs it
# (fxpipe.passes) for the check, so that the library's calls into the passes are typed too.
test: setup
	$(PY) -m pytest -q -n auto --dist worksteal  # one test process per core; an idle one takes tests queued for another
	ln -sfn ../passes fxpipe/passes
	$(PY) -m mypy fxpipe tests benchmarks examples; status=$$?; rm -f fxpipe/passes; exit $$status

bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/schedules.py --gantt docs/gantt_zb_h1.svg
	$(PY) benchmarks/balance.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/tokens.py

# The GPU check, one command on a machine with CUDA and its own torch, which may reach no package
# registry: what it needs beyond that torch comes from wheels fetched here beforehand (gpu-wheels),
# then the CUDA tests and the table of benchmarks/gpu.py, in under 8 minutes. The table is printed
# even when a test fails; the check fails after it.
GPU_PYTHON ?= python3
WHEELS := .whl

gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(WHEELS) torchgpipe==0.0.7 'graphviz>=0.20'

gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-build-isolation -e . $(wildcard $(WHEELS)/*.whl)
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider -rfE tests/gpu; status=$$?; \
	$(GPU_PYTHON) benchmarks/gpu.py --budget 240; exit $$status

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
