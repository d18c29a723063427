"""Readable problem names from the op_name metadata JAX writes into the HLO (its name stack):
`jit(step)/transpose(jvp(llama_backbone))/transformer_layer_0/self_attention/query/bqm,muh->bquh/dot_general`
names the dot `grad/self_attention/query`. Where the name stack names no layer (Flax NNX and
plain JAX push no scopes, Equinox only its modules' classes), the argument a dot multiplies does:
JAX writes each argument's path into its parameter's op_name
(`params['blocks'][0]['attn']['query']['kernel'].value`), so that dot is `attn/query` (`dot_label`)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

_PRIMITIVES = {"dot_general", "dot", "einsum", "matmul", "tensordot", "conv_general_dilated"}
_WRAPPER = re.compile(r"^(?:jvp|transpose|vmap|remat|checkpoint|custom_jvp_call|custom_vjp_call|pjit|jit|"
                      r"named_call|cond|while|scan|body|branch_\d+_fun)\((.*)\)$")
# the same transformations as bare scopes, which name no layer: a scanned layer's dot is
# `while/body/closed_call/dot_general` (`jax.lax.scan`'s loop body, called as Flax's `nnx.scan` calls it)
_BARE = re.compile(r"^(?:while|body|cond|scan|closed_call|core_call|remat|checkpoint|rematted_computation|"
                   r"branch_\d+_fun)$")


def _component(c: str) -> str:
    """`transpose(jvp(block))` -> `block`; `vmap(vmap())` -> ``."""
    while True:
        m = _WRAPPER.match(c)
        if m is None:
            return c
        c = m.group(1)


def op_path(op_name: str) -> tuple[bool, list[str], list[str]]:
    """(backward, the name stack's scopes, its einsum equations) of a dot's op_name: the jit
    wrapper, transformations (wrapping a scope, or bare: `_BARE`) and the primitive itself left
    out; backward when the dot
    comes from a transpose (the gradient of a forward op)."""
    parts = [p for p in _top_level(op_name) if p]
    backward = "transpose(" in op_name
    while parts and re.match(r"^p?jit\(", parts[0]):   # the program's own jit (and the pass's around it)
        parts = parts[1:]
    out, eqs = [], []
    for p in parts:
        # a transformation wraps a whole scope, which may hold slashes: jvp(attention/qkv)
        for c in _component(p).split("/"):
            c = _component(c)
            if "->" in c and "," in c:
                eqs.append(c)
            elif c and c not in _PRIMITIVES and not _BARE.match(c):
                out.append(c)
    return backward, out, eqs


def _top_level(op_name: str) -> list[str]:
    """`op_name` split on the slashes outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(op_name):
        depth += (ch == "(") - (ch == ")")
        if ch == "/" and depth == 0:
            parts.append(op_name[start:i])
            start = i + 1
    parts.append(op_name[start:])
    return parts


_INDEX = re.compile(r"^(?:\d+|.*_\d+)$")  # a repeated block's scope: `transformer_layer_3`, `7`


def _indices(path: Sequence[str]) -> list[bool]:
    """Which scopes of `path` are a repeated block's index: a number, or a name ending in `_N`
    above the innermost scope. The innermost scope is the layer that ran the dot, so a name of its
    own there (keras-hub Gemma's `ffw_gating_2` beside `ffw_gating`) is kept; only a bare number
    there is an index (penzai's positions)."""
    return [c.isdigit() or (i < len(path) - 1 and bool(_INDEX.match(c))) for i, c in enumerate(path)]


def short_name(op_name: str, depth: int = 2) -> str:
    """The one readable name of a pair, wherever it is shown (extract, plan, bench-model, the
    dashboard): the last `depth` scopes of the dot's name stack that are not a repeated block's
    index (`_indices`: so every layer's `mlp/up_proj` has one name), `grad/` first for a backward dot; with no
    named scope, the einsum's equation (`bsd,df->bsf`), else the last `depth` index scopes (a
    model that names its layers by position), else `dot`. Scopes the compiler pass adds
    (`__overlap...__`) are not part of it."""
    backward, path, eqs = op_path(op_name)
    path = [c for c in path if not c.startswith("__overlap")]
    named = [c for c, index in zip(path, _indices(path), strict=True) if not index]
    name = "/".join(named[-depth:]) if named else eqs[-1] if eqs else "/".join(path[-depth:]) or "dot"
    return f"grad/{name}" if backward else name


_ARGUMENT = re.compile(r"[A-Za-z_]\w*(?:\['[^']*'\]|\[\d+\]|\.[A-Za-z_]\w*)*")
_KEY = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)")
# the leaf of a layer's parameter rather than the layer (`attn.query.kernel` is the attention's query)
_LEAVES = frozenset({"kernel", "weight", "weights", "w", "embedding", "embeddings"})


def argument_scopes(op_name: str) -> list[str]:
    """The scopes of a program argument's path as JAX writes it into its parameter's op_name
    (`params['blocks'][0]['attn']['query']['kernel'].value` -> blocks, 0, attn, query): the
    argument's own name left out where a path follows it, then a last `.value` attribute (a Flax
    Variable's) and a leaf name of `_LEAVES`; [] where `op_name` is not such a path (a name stack,
    or nothing)."""
    text = op_name.replace("\\", "")
    root = re.match(r"[A-Za-z_]\w*", text)
    if root is None or not _ARGUMENT.fullmatch(text):
        return []
    keys = _KEY.findall(text[root.end():])   # (dict key, index, attribute) per accessor
    if keys and keys[-1][2] == "value":
        keys.pop()
    if keys and (keys[-1][0] or keys[-1][2]) in _LEAVES:
        keys.pop()
    return [a or b or c for a, b, c in keys] or [root.group(0)]


def dot_label(op_name: str, arguments: Sequence[str] = ()) -> str:
    """The op_name a dot is named by (`short_name`): its own, unless its name stack names no layer
    (no scope, or only classes: Equinox scopes each call by its module's class, `eqx.nn.Linear`)
    and no einsum, and it multiplies a program argument (`arguments`: the op_names of the
    arguments among its forward dot's operands and its own, '' for the others, `HloModule.arguments`):
    then that argument's path names it, the deepest path where several are (a model's weight, not
    the input `x`), the later one on a tie (`x @ w`; its own over its forward dot's)."""
    backward, path, eqs = op_path(op_name)
    if eqs or any("." not in c and not c.startswith("__overlap") for c in path):
        return op_name   # a scope names it (penzai's positions too), or its einsum does
    scopes = max((argument_scopes(a) for a in reversed(arguments)), key=len, default=[])   # ties: the later
    if not scopes:
        return op_name
    return "/".join(["transpose()" if backward else "", *scopes, "dot_general"]).lstrip("/")


def problem_names(op_names: Sequence[Sequence[str]]) -> list[str]:
    """One name per problem from the op_names of its pairs (in program order): the distinct short
    names of its dots joined by `+` (a problem several layers share, or Q/K/V of one shape, gets
    each layer's dot once), then `#2`, `#3` ... on names that repeat."""
    raw = []
    for ops in op_names:
        seen: list[str] = []
        for op in ops:
            n = short_name(op)
            if n not in seen:
                seen.append(n)
        if len(seen) > 3:
            seen = [*seen[:2], f"{len(seen) - 2} more"]
        raw.append("+".join(seen) if seen else "dot")
    total, count = Counter(raw), Counter[str]()
    out = []
    for n in raw:
        count[n] += 1
        out.append(n if total[n] == 1 or count[n] == 1 else f"{n}#{count[n]}")
    return out
