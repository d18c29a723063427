"""GroupedProblem: JSON form, order-free canonical key distinct from single keys, clear errors."""

from __future__ import annotations

import copy
import json

import pytest

from autotuner import GroupedProblem, Problem, ProblemError
from autotuner.problem import problem_from_dict
from autotuner.problem.problems_file import ProblemsFileError, load_problems

Q = {"equation": "bsd,dhk->bshk", "lhs": {"shape": [2, 16, 32], "spec": [None, "x", None]},
     "rhs": {"shape": [32, 4, 8], "spec": [None, "x", None]}, "out_spec": [None, None, "x", None],
     "dtype": "float32", "mesh": {"x": 4}}
UP = {"equation": "bsd,df->bsf", "lhs": {"shape": [2, 16, 32], "spec": [None, "x", None]},
      "rhs": {"shape": [32, 12], "spec": [None, "x"]}, "out_spec": [None, None, "x"],
      "dtype": "float32", "mesh": {"x": 4}}
# the shared operand as rhs, other letter names: the same gather
UP_SWAPPED = {"equation": "ef,abe->abf", "lhs": {"shape": [32, 12], "spec": [None, "x"]},
              "rhs": {"shape": [2, 16, 32], "spec": [None, "x", None]}, "out_spec": [None, None, "x"],
              "dtype": "float32", "mesh": {"x": 4}}

# rank-12 operands (9 size-1 batch letters): 8 of them take 8 * 38 + 7 characters joined
WIDE = {"equation": "bsdABCDEFGHI,dhABCDEFGHI->bshABCDEFGHI",
        "lhs": {"shape": [2, 16, 32] + [1] * 9, "spec": [None, "x"] + [None] * 10},
        "rhs": {"shape": [32, 4] + [1] * 9, "spec": [None, "x"] + [None] * 9},
        "out_spec": [None, None, "x"] + [None] * 9, "dtype": "float32", "mesh": {"x": 4}}


def test_round_trip_pattern_and_views() -> None:
    gp = GroupedProblem.from_dict({"einsums": [Q, UP, UP_SWAPPED]})
    assert GroupedProblem.from_json(json.dumps(gp.to_dict())) == gp
    assert gp.pattern.label == "all_gather_group3:free" and gp.pattern.axis == "x" and gp.pattern.dim == 1
    assert gp.k == 3 and gp.axis_size == 4 and gp.dtype == "float32"
    assert gp.gathered.shape == (2, 16, 32) and [w.shape for w in gp.weights()] == [(32, 4, 8), (32, 12), (32, 12)]
    assert gp.equation == "bsd,dhk->bshk;bsd,df->bsf;ef,abe->abf"
    f = gp.features()
    assert f["n"] == 32 + 12 + 12 and f["comm_bytes"] == Problem.from_dict(Q).comm_bytes()
    assert f["flops"] == sum(Problem.from_dict(d).features()["flops"] for d in (Q, UP, UP_SWAPPED))
    assert "group of 3" in gp.describe()


def test_key_ignores_order_and_letter_names_and_differs_from_single_keys() -> None:
    a = GroupedProblem.from_dict({"einsums": [Q, UP]})
    b = GroupedProblem.from_dict({"einsums": [UP, Q]})
    renamed = copy.deepcopy(UP)
    renamed["equation"] = "xyz,zw->xyw"
    c = GroupedProblem.from_dict({"einsums": [renamed, Q]})
    assert a.key == b.key == c.key
    assert a.key not in {Problem.from_dict(Q).key, Problem.from_dict(UP).key}
    assert GroupedProblem.from_dict({"einsums": [Q, UP, UP]}).key != a.key
    bf16 = [{**d, "dtype": "bfloat16"} for d in (Q, UP)]
    assert GroupedProblem.from_dict({"einsums": bf16}).key != a.key


def test_problem_from_dict_tells_the_two_forms_apart() -> None:
    assert isinstance(problem_from_dict(Q), Problem)
    assert isinstance(problem_from_dict({"einsums": [Q, UP]}), GroupedProblem)


@pytest.mark.parametrize(("doc", "field", "words"), [
    ({"einsums": [Q]}, "einsums", "2 to 8"),
    ({"einsums": [WIDE] * 8}, "einsums", "characters"),
    ({"einsums": "Q"}, "einsums", "expected a list"),
    ({"einsums": [Q, UP], "dtype": "float32"}, "dtype", "unknown field"),
    ({"einsums": [Q, {**UP, "dtype": "bfloat16"}]}, "einsums[1].dtype", "differs"),
    ({"einsums": [Q, {**UP, "equation": "bsd,df"}]}, "einsums[1].equation", "'->'"),
    ({"einsums": [Q, {**UP, "lhs": {"shape": [2, 8, 32], "spec": [None, "x", None]}}]}, "einsums[1].lhs",
     "not einsums[0]'s"),
    ({"einsums": [Q, {**UP, "lhs": {"shape": [2, 16, 32], "spec": ["x", None, None]},
                      "out_spec": ["x", None, None]}]}, "einsums[1]", ""),
    ({"einsums": [Q, {**UP, "lhs": {"shape": [2, 16, 32], "spec": [None, None, "x"]},
                      "rhs": {"shape": [32, 12], "spec": ["x", None]}, "out_spec": [None, "x", None]}]},
     "einsums[1].out_spec", "reduce_scatter"),
])
def test_errors_name_the_member_and_field(doc: dict, field: str, words: str) -> None:
    with pytest.raises(ProblemError) as e:
        GroupedProblem.from_dict(doc)
    assert e.value.field.startswith(field), e.value
    assert words in str(e.value)


def test_problems_files_hold_both_forms(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(Q) + "\n" + json.dumps({"einsums": [Q, UP]}) + "\n")
    got = load_problems(path)
    assert isinstance(got[0], Problem) and isinstance(got[1], GroupedProblem)
    path.write_text(json.dumps({"einsums": [Q, {**UP, "mesh": {"x": 2}}]}) + "\n")
    with pytest.raises(ProblemsFileError, match=r"line 1: einsums\[1\]"):
        load_problems(path)
