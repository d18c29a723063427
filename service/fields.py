"""Pydantic field types for the domain objects, validated by the domain code itself.

One source of truth: a request's ``problem`` is parsed by :meth:`autotuner.Problem.from_dict`,
its ``device`` by :meth:`autotuner.Device.from_dict` and a ``strategy`` by
:meth:`autotuner.Strategy.from_dict`. Their errors (``ProblemError`` etc.) become pydantic
validation errors of type ``problem_invalid`` / ``device_invalid`` / ``strategy_invalid``
whose ``ctx.path`` is the offending part (e.g. ``lhs.spec[1]``); the service's 422 handler
appends it to ``loc`` (see :mod:`service.errors`). The JSON schemas below only document the
shapes for OpenAPI; they validate nothing the domain code does not.

A compiler sends the same shapes again and again: each app parses through its own
:class:`ParseMemo` (``ServiceState.parse_memo``), which keeps the parsed objects by the JSON
text of the raw input, and their keys. Its :class:`ParseMemoMiddleware` makes it the memo of
the requests to that app (a context variable, set per request); outside a request, parsing is
not memoised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from contextvars import ContextVar
from typing import Annotated, Any

from pydantic import AfterValidator, Field, PlainSerializer, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError
from starlette.types import ASGIApp, Receive, Scope, Send

from autotuner import Device, DeviceError, Problem, ProblemError, Strategy, StrategyError
from autotuner.problem import GroupedProblem, problem_from_dict

__all__ = [
    "DEVICE_SCHEMA",
    "PROBLEM_SCHEMA",
    "STRATEGY_SCHEMA",
    "DeviceField",
    "JsonObject",
    "ParseMemo",
    "ParseMemoMiddleware",
    "ProblemField",
    "StrategyField",
    "Text",
    "check_json",
    "check_text",
    "field_path",
    "parse_device",
    "parse_problem",
    "parse_strategy",
]

MEMO_MAX = 65_536


def _memo_key(value: Any) -> str | None:
    # Key order kept: the order of mesh axes is part of a Problem (not of its canonical key).
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def _parse_problem(value: Any) -> Problem:
    problem = problem_from_dict(value)   # a grouped problem (an object with `einsums`) too
    try:
        problem.features()  # the numbers the database stores must be representable
    except OverflowError:
        raise ProblemError("lhs.shape", "sizes are too large (their products overflow a float)") from None
    return problem


class ParseMemo:
    """Problems and devices parsed from request JSON, by its text, and their keys: one per app.

    Each table holds at most ``max_entries`` and starts afresh when full. Thread-safe enough
    for its use: a lost entry is parsed again."""

    def __init__(self, max_entries: int = MEMO_MAX) -> None:
        self.max_entries = max_entries
        self._parsed: dict[tuple[type, str], Any] = {}
        self._keys: dict[Problem | Device, str] = {}

    def _remember(self, memo: dict[Any, Any], key: Any, value: Any) -> None:
        if len(memo) >= self.max_entries:
            memo.clear()
        memo[key] = value

    def _parse(self, kind: type, value: Any, parse: Any) -> Any:
        if isinstance(value, kind):
            return value
        mk = _memo_key(value)
        if mk is None:
            return parse(value)
        hit = self._parsed.get((kind, mk))
        if hit is None:
            hit = parse(value)
            self._remember(self._parsed, (kind, mk), hit)
        return hit

    def problem(self, value: Any) -> Problem:
        return self._parse(Problem, value, _parse_problem)  # type: ignore[no-any-return]

    def device(self, value: Any) -> Device:
        return self._parse(Device, value, Device.from_dict)  # type: ignore[no-any-return]

    def key(self, obj: Problem | Device) -> str:
        """``obj.key`` (THE canonical key of a problem, a device's fingerprint key)."""
        key = self._keys.get(obj)
        if key is None:
            key = obj.key
            self._remember(self._keys, obj, key)
        return key


_current: ContextVar[ParseMemo | None] = ContextVar("autotuner_parse_memo", default=None)


class ParseMemoMiddleware:
    """Pure ASGI middleware: the requests to this app parse through ``memo``."""

    def __init__(self, app: ASGIApp, memo: ParseMemo) -> None:
        self.app = app
        self.memo = memo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _current.set(self.memo)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)


def parse_problem(value: Any) -> Problem:
    """``Problem.from_dict(value)`` whose numbers the database can store; memoised in a request."""
    memo = _current.get()
    if memo is not None:
        return memo.problem(value)
    return value if isinstance(value, (Problem, GroupedProblem)) else _parse_problem(value)


def parse_device(value: Any) -> Device:
    """``Device.from_dict(value)``; memoised in a request."""
    memo = _current.get()
    if memo is not None:
        return memo.device(value)
    return value if isinstance(value, Device) else Device.from_dict(value)


def parse_strategy(value: Any) -> Strategy:
    if isinstance(value, Strategy):
        return value
    try:
        return Strategy.from_dict(value)
    except TypeError as e:  # e.g. a non-string key in the object
        raise StrategyError("method", str(e)) from None


_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def field_path(field: str) -> list[str | int]:
    """``"lhs.spec[1]"`` -> ``["lhs", "spec", 1]``."""
    out: list[str | int] = []
    for name, index in _PART.findall(field):
        out.append(int(index) if index else name)
    return out


def _validate_problem(value: Any) -> Problem:
    try:
        return parse_problem(value)
    except ProblemError as e:
        # "problem" names the whole object: no path below the field itself.
        path = "" if e.field == "problem" else e.field
        raise PydanticCustomError("problem_invalid", "{message}",
                                  {"path": path, "message": e.message}) from None


def check_text(value: str) -> str:
    """Text the databases can store: no NUL character, no lone surrogate."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


def check_json(value: Any, depth: int = 0) -> Any:
    """A JSON value every backend stores and returns as is: finite numbers, text as in
    :func:`check_text`, at most 32 levels deep."""
    if depth > 32:
        raise ValueError("is nested more than 32 levels deep")
    if isinstance(value, str):
        check_text(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("numbers must be finite")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k)
            check_json(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            check_json(v, depth + 1)
    return value


def _validate_device(value: Any) -> Device:
    if isinstance(value, dict):
        for name, v in value.items():
            if isinstance(v, str):
                try:
                    check_text(v)
                except ValueError as e:
                    raise PydanticCustomError("device_invalid", "{message}",
                                              {"path": str(name), "message": str(e)}) from None
    try:
        return parse_device(value)
    except DeviceError as e:
        path = "" if e.field == "device" else e.field
        raise PydanticCustomError("device_invalid", "{message}",
                                  {"path": path, "message": str(e).split(": ", 1)[-1]}) from None


def _validate_strategy(value: Any) -> Strategy:
    try:
        return parse_strategy(value)
    except StrategyError as e:
        raise PydanticCustomError("strategy_invalid", "{message}",
                                  {"path": e.field, "message": str(e).split(": ", 1)[-1]}) from None


# -- documentation schemas -------------------------------------------------------------------------

_AXES = {"type": "array", "items": {"type": "string"}}
_SPEC_ENTRY = {"anyOf": [{"type": "null"}, {"type": "string"}, _AXES]}
_SPEC = {"type": "array", "items": _SPEC_ENTRY, "maxItems": 12}
_SHAPE = {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1, "maxItems": 12}
_OPERAND = {
    "type": "object",
    "properties": {"shape": _SHAPE, "spec": _SPEC},
    "required": ["shape"],
    "additionalProperties": False,
}

PROBLEM_EXAMPLE = {
    "equation": "bsd,df->bsf",
    "lhs": {"shape": [8, 2048, 4096], "spec": [None, "x", None]},
    "rhs": {"shape": [4096, 16384], "spec": [None, "x"]},
    "out_spec": [None, None, "x"],
    "dtype": "bfloat16",
    "mesh": {"x": 8},
}

PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "description": "A sharded einsum (autotuner.Problem): global shapes, PartitionSpec-like specs "
                   "(null, an axis name or a list of names per dimension), the output spec, the "
                   "dtype and the mesh axes. Validated by Problem.from_dict. A grouped problem (one "
                   "all-gather feeding several einsums, autotuner.GroupedProblem) is accepted too: "
                   "{\"einsums\": [Problem, ...]}.",
    "type": "object",
    "properties": {
        "equation": {"type": "string", "examples": ["bsd,df->bsf"]},
        "lhs": _OPERAND,
        "rhs": _OPERAND,
        "out_spec": _SPEC,
        "dtype": {"type": "string", "enum": ["float32", "bfloat16", "float16"]},
        "mesh": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1},
                 "minProperties": 1},
    },
    "required": ["equation", "lhs", "rhs", "dtype", "mesh"],
    "additionalProperties": False,
    "examples": [PROBLEM_EXAMPLE],
}

_TEXT = {"type": "string", "minLength": 1, "maxLength": 200}
DEVICE_SCHEMA: dict[str, Any] = {
    "title": "Device",
    "description": "A device fingerprint (autotuner.Device). Validated by Device.from_dict.",
    "type": "object",
    "properties": {
        "platform": _TEXT,
        "device_kind": _TEXT,
        "num_devices": {"type": "integer", "minimum": 1},
        "num_processes": {"type": "integer", "minimum": 1},
        "topology": _TEXT,
        "jax_version": _TEXT,
        "jaxlib_version": _TEXT,
    },
    "required": ["platform", "device_kind", "num_devices", "num_processes", "topology",
                 "jax_version", "jaxlib_version"],
    "additionalProperties": False,
    "examples": [{"platform": "cpu", "device_kind": "cpu", "num_devices": 8, "num_processes": 1,
                  "topology": "inproc", "jax_version": "0.10.2", "jaxlib_version": "0.10.2"}],
}

def _strategy_schema() -> dict[str, Any]:
    """Built from ``autotuner.strategy`` itself, so new methods and knobs show up here."""
    from autotuner import strategy as st

    choices: dict[str, Any] = {
        "method": {"type": "string", "enum": list(st.METHODS)},
        "direction": {"type": "string", "enum": list(st.DIRECTIONS)},
        "chunks": {"type": "integer", "enum": list(st.CHUNKS)},
        "unroll": {"anyOf": [{"type": "integer", "enum": [u for u in st.UNROLLS if isinstance(u, int)]},
                             {"type": "string", "enum": [u for u in st.UNROLLS if isinstance(u, str)]}]},
        "fuse": {"type": "string", "enum": list(st.FUSES)},
    }
    props = {}
    for f in dataclasses.fields(st.Strategy):
        if f.name in choices:
            props[f.name] = choices[f.name]
        elif isinstance(f.default, bool):
            props[f.name] = {"type": "boolean"}
        else:
            props[f.name] = {}
    return {
        "title": "Strategy",
        "description": "How to run a problem (autotuner.Strategy); {\"method\": \"baseline\"} is "
                       "always valid. Validated by Strategy.from_dict.",
        "type": "object",
        "properties": props,
        "required": ["method"],
        "additionalProperties": False,
    }


STRATEGY_SCHEMA: dict[str, Any] = _strategy_schema()

ProblemField = Annotated[
    Problem,
    PlainValidator(_validate_problem),
    PlainSerializer(lambda p: p.to_dict(), return_type=dict),
    WithJsonSchema(PROBLEM_SCHEMA),
]
DeviceField = Annotated[
    Device,
    PlainValidator(_validate_device),
    PlainSerializer(lambda d: d.to_dict(), return_type=dict),
    WithJsonSchema(DEVICE_SCHEMA),
]
StrategyField = Annotated[
    Strategy,
    PlainValidator(_validate_strategy),
    PlainSerializer(lambda s: s.to_dict(), return_type=dict),
    WithJsonSchema(STRATEGY_SCHEMA),
]

# Free text and JSON objects stored as given (worker names, errors, params, memory stats).
TEXT_PATTERN = r"^[^\x00]*$"
Text = Annotated[str, Field(pattern=TEXT_PATTERN), AfterValidator(check_text)]
JsonObject = Annotated[dict[str, Any], AfterValidator(check_json)]
