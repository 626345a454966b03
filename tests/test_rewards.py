import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from anabranch.config import ConfigError, RewardConfig, RewardFunctionConfig
from anabranch.rewards import build_rewards, score
from anabranch.rewards.math_answer import math_verify_reward

SRC = str(Path(__file__).parents[1] / "src")


@pytest.mark.parametrize("completion,answer,expected", [
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("so 7 + 5 = 12", "12", 1.0),
    ("First 3, then 4, finally 10", "10", 1.0),      # the last number counts
    ("It is 12, not 13", "12", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),           # equivalence, not string match
    ("no number here", "3", 0.0),
    ("-4", "-4", 1.0),
    ("", "1", 0.0),
])
def test_math_verify_reward(completion, answer, expected):
    assert math_verify_reward(["p"], [completion], answer=[answer]) == [expected]


def test_math_verify_works_off_the_main_thread():
    out = {}

    def run():
        out["r"] = math_verify_reward(["p", "p"], ["\\boxed{5}", "6"], answer=["5", "5"])

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out["r"] == [1.0, 0.0]


def test_user_function_by_module_path_and_weights(monkeypatch):
    mod = types.ModuleType("my_rewards")
    mod.length = lambda prompts, completions, **kw: [float(len(c)) for c in completions]
    monkeypatch.setitem(sys.modules, "my_rewards", mod)
    cfg = RewardConfig(functions=[RewardFunctionConfig("math_verify", 1.0),
                                  RewardFunctionConfig("my_rewards:length", 0.5)])
    sources = build_rewards(cfg)
    total, per = score(sources, ["p", "p"], ["12", "abc"], [{"answer": "12"}, {"answer": "12"}])
    assert per == {"math_verify": [1.0, 0.0], "my_rewards:length": [2.0, 3.0]}
    assert total == [1.0 + 0.5 * 2.0, 0.0 + 0.5 * 3.0]


def test_unknown_reward_and_bad_module():
    with pytest.raises(ConfigError, match="Did you mean 'math_verify'"):
        build_rewards(RewardConfig(functions=[RewardFunctionConfig("math_verfy")]))
    with pytest.raises(ConfigError, match="no_such_module"):
        build_rewards(RewardConfig(functions=[RewardFunctionConfig("no_such_module:fn")]))


def test_a_timeout_during_the_first_import_does_not_break_sympy():
    """The first comparison of a process imports math-verify and sympy, which can take seconds: a
    time limit firing inside that import would leave sympy half-imported for the whole process.
    Run in a fresh interpreter (sympy not yet imported) with a limit far shorter than the import
    (without the warm-up outside the limit: a RecursionError or every later comparison False)."""
    code = (
        "import sys\n"
        "import anabranch.rewards.math_answer as m\n"
        "assert 'sympy' not in sys.modules\n"
        "m.TIMEOUT_S = 0.05\n"
        "m.is_equivalent('\\\\boxed{2}', '2')\n"
        "m.TIMEOUT_S = 5.0\n"
        "import sympy\n"
        "print(m.is_equivalent('\\\\boxed{1/2}', '0.5'), m.answers_equivalent('3', '6/2'),"
        " sympy.printing.sstr(sympy.Rational(1, 2)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "1/2"]
