"""README.md's commands work (issue 37): every command line of its ```sh blocks is run for real,
in the README's order, in a fresh directory, and must exit 0, unless it is too long for CI, in
which case it must parse. The quickstart's ```python block is the `quickstart.py` that its
`python quickstart.py` line runs (on 2 in-process CPU devices), so the Python example runs too.

What is only checked, and how:
- `pip install ...`: not run here (it would change this environment); tests/test_package.py
  installs the bare package into a fresh venv and runs `overlap` from it, and `make` installs the
  extras from requirements.lock for every other test.
- `make TARGET` (`make run` tunes for minutes, `make test` is the whole suite): `make -n TARGET`.
- `autotuner ...` on a target other than `inproc:N` (a lab needs root and minutes, `local` the
  job's own hosts, `aot:tpu:...` libtpu and minutes of XLA:TPU compiles), `autotuner up`, `autotuner
  lab ...`, or a service that is not on this machine: parsed by the CLI's own click tree (every
  option known, every value converted); its `--help` is checked with every other command's.
Every `autotuner` command of the README, run or not, is also parsed that way, and every command of
the CLI renders its `--help` (in-process, `test_every_command_renders_its_help`).

A line ending in `&` (`autotuner serve`) starts in the background on a free port; the README's
`127.0.0.1:8000` in the lines after it is rewritten to that port. The run takes about 1.5 minutes
on 2 cores: the tune is `--trials 2 --reps 3 --precision 0` on a 1-layer step of 12 small problems.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent          # the venv's bin: its `autotuner` and `python`
DEFAULT_URL = "127.0.0.1:8000"              # where the README's service listens
QUICKSTART = "quickstart.py"                # the name the README gives its Python block
ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def command_lines(block: str) -> list[str]:
    """One string per command: `\\`-continued lines joined, blank and comment lines left out."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    assert not pending, f"a README command ends in a continuation: {pending!r}"
    return out


def split(line: str) -> tuple[dict[str, str], list[str], bool]:
    """(environment assignments, argv, background?) of one command line."""
    words = shlex.split(line, comments=True)
    background = bool(words) and words[-1] == "&"
    words = words[:-1] if background else words
    env: dict[str, str] = {}
    while words and ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words, f"no command in README line {line!r}"
    return env, words, background


def option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def too_long(argv: list[str]) -> str | None:
    """Why this README command is parsed instead of run, or None: it is run."""
    tool = argv[0]
    if tool == "pip":
        return "pip install: tests/test_package.py installs the package into a fresh venv"
    if tool == "make":
        return "make: the whole job or the whole suite; `make -n` checks the target"
    if tool == "autotuner":
        sub = argv[1] if len(argv) > 1 else ""
        if sub in ("up", "lab"):
            return f"autotuner {sub}: the main job / the lab (root, minutes)"
        target = option(argv, "--target")
        if target is not None and not target.startswith("inproc:"):
            return f"--target {target}: a lab, the job's hosts or libtpu's compiler, minutes"
        service = option(argv, "--service")
        if service is not None and DEFAULT_URL not in service:
            return f"--service {service}: a service that is not on this machine"
        return None
    if tool == "python":
        return None
    raise AssertionError(f"README runs {tool!r}: teach tests/test_readme.py to run or check it")


def autotuner_argvs(argv: list[str]) -> Iterator[list[str]]:
    """The `autotuner` commands of one argv: itself, and one that `autotuner lab run ... --` runs."""
    if argv and argv[0] == "autotuner":
        yield argv[1:]
        if "--" in argv:
            yield from autotuner_argvs(argv[argv.index("--") + 1:])


def command_path(args: list[str]) -> list[str]:
    """The subcommand path of `autotuner ARGS` (e.g. ['lab', 'run'], ['tune'])."""
    root = cli_root()
    path: list[str] = []
    cmd = root
    for a in args:
        subs = getattr(cmd, "commands", None)
        if not subs or a.startswith("-"):
            break
        assert a in subs, f"`autotuner {' '.join([*path, a])}`: no such command ({sorted(subs)})"
        path.append(a)
        cmd = subs[a]
    return path


_ROOT_CMD: list[Any] = []


def cli_root() -> Any:
    if not _ROOT_CMD:
        import typer

        from autotuner.cli import app
        _ROOT_CMD.append(typer.main.get_command(app))
    return _ROOT_CMD[0]


def test_every_command_renders_its_help() -> None:
    """`autotuner ... --help` for every command of the click tree, in-process: exits 0 and names
    the command's options, each paragraph of its help on one line (a help text typer cannot render
    fails here, not on a user's screen)."""
    from typer.testing import CliRunner

    from autotuner.cli import app

    def walk(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        yield path, cmd
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            yield from walk(sub, [*path, name])

    seen = 0
    for path, cmd in walk(cli_root(), []):
        r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"})
        assert r.exit_code == 0, f"autotuner {' '.join(path)} --help: {r.output[-2000:]}"
        for p in cmd.params:
            if p.opts[0].startswith("--") and not getattr(p, "hidden", False):
                assert p.opts[0] in r.output, f"autotuner {' '.join(path)} --help does not show {p.opts[0]}"
        # a paragraph is one line: rich keeps a help text's line breaks, so a docstring wrapped
        # in the source came out ragged in a terminal of another width (`cli.common.reflow_help`)
        assert all("\n" not in para for para in (cmd.help or "").split("\n\n")), (path, cmd.help)
        seen += 1
    assert seen > 10, seen


def parse_error(args: list[str]) -> str | None:
    """Parse `autotuner ARGS` with the CLI's click tree (options known, values converted), running
    nothing: None, or click's message."""
    import typer

    path = command_path(args)
    cmd = cli_root()
    for name in path:
        cmd = cmd.commands[name]
    if hasattr(cmd, "commands"):
        return f"`autotuner {' '.join(path)}` needs a subcommand"
    try:
        cmd.make_context(" ".join(["autotuner", *path]), list(args[len(path):]))
    except typer.Exit:
        return None
    except Exception as e:  # click's UsageError/BadParameter (Typer vendors click: duck-typed)
        if not callable(getattr(e, "format_message", None)):
            raise
        return e.format_message()
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"`autotuner serve` exited with {proc.returncode}"
        try:
            if httpx.get(url + "/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"`autotuner serve` did not answer on {url} within {timeout:.0f} s")


def test_readme_commands_are_all_run_or_checked() -> None:
    """Cheap and fast: every README command is known to the classifier, every `autotuner` command
    of it parses, and the quickstart's Python block is run by one of its command lines."""
    text = README.read_text()
    lines = [line for block in blocks(text, "sh") for line in command_lines(block)]
    assert lines, "README.md has no ```sh blocks"
    errors = []
    for line in lines:
        _, argv, _ = split(line)
        too_long(argv)   # raises on a tool the test cannot run or check
        for args in autotuner_argvs(argv):
            err = parse_error(args)
            if err:
                errors.append(f"{line}: {err}")
    assert not errors, "\n".join(errors)
    assert len(blocks(text, "python")) == 1, "README.md: one ```python block, the quickstart"
    assert any(split(line)[1][:2] == ["python", QUICKSTART] for line in lines), (
        f"no README command runs `python {QUICKSTART}` (the ```python block)")


@pytest.mark.slow
def test_readme_commands_run(tmp_path: Path) -> None:
    text = README.read_text()
    (tmp_path / QUICKSTART).write_text(blocks(text, "python")[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOTUNER_", "XLA_FLAGS", "JAX_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", JAX_PLATFORMS="cpu",
               AUTOTUNER_CACHE_DIR=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    background: list[subprocess.Popen[bytes]] = []
    url = DEFAULT_URL
    ran, checked = [], []
    try:
        for block in blocks(text, "sh"):
            for line in command_lines(block):
                assigned, argv, in_background = split(line)
                argv = [a.replace(DEFAULT_URL, url) for a in argv]
                for args in autotuner_argvs(argv):
                    err = parse_error(args)
                    assert err is None, f"README: {line}: {err}"
                why = too_long(argv)
                if why is not None:
                    checked.append(line)
                    if argv[0] == "make":
                        r = subprocess.run(["make", "-n", "-C", str(ROOT), *argv[1:]], env=env,
                                           capture_output=True, text=True, timeout=120)
                        assert r.returncode == 0, f"README: {line}: make -n: {r.stderr[-2000:]}"
                    continue
                ran.append(line)
                if in_background:
                    assert argv[:2] == ["autotuner", "serve"], f"README: only the service runs in the background: {line}"
                    port = free_port()
                    proc = subprocess.Popen([*argv, "--port", str(port)], env={**env, **assigned}, cwd=tmp_path,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    background.append(proc)
                    url = f"127.0.0.1:{port}"
                    wait_healthy(f"http://{url}", proc)
                    continue
                r = subprocess.run(argv, env={**env, **assigned}, cwd=tmp_path, capture_output=True, text=True,
                                   timeout=300)
                assert r.returncode == 0, (f"README: {line}\nexit {r.returncode}\n"
                                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
                if argv[:2] == ["python", QUICKSTART]:
                    assert "pairs decomposed" in r.stdout and "loss" in r.stdout, r.stdout[-3000:]
    finally:
        for proc in background:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert any(line.split()[:2] == ["autotuner", "tune"] for line in ran), ran
    assert checked, "nothing was too long to run: then the classifier is not exercised"
