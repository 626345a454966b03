"""The random_calculation task (Wu et al. 2025's RandomCalculation): seeded, exact, disjoint splits."""

import ast
import re
from fractions import Fraction

import pytest

from anabranch.config import ConfigError, TaskConfig
from anabranch.data.random_calculation import Node, generate, render
from anabranch.data.files import DataError
from anabranch.data.tasks import load_task


def independent_value(expr: str) -> Fraction:
    """The expression's value from Python's own parser, operands as Fractions (not the generator's tree)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}

    def ev(n):
        if isinstance(n, ast.BinOp):
            return ops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        assert isinstance(n, ast.Constant) and isinstance(n.value, int)
        return Fraction(n.value)

    return ev(ast.parse(expr, mode="eval").body)


def n_ops(expr: str) -> int:
    return sum(isinstance(n, ast.BinOp) for n in ast.walk(ast.parse(expr, mode="eval")))


def test_same_seed_same_problems_other_seed_other_problems():
    params = {"max_steps": 4}
    a, b, c = generate(3, 50, params), generate(3, 50, params), generate(4, 50, params)
    assert a == b
    assert [r["question"] for r in a] != [r["question"] for r in c]


def test_answers_match_an_independent_evaluation_and_steps_are_respected():
    params = {"min_steps": 2, "max_steps": 5, "min_value": -9, "max_value": 30}
    rows = generate(0, 300, params)
    fractional = 0
    for r in rows:
        gold = independent_value(r["expression"])
        assert Fraction(r["answer"]) == gold, r
        # Lowest terms, and an integer written without a denominator.
        assert r["answer"] == (str(gold.numerator) if gold.denominator == 1 else f"{gold.numerator}/{gold.denominator}")
        fractional += gold.denominator != 1
        assert 2 <= r["steps"] <= 5 and n_ops(r["expression"]) == r["steps"]
        assert r["expression"] in r["question"]
        assert all(-9 <= int(x) <= 30 for x in re.findall(r"-?\d+", r["expression"]))
    assert {r["steps"] for r in rows} == {2, 3, 4, 5}
    assert fractional > 0  # division makes non-integer answers, kept exact


def test_only_needed_parentheses():
    n = {v: Node(Fraction(v)) for v in (1, 2, 3)}
    sub = Node(Fraction(-1), "-", n[2], n[3])  # 2 - 3
    assert render(Node(Fraction(2), "-", n[1], sub)) == "1 - (2 - 3)"
    assert render(Node(Fraction(-4), "-", sub, n[1])) == "2 - 3 - 1"
    assert render(Node(Fraction(-1), "*", n[1], sub)) == "1 * (2 - 3)"
    assert render(Node(Fraction(0), "+", n[1], sub)) == "1 + 2 - 3"
    assert render(Node(Fraction(2, 3), "/", n[2], Node(Fraction(3), "*", n[1], n[3]))) == "2 / (1 * 3)"
    assert render(Node(Fraction(-1), "+", Node(Fraction(-2)), n[1])) == "(-2) + 1"


def test_splits_are_disjoint_reproducible_and_sized():
    cfg = TaskConfig(name="random_calculation", train_size=400, eval_size=40, seed=5,
                     params={"min_steps": 1, "max_steps": 1, "max_value": 9, "operators": ["+"]})
    train, held = load_task(cfg)
    assert len(held) == 40 and len({r["question"] for r in held}) == 40
    # 81 distinct one-step sums: many of the 400 draws repeat a held-out one and must be gone.
    assert 0 < len(train) < 400
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert load_task(cfg) == (train, held)
    assert all(r["task"] == "random_calculation" for r in train + held)


def test_gold_answers_get_full_math_verify_credit():
    from anabranch.rewards.registry import REWARDS

    rows = generate(1, 20, {"max_steps": 3})
    scores = REWARDS.get("math_verify")([r["question"] for r in rows],
                                        [f"The result is \\boxed{{{r['answer']}}}" for r in rows],
                                        answer=[r["answer"] for r in rows])
    assert scores == [1.0] * 20


@pytest.mark.parametrize("params, key", [
    ({"steps": 3}, "steps"),
    ({"min_steps": 0}, "task.params.min_steps"),
    ({"min_steps": 3, "max_steps": 2}, "task.params.max_steps"),
    ({"min_value": 5, "max_value": 1}, "task.params.max_value"),
    ({"max_value": 2.5}, "task.params.max_value"),
    ({"operators": ["+", "^"]}, "task.params.operators"),
    ({"operators": ["/"], "min_value": 0, "max_value": 0}, "task.params"),
])
def test_bad_params_are_refused_naming_the_key(params, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_task(TaskConfig(name="random_calculation", train_size=5, eval_size=2, params=params))


def test_a_small_parameter_space_warns_when_fewer_than_eval_size_problems_are_held_out(caplog):
    # 81 distinct one-step sums; the 320 held-out draws of seed 2 reach only 79 of them.
    cfg = TaskConfig(name="random_calculation", train_size=400, eval_size=80, seed=2,
                     params={"min_steps": 1, "max_steps": 1, "max_value": 9, "operators": ["+"]})
    with caplog.at_level("WARNING", logger="anabranch.data.tasks"):
        train, held = load_task(cfg)
    assert len(held) == 79 and 0 < len(train)
    assert "task.eval_size=80" in caplog.text and "only 79 distinct held-out problems" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="anabranch.data.tasks"):
        load_task(TaskConfig(name="random_calculation", train_size=50, eval_size=5, seed=2))
    assert "distinct held-out" not in caplog.text  # a space large enough: no warning
    # Every training draw is a held-out problem: refused, naming the keys to change.
    with pytest.raises(DataError, match="no training problems left.*task.eval_size"):
        load_task(TaskConfig(name="random_calculation", train_size=50, eval_size=20, seed=0,
                             params={"min_steps": 1, "max_steps": 1, "max_value": 3, "operators": ["+"]}))


@pytest.mark.parametrize("override, key", [
    ("task.params.max_steps=-1", "task.params.max_steps"),
    ("task.params.operators=[^]", "task.params.operators"),
    ("task.params.depth=2", "depth"),
])
def test_bad_params_are_refused_at_config_load(override, key):
    from anabranch.config import load_config

    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, ["task.name=random_calculation", override])
    load_config(None, ["task.name=random_calculation", "task.params.max_steps=4"])  # a good one loads
