"""The device fingerprint, part of every record's key: what the measurements were taken on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from autotuner.errors import AutotunerError

ESTIMATE_PREFIX = "aot:"  # the topology of a compile-only target: XLA's estimates, never measurements
ESTIMATED_LABEL = "estimated (XLA:TPU compile, no TPU)"  # what every figure of such a device says it is


def estimated_topology(topology: object) -> bool:
    """Whether a device of this topology label is a compile-only target (`Device.estimated`)."""
    return str(topology).startswith(ESTIMATE_PREFIX)


class DeviceError(AutotunerError, ValueError):
    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"device.{field}: {message}")


@dataclass(frozen=True)
class Device:
    platform: str            # cpu, gpu, tpu
    device_kind: str         # e.g. "cpu", "NVIDIA H100 80GB HBM3", "TPU v4"
    num_devices: int
    num_processes: int
    topology: str            # e.g. "inproc", "lab-ring-2gbit", "local", "aot:tpu:v5e:2x4" (estimates)
    jax_version: str
    jaxlib_version: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Device:
        if not isinstance(d, dict):
            raise DeviceError("device", f"expected a JSON object, got {type(d).__name__}")
        names = {f.name: f.type for f in fields(cls)}
        extra = sorted(set(d) - set(names))
        if extra:
            raise DeviceError(extra[0], "unknown field")
        vals = {}
        for name in names:
            if name not in d:
                raise DeviceError(name, "missing field")
            v = d[name]
            if name in ("num_devices", "num_processes"):
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise DeviceError(name, f"must be a positive integer, got {v!r}")
            elif not isinstance(v, str) or not v or len(v) > 200:
                raise DeviceError(name, f"must be a non-empty string (at most 200 characters), got {v!r}")
            vals[name] = v
        return cls(**vals)

    @property
    def key(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def estimated(self) -> bool:
        """A compile-only target (`aot:tpu:...`): what is stored for it are XLA's estimates, never
        measurements."""
        return estimated_topology(self.topology)

    @property
    def label(self) -> str:
        return f"{self.platform}:{self.device_kind}x{self.num_devices}/{self.topology}"

    @classmethod
    def current(cls, topology: str | None = None) -> Device:
        """Fingerprint of the devices this process sees (jax must be importable)."""
        import jax
        import jaxlib

        devs = jax.devices()
        platform = devs[0].platform
        if topology is None:
            topology = "inproc" if platform == "cpu" and jax.process_count() == 1 else "local"
        return cls(platform=platform, device_kind=str(devs[0].device_kind), num_devices=len(devs),
                   num_processes=jax.process_count(), topology=topology,
                   jax_version=jax.__version__, jaxlib_version=jaxlib.__version__)
