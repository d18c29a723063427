"""The package a user installs into their own environment (issue 37): `pip install .` with no
extras, into a fresh venv, gives the runtime: `overlap` with an offline snapshot runs on a
2-device CPU program while FastAPI, SQLAlchemy, Optuna and plotly are neither installed nor
needed; the `autotuner` command says which extra it needs instead of a traceback. The install
is constrained to requirements.lock's versions, so pip's cache answers where it has them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import autotuner
    from autotuner import Client, overlap

    assert not autotuner.__file__.startswith(sys.argv[1]), autotuner.__file__   # the installed copy
    absent = [m for m in ("fastapi", "sqlalchemy", "optuna", "plotly", "typer") if importlib.util.find_spec(m)]
    assert not absent, absent
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    a = jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8), NamedSharding(mesh, P("x", None)))
    b = jax.device_put(np.ones((8, 12), np.float32), NamedSharding(mesh, P(None, None)))

    def f(x, y):
        x = jax.reshard(x, NamedSharding(mesh, P(None, None)))
        return jnp.einsum("ij,jk->ik", x, y, out_sharding=NamedSharding(mesh, P(None, None)))

    with open("snapshot.json", "w") as fh:
        json.dump({"format": "autotuner-snapshot", "version": 1, "entries": []}, fh)
    ov = overlap(f, client=Client(offline="snapshot.json"))
    plan = ov.plan(a, b)
    assert len(plan) == 1 and plan[0].source == "default", plan
    assert np.allclose(ov(a, b), np.asarray(a) @ np.asarray(b))
    print("ran", len(plan), "pair(s)")
""")


@pytest.mark.slow
def test_the_bare_package_runs_overlap_without_the_tuning_and_service_stack(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT),
                          "-c", str(ROOT / "requirements.lock")], capture_output=True, text=True, timeout=1200)
    assert pip.returncode == 0, pip.stderr[-3000:]
    (tmp_path / "run.py").write_text(SCRIPT)
    run = subprocess.run([str(py), "run.py", str(ROOT)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ran 1 pair(s)" in run.stdout, run.stdout + run.stderr[-3000:]
    cli = subprocess.run([str(venv / "bin" / "autotuner"), "--help"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "pip install 'overlap-autotuner[tune]'" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr
