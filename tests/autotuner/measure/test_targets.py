"""Where measurements run (`autotuner.measure.targets`): what starting a target does to JAX."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]


def test_inproc_devices_are_the_cpu_when_jax_was_imported_first():
    """`inproc:N` (and every command that builds a program on in-process devices) asks JAX for the
    CPU alone. JAX reads JAX_PLATFORMS when it is imported, and `prepare_inproc` runs after the
    import, so setting the variable there did nothing: a GPU host started CUDA, and a host with
    libtpu installed (`make test` installs it) probed for a TPU, with libtpu's warnings and an
    `E0000 ... INVALID_ARGUMENT` on stderr. A fresh process without JAX_PLATFORMS, as a user's shell is."""
    code = ("import jax\n"
            "from autotuner.measure.targets import prepare_inproc\n"
            "prepare_inproc(2)\n"
            "print(jax.config.jax_platforms, jax.default_backend(), jax.device_count())\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith(("XLA_", "TPU_"))}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["cpu", "cpu", "2"], r.stdout
    assert "TPU" not in r.stderr, r.stderr[-3000:]


def test_a_platform_the_user_chose_is_kept():
    """The user's own choice (JAX_PLATFORMS, or `jax.config`'s `jax_platforms`) is left as it is."""
    code = ("import jax\n"
            "jax.config.update('jax_platforms', 'cpu,tpu')\n"
            "from autotuner.measure.platforms import cpu_unless_chosen\n"
            "cpu_unless_chosen()\n"
            "print(jax.config.jax_platforms)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["cpu,tpu"], r.stdout


def test_the_default_target_on_a_cpu_host_is_eight_in_process_devices():
    """`tune`/`calibrate` without --target: JAX is started to tell a GPU/TPU host from a CPU one,
    and on a CPU host the in-process target must then find its 8 devices (it found 1 and failed,
    "JAX is already initialised with 1 devices; inproc:8 needs a fresh process")."""
    code = ("import jax\n"
            "from autotuner.measure.targets import default_target, prepare_inproc\n"
            "t = default_target()\n"
            "prepare_inproc(int(t.split(':')[1]))\n"
            "print(t, jax.device_count())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["JAX_PLATFORMS"] = "cpu"   # what a CPU host's JAX finds (libtpu, where installed, not probed)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["inproc:8", "8"], r.stdout
