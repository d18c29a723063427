"""The `autotuner` command line: one module per command group, each registering its commands on
the app of `autotuner.cli.common`; `main` (the console script) imports them all and runs the app.
No command module imports this package or another command group."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# what the [tune] and [service] extras bring (pyproject.toml): missing, the command says which extra
EXTRAS = frozenset({"typer", "rich", "yaml", "sqlalchemy", "alembic", "psycopg", "optuna", "fastapi", "uvicorn",
                    "prometheus_client", "plotly", "jinja2"})
COMMANDS = ("tune", "worker_cmd", "lab", "up", "db", "extract", "service", "costmodel", "plan_cmd", "bench", "tune_model")


def _registered() -> Any:
    """The Typer app with every command group registered on it."""
    for name in COMMANDS:
        importlib.import_module(f"autotuner.cli.{name}")
    from autotuner.cli.common import app, reflow_help

    reflow_help(app)
    return app


def __getattr__(name: str) -> Any:
    if name == "app":  # `autotuner.cli.app`: the whole command tree (docs, tests, completion)
        return _registered()
    raise AttributeError(f"module 'autotuner.cli' has no attribute {name!r}")


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        app = _registered()
    except ModuleNotFoundError as e:   # the bare package (a training image): the runtime only
        if (e.name or "").split(".")[0] not in EXTRAS:
            raise
        sys.stderr.write(f"error: the autotuner command needs the package's [tune] extra (missing: {e.name}); "
                         "install it with: pip install 'overlap-autotuner[tune]' (or [service], [all])\n")
        sys.exit(2)
    from autotuner.cli.common import err
    from autotuner.errors import AutotunerError

    try:
        app()
    except AutotunerError as e:  # a clear message, never a traceback
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        sys.exit(2)
