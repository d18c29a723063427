"""The lookup fast path (service/fastpath.py) answers exactly what the FastAPI routes answer,
and leaves everything else to them."""

from __future__ import annotations

import json
from typing import Any

from service.routes.lookup import PROCESS_HEADER
from service.schemas import Lookup, LookupBatch
from service.testing import DEVICE, READ_HEADERS, READ_TOKEN, problem

ROUTES_ONLY = {"content-type": "application/x-routes+json"}  # a JSON type the fast path skips


def _both(client: Any, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> tuple[Any, Any]:
    raw = json.dumps(body)
    fast = client.post(path, content=raw, headers={"content-type": "application/json", **(headers or {})})
    slow = client.post(path, content=raw, headers={**ROUTES_ONLY, **(headers or {})})
    return fast, slow


def test_the_fast_path_answers_as_the_routes_do(client, post_results):
    post_results(client, problem())
    for p in (problem(), problem(64, 64, 64)):  # tuned, then default (no neighbour that close)
        fast, slow = _both(client, "/v1/lookup", {"device": DEVICE, "problem": p})
        assert fast.status_code == slow.status_code == 200
        assert fast.json() == slow.json()
        Lookup.model_validate(fast.json())
        assert fast.headers[PROCESS_HEADER] == slow.headers[PROCESS_HEADER]
    body = {"device": DEVICE, "problems": [problem(), problem(64, 64, 64), problem()]}
    fast, slow = _both(client, "/v1/lookup/batch", body)
    assert fast.status_code == slow.status_code == 200
    assert fast.json() == slow.json()
    assert [r.source for r in LookupBatch.model_validate(fast.json()).results] == \
        ["tuned", "default", "tuned"]
    metrics = client.get("/metrics").text  # both paths counted under the route templates
    assert 'route="/v1/lookup",status="200"} 4.0' in metrics
    assert 'route="/v1/lookup/batch",status="200"} 2.0' in metrics


def test_what_the_fast_path_does_not_answer_the_routes_do(client):
    cases = [
        ("/v1/lookup", {"device": DEVICE, "problem": problem(), "extra": 1}),
        ("/v1/lookup", {"device": DEVICE, "problem": {**problem(), "dtype": "float99"}}),
        ("/v1/lookup", {"device": {**DEVICE, "platform": "a\u0000b"}, "problem": problem()}),
        ("/v1/lookup/batch", {"device": DEVICE, "problems": []}),
        ("/v1/lookup/batch", {"device": DEVICE, "problems": [problem()] * 1001}),
        ("/v1/lookup", [1, 2]),
    ]
    for path, body in cases:
        fast, slow = _both(client, path, body)
        assert fast.status_code == slow.status_code == 422, (path, fast.text)
        assert fast.json() == slow.json()
    bad = client.post("/v1/lookup", content=b'{"device": NaN}', headers={"content-type": "application/json"})
    assert bad.status_code == 422


def test_read_tokens_are_checked_on_the_fast_path(make_client):
    client = make_client(read_tokens=[READ_TOKEN])
    body = {"device": DEVICE, "problem": problem()}
    assert client.post("/v1/lookup", json=body).status_code == 401
    assert client.post("/v1/lookup", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = client.post("/v1/lookup", json=body, headers=READ_HEADERS)
    assert ok.status_code == 200 and ok.json()["source"] == "default"
