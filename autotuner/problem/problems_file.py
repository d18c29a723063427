"""Reading problems files: one Problem, a list, JSON lines or YAML. Errors name file, item, field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autotuner.errors import AutotunerError
from autotuner.problem import GroupedProblem, Problem, ProblemError, problem_from_dict


class ProblemsFileError(AutotunerError, ValueError):
    """A problems file that cannot be used; the message names the file, the line or item, the field."""


def _load_yaml(text: str, path: Path) -> Any:
    import yaml

    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        raise ProblemsFileError(f"{path}: invalid YAML at {where}: {getattr(e, 'problem', e)}") from None


def _items(path: Path, text: str) -> list[tuple[str, Any]]:
    """(location, raw item) pairs, location like 'line 3' or 'item 2'."""
    suffix = path.suffix.lower()
    stripped = text.strip()
    if not stripped:
        raise ProblemsFileError(f"{path}: the file is empty; expected problems as JSON, JSONL or YAML")
    if suffix in (".yaml", ".yml"):
        docs = [d for d in _load_yaml(text, path) if d is not None]
        items = docs[0] if len(docs) == 1 and isinstance(docs[0], list) else docs
        return [(f"item {i}", d) for i, d in enumerate(items)]
    if suffix == ".jsonl" or (suffix != ".json" and "\n" in stripped and stripped[0] == "{"
                              and not _is_json(stripped)):
        out = []
        for no, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                out.append((f"line {no}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ProblemsFileError(f"{path}: line {no}: invalid JSON: {e.msg} (column {e.colno})") from None
        return out
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProblemsFileError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if isinstance(data, list):
        return [(f"item {i}", d) for i, d in enumerate(data)]
    if isinstance(data, dict) and isinstance(data.get("problems"), list):
        return [(f"problems[{i}]", d) for i, d in enumerate(data["problems"])]
    return [("item 0", data)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def load_problems(path: str | Path) -> list[Problem | GroupedProblem]:
    """Parse and validate every problem of the file (single einsums, and grouped ones: an object
    with `einsums`); nothing is returned unless all are valid."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ProblemsFileError(f"{p}: cannot read: {e.strerror or e}") from None
    out = []
    for where, raw in _items(p, text):
        try:
            out.append(problem_from_dict(raw))
        except ProblemError as e:
            raise ProblemsFileError(f"{p}: {where}: {e}") from None
    if not out:
        raise ProblemsFileError(f"{p}: no problems in the file")
    return out
