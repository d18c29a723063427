"""Query parameters of the dashboard's pages, validated into frozen models.

The pages parse ``request.query_params`` themselves (instead of FastAPI ``Query`` parameters) so
a bad value gets a readable 400 page naming the parameter, not the API's JSON 422. Empty values
(``?device=`` from a form's "any" option) mean "not given"; unknown parameters are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlencode

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from autotuner.errors import AutotunerError
from service.field_types import check_text
from service.schemas import SortKey

__all__ = ["PER_PAGE", "BadParams", "OverviewParams", "ProblemRef", "TableParams", "parse",
           "parse_problem_ref"]

MAX_OFFSET = 2**31 - 1
PER_PAGE = (25, 50, 100, 200)


def _blank_is_none(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        return None
    return value.strip() if isinstance(value, str) else value


def _text(max_length: int) -> Any:
    value = Annotated[str, StringConstraints(max_length=max_length), AfterValidator(check_text)]
    return Annotated[value | None, BeforeValidator(_blank_is_none)]


DeviceKey = _text(128)


class BadParams(AutotunerError):
    """Invalid query parameters: ``errors`` are ``(parameter, message)`` pairs."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{p}: {m}" for p, m in errors))
        self.errors = errors


class _Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


P = TypeVar("P", bound=_Params)


class OverviewParams(_Params):
    device: DeviceKey = None


class TableParams(_Params):
    device: DeviceKey = None
    pattern: _text(64) = None  # type: ignore[valid-type]
    dtype: _text(32) = None  # type: ignore[valid-type]
    method: _text(64) = None  # type: ignore[valid-type]
    q: _text(256) = None  # type: ignore[valid-type]
    sort: Annotated[SortKey, BeforeValidator(lambda v: _blank_is_none(v) or "updated")] = "updated"
    order: Annotated[Literal["desc", "asc"],
                     BeforeValidator(lambda v: _blank_is_none(v) or "desc")] = "desc"
    page: Annotated[int, BeforeValidator(lambda v: _blank_is_none(v) or 1), Field(ge=1)] = 1
    per_page: Annotated[int, BeforeValidator(lambda v: _blank_is_none(v) or 50),
                        Field(ge=1, le=max(PER_PAGE))] = 50

    @property
    def offset(self) -> int:
        return (self.page - 1) * self.per_page

    def check(self) -> TableParams:
        if self.offset > MAX_OFFSET:
            raise BadParams([("page", f"must be at most {MAX_OFFSET // self.per_page + 1}")])
        return self

    def query(self, **changes: Any) -> str:
        """This table's query string with ``changes`` applied (defaults left out)."""
        values = {**self.model_dump(), **changes}
        defaults = TableParams().model_dump()
        kept = {k: v for k, v in values.items() if v is not None and v != defaults[k]}
        return "?" + urlencode(kept) if kept else ""

    def last_page(self, total: int) -> int:
        return max(1, math.ceil(total / self.per_page))


def parse(model: type[P], query: Mapping[str, str]) -> P:
    """``model`` from the query parameters, or :class:`BadParams`."""
    try:
        params = model.model_validate(dict(query))
    except ValidationError as e:
        errors = []
        for err in e.errors(include_url=False, include_input=False):
            loc = ".".join(str(x) for x in err.get("loc", ())) or "query"
            errors.append((loc, str(err.get("msg", "invalid value"))))
        raise BadParams(errors) from None
    if isinstance(params, TableParams):
        params.check()
    return params


class ProblemRef(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: int | None = None
    key: str | None = None


def parse_problem_ref(text: str) -> ProblemRef | None:
    """A problem page's path segment: a numeric id or a problem key; ``None`` if it is neither
    (the page answers 404: no such problem can exist)."""
    if text.isascii() and text.isdigit():
        value = int(text)
        return ProblemRef(id=value) if value <= MAX_OFFSET else None
    if 0 < len(text) <= 128 and all(c.isascii() and (c.isalnum() or c in "_-") for c in text):
        return ProblemRef(key=text)
    return None
