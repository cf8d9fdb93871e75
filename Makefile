# Pagoda: `make run` serves SmolLM2-135M-Instruct (fetched once), `make test` runs the tests.
# Both install first when needed; `make install` is idempotent and quick when nothing changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install protos check-protos test run lint bench clean browser chaos

install: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt scripts/install_torch.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@scripts/install_torch.sh $(PY)  # the CPU build without a GPU: no CUDA packages
	@# triton comes with torch where torch brings it (CUDA builds): no pin may fight it
	@if $(PY) -c "import triton" 2>/dev/null; then \
		grep -v '^triton==' requirements/constraints.txt > $(VENV)/constraints.txt; \
	else cp requirements/constraints.txt $(VENV)/constraints.txt; fi
	$(PIP) install -q -c $(VENV)/constraints.txt -e '.[dev]'
	@touch $(STAMP)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py --out services/pb

check-protos: $(STAMP)
	$(PY) scripts/gen_protos.py --check services/pb

# The dashboard's test drives a real headless Chromium (Playwright, from the package index,
# pointed at the system's browser): Debian's chromium, installed here where apt can as root.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "installing Debian's chromium (for the dashboard test)"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
				apt-get install -y -q chromium >/dev/null 2>&1; } || \
				echo "chromium could not be installed: the dashboard test will be skipped"; \
		else echo "no chromium, and no apt-get as root: the dashboard test will be skipped"; fi; }

test: $(STAMP) check-protos browser
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q --durations=15 tests

run: $(STAMP)
	$(VENV)/bin/pagoda serve

# The chaos and fuzz suites' long profile (the quick one runs in `make test`): more requests,
# more fuzz cases; each scenario prints its counts.
chaos: $(STAMP) browser
	PAGODA_CHAOS_PROFILE=long $(PY) -m pytest -q -s --durations=15 tests/chaos

# Benchmarks are never part of `make test`: a quick run of every comparison, under 10 minutes.
bench: $(STAMP)
	$(PY) -m wiring.cli bench --quick --plot --out bench/results

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .  # fails on a formatting drift: `ruff format .` fixes it

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
