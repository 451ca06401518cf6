"""The built-in arithmetic word-problem generator: determinism, splits, levels, answers."""

from __future__ import annotations

import ast
import operator
import re

import pytest

from qerl_pipeline.config import GeneratorConfig
from qerl_pipeline.data.generator import LEVELS, generate_splits, split_of
from qerl_pipeline.rewards import gold_is_parseable

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(expr: str) -> float:
    """Evaluate 'a op b' with + - * / only (no eval())."""

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected expression {expr!r}")

    return walk(ast.parse(expr, mode="eval").body)


def test_same_seed_same_problems_and_other_seed_differs():
    cfg = GeneratorConfig(n_train=300, n_test=60, levels=[1, 2, 3, 4, 5], seed=7)
    a, b = generate_splits(cfg), generate_splits(cfg)
    assert a == b
    c = generate_splits(cfg.model_copy(update={"seed": 8}))
    assert [p.question for p in a["train"]] != [p.question for p in c["train"]]


def test_sizes_and_disjoint_splits():
    out = generate_splits(GeneratorConfig(n_train=500, n_test=100, levels=[1, 2], seed=3))
    assert len(out["train"]) == 500 and len(out["test"]) == 100
    train_q = {p.question for p in out["train"]}
    test_q = {p.question for p in out["test"]}
    assert len(train_q) == 500 and len(test_q) == 100  # no duplicates
    assert not train_q & test_q
    assert all(split_of(q) == "test" for q in test_q) and all(split_of(q) == "train" for q in train_q)
    assert len({p.id for p in out["train"] + out["test"]}) == 600


def test_test_split_does_not_depend_on_n_train():
    small = generate_splits(GeneratorConfig(n_train=50, n_test=40, levels=[1, 2, 3], seed=11))
    large = generate_splits(GeneratorConfig(n_train=400, n_test=40, levels=[1, 2, 3], seed=11))
    assert small["test"] == large["test"]


@pytest.mark.parametrize("level", LEVELS)
def test_answers_are_correct_for_every_level(level):
    out = generate_splits(GeneratorConfig(n_train=120, n_test=30, levels=[level], seed=level))
    for p in out["train"] + out["test"]:
        assert p.level == level
        assert isinstance(p.answer, int) and p.answer >= 0, p
        values = {}
        for step in p.steps:
            expr, result = step.split(" = ")
            value = _eval(expr)
            assert value == int(result), f"{p.id}: step {step!r} is wrong"
            values[int(result)] = True
        assert int(p.steps[-1].split(" = ")[1]) == p.answer, p
        # every number a step starts from appears in the question or is an earlier result
        given = {int(n) for n in re.findall(r"\d+", p.question)}
        for step in p.steps:
            for n in re.findall(r"\d+", step.split(" = ")[0]):
                assert int(n) in given or int(n) in values, f"{p.id}: {n} in {step!r} comes from nowhere"
        assert gold_is_parseable(str(p.answer))


def test_levels_get_harder():
    out = generate_splits(GeneratorConfig(n_train=200, n_test=20, levels=list(LEVELS), seed=5))
    by_level = {lv: [p for p in out["train"] if p.level == lv] for lv in LEVELS}
    assert all(len(v) >= 30 for v in by_level.values())  # levels are balanced
    # level 1: one small +/- step; higher levels: more steps and larger numbers on average
    assert all(len(p.steps) == 1 and re.fullmatch(r"\d+ [+-] \d+ = \d+", p.steps[0]) for p in by_level[1])
    assert all(p.answer <= 40 and max(map(int, re.findall(r"\d+", p.question))) <= 20 for p in by_level[1])
    mean_steps = [sum(len(p.steps) for p in by_level[lv]) / len(by_level[lv]) for lv in LEVELS]
    mean_max_number = [
        sum(max(map(int, re.findall(r"\d+", p.question))) for p in by_level[lv]) / len(by_level[lv]) for lv in LEVELS
    ]
    assert mean_steps[0] < mean_steps[2] <= mean_steps[4]
    assert mean_max_number == sorted(mean_max_number)
    assert any("*" in s for p in by_level[3] for s in p.steps)
    assert any("/" in s for p in by_level[4] for s in p.steps)


def test_unknown_level_is_an_error():
    with pytest.raises(ValueError, match="level 9 unknown"):
        generate_splits(GeneratorConfig(n_train=5, n_test=5, levels=[9]))
