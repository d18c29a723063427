"""Problem parsing, validation, classification and the canonical key (no JAX needed)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from autotuner import Problem, ProblemError, Strategy, StrategyError

DESIGN_EXAMPLE = {
    "equation": "bsd,df->bsf",
    "lhs": {"shape": [8, 2048, 4096], "spec": [None, "x", None]},
    "rhs": {"shape": [4096, 16384], "spec": [None, "x"]},
    "out_spec": [None, None, "x"],
    "dtype": "bfloat16",
    "mesh": {"x": 8},
}


def with_(base: dict, path: str, value) -> dict:
    """A deep copy of `base` with the dotted `path` set to `value` (or deleted for ...)."""
    d = copy.deepcopy(base)
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is ...:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return d


def test_design_example_parses_and_classifies():
    p = Problem.from_dict(DESIGN_EXAMPLE)
    assert p.pattern.kind == "all_gather"
    assert (p.pattern.operand, p.pattern.letter, p.pattern.dim_class, p.pattern.axis) == ("lhs", "s", "free", "x")
    assert p.pattern.label == "all_gather:lhs:free"
    assert p.to_dict() == DESIGN_EXAMPLE
    assert Problem.from_dict(p.to_dict()) == p
    assert p.axis_size == 8
    f = p.features()
    assert (f["m"], f["n"], f["k"], f["b"]) == (8 * 2048, 16384, 4096, 1)  # b and s are free in lhs
    assert p.comm_bytes() == 8 * 256 * 4096 * 7 * 2


@pytest.mark.parametrize(
    "d, kind, operand, letter, dim_class",
    [
        # Megatron MLP-up with sequence parallelism: gather the sequence (a free dim of lhs)
        (DESIGN_EXAMPLE, "all_gather", "lhs", "s", "free"),
        # gather the contracting dim of lhs
        ({"equation": "bsd,df->bsf", "lhs": {"shape": [2, 8, 16], "spec": [None, None, "x"]},
          "rhs": {"shape": [16, 8], "spec": [None, "x"]}, "out_spec": [None, None, "x"],
          "dtype": "float32", "mesh": {"x": 4}}, "all_gather", "lhs", "d", "contracting"),
        # gather a free dim of rhs (weights sharded, activations replicated)
        ({"equation": "md,df->mf", "lhs": {"shape": [8, 16], "spec": ["x", None]},
          "rhs": {"shape": [16, 8], "spec": [None, "x"]}, "out_spec": ["x", None],
          "dtype": "float32", "mesh": {"x": 4}}, "all_gather", "rhs", "f", "free"),
        # gather the batch dim
        ({"equation": "bij,bjk->bik", "lhs": {"shape": [8, 4, 6], "spec": ["x", None, None]},
          "rhs": {"shape": [8, 6, 8], "spec": [None, None, "x"]}, "out_spec": [None, None, "x"],
          "dtype": "float32", "mesh": {"x": 4}}, "all_gather", "lhs", "b", "batch"),
        # Megatron MLP-down: partial sums over a sharded contraction, scattered over the sequence
        ({"equation": "bsf,fd->bsd", "lhs": {"shape": [2, 8, 16], "spec": [None, None, "x"]},
          "rhs": {"shape": [16, 8], "spec": ["x", None]}, "out_spec": [None, "x", None],
          "dtype": "float32", "mesh": {"x": 4}}, "reduce_scatter", None, "s", "free_lhs"),
        ({"equation": "ij,jk->ik", "lhs": {"shape": [8, 8], "spec": [None, "x"]},
          "rhs": {"shape": [8, 8], "spec": ["x", None]}, "out_spec": [None, "x"],
          "dtype": "float32", "mesh": {"x": 4}}, "reduce_scatter", None, "k", "free_rhs"),
        # local einsum: nothing to communicate
        ({"equation": "ij,jk->ik", "lhs": {"shape": [8, 8], "spec": ["x", None]},
          "rhs": {"shape": [8, 8], "spec": [None, None]}, "out_spec": ["x", None],
          "dtype": "float32", "mesh": {"x": 4}}, "none", None, None, None),
        # a data axis on the batch dim and the collective over the model axis
        ({"equation": "bsd,df->bsf", "lhs": {"shape": [4, 8, 16], "spec": ["data", "model", None]},
          "rhs": {"shape": [16, 8], "spec": [None, "model"]}, "out_spec": ["data", None, "model"],
          "dtype": "float32", "mesh": {"data": 2, "model": 4}}, "all_gather", "lhs", "s", "free"),
        # the collective axis is the minor one of a two-axis entry
        ({"equation": "sd,df->sf", "lhs": {"shape": [16, 8], "spec": [["y", "x"], None]},
          "rhs": {"shape": [8, 8], "spec": [None, None]}, "out_spec": ["y", None],
          "dtype": "float32", "mesh": {"x": 2, "y": 2}}, "all_gather", "lhs", "s", "free"),
    ],
)
def test_classification(d, kind, operand, letter, dim_class):
    p = Problem.from_dict(d)
    assert p.pattern.kind == kind
    assert p.pattern.operand == operand
    assert p.pattern.letter == letter
    assert p.pattern.dim_class == dim_class


# (mutated problem, field named in the error, a phrase of the message)
INVALID = [
    (with_(DESIGN_EXAMPLE, "equation", "bsd,df"), "equation", "'->'"),
    (with_(DESIGN_EXAMPLE, "equation", "bsd,df,fg->bsg"), "equation", "two operands"),
    (with_(DESIGN_EXAMPLE, "equation", "bsd,df->bsz"), "equation", "'z'"),
    (with_(DESIGN_EXAMPLE, "equation", "bss,df->bsf"), "equation", "repeats"),
    (with_(DESIGN_EXAMPLE, "equation", "...d,df->...f"), "equation", "ellipsis"),
    (with_(DESIGN_EXAMPLE, "equation", "bs1,df->bsf"), "equation", "'1'"),
    (with_(DESIGN_EXAMPLE, "equation", 42), "equation", "string"),
    (with_(DESIGN_EXAMPLE, "equation", "bsdq,df->bsf"), "equation", "summed within the lhs"),
    (with_(DESIGN_EXAMPLE, "lhs.shape", [8, 2048]), "lhs.shape", "rank"),
    (with_(DESIGN_EXAMPLE, "lhs.shape.1", 0), "lhs.shape[1]", "positive"),
    (with_(DESIGN_EXAMPLE, "lhs.shape.1", -8), "lhs.shape[1]", "positive"),
    (with_(DESIGN_EXAMPLE, "lhs.shape.1", "2048"), "lhs.shape[1]", "integer"),
    (with_(DESIGN_EXAMPLE, "lhs.shape.1", 2048.0), "lhs.shape[1]", "integer"),
    (with_(DESIGN_EXAMPLE, "rhs.shape.0", 1024), "rhs.shape[0]", "'d' has size 4096 in lhs but 1024"),
    (with_(DESIGN_EXAMPLE, "lhs.spec.1", "y"), "lhs.spec[1]", "unknown mesh axis 'y'"),
    (with_(DESIGN_EXAMPLE, "lhs.spec", [None, "x", "x"]), "lhs.spec[2]", "already used"),
    (with_(DESIGN_EXAMPLE, "lhs.spec", [None, "x"]), "lhs.spec", "2 entries"),
    (with_(DESIGN_EXAMPLE, "lhs.spec.1", 3), "lhs.spec[1]", "mesh axis name"),
    (with_(DESIGN_EXAMPLE, "lhs.shape.1", 2044), "lhs.shape[1]", "not divisible"),
    (with_(DESIGN_EXAMPLE, "out_spec", [None, None]), "out_spec", "2 entries"),
    (with_(with_(DESIGN_EXAMPLE, "rhs.shape.1", 16380), "rhs.spec", [None, None]), "out_spec.shape[2]",
     "not divisible"),
    (with_(DESIGN_EXAMPLE, "dtype", "int8"), "dtype", "unsupported dtype"),
    (with_(DESIGN_EXAMPLE, "dtype", None), "dtype", "unsupported dtype"),
    (with_(DESIGN_EXAMPLE, "mesh", {"x": 0}), "mesh.x", "positive"),
    (with_(DESIGN_EXAMPLE, "mesh", {}), "mesh", "at least one axis"),
    (with_(DESIGN_EXAMPLE, "mesh", [8]), "mesh", "object"),
    (with_(DESIGN_EXAMPLE, "mesh", {"x": 8, "not an id": 2}), "mesh", "identifier"),
    (with_(DESIGN_EXAMPLE, "rhs", ...), "rhs", "missing field"),
    (with_(DESIGN_EXAMPLE, "lhs.shape", ...), "lhs.shape", "missing field"),
    (with_(DESIGN_EXAMPLE, "dtype", ...), "dtype", "missing field"),
    (with_(DESIGN_EXAMPLE, "lhs", [1, 2]), "lhs", "object"),
    (with_(DESIGN_EXAMPLE, "colour", "red"), "colour", "unknown field"),
    (with_(DESIGN_EXAMPLE, "lhs.strides", [1]), "lhs.strides", "unknown field"),
    ([1, 2, 3], "problem", "JSON object"),
    # an all-reduce layout: contracting dim sharded in both operands, output not sharded on it
    ({"equation": "ij,jk->ik", "lhs": {"shape": [8, 8], "spec": [None, "x"]},
      "rhs": {"shape": [8, 8], "spec": ["x", None]}, "out_spec": [None, None],
      "dtype": "float32", "mesh": {"x": 4}}, "out_spec", "all-reduce"),
    # two all-gathers needed (both operands sharded on their free dims, output replicated)
    ({"equation": "ij,jk->ik", "lhs": {"shape": [8, 8], "spec": ["x", None]},
      "rhs": {"shape": [8, 8], "spec": [None, "y"]}, "out_spec": [None, None],
      "dtype": "float32", "mesh": {"x": 2, "y": 2}}, "out_spec", "layout not decomposed"),
]


@pytest.mark.parametrize("d, field, phrase", INVALID, ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(INVALID)])
def test_invalid_problems_name_the_field(d, field, phrase):
    with pytest.raises(ProblemError) as e:
        Problem.from_dict(d)
    assert e.value.field == field
    assert str(e.value).startswith(field + ":")
    assert phrase in str(e.value)


def test_at_least_fifteen_distinct_invalid_problems():
    assert len({json.dumps(d, sort_keys=True, default=str) for d, _, _ in INVALID}) >= 15


def test_from_json_rejects_bad_json():
    with pytest.raises(ProblemError, match="invalid JSON"):
        Problem.from_json("{not json")


def test_key_normalises_letters_specs_and_mesh_order():
    p = Problem.from_dict(DESIGN_EXAMPLE)
    renamed = copy.deepcopy(DESIGN_EXAMPLE)
    renamed["equation"] = "xyz,zw->xyw"
    listy = with_(DESIGN_EXAMPLE, "lhs.spec", [[], ["x"], None])
    assert Problem.from_dict(renamed).key == p.key
    assert Problem.from_dict(listy).key == p.key
    two = with_(with_(DESIGN_EXAMPLE, "mesh", {"x": 8, "d": 2}), "lhs.spec", ["d", "x", None])
    two = with_(two, "out_spec", ["d", None, "x"])
    swapped = with_(two, "mesh", {"d": 2, "x": 8})
    assert Problem.from_dict(two).key == Problem.from_dict(swapped).key
    assert Problem.from_dict(with_(DESIGN_EXAMPLE, "dtype", "float32")).key != p.key
    assert Problem.from_dict(with_(DESIGN_EXAMPLE, "lhs.shape.0", 16)).key != p.key
    assert len(p.key) == 32


def test_key_is_stable_across_processes():
    code = ("import json,sys; from autotuner import Problem; "
            "print(Problem.from_dict(json.loads(sys.argv[1])).key)")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(DESIGN_EXAMPLE)], check=True,
                         capture_output=True, text=True, env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert out.stdout.strip() == Problem.from_dict(DESIGN_EXAMPLE).key
    # pinned: the key is part of stored records; changing it orphans every database
    assert Problem.from_dict(DESIGN_EXAMPLE).key == KNOWN_KEY


KNOWN_KEY = "eff485c3d2e1745e2342cf8c8cd35ef1"


def test_strategy_round_trip_and_errors():
    s = Strategy("ring", "bidi", 2, 1, "after", False)
    assert Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert Strategy.from_dict({"method": "baseline"}).is_baseline
    assert s.key == "ring-bidi-c2-u1-after-comp"
    for bad, field in [({"method": "magic"}, "method"), ({"method": "ring", "chunks": 3}, "chunks"),
                       ({"method": "ring", "unroll": 0}, "unroll"), ({"direction": "uni"}, "method"),
                       ({"method": "ring", "speed": 1}, "speed"), ({"method": "ring", "send_first": 1}, "send_first")]:
        with pytest.raises(StrategyError) as e:
            Strategy.from_dict(bad)
        assert e.value.field == field
