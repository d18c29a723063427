"""Agree: one plan per program for a whole multi-process job, or plain jit on every process.

A multi-process job compiles one SPMD program; two processes that rewrite it differently run
collectives that do not match, and the job hangs. So the pass's decisions are process 0's: each
process chooses as it can (its own client, evidence and memory figures, none shared), then, before
each compile, process 0 publishes its plan (`Plan` below: the actions to apply and the rows as it
chose them) through jax.distributed's key-value store and every other process applies exactly that
plan. A process 0 that falls back publishes "plain", and the others fall back with it.

At the end every process publishes a digest of what it runs (`digest`) and reads everyone's: one
that differs, or is missing after `TIMEOUT_S`, sends every process to plain jit, with one line
naming the rank and the cause. The keys count preparations per process (`next_job_key`), the same
count on every process, since every process prepares the same signatures in the same order.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from typing import Any

log = logging.getLogger("autotuner.overlap")

TIMEOUT_S = 600.0   # the longest a process waits for another's plan or digest
PREFIX = "autotuner/plan/v1"

_count = itertools.count()
_count_lock = threading.Lock()


class AgreeError(RuntimeError):
    """The processes of a job could not agree on a plan (another process's is missing or differs)."""


def processes() -> tuple[int, int]:
    """(this process's index, how many processes the job has)."""
    import jax

    return jax.process_index(), jax.process_count()


def next_job_key() -> str:
    """The key prefix of this process's next preparation in a multi-process job."""
    with _count_lock:
        return f"{PREFIX}/{next(_count)}"


def _kv() -> Any:
    from autotuner.runtime.collective import _kv_client

    kv = _kv_client()
    if kv is None:
        raise AgreeError("no jax.distributed key-value store: the processes cannot agree on a plan")
    return kv


def publish(name: str, doc: Any) -> None:
    _kv().key_value_set(name, json.dumps(doc), allow_overwrite=True)


def receive(name: str, what: str, timeout_s: float = TIMEOUT_S) -> Any:
    """The document published under `name`; AgreeError if none comes within `timeout_s`."""
    try:
        return json.loads(_kv().blocking_key_value_get(name, int(timeout_s * 1000)))
    except AgreeError:
        raise
    except Exception as e:  # noqa: BLE001 - a timeout, a dead coordinator: no agreement
        raise AgreeError(f"no {what} within {timeout_s:g} s ({type(e).__name__}: {str(e)[:200]})") from None


def digest(rows: Any, plain: bool) -> str:
    """What a process runs, in 16 hex digits: "plain", or the pairs it rewrites and how."""
    if plain:
        return "plain"
    what = [[r.name, r.strategy.key, r.applied, r.served_by] for r in rows]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def everyone(job_key: str, mine: str, rank: int, count: int, timeout_s: float = TIMEOUT_S) -> str | None:
    """Publish this process's digest and read every process's: None where all are equal, else why
    not (the first rank that differs or is missing, and how)."""
    publish(f"{job_key}/digest/{rank}", mine)
    for other in range(count):
        if other == rank:
            continue
        try:
            theirs = receive(f"{job_key}/digest/{other}", f"digest from process {other}", timeout_s)
        except AgreeError as e:
            return f"process {other}: {e}"
        if theirs != mine:
            return f"process {other} runs {theirs}, process {rank} {mine}"
    return None
