"""API fuzzing: schemathesis generates requests from the app's own OpenAPI schema, valid and
invalid ones, with and without a write token; no response may be a server error, and every
documented response must match its schema.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from autotuner.settings import Settings
from service import create_app
from service.testing import DEVICE, WRITE_HEADERS, WRITE_TOKEN, measurements, problem

EXAMPLES = 25      # per operation and generation mode
MIN_CASES = 500


@pytest.fixture
def app(sqlite_url: str, testclient_cls: Any) -> Any:
    application = create_app(Settings(db_url=sqlite_url, write_tokens=[WRITE_TOKEN], max_batch=50))
    # some records, so that reads and job calls find something
    with testclient_cls(application) as c:
        for i in range(3):
            c.post("/v1/results", headers=WRITE_HEADERS,
                   json={"device": DEVICE, "problem": problem(1024 * (i + 1)), "measurements": measurements()})
        c.post("/v1/jobs", headers=WRITE_HEADERS, json={"device": DEVICE, "problem": problem()})
    yield application
    schemathesis.python.asgi.shutdown_lifespans()


@pytest.mark.slow
def test_no_server_errors(app: Any) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    seen: collections.Counter[tuple[str, int]] = collections.Counter()

    def fuzz(operation: Any, mode: GenerationMode) -> None:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode), authorized=st.booleans())
        def check(case: Any, authorized: bool) -> None:
            headers = dict(WRITE_HEADERS) if authorized else None
            response = case.call(headers=headers)
            seen[(operation.label, response.status_code)] += 1
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance],
                                   headers=headers)

        try:
            check()
        except Unsatisfiable:
            # nothing to get wrong (e.g. GET /healthz has no parameters): no negative cases
            assert mode is GenerationMode.NEGATIVE, operation.label

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            t = time.perf_counter()
            fuzz(operation, mode)
            print(f"{operation.label} {mode.value}: {time.perf_counter() - t:.1f} s")

    total = sum(seen.values())
    print("fuzz cases:", total, sorted(collections.Counter(st for (_, st) in seen.elements()).items()))
    statuses = collections.Counter(status for (_, status) in seen.elements())
    assert total >= MIN_CASES, (total, statuses)
    assert all(status < 500 for status in statuses), statuses
    # the fuzzing reached the handlers, not only the validation layer
    assert statuses[200] + statuses[201] > 50, statuses
    assert statuses[422] > 50, statuses
