# The two commands of the README: `make bench` (the main job) and `make test`.
# Each creates .venv and installs what it needs; on CPU machines torch is the local CPU wheel.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# bench_restore.py's defaults are 2 GiB and 3 runs (~10 s a measurement, 24 of them, on the 2-core
# VMs); 1 GiB and 2 runs keep `make bench` near 5 minutes there
RESTORE_ARGS ?= --size 1GiB --runs 2

.PHONY: venv test bench lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[gpu,test,bench]'
	touch $@

# The suite starts about 200 Python interpreters; where PYTHONDONTWRITEBYTECODE is set (as on the
# development VMs) each compiled gds_persist's ~100 modules again (0.3-0.5 s of CPU): once here
test: venv
	$(PY) -m compileall -q gds_persist tests bench >/dev/null
	$(PY) -m pytest -q

bench: venv
	@command -v fio >/dev/null || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && apt-get install -y -qq fio >/dev/null) || echo "fio not installed: the drive limit will be a plain O_DIRECT stream"; }
	$(PY) bench/bench_io.py --svg bench/out/bench_io.svg $(BENCH_ARGS)
	$(PY) bench/bench_restore.py $(RESTORE_ARGS)

lint: venv
	$(VENV)/bin/ruff check gds_persist tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
