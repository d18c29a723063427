"""What the XLA:TPU estimate (`autotuner.hlo.schedule`) needs of a TPU generation, from public specs.

Each constant says where it comes from (README, "TPU truth from the compiler", has the table and
the links):
- **clock**: turns the compiler's per-op `estimated_cycles` into seconds. v4: 1050 MHz (the TPU v4
  paper, Jouppi et al., ISCA 2023), which is also what the Cloud TPU page's 275 TFLOP/s over 2
  TensorCores x 4 MXUs x 128x128 multiply-adds x 2 gives; v5e: 1.5 GHz ("How to Scale Your
  Model", the JAX team's book, ch. 2), = 197 TFLOP/s over 4 MXUs; v5p: not published, 459 TFLOP/s
  over 2 TensorCores x 4 MXUs x 128x128 x 2 = 1.75 GHz. v6e: not published, and its public figures
  do not give one (918 TFLOP/s over 2 MXUs of 256x256 would be 3.5 GHz, while XLA:TPU's own cycle
  count for a large matmul already implies more multiply-adds per cycle than that): 2.2 GHz, at
  which XLA:TPU's estimate of an 8192^3 bf16 matmul reaches 89% of the published 918 TFLOP/s, what
  the same estimate reaches on v4, v5e and v5p at their clocks (88-90%). `bench/tpu_estimates.py
  --calibrate` prints that fraction per generation; tests/autotuner/measure/test_aot.py checks it
  stays within 85-95% on the installed libtpu, so a change of XLA's cycle model is caught.
- **link_bytes_per_s**: one ICI link, one direction ("How to Scale Your Model", ch. 2 table:
  4.5e10 B/s on v4 and v5e, 9e10 on v5p and v6e; Cloud's per-chip bidirectional figures, 400 GB/s
  over 4 ports on v5e and 800 GB/s over 4 on v6e, agree within 10%).
- **hbm_bytes_per_s**: per chip, Cloud TPU pages (v4 1200, v5e 819, v5p 2765, v6e 1638 GB/s).
- **wraps**: whether the slice's axes close into rings. Slices smaller than a 4x4x4 cube (v4,
  v5p) or with axes under 16 (v5e, v6e) have no wrap-around links (Cloud v5p page; the book), so
  the small topologies this target compiles for are meshes.
- **hop_latency_s**: an assumption, not a spec: 1 microsecond per transfer step (public material
  says "sub-microsecond" per hop between neighbours; the issue of a DMA costs some too). It keeps
  the estimate from rewarding ever finer chunks for free.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotuner.errors import AutotunerError


class ChipError(AutotunerError, ValueError):
    pass


@dataclass(frozen=True)
class Chip:
    generation: str          # v4, v5e, v5p, v6e
    device_kind: str         # what JAX calls its devices
    clock_hz: float
    clock_source: str
    peak_flops: float        # bf16, per chip
    link_bytes_per_s: float  # one ICI link, one direction
    hbm_bytes_per_s: float   # per chip
    cores: int               # TensorCores per chip
    hop_latency_s: float = 1e-6

    def to_dict(self) -> dict[str, object]:
        return {"generation": self.generation, "clock_hz": self.clock_hz, "clock_source": self.clock_source,
                "peak_flops": self.peak_flops, "link_bytes_per_s": self.link_bytes_per_s,
                "hbm_bytes_per_s": self.hbm_bytes_per_s, "hop_latency_s": self.hop_latency_s}


CHIPS: dict[str, Chip] = {c.generation: c for c in (
    Chip("v4", "TPU v4", 1.05e9, "TPU v4 paper (ISCA 2023)", 275e12, 4.5e10, 1200e9, 2),
    Chip("v5e", "TPU v5 lite", 1.5e9, "How to Scale Your Model, ch. 2", 197e12, 4.5e10, 819e9, 1),
    Chip("v5p", "TPU v5", 1.75e9, "derived: 459 TFLOP/s / (2 x 4 MXUs x 128x128 x 2)", 459e12, 9e10, 2765e9, 2),
    Chip("v6e", "TPU v6 lite", 2.2e9, "set: XLA:TPU's 8192^3 matmul estimate at 89% of 918 TFLOP/s, as on v4-v5p",
         918e12, 9e10, 1638e9, 1),
)}


def chip_for(device_kind: str) -> Chip:
    """The generation of a JAX TPU device kind ("TPU v5 lite" -> v5e)."""
    for c in CHIPS.values():
        if c.device_kind == device_kind:
            return c
    known = ", ".join(f"{c.device_kind!r} ({c.generation})" for c in CHIPS.values())
    raise ChipError(f"no estimate constants for device kind {device_kind!r}; known: {known}")
