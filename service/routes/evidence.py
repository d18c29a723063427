"""GET /v1/evidence: in-program evidence (`autotuner tune-model`) of one device and program, which
`overlap` prefers to the isolated winners for that program."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter

from autotuner.snapshot import evidence_json
from db import repository as repo
from service.deps import ReadAuth, ReadSessionDep
from service.routes._common import READ, responses, text_query

router = APIRouter(tags=["snapshot"])


@router.get("/v1/evidence", responses=responses(*READ))
def evidence(
    _: ReadAuth,
    s: ReadSessionDep,
    device_key: Annotated[str, text_query("the device key", 128)],
    program_key: Annotated[str, text_query("the program key (`Plan.program`)", 64)],
) -> dict[str, Any]:
    """`{"evidence": [...]}`: the newest evidence of each problem of the program on the device, in
    the snapshot's `evidence` form; an empty list where there is none."""
    return {"evidence": [evidence_json(e) for e in repo.get_evidence(s, device_key, program_key)]}
