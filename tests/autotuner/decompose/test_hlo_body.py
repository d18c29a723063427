"""The compiled ring programs keep the shape that lets transfer and einsum overlap.

Read from XLA:CPU's optimised HLO (8 in-process devices, tests/conftest.py), per strategy family
(all-gather and reduce-scatter, uni and bidi, fuse loop and after):
- the rolled loop's body copies nothing but its loop-carried values (XLA's copy for an in-place
  while loop), at most one per buffer in flight: no copy of a received buffer, a partial result
  or a slice;
- no slice of a buffer in flight (the partial einsum reads the received buffer whole);
- no transfer depends on a dot of the same step (that would order the send after the einsum);
- a reduce-scatter ring's partial einsums run in ring order, each after the one before (the
  accumulator in flight computed before the next partial starts, so it is not slowed down by
  partials that nothing needs yet); they read one element of the value before them for that,
  which is not a re-slice of it;
- a 3-D or 4-D einsum whose matmul is 2-D compiles to the same program as its 2-D form.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import jax
import pytest

import autotuner
from autotuner import Problem, Strategy
from autotuner.decompose import check_valid
from autotuner.decompose.canonical import canonical
from autotuner.strategy import StrategyError

DOT_OPS = ("dot", "convolution")
SLICES = ("slice", "dynamic-slice")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")


@dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    calls: str | None
    index: int | None  # parameter number


def parse(text: str) -> dict[str, list[Instr]]:
    """Computation name -> its instructions, from `compiled.as_text()`."""
    comps: dict[str, list[Instr]] = {}
    cur: list[Instr] | None = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) \(", line)
        if head and line.rstrip().endswith("{"):
            cur = comps.setdefault("ENTRY" if line.startswith("ENTRY") else head.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            name, shape, op, rest = m.groups()
            args = rest.split(")")[0] if op == "parameter" else rest.split("), ")[0]
            calls = re.search(r"calls=%([\w.\-]+)", rest)
            cur.append(Instr(name, shape, op, [] if op in ("parameter", "constant") else
                             re.findall(r"%([\w.\-]+)", args), calls.group(1) if calls else None,
                             int(args) if op == "parameter" else None))
    return comps


def hlo(p: Problem, s: Strategy) -> dict[str, list[Instr]]:
    n = p.axis_size
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    args = (jax.ShapeDtypeStruct(p.lhs.shape, p.dtype), jax.ShapeDtypeStruct(p.rhs.shape, p.dtype))
    return parse(jax.jit(autotuner.build(p, s, mesh)).lower(*args).compile().as_text())


def has_op(comps: dict[str, list[Instr]], ins: Instr, ops: tuple[str, ...]) -> bool:
    """`ins` is one of `ops`, or a fusion/call whose computation contains one."""
    if ins.op in ops:
        return True
    return ins.calls is not None and any(has_op(comps, i, ops) for i in comps.get(ins.calls, []))


def through(by_name: dict[str, Instr], name: str, ops: tuple[str, ...]) -> list[str]:
    """`name` and what it is a `ops` (copy, bitcast) of, back to the first other instruction."""
    out = [name]
    x = by_name.get(name)
    while x is not None and x.op in ops and x.operands:
        out.append(x.operands[0])
        x = by_name.get(x.operands[0])
    return out


def elements(shape: str) -> int:
    """Number of elements of an HLO array shape (`f32[2,3]{1,0}` -> 6)."""
    dims = re.match(r"^\w+\[([\d,]*)\]", shape)
    return 0 if dims is None else math.prod(int(d) for d in dims.group(1).split(",") if d)


def sliced_params(callee: list[Instr]) -> set[int]:
    """Parameter numbers of a fused computation that a slice or dynamic-slice reads (more than
    one element of: reading one element orders the fusion after the parameter's producer)."""
    by_name = {i.name: i for i in callee}
    out = set()
    for i in callee:
        if i.op in SLICES and i.operands and elements(i.shape) > 1:
            src = by_name.get(through(by_name, i.operands[0], ("bitcast",))[-1])
            if src is not None and src.op == "parameter":
                out.add(src.index)
    return out


def bodies(comps: dict[str, list[Instr]]) -> list[str]:
    """The while bodies (computations other than ENTRY that send)."""
    return [c for c, ins in comps.items() if c != "ENTRY" and any(i.op == "collective-permute" for i in ins)]


def ancestors(instrs: list[Instr], name: str) -> set[str]:
    by_name = {i.name: i for i in instrs}
    seen: set[str] = set()
    todo = list(by_name[name].operands)
    while todo:
        x = todo.pop()
        if x in seen or x not in by_name:
            continue
        seen.add(x)
        todo.extend(by_name[x].operands)
    return seen


def check_body(comps: dict[str, list[Instr]], body: str, in_flight: int, where: str) -> None:
    """The three rules of the module docstring on one computation that sends."""
    instrs = comps[body]
    by_name = {i.name: i for i in instrs}
    sends = [i for i in instrs if i.op == "collective-permute"]
    # 1. copies: only of loop-carried values, at most one per buffer in flight (scalars aside)
    copies = [i for i in instrs if i.op == "copy"]
    for c in copies:
        src = by_name.get(c.operands[0])
        assert src is not None and src.op == "get-tuple-element", \
            f"{where}: the loop body copies {c.operands[0]} ({src.op if src else '?'}), not a loop-carried value"
    big = [c for c in copies if not re.match(r"^\w+\[\]", c.shape)]
    assert len(big) <= in_flight, f"{where}: {len(big)} buffer copies in the loop body for {in_flight} in flight"
    # 2. no slice of a buffer in flight: what is sent (back through copies and bitcasts) or received
    flight = {s.name for s in sends} | {x for s in sends for x in through(by_name, s.operands[0], ("copy", "bitcast"))}
    flight |= {i.name for i in instrs if i.op in ("bitcast", "copy") and i.operands and i.operands[0] in flight}
    for i in instrs:
        if i.op in SLICES and i.operands and i.operands[0] in flight:
            raise AssertionError(f"{where}: {i.name} slices the buffer in flight {i.operands[0]}")
        if i.op == "fusion" and i.calls:
            cut = sliced_params(comps[i.calls])
            bad = [x for k, x in enumerate(i.operands) if x in flight and k in cut]
            assert not bad, f"{where}: fusion {i.name} slices the buffer in flight {bad[0]}"
    # 3. no transfer waits for an einsum of the same computation
    dots = {i.name for i in instrs if has_op(comps, i, DOT_OPS)}
    for s in sends:
        late = ancestors(instrs, s.name) & dots
        assert not late, f"{where}: the transfer {s.name} depends on the einsum {sorted(late)}"


# -- the families -------------------------------------------------------------------------------

def problem(eq: str, lhs: tuple, rhs: tuple, out_spec: list, n: int) -> Problem:
    return Problem.from_dict({"equation": eq, "lhs": {"shape": lhs[0], "spec": lhs[1]},
                              "rhs": {"shape": rhs[0], "spec": rhs[1]}, "out_spec": out_spec,
                              "dtype": "float32", "mesh": {"x": n}})


def ag(n: int) -> Problem:
    return problem("sd,df->sf", ([16 * n, 32], ["x", None]), ([32, 8 * n], [None, "x"]), [None, "x"], n)


def rs(n: int) -> Problem:
    return problem("sf,fd->sd", ([16 * n, 8 * n], [None, "x"]), ([8 * n, 32], ["x", None]), ["x", None], n)


# (name, problem, direction, fuse): uni on 4 devices, bidi on 8 (the smallest with a rolled loop)
FAMILIES = [("all_gather uni loop", ag(4), "uni", "loop"), ("all_gather uni after", ag(4), "uni", "after"),
            ("all_gather bidi loop", ag(8), "bidi", "loop"), ("all_gather bidi after", ag(8), "bidi", "after"),
            ("reduce_scatter uni", rs(4), "uni", "loop"), ("reduce_scatter bidi", rs(8), "bidi", "loop")]


def skip_unless(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


@pytest.mark.parametrize("send_first", [True, False])
@pytest.mark.parametrize(("name", "p", "direction", "fuse"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_loop_body_has_no_copy_reslice_or_late_send(name, p, direction, fuse, send_first):
    skip_unless(p.axis_size)
    chunks = 2
    s = Strategy("ring", direction, chunks, 1, fuse, send_first)
    comps = hlo(p, s)
    found = bodies(comps)
    assert found, f"{name}: no rolled loop that sends in the compiled program"
    for b in found:
        check_body(comps, b, chunks * (2 if direction == "bidi" else 1), f"{name} ({s.key}) body {b}")


@pytest.mark.parametrize("chunks", [1, 2])
def test_unrolled_all_gather_sends_never_wait_for_an_einsum(chunks):
    """Straight-line all-gather rings: every transfer is free to start before any dot."""
    skip_unless(4)
    comps = hlo(ag(4), Strategy("ring", "uni", chunks, "full", "loop", True))
    instrs = comps["ENTRY"]
    dots = {i.name for i in instrs if has_op(comps, i, DOT_OPS)}
    for s in (i for i in instrs if i.op == "collective-permute"):
        assert not ancestors(instrs, s.name) & dots, f"{s.name} waits for an einsum"


def ring_order(instrs: list[Instr], dots: set[str]) -> list[int]:
    """Per dot, how many dots it waits for, in increasing order: 0, 1, ..., m-1 when the dots run
    one after the other."""
    return sorted(len(ancestors(instrs, d) & dots) for d in dots)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize(("n", "direction", "unroll"), [(4, "uni", "full"), (4, "uni", 1), (8, "bidi", "full"),
                                                       (8, "bidi", 1), (3, "bidi", "full")])
def test_reduce_scatter_partials_run_one_after_the_other(n, direction, unroll, chunks):
    """A reduce-scatter ring computes its partial einsums in ring order, each after the one
    before it, so a finished accumulator is sent while the next partial is computed instead of
    all partials sharing the cores first (XLA:CPU starts every ready thunk)."""
    skip_unless(n)
    p = rs(n) if n != 3 else problem("sf,fd->sd", ([48, 48], [None, "x"]), ([48, 32], ["x", None]), ["x", None], 3)
    s = Strategy("ring", direction, chunks, unroll, "loop", True)
    try:
        check_valid(p, s)
    except StrategyError as e:
        pytest.skip(str(e))
    comps = hlo(p, s)
    for c in ["ENTRY", *bodies(comps)]:
        instrs = comps[c]
        dots = {i.name for i in instrs if has_op(comps, i, DOT_OPS)}
        assert ring_order(instrs, dots) == list(range(len(dots))), f"{s.key} {c}: partial einsums run side by side"
        if c != "ENTRY":  # the body's first partial waits for the accumulators it sends
            sent = {x for i in instrs if i.op == "collective-permute" for x in i.operands}
            first = min(dots, key=lambda d: len(ancestors(instrs, d) & dots))
            assert ancestors(instrs, first) & sent, f"{s.key} {c}: the first partial does not wait for the sends"


def test_ring_order_fails_on_partials_side_by_side():
    text = """%b (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %d1 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d2 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d3 = f32[4,4]{1,0} dot(%d1, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %a = f32[4,4]{1,0} add(%d3, %d2)
}
"""
    instrs = parse(text)["b"]
    assert ring_order(instrs, {"d1", "d2", "d3"}) == [0, 0, 1]
    assert ring_order(instrs, {"d1", "d3"}) == [0, 1]


def test_the_checks_fail_on_a_body_that_breaks_them():
    """Each rule trips on a hand-made body: a copy of a received buffer, a slice of it, a send
    of a dot's result."""
    text = """%fused_dot (param_0: f32[4,4], param_1: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  %param_1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (f32[4,4], f32[4,4])) -> (f32[4,4], f32[4,4]) {
  %p = (f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %g0 = f32[4,4]{1,0} get-tuple-element(%p), index=0
  %g1 = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %d = f32[4,4]{1,0} fusion(%g0, %g1), kind=kCustom, calls=%fused_dot
  %send = f32[4,4]{1,0} collective-permute(%d), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %c = f32[4,4]{1,0} copy(%send)
  %sl = f32[2,4]{1,0} slice(%send), slice={[0:2], [0:4]}
  ROOT %t = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%c, %g1)
}
"""
    comps = parse(text)
    assert bodies(comps) == ["body"]
    with pytest.raises(AssertionError, match="copies send"):
        check_body(comps, "body", 1, "hand-made")
    comps["body"] = [i for i in comps["body"] if i.name != "c"]
    with pytest.raises(AssertionError, match="slices the buffer in flight send"):
        check_body(comps, "body", 1, "hand-made")
    comps["body"] = [i for i in comps["body"] if i.name != "sl"]
    with pytest.raises(AssertionError, match="depends on the einsum"):
        check_body(comps, "body", 1, "hand-made")


# -- canonical form -----------------------------------------------------------------------------

def op_counts(comps: dict[str, list[Instr]]) -> list[Counter]:
    """Per computation that sends (entry first): transfers, einsums, copies, slices, loops, and
    the number of thunks (XLA:CPU runs a sequence of 8 thunks or fewer without concurrency)."""
    skip = {"bitcast", "parameter", "constant", "get-tuple-element", "tuple"}
    out = []
    for c in ["ENTRY", *sorted(bodies(comps))]:
        ins = [i for i in comps[c] if i.op not in skip]
        kinds = Counter("dot" if has_op(comps, i, DOT_OPS) else "slice" if has_op(comps, i, SLICES)
                        else i.op if i.op in ("collective-permute", "copy", "while") else "other" for i in ins)
        kinds["thunks"] = len(ins)
        out.append(kinds)
    return out


# (3-D/4-D problem, its 2-D form): the MLP up-projection with batch 1, and the attention's
# per-head projections whose (heads, head_dim) letters always travel together
CANON = [
    (problem("bsd,df->bsf", ([1, 64, 32], [None, "x", None]), ([32, 32], [None, "x"]), [None, None, "x"], 4),
     problem("sd,df->sf", ([64, 32], ["x", None]), ([32, 32], [None, "x"]), [None, "x"], 4)),
    (problem("bsd,dhk->bshk", ([1, 64, 32], [None, "x", None]), ([32, 8, 4], [None, "x", None]),
             [None, None, "x", None], 4),
     problem("sd,dh->sh", ([64, 32], ["x", None]), ([32, 32], [None, "x"]), [None, "x"], 4)),
    (problem("bshk,hkd->bsd", ([1, 64, 8, 4], [None, None, "x", None]), ([8, 4, 32], ["x", None, None]),
             [None, "x", None], 4),
     problem("sh,hd->sd", ([64, 32], [None, "x"]), ([32, 32], ["x", None]), ["x", None], 4)),
]


@pytest.mark.parametrize(("p", "flat"), CANON, ids=[c[0].equation for c in CANON])
def test_canonical_form_is_the_2d_matmul(p, flat):
    c = canonical(p)
    assert c is not None and c.to_dict() == flat.to_dict()
    assert canonical(flat) is None


def test_canonical_leaves_what_cannot_merge():
    """A sharded letter never folds into the one before it; letters that part ways never merge."""
    batch2 = problem("bsd,df->bsf", ([2, 64, 32], [None, "x", None]), ([32, 32], [None, "x"]),
                     [None, None, "x"], 4)
    assert canonical(batch2) is None
    swapped = problem("sdk,kdf->sf", ([64, 8, 4], ["x", None, None]), ([4, 8, 32], [None, None, "x"]),
                      [None, "x"], 4)
    assert canonical(swapped) is None
    together = problem("sdk,dkf->sf", ([64, 8, 4], ["x", None, None]), ([8, 4, 32], [None, None, "x"]),
                       [None, "x"], 4)
    c = canonical(together)
    assert c is not None and c.equation == "sd,df->sf" and c.lhs.shape == (64, 32)


@pytest.mark.parametrize(("p", "flat"), CANON, ids=[c[0].equation for c in CANON])
@pytest.mark.parametrize("s", [Strategy("ring", "uni", 2, 1, "loop", True),
                               Strategy("ring", "uni", 2, "full", "after", True),
                               Strategy("ring", "bidi", 1, "full", "loop", False)], ids=lambda s: s.key)
def test_3d_einsum_compiles_to_its_2d_program(p, flat, s):
    skip_unless(p.axis_size)
    if s.fuse == "after" and p.pattern.kind != "all_gather":   # all-gather only: refused, not built
        with pytest.raises(StrategyError, match="fuse"):
            check_valid(p, s)
        return
    got, want = op_counts(hlo(p, s)), op_counts(hlo(flat, s))
    if s.fuse == "loop" and p.pattern.kind == "all_gather":
        # known: XLA:CPU copies the local output once after the ring, as it cannot update it in
        # place through the reshape back to the 3-D/4-D layout (outside the loop, one copy)
        for k in ("copy", "thunks"):
            if got[0][k] == want[0][k] + 1:
                got[0][k] -= 1
    assert got == want, f"{p.equation} vs {flat.equation} with {s.key}"


@pytest.mark.parametrize("p", [c[0] for c in CANON] + [
    problem("bsd,df->bsf", ([2, 64, 32], [None, "x", None]), ([32, 32], [None, "x"]), [None, None, "x"], 4),
    problem("bsf,fd->bsd", ([2, 64, 32], [None, None, "x"]), ([32, 16], ["x", None]), [None, "x", None], 4)],
    ids=lambda p: p.equation)
def test_every_strategy_of_a_3d_or_4d_problem_matches_einsum(p):
    import numpy as np

    from autotuner.testing import TOLERANCE, inputs, reference, relative_error

    skip_unless(p.axis_size)
    mesh = jax.make_mesh((p.axis_size,), ("x",), devices=jax.devices()[: p.axis_size])
    a, b = inputs(p, seed=3)
    ref = reference(p, a, b)
    strategies = autotuner.space(p)
    strategies += [s.serial() for s in strategies if s.method == "ring" and s.unroll == 1][:2]   # rolled loops' controls
    for g in range(0, len(strategies), 16):
        chunk = strategies[g: g + 16]
        fns = [autotuner.build(p, s, mesh) for s in chunk]
        outs = jax.jit(lambda x, y, fns=fns: [f(x, y) for f in fns])(a, b)
        for s, out in zip(chunk, outs, strict=True):
            assert out.shape == p.out_shape, s.key
            err = relative_error(np.asarray(out), ref)
            assert err <= TOLERANCE[p.dtype], f"{s.key} on {p.describe()}: relative error {err:.3g}"


def keep_hlo(p: Problem, s: Strategy) -> dict[str, list[Instr]]:
    from autotuner.decompose import build_keeping

    n = p.axis_size
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    args = (jax.ShapeDtypeStruct(p.lhs.shape, p.dtype), jax.ShapeDtypeStruct(p.rhs.shape, p.dtype))
    return parse(jax.jit(build_keeping(p, s, mesh)).lower(*args).compile().as_text())


@pytest.mark.parametrize(("p", "flat"), [c for c in CANON if c[0].pattern.kind == "all_gather"],
                         ids=lambda x: x.equation if isinstance(x, Problem) else None)
@pytest.mark.parametrize("s", [Strategy("ring", "uni", 2, 1, "loop", True),
                               Strategy("ring", "uni", 2, "full", "after", True)], ids=lambda s: s.key)
def test_a_kept_3d_ring_runs_its_2d_program(p, flat, s):
    """The ring that also returns the gathered operand (`build_keeping`, for a gathered value that
    other equations reuse) runs a single problem on its canonical matmul, as `build` does."""
    skip_unless(p.axis_size)
    got, want = op_counts(keep_hlo(p, s)), op_counts(keep_hlo(flat, s))
    # the reshape back to the 3-D/4-D layout outside the ring: at most one copy per result
    for k in ("copy", "thunks"):
        extra = got[0][k] - want[0][k]
        if 0 < extra <= 2:
            got[0][k] -= extra
    assert got == want, f"{p.equation} vs {flat.equation} with {s.key}"


@pytest.mark.parametrize(("n", "direction"), [(4, "uni"), (8, "bidi")])
def test_the_chain_keeps_other_blocks_exact_when_one_is_not_finite(n, direction):
    """The chain reads one element of each accumulator into a slice offset; an inf or NaN there
    must not move the slice: the blocks that are finite stay equal to the einsum's."""
    import numpy as np

    from autotuner.testing import inputs

    skip_unless(n)
    p = rs(n)
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    a, b = inputs(p, seed=1)
    a = np.array(a)
    a[0, :] = np.inf  # output row 0 (block 0) becomes inf/NaN
    ref = np.einsum("sf,fd->sd", a.astype(np.float64), np.asarray(b, np.float64))
    for chunks in (1, 2):
        s = Strategy("ring", direction, chunks, "full", "loop", True)
        out = np.asarray(jax.jit(autotuner.build(p, s, mesh))(a, b))
        blk = p.lhs.shape[0] // n
        assert not np.isfinite(out[0]).all()
        np.testing.assert_allclose(out[blk:], ref[blk:], rtol=1e-4, atol=1e-4, err_msg=s.key)
