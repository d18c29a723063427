#!/usr/bin/env bash
# `make test`: every test. Prepares what the suite needs, then lint and pytest. (The Makefile has
# already installed the models extra and libtpu, the XLA:TPU compiler of the tpu tests.)
#
# As root with apt-get (a fresh CI box or dev machine), it installs and starts what is missing —
# Debian's chromium for the browser tests (scripts/test_deps.sh) and PostgreSQL 15 for the
# postgres tests (scripts/ci_services.sh) — and then requires both groups to run (they fail
# instead of skipping). Without root it prints one line per group that will skip and what to
# install. A PostgreSQL of your own: set AUTOTUNER_TEST_PG_URL and nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

root_apt=0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  root_apt=1
fi

scripts/test_deps.sh
if [ -x /usr/lib/chromium/chromium ] || [ -n "${AUTOTUNER_CHROMIUM:-}" ]; then
  export AUTOTUNER_REQUIRE_BROWSER="${AUTOTUNER_REQUIRE_BROWSER:-1}"
else
  echo "make test: browser tests will skip: apt-get install chromium (as root), or set AUTOTUNER_CHROMIUM" >&2
fi

if [ -n "${AUTOTUNER_TEST_PG_URL:-}" ]; then
  export AUTOTUNER_REQUIRE_POSTGRES="${AUTOTUNER_REQUIRE_POSTGRES:-1}"
elif [ "$root_apt" = "1" ]; then
  source scripts/ci_services.sh
else
  echo "make test: PostgreSQL tests will skip: run as root (installs postgresql-15), or set AUTOTUNER_TEST_PG_URL" >&2
fi

# the tpu group compiles with libtpu (make test installs it): it runs, or fails, never skips
if "$PY" -c "import libtpu" >/dev/null 2>&1; then
  export AUTOTUNER_REQUIRE_TPU="${AUTOTUNER_REQUIRE_TPU:-1}"
else
  echo "make test: TPU compiler tests will skip: make tpu (pip install \"jax[tpu]==<jax version>\")" >&2
fi

if [ "$(id -u)" != "0" ]; then
  echo "make test: lab tests that shape links will skip: they need root and ip netns" >&2
fi

"$PY" -m ruff check autotuner db service tests bench
# pytest-xdist, three workers, tests handed out as workers free up (`--dist load`, xdist's default).
# On this 2-core machine three workers took 13:29-14:50 (a quiet machine) and 18:12-20:12 (a busy one),
# two 20:55-21:18, serial 31:18; each module kept in one worker (`--dist loadfile`) took 22:15.
# Tests that share the machine's state (the lab's network namespaces, PostgreSQL databases, ports)
# are written to run side by side.
exec "$PY" -m pytest -n 3 "$@"
