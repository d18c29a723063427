"""Request dependencies as named ``Annotated`` aliases.

- ``StateDep``: the app's :class:`ServiceState` (settings, database, lookup engine, metrics,
  the memo of parsed request objects, the dashboard's static files, the watcher of changed
  winners).
- ``SessionDep``: a transactional session (commits when the route function returns, before the
  response is sent, so a failed commit is the response); ``ReadSessionDep``: the same for pure
  readers (SQLite: deferred BEGIN, runs beside a writer).
- ``WriteAuth`` / ``ReadAuth``: bearer-token checks (:mod:`service.auth`), declared in OpenAPI;
  ``ResultsAuth``: an upload's (a write or an in-job token), giving the route the token's grant.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from autotuner.settings import Settings
from db import Database
from service import auth
from service.coherence import ChangeWatcher
from service.field_types import ParseMemo
from service.lookups import LookupEngine
from service.metrics import Metrics

if TYPE_CHECKING:
    from service.dashboard.assets import Assets


@dataclass
class ServiceState:
    settings: Settings
    database: Database
    lookups: LookupEngine
    metrics: Metrics
    parse_memo: ParseMemo
    assets: Assets
    watcher: ChangeWatcher | None = None


async def get_state(request: Request) -> ServiceState:
    return request.app.state.autotuner  # type: ignore[no-any-return]


StateDep = Annotated[ServiceState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with state.database.session() as s:
        yield s


def get_read_session(state: StateDep) -> Iterator[Session]:
    with state.database.session(read_only=True) as s:
        yield s


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]

_bearer = HTTPBearer(auto_error=False, scheme_name="BearerToken",
                     description="AUTOTUNER_WRITE_TOKENS / AUTOTUNER_READ_TOKENS or a stored token")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _token(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return credentials.credentials if credentials is not None else None


async def write_auth(state: StateDep, credentials: Credentials) -> None:
    await auth.require("write", _token(credentials), state.settings, state.database)


async def read_auth(state: StateDep, credentials: Credentials) -> None:
    await auth.require("read", _token(credentials), state.settings, state.database)


async def results_auth(state: StateDep, credentials: Credentials) -> auth.Grant:
    return await auth.require("results", _token(credentials), state.settings, state.database)


WriteAuth = Annotated[None, Depends(write_auth)]
ReadAuth = Annotated[None, Depends(read_auth)]
ResultsAuth = Annotated[auth.Grant, Depends(results_auth)]   # a write token, or an in-job one
