#!/bin/sh
# Entrypoint of the overlap-autotuner image: runs `autotuner ARGS...`.
#
# Before `serve` it migrates the database (`autotuner db upgrade`: alembic upgrade head, a no-op
# when the schema is already current), so the service never starts on an old schema. It uses
# the --db of the serve command when one is given, else AUTOTUNER_DB_URL. Compose and Kubernetes
# also run the migration as a step of its own before the service starts (deploy/README.md).
set -eu

if [ "${1:-}" = "serve" ]; then
    db=""
    prev=""
    for arg in "$@"; do
        if [ "$prev" = "--db" ]; then
            db=$arg
        fi
        case $arg in
            --db=*) db=${arg#--db=} ;;
        esac
        prev=$arg
    done
    if [ -n "$db" ]; then
        autotuner db upgrade --db "$db"
    else
        autotuner db upgrade
    fi
fi

exec autotuner "$@"
