VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
AZURITE := azurite@3.37.0

.PHONY: install test test-ray demo bench faults lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,integrations,s3,azure,ray]' '$(TORCH_PIN)'
	touch $@

# Azurite (the Azure Blob emulator the az:// tests run against) from the npm registry; without
# Node.js/npm the install goes on and those tests are skipped, saying why
.azurite/.installed: Makefile
	if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .azurite $(AZURITE) && touch $@; \
	else echo "npm not found: the az:// tests (Azurite) will be skipped"; fi

install: $(VENV)/.installed .azurite/.installed

test: install
	$(PY) -m pytest -q --durations=20 tests

# the Ray Train tests alone (a local Ray cluster: about 1 minute on 2 idle cores, 3-4 on busy ones); make test runs them too
test-ray: install
	$(PY) -m pytest -q -m ray tests/test_ray.py

demo: install
	$(PY) examples/demo.py

bench: install
	$(PY) benchmarks/bench_single.py
	$(PY) benchmarks/bench_distributed.py
	$(PY) benchmarks/bench_broadcast.py
	$(PY) benchmarks/bench_planning.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_incremental.py
	$(PY) benchmarks/bench_async.py
	$(PY) benchmarks/bench_export.py
	$(PY) benchmarks/bench_s3.py
	$(PY) benchmarks/bench_compression.py
	$(PY) benchmarks/bench_recovery.py

faults: install
	$(PY) -m faults.campaign
	SHARDSAFE_LAYOUT_CASES=60 $(PY) -m pytest -q tests/test_layout_property.py

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) .azurite build *.egg-info src/*.egg-info
