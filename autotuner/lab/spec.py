"""What a lab is: `LabSpec` (topology, process count, link shaping) and the lab's errors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from autotuner.errors import AutotunerError

if TYPE_CHECKING:
    pass

Topology = Literal["none", "shared", "ring"]
_TOPOLOGIES = ("none", "shared", "ring")
_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$", re.IGNORECASE)
_SIZE = re.compile(r"^\d+(\.\d+)?([kmg]?b?|[kmg]bit)$", re.IGNORECASE)
_TIME = re.compile(r"^\d+(\.\d+)?(s|sec|ms|msec|us|usec)$", re.IGNORECASE)
HANDLER_FORM = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
OWNED = re.compile(r"^otl(\d+)-\d+-")  # otl<owner pid>-<lab number>-<process or tmp suffix>
REPO_ROOT = str(Path(__file__).resolve().parents[2])  # what holds the autotuner package
COORDINATOR_PORT = 8476           # coordinator port inside a fresh namespace (nothing else listens there)
LOG_TAIL = 15


def owner_exited(name: str) -> bool:
    """Whether `name` (a namespace, /etc/netns dir or temp dir) is a lab's whose owner has exited:
    what a dead or finished lab left behind (a running lab's owner is alive)."""
    return (m := OWNED.match(name)) is not None and not Path(f"/proc/{m.group(1)}").exists()


# Pin each worker to one core, or leave placement to the scheduler? Measured here (2 cores,
# lab:shared:2:2gbit, all-gather of a 1024x1024 f32 shard then a matmul with a 1024x768 shard, vs
# a ppermute ring decomposition in 2 chunks; medians of 7-11 interleaved reps, ms, baseline/ring):
# pinned 54-61 / 48-51, unpinned 50-62 / 41-50 (pin switched per rep inside one lab);
# Lab(pin=True) 56-71 / 53-71, Lab(pin=False) 50-72 / 41-59 (3 labs each, alternating).
# Comm alone 31 ms. Unpinned is never slower and keeps more of the overlap, so it is the default.
PIN_DEFAULT = False


class LabError(AutotunerError, RuntimeError):
    """The lab cannot be set up here (not root, no `ip`, no netns or tbf support, bad spec)."""


class LabWorkerError(LabError):
    """A worker died or a call timed out; the lab was torn down and restarts on the next call."""


@dataclass(frozen=True)
class LabSpec:
    topology: Topology
    n: int
    rate: str = "2gbit"
    burst: str = "1mb"  # small against the messages: a 4mb bucket let 4 MiB shards pass unshaped
    latency: str = "100ms"
    pin: bool = PIN_DEFAULT

    def __post_init__(self) -> None:
        if self.topology not in _TOPOLOGIES:
            raise LabError(f"lab topology must be one of {_TOPOLOGIES}, got {self.topology!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= 8:
            raise LabError(f"lab process count must be an integer in 1..8, got {self.n!r}")
        for name, pattern, example in (("rate", _RATE, "2gbit"), ("burst", _SIZE, "1mb"),
                                       ("latency", _TIME, "100ms")):
            value = getattr(self, name)
            if not isinstance(value, str) or not pattern.match(value):
                raise LabError(f"lab {name} must look like {example!r}, got {value!r}")

    @classmethod
    def parse(cls, target: str) -> LabSpec:
        """Parse ``lab:TOPOLOGY:N[:RATE]``, e.g. ``lab:shared:2:2gbit`` or ``lab:none:2``."""
        parts = target.strip().split(":")
        if parts[0] != "lab" or len(parts) not in (3, 4):
            raise LabError(f"bad lab target {target!r}: expected lab:TOPOLOGY:N[:RATE], e.g. "
                           "lab:shared:2:2gbit, lab:ring:4:1gbit or lab:none:2")
        if not parts[2].isdigit():
            raise LabError(f"bad lab target {target!r}: process count {parts[2]!r} is not a number")
        rate = {"rate": parts[3]} if len(parts) == 4 else {}
        return cls(parts[1], int(parts[2]), **rate)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """Topology label for the device fingerprint: ``lab-shared-2gbit``, ``lab-none``."""
        return "lab-none" if self.topology == "none" else f"lab-{self.topology}-{self.rate.lower()}"
