"""What the project writes and reads back: a write is whole (temp file, fsync, rename) and a
read of any other byte string is a miss, never an exception."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from autotuner.files import write_atomic
from autotuner.hlo.compile import _load, keep_json


def test_a_write_is_whole_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "kept.json"
    write_atomic(target, "old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["kept.json"]
    # a directory that is not there: nothing written, nothing left, and the error names the file
    # asked for (it named the temp file, `.x.json.PID.THREAD.tmp`, in `db export`'s message)
    with pytest.raises(FileNotFoundError) as e:
        write_atomic(tmp_path / "missing" / "x.json", "data")
    assert e.value.filename == str(tmp_path / "missing" / "x.json")
    assert os.listdir(tmp_path) == ["kept.json"]


@pytest.mark.parametrize("cut", ["truncated", "garbage", "not-gzip", "wrong-json", "empty"])
def test_a_kept_texts_file_that_is_not_what_was_kept_is_a_miss(tmp_path, cut):
    """A host whose kept partitioned texts were cut short by a crash (`EOFError` from gzip,
    once uncaught: that host ran plain jit on every restart) reads them as a miss."""
    keep_json(str(tmp_path / "k.json.gz"), {"pre": "a", "post": "b", "parts": 2, "temp_bytes": 7}, "texts")
    assert _load(str(tmp_path), "k") == ("a", "b", 2, 7)
    whole = (tmp_path / "k.json.gz").read_bytes()
    data = {"truncated": whole[: len(whole) // 2], "garbage": b"\x1f\x8b\x08\x00garbage" * 3,
            "not-gzip": b'{"pre": "a"}', "wrong-json": gzip.compress(json.dumps([1, 2]).encode()),
            "empty": b""}[cut]
    (tmp_path / "k.json.gz").write_bytes(data)
    assert _load(str(tmp_path), "k") is None
