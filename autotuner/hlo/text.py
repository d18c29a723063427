"""The HLO text of one module, parsed: computations, instructions, their shapes and attributes."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from autotuner.errors import AutotunerError

log = logging.getLogger(__name__)

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
PASS_THROUGH = frozenset({"copy", "convert", "bitcast", "reshape", "transpose"})


class ExtractError(AutotunerError, RuntimeError):
    """The program could not be compiled or its partitioned HLO could not be obtained."""


# -- HLO text ------------------------------------------------------------------------------------

@dataclass
class Instr:
    name: str
    etype: str | None                # element type (f32, s32, ...); None for tuples / tokens
    shape: tuple[int, ...] | None    # None for tuples
    opcode: str
    operands: list[str]
    operand_text: str
    attr_text: str                   # what follows the operands, as written; `attrs` parses it
    computation: str

    @functools.cached_property
    def attrs(self) -> dict[str, str]:
        """The attributes (key=value after the operands), parsed on first use: most instructions'
        are never read, and splitting them was a third of parsing a large module."""
        attrs: dict[str, str] = {}
        last = None
        for item in _split_top(self.attr_text):
            if "=" in item:
                k, v = item.split("=", 1)
                k = k.strip()
                attrs[k] = v.strip()
                last = k
            elif last is not None:
                attrs[last] += ", " + item
        return attrs

    def attr_ints(self, key: str) -> tuple[int, ...]:
        v = self.attrs.get(key)
        if v is None:
            return ()
        return tuple(int(t) for t in re.findall(r"-?\d+", v))

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs.get("metadata", ""))
        return m.group(1) if m else ""

    @property
    def stack_frame(self) -> str:
        m = re.search(r"stack_frame_id=(\d+)", self.attrs.get("metadata", ""))
        return m.group(1) if m else ""


@dataclass
class HloModule:
    name: str
    num_partitions: int
    instrs: dict[str, Instr]
    order: list[str]
    computations: dict[str, list[str]]
    users: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in self.order:
            for o in self.instrs[n].operands:
                if o in self.instrs:
                    self.users.setdefault(o, []).append(n)

    def op(self, name: str) -> Instr | None:
        return self.instrs.get(name)

    def source(self, name: str) -> Instr | None:
        """What `name` is a relayout of: the first producer up its chain of `PASS_THROUGH` ops."""
        cur = self.op(name)
        while cur is not None and cur.opcode in PASS_THROUGH and cur.operands:
            cur = self.op(cur.operands[0])
        return cur

    def arguments(self, dot: Instr) -> list[str]:
        """The op_names of the program arguments `dot` multiplies, where JAX wrote their paths, ''
        for the others: first those of the first dot from the same source line (`stack_frame`: the
        forward dot that a weight's gradient, whose operands are computed values or the input, is
        the transpose of), then per operand of `dot` the argument it is (`argument`), last, so that
        of two paths alike its own wins (`names.dot_label`: a line that multiplies several weights
        in a loop has one stack frame)."""
        return self._frame_arguments.get(dot.stack_frame, []) + self._operand_arguments(dot)

    def _operand_arguments(self, dot: Instr) -> list[str]:
        out = []
        for o in dot.operands:
            src = self.argument(o)
            out.append(src.op_name if src is not None else "")
        return out

    def argument(self, name: str) -> Instr | None:
        """The program parameter `name` is, None where it is computed: followed up relayouts
        (`PASS_THROUGH`), slices (a scanned layer's weights are one slice of a stacked argument per
        iteration) and a while loop's state that its body passes on unchanged (where a scan keeps
        its stacked arguments) to the loop's initial value."""
        cur = self.op(name)
        for _ in range(len(self.order)):
            if cur is None or cur.opcode == "parameter" and cur.computation not in self.loops:
                return cur
            if cur.opcode in PASS_THROUGH or cur.opcode == "dynamic-slice":
                cur = self.op(cur.operands[0]) if cur.operands else None
            elif cur.opcode == "get-tuple-element" and cur.operands:
                cur = self._element(cur)
            else:
                return None
        return None

    def _element(self, gte: Instr) -> Instr | None:
        """The value a get-tuple-element takes: the element of a tuple, through optimization
        barriers (what remat puts around a rematerialized computation's inputs), else of a loop
        body's state (`_loop_input`)."""
        src, k = self.op(gte.operands[0]), gte.attr_ints("index")
        while src is not None and src.opcode == "opt-barrier" and src.operands:
            src = self.op(src.operands[0])
        if src is None or len(k) != 1:
            return None
        if src.opcode == "tuple":
            return self.op(src.operands[k[0]]) if k[0] < len(src.operands) else None
        return self._loop_input(src, k[0]) if src.opcode == "parameter" and src.name == gte.operands[0] else None

    def _loop_input(self, param: Instr, k: int) -> Instr | None:
        """What element `k` of a while body's state (`param`, the body's parameter) is on entry to
        the loop, where every iteration passes it on unchanged; None otherwise (not a loop body,
        or a value the loop carries)."""
        loop = self.loops.get(param.computation)
        body = self.computations.get(param.computation, [])
        if loop is None or not loop.operands or not body:
            return None
        root = self.op(body[-1])
        out = self.op(root.operands[k]) if root is not None and root.opcode == "tuple" and k < len(root.operands) else None
        if out is None or out.opcode != "get-tuple-element" or out.operands[:1] != [param.name] \
                or out.attr_ints("index") != (k,):
            return None   # carried: changed by the loop
        init = self.op(loop.operands[0])
        return self.op(init.operands[k]) if init is not None and init.opcode == "tuple" and k < len(init.operands) else None

    @functools.cached_property
    def loops(self) -> dict[str, Instr]:
        """Each while loop's body computation -> the loop."""
        out = {}
        for n in self.order:
            ins = self.instrs[n]
            if ins.opcode == "while":
                out[ins.attrs.get("body", "").lstrip("%")] = ins
        return out

    @functools.cached_property
    def _frame_arguments(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in self.order:
            ins = self.instrs[n]
            if ins.opcode == "dot" and ins.stack_frame and ins.stack_frame not in out:
                args = self._operand_arguments(ins)
                if any(args):
                    out[ins.stack_frame] = args
        return out


_CLOSE = {"(": ")", "[": "]", "{": "}"}
_SPECIAL = re.compile(r"[\"'\\()\[\]{},]")   # the characters the scanners below act on


def _structural(text: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """(index, character) of each bracket and comma of `text` from `start` that is outside quotes
    (a backslash escapes the next character inside quotes): what both scanners below act on."""
    quote, skip = None, -1
    for m in _SPECIAL.finditer(text, start):
        j = m.start()
        if j == skip:
            continue
        c = text[j]
        if quote:
            if c == "\\":
                skip = j + 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        else:
            yield j, c


def _match(text: str, i: int) -> int:
    """Index just past the bracket that closes the one at text[i] (quotes respected)."""
    stack: list[str] = []
    for j, c in _structural(text, i):
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"unbalanced brackets in {text[i:i + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas not nested in brackets or quotes."""
    out: list[str] = []
    depth, start = 0, 0
    for i, c in _structural(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_TYPE = re.compile(r"^([a-z][a-z0-9]*)\[([^\]]*)\](?:\{[^}]*\})?")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_OPCODE = re.compile(r"([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_NESTED = re.compile(r"[\"'(\[{]")   # an operand list holding these is scanned bracket by bracket


def parse_hlo(text: str) -> HloModule:
    """A light parser for HLO text: instructions with shapes, operands and raw attributes."""
    name, parts = "", 1
    instrs: dict[str, Instr] = {}
    order: list[str] = []
    comps: dict[str, list[str]] = {}
    comp: str | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("HloModule"):
            m = re.match(r"HloModule\s+([^\s,]+)", line)
            name = m.group(1) if m else ""
            m = re.search(r"num_partitions=(\d+)", line)
            parts = int(m.group(1)) if m else 1
            continue
        if comp is None:
            if line.endswith("{") and "->" in line and " = " not in line.split("(")[0]:
                m = _HEADER.match(line)
                comp = m.group(1) if m else f"computation{len(comps)}"
                comps[comp] = []
            continue
        if line.strip() == "}":
            comp = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        try:
            ins = _parse_instr(m.group(1), m.group(2), comp)
        except (ValueError, IndexError):
            log.debug("extract: could not parse HLO line %r", line[:200])
            continue
        instrs[ins.name] = ins
        order.append(ins.name)
        comps[comp].append(ins.name)
    return HloModule(name, parts, instrs, order, comps)


def _parse_instr(name: str, rest: str, comp: str) -> Instr:
    rest = rest.strip()
    etype: str | None = None
    shape: tuple[int, ...] | None = None
    if rest.startswith("("):
        end = _match(rest, 0)
        rest = rest[end:].strip()
    else:
        m = _ARRAY_TYPE.match(rest)
        if m:
            etype = m.group(1)
            dims = [d.strip().lstrip("<=") for d in m.group(2).split(",") if d.strip()]
            shape = tuple(int(d) for d in dims)
            rest = rest[m.end():].strip()
        else:  # token[] or similar
            tok = rest.split(" ", 1)
            rest = tok[1] if len(tok) > 1 else ""
    m = _OPCODE.match(rest)
    if not m:
        raise ValueError("no opcode")
    opcode = m.group(1)
    start = m.end() - 1
    close = rest.find(")", start)
    if close > 0 and not _NESTED.search(rest, start + 1, close):
        end = close + 1       # the usual operand list, `%a, %b`: nothing nested to skip
    else:
        end = _match(rest, start)
    operand_text = rest[start + 1:end - 1]
    operands = _OPERAND.findall(operand_text)
    if not operands and opcode not in ("constant", "parameter", "iota", "partition-id", "replica-id"):
        operands = [t.split()[-1] for t in _split_top(operand_text) if t.split()]
    tail = rest[end:].strip()
    if tail.startswith(","):
        tail = tail[1:]
    return Instr(name, etype, shape, opcode, operands, operand_text, tail, comp)
