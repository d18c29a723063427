"""The repository: every query of the results database lives behind these functions.

Contract kept by every backend (SQLite, PostgreSQL):

- Every function takes an open :class:`~sqlalchemy.orm.Session` first and runs inside the
  caller's transaction; none commits. Use :func:`db.session_scope` (or
  ``Database.session()``), which commits, rolls back, and translates database errors into
  :class:`~db.errors.DuplicateError` / :class:`~db.errors.StorageError`.
- Inputs are plain values (keys, canonical dicts, features computed by the caller with
  ``autotuner.Problem``/``autotuner.Device``); invalid ones raise ``ValueError`` naming the
  field, missing referenced rows raise :class:`~db.errors.NotFoundError`.
- Results are frozen records (:mod:`db.records`), never ORM rows, detached from the session.
  Measurements never change once stored; winners are derived from them.
- Upserts (devices, problems, demand, winners) and job claims are safe under concurrency
  from many processes. On PostgreSQL take locks in one order to avoid deadlocks: devices,
  then problems by key, then winner recomputations by problem id; one transaction per
  (device, problem) batch is simplest.
- Engines and sessions are not shared across processes; a session is used by one thread.
"""

from __future__ import annotations

from db import _stats
from db._benches import get_model_bench, list_model_benches, record_model_bench
from db._calibrations import add_calibration, get_calibration, list_calibrations
from db._catalog import (
    get_device,
    get_device_by_key,
    get_problem,
    get_problem_by_key,
    list_devices,
    log_feature,
    upsert_device,
    upsert_problem,
)
from db._changes import Changes, changes_since, current_generation, note_change
from db._common import named_lock
from db._evidence import get_evidence, list_evidence, record_evidence
from db._failures import clear_failure, list_failures, record_failure
from db._listing import SORT_KEYS, list_problems
from db._nearest import nearest_winners, problem_groups, tuned_group, tuned_groups
from db._queue import (
    cancel_job,
    claim_job,
    enqueue_demand,
    enqueue_job,
    fail_abandoned,
    finish_job,
    get_job,
    heartbeat_job,
    list_demand,
    list_jobs,
    record_miss,
    record_misses,
    release_job,
    retry_job,
    trim_demand,
)
from db._results import (
    get_winner,
    get_winners,
    list_measurements,
    list_winners,
    recompute_winner,
    record_measurements,
)
from db._stats import *  # noqa: F403  - the dashboard's aggregates, as _stats.__all__ lists
from db._tokens import add_token, check_token, list_tokens, revoke_token, token_grant, token_hash
from db.apply_rule import choose_winner
from db.optuna_storage import OPTUNA_SCHEMA, ensure_optuna_schema, optuna_storage_url

__all__ = [
    "Changes",
    "OPTUNA_SCHEMA",
    "SORT_KEYS",
    "add_calibration",
    "add_token",
    "changes_since",
    "check_token",
    "choose_winner",
    "clear_failure",
    "current_generation",
    "cancel_job",
    "claim_job",
    "fail_abandoned",
    "enqueue_demand",
    "enqueue_job",
    "ensure_optuna_schema",
    "finish_job",
    "get_calibration",
    "get_device",
    "get_device_by_key",
    "get_evidence",
    "get_job",
    "get_model_bench",
    "get_problem",
    "get_problem_by_key",
    "get_winner",
    "get_winners",
    "heartbeat_job",
    "list_calibrations",
    "list_demand",
    "list_failures",
    "list_devices",
    "list_evidence",
    "list_jobs",
    "list_measurements",
    "list_model_benches",
    "named_lock",
    "note_change",
    "list_problems",
    "list_tokens",
    "list_winners",
    "log_feature",
    "nearest_winners",
    "optuna_storage_url",
    "record_evidence",
    "record_failure",
    "problem_groups",
    "record_measurements",
    "record_model_bench",
    "record_miss",
    "record_misses",
    "trim_demand",
    "recompute_winner",
    "release_job",
    "retry_job",
    "revoke_token",
    "token_grant",
    "token_hash",
    "tuned_group",
    "tuned_groups",
    "upsert_device",
    "upsert_problem",
    *_stats.__all__,
]
