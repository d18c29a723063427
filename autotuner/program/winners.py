"""Where `plan` and `bench-model` get the tuned winners: a results database (--db), a service
(--service, its /v1/snapshot), or a snapshot file (--snapshot); none of them: the configured
service (AUTOTUNER_SERVICE_URL), else no client (every pair stays baseline).

Every source is read as one snapshot (`autotuner.snapshot`), answered offline by a `Client` for
one device fingerprint: --device (a key, a key prefix or a label such as
`cpu:cpux4/lab-shared-2gbit`), else the one device of the snapshot with winners for the program's
mesh size. Not a command group (it registers nothing).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotuner.program.console import db_url, fail, open_database

SOURCE_HELP = ("winners from the results database (--db URL), a service (--service URL) or a snapshot file "
               "(--snapshot); none given: AUTOTUNER_SERVICE_URL if set, else the results database "
               "(AUTOTUNER_DB_URL, else ./autotuner.db) where it exists, else none (every pair baseline)")


def _from_db(url: str) -> dict[str, Any]:
    from autotuner import snapshot
    from db import SchemaError
    from db import repository as repo

    try:
        database = open_database(db_url(url), create=False)
    except SchemaError as e:
        fail(str(e))
    with database.session(read_only=True) as s:
        devices = [{k: getattr(d, k) for k in snapshot.DEVICE_FIELDS} for d in repo.list_devices(s)]
        entries = [snapshot.Entry.of(w).to_json() for w in repo.list_winners(s)]
        evidence = [snapshot.evidence_json(e) for e in repo.list_evidence(s)]
    database.engine.dispose()
    return snapshot.document(devices, entries, evidence=evidence)


def _from_service(url: str) -> dict[str, Any]:
    import httpx

    from autotuner.settings import get_settings

    token = get_settings().service_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/snapshot", headers=headers, timeout=30.0)
        r.raise_for_status()
        return dict(r.json())
    except (httpx.HTTPError, ValueError) as e:
        fail(f"--service {url}: cannot read its snapshot: {e}")
    raise AssertionError("unreachable")


def _label(d: dict[str, Any]) -> str:
    return f"{d['platform']}:{d['device_kind']}x{d['num_devices']}/{d.get('topology') or ''}"


def _pick_device(doc: dict[str, Any], wanted: str | None, n: int, prefer: str | None = None) -> Any:
    from autotuner.snapshot import SnapshotError, device_of

    devices = [d for d in doc.get("devices") or [] if isinstance(d, dict)]
    with_winners = {e.get("device_key") for e in doc.get("entries") or [] if isinstance(e, dict)}
    if wanted:
        hits = [d for d in devices if d.get("key") == wanted or str(d.get("key", "")).startswith(wanted)
                or _label(d) == wanted]
        if len(hits) != 1:
            known = ", ".join(f"{_label(d)} ({str(d.get('key'))[:12]})" for d in devices) or "none"
            fail(f"--device {wanted!r} matches {len(hits)} device(s) of the winners; known: {known}")
    else:
        hits = [d for d in devices if d.get("key") in with_winners and d.get("num_devices") == n]
        if prefer and any(d.get("key") == prefer for d in hits):
            hits = [d for d in hits if d.get("key") == prefer]
        if len(hits) > 1:
            fail(f"the winners hold {len(hits)} devices of {n} devices: "
                 + ", ".join(f"{_label(d)} ({str(d['key'])[:12]})" for d in hits) + "; pick one with --device")
        if not hits:
            return None
    try:
        return device_of(hits[0])
    except SnapshotError as e:
        fail(f"the winners' {e}")


@dataclass
class Winners:
    client: Any             # a Client, or None (every pair baseline under auto)
    where: str              # a line saying where the winners come from
    snapshot: str | None = None   # the snapshot file the client answers from
    device: Any = None            # the Device whose winners it answers

    def said(self, strategy: Any) -> str:
        """The line a command prints of its winners: where they come from, or, where `--strategy`
        names one strategy for every pair, that they go unused."""
        if strategy == "auto":
            return self.where
        return f"--strategy {strategy if isinstance(strategy, str) else strategy.key} for every pair: no winners used"


def _default_db() -> str | None:
    """The results database `--db` means by default (AUTOTUNER_DB_URL, else ./autotuner.db), where
    it exists: a SQLite file that is there, or any other URL the environment names."""
    import os

    url = db_url(None)
    if not url.startswith("sqlite:///"):
        return url
    return url if os.environ.get("AUTOTUNER_DB_URL") or Path(url.removeprefix("sqlite:///")).is_file() else None


def make_client(*, db: str | None, service: str | None, snapshot: str | None, device: str | None,
                n: int, tmpdir: str, prefer: str | None = None) -> Winners:
    """The client for the winners source given (see the module docs); `prefer`: the device key
    to pick when several hold winners for `n` devices (the target's own)."""
    given = [x for x in (db, service, snapshot) if x]
    if len(given) > 1:
        fail("give at most one of --db, --service, --snapshot")
    if not given:
        from autotuner.runtime.client import default_client

        c = default_client()
        if c is not None:
            if device:
                fail("--device needs --db, --service or --snapshot (the configured service answers for this host)")
            return Winners(c, "winners from the configured service")
        db = _default_db()
        if db is None:
            if device:
                fail("--device needs --db, --service or --snapshot")
            return Winners(None, "no winners source (--db, --service, --snapshot, or ./autotuner.db): every pair "
                                 "stays baseline")
    from autotuner.snapshot import SnapshotError, check, load

    where = f"--db {db}" if db else f"--service {service}" if service else f"--snapshot {snapshot}"
    try:
        doc = _from_db(db) if db else check(_from_service(service), "its answer") if service else load(snapshot)
    except SnapshotError as e:
        fail(f"{where}: {e}")
    dev = _pick_device(doc, device, n, prefer)
    if dev is None:
        return Winners(None, f"{where} holds no winners for {n} devices: every pair stays baseline")
    from autotuner.runtime.client import Client, ClientError

    path = Path(tempfile.mkstemp(suffix=".json", dir=tmpdir)[1])
    path.write_text(json.dumps(doc))
    try:
        client = Client(offline=path, device=dev)
    except ClientError as e:
        fail(f"{where}: {e}")
    entries = sum(1 for e in doc.get("entries") or [] if e.get("device_key") == dev.key)
    return Winners(client, f"winners from {where}, device {dev.label} ({dev.key[:12]}, {entries} winner(s))",
                   str(path), dev)
