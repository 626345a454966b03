"""Reward bugs found by auditing the rewards against realistic completions; each test fails
without its fix."""

import pytest

from anabranch.rewards.extract import extract_answer, extract_answer_line, extract_boxed
from anabranch.rewards.majority_vote import majority_vote_reward
from anabranch.rewards.math_answer import answers_equivalent, math_verify_reward
from anabranch.rewards.reasoning_gym_score import reasoning_gym_reward
from anabranch.rewards.sandbox import SandboxLimits, run_tests


# --- answer extraction -------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    # The answer line ends with its sentence: the text after it is not part of the answer.
    ("The answer is 12. There were 5 apples left over.", "12"),
    ("So the answer is 7. I hope this helps! Ask me 2 more questions.", "7"),
    ("The answer is $\\frac{1}{2}$. Simplify 2/4 to check.", "\\frac{1}{2}"),
    # The last lead-in on the line, not the first: the Minerva/MATH "Final Answer" format.
    ("Final Answer: The final answer is $7$. I hope it is correct.", "7"),
    # Decimal points and a final full stop are still handled.
    ("The answer is 3.5.", "3.5"),
    ("Answer: 8 after 9", "8 after 9"),
    ("The answer is 5! = 120", "5! = 120"),  # a factorial, not the end of a sentence
])
def test_answer_line_is_the_answer_not_the_rest_of_the_line(text, expected):
    assert extract_answer_line(text) == expected
    assert extract_answer(text) == expected


def test_boxed_without_braces_does_not_take_a_later_brace():
    # "\boxed 7" is math-verify's brace-less form; the "{" of a later \frac is not its content.
    assert extract_boxed("The answer is \\boxed 7, since f(x) = \\frac{1}{2}") == "7"
    assert extract_boxed("\\boxed {5}") == "5"
    assert extract_boxed("so \\boxed7 is it") == "7"  # was "is", the word after the command
    assert extract_boxed("\\boxed{a{b}c}") == "a{b}c"


def test_majority_vote_counts_the_stated_answer_not_a_later_number():
    # Completion 0 says 12 and then mentions 5: it must vote for 12 (with completions 2 and 3),
    # not for 5 (with completion 1). Before the fix its vote was read as "5" and, on the tie, the
    # three completions answering 12 were split 1 / 2 and two of them got reward 0.
    completions = ["The answer is 12. There were 5 apples left over.", "The answer is 5.",
                   "\\boxed{12}", "so 12"]
    out = majority_vote_reward(None, completions, group_index=[0] * 4, answer=["12"] * 4)
    assert out.values == [1.0, 0.0, 1.0, 1.0]
    assert out.metrics["label_accuracy"] == 1.0
    assert out.metrics["reward_accuracy"] == 1.0


def test_reasoning_gym_reward_reads_the_answer_sentence():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1, min_terms=2, max_terms=2,
                                      min_digits=1, max_digits=1, operators=["+"])
    e = ds[0]
    a = int(e["answer"])
    comps = [f"The answer is {a}. I first computed {a + 1}, then corrected it.", f"The answer is {a + 1}."]
    assert reasoning_gym_reward(None, comps, rg_entry=[e, e], rg_dataset=[ds, ds]) == [1.0, 0.0]


# --- gold answers ------------------------------------------------------------------------------

def test_gold_with_an_escaped_dollar_sign_is_parsed():
    # MATH-style money answers ("\$18.90"): the escaped "\$" is not a math delimiter. Before the
    # fix the gold was not wrapped in $...$, math-verify found nothing in it, and every
    # completion, right or wrong, scored 0.
    assert math_verify_reward(["p"] * 3, ["The total is \\boxed{18.90}", "\\boxed{\\$18.9}", "\\boxed{18.91}"],
                              answer=["\\$18.90"] * 3) == [1.0, 1.0, 0.0]
    assert answers_equivalent("\\$18.90", "18.9")
    assert not answers_equivalent("\\$18.90", "18.91")


# --- code sandbox ------------------------------------------------------------------------------

LIMITS = SandboxLimits(wall_s=10)


def test_output_without_a_newline_does_not_hide_a_pass():
    # A test that prints without a trailing newline: the harness's "<nonce> PASS i" then shares
    # the line with that text, and was not recognised.
    res = run_tests("def f(x):\n    return 2 * x\n", ['print(f(1), end="")\nassert f(1) == 2', "assert f(3) == 6"],
                    limits=LIMITS)
    assert (res.passed, res.total, res.all_passed) == (2, 2, True)
    res = run_tests('print("hi", end="")\ndef f(x):\n    return 2 * x\n', ["assert f(1) == 2"], limits=LIMITS)
    assert res.all_passed and res.error == ""


def test_more_output_than_the_kept_tail_does_not_lose_passes():
    # Only the last output_kb of stdout is kept for the report, but every PASS line counts: a
    # test printing 100 kB must not erase the passes reported before it.
    tests = ["assert f(1) == 2", 'print("x" * 100_000)\nassert f(2) == 4', "assert f(3) == 6"]
    res = run_tests("def f(x):\n    return 2 * x\n", tests, limits=LIMITS)
    assert (res.passed, res.passed_ids, res.error) == (3, [0, 1, 2], "")
    assert len(res.stdout) <= LIMITS.output_kb * 1024


def test_python3_fenced_code_is_the_program():
    # "```python3" (and other Python info strings) is a Python block; before the fix only
    # python/py/Python were recognised, the raw completion (fences and prose) was run and failed.
    from anabranch.rewards.code_exec import code_tests_reward, extract_code

    body = "def f(x):\n    return 2 * x\n"
    assert extract_code(f"Here:\n```python3\n{body}```\nDone.") == body
    assert extract_code(f"```py3\n{body}```") == body
    # A non-Python block after the program (its output) is not taken as the program.
    assert extract_code(f"```python\n{body}```\nOutput:\n```text\n2\n```") == body
    out = code_tests_reward(["p"], [f"Sure.\n```python3\n{body}```"], tests=[["assert f(2) == 4"]],
                            entry_point=["f"], wall_s=10)
    assert out.values == [1.0]


# --- composition -------------------------------------------------------------------------------

def test_a_source_listed_twice_keeps_both_values_and_the_first_under_its_name():
    # per_source[name] is what accuracy and dynamic sampling read for the correctness source (the
    # first one listed); a second entry of the same function with other params must not overwrite
    # it, and its own values must still be reported.
    from anabranch.config import RewardConfig, RewardFunctionConfig
    from anabranch.rewards import build_rewards, score_detailed

    sources = build_rewards(RewardConfig([RewardFunctionConfig("format", 1.0),
                                          RewardFunctionConfig("format", 0.5, {"pattern": "x"})]))
    out = score_detailed(sources, ["p", "p"], ["<think>a</think><answer>1</answer>", "x"], [{}, {}])
    assert out.total == [1.0, 0.5]
    assert out.per_source == {"format": [1.0, 0.0], "format#2": [0.0, 1.0]}
    assert out.metrics == {"reward/format/failures": 0.0, "reward/format#2/failures": 0.0}


# --- format reward -----------------------------------------------------------------------------

def test_format_reward_is_linear_on_a_truncated_answer():
    # A completion cut off inside <answer> (no closing tag) is common at the length limit. The old
    # default pattern "(?:...)*\S(?:...)*" backtracked quadratically: 8,000 characters took 0.8 s
    # and 40,000 about 20 s, so a batch of them ran past the reward deadline.
    import time

    from anabranch.rewards.format_reward import format_reward

    start = time.perf_counter()
    out = format_reward(None, ["<think>x</think><answer>" + "a" * 40_000,
                               "<think>x</think><answer>" + "a" * 40_000 + "</answer> trailing"])
    assert out == [0.0, 0.0]
    assert time.perf_counter() - start < 1.0
    # The layout it accepts is unchanged.
    assert format_reward(None, ["<think>a</think>\n<answer> 1 </answer>", "<think></think><answer>x</answer>",
                                "<think>a</think><answer> \n </answer>", "<think>a</think><answer><answer>1</answer>",
                                "<think>a</think><answer>1</answer></answer>"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_code_extraction_is_linear_on_adversarial_fences():
    import time

    from anabranch.rewards.code_exec import extract_code

    # The old fence pattern "```[ \t]*(?:python)?[ \t]*\n" split a run of spaces between its two
    # "[ \t]*" in every way: 50,000 spaces after "```" took about 2 s.
    start = time.perf_counter()
    for text in ["```" + "x" * 50_000, "```" + " " * 50_000, "```\n" * 20_000, "```x" * 20_000]:
        extract_code(text)
    assert time.perf_counter() - start < 1.0


_AS_USER = """
import sys, threading
sys.path.insert(0, sys.argv[1])
import sandbox
stop = threading.Event()
for _ in range(100):  # a trainer's thread pools: more tasks than SandboxLimits.nproc
    threading.Thread(target=stop.wait, daemon=True).start()
ns = sandbox.namespaces_available()
res = sandbox.run_tests("def f(x):\\n    return 2 * x\\n", ["assert f(1) == 2"], limits=sandbox.SandboxLimits(wall_s=10))
print(ns, res.passed, res.total, repr(res.error))
stop.set()
"""


def test_a_non_root_trainer_with_many_threads_can_run_programs(tmp_path):
    # RLIMIT_NPROC counts every task of the real user, the trainer's threads included. With a
    # bare limit of 64, a non-root trainer holding 100 threads got "unshare: fork failed" for every
    # program (reward 0), or the probe silently turned the namespaces off. Run as "nobody" with
    # the system Python (the venv's Python may not be readable by that user).
    import os
    import shutil
    import stat
    import subprocess
    import tempfile
    from pathlib import Path

    import anabranch.rewards.sandbox as sandbox

    python, setpriv = "/usr/bin/python3", shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None or not os.path.exists(python) or not sandbox.namespaces_available():
        pytest.skip("needs root (to switch to an unprivileged user), setpriv, /usr/bin/python3 and user namespaces")
    folder = Path(tempfile.mkdtemp(prefix="anabranch-nproc-"))
    try:
        folder.chmod(0o755)
        for name in ("sandbox.py", "sandbox_harness.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), folder / name)
            (folder / name).chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        probe = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                                f"import sys; sys.path.insert(0, {str(folder)!r}); import sandbox; "
                                "print(sandbox.namespaces_available())"],
                               capture_output=True, text=True, timeout=60, cwd=folder)
        if probe.stdout.strip() != "True":
            pytest.skip(f"user namespaces do not work for an unprivileged user here: {probe.stderr[-300:]}")
        out = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", _AS_USER,
                              str(folder)], capture_output=True, text=True, timeout=60, cwd=folder)
        assert out.stdout.split() == ["True", "1", "1", "''"], (out.stdout, out.stderr[-1000:])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_nproc_limit_is_counted_on_top_of_the_users_tasks(monkeypatch):
    import anabranch.rewards.sandbox as sandbox

    limits = SandboxLimits(nproc=64)
    monkeypatch.setattr(sandbox, "_user_tasks", lambda: 500)
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 1000)
    assert sandbox._nproc_limit(limits) == 564
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 0)  # the kernel exempts root: the bare limit
    assert sandbox._nproc_limit(limits) == 64


def test_tests_given_as_one_string_are_one_test():
    # A "tests" column holding one snippet as a string: list() of it made each character a test,
    # and the blank and digit ones passed, so a wrong program scored 0.375 here.
    from anabranch.rewards.code_exec import code_tests_reward

    out = code_tests_reward(["p"] * 2, ["def f(x):\n    return 0\n", "def f(x):\n    return 2 * x\n"],
                            tests=["assert f(1) == 2"] * 2, wall_s=10)
    assert out.values == [0.0, 1.0]
