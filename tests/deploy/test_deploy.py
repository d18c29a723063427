"""The deployment files (deploy/) against the code they deploy.

No Docker engine or cluster is needed: the Dockerfile, the compose file and the Kubernetes
manifests are parsed, and what they say is checked against the code itself:

- every ``AUTOTUNER_*`` name is a field of ``autotuner.settings.Settings`` (read from the class), or a
  documented compose-only variable; the values they set validate as Settings;
- every ``autotuner ...`` command line (compose, Kubernetes, the image's ENTRYPOINT/CMD and
  entrypoint script, RUN lines, the README) parses with the real click command tree of the
  Typer app behind the ``autotuner`` console script;
- ports, probes and the HEALTHCHECK agree with the ``--port`` default of ``autotuner serve``
  and the service's ``GET /healthz`` route;
- images are the one built from deploy/Dockerfile; what the Dockerfile COPYs exists, is not
  dockerignored, and is every package pyproject.toml installs;
- the order of start-up (healthy PostgreSQL, then the migration, then the service, then the
  worker), fail-fast secrets, non-root users, accelerator requests;
- no token on any command line (compose, Kubernetes, the image, the README): each comes from the
  environment variable of its command's --token option, or --token-file; compose publishes the
  service on loopback unless told otherwise (reads are open while no read token is set).

Every check is a function returning a list of errors, so that ``test_checks_catch_mistakes``
can apply realistic mistakes to the files in memory and see each check fail.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = "deploy/Dockerfile"
DOCKERIGNORE = "deploy/Dockerfile.dockerignore"  # BuildKit: <Dockerfile>.dockerignore
ENTRYPOINT_SCRIPT = "deploy/docker-entrypoint.sh"
COMPOSE = "deploy/docker-compose.yml"
K8S = "deploy/k8s"
README = "deploy/README.md"
IMAGE_NAME = "overlap-autotuner"
HEALTH_PATH = "/healthz"
LIVE_PATH = "/livez"
# AUTOTUNER_* names the deploy files use that are not settings: compose variables only,
# interpolated into a command line (never a container's environment: the code ignores them).
DEPLOY_ONLY_VARS = {"AUTOTUNER_WORKER_TOKEN": "the tuner worker's token (docker-compose.yml, the k8s worker pool)",
                    "AUTOTUNER_BIND": "the host address compose publishes the service on (docker-compose.yml)"}
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# accelerator resource -> the JAX_EXTRA its image must be built with (a prefix of it)
ACCELERATORS = {"nvidia.com/gpu": "cuda", "google.com/tpu": "tpu"}
TPU_NODE_SELECTORS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")
POD_KINDS = {"Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}
CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


# -- the code ------------------------------------------------------------------------------------

@functools.cache
def settings_fields() -> dict[str, str]:
    """Environment variable name -> field name, from ``autotuner.settings.Settings`` itself."""
    from autotuner.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    out = {}
    for name, f in Settings.model_fields.items():
        alias = f.validation_alias if isinstance(f.validation_alias, str) else None
        out[(alias or prefix + name).upper()] = name
    return out


@functools.cache
def secret_settings() -> frozenset[str]:
    """Settings that hold secrets: those kept out of repr (tokens), and the database URL
    (it holds the password)."""
    from autotuner.settings import Settings

    return frozenset(env for env, name in settings_fields().items()
                     if Settings.model_fields[name].repr is False) | {"AUTOTUNER_DB_URL"}


def parse_settings(env: dict[str, str]) -> Any:
    """Settings from ``env``'s AUTOTUNER_* values alone (not the process's environment)."""
    from autotuner.settings import Settings

    fields = settings_fields()
    return Settings(_env_file=None, **{fields[k]: v for k, v in env.items() if k in fields})


def settings_errors(env: dict[str, str], where: str) -> list[str]:
    from pydantic import ValidationError

    try:
        parse_settings(env)
    except ValidationError as e:
        return [f"{where}: invalid settings: {e}"]
    return []


class Cli:
    """The click tree of the Typer app behind the `autotuner` console script (pyproject.toml)."""

    def __init__(self) -> None:
        script = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["autotuner"]
        module, _, _func = script.partition(":")
        app = importlib.import_module(module).app
        assert isinstance(app, typer.Typer), f"{module}.app is not a Typer app"
        self.root = typer.main.get_command(app)

    # Typer 0.29 vendors its own click (typer._click): the tree is walked by duck typing
    # (a group has `commands`), and errors are told apart by click's `format_message`.
    def command(self, path: list[str]) -> Any:
        cmd = self.root
        for name in path:
            if name not in (getattr(cmd, "commands", None) or {}):
                return None
            cmd = cmd.commands[name]
        return cmd

    def parse(self, args: list[str]) -> tuple[list[str], Any, str | None]:
        """(command path, its parsed context, error). No context after --help."""
        cmd = self.root
        path: list[str] = []
        rest = list(args)
        while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
            if rest[0] not in cmd.commands:
                where = " ".join(["autotuner", *path])
                return path, None, (f"`{where} {rest[0]}`: no such command "
                                    f"(commands: {', '.join(sorted(cmd.commands))})")
            path.append(rest.pop(0))
            cmd = cmd.commands[path[-1]]
        name = " ".join(["autotuner", *path])
        if "--help" in rest:
            return path, None, None
        if hasattr(cmd, "commands"):
            return path, None, f"`{name}` needs a subcommand ({', '.join(sorted(cmd.commands))})"
        try:
            ctx = cmd.make_context(name, rest)
        except typer.Exit:
            return path, None, None
        except Exception as e:
            if not callable(getattr(e, "format_message", None)):
                raise
            return path, None, f"`{name} {' '.join(rest)}`: {e.format_message()}"
        return path, ctx, None

    def errors(self, args: list[str], where: str) -> list[str]:
        _, _, err = self.parse(args)
        return [f"{where}: {err}"] if err else []

    def mention_errors(self, args: list[str], where: str) -> list[str]:
        """For a command named in prose (`autotuner worker`, `... --token ...`): the command
        exists and every --option named is one of its options; values may be left out."""
        cmd, path, rest = self.root, [], list(args)
        while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
            if rest[0] not in cmd.commands:
                return [f"{where}: `autotuner {' '.join([*path, rest[0]])}`: no such command"]
            path.append(rest.pop(0))
            cmd = cmd.commands[path[-1]]
        opts = {o for p in cmd.params for o in [*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())]}
        return [f"{where}: `autotuner {' '.join(path)}` has no option {a.split('=')[0]}"
                for a in rest if a.startswith("-") and a.split("=")[0] not in opts | {"--help"}]


@functools.cache
def cli() -> Cli:
    return Cli()


@functools.cache
def cli_envvars() -> dict[str, frozenset[str]]:
    """Environment variables CLI options read (click's `envvar`) -> the commands that read them."""
    out: dict[str, set[str]] = {}

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        for p in cmd.params:
            env = p.envvar if isinstance(p.envvar, list | tuple) else [p.envvar] if p.envvar else []
            for name in env:
                out.setdefault(name, set()).add(" ".join(path))
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(cli().root, ())
    return {k: frozenset(v) for k, v in out.items()}


def serve_port() -> int | None:
    """The default of `autotuner serve --port` (None while there is no serve command)."""
    serve = cli().command(["serve"])
    if serve is None:
        return None
    (port,) = [p for p in serve.params if "--port" in getattr(p, "opts", ())]
    return int(port.default)


def serve_missing() -> list[str]:
    return [] if serve_port() is not None else ["`autotuner serve` is not a command of the CLI "
                                                "(its --port default is the service's port)"]


@functools.cache
def get_routes() -> frozenset[str]:
    from service.routes import ROUTERS

    return frozenset(r.path for router in ROUTERS for r in router.routes
                     if "GET" in (getattr(r, "methods", None) or ()))


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


# -- shell ---------------------------------------------------------------------------------------

_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "(", ")", "2>", ";;"}


def shell_commands(text: str) -> Iterator[list[str]]:
    """The simple commands of a shell snippet (continuations joined), as argv lists, with
    leading `exec`, `env` and VAR=value words dropped. Best effort, for the lines we write."""
    text = re.sub(r"\\\n", " ", text)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            tokens = list(lex)
        except ValueError:
            continue
        cmd: list[str] = []
        for tok in [*tokens, ";"]:
            if tok in _OPERATORS or set(tok) <= set("&|;<>()"):
                while cmd and (cmd[0] in ("exec", "env", "then", "do", "else", "!", "time")
                               or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0])):
                    cmd.pop(0)
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(tok)


def autotuner_calls(text: str) -> Iterator[list[str]]:
    """Arguments of every `autotuner ...` call in a shell snippet (`"$@"` pass-throughs skipped)."""
    for argv in shell_commands(text):
        if Path(argv[0]).name == "autotuner" and "$@" not in argv:
            yield argv[1:]


# -- Dockerfile ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instr:
    op: str
    rest: str
    line: int

    def argv(self) -> list[str]:
        """Exec form (JSON) as is; shell form as /bin/sh -c."""
        text = self.rest.strip()
        if text.startswith("["):
            return list(json.loads(text))
        return ["/bin/sh", "-c", text]

    def flags_and_words(self) -> tuple[dict[str, str], list[str]]:
        """COPY/ADD: ({"from": ..., "chmod": ...}, [sources..., destination])."""
        text = self.rest.strip()
        flags: dict[str, str] = {}
        words = shlex.split(text)
        while words and words[0].startswith("--"):
            key, _, value = words.pop(0)[2:].partition("=")
            flags[key] = value
        if words and words[0].startswith("["):
            words = list(json.loads(" ".join(words)))
        return flags, words


def parse_dockerfile(text: str) -> list[list[Instr]]:
    """The stages of a Dockerfile, each a list of instructions (continuations joined)."""
    stages: list[list[Instr]] = [[]]  # stage 0: the global ARGs before the first FROM
    buf, start = "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment inside a continuation
        if not buf:
            start = no
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        op, _, rest = buf.partition(" ")
        instr = Instr(op.upper(), rest.strip(), start)
        if instr.op == "FROM":
            stages.append([])
        stages[-1].append(instr)
        buf = ""
    return stages


def dockerignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = _glob_regex(pattern.lstrip("!").strip().strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


# -- compose interpolation -----------------------------------------------------------------------

_INTERP = re.compile(r"\$(?:(?P<esc>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])"
                     r"(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Ref:
    name: str
    op: str | None   # None, "-", ":-", "?", ":?", "+", ":+"
    arg: str


def compose_refs(text: str) -> list[Ref]:
    return [Ref(m["name"] or m["bare"], m["op"], m["arg"] or "")
            for m in _INTERP.finditer(text) if not m["esc"]]


class MissingVariable(ValueError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of ``${VAR}``, ``${VAR:-x}``, ``${VAR:?msg}``, ... and ``$$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m["esc"]:
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"], m["arg"] or ""
        is_set, nonempty = name in env, bool(env.get(name))
        if op in (":?", "?") and not (nonempty if op == ":?" else is_set):
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-"):
            return env[name] if (nonempty if op == ":-" else is_set) else arg
        if op in (":+", "+"):
            return arg if (nonempty if op == ":+" else is_set) else ""
        return env.get(name, "")

    return _INTERP.sub(sub, value)


# -- the deploy files ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Container:
    where: str        # "file: kind/name: container"
    spec: dict[str, Any]
    pod: dict[str, Any]
    doc: dict[str, Any]
    init: bool


@dataclass(frozen=True)
class Deploy:
    """The files under deploy/ (as text, so that tests can alter them) and their parsed forms."""

    texts: dict[str, str]

    @classmethod
    def from_repo(cls) -> Deploy:
        texts = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "deploy").rglob("*"))
                 if p.is_file()}
        return cls(texts)

    def replaced(self, path: str, old: str, new: str, count: int = 1) -> Deploy:
        assert old in self.texts[path], f"{old!r} not in {path}: the mutation is stale"
        return Deploy({**self.texts, path: self.texts[path].replace(old, new, count)})

    # Dockerfile
    @cached_property
    def stages(self) -> list[list[Instr]]:
        return parse_dockerfile(self.texts[DOCKERFILE])

    @cached_property
    def final(self) -> list[Instr]:
        return self.stages[-1]

    def last(self, op: str) -> Instr | None:
        found = [i for i in self.final if i.op == op]
        return found[-1] if found else None

    @cached_property
    def image_entrypoint(self) -> list[str]:
        i = self.last("ENTRYPOINT")
        return i.argv() if i else []

    @cached_property
    def image_cmd(self) -> list[str]:
        i = self.last("CMD")
        return i.argv() if i else []

    def build_args(self) -> dict[str, str]:
        """ARG names (all stages) -> default."""
        out = {}
        for stage in self.stages:
            for i in stage:
                if i.op == "ARG":
                    name, _, default = i.rest.partition("=")
                    out[name.strip()] = default.strip().strip('"')
        return out

    # compose
    @cached_property
    def compose_raw(self) -> dict[str, Any]:
        return yaml.safe_load(self.texts[COMPOSE])

    def compose(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        return interpolate(self.compose_raw, env if env is not None else self.fake_env())

    @cached_property
    def compose_refs(self) -> list[Ref]:
        """The interpolations in the compose file's values (comments are not values)."""
        def strings(v: Any) -> Iterator[str]:
            if isinstance(v, dict):
                for x in v.values():
                    yield from strings(x)
            elif isinstance(v, list):
                for x in v:
                    yield from strings(x)
            elif isinstance(v, str):
                yield v

        return [r for s in strings(self.compose_raw) for r in compose_refs(s)]

    def fake_env(self) -> dict[str, str]:
        """A value for every variable the compose file names, each recognisable."""
        return {r.name: f"<{r.name}>" for r in self.compose_refs}

    # kubernetes
    @cached_property
    def k8s_docs(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for path, text in self.texts.items():
            if path.startswith(K8S + "/") and path.endswith((".yaml", ".yml")):
                out += [(path, d) for d in yaml.safe_load_all(text) if d]
        return out

    def k8s(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        return [(p, d) for p, d in self.k8s_docs if d.get("kind") == kind]

    def k8s_applied(self, path: str) -> bool:
        """Whether `kubectl apply -f deploy/k8s/` applies the file (it does not recurse)."""
        return str(Path(path).parent) == K8S

    @cached_property
    def containers(self) -> list[Container]:
        out = []
        for path, doc in self.k8s_docs:
            pod = pod_spec(doc)
            if pod is None:
                continue
            name = doc["metadata"].get("name") or doc["metadata"].get("generateName")
            for init, key in ((True, "initContainers"), (False, "containers")):
                for c in pod.get(key) or []:
                    out.append(Container(f"{path}: {doc['kind']}/{name}: {c['name']}", c, pod, doc, init))
        return out

    # README
    @cached_property
    def readme_blocks(self) -> list[str]:
        return re.findall(r"```(?:sh|bash|shell|console)?\n(.*?)```", self.texts[README], re.S)

    @cached_property
    def readme_inline(self) -> list[str]:
        text = re.sub(r"```.*?```", "", self.texts[README], flags=re.S)
        return re.findall(r"`([^`\n]+)`", text)


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind not in POD_KINDS:
        return None
    if kind == "Pod":
        return spec
    if kind == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def effective_argv(entrypoint: Any, command: Any, image_ep: list[str], image_cmd: list[str]) -> list[str]:
    """What runs: an overridden entrypoint drops the image's CMD (compose and Kubernetes alike)."""
    def words(v: Any) -> list[str]:
        return shlex.split(v) if isinstance(v, str) else [str(x) for x in v]

    if entrypoint is not None:
        return words(entrypoint) + (words(command) if command is not None else [])
    return image_ep + (words(command) if command is not None else image_cmd)


def our_image(image: str) -> tuple[str, str] | None:
    """(version, extra) for [REGISTRY/]overlap-autotuner:VERSION[-EXTRA], else None."""
    m = re.fullmatch(rf"(?:.+/)?{re.escape(IMAGE_NAME)}:([0-9][^-\s]*)(?:-([a-z0-9]+))?", image)
    return (m[1], m[2] or "") if m else None


def cli_args_of(argv: list[str], d: Deploy) -> list[str] | None:
    """The `autotuner` arguments of a container's argv; None for a `python -c` snippet.
    Raises ValueError for any other program."""
    if not argv:
        raise ValueError("runs nothing (no ENTRYPOINT/CMD and no command)")
    prog = Path(argv[0]).name
    if prog == "autotuner":
        return argv[1:]
    if d.image_entrypoint and argv[: len(d.image_entrypoint)] == d.image_entrypoint:
        return argv[len(d.image_entrypoint):]  # the entrypoint script execs `autotuner "$@"`
    if prog.startswith("python") and argv[1:2] == ["-c"]:
        return None
    raise ValueError(f"runs {argv[0]!r}, neither autotuner nor the image's entrypoint")


def python_snippet_errors(code: str, where: str) -> list[str]:
    """A `python -c` snippet compiles, and the names it imports from our packages exist."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return [f"{where}: python -c: {e}"]
    errors = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (
                "db", "service", "autotuner"):
            try:
                module = importlib.import_module(node.module)
            except ImportError as e:
                errors.append(f"{where}: python -c: {e}")
                continue
            errors += [f"{where}: python -c imports {a.name} from {node.module}, which has none"
                       for a in node.names if not hasattr(module, a.name)]
    return errors


# -- checks: environment variables ---------------------------------------------------------------

def check_env_names(d: Deploy) -> list[str]:
    """Every AUTOTUNER_* name anywhere in deploy/ is read by the code: a Settings field, or an
    environment variable of a CLI option (then only set for a container running that command),
    or a compose-only variable, interpolated in the compose file and documented in the README."""
    errors = []
    fields, envvars = settings_fields(), cli_envvars()
    for path, text in d.texts.items():
        for name in sorted(set(re.findall(r"\bAUTOTUNER_[A-Z0-9_]*[A-Z0-9]\b", text))):
            if name in fields or name in envvars:
                continue
            if name not in DEPLOY_ONLY_VARS:
                errors.append(f"{path}: {name} is not a setting (autotuner.settings.Settings has "
                              f"{', '.join(sorted(fields))}) nor an option's environment variable")
            elif path not in (COMPOSE, README):
                errors.append(f"{path}: {name} is not read by the code ({DEPLOY_ONLY_VARS[name]})")
    for name in DEPLOY_ONLY_VARS:
        if name not in d.texts[README]:
            errors.append(f"{README}: does not document {name}")
    # who sets what: a variable read by a CLI option only, for a container running that command
    env_of: list[tuple[str, set[str], list[str]]] = []
    for svc, spec in (d.compose().get("services") or {}).items():
        if our_image(str(spec.get("image", ""))) is not None:
            env_of.append((f"{COMPOSE}: {svc}", set(compose_env(spec)), _cli_path(_service_argv(spec, d), d)))
    for c in d.containers:
        env, _ = container_env(c, d)
        env_of.append((c.where, set(env), _cli_path(effective_argv(
            c.spec.get("command"), c.spec.get("args"), d.image_entrypoint, d.image_cmd), d)))
    for where, names, path in env_of:
        for name in sorted(names):
            if name in fields or not name.startswith("AUTOTUNER_"):
                continue
            readers = envvars.get(name, frozenset())
            if " ".join(path) not in readers:
                errors.append(f"{where}: sets {name}, which is not read by `autotuner {' '.join(path)}`"
                              + (f" (only by {', '.join(sorted(readers))})" if readers else ""))
    return errors


def compose_env(spec: dict[str, Any]) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def container_env(c: Container, d: Deploy) -> tuple[dict[str, str], list[str]]:
    """(name -> value or '<from NAME>', errors): explicit env plus envFrom sources, resolved."""
    env: dict[str, str] = {}
    errors = []
    sources = {("ConfigMap", doc["metadata"]["name"]): doc.get("data") or {} for _, doc in d.k8s("ConfigMap")}
    sources |= {("Secret", doc["metadata"]["name"]): {**(doc.get("data") or {}), **(doc.get("stringData") or {})}
                for _, doc in d.k8s("Secret")}
    for src in c.spec.get("envFrom") or []:
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in src:
                name = src[key]["name"]
                if (kind, name) not in sources:
                    errors.append(f"{c.where}: envFrom {kind} {name!r}, which no manifest defines")
                env |= {k: str(v) for k, v in sources.get((kind, name), {}).items()}
    for e in c.spec.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        ref = e.get("valueFrom") or {}
        for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
            if key in ref:
                name, k = ref[key]["name"], ref[key]["key"]
                data = sources.get((kind, name))
                if data is None:
                    errors.append(f"{c.where}: env {e['name']} from {kind} {name!r}, which no manifest defines")
                elif k not in data:
                    errors.append(f"{c.where}: env {e['name']} from {kind} {name!r} key {k!r}, which it "
                                  f"does not have ({', '.join(sorted(data))})")
                else:
                    env[e["name"]] = str(data[k])
    return env, errors


def check_settings_values(d: Deploy) -> list[str]:
    """The values the deploy files set validate as Settings; secrets are not in ConfigMaps."""
    errors = []
    for svc, spec in d.compose().get("services", {}).items():
        errors += settings_errors(compose_env(spec), f"{COMPOSE}: {svc}")
    for c in d.containers:
        env, errs = container_env(c, d)
        errors += errs + settings_errors(env, c.where)
    for path, doc in d.k8s("ConfigMap"):
        errors += [f"{path}: ConfigMap {doc['metadata']['name']} holds the secret {k}; put it in a Secret"
                   for k in doc.get("data") or {} if k in secret_settings()]
    return errors


# -- checks: command lines -----------------------------------------------------------------------

def check_commands(d: Deploy) -> list[str]:
    """Every `autotuner ...` command line in deploy/ is a real command with real options."""
    c = cli()
    errors = []
    # the image: ENTRYPOINT + CMD, RUN lines, the entrypoint script
    try:
        args = cli_args_of(effective_argv(None, None, d.image_entrypoint, d.image_cmd), d)
        if args is not None:
            errors += c.errors(args, f"{DOCKERFILE}: ENTRYPOINT + CMD")
    except ValueError as e:
        errors.append(f"{DOCKERFILE}: ENTRYPOINT + CMD {e}")
    for stage in d.stages:
        for i in stage:
            if i.op == "RUN":
                for args in autotuner_calls(i.rest):
                    errors += c.errors(args, f"{DOCKERFILE}:{i.line}: RUN")
    for args in autotuner_calls(d.texts[ENTRYPOINT_SCRIPT]):
        errors += c.errors(args, ENTRYPOINT_SCRIPT)
    # compose
    for svc, spec in d.compose().get("services", {}).items():
        if our_image(str(spec.get("image", ""))) is None:
            continue
        argv = effective_argv(spec.get("entrypoint"), spec.get("command"), d.image_entrypoint, d.image_cmd)
        try:
            args = cli_args_of(argv, d)
        except ValueError as e:
            errors.append(f"{COMPOSE}: {svc}: {e}")
            continue
        if args is not None:
            errors += c.errors(args, f"{COMPOSE}: {svc}")
    # kubernetes
    for ct in d.containers:
        argv = effective_argv(ct.spec.get("command"), ct.spec.get("args"), d.image_entrypoint, d.image_cmd)
        try:
            args = cli_args_of(argv, d)
        except ValueError as e:
            errors.append(f"{ct.where}: {e}")
            continue
        if args is None:
            errors += python_snippet_errors(argv[2], ct.where)
        else:
            errors += c.errors(args, ct.where)
    # README
    for block in d.readme_blocks:
        for args in autotuner_calls(block):
            errors += c.errors(args, f"{README}: `autotuner {' '.join(args)}`")
    for span in d.readme_inline:
        if span.startswith("autotuner "):
            for args in autotuner_calls(span):
                errors += c.mention_errors(args, README)
    return errors


def check_entrypoint_script(d: Deploy, tmp: Path) -> list[str]:
    """Run the image's entrypoint script with a fake `autotuner`: `serve` migrates first (with
    serve's --db when given) and not when the migration fails; other commands run as they are."""
    ep = d.image_entrypoint
    copies = [(i.flags_and_words()[1]) for i in d.final if i.op == "COPY"]
    script_dest = [w[-1] for w in copies if ENTRYPOINT_SCRIPT in w[:-1]]
    if not script_dest:
        return [f"{DOCKERFILE}: does not COPY {ENTRYPOINT_SCRIPT} into the final image"]
    if not ep or Path(ep[0]).name != Path(script_dest[0]).name:
        return [f"{DOCKERFILE}: ENTRYPOINT {ep} is not the entrypoint script ({script_dest[0]})"]
    script = tmp / "entrypoint.sh"
    script.write_text(d.texts[ENTRYPOINT_SCRIPT])
    syntax = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    if syntax.returncode:
        return [f"{ENTRYPOINT_SCRIPT}: sh -n: {syntax.stderr.strip()}"]
    log = tmp / "calls.jsonl"
    fake = tmp / "bin" / "autotuner"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    "sys.exit(3 if sys.argv[1:3] == ['db', 'upgrade'] and os.environ.get('FAIL_UPGRADE') else 0)\n")
    fake.chmod(0o755)

    def calls(args: list[str], **env: str) -> tuple[int, list[list[str]]]:
        log.write_text("")
        r = subprocess.run(["sh", str(script), *args], capture_output=True, text=True, timeout=30,
                           env={"PATH": f"{fake.parent}:{os.environ['PATH']}", **env})
        return r.returncode, [json.loads(line) for line in log.read_text().splitlines()]

    url = "postgresql://u:p@db:5432/x"
    serve = ["serve", "--host", "0.0.0.0"]
    cases = [
        (serve, {}, 0, [["db", "upgrade"], serve]),
        ([*serve, "--db", url], {}, 0, [["db", "upgrade", "--db", url], [*serve, "--db", url]]),
        ([*serve, f"--db={url}"], {}, 0, [["db", "upgrade", "--db", url], [*serve, f"--db={url}"]]),
        (serve, {"FAIL_UPGRADE": "1"}, 3, [["db", "upgrade"]]),
        (["worker", "--once"], {}, 0, [["worker", "--once"]]),
        (["db", "upgrade"], {}, 0, [["db", "upgrade"]]),
    ]
    errors = []
    for args, env, rc, want in cases:
        got_rc, got = calls(args, **env)
        if (got_rc != 0) != (rc != 0) or got != want:
            errors.append(f"{ENTRYPOINT_SCRIPT} {' '.join(args)} {env or ''}: ran {got} (exit {got_rc}), "
                          f"expected {want} (exit {rc})")
    return errors


# -- checks: the image ---------------------------------------------------------------------------

def check_dockerfile(d: Deploy) -> list[str]:
    """Python 3.11 slim, requirements.lock then the project with --no-deps, a numeric non-root
    USER, and a COPY for every package pyproject.toml installs."""
    errors = []
    args = d.build_args()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for stage in d.stages[1:]:
        base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), stage[0].rest.split()[0])
        if not re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", base):
            errors.append(f"{DOCKERFILE}:{stage[0].line}: FROM {base}: not python:3.11-slim")
    from packaging.specifiers import SpecifierSet

    if "3.11" not in SpecifierSet(pyproject["project"]["requires-python"]):
        errors.append("pyproject.toml: requires-python excludes the image's Python 3.11")

    all_instrs = [i for stage in d.stages for i in stage]
    copies = {}  # source -> destination
    for i in all_instrs:
        if i.op == "COPY":
            flags, words = i.flags_and_words()
            if "from" not in flags:
                for src in words[:-1]:
                    dest = words[-1]
                    copies[src] = dest + Path(src).name if dest.endswith("/") else dest
    lock_dest = copies.get("requirements.lock")
    project_dir = str(Path(copies.get("pyproject.toml", "/nonexistent/x")).parent)
    runs = [(n, i) for n, i in enumerate(all_instrs) if i.op == "RUN"]
    lock_at = [n for n, i in runs if lock_dest and re.search(
        rf"pip install .*(-r|--requirement)[ =]{re.escape(lock_dest)}\b", i.rest)]
    project_at = [n for n, i in runs for argv in shell_commands(i.rest)
                  if argv[:2] == ["pip", "install"] and "--no-deps" in argv
                  and project_dir in [a.rstrip("/") for a in argv]]
    if not lock_at:
        errors.append(f"{DOCKERFILE}: no RUN pip install -r of the copied requirements.lock")
    if not project_at:
        errors.append(f"{DOCKERFILE}: no RUN pip install --no-deps {project_dir} (the project)")
    if lock_at and project_at and min(project_at) < min(lock_at):
        errors.append(f"{DOCKERFILE}: the project is installed before requirements.lock")
    if any("--no-build-isolation" in i.rest for n, i in runs if n in project_at):
        lock = (REPO / "requirements.lock").read_text().lower()
        for req in pyproject["build-system"]["requires"]:
            name = re.split(r"[<>=!~ \[]", req)[0].lower()
            if not re.search(rf"^{re.escape(name)}==", lock, re.M):
                errors.append(f"{DOCKERFILE}: --no-build-isolation, but requirements.lock lacks the "
                              f"build requirement {req}")
    # every package setuptools finds, and the readme, are copied next to pyproject.toml
    include = pyproject.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get(
        "include", ["*"])
    packages = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()
                      and any(re.fullmatch(_glob_regex(pat).pattern, p.name) for pat in include))
    for name in [*packages, pyproject["project"].get("readme", "")]:
        if name and str(Path(copies.get(name, "/nonexistent/x")).parent) != project_dir:
            errors.append(f"{DOCKERFILE}: {name} (installed by pyproject.toml) is not copied to {project_dir}/")
    # the user
    user = d.last("USER")
    uid = user.rest.split(":")[0].strip() if user else "0"
    if not uid.isdigit() or int(uid) == 0:
        errors.append(f"{DOCKERFILE}: the final stage's USER is {user.rest if user else 'root'}; it must be "
                      "a numeric non-root uid (Kubernetes' runAsNonRoot cannot verify a name)")
    return errors


def check_copy_sources(d: Deploy) -> list[str]:
    """What the Dockerfile copies from the build context (the repository root) exists there
    and is not excluded by the Dockerfile's .dockerignore."""
    errors = []
    patterns = dockerignore_patterns(d.texts.get(DOCKERIGNORE, ""))
    if DOCKERIGNORE not in d.texts:
        errors.append(f"{DOCKERIGNORE} is missing: the whole repository (.venv included) is sent "
                      "to the builder")
    for stage in d.stages:
        for i in stage:
            if i.op not in ("COPY", "ADD"):
                continue
            flags, words = i.flags_and_words()
            if "from" in flags:
                continue
            for src in words[:-1]:
                matches = list(REPO.glob(src))
                if not matches:
                    errors.append(f"{DOCKERFILE}:{i.line}: COPY {src}: no such file in the repository")
                for m in matches:
                    files = [m] if m.is_file() else [f for f in m.rglob("*") if f.is_file()
                                                     and "__pycache__" not in f.parts]
                    for f in files:
                        rel = str(f.relative_to(REPO))
                        if dockerignored(rel, patterns):
                            errors.append(f"{DOCKERFILE}:{i.line}: COPY {src}: {rel} is excluded by "
                                          f"{DOCKERIGNORE}")
                            break
    for heavy in (".venv", ".git", "autotuner.db"):
        if not dockerignored(heavy, patterns):
            errors.append(f"{DOCKERIGNORE}: does not exclude {heavy}")
    return errors


def check_healthcheck(d: Deploy) -> list[str]:
    """The image's HEALTHCHECK asks GET /healthz on serve's port with Python (no curl in
    python:slim); EXPOSE and the default CMD agree; /healthz is a route of the service."""
    errors = serve_missing()
    port = serve_port()
    for path in (HEALTH_PATH, LIVE_PATH):
        if path not in get_routes():
            errors.append(f"the service has no GET {path} route (routes: {sorted(get_routes())})")
    hc = d.last("HEALTHCHECK")
    if hc is None:
        return [*errors, f"{DOCKERFILE}: no HEALTHCHECK"]
    m = re.search(r"\bCMD\s+(.*)$", hc.rest, re.S)
    argv = Instr("CMD", m[1], hc.line).argv() if m else []
    if Path(argv[0] if argv else "").name not in ("python", "python3") or argv[1:2] != ["-c"]:
        return [*errors, f"{DOCKERFILE}: HEALTHCHECK {argv}: expected python -c (the slim image has no curl)"]
    errors += python_snippet_errors(argv[2], f"{DOCKERFILE}: HEALTHCHECK")
    urls = re.findall(r"https?://[^'\"\s]+", argv[2])
    if len(urls) != 1:
        return [*errors, f"{DOCKERFILE}: HEALTHCHECK: expected one URL, found {urls}"]
    u = urlsplit(urls[0])
    if u.path != HEALTH_PATH:
        errors.append(f"{DOCKERFILE}: HEALTHCHECK asks {u.path}, not {HEALTH_PATH}")
    if "urlopen" not in argv[2]:
        errors.append(f"{DOCKERFILE}: HEALTHCHECK does not fail on an error status (use urlopen)")
    if port is not None:
        if u.port != port:
            errors.append(f"{DOCKERFILE}: HEALTHCHECK asks port {u.port}; autotuner serve listens on {port}")
        expose = d.last("EXPOSE")
        if expose is None or str(port) not in re.split(r"[\s/]+", expose.rest):
            errors.append(f"{DOCKERFILE}: EXPOSE {expose.rest if expose else '(none)'}, serve's port is {port}")
        errors += serve_bind_errors(effective_argv(None, None, d.image_entrypoint, d.image_cmd), d,
                                    f"{DOCKERFILE}: CMD", port)
    return errors


def serve_bind_errors(argv: list[str], d: Deploy, where: str, port: int | None) -> list[str]:
    """A container that serves must listen on all interfaces (serve's default is loopback)
    and on `port` (None: serve's default)."""
    try:
        args = cli_args_of(argv, d)
    except ValueError:
        return []  # reported by check_commands
    if not args:
        return []
    path, ctx, err = cli().parse(args)
    if err or ctx is None or path != ["serve"]:
        return [] if err else [f"{where}: does not run `autotuner serve`"]
    errors = []
    if ctx.params.get("host") not in ("0.0.0.0", "::"):
        errors.append(f"{where}: serve listens on {ctx.params.get('host')}, unreachable from outside "
                      "the container; pass --host 0.0.0.0")
    want = port if port is not None else serve_port()
    if ctx.params.get("port") != want:
        errors.append(f"{where}: serve listens on port {ctx.params.get('port')}, expected {want}")
    return errors


# -- checks: compose -----------------------------------------------------------------------------

def _service_argv(spec: dict[str, Any], d: Deploy) -> list[str]:
    return effective_argv(spec.get("entrypoint"), spec.get("command"), d.image_entrypoint, d.image_cmd)


def _cli_path(argv: list[str], d: Deploy) -> list[str]:
    try:
        args = cli_args_of(argv, d)
    except ValueError:
        return []
    return cli().parse(args)[0] if args else []


def _option(argv: list[str], name: str) -> str | None:
    for n, a in enumerate(argv):
        if a == name and n + 1 < len(argv):
            return argv[n + 1]
        if a.startswith(name + "="):
            return a.partition("=")[2]
    return None


def token_envvars(path: list[str]) -> list[str]:
    """The environment variables the --token option of `autotuner PATH` reads (none: no such option)."""
    cmd = cli().command(path) if path else None
    for p in (cmd.params if cmd is not None else []):
        if "--token" in getattr(p, "opts", ()):
            env = p.envvar
            return list(env) if isinstance(env, list | tuple) else [env] if env else []
    return []


def given_token(argv: list[str], env: dict[str, str], d: Deploy) -> str | None:
    """The token a command line gets: --token's value, else the first of its option's
    environment variables that ``env`` sets (None: neither; --token-file is not read)."""
    token = _option(argv, "--token")
    if token is not None:
        return token
    return next((env[name] for name in token_envvars(_cli_path(argv, d)) if name in env), None)


def check_compose(d: Deploy) -> list[str]:
    """Healthchecked PostgreSQL; migrate after it is healthy; the service after migrate
    succeeded; the worker after the service is healthy; the DB URL names the compose database;
    the image is built from deploy/Dockerfile; ports agree."""
    errors = []
    services = d.compose().get("services", {})
    pg = [n for n, s in services.items() if str(s.get("image", "")).startswith("postgres:")]
    if len(pg) != 1:
        return [f"{COMPOSE}: expected one postgres service, found {pg}"]
    pg_name, pg_spec = pg[0], services[pg[0]]
    if not (pg_spec.get("image", "").split(":")[1].split(".")[0] == "15"):
        errors.append(f"{COMPOSE}: {pg_name}: image {pg_spec.get('image')}, expected postgres:15")
    test = (pg_spec.get("healthcheck") or {}).get("test")
    if not test or "pg_isready" not in " ".join(test if isinstance(test, list) else [test]):
        errors.append(f"{COMPOSE}: {pg_name}: no pg_isready healthcheck")
    ours = {n: s for n, s in services.items() if our_image(str(s.get("image", ""))) is not None}
    by_cmd = {n: _cli_path(_service_argv(s, d), d) for n, s in ours.items()}
    migrate = [n for n, p in by_cmd.items() if p == ["db", "upgrade"]]
    serve = [n for n, p in by_cmd.items() if p == ["serve"]]
    workers = [n for n, p in by_cmd.items() if p == ["worker"]]
    for what, found in (("migration (autotuner db upgrade)", migrate), ("service (autotuner serve)", serve),
                        ("tuner worker (autotuner worker)", workers)):
        if not found:
            errors.append(f"{COMPOSE}: no {what} service")

    def needs(svc: str, dep: str, condition: str) -> None:
        got = ((services[svc].get("depends_on") or {}).get(dep) or {}) if isinstance(
            services[svc].get("depends_on"), dict) else {}
        if got.get("condition") != condition:
            errors.append(f"{COMPOSE}: {svc}: depends_on {dep} must have condition: {condition} "
                          f"(has {got.get('condition') if got else 'none'})")

    def healthchecked(svc: str) -> bool:
        hc = services[svc].get("healthcheck")
        return not (hc or {}).get("disable") and (hc is not None or d.last("HEALTHCHECK") is not None)

    for n, spec in ours.items():
        s_env = compose_env(spec)
        if "AUTOTUNER_DB_URL" in s_env:
            needs(n, pg_name, "service_healthy")
            url = parse_settings(s_env).db_url
            u = make_url(url)
            pg_env = compose_env(pg_spec)
            want = {"host": pg_name, "port": 5432, "username": pg_env.get("POSTGRES_USER", "postgres"),
                    "database": pg_env.get("POSTGRES_DB") or pg_env.get("POSTGRES_USER", "postgres"),
                    "password": pg_env.get("POSTGRES_PASSWORD")}
            got = {"host": u.host, "port": u.port or 5432, "username": u.username, "database": u.database,
                   "password": u.password}
            if got != want or not u.drivername.startswith("postgresql"):
                errors.append(f"{COMPOSE}: {n}: AUTOTUNER_DB_URL {u!r} is not the compose database {want}")
        if not str(spec.get("image", "")).startswith(IMAGE_NAME + ":"):
            errors.append(f"{COMPOSE}: {n}: image {spec.get('image')} has a registry; the compose image is local")
        build = spec.get("build")
        if isinstance(build, str):
            build = {"context": build}
        if not build:
            errors.append(f"{COMPOSE}: {n}: no build: compose would try to pull {spec.get('image')}")
            continue
        context = (REPO / Path(COMPOSE).parent / build.get("context", ".")).resolve()
        dockerfile = (context / build.get("dockerfile", "Dockerfile")).resolve()
        if context != REPO or dockerfile != REPO / DOCKERFILE:
            errors.append(f"{COMPOSE}: {n}: builds {dockerfile} in {context}, not {DOCKERFILE} in the repository")
        if build.get("args") or our_image(spec["image"]) != (project_version(), ""):
            errors.append(f"{COMPOSE}: {n}: image {spec['image']}, expected {IMAGE_NAME}:{project_version()} "
                          "(the CPU image, no build args)")
    for n in serve:
        for m in migrate:
            needs(n, m, "service_completed_successfully")
        if not healthchecked(n):
            errors.append(f"{COMPOSE}: {n}: the service has no healthcheck (the image's is disabled)")
        port = serve_port()
        errors += serve_bind_errors(_service_argv(services[n], d), d, f"{COMPOSE}: {n}", None)
        published = [str(p).rsplit(":", 1)[-1].split("/")[0] for p in services[n].get("ports") or []]
        if port is not None and published and str(port) not in published:
            errors.append(f"{COMPOSE}: {n}: publishes container port(s) {published}, serve listens on {port}")
    for n in workers:
        argv = _service_argv(services[n], d)
        url = _option(argv, "--service")
        u = urlsplit(url or "")
        if u.hostname not in serve:
            errors.append(f"{COMPOSE}: {n}: --service {url} is not a compose service running serve ({serve})")
        elif u.port != (serve_port() or u.port):
            errors.append(f"{COMPOSE}: {n}: --service {url}: serve listens on {serve_port()}")
        for s in serve:
            if u.hostname == s:
                needs(n, s, "service_healthy")
                token = given_token(argv, compose_env(services[n]), d)
                if token not in parse_settings(compose_env(services[s])).write_tokens:
                    errors.append(f"{COMPOSE}: {n}: its token ({', '.join(token_envvars(['worker']))}) is not "
                                  f"among {s}'s AUTOTUNER_WRITE_TOKENS")
        if (services[n].get("healthcheck") or {}).get("disable") is not True and d.last("HEALTHCHECK"):
            errors.append(f"{COMPOSE}: {n}: a worker does not serve /healthz; disable the image's healthcheck")
        # its outbox and study outlive the container (a new image recreates it) on a named volume
        cache = compose_env(services[n]).get("AUTOTUNER_CACHE_DIR")
        named = set(d.compose().get("volumes") or {})
        mounts = [str(v).split(":")[:2] for v in services[n].get("volumes") or []]
        if not cache or not any(len(m) == 2 and m[0] in named and (Path(cache) == Path(m[1])
                                                                   or Path(m[1]) in Path(cache).parents)
                                for m in mounts):
            errors.append(f"{COMPOSE}: {n}: AUTOTUNER_CACHE_DIR ({cache}) is not on a named volume: the kept "
                          "uploads and the study go with the container")
        elif not any(i.op == "RUN" and re.search(rf"install -d -o 10001 -g 10001 {re.escape(cache)}(\s|$)", i.rest)
                     for i in d.final):
            errors.append(f"{COMPOSE}: {n}: the image does not create {cache} for its user (install -d -o 10001 "
                          f"-g 10001 {cache}): a new named volume there is root's, and the worker cannot write it")
    for n in migrate:
        if (services[n].get("restart") or "no") != "no":
            errors.append(f"{COMPOSE}: {n}: a one-shot migration must not restart")
    return errors


def check_compose_secrets(d: Deploy) -> list[str]:
    """Secrets come from the environment and fail fast (${VAR:?message}); nothing secret is
    written in the file; the README exports each required variable."""
    errors = []
    raw = d.compose_raw.get("services", {})
    secret_vars: set[str] = set()

    def feed(value: Any, what: str) -> None:
        refs = compose_refs(str(value))
        if not refs:
            errors.append(f"{COMPOSE}: {what} is written in the file; take it from ${{VAR:?message}}")
        for r in refs:
            if r.op in (":-", "-") and r.arg == "":
                continue  # optional, empty by default (e.g. no read tokens: reads are open)
            if r.op != ":?" or not r.arg.strip():
                errors.append(f"{COMPOSE}: {what}: ${{{r.name}{r.op or ''}{r.arg}}} must be "
                              f"${{{r.name}:?message}}")
            secret_vars.add(r.name)

    for svc, spec in raw.items():
        s_env = compose_env(spec)
        for key in ("POSTGRES_PASSWORD",):
            if key in s_env:
                feed(s_env[key], f"{svc}: {key}")
        for key in sorted(secret_settings() & set(s_env)):
            if key == "AUTOTUNER_DB_URL":
                pw = make_url(interpolate(s_env[key], d.fake_env())).password
                feed(next((f"${{{r.name}{r.op or ''}{r.arg}}}" for r in compose_refs(s_env[key])
                           if f"<{r.name}>" == pw), pw or ""), f"{svc}: the password in {key}")
            else:
                feed(s_env[key], f"{svc}: {key}")
                tokens = getattr(parse_settings({key: interpolate(s_env[key], d.fake_env())}),
                                 settings_fields()[key])
                errors += [f"{COMPOSE}: {svc}: {key} holds the literal token {t!r}"
                           for t in ([tokens] if isinstance(tokens, str) else tokens or [])
                           if not re.fullmatch(r"<\w+>", t)]
        argv = spec.get("command") or []
        argv = argv if isinstance(argv, list) else shlex.split(argv)
        token = _option(argv, "--token")
        if token is not None:
            feed(token, f"{svc}: --token")
        for key in sorted(set(token_envvars(_cli_path(_service_argv(spec, d), d))) & set(s_env)):
            if key not in secret_settings():  # those are fed above
                feed(s_env[key], f"{svc}: {key}")
    for name in sorted(secret_vars):
        if not re.search(rf"^\s*(export\s+)?.*\b{name}=", "\n".join(d.readme_blocks), re.M):
            errors.append(f"{README}: does not set {name}, which compose requires")
    if "POSTGRES_PASSWORD" not in secret_vars:
        errors.append(f"{COMPOSE}: POSTGRES_PASSWORD does not come from the environment")
    return errors


def check_compose_bind(d: Deploy) -> list[str]:
    """With only the required variables set, compose publishes the service on loopback: reads
    are open while AUTOTUNER_READ_TOKENS is empty. Other hosts are an explicit choice
    (``"${AUTOTUNER_BIND:-127.0.0.1}:8000:8000"`` with AUTOTUNER_BIND set)."""
    errors = []
    required = {r.name: f"<{r.name}>" for r in d.compose_refs if r.op not in (":-", "-")}
    services = d.compose(required).get("services", {})
    serving = [n for n, spec in services.items() if our_image(str(spec.get("image", ""))) is not None
               and _cli_path(_service_argv(spec, d), d) == ["serve"]]
    if not serving:
        return [f"{COMPOSE}: no service runs `autotuner serve`"]
    for n in serving:
        for p in services[n].get("ports") or []:
            if isinstance(p, dict):
                host = str(p.get("host_ip") or "")
            else:
                parts = str(p).rsplit(":", 2)
                host = parts[0] if len(parts) == 3 else ""
            host = host.strip("[]")
            if host not in LOOPBACK:
                errors.append(f"{COMPOSE}: {n}: publishes {p} on {host or 'all interfaces'} by default, with "
                              "reads open while AUTOTUNER_READ_TOKENS is empty; bind loopback unless told "
                              'otherwise: "${AUTOTUNER_BIND:-127.0.0.1}:PORT:PORT"')
    return errors


def check_no_token_in_args(d: Deploy) -> list[str]:
    """No command line carries a token (`ps`, `docker inspect`, pod specs and shell history show
    argv): not compose's, the manifests', the image's, nor the README's. A command reads it from
    its --token option's environment variable, or from --token-file."""
    argvs: list[tuple[str, list[str]]] = []
    for svc, spec in (d.compose().get("services") or {}).items():
        if our_image(str(spec.get("image", ""))) is not None:
            argvs.append((f"{COMPOSE}: {svc}", [str(a) for a in _service_argv(spec, d)]))
    for c in d.containers:
        argvs.append((c.where, [str(a) for a in effective_argv(c.spec.get("command"), c.spec.get("args"),
                                                                d.image_entrypoint, d.image_cmd)]))
    argvs.append((f"{DOCKERFILE}: ENTRYPOINT + CMD", effective_argv(None, None, d.image_entrypoint, d.image_cmd)))
    for stage in d.stages:
        argvs += [(f"{DOCKERFILE}:{i.line}: RUN", ["autotuner", *args])
                  for i in stage if i.op == "RUN" for args in autotuner_calls(i.rest)]
    argvs += [(ENTRYPOINT_SCRIPT, ["autotuner", *args]) for args in autotuner_calls(d.texts[ENTRYPOINT_SCRIPT])]
    argvs += [(README, ["autotuner", *args]) for text in [*d.readme_blocks, *d.readme_inline]
              for args in autotuner_calls(text)]
    errors = []
    for where, argv in argvs:
        if any(a == "--token" or a.startswith("--token=") for a in argv):
            env = token_envvars(_cli_path(argv, d)) or ["its --token option's environment variable"]
            errors.append(f"{where}: passes a token on the command line ({' '.join(argv[:3])} ... --token); "
                          f"set {' or '.join(env)} in the environment, or use --token-file")
    return errors


# -- checks: kubernetes --------------------------------------------------------------------------

def check_k8s_structure(d: Deploy) -> list[str]:
    """Well-formed documents in one namespace, applied in a working order; references between
    them (ConfigMaps, Secrets, labels, `$(VAR)` in args) resolve."""
    errors = []
    namespaces = [doc["metadata"]["name"] for _, doc in d.k8s("Namespace")]
    if len(namespaces) != 1:
        return [f"{K8S}: expected one Namespace, found {namespaces}"]
    ns = namespaces[0]
    applied = sorted(p for p in {p for p, _ in d.k8s_docs} if d.k8s_applied(p))
    first_kinds = [doc["kind"] for p, doc in d.k8s_docs if p == applied[0]] if applied else []
    if first_kinds != ["Namespace"]:
        errors.append(f"{K8S}: `kubectl apply -f {K8S}/` applies {applied[:1]} first; it must be the Namespace")
    for path, doc in d.k8s_docs:
        meta = doc.get("metadata") or {}
        if not doc.get("apiVersion") or not doc.get("kind") or not (meta.get("name") or meta.get("generateName")):
            errors.append(f"{path}: a document without apiVersion, kind or metadata.name")
            continue
        if doc["kind"] not in CLUSTER_KINDS and meta.get("namespace") != ns:
            errors.append(f"{path}: {doc['kind']}/{meta.get('name')} is in namespace {meta.get('namespace')}, not {ns}")
        if meta.get("generateName") and d.k8s_applied(path):
            errors.append(f"{path}: generateName cannot be used with `kubectl apply`")
    for c in d.containers:
        env, errs = container_env(c, d)
        errors += errs
        for word in [*(c.spec.get("command") or []), *(c.spec.get("args") or [])]:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(word)):
                if var not in env:
                    errors.append(f"{c.where}: $({var}) is not in the container's environment "
                                  "(Kubernetes would pass it literally)")
        mounts = {m["name"] for m in c.spec.get("volumeMounts") or []}
        volumes = {v["name"]: v for v in c.pod.get("volumes") or []}
        errors += [f"{c.where}: mounts {m!r}, which the pod has no volume for" for m in mounts - set(volumes)]
        cms = {doc["metadata"]["name"]: doc.get("data") or {} for _, doc in d.k8s("ConfigMap")}
        for v in volumes.values():
            if "configMap" in v and v["configMap"]["name"] not in cms:
                errors.append(f"{c.where}: volume {v['name']}: ConfigMap {v['configMap']['name']!r} is not defined")
    for path, doc in [*d.k8s("Deployment"), *d.k8s("StatefulSet")]:
        selector = doc["spec"]["selector"].get("matchLabels") or {}
        labels = doc["spec"]["template"]["metadata"].get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            errors.append(f"{path}: selector {selector} does not match the pod labels {labels}")
    indexed = {doc["metadata"]["name"]: doc for _, doc in d.k8s("Job")
               if doc["spec"].get("completionMode") == "Indexed"}
    for path, doc in d.k8s("Service"):
        sel = doc["spec"].get("selector") or {}
        pods = [p for p, dep in d.k8s("Deployment")
                if all((dep["spec"]["template"]["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())]
        job = indexed.get(sel.get("batch.kubernetes.io/job-name", ""))
        if job is not None and list(sel) == ["batch.kubernetes.io/job-name"]:
            # the headless Service that names an Indexed Job's pods (their hostnames' subdomain)
            if doc["spec"].get("clusterIP") != "None":
                errors.append(f"{path}: Service {doc['metadata']['name']} of Job {sel} must be headless (clusterIP: None)")
            if job["spec"]["template"]["spec"].get("subdomain") != doc["metadata"]["name"]:
                errors.append(f"{path}: Job {job['metadata']['name']}'s pods name no subdomain "
                              f"{doc['metadata']['name']!r}: their hostnames do not resolve")
            continue
        if not sel or not pods:
            errors.append(f"{path}: Service {doc['metadata']['name']} selects {sel}, which no Deployment's pods have")
    return errors


def _serve_containers(d: Deploy) -> list[Container]:
    return [c for c in d.containers if _cli_path(effective_argv(
        c.spec.get("command"), c.spec.get("args"), d.image_entrypoint, d.image_cmd), d) == ["serve"]]


def check_k8s_service(d: Deploy) -> list[str]:
    """The Deployment serves on serve's port on all interfaces, probes /healthz on that port,
    the Service forwards to it, the migration is a Job applied with the rest, and clients'
    --service URLs name the Service and its port."""
    errors = serve_missing()
    port = serve_port()
    serving = _serve_containers(d)
    if not serving:
        return [*errors, f"{K8S}: no container runs `autotuner serve`"]
    for c in serving:
        argv = effective_argv(c.spec.get("command"), c.spec.get("args"), d.image_entrypoint, d.image_cmd)
        ctx = cli().parse(cli_args_of(argv, d) or [])[1]
        listen = ctx.params.get("port") if ctx else None
        errors += serve_bind_errors(argv, d, c.where, None)
        named = {p.get("name"): p["containerPort"] for p in c.spec.get("ports") or []}
        if listen not in named.values():
            errors.append(f"{c.where}: containerPorts {sorted(named.values())} do not include serve's port {listen}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.spec.get(probe)
            if probe != "startupProbe" and not p:
                errors.append(f"{c.where}: no {probe}")
            if not p:
                continue
            get = p.get("httpGet") or {}
            got_port = named.get(get.get("port"), get.get("port"))
            want = LIVE_PATH if probe == "livenessProbe" else HEALTH_PATH   # liveness never asks the database
            if get.get("path") != want or got_port != listen:
                errors.append(f"{c.where}: {probe} asks {get.get('path')} on port {got_port}, "
                              f"expected {want} on {listen}")
        if c.doc["kind"] == "Deployment":
            pod_labels = c.doc["spec"]["template"]["metadata"].get("labels") or {}
            svcs = [doc for _, doc in d.k8s("Service")
                    if all(pod_labels.get(k) == v for k, v in (doc["spec"].get("selector") or {}).items())]
            for svc in svcs:
                for sp in svc["spec"]["ports"]:
                    target = named.get(sp.get("targetPort"), sp.get("targetPort", sp["port"]))
                    if target != listen:
                        errors.append(f"Service {svc['metadata']['name']}: port {sp['port']} targets "
                                      f"{sp.get('targetPort')} = {target}, serve listens on {listen}")
        res = c.spec.get("resources") or {}
        if not (res.get("requests") and (res.get("limits") or {}).get("memory")):
            errors.append(f"{c.where}: set resources.requests and a memory limit")
    if port is not None and not any(c.doc["kind"] == "Deployment" for c in serving):
        errors.append(f"{K8S}: `autotuner serve` does not run in a Deployment")
    migrations = [c for c in d.containers if c.doc["kind"] == "Job" and _cli_path(effective_argv(
        c.spec.get("command"), c.spec.get("args"), d.image_entrypoint, d.image_cmd), d) == ["db", "upgrade"]]
    if not any(d.k8s_applied(c.where.split(":")[0]) for c in migrations):
        errors.append(f"{K8S}: no migration Job (autotuner db upgrade) applied by `kubectl apply -f {K8S}/`")
    # clients of the service
    services = {doc["metadata"]["name"]: doc for _, doc in d.k8s("Service")}
    ns = next((doc["metadata"]["name"] for _, doc in d.k8s("Namespace")), None)
    for c in d.containers:
        argv = [str(a) for a in effective_argv(c.spec.get("command"), c.spec.get("args"),
                                                d.image_entrypoint, d.image_cmd)]
        url = _option(argv, "--service")
        if url is None:
            continue
        u = urlsplit(url)
        host = (u.hostname or "").split(".")
        svc = services.get(host[0])
        if svc is None or (len(host) > 1 and host[1] != ns):
            errors.append(f"{c.where}: --service {url} names no Service of namespace {ns} ({sorted(services)})")
        elif u.port not in [p["port"] for p in svc["spec"]["ports"]]:
            errors.append(f"{c.where}: --service {url}: Service {host[0]} has ports "
                          f"{[p['port'] for p in svc['spec']['ports']]}")
    return errors


def check_k8s_security(d: Deploy) -> list[str]:
    """Every pod of our image runs as non-root, as the image's USER."""
    errors = []
    user = d.last("USER")
    uid = int(user.rest.split(":")[0]) if user and user.rest.split(":")[0].isdigit() else None
    for c in d.containers:
        if our_image(c.spec.get("image", "")) is None:
            errors.append(f"{c.where}: image {c.spec.get('image')} is not {IMAGE_NAME} (built from {DOCKERFILE})")
            continue
        pod_sc, sc = c.pod.get("securityContext") or {}, c.spec.get("securityContext") or {}
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            errors.append(f"{c.where}: runAsNonRoot is not set")
        run_as = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if run_as is not None and run_as != uid:
            errors.append(f"{c.where}: runAsUser {run_as}, the image's USER is {uid}")
        if sc.get("privileged") or sc.get("allowPrivilegeEscalation", False):
            errors.append(f"{c.where}: privileged or allowPrivilegeEscalation")
    return errors


def check_k8s_secrets(d: Deploy) -> list[str]:
    """Secrets in the repository are placeholders (CHANGE-ME), in stringData, outside what
    `kubectl apply -f deploy/k8s/` applies; the tuner's token is one of the write tokens."""
    errors = []
    secrets = d.k8s("Secret")
    if not secrets:
        errors.append(f"{K8S}: no example Secret")
    for path, doc in secrets:
        name = doc["metadata"]["name"]
        if doc.get("data"):
            errors.append(f"{path}: Secret {name}: use stringData with CHANGE-ME placeholders, not data")
        for k, v in (doc.get("stringData") or {}).items():
            v = str(v)
            if "CHANGE-ME" not in v:
                errors.append(f"{path}: Secret {name}: {k} is not a CHANGE-ME placeholder")
            if "://" in v:
                pw = make_url(v).password
                if pw is not None and "CHANGE-ME" not in pw:
                    errors.append(f"{path}: Secret {name}: {k}: the password is not a CHANGE-ME placeholder")
            if k in settings_fields() and isinstance(getattr(parse_settings({k: v}), settings_fields()[k]), list):
                errors += [f"{path}: Secret {name}: {k}: token {t!r} is not a CHANGE-ME placeholder"
                           for t in getattr(parse_settings({k: v}), settings_fields()[k]) if "CHANGE-ME" not in t]
        if d.k8s_applied(path):
            errors.append(f"{path}: `kubectl apply -f {K8S}/` would overwrite the real Secret {name} "
                          "with placeholders; keep it in a subdirectory")
    write_tokens = set()
    for _, doc in secrets:
        data = doc.get("stringData") or {}
        if "AUTOTUNER_WRITE_TOKENS" in data:
            write_tokens |= set(parse_settings({"AUTOTUNER_WRITE_TOKENS": data["AUTOTUNER_WRITE_TOKENS"]}).write_tokens)
    for c in d.containers:
        argv = [str(a) for a in effective_argv(c.spec.get("command"), c.spec.get("args"),
                                                d.image_entrypoint, d.image_cmd)]
        if _cli_path(argv, d) not in (["tune"], ["worker"]):  # the commands that write
            continue
        env, _ = container_env(c, d)
        token, name = _option(argv, "--token"), None
        m = re.fullmatch(r"\$\((\w+)\)", token or "")
        if token is not None and not m:
            errors.append(f"{c.where}: --token {token!r} is written in the manifest; use an env var from a Secret")
            continue
        if m:
            name = m[1]
        else:
            name = next((n for n in token_envvars(_cli_path(argv, d)) if n in env), None)
        if name is not None and env.get(name) not in write_tokens:
            errors.append(f"{c.where}: its token ({name}) is not one of the example AUTOTUNER_WRITE_TOKENS")
    return errors


def check_k8s_tuners(d: Deploy) -> list[str]:
    """The tuner Jobs: `autotuner tune --target local --service ... --problems FILE`, the token in
    the environment (or --token-file),
    with FILE from a ConfigMap whose problems load and fit the accelerators the Job asks for;
    a GPU Job and a GKE TPU Job, each on an image with the matching JAX."""
    from autotuner.problem.problems_file import load_problems

    errors = []
    found: set[str] = set()
    for c in [c for c in _accelerator_commands(d, "tune") if c.doc["kind"] == "Job"]:
        argv, env, resource, errs = _on_an_accelerator(c, d, "tune", ("--service", "--problems"))
        errors += errs
        if resource is None:
            continue
        found.add(resource)
        res = c.spec.get("resources") or {}
        per_pod = int(res["limits"][resource])
        count = per_pod * (processes := _job_processes(c, env, d, errors))
        if processes > 1:
            found.add("multi-process")
        if (res.get("requests") or {}).get(resource, per_pod) != per_pod:
            errors.append(f"{c.where}: {resource}: requests and limits differ")
        if processes == 1:   # one pod: a failed container restarts in it and goes on from its cache
            if c.pod.get("restartPolicy") != "OnFailure":
                errors.append(f"{c.where}: restartPolicy {c.pod.get('restartPolicy')}: a one-pod tuner Job "
                              "restarts its container in the pod (OnFailure), where its cache is kept")
            errors += _kept_across_restarts(c, env)
        if resource == "google.com/tpu":
            sel = c.pod.get("nodeSelector") or {}
            missing = [k for k in TPU_NODE_SELECTORS if k not in sel]
            if missing:
                errors.append(f"{c.where}: a TPU Job needs the node selectors {missing}")
            topo = sel.get("cloud.google.com/gke-tpu-topology", "")
            if topo and math.prod(int(x) for x in topo.split("x")) != int(count):
                errors.append(f"{c.where}: TPU topology {topo} has {math.prod(int(x) for x in topo.split('x'))} "
                              f"chips, the Job asks for google.com/tpu: {count} in all")
        # the problems file: a ConfigMap mounted where --problems points, loadable, meshes fit
        problems = Path(_option(argv, "--problems") or "/")
        mount = next((m for m in c.spec.get("volumeMounts") or []
                      if problems.parent == Path(m["mountPath"])), None)
        volume = next((v for v in c.pod.get("volumes") or [] if mount and v["name"] == mount["name"]), None)
        cm = next((doc for _, doc in d.k8s("ConfigMap")
                   if volume and "configMap" in volume and doc["metadata"]["name"] == volume["configMap"]["name"]),
                  None)
        text = (cm.get("data") or {}).get(problems.name) if cm else None
        if text is None:
            errors.append(f"{c.where}: --problems {problems}: no ConfigMap key {problems.name} mounted at {problems.parent}")
            continue
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / problems.name
            f.write_text(text)
            try:
                loaded = load_problems(f)
            except ValueError as e:
                errors.append(f"{c.where}: ConfigMap {cm['metadata']['name']}: {e}")
                continue
        for p in loaded:
            need = math.prod(s for _, s in p.mesh)
            if need != int(count):
                errors.append(f"{c.where}: problem {p.key[:8]} has a mesh of {need} devices; the Job gets "
                              f"{count} {resource}")
    for resource in ACCELERATORS:
        if resource not in found:
            errors.append(f"{K8S}: no tuner Job asking for {resource}")
    if "multi-process" not in found:
        errors.append(f"{K8S}: no tuner Job spanning hosts (an Indexed Job, one JAX process per pod)")
    return errors


def _accelerator_commands(d: Deploy, command: str) -> list[Container]:
    """The manifests' containers that run `autotuner COMMAND`."""
    return [c for c in d.containers if c.where.startswith(K8S) and _cli_path(effective_argv(
        c.spec.get("command"), c.spec.get("args"), d.image_entrypoint, d.image_cmd), d) == [command]]


def _on_an_accelerator(c: Container, d: Deploy, command: str,
                       required: tuple[str, ...]) -> tuple[list[str], dict[str, Any], str | None, list[str]]:
    """What a tuner Job and a worker on an accelerator share: the ``required`` options, a token
    from the environment (or --token-file), --target local, one accelerator limit and the image
    built for it. Returns (argv, env, the accelerator resource or None, errors)."""
    errors = []
    argv = [str(a) for a in effective_argv(c.spec.get("command"), c.spec.get("args"),
                                            d.image_entrypoint, d.image_cmd)]
    for opt in required:
        if _option(argv, opt) is None:
            errors.append(f"{c.where}: {command} without {opt}")
    env, _ = container_env(c, d)
    if given_token(argv, env, d) is None and _option(argv, "--token-file") is None:
        errors.append(f"{c.where}: {command} without a token: set {' or '.join(token_envvars([command]))} "
                      "from a Secret (or mount one for --token-file)")
    if _option(argv, "--target") != "local":
        errors.append(f"{c.where}: --target {_option(argv, '--target')}; {command} on an accelerator tunes "
                      "--target local")
    limits = (c.spec.get("resources") or {}).get("limits") or {}
    accel = {r: limits[r] for r in ACCELERATORS if limits.get(r)}
    if len(accel) != 1:
        errors.append(f"{c.where}: expected one accelerator limit of {sorted(ACCELERATORS)}, found {accel}")
        return argv, env, None, errors
    (resource, _), = accel.items()
    tag = our_image(c.spec.get("image", ""))
    if tag is None or not tag[1].startswith(ACCELERATORS[resource]):
        errors.append(f"{c.where}: asks for {resource} on image {c.spec.get('image')}; it needs the image "
                      f"built with JAX_EXTRA={ACCELERATORS[resource]}...")
    return argv, env, resource, errors


def _kept_across_restarts(c: Container, env: dict[str, Any]) -> list[str]:
    """A tuner's cache folder (`AUTOTUNER_CACHE_DIR`: its outbox of uploads the service has not
    stored yet, its scratch study) on a pod volume: the kubelet restarts a container from the
    image, so one in the container's own files is gone with it, and the restarted tuner neither
    sends what was kept nor resumes its study."""
    cache = env.get("AUTOTUNER_CACHE_DIR")
    if not cache:
        return [f"{c.where}: AUTOTUNER_CACHE_DIR is not set: the outbox and the study live in the "
                "container's files and are lost when it restarts"]
    mount = next((m for m in c.spec.get("volumeMounts") or []
                  if Path(cache) == Path(m["mountPath"]) or Path(m["mountPath"]) in Path(cache).parents), None)
    volume = next((v for v in c.pod.get("volumes") or [] if mount and v["name"] == mount["name"]), None)
    if volume is None or not ({"emptyDir", "persistentVolumeClaim", "ephemeral"} & set(volume)):
        return [f"{c.where}: AUTOTUNER_CACHE_DIR {cache} is not on a pod volume (emptyDir or a claim): "
                "what it keeps is lost when the container restarts"]
    return []


def check_k8s_workers(d: Deploy) -> list[str]:
    """The standing tuner pool: a Deployment running `autotuner worker --target local --service
    ...` on one accelerator kind, its token in the environment (or --token-file), on the image
    with the matching JAX, with a grace period that leaves a stopped worker the time to hand its
    job back (`POST /v1/jobs/{id}/release`, one request of at most 10 s)."""
    workers = _accelerator_commands(d, "worker")
    if not workers:
        return [f"{K8S}: no Deployment runs `autotuner worker` (the standing tuner pool)"]
    errors = []
    for c in workers:
        _argv, env, _res, errs = _on_an_accelerator(c, d, "worker", ("--service",))
        errors += errs + _kept_across_restarts(c, env)
        if c.doc["kind"] != "Deployment":
            errors.append(f"{c.where}: a worker runs until stopped: a Deployment, not a {c.doc['kind']}")
        grace = c.pod.get("terminationGracePeriodSeconds", 30)
        if grace < 15:
            errors.append(f"{c.where}: terminationGracePeriodSeconds {grace}: a stopped worker needs up to 10 s "
                          "to hand its job back")
    return errors


def _job_processes(c: Container, env: dict[str, Any], d: Deploy, errors: list[str]) -> int:
    """How many JAX processes a tuner Job runs: its completions for an Indexed Job, which must give
    each pod the environment `autotuner tune` joins a multi-process job from (JAX_NUM_PROCESSES =
    completions = parallelism, JAX_PROCESS_ID = the pod's completion index, JAX_COORDINATOR_ADDRESS
    = pod 0's hostname in the Job's headless Service, on a port the container and Service open)."""
    spec = c.doc["spec"]
    if spec.get("completionMode") != "Indexed":
        return 1
    n = int(spec.get("completions") or 1)
    if int(spec.get("parallelism") or 1) != n:
        errors.append(f"{c.where}: parallelism {spec.get('parallelism')} != completions {n}: every process "
                      "must run at once")
    items = {e["name"]: e for e in c.spec.get("env") or []}
    if str((items.get("JAX_NUM_PROCESSES") or {}).get("value")) != str(n):
        errors.append(f"{c.where}: JAX_NUM_PROCESSES must be the Job's completions, {n}")
    ref = ((items.get("JAX_PROCESS_ID") or {}).get("valueFrom") or {}).get("fieldRef") or {}
    if ref.get("fieldPath") != "metadata.annotations['batch.kubernetes.io/job-completion-index']":
        errors.append(f"{c.where}: JAX_PROCESS_ID must come from the pod's job-completion-index annotation")
    sub = c.pod.get("subdomain")
    svc = next((doc for _, doc in d.k8s("Service") if doc["metadata"]["name"] == sub), None)
    ports = {p["port"] for p in (svc or {}).get("spec", {}).get("ports") or []}
    own = {p["containerPort"] for p in c.spec.get("ports") or []}
    addr = str((items.get("JAX_COORDINATOR_ADDRESS") or {}).get("value", ""))
    host, _, port = addr.rpartition(":")
    if svc is None or host != f"{c.doc['metadata']['name']}-0.{sub}" or not port.isdigit() \
            or int(port) not in ports or int(port) not in own:
        errors.append(f"{c.where}: JAX_COORDINATOR_ADDRESS {addr!r} must be pod 0's hostname "
                      f"({c.doc['metadata']['name']}-0.SUBDOMAIN, SUBDOMAIN a headless Service) and a port "
                      "both the container and the Service open")
    return n


# -- checks: images and the README ---------------------------------------------------------------

def check_images(d: Deploy) -> list[str]:
    """Every image of ours in compose and Kubernetes is a tag of the pyproject version built by a
    `docker build -f deploy/Dockerfile` command of the README (with real build args)."""
    errors = []
    built: dict[str, str] = {}  # tag -> JAX_EXTRA
    args = d.build_args()
    for block in d.readme_blocks:
        for argv in shell_commands(block):
            if argv[:2] != ["docker", "build"]:
                continue
            if _option(argv, "-f") != DOCKERFILE or argv[-1] != ".":
                errors.append(f"{README}: {' '.join(argv)}: build with -f {DOCKERFILE} from the repository root (.)")
            extra = ""
            for n, a in enumerate(argv):
                if a == "--build-arg":
                    key, _, value = argv[n + 1].partition("=")
                    if key not in args:
                        errors.append(f"{README}: --build-arg {key}: the Dockerfile has no ARG {key} ({sorted(args)})")
                    if key == "JAX_EXTRA":
                        extra = value
            tag = _option(argv, "-t") or ""
            if our_image(tag) != (project_version(), extra):
                errors.append(f"{README}: builds {tag}, expected {IMAGE_NAME}:{project_version()}"
                              f"{'-' + extra if extra else ''}")
            built[tag] = extra
    used = [(f"{COMPOSE}: {n}", str(s.get("image"))) for n, s in d.compose().get("services", {}).items()
            if not str(s.get("image", "")).startswith("postgres:")]
    used += [(f"{README}: {' '.join(argv[:3])}...", a) for block in d.readme_blocks
             for argv in shell_commands(block) if argv[:2] != ["docker", "build"]
             for a in argv if re.fullmatch(rf"(?:\S+/)?{IMAGE_NAME}:\S+", a)]
    used += [(c.where, c.spec.get("image", "")) for c in d.containers]
    for where, image in used:
        tag = re.sub(r"^.+/(?=[^/]+$)", "", image)
        if our_image(image) is None:
            errors.append(f"{where}: image {image} is not {IMAGE_NAME}:VERSION[-EXTRA]")
        elif tag not in built:
            errors.append(f"{where}: image {image}: no README command builds {tag} ({sorted(built)})")
    return errors


def check_readme(d: Deploy) -> list[str]:
    """The README's docker, compose and kubectl commands name files, services and objects that
    exist."""
    errors = []
    names = {(doc["kind"].lower(), doc["metadata"].get("name")) for _, doc in d.k8s_docs}
    services = set(d.compose_raw.get("services", {}))
    for block in d.readme_blocks:
        for argv in shell_commands(block):
            if argv[0] not in ("docker", "kubectl", "kind", "sed"):
                continue
            for n, a in enumerate(argv):
                nxt = argv[n + 1] if n + 1 < len(argv) else ""
                path = nxt if a == "-f" and ("/" in nxt or nxt.endswith((".yaml", ".yml"))) else (
                    a if a.startswith("deploy/") else None)
                if path and path != "-" and not list(REPO.glob(path)):
                    errors.append(f"{README}: {' '.join(argv[:4])}...: {path} does not exist")
                m = re.fullmatch(r"(job|deployment|service|configmap|secret)/([\w.-]+)", a)
                if m and (m[1], m[2]) not in names:
                    errors.append(f"{README}: {a} is not an object of {K8S}")
                if a == "--scale":
                    svc = argv[n + 1].partition("=")[0]
                    if svc not in services:
                        errors.append(f"{README}: --scale {svc}: no such compose service")
            if argv[:3] == ["kubectl", "-n", next((doc["metadata"]["name"] for _, doc in d.k8s("Namespace")), "")] \
                    and argv[3:6] == ["create", "secret", "generic"]:
                name = argv[6]
                example = next((doc for _, doc in d.k8s("Secret") if doc["metadata"]["name"] == name), None)
                keys = {a.split("=", 2)[1] for a in argv if a.startswith("--from-literal=")}
                if example is None:
                    errors.append(f"{README}: creates Secret {name}, which no manifest uses")
                elif keys != set(example.get("stringData") or {}):
                    errors.append(f"{README}: Secret {name} gets {sorted(keys)}, the manifests use "
                                  f"{sorted(example.get('stringData') or {})}")
            if argv[0] == "kubectl" and "-l" in argv:
                sel = dict(kv.split("=", 1) for kv in argv[argv.index("-l") + 1].split(","))
                pod_labels = [doc["spec"]["template"]["metadata"].get("labels") or {}
                              for _, doc in d.k8s_docs if doc["kind"] in ("Job", "Deployment")]
                if not any(all(labels.get(k) == v for k, v in sel.items()) for labels in pod_labels):
                    errors.append(f"{README}: -l {sel} selects no pods of the manifests")
    return errors


# -- the tests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deploy() -> Deploy:
    return Deploy.from_repo()


def _ok(errors: list[str]) -> None:
    assert not errors, "\n".join(errors)


def test_files_exist(deploy: Deploy) -> None:
    for path in (DOCKERFILE, DOCKERIGNORE, ENTRYPOINT_SCRIPT, COMPOSE, README):
        assert path in deploy.texts, path
    assert deploy.k8s_docs, f"no manifests under {K8S}"
    assert os.access(REPO / ENTRYPOINT_SCRIPT, os.X_OK), f"{ENTRYPOINT_SCRIPT} is not executable"


def test_env_names_are_settings(deploy: Deploy) -> None:
    _ok(check_env_names(deploy))


def test_settings_values_validate(deploy: Deploy) -> None:
    _ok(check_settings_values(deploy))


def test_command_lines_are_real_cli_commands(deploy: Deploy) -> None:
    _ok(check_commands(deploy))


def test_entrypoint_migrates_before_serve(deploy: Deploy, tmp_path: Path) -> None:
    _ok(check_entrypoint_script(deploy, tmp_path))


def test_dockerfile(deploy: Deploy) -> None:
    _ok(check_dockerfile(deploy))


def test_dockerfile_copy_sources(deploy: Deploy) -> None:
    _ok(check_copy_sources(deploy))


def test_healthcheck_and_port(deploy: Deploy) -> None:
    _ok(check_healthcheck(deploy))


def test_compose(deploy: Deploy) -> None:
    _ok(check_compose(deploy))


def test_compose_binds_loopback(deploy: Deploy) -> None:
    _ok(check_compose_bind(deploy))
    # told otherwise, it binds what it is told
    env = {**deploy.fake_env(), "AUTOTUNER_BIND": "0.0.0.0"}
    published = [str(p) for s in deploy.compose(env)["services"].values() for p in s.get("ports") or []]
    assert published == ["0.0.0.0:8000:8000"]


def test_no_token_on_a_command_line(deploy: Deploy) -> None:
    _ok(check_no_token_in_args(deploy))
    # and the commands that get one, get it from the environment
    for svc, spec in deploy.compose().get("services", {}).items():
        argv = _service_argv(spec, deploy)
        if our_image(str(spec.get("image", ""))) is not None and token_envvars(_cli_path(argv, deploy)):
            assert given_token(argv, compose_env(spec), deploy), f"{COMPOSE}: {svc} gets no token"
    for c in deploy.containers:
        argv = [str(a) for a in effective_argv(c.spec.get("command"), c.spec.get("args"),
                                                deploy.image_entrypoint, deploy.image_cmd)]
        if _cli_path(argv, deploy) in (["tune"], ["worker"]):
            assert given_token(argv, container_env(c, deploy)[0], deploy), f"{c.where} gets no token"


def test_compose_secrets_fail_fast(deploy: Deploy) -> None:
    _ok(check_compose_secrets(deploy))
    for r in deploy.compose_refs:
        if r.op == ":?":
            with pytest.raises(MissingVariable, match=r.name):
                deploy.compose({k: v for k, v in deploy.fake_env().items() if k != r.name})


def test_k8s_structure(deploy: Deploy) -> None:
    _ok(check_k8s_structure(deploy))


def test_k8s_service(deploy: Deploy) -> None:
    _ok(check_k8s_service(deploy))


def test_k8s_security(deploy: Deploy) -> None:
    _ok(check_k8s_security(deploy))


def test_k8s_secrets_are_placeholders(deploy: Deploy) -> None:
    _ok(check_k8s_secrets(deploy))


def test_k8s_tuner_jobs(deploy: Deploy) -> None:
    _ok(check_k8s_tuners(deploy))


def test_k8s_worker_pool(deploy: Deploy) -> None:
    _ok(check_k8s_workers(deploy))


def test_images(deploy: Deploy) -> None:
    _ok(check_images(deploy))


def test_readme(deploy: Deploy) -> None:
    _ok(check_readme(deploy))


# Realistic mistakes, applied to the files in memory: each must make its check fail with a
# message containing the given text.
MISTAKES = [
    ("a compose worker's cache in the container", check_compose,
     (COMPOSE, "      - tuner-cache:/cache\n", ""), "is not on a named volume"),
    ("a compose worker's cache the image leaves to root", check_compose,
     (DOCKERFILE, " \\\n    && install -d -o 10001 -g 10001 /cache", ""), "does not create /cache"),
    ("a tuner's cache in the container's files", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "mountPath: /cache", "mountPath: /scratch"), "not on a pod volume"),
    ("a one-pod tuner Job that starts afresh", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-tpu-job.yaml", "restartPolicy: OnFailure", "restartPolicy: Never"),
     "restartPolicy Never"),
    ("a worker without its cache folder", check_k8s_workers,
     ("deploy/k8s/tuner/worker-gpu-deployment.yaml", "name: AUTOTUNER_CACHE_DIR", "name: AUTOTUNER_CACHE"),
     "AUTOTUNER_CACHE_DIR is not set"),
    ("typo'd setting in the ConfigMap", check_env_names,
     ("deploy/k8s/10-configmap.yaml", "AUTOTUNER_MAX_BATCH:", "AUTOTUNER_MAXBATCH:"), "AUTOTUNER_MAXBATCH"),
    ("singular token variable in compose", check_env_names,
     (COMPOSE, "AUTOTUNER_WRITE_TOKENS: ${", "AUTOTUNER_WRITE_TOKEN: ${"), "AUTOTUNER_WRITE_TOKEN is not"),
    ("compose-only variable in a manifest", check_env_names,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "name: AUTOTUNER_SERVICE_TOKEN", "name: AUTOTUNER_WORKER_TOKEN"),
     "is not read by"),
    ("a unit in a number setting", check_settings_values,
     ("deploy/k8s/10-configmap.yaml", 'AUTOTUNER_LEASE_SECONDS: "300"', 'AUTOTUNER_LEASE_SECONDS: "5m"'),
     "invalid settings"),
    ("the DB URL in the ConfigMap", check_settings_values,
     ("deploy/k8s/10-configmap.yaml", "\ndata:\n", "\ndata:\n  AUTOTUNER_DB_URL: postgresql://u:pw@h/db\n"),
     "holds the secret AUTOTUNER_DB_URL"),
    ("a subcommand that does not exist", check_commands,
     (COMPOSE, 'command: ["db", "upgrade"]', 'command: ["db", "migrate"]'), "no such command"),
    ("an option that does not exist", check_commands,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "- --problems", "- --problem-file"), "No such option"),
    ("an option of another command", check_commands,
     ("deploy/k8s/20-migrate-job.yaml", 'args: ["db", "upgrade"]', 'args: ["db", "upgrade", "--port", "8000"]'),
     "No such option"),
    ("a command without its value", check_commands,
     (README, "--problems /problems/problems.json\n```", "--problems\n```"), "requires an argument"),
    ("an entrypoint that does not migrate", check_entrypoint_script,
     (ENTRYPOINT_SCRIPT, "        autotuner db upgrade\n", "        true\n"), "expected [['db', 'upgrade']"),
    ("an entrypoint that ignores serve's --db", check_entrypoint_script,
     (ENTRYPOINT_SCRIPT, 'autotuner db upgrade --db "$db"', "autotuner db upgrade"), "--db"),
    ("an entrypoint that serves after a failed migration", check_entrypoint_script,
     (ENTRYPOINT_SCRIPT, "set -eu\n", "set -u\n"), "exit 3"),
    ("running as root", check_dockerfile, (DOCKERFILE, "USER 10001:10001\n", ""), "non-root"),
    ("a user name instead of a uid", check_dockerfile, (DOCKERFILE, "USER 10001:10001", "USER autotuner"),
     "numeric"),
    ("installing without the lock", check_dockerfile,
     (DOCKERFILE, "pip install --requirement /tmp/requirements.lock", "pip install jax"), "requirements.lock"),
    ("a package not copied", check_dockerfile, (DOCKERFILE, "COPY service /src/service\n", ""),
     "service (installed by pyproject.toml)"),
    ("the wrong Python", check_dockerfile, (DOCKERFILE, "python:3.11-slim-bookworm", "python:3.12-slim"),
     "not python:3.11-slim"),
    ("a COPY of a missing path", check_copy_sources, (DOCKERFILE, "COPY db /src/db", "COPY database /src/db"),
     "no such file"),
    ("a dockerignored COPY source", check_copy_sources, (DOCKERIGNORE, "!service\n", ""), "excluded"),
    ("the healthcheck on another port", check_healthcheck, (DOCKERFILE, "127.0.0.1:8000/healthz", "127.0.0.1:8080/healthz"),
     "port 8080"),
    ("the healthcheck on another path", check_healthcheck, (DOCKERFILE, "8000/healthz", "8000/health"), "/health,"),
    ("the healthcheck with curl", check_healthcheck,
     (DOCKERFILE, 'CMD ["python", "-c", ', 'CMD ["curl", "-f", '), "no curl"),
    ("serve on loopback in the image", check_healthcheck,
     (DOCKERFILE, 'CMD ["serve", "--host", "0.0.0.0", ', 'CMD ["serve", '), "--host 0.0.0.0"),
    ("the service started before postgres is healthy", check_compose,
     (COMPOSE, "condition: service_healthy\n      migrate:", "condition: service_started\n      migrate:"),
     "service_healthy"),
    ("the service started before the migration ends", check_compose,
     (COMPOSE, "condition: service_completed_successfully", "condition: service_started"),
     "service_completed_successfully"),
    ("the worker pointed at the wrong host", check_compose, (COMPOSE, "http://service:8000", "http://localhost:8000"),
     "--service http://localhost:8000"),
    ("the DB URL naming another database", check_compose,
     (COMPOSE, "@postgres:5432/autotuner\n    depends_on:\n      postgres:\n        condition: service_healthy\n    healthcheck",
      "@postgres:5432/tuner\n    depends_on:\n      postgres:\n        condition: service_healthy\n    healthcheck"),
     "is not the compose database"),
    ("compose building another Dockerfile", check_compose, (COMPOSE, "dockerfile: deploy/Dockerfile", "dockerfile: Dockerfile"),
     "not deploy/Dockerfile"),
    ("a default password", check_compose_secrets,
     (COMPOSE, "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD, the database password}",
      "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:-postgres}"), "must be ${POSTGRES_PASSWORD:?message}"),
    ("a token in the file", check_compose_secrets,
     (COMPOSE, "AUTOTUNER_WRITE_TOKENS: ${AUTOTUNER_WRITE_TOKENS:?", "AUTOTUNER_WRITE_TOKENS: devtoken,${AUTOTUNER_WRITE_TOKENS:?"),
     "literal token 'devtoken'"),
    ("a required variable the README does not set", check_compose_secrets,
     (README, "export AUTOTUNER_WORKER_TOKEN=$(openssl rand -hex 24)\n", ""), "AUTOTUNER_WORKER_TOKEN"),
    ("a probe on another path", check_k8s_service, ("deploy/k8s/30-deployment.yaml", "path: /healthz", "path: /health"),
     "asks /health on port"),
    ("a liveness probe that asks the database", check_k8s_service,
     ("deploy/k8s/30-deployment.yaml", "path: /livez", "path: /healthz"), "livenessProbe asks /healthz"),
    ("a containerPort off serve's port", check_k8s_service,
     ("deploy/k8s/30-deployment.yaml", "containerPort: 8000", "containerPort: 8080"), "do not include"),
    ("serve on loopback in the Deployment", check_k8s_service,
     ("deploy/k8s/30-deployment.yaml", '"--host", "0.0.0.0", ', ""), "--host 0.0.0.0"),
    ("a multi-node Job whose process count is off", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-multinode-job.yaml", 'value: "2"', 'value: "4"'), "JAX_NUM_PROCESSES must be"),
    ("a multi-node Job with a coordinator no pod has", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-multinode-job.yaml", "value: autotuner-tune-multinode-0.", "value: autotuner-tune-0."),
     "must be pod 0's hostname"),
    ("a multi-node Job whose pods have no subdomain", check_k8s_structure,
     ("deploy/k8s/tuner/tune-multinode-job.yaml", "      subdomain: autotuner-tune-multinode\n", ""),
     "name no subdomain"),
    ("a multi-node Job on fewer GPUs than the problems' mesh", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-multinode-job.yaml", "  completions: 2\n  parallelism: 2",
      "  completions: 1\n  parallelism: 1"), "JAX_NUM_PROCESSES must be"),
    ("the tuner pointed at a missing Service", check_k8s_service,
     ("deploy/k8s/tuner/tune-tpu-job.yaml", "http://autotuner:8000", "http://autotuner-service:8000"), "names no Service"),
    ("a Service that selects nothing", check_k8s_structure,
     ("deploy/k8s/40-service.yaml", "selector:\n    app.kubernetes.io/name: autotuner", "selector:\n    app: autotuner"),
     "which no Deployment's pods have"),
    ("a secretKeyRef to a missing key", check_k8s_structure,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "key: AUTOTUNER_SERVICE_TOKEN", "key: token"), "key 'token'"),
    ("$(VAR) not in the environment", check_k8s_structure,
     ("deploy/k8s/tuner/tune-tpu-job.yaml", "- /problems/problems.json", "- $(AUTOTUNER_PROBLEMS)"),
     "$(AUTOTUNER_PROBLEMS)"),
    ("no runAsNonRoot", check_k8s_security, ("deploy/k8s/30-deployment.yaml", "runAsNonRoot: true", "runAsNonRoot: false"),
     "runAsNonRoot"),
    ("another uid than the image's", check_k8s_security, ("deploy/k8s/20-migrate-job.yaml", "runAsUser: 10001", "runAsUser: 1000"),
     "runAsUser 1000"),
    ("a real-looking secret", check_k8s_secrets,
     ("deploy/k8s/secrets/secret.example.yaml", "CHANGE-ME-db-password", "hunter2"), "AUTOTUNER_DB_URL: the password"),
    ("the tuner's token not a write token", check_k8s_secrets,
     ("deploy/k8s/secrets/secret.example.yaml", "AUTOTUNER_SERVICE_TOKEN: CHANGE-ME-tuner-token",
      "AUTOTUNER_SERVICE_TOKEN: CHANGE-ME-other-token"), "not one of"),
    ("fewer GPUs than the problems' mesh", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "nvidia.com/gpu: 8\n            limits", "nvidia.com/gpu: 4\n            limits"),
     "requests and limits differ"),
    ("a GPU Job on the CPU image", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "overlap-autotuner:0.1.0-cuda12", "overlap-autotuner:0.1.0"), "JAX_EXTRA=cuda"),
    ("a TPU Job without node selectors", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-tpu-job.yaml", "        cloud.google.com/gke-tpu-topology: 2x4\n", ""), "node selectors"),
    ("a TPU topology of another size", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-tpu-job.yaml", "gke-tpu-topology: 2x4", "gke-tpu-topology: 4x4"), "16 chips"),
    ("an invalid problem", check_k8s_tuners,
     ("deploy/k8s/tuner/problems-configmap.yaml", '"shape": [4096, 4096]', '"shape": [4095, 4096]'), "ConfigMap"),
    ("an image tag nobody builds", check_images,
     ("deploy/k8s/20-migrate-job.yaml", "image: overlap-autotuner:0.1.0", "image: overlap-autotuner:latest"),
     "not overlap-autotuner:VERSION"),
    ("an image of another version", check_images,
     ("deploy/k8s/30-deployment.yaml", "image: overlap-autotuner:0.1.0\n          imagePullPolicy: IfNotPresent\n          command: [\"autotuner\"]",
      "image: overlap-autotuner:0.2.0\n          imagePullPolicy: IfNotPresent\n          command: [\"autotuner\"]"),
     "no README command builds"),
    ("a README image nobody builds", check_images,
     (README, "-e AUTOTUNER_READ_TOKENS overlap-autotuner:0.1.0", "-e AUTOTUNER_READ_TOKENS overlap-autotuner:latest"),
     "not overlap-autotuner:VERSION"),
    ("a typo'd variable in the README", check_env_names,
     (README, "`AUTOTUNER_LOOKUP_CACHE_SECONDS`", "`AUTOTUNER_LOOKUP_CACHE_SECS`"), "AUTOTUNER_LOOKUP_CACHE_SECS"),
    ("a README command with a missing file", check_readme,
     (README, "kubectl create -f deploy/k8s/tuner/tune-gpu-job.yaml", "kubectl create -f deploy/k8s/tuner/gpu-job.yaml"),
     "does not exist"),
    ("a README secret with other keys", check_readme,
     (README, "--from-literal=AUTOTUNER_SERVICE_TOKEN=", "--from-literal=AUTOTUNER_TOKEN="), "gets ['AUTOTUNER_TOKEN']"),
    ("compose publishing on all interfaces", check_compose_bind,
     (COMPOSE, '"${AUTOTUNER_BIND:-127.0.0.1}:8000:8000"', '"8000:8000"'), "on all interfaces by default"),
    ("compose binding 0.0.0.0 by default", check_compose_bind,
     (COMPOSE, "${AUTOTUNER_BIND:-127.0.0.1}", "${AUTOTUNER_BIND:-0.0.0.0}"), "on 0.0.0.0 by default"),
    ("a token on the worker's command line", check_no_token_in_args,
     (COMPOSE, "      - --target\n      - inproc:4",
      "      - --token\n      - ${AUTOTUNER_WORKER_TOKEN:?set it}\n      - --target\n      - inproc:4"),
     "passes a token on the command line"),
    ("a token in a Job's args", check_no_token_in_args,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "            - --problems\n",
      "            - --token\n            - $(AUTOTUNER_SERVICE_TOKEN)\n            - --problems\n"),
     "set AUTOTUNER_SERVICE_TOKEN in the environment"),
    ("a token in a README command", check_no_token_in_args,
     (README, "--service http://autotuner:8000 --problems", '--service http://autotuner:8000 --token "$T" --problems'),
     "passes a token on the command line"),
    ("a tuner Job without its token", check_k8s_tuners,
     ("deploy/k8s/tuner/tune-gpu-job.yaml", "- name: AUTOTUNER_SERVICE_TOKEN", "- name: TUNER_TOKEN"),
     "tune without a token"),
    ("the worker's token not a write token", check_compose,
     (COMPOSE, "AUTOTUNER_WORKER_TOKEN: ${AUTOTUNER_WORKER_TOKEN:?", "AUTOTUNER_WORKER_TOKEN: ${OTHER_TOKEN:?"),
     "is not among"),
    ("a worker on CPU devices in the cluster", check_k8s_workers,
     ("deploy/k8s/tuner/worker-gpu-deployment.yaml", "- --target\n            - local", "- --target\n            - inproc:8"), "--target inproc:8"),
    ("a worker without its token", check_k8s_workers,
     ("deploy/k8s/tuner/worker-gpu-deployment.yaml", "name: AUTOTUNER_WORKER_TOKEN", "name: AUTOTUNER_SERVICE_TOKEN"), "worker without a token"),
    ("a worker killed before it hands its job back", check_k8s_workers,
     ("deploy/k8s/tuner/worker-gpu-deployment.yaml", "terminationGracePeriodSeconds: 60", "terminationGracePeriodSeconds: 1"), "hand its job back"),
    ("a GPU worker on the CPU image", check_k8s_workers,
     ("deploy/k8s/tuner/worker-gpu-deployment.yaml", "image: overlap-autotuner:0.1.0-cuda12", "image: overlap-autotuner:0.1.0"), "JAX_EXTRA=cuda"),
    ("a worker token with a default", check_compose_secrets,
     (COMPOSE, "AUTOTUNER_WORKER_TOKEN: ${AUTOTUNER_WORKER_TOKEN:?set AUTOTUNER_WORKER_TOKEN, the tuner worker's write token}",
      "AUTOTUNER_WORKER_TOKEN: ${AUTOTUNER_WORKER_TOKEN:-devtoken}"), "must be ${AUTOTUNER_WORKER_TOKEN:?message}"),
]


@pytest.mark.parametrize(("check", "mutation", "expected"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_checks_catch_mistakes(deploy: Deploy, check: Any, mutation: tuple[str, str, str], expected: str,
                               tmp_path: Path) -> None:
    if check in (check_healthcheck, check_compose, check_k8s_service) and serve_port() is None:
        pytest.skip("needs `autotuner serve` (its own tests fail while it is missing)")
    broken = deploy.replaced(*mutation)
    errors = check(broken, tmp_path) if check is check_entrypoint_script else check(broken)
    assert any(expected in e for e in errors), f"expected an error with {expected!r}, got:\n" + "\n".join(errors)
