"""The architecture as tests: module size, no import cycle, a light runtime import.

These read the source tree (and run one fresh interpreter); they fail with the offending module,
cycle or loaded package named, so a change that breaks the layout says where.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("autotuner", "db", "service")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages (migrations excepted)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO)
            if "migrations" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (top level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def test_no_function_of_the_pass_is_over_60_lines() -> None:
    """The compiler pass reads as stages (`overlap.pipeline`): each a function a screen long."""
    long = {}
    for path in sorted((REPO / "autotuner" / "overlap").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"functions of the pass over 60 lines (split them into stages): {long}"


def test_readmes_module_map_is_the_tree() -> None:
    """README's Architecture section lists every module (scripts/modules.py draws it from the tree)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("modules_map", REPO / "scripts" / "modules.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.readme_map((REPO / "README.md").read_text()) == mod.module_map(REPO), (
        "README's module map is stale: paste `python scripts/modules.py` into its Architecture section")


# Basenames that several modules may share, each with exactly these modules: the name is the
# same job in each package, or (service.routes) the URL of the resource a router serves.
SHARED_BASENAMES = {
    # each top-level package's exceptions; db's and service's derive from autotuner.errors'
    "errors": {"autotuner.errors", "db.errors", "service.errors"},
    # a package's private helpers (the leading underscore: imported only inside that package)
    "_common": {"autotuner.decompose._common", "db._common", "service.routes._common"},
    # a package's helpers for tests and benchmarks (problems and inputs; request bodies and a server)
    "testing": {"autotuner.testing", "service.testing"},
    # service/routes/ names each router after the /v1 resource it serves (one router per resource)
    "benches": {"service.routes.benches", "service.dashboard.benches"},
    "problems": {"service.routes.problems", "autotuner.hlo.problems"},
    "results": {"service.routes.results", "autotuner.results"},
    "snapshot": {"service.routes.snapshot", "autotuner.snapshot"},
}


def _basename_clashes(modules: list[str]) -> dict[str, list[str]]:
    """Basename -> the modules (dotted; packages' __init__ and __main__ left out) that share it,
    for every basename two or more modules share other than as `SHARED_BASENAMES` lists."""
    by_name: dict[str, set[str]] = {}
    for name in modules:
        by_name.setdefault(name.rpartition(".")[2], set()).add(name)
    return {base: sorted(mods) for base, mods in sorted(by_name.items())
            if len(mods) > 1 and mods != SHARED_BASENAMES.get(base)}


def test_no_two_modules_share_a_basename() -> None:
    """A module's name says what it holds: two modules of different jobs never share one
    (`lab.py` for the lab's launcher and for the measurement target on it, say). Packages
    (__init__) and `__main__` are not modules here; SHARED_BASENAMES says which names may recur."""
    modules = [name for name, path in _modules().items() if path.name not in ("__init__.py", "__main__.py")]
    clashes = _basename_clashes(modules)
    assert not clashes, f"modules that share a name (name each for what it holds): {clashes}"


def test_the_basename_check_finds_a_clash() -> None:
    assert _basename_clashes(["autotuner.lab.launcher", "autotuner.measure.lab_target", "autotuner.errors",
                              "db.errors", "service.errors"]) == {}
    assert _basename_clashes(["autotuner.lab.lab", "autotuner.measure.lab", "autotuner.cli.lab", "db.errors",
                              "service.errors"]) == {
        "errors": ["db.errors", "service.errors"],   # not the listed set: autotuner.errors is missing
        "lab": ["autotuner.cli.lab", "autotuner.lab.lab", "autotuner.measure.lab"]}


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _package(module: str) -> str:
    """autotuner.X for a module of autotuner's sub-package X; db or service for theirs; any
    other module (autotuner's own top-level modules, its __init__) is its own node."""
    parts = module.split(".")
    if parts[0] != "autotuner":
        return parts[0]
    if len(parts) > 1 and (REPO / "autotuner" / parts[1]).is_dir():
        return f"autotuner.{parts[1]}"
    return module


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to packages (`_package`), imports inside one package dropped."""
    out: dict[str, set[str]] = {}
    for name, deps in graph.items():
        pkg = _package(name)
        out.setdefault(pkg, set()).update(_package(d) for d in deps)
        out[pkg].discard(pkg)
    return out


def test_no_import_cycle_between_packages() -> None:
    modules = _modules()
    graph = _package_graph({name: _imports(name, path, modules) for name, path in modules.items()})
    cycles = _cycles(graph)
    assert not cycles, f"packages that import each other (make the dependency point one way): {cycles}"


def test_the_package_cycle_check_finds_a_cycle() -> None:
    """A module graph without a cycle (measure.targets -> lab.spec, lab.runner -> measure.local)
    has one between its packages (measure <-> lab)."""
    graph = {"autotuner.measure.targets": {"autotuner.lab.spec"}, "autotuner.lab.spec": set(),
             "autotuner.lab.runner": {"autotuner.measure.local"}, "autotuner.measure.local": set(),
             "service.app": {"db.tables"}, "db.tables": set()}
    assert _cycles(graph) == []
    assert _package_graph(graph) == {"autotuner.measure": {"autotuner.lab"},
                                     "autotuner.lab": {"autotuner.measure"}, "service": {"db"}, "db": set()}
    assert _cycles(_package_graph(graph)) == [["autotuner.lab", "autotuner.measure"]]


def test_dependencies_point_one_way() -> None:
    """db imports of autotuner only its light core (errors, settings, the winner rule, the measurement's
    fields, atomic file writes); autotuner's runtime
    imports no db, service or tuner code; nothing of autotuner imports service; measure times
    what it is given: it imports neither the compiler pass nor the runtime, nor the lab's
    runner (the lab imports nothing of measure)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    allowed_core = {"autotuner.errors", "autotuner.settings", "autotuner.rule", "autotuner.measurement",
                    "autotuner.files"}
    bad = []
    for name, deps in graph.items():
        for d in deps:
            top, dtop = name.split(".")[0], d.split(".")[0]
            if top == "db" and dtop == "autotuner" and d not in allowed_core:
                bad.append((name, d))
            if top == "autotuner" and dtop == "service":
                bad.append((name, d))
            if name.startswith("autotuner.runtime") and (dtop in ("db", "service")
                                                         or d.startswith(("autotuner.tune", "autotuner.cli"))):
                bad.append((name, d))
            if name.startswith("autotuner.decompose") and (dtop in ("db", "service")
                                                            or d.startswith("autotuner.tune")):
                bad.append((name, d))
            if name.startswith("autotuner.measure") and d.startswith(
                    ("autotuner.runtime", "autotuner.overlap", "autotuner.lab.runner")):
                bad.append((name, d))
            if name.startswith("autotuner.lab") and d.startswith("autotuner.measure"):
                bad.append((name, d))
    assert not bad, f"imports against the layout's direction: {sorted(bad)}"


HEAVY = ("sqlalchemy", "alembic", "fastapi", "optuna")

_TRAINING_JOB = """
import json, sys
import autotuner
light = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
x = jax.device_put(jnp.ones((2, 64, 32)), NamedSharding(mesh, P(None, "model", None)))
w = jax.device_put(jnp.ones((32, 128)), NamedSharding(mesh, P(None, "model")))
f = jax.jit(lambda x, w: autotuner.collective_einsum("bsd,df->bsf", x, w, mesh=mesh,
                                                     out_spec=P(None, None, "model"), strategy="auto"))
out = f(x, w)
import numpy as np
ok = bool(np.allclose(np.asarray(out), np.einsum("bsd,df->bsf", np.asarray(x), np.asarray(w))))
print(json.dumps({"import": light, "job": sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY)),
                  "ok": ok}))
"""


def test_runtime_path_loads_no_database_web_or_optuna_code(tmp_path: Path) -> None:
    """`import autotuner` and a jitted collective_einsum(strategy="auto") in a fresh interpreter,
    with a service URL set (the client asks it over HTTP): none of the heavy stacks load."""
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "AUTOTUNER_SERVICE_URL": "http://127.0.0.1:9",  # nothing listens: baseline, one warning
           "AUTOTUNER_CACHE_DIR": str(tmp_path / "cache")}
    code = f"HEAVY = {HEAVY!r}\n" + _TRAINING_JOB
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"import": [], "job": [], "ok": True}, got


_UPLOAD = """
import json, sys
import autotuner, autotuner.overlap
from autotuner import Device, Problem
from autotuner.measure import Candidate, SessionResult
from autotuner.runtime.client import Client
p = Problem.from_dict({"equation": "sd,df->sf", "lhs": {"shape": [64, 32], "spec": ["x", None]},
                       "rhs": {"shape": [32, 64], "spec": [None, "x"]}, "out_spec": [None, "x"],
                       "dtype": "float32", "mesh": {"x": 4}})
base = Candidate({"method": "baseline"}, "baseline", samples=[1.0] * 3, median_s=1.0, n=3)
ring = Candidate({"method": "ring", "direction": "uni", "chunks": 1, "unroll": "full", "fuse": "loop",
                  "send_first": True}, "ring-uni-c1-ufull-loop-send", samples=[0.8] * 3, median_s=0.8, n=3,
                 ratio=1.25, ratio_lo=1.2, ratio_hi=1.3)
session = SessionResult(p.to_dict(), base, [ring], None, None, None, 3, 0.1)
client = Client("http://127.0.0.1:9", token="t", device=Device("cpu", "cpu", 4, 1, "inproc", "x", "y"))
answer, where = client.upload(None, p, session, name="in-job tuning")
print(json.dumps({"posted": where.startswith("nowhere (the upload to"),
                  "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))}))
"""


def test_the_pass_and_the_in_job_upload_load_no_database_web_or_optuna_code(tmp_path: Path) -> None:
    """Transitively, imports inside functions included: `import autotuner.overlap` and the in-job
    upload (`Client.upload` -> the measurement items and the /v1/results body, posted to a service
    that is not there) load none of the heavy stacks; plotly neither."""
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path),
           "AUTOTUNER_CACHE_DIR": str(tmp_path / "cache")}
    code = f"HEAVY = {(*HEAVY, 'plotly')!r}\n" + _UPLOAD
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"posted": True, "loaded": []}


def test_the_light_import_check_sees_a_heavy_import(tmp_path: Path) -> None:
    """The same probe, after importing the tuner's database layer, reports sqlalchemy."""
    code = (f"HEAVY = {HEAVY!r}\nimport json, sys\nimport autotuner.tune.store, db\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(HEAVY))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)},
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sqlalchemy" in json.loads(res.stdout.strip().splitlines()[-1])
