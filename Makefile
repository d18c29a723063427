# The two commands every user runs: `make run` (the main job) and `make test` (every test).
# Both work from nothing: they create .venv and install the pinned requirements.lock into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODELS := $(VENV)/.models-installed
TPU    := $(VENV)/.tpu-installed

.PHONY: run test install tpu lint clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The `models` extra: third-party transformer libraries for tests/models (see requirements-models.lock).
$(MODELS): $(STAMP) requirements-models.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.lock
	touch $(MODELS)

# The XLA:TPU compiler (libtpu) for the aot:tpu:TOPOLOGY target and the tpu tests: jax's own `tpu`
# extra at the installed jax's version, so libtpu always matches jax (about 680 MB).
$(TPU): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check "jax[tpu]==$$($(PY) -c 'import importlib.metadata as m; print(m.version("jax"))')"
	touch $(TPU)

install: $(STAMP)

tpu: $(TPU)

run: $(STAMP)
	$(VENV)/bin/autotuner up

# scripts/test.sh installs and starts PostgreSQL and chromium when root (else says what skips).
test: $(STAMP) $(MODELS) $(TPU)
	PY=$(PY) scripts/test.sh

lint: $(STAMP)
	$(PY) -m ruff check autotuner db service tests bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
