# Entry points. Set-up is implicit: every target bootstraps .venv (pinned: requirements.lock) when
# it is missing or older than the pins. `make reports` is the main job, `make test` the test suite.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kdlib-stamp
PROFILE ?= cpu

.PHONY: all reports test lab gpu-test clean-reports lint chromium

all: reports

# A venv without a working pip (`python -m venv` stopped part way, e.g. without Debian's python3.11-venv)
# is made again rather than taken as built.
$(STAMP): requirements.lock pyproject.toml
	@$(BIN)/python -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && $(PY) -m venv $(VENV); }
	$(BIN)/python -m pip install -q pip==26.3
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kdlib)" >/dev/null
	@touch $(STAMP)

# Headless Chromium for the report-rendering test (Debian's package); skipped when present.
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

## reports: every notebook through papermill on its CPU defaults -> reports/ (ipynb + html + index.html)
reports: $(STAMP)
	$(BIN)/kdlib report --profile $(PROFILE)

## test: unit, property and fuzz tests, kernel compile checks, nbval over all notebooks, batch runner (CPU)
test: $(STAMP) chromium
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not gpu" tests
	$(BIN)/python -m pytest -n 2 --dist loadfile --nbval-lax --nbval-current-env notebooks

## lab: JupyterLab on the notebooks; options in LAB_ARGS (e.g. "--no-browser --ip 127.0.0.1 --port 8888"),
## --allow-root added when run as root; the kernels' sockets get CurveZMQ keys where pyzmq has curve
CURVE = $(shell $(BIN)/python -c "import zmq; print(int(zmq.has('curve')))" 2>/dev/null)
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root) \
	  $(if $(filter 1,$(CURVE)),--KernelManager.transport_encryption=auto) $(LAB_ARGS)

## gpu-test: on a CUDA machine (no venv there): every kernel against its reference, the engine on GPU;
## SHARD=K/N runs the K-th of N shares (tests/conftest.py's --shard)
gpu-test:
	python3 -m pytest -m gpu tests $(if $(SHARD),--shard $(SHARD))

lint: $(STAMP)
	$(BIN)/ruff check kdlib tests

clean-reports:
	rm -rf reports/*.html reports/*.ipynb reports/*_files reports/index.json
