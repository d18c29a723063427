"""Pydantic field types for the domain objects, validated by the domain code itself.

One source of truth: a request's ``problem`` is parsed by :meth:`autotuner.Problem.from_dict`,
its ``device`` by :meth:`autotuner.Device.from_dict` and a ``strategy`` by
:meth:`autotuner.Strategy.from_dict`. Their errors (``ProblemError`` etc.) become pydantic
validation errors of type ``problem_invalid`` / ``device_invalid`` / ``strategy_invalid``
whose ``ctx.path`` is the offending part (e.g. ``lhs.spec[1]``); the service's 422 handler
appends it to ``loc`` (see :mod:`service.errors`). The JSON schemas below only document the
shapes for OpenAPI; they validate nothing the domain code does not.

Before the domain code sees a problem or a device, :func:`check_problem_input` and
:func:`check_device_input` hold every value a request can carry to the limits below (README
"Limits and bounds"), so that nothing larger is parsed, echoed in an error, kept or stored:
an equation of at most 256 characters (the ``problems.equation`` column), at most
:data:`MAX_MESH_AXES` mesh axes named in at most :data:`MAX_AXIS_NAME` characters, a dtype
of at most 32 characters (then one of ``autotuner.DTYPES`` or an alias), every size (a
dimension, a mesh axis, a device count) in 1..``db.fields.INT_MAX`` (the integer columns'
range on PostgreSQL), an operand of fewer than 2**63 elements, device texts within their
columns. A value outside them is a ``problem_invalid`` / ``device_invalid`` error naming it.

A compiler sends the same shapes again and again: each app parses through its own
:class:`ParseMemo` (``ServiceState.parse_memo``), which keeps the parsed objects by the JSON
text of the parsed input (whitespace and the body's layout play no part), and their keys,
within ``AUTOTUNER_PARSE_MEMO_ENTRIES`` / ``AUTOTUNER_PARSE_MEMO_BYTES`` per table (the oldest
go first). Its :class:`ParseMemoMiddleware` makes it the memo of the requests to that app (a
context variable, set per request); outside a request, parsing is not memoised.
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
from autotuner.problem.core import MAX_RANK
from autotuner.problem.grouped_problem import MAX_EINSUMS
from db import DeviceRecord, ProblemRecord
from db.fields import INT_MAX, fields_of
from service.bounded import BoundedDict, estimate

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
    "check_device_input",
    "check_json",
    "check_problem_input",
    "check_text",
    "field_path",
    "parse_device",
    "parse_problem",
    "parse_strategy",
]

MEMO_ENTRIES = 16_384  # the defaults of AUTOTUNER_PARSE_MEMO_ENTRIES / _BYTES
MEMO_BYTES = 32 * 2**20

# -- input limits (README "Limits and bounds") -----------------------------------------------------

MAX_EQUATION = fields_of(ProblemRecord, ("equation",))["equation"].max_len or 256
MAX_MESH_AXES = 16
MAX_AXIS_NAME = 64
MAX_DTYPE = 32
MAX_ELEMENTS = 2**63 - 1  # of one operand: its element count is an int64 everywhere
DEVICE_TEXT = {name: spec.max_len or 0 for name, spec in fields_of(DeviceRecord).items()
               if spec.kind is str and not spec.joined and name != "key"}
DEVICE_SIZES = ("num_devices", "num_processes")


def _size(value: Any, field_: str, error: type[ProblemError] | type[DeviceError]) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value > INT_MAX:
        raise error(field_, f"must be at most {INT_MAX}")


def check_problem_input(value: Any, where: str = "") -> None:
    """Raise ProblemError naming the field of the first value of a problem's JSON (a grouped
    problem's too) outside the input limits (module docs); the domain parser checks the rest."""
    if not isinstance(value, dict):
        return
    if "einsums" in value:  # a grouped problem (autotuner.problem.problem_from_dict)
        items = value["einsums"]
        for i, item in enumerate(items[: MAX_EINSUMS + 1] if isinstance(items, list) else ()):
            check_problem_input(item, f"{where}einsums[{i}].")
        return
    eq = value.get("equation")
    if isinstance(eq, str) and len(eq) > MAX_EQUATION:
        raise ProblemError(f"{where}equation", f"is {len(eq)} characters long; at most {MAX_EQUATION}")
    mesh = value.get("mesh")
    if isinstance(mesh, dict):
        if len(mesh) > MAX_MESH_AXES:
            raise ProblemError(f"{where}mesh", f"has {len(mesh)} axes; at most {MAX_MESH_AXES}")
        for name, size in mesh.items():
            if isinstance(name, str) and len(name) > MAX_AXIS_NAME:
                raise ProblemError(f"{where}mesh", f"an axis name is {len(name)} characters long; "
                                                   f"at most {MAX_AXIS_NAME}")
            _size(size, f"{where}mesh.{name}", ProblemError)
    for operand in ("lhs", "rhs"):
        shape = value.get(operand, {}).get("shape") if isinstance(value.get(operand), dict) else None
        if isinstance(shape, list) and len(shape) <= MAX_RANK:
            for i, d in enumerate(shape):
                _size(d, f"{where}{operand}.shape[{i}]", ProblemError)
            if all(isinstance(d, int) for d in shape) and math.prod(shape) > MAX_ELEMENTS:
                raise ProblemError(f"{where}{operand}.shape", f"has more than {MAX_ELEMENTS} elements")
    dtype = value.get("dtype")
    if isinstance(dtype, str) and len(dtype) > MAX_DTYPE:
        raise ProblemError(f"{where}dtype", f"is {len(dtype)} characters long; not a dtype")


def check_device_input(value: Any) -> None:
    """Raise DeviceError naming the first field of a device's JSON outside the input limits:
    texts longer than their columns, counts over ``INT_MAX``."""
    if not isinstance(value, dict):
        return
    for name, limit in DEVICE_TEXT.items():
        v = value.get(name)
        if isinstance(v, str) and len(v) > limit:
            raise DeviceError(name, f"is {len(v)} characters long; at most {limit}")
    for name in DEVICE_SIZES:
        _size(value.get(name), name, DeviceError)


def _memo_key(value: Any) -> str | None:
    # Key order kept: the order of mesh axes is part of a Problem (not of its canonical key).
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def _parse_problem(value: Any) -> Problem:
    check_problem_input(value)
    problem = problem_from_dict(value)   # a grouped problem (an object with `einsums`) too
    try:
        problem.features()  # the numbers the database stores must be representable
    except OverflowError:
        raise ProblemError("lhs.shape", "sizes are too large (their products overflow a float)") from None
    return problem


def _parse_device(value: Any) -> Device:
    check_device_input(value)
    return Device.from_dict(value)


class ParseMemo:
    """Problems and devices parsed from request JSON, by its text, and their keys: one per app.

    Each table holds at most ``max_entries`` entries and ``max_bytes`` bytes (estimated); the
    oldest go first."""

    def __init__(self, max_entries: int = MEMO_ENTRIES, max_bytes: int = MEMO_BYTES) -> None:
        self.max_entries = max_entries
        self._parsed: BoundedDict[tuple[type, str], Any] = BoundedDict(max_entries, max_bytes)
        self._keys: BoundedDict[Problem | Device, str] = BoundedDict(max_entries, max_bytes)

    def _parse(self, kind: type, value: Any, parse: Any) -> Any:
        if isinstance(value, kind):
            return value
        mk = _memo_key(value)
        if mk is None:
            return parse(value)
        hit = self._parsed.get((kind, mk))
        if hit is None:
            hit = parse(value)
            self._parsed.put((kind, mk), hit, estimate(len(mk)))
        return hit

    def problem(self, value: Any) -> Problem:
        return self._parse(Problem, value, _parse_problem)  # type: ignore[no-any-return]

    def device(self, value: Any) -> Device:
        return self._parse(Device, value, _parse_device)  # type: ignore[no-any-return]

    def key(self, obj: Problem | Device) -> str:
        """``obj.key`` (THE canonical key of a problem, a device's fingerprint key)."""
        key = self._keys.get(obj)
        if key is None:
            key = obj.key
            self._keys.put(obj, key, estimate(len(repr(obj))))
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
    return value if isinstance(value, Device) else _parse_device(value)


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
_SPEC = {"type": "array", "items": _SPEC_ENTRY, "maxItems": MAX_RANK}
_SIZE = {"type": "integer", "minimum": 1, "maximum": INT_MAX}
_SHAPE = {"type": "array", "items": _SIZE, "minItems": 1, "maxItems": MAX_RANK}
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
        "equation": {"type": "string", "maxLength": MAX_EQUATION, "examples": ["bsd,df->bsf"]},
        "lhs": _OPERAND,
        "rhs": _OPERAND,
        "out_spec": _SPEC,
        "dtype": {"type": "string", "enum": ["float32", "bfloat16", "float16"]},
        "mesh": {"type": "object", "additionalProperties": _SIZE, "minProperties": 1,
                 "maxProperties": MAX_MESH_AXES, "propertyNames": {"maxLength": MAX_AXIS_NAME}},
    },
    "required": ["equation", "lhs", "rhs", "dtype", "mesh"],
    "additionalProperties": False,
    "examples": [PROBLEM_EXAMPLE],
}

DEVICE_SCHEMA: dict[str, Any] = {
    "title": "Device",
    "description": "A device fingerprint (autotuner.Device). Validated by Device.from_dict.",
    "type": "object",
    "properties": {
        **{name: {"type": "string", "minLength": 1, "maxLength": n} for name, n in DEVICE_TEXT.items()},
        **{name: _SIZE for name in DEVICE_SIZES},
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
