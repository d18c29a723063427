"""Files the project writes and reads back (the kept texts and pairs beside JAX's cache, snapshot
files, the lookup cache): a write is whole or not at all and survives a crash; a read of a file
that is not what was written (truncated, garbage, another format) is the caller's miss.

Pure standard library: the training job imports it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """`data` at `path`, whole or not at all, durable: written to a temp file of this process and
    thread beside it, flushed and fsynced, renamed over `path`, and the directory fsynced so that
    the rename survives a crash too. Raises OSError naming `path` (the temp file is removed)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.filename == str(tmp):   # say the file asked for, not ours
            raise OSError(e.errno, e.strerror, str(target)) from None
        raise
    with contextlib.suppress(OSError):   # not every filesystem lets a directory be opened or synced
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
