"""The Strategy: a frozen, JSON-serializable choice of how to run one Problem.

`{"method": "baseline"}` is always valid: the plain collective and the plain einsum. `ring`
decomposes the collective and the einsum together into a loop of CollectivePermutes and partial
einsums (Wang et al., ASPLOS 2023). Its knobs, each a different program:

- direction: `uni` sends whole shards one way round the ring (n-1 steps); `bidi` sends shards
  both ways at once (ceil((n-1)/2) steps, each link direction carrying half the data; for even n
  the antipodal shard is split in halves, one per direction). Needs n >= 3.
- chunks: 1, 2 or 4 pieces per shard, each with its own transfer and partial einsum, so the
  pipeline is finer and its fill/drain shorter.
- unroll: 1 (a rolled `scan` loop), 2 (scan unrolled by two), or `full` (straight-line code).
- fuse: all-gather only. `loop` writes each partial result into its slot of the output buffer
  (or adds it to the accumulator) inside the loop; `after` collects the partial results as loop
  outputs and concatenates (or sums) them after the loop.
- send_first: the step's transfer is issued before its partial einsum (True) or after (False).

`plain` is the einsum as the user's program has it, partitioned by GSPMD with the compiler's
default options: what plain `jax.jit` compiles to on the target. On TPU that is often XLA's own
windowed einsum already (on by default above its size threshold), so there it is the reference
every candidate is measured against (`reference`); elsewhere it is a candidate beside the
hand-written `baseline`, and a decomposition wins only if it beats both.

`serial` is a ring's control: the same decomposition (same knobs, same transfers, same partial
einsums), decomposed but not overlapped: each step's transfer completes before its partial einsum
starts (or, with send_first false, the einsum before the transfer), by a data dependency XLA
cannot remove. Timed beside the ring and the baseline, it splits a ring's speedup into what the
decomposition's traffic saves (`baseline / serial`) and what overlap adds (`serial / ring`).
`space` never offers it, the winner rule never picks it (`is_control`), the pass never applies it.

`xla_windowed` compiles the plain einsum (GSPMD inserts the collective, as the baseline's plain
collective + einsum) with XLA's own windowed-einsum ("collective matmul") pass switched on by
per-compile options (`autotuner.decompose.compiler_options`); `multi_stream` asks XLA:GPU to run
the windowed loop's partial einsums on several streams. Only the platforms that honour the
options get it from `space` (GPU, TPU); XLA:CPU accepts and ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from autotuner.errors import AutotunerError

METHODS = ("baseline", "plain", "ring", "serial", "xla_windowed")
DIRECTIONS = ("uni", "bidi")
CHUNKS = (1, 2, 4)
UNROLLS: tuple[int | str, ...] = (1, 2, "full")
FUSES = ("loop", "after")
RING_KNOBS = ("direction", "chunks", "unroll", "fuse", "send_first")


class StrategyError(AutotunerError, ValueError):
    """An invalid Strategy; `field` names the offending knob."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"strategy.{field}: {message}")


@dataclass(frozen=True)
class Strategy:
    method: Literal["baseline", "plain", "ring", "serial", "xla_windowed"] = "baseline"
    direction: Literal["uni", "bidi"] = "uni"
    chunks: int = 1
    unroll: int | str = "full"
    fuse: Literal["loop", "after"] = "loop"
    send_first: bool = True
    multi_stream: bool = False   # xla_windowed only

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise StrategyError("method", f"unknown method {self.method!r} (known: {', '.join(METHODS)})")
        if self.direction not in DIRECTIONS:
            raise StrategyError("direction", f"must be one of {DIRECTIONS}, got {self.direction!r}")
        if isinstance(self.chunks, bool) or self.chunks not in CHUNKS:
            raise StrategyError("chunks", f"must be one of {CHUNKS}, got {self.chunks!r}")
        if isinstance(self.unroll, bool) or self.unroll not in UNROLLS:
            raise StrategyError("unroll", f"must be one of {UNROLLS}, got {self.unroll!r}")
        if self.fuse not in FUSES:
            raise StrategyError("fuse", f"must be one of {FUSES}, got {self.fuse!r}")
        if not isinstance(self.send_first, bool):
            raise StrategyError("send_first", f"must be true or false, got {self.send_first!r}")
        if not isinstance(self.multi_stream, bool):
            raise StrategyError("multi_stream", f"must be true or false, got {self.multi_stream!r}")
        if self.multi_stream and self.method != "xla_windowed":
            raise StrategyError("multi_stream", "applies to method 'xla_windowed' only")
        if self.method in ("xla_windowed", "plain"):
            for name in RING_KNOBS:
                if getattr(self, name) != _RING_DEFAULTS[name]:
                    raise StrategyError(name, f"applies to method 'ring' only, not {self.method!r}")

    @classmethod
    def baseline(cls) -> Strategy:
        return cls()

    @classmethod
    def plain(cls) -> Strategy:
        return cls("plain")

    @property
    def is_baseline(self) -> bool:
        return self.method == "baseline"

    @property
    def is_control(self) -> bool:
        """A measurement control (`serial`), never a candidate."""
        return self.method == "serial"

    def serial(self) -> Strategy:
        """This ring's control: the same ring, decomposed but not overlapped."""
        if self.method != "ring":
            raise StrategyError("method", f"only a ring has a serial control, not {self.method!r}")
        return Strategy("serial", self.direction, self.chunks, self.unroll, self.fuse, self.send_first)

    def ring(self) -> Strategy:
        """The ring a `serial` control controls (a ring: itself)."""
        if self.method not in ("ring", "serial"):
            raise StrategyError("method", f"{self.method!r} is not a ring")
        return Strategy("ring", self.direction, self.chunks, self.unroll, self.fuse, self.send_first)

    @property
    def rewrites(self) -> bool:
        """Whether the compiler pass rewrites a pair for it: a ring does; `baseline` and `plain`
        leave the user's program as it is, and `xla_windowed` is a compile option."""
        return self.method == "ring"

    def to_dict(self) -> dict[str, Any]:
        if self.method in ("baseline", "plain"):
            return {"method": self.method}
        if self.method == "xla_windowed":
            return {"method": self.method, "multi_stream": self.multi_stream}
        return {"method": self.method, "direction": self.direction, "chunks": self.chunks,
                "unroll": self.unroll, "fuse": self.fuse, "send_first": self.send_first}

    @classmethod
    def from_dict(cls, d: Any) -> Strategy:
        if not isinstance(d, dict):
            raise StrategyError("method", f"expected a JSON object, got {type(d).__name__}")
        known = {"method", *RING_KNOBS, "multi_stream"}
        extra = sorted(set(d) - known)
        if extra:
            raise StrategyError(extra[0], "unknown field")
        if "method" not in d:
            raise StrategyError("method", "missing field")
        if d["method"] == "baseline":
            return cls()
        if d["method"] in ("xla_windowed", "plain"):
            ring = sorted(set(d) & set(RING_KNOBS))
            if ring:
                raise StrategyError(ring[0], f"applies to method 'ring' only, not {d['method']!r}")
        return cls(**d)

    @classmethod
    def from_key(cls, key: str) -> Strategy:
        """The strategy a `key` names (`Strategy.from_key(s.key) == s`): `baseline`, `plain`,
        `xla_windowed[-ms]`, or `METHOD-DIRECTION-cCHUNKS-uUNROLL-FUSE-send|comp` for a ring or its
        `serial` control; StrategyError for anything else."""
        if key in ("baseline", "plain"):
            return cls(key)
        if key in ("xla_windowed", "xla_windowed-ms"):
            return cls("xla_windowed", multi_stream=key.endswith("-ms"))
        parts = str(key).split("-")
        if (len(parts) != 6 or parts[0] not in ("ring", "serial") or not parts[2].startswith("c")
                or not parts[3].startswith("u") or parts[5] not in ("send", "comp")):
            raise StrategyError("key", f"{key!r} is not a strategy key: expected baseline, plain, xla_windowed, "
                                       "or a ring's, such as ring-uni-c2-u1-loop-send")
        unroll, chunks = parts[3][1:], parts[2][1:]
        try:
            return cls.from_dict({"method": parts[0], "direction": parts[1], "chunks": int(chunks),
                                  "unroll": unroll if unroll == "full" else int(unroll), "fuse": parts[4],
                                  "send_first": parts[5] == "send"})
        except (TypeError, ValueError) as e:
            raise StrategyError("key", f"{key!r} is not a strategy key ({e})") from None

    @property
    def key(self) -> str:
        """Short stable name, e.g. `baseline`, `ring-bidi-c2-u1-loop-send` or `xla_windowed-ms`."""
        if self.method in ("baseline", "plain"):
            return self.method
        if self.method == "xla_windowed":
            return "xla_windowed-ms" if self.multi_stream else "xla_windowed"
        return (f"{self.method}-{self.direction}-c{self.chunks}-u{self.unroll}-{self.fuse}-"
                f"{'send' if self.send_first else 'comp'}")

    def __str__(self) -> str:
        return self.key


def reference(platform: str | None) -> Strategy:
    """The program a candidate must beat on `platform`, the one a session measures first and a
    winner's speedup is over: on TPU `plain` (what the user's `jax.jit` compiles to, XLA's own
    windowed einsum included where XLA decides so), elsewhere the hand-written `baseline`."""
    return Strategy.plain() if platform == "tpu" else Strategy.baseline()


_RING_DEFAULTS: dict[str, Any] = {"direction": "uni", "chunks": 1, "unroll": "full", "fuse": "loop",
                                  "send_first": True}


def parse_choice(strategy: Any, *, callables: bool = True) -> tuple[str, Any]:
    """The `strategy` argument of `overlap` and `collective_einsum(s)`, read in one place:
    ("auto", None) for "auto" (the client's answer); ("one", Strategy) for "baseline", "plain", a Strategy
    or its dict; ("callable", fn) for a callable `Problem -> Strategy` where `callables` allows it.
    Raises StrategyError for an invalid dict, ValueError for anything else (callers prefix their name)."""
    if isinstance(strategy, str):
        if strategy == "auto":
            return "auto", None
        if strategy in ("baseline", "plain"):
            return "one", Strategy(strategy)
    elif isinstance(strategy, Strategy):
        return "one", strategy
    elif isinstance(strategy, dict):
        return "one", Strategy.from_dict(strategy)
    elif callables and callable(strategy):
        return "callable", strategy
    what = "'auto', 'baseline', 'plain', a Strategy, its dict" + (" or a callable Problem -> Strategy" if callables else "")
    got = repr(strategy) if isinstance(strategy, str) else type(strategy).__name__
    raise ValueError(f"strategy must be {what}, got {got}")
