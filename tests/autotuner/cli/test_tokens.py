"""Bearer tokens on the command line (issue 26): every command that takes ``--token`` also
reads it from its environment variable and from ``--token-file``, so that no deployment has to
write a token into an argv (visible in ``ps``, shell history and pod specs).

The commands ask a tiny ``http.server`` on 127.0.0.1 that records the Authorization header."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from autotuner import snapshot
from autotuner.cli import app
from service.testing import DEVICE, RING, problem

TOKEN_ENV = {"lookup": "AUTOTUNER_SERVICE_TOKEN", "snapshot": "AUTOTUNER_SERVICE_TOKEN",
             "tune": "AUTOTUNER_SERVICE_TOKEN", "worker": "AUTOTUNER_WORKER_TOKEN"}


class Recorder:
    """Answers GET /v1/snapshot (an empty snapshot) and POST /v1/lookup (a tuned ring);
    records each request's Authorization header."""

    def __init__(self) -> None:
        self.auth: list[str | None] = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, doc: Any) -> None:
                rec.auth.append(self.headers.get("Authorization"))
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(snapshot.document([], [], datetime(2026, 1, 1, tzinfo=UTC)))

            def do_POST(self) -> None:  # noqa: N802
                from autotuner import Device, Problem

                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._answer({"strategy": RING, "strategy_key": "ring", "source": "tuned", "speedup": 1.2,
                              "problem_key": Problem.from_dict(request["problem"]).key,
                              "device_key": Device.from_dict(request["device"]).key})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    for name in set(TOKEN_ENV.values()):
        monkeypatch.delenv(name, raising=False)
    rec = Recorder()
    yield rec
    rec.server.shutdown()
    rec.server.server_close()


def _token_params() -> dict[str, tuple[Any, set[str]]]:
    """Command path -> (its --token parameter, the names of all its options)."""
    out = {}

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        for p in cmd.params:
            if "--token" in getattr(p, "opts", ()):
                out[" ".join(path)] = (p, {o for q in cmd.params for o in getattr(q, "opts", ())})
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return out


def test_every_token_option_reads_the_environment_and_a_file():
    params = _token_params()
    assert set(params) == set(TOKEN_ENV), "a new command takes --token: add it to TOKEN_ENV"
    for path, (param, opts) in params.items():
        assert param.envvar == TOKEN_ENV[path], path
        assert "--token-file" in opts, path


def _snapshot(tmp_path: Path, url: str, *extra: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, ["snapshot", "--service", url, "--all", "--out", str(tmp_path / "s.json"),
                                    *extra], env=env)


def test_snapshot_token_from_the_environment_and_a_file(recorder, tmp_path):
    res = _snapshot(tmp_path, recorder.url, env={"AUTOTUNER_SERVICE_TOKEN": "env-token"})
    assert res.exit_code == 0, res.output
    secret = tmp_path / "token"
    secret.write_text("file-token\n")  # as a mounted Secret or `echo` writes it
    res = _snapshot(tmp_path, recorder.url, "--token-file", str(secret), env={"AUTOTUNER_SERVICE_TOKEN": "env-token"})
    assert res.exit_code == 0, res.output
    res = _snapshot(tmp_path, recorder.url, "--token", "argv-token")
    assert res.exit_code == 0, res.output
    assert recorder.auth == ["Bearer env-token", "Bearer file-token", "Bearer argv-token"]


def test_lookup_token_from_a_file(recorder, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("read-token")
    res = CliRunner().invoke(app, ["lookup", "--service", recorder.url, "--problem", json.dumps(problem()),
                                   "--device", json.dumps(DEVICE), "--token-file", str(secret)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.splitlines()[-1])["origin"] == "service"
    assert recorder.auth == ["Bearer read-token"]


@pytest.mark.parametrize(("content", "message"), [
    (None, "No such file"), ("", "the file is empty"), ("two\ntokens\n", "one token on one line"),
    (b"\xff\xfe", "codec"),
])
def test_a_bad_token_file_is_one_line_error(recorder, tmp_path, content, message):
    secret = tmp_path / "token"
    if isinstance(content, bytes):
        secret.write_bytes(content)
    elif content is not None:
        secret.write_text(content)
    res = _snapshot(tmp_path, recorder.url, "--token-file", str(secret))
    assert res.exit_code == 2 and message in res.output and "--token-file" in res.output, res.output
    assert recorder.auth == []


def test_token_and_token_file_both_on_the_command_line(recorder, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("file-token")
    res = _snapshot(tmp_path, recorder.url, "--token", "argv-token", "--token-file", str(secret))
    assert res.exit_code == 2 and "not both" in res.output, res.output
    assert recorder.auth == []


def test_tune_and_worker_without_a_token_name_the_variable(recorder, tmp_path):
    problems = tmp_path / "problems.json"
    problems.write_text(json.dumps([problem()]))
    res = CliRunner().invoke(app, ["tune", "--service", recorder.url, "--target", "inproc:8", "--problems",
                                   str(problems), "--exhaustive"])
    assert res.exit_code == 2 and "AUTOTUNER_SERVICE_TOKEN" in res.output and "--token-file" in res.output
    res = CliRunner().invoke(app, ["worker", "--service", recorder.url, "--target", "inproc:8", "--once"])
    assert res.exit_code == 2 and "AUTOTUNER_WORKER_TOKEN" in res.output and "--token-file" in res.output
    assert recorder.auth == []


class _Session:
    """A stand-in for TargetSession: no devices started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from autotuner import Device

        self.device = Device.from_dict(DEVICE)

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.mark.parametrize("how", ["env", "file"])
def test_worker_token_from_the_environment_or_a_file(recorder, tmp_path, monkeypatch, how):
    from autotuner.measure import targets
    from autotuner.tune import service_worker

    got: list[str] = []
    monkeypatch.setattr(targets, "TargetSession", _Session)
    monkeypatch.setattr(service_worker, "work", lambda ts, service, token, **kw: got.append(token) or 0)
    secret = tmp_path / "token"
    secret.write_text("worker-file-token\n")
    extra, env = (([], {"AUTOTUNER_WORKER_TOKEN": "worker-env-token"}) if how == "env"
                  else (["--token-file", str(secret)], None))
    res = CliRunner().invoke(app, ["worker", "--service", recorder.url, "--target", "inproc:8", "--once", *extra],
                             env=env)
    assert res.exit_code == 0, res.output
    assert got == ["worker-env-token" if how == "env" else "worker-file-token"]


@pytest.mark.parametrize("command", ["tune", "worker"])
def test_a_service_url_without_its_scheme_is_one_line_before_a_target_starts(tmp_path, command):
    problems = tmp_path / "problems.json"
    problems.write_text(json.dumps([problem()]))
    argv = [command, "--service", "autotuner:8000", "--token", "t", "--target", "inproc:8"]
    res = CliRunner().invoke(app, [*argv, "--problems", str(problems)] if command == "tune" else argv)
    assert res.exit_code == 2, res.output
    assert "service URL 'autotuner:8000': expected http(s)://HOST[:PORT]" in res.output, res.output
    assert "lab " not in res.output and "worker on" not in res.output and "target" not in res.output
