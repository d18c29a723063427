"""Every file the project reads back takes any byte string as a miss, never an exception
(issue 39 item 3), property-tested: the partitioned texts and the pairs kept beside JAX's cache
(`hlo.compile._load`, `overlap.find._load_found`), the client's disk cache
(`runtime.answers.DiskCache`) and an offline snapshot (`Client(offline=...)`). Inputs: arbitrary
bytes, the same gzip-wrapped (the kept texts' container), and arbitrary JSON documents (a file
that parses but is not what was written: an older version, a hand edit)."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotuner import Device, Problem
from autotuner.hlo import compile as hc
from autotuner.overlap import find
from autotuner.runtime.answers import DiskCache
from autotuner.runtime.client import Client
from service.testing import problem

DEVICE = Device(platform="cpu", device_kind="cpu", num_devices=8, num_processes=1, topology="readback-test",
                jax_version="0.10.2", jaxlib_version="0.10.2")
PROBLEM = Problem.from_dict(problem())

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
                    max_leaves=20)
# what a kept file may hold: bytes, bytes in gzip, a JSON document (bare, or gzip-wrapped),
# a document of the right keys with values of any kind
CONTENT = st.one_of(
    st.binary(max_size=512),
    st.binary(max_size=512).map(gzip.compress),
    JSON.map(lambda d: json.dumps(d).encode()),
    JSON.map(lambda d: gzip.compress(json.dumps(d).encode())),
    st.fixed_dictionaries({k: JSON for k in ("pre", "post", "parts", "temp_bytes")})
      .map(lambda d: gzip.compress(json.dumps(d).encode())),
    st.fixed_dictionaries({k: JSON for k in ("sites", "rows", "notes", "added")}).map(lambda d: json.dumps(d).encode()),
)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _write(data: bytes, name: str) -> tuple[tempfile.TemporaryDirectory[str], Path]:
    d = tempfile.TemporaryDirectory(prefix="readback-")
    path = Path(d.name) / name
    path.write_bytes(data)
    return d, path


@SETTINGS
@given(CONTENT)
def test_kept_partitioned_texts(data: bytes) -> None:
    d, path = _write(data, "k.json.gz")
    with d:
        got = hc._load(str(path.parent), "k")
        assert got is None or (isinstance(got[0], str) and isinstance(got[2], int))


@SETTINGS
@given(CONTENT)
def test_kept_pairs(data: bytes) -> None:
    d, path = _write(data, "k.found.json")
    with d:
        assert find._load_found(str(path), SimpleNamespace(infos={})) is None   # type: ignore[arg-type]


@SETTINGS
@given(st.lists(CONTENT, max_size=3))
def test_the_clients_disk_cache(lines: list[bytes]) -> None:
    d, path = _write(b"\n".join(lines), f"lookups-{DEVICE.key}.jsonl")
    with d:
        got: Any = DiskCache(path.parent).get(DEVICE.key, PROBLEM.key)
        assert got is None or got.problem_key == PROBLEM.key


@SETTINGS
@given(CONTENT)
def test_an_offline_snapshot(data: bytes) -> None:
    d, path = _write(data, "snapshot.json")
    with d:
        answer = Client(offline=str(path), device=DEVICE).lookup(PROBLEM)
        assert answer.problem_key == PROBLEM.key and answer.strategy is not None
