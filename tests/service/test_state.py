"""What an app owns: its parse memo and its static files (no module-level memo shared by apps)."""

from __future__ import annotations

import gc
import pickle

from autotuner import Problem
from service.field_types import ParseMemo, parse_problem
from service.testing import DEVICE, problem


def test_requests_parse_through_their_apps_memo(make_client):
    a, b = make_client(), make_client()
    memo_a, memo_b = (c.app.state.autotuner.parse_memo for c in (a, b))
    assert memo_a is not memo_b and not memo_a._parsed and not memo_b._parsed
    body = {"device": DEVICE, "problem": problem()}
    # lookups: the fast path (service/fastpath.py) remembers each body parsed, per app
    fast_a, fast_b = a.app.fast_path, b.app.fast_path
    assert a.post("/v1/lookup", json=body).status_code == 200
    assert len(fast_a._memo) == 1 and not fast_b._memo
    (_, (parsed,), _, (pkey,)), = (pickle.loads(v) for v in fast_a._memo.values())
    assert a.post("/v1/lookup", json=body).status_code == 200
    assert len(fast_a._memo) == 1
    assert memo_a.key(parsed) == parsed.key == pkey == Problem.from_dict(problem()).key
    # the routes: through the app's memo (the problem and the device)
    assert a.post("/v1/jobs", json=body).status_code in (201, 401)
    assert a.post("/v1/lookup", json={**body, "x": 1}).status_code == 422  # the routes answer it
    assert len(memo_a._parsed) == 2 and not memo_b._parsed
    again = memo_a.problem(problem())
    assert memo_a.problem(problem()) is again
    # outside a request nothing is memoised
    assert parse_problem(problem()) is not parse_problem(problem())


def test_the_lookup_caches_hold_nothing_the_garbage_collector_tracks(make_client):
    """The fast path's memo and the answer cache hold strings, bytes and floats: a full
    collection never traverses them however full they are (as objects, they made its pauses
    the service's p99)."""
    c = make_client()
    for m in (64, 128, 256):
        assert c.post("/v1/lookup", json={"device": DEVICE, "problem": problem(m)}).status_code == 200
    assert c.post("/v1/lookup/batch", json={"device": DEVICE, "problems": [problem(512), problem(1024)]}
                  ).status_code == 200
    gc.collect()  # a tuple of untracked values is untracked by the collection that meets it
    fast, answers = c.app.fast_path, c.app.state.autotuner.lookups._answers
    assert len(fast._memo) == 3 and len(fast._batch_memo) == 1 and len(answers) == 5
    for table in (fast._memo, fast._batch_memo, answers):
        assert not any(gc.is_tracked(k) or gc.is_tracked(v) for k, v in table.items())


def test_the_memo_is_bounded():
    memo = ParseMemo(max_entries=2)
    first = memo.problem(problem(1024))
    memo.problem(problem(2048))
    assert memo.problem(problem(1024)) is first
    memo.problem(problem(4096))  # full: starts afresh
    assert memo.problem(problem(1024)) is not first
    assert memo.problem(Problem.from_dict(problem(64))) == Problem.from_dict(problem(64))


def test_each_app_has_its_own_static_files(make_client):
    a, b = make_client(), make_client()
    assets_a, assets_b = (c.app.state.autotuner.assets for c in (a, b))
    assert assets_a is not assets_b
    assert a.get("/static/dashboard.css").status_code == 200
    assert set(assets_a._loaded) == {"dashboard.css"} and not assets_b._loaded
    assert assets_a.get("nope.js") is None
