#!/usr/bin/env bash
# System services the test suite needs; sourced by scripts/test.sh (`make test`) when root, under `set -euo pipefail`.
#
# PostgreSQL 15 from Debian: installed if missing, cluster 15/main started if it is not running,
# a password set for user `postgres`, the test database created. Then it exports
#   AUTOTUNER_TEST_PG_URL      the URL the postgres-marked tests connect to
#   AUTOTUNER_REQUIRE_POSTGRES=1  so those tests fail instead of skipping if it is unreachable.
# Fast when everything is already there (a few psql calls, no apt).
# Can also be run directly (`bash scripts/ci_services.sh`) to prepare a machine by hand;
# the exports then only live in that shell.
# Overridable: AUTOTUNER_CI_PG_VERSION (15), AUTOTUNER_CI_PG_PASSWORD (postgres),
# AUTOTUNER_CI_PG_DB (autotuner_test).

_autotuner_ci_postgres() {
  local version="${AUTOTUNER_CI_PG_VERSION:-15}"
  local cluster=main
  local password="${AUTOTUNER_CI_PG_PASSWORD:-postgres}"
  local dbname="${AUTOTUNER_CI_PG_DB:-autotuner_test}"
  local port line i exists

  if [ ! -x "/usr/lib/postgresql/${version}/bin/postgres" ] || ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "ci_services: installing PostgreSQL ${version} (apt-get)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi

  line="$(pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1 == v && $2 == c')"
  if [ -z "$line" ]; then
    echo "ci_services: creating cluster ${version}/${cluster}" >&2
    pg_createcluster "$version" "$cluster" >/dev/null
    line="$(pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1 == v && $2 == c')"
  fi
  port="$(awk '{print $3}' <<<"$line")"

  # `status` exits 0 when running, 3 when stopped; `start` on a running cluster is an error.
  if ! pg_ctlcluster "$version" "$cluster" status >/dev/null 2>&1; then
    echo "ci_services: starting PostgreSQL ${version}/${cluster} on port ${port}" >&2
    pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" start
  fi
  for i in $(seq 1 60); do
    if pg_isready -q -h 127.0.0.1 -p "$port"; then
      break
    fi
    if [ "$i" -eq 60 ]; then
      echo "ci_services: PostgreSQL did not become ready on 127.0.0.1:${port}" >&2
      return 1
    fi
    sleep 0.5
  done

  # Password login over TCP (pg_hba: scram-sha-256 on 127.0.0.1); set it only when it fails.
  if ! PGPASSWORD="$password" psql -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAq \
      -c "SELECT 1" >/dev/null 2>&1; then
    # Via stdin so psql interpolates :'pw' as a quoted literal (it does not inside -c).
    runuser -u postgres -- psql -p "$port" -d postgres -q -v ON_ERROR_STOP=1 -v pw="$password" \
      >/dev/null <<<"ALTER USER postgres PASSWORD :'pw'"
  fi

  exists="$(PGPASSWORD="$password" psql -h 127.0.0.1 -p "$port" -U postgres -d postgres -tAq \
    -v ON_ERROR_STOP=1 -c "SELECT 1 FROM pg_database WHERE datname = '${dbname}'")"
  if [ "$exists" != "1" ]; then
    PGPASSWORD="$password" psql -h 127.0.0.1 -p "$port" -U postgres -d postgres -q \
      -v ON_ERROR_STOP=1 -c "CREATE DATABASE \"${dbname}\"" >/dev/null
  fi

  export AUTOTUNER_TEST_PG_URL="postgresql+psycopg://postgres:${password}@127.0.0.1:${port}/${dbname}"
  export AUTOTUNER_REQUIRE_POSTGRES=1
  echo "ci_services: PostgreSQL ready: ${AUTOTUNER_TEST_PG_URL/:${password}@/:***@}" >&2
}

_autotuner_ci_postgres
unset -f _autotuner_ci_postgres
