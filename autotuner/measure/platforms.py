"""Which platform JAX starts on, asked before it starts: whether its backends have started, and the
CPU alone for the targets whose devices are this process's CPU (`inproc:N`) or only compiled for
(`aot`). `autotuner.measure.targets` and `autotuner.measure.aot` both ask here."""

from __future__ import annotations

import os
import sys


def backends_started() -> bool:
    """Whether JAX has started its backends (importing jax, or loading libtpu's topologies for an
    `aot` target, does not): until then the number of CPU devices can still be set."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public API says this (checked with jax 0.10.2)

    return bool(xla_bridge.backends_are_initialized())


def cpu_unless_chosen() -> None:
    """JAX's platforms: the CPU alone unless the user chose (JAX_PLATFORMS, or jax.config's
    `jax_platforms`), set before JAX starts its backends. JAX reads JAX_PLATFORMS when it is
    imported, so where it is imported already (`backends_started` imports it) its config is set too:
    the variable alone did nothing there, and a GPU host's `inproc:N` started CUDA, a host with
    libtpu installed probed for a TPU (its warnings and an `E0000 ... INVALID_ARGUMENT` on stderr)."""
    if backends_started():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # and for a later import, and child processes
    jax = sys.modules.get("jax")
    if jax is not None and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
