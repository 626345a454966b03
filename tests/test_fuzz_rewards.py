"""Fuzzing the answer extractors and reward parsers with arbitrary, very long and adversarial
text: each returns a value of the promised kind, or its controlled failure value, within a time
bound; none raises out of the reward layer or hangs.

To fuzz a new extractor or parser, add one entry to ``TARGETS``: a name and a function of one
text that calls it (with that text as the completion, the gold answer, or both) and returns the
value; ``check`` says which values are allowed.
"""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anabranch.rewards import math_answer
from anabranch.rewards.compose import build_rewards, score
from anabranch.config import RewardConfig, RewardFunctionConfig

# Seconds one call may take. The comparison time limit is lowered to 1 s for the test (below), so a
# parse that blows up (power towers, deep nesting) is cut off; the bound is below the 5 s default,
# so it fails if the limit were not applied.
BOUND_S = 3.0


def reward_values(values):
    assert isinstance(values, list) and all(v in (0.0, 1.0) for v in values), values
    return values


TARGETS = {
    # name: (call on one text, check of what it returned)
    "math_verify completion": (lambda t: math_answer.math_verify_reward(["p"], [t], answer=["7"]), reward_values),
    "math_verify gold": (lambda t: math_answer.math_verify_reward(["p"], ["\\boxed{7}"], answer=[t]), reward_values),
    "math_verify both": (lambda t: math_answer.math_verify_reward(["p"], [t], answer=[t[:50]]), reward_values),
    "score() layer": (lambda t: score(build_rewards(RewardConfig([RewardFunctionConfig("math_verify")])),
                                      ["p"], [t], [{"answer": "7"}])[0], reward_values),
}

# Pieces of LaTeX and numbers that stress parsers: unbalanced and deep nesting, huge exponents,
# huge numbers, stray delimiters, control characters and non-ASCII.
FRAGMENTS = ["\\boxed{", "}", "{", "\\frac{", "}{", "^", "^{", "2", "9" * 50, "$", "$$", "\\(", "\\)",
             "\\sqrt{", "\\left(", "\\right)", "(", ")", "=", "x", "\\infty", "1e9999", "/0", "\\\\",
             "Answer:", "\n", "\x00", "\u200b", "∞", "½", "\\text{", "%", "...", "-", ".", ","]

adversarial = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=300).map("".join)
long_text = st.tuples(st.sampled_from(FRAGMENTS + ["a", "7 "]), st.integers(2_000, 60_000)).map(
    lambda p: p[0] * p[1])


@pytest.fixture(autouse=True)
def short_math_verify_timeouts(monkeypatch):
    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1.0)
    math_answer._parse_gold.cache_clear()
    # The process's first comparison imports math-verify and sympy outside the limit (seconds on a
    # cold, busy machine); that one-time cost is not the parse time this file bounds.
    math_answer._warm_up()


def run_bounded(name, text):
    call, check = TARGETS[name]
    t0 = time.perf_counter()
    value = call(text)  # any exception fails the test: nothing may escape
    elapsed = time.perf_counter() - t0
    assert elapsed < BOUND_S, f"{name} took {elapsed:.1f}s on {text[:80]!r}..."
    check(value)


FUZZ = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.mark.parametrize("name", sorted(TARGETS))
@FUZZ
@given(text=st.text(max_size=400))
def test_arbitrary_text(name, text):
    run_bounded(name, text)


@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(FUZZ, max_examples=6)
@given(text=adversarial)
def test_adversarial_latex(name, text):
    run_bounded(name, text)


@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(FUZZ, max_examples=3)
@given(text=long_text)
def test_very_long_text(name, text):
    run_bounded(name, text)


@pytest.mark.parametrize("text", [
    "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",  # a power tower sympy would try to evaluate
    "\\boxed{" * 2000,  # unbalanced
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",  # deep nesting
    "9" * 100_000,  # a huge integer
])
def test_known_hard_inputs(text):
    for name in TARGETS:
        run_bounded(name, text)


def test_time_limit_survives_a_swallowed_timeout():
    # Code that eats the first timeout (as a destructor or a broad except can) is still stopped.
    from anabranch.rewards.time_limit import TimeLimitExceeded, time_limit

    t0, swallowed = time.perf_counter(), 0
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.2):
            while True:
                try:
                    while True:
                        pass
                except TimeLimitExceeded:
                    swallowed += 1
                    if swallowed > 3:
                        raise
    assert swallowed == 4 and time.perf_counter() - t0 < 2
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is off afterwards


def test_correct_answers_still_score_one():
    # The guard rails do not turn right answers into zeros.
    assert math_answer.math_verify_reward(["p"] * 3, ["so \\boxed{7}", "The answer is 7", "\\boxed{8}"],
                                          answer=["7", "7", "7"]) == [1.0, 1.0, 0.0]
