"""The `autotuner` Typer app every command module registers on, and what they share: the
stderr console, `say`, `fail` (one line, exit 2), the database URL and opening the database (these
five from `autotuner.program.console`, which the program-level library shares), `fmt`, and the
bearer token of a --token / --token-file pair (`token_of`); `reflow_help` puts each paragraph of
every command's help on one line."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import typer

from autotuner.program.console import DB_HELP, db_url, err, fail, open_database, say

__all__ = ["DB_HELP", "SERVICE_TOKEN_ENV", "TOKEN_FILE_HELP", "app", "db_app", "db_url", "err", "fail", "fmt",
           "open_database", "say", "token_of"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Pick, per sharded einsum and device, the fastest collective/einsum overlap.")
db_app = typer.Typer(no_args_is_help=True, help="Manage the results database.")
app.add_typer(db_app, name="db")


def _version(value: bool) -> None:
    if value:
        import importlib.metadata as md

        import jax

        try:
            mine = md.version("overlap-autotuner")
        except md.PackageNotFoundError:
            mine = "unknown (not installed)"
        typer.echo(f"overlap-autotuner {mine} (jax {jax.__version__})")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version (and JAX's) and exit.")) -> None:
    """Pick, per sharded einsum and device, the fastest collective/einsum overlap."""


def reflow_help(typer_app: typer.Typer) -> None:
    """Every command's help (its docstring where it has no `help=`) with each paragraph on one
    line: rich, which renders typer's help, keeps a docstring's line breaks, so a paragraph wrapped
    at 100 columns in the source came out ragged in an 80-column terminal. Groups recursively."""
    for info in typer_app.registered_commands:
        text = info.help if info.help is not None else inspect.getdoc(info.callback)
        if text:
            info.help = "\n\n".join(" ".join(p.split("\n")) for p in text.split("\n\n"))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# -- bearer tokens ---------------------------------------------------------------------------------
# Every command that takes a --token reads it from the environment too (the option's envvar) or
# from --token-file: a token written on a command line shows in `ps`, shell history and pod specs.
SERVICE_TOKEN_ENV = "AUTOTUNER_SERVICE_TOKEN"  # also the client's setting (settings.service_token)
TOKEN_FILE_HELP = "read the token from this file (e.g. a mounted Secret) instead of --token"


def token_of(ctx: typer.Context, token: str | None, token_file: Path | None) -> str | None:
    """The bearer token: the contents of ``--token-file`` when given (trailing whitespace
    stripped), else ``--token`` or its environment variable. One line (exit 2): an unreadable,
    empty or multi-line file, or --token and --token-file both on the command line."""
    if token_file is None:
        return token or None
    source = ctx.get_parameter_source("token")
    if token is not None and source is not None and source.name == "COMMANDLINE":
        fail("give --token or --token-file, not both")
    try:
        text = token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--token-file {token_file}: {getattr(e, 'strerror', None) or e}")
        raise AssertionError from e
    if not text or any(c.isspace() for c in text):
        fail(f"--token-file {token_file}: expected one token on one line"
             + (", the file is empty" if not text else ""))
    return text


def check_service_url(url: str) -> None:
    """One line (exit 2) unless ``url`` is an http(s)://HOST[:PORT] URL (`runtime.transport.check_url`,
    the client's rule): before a target starts, not after the first request."""
    from autotuner.runtime.transport import ServiceURLError, check_url

    try:
        check_url(url)
    except ServiceURLError as e:
        fail(str(e))
