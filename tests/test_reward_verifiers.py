import pytest

from anabranch.rewards.extract import (extract_answer, extract_answer_line, extract_boxed,
                                       extract_last_number)
from anabranch.rewards.format_reward import format_reward
from anabranch.rewards.length import overlong_penalty, target_length
from anabranch.rewards.math_answer import answers_equivalent
from anabranch.rewards.reasoning_gym_score import reasoning_gym_reward


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{{2}}", "{2}"),           # last box, nested braces kept
    ("\\boxed{unbalanced", None),
    ("", None),
    (None, None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("Answer: 42.", "42"),
    ("The final answer is **12**", "12"),
    ("**Answer:** 7", "7"),
    ("Answer = 9", "9"),
    ("I answered wrong: 5", None),     # "answered" is not "answer"
    ("Answer:", None),
])
def test_extract_answer_line(text, expected):
    assert extract_answer_line(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("so 1,234 and then 5", "5"),
    ("total 1,234", "1234"),
    ("-3/4 stuff", "-3/4"),
    ("pi is 3.14.", "3.14"),
    ("no digits", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_extract_answer_priority():
    assert extract_answer("Answer: 3 but \\boxed{4}") == "4"
    assert extract_answer("<answer>7</answer> Answer: 8") == "7"
    assert extract_answer("Answer: 8 after 9") == "8 after 9"
    assert extract_answer("x = 2, y = 5") == "5"


def test_extractors_are_fast_on_adversarial_text():
    import time

    t = time.perf_counter()
    for text in ["\\boxed{" * 20000, "{" * 50000, "answer " * 20000, "1," * 30000, "<answer>" * 20000]:
        extract_answer(text)
    assert time.perf_counter() - t < 2.0


def test_answers_equivalent():
    assert answers_equivalent("0.5", "\\frac{1}{2}")
    assert answers_equivalent("12", "12")
    assert not answers_equivalent("12", "13")
    assert not answers_equivalent(None, "1")


def test_format_reward():
    good = "<think>2+2 is 4</think>\n<answer>4</answer>"
    assert format_reward(None, [good, "4", "<think>x</think><answer> </answer>",
                                good + " extra", "<think>a<think>b</think><answer>1</answer>"]) == [1, 0, 0, 0, 0]
    assert format_reward(None, ["ANS 3"], pattern=r"ANS \d+") == [1.0]


def test_overlong_penalty_matches_dapo_formula():
    # L_max = 20, L_cache = 4: zero up to 16, linear to -1 at 20, -1 beyond.
    vals = overlong_penalty(None, ["x"] * 5, response_length=[10, 16, 18, 20, 25], max_length=20, cache_length=4)
    assert vals == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(None, ["a" * 18], max_length=20, cache_length=4) == [-0.5]  # characters


def test_target_length():
    assert target_length(None, ["x"] * 4, response_length=[10, 5, 15, 40], target=10) == [0.0, -0.5, -0.5, -1.0]
    with pytest.raises(ValueError):
        target_length(None, ["x"], target=0)


def test_reasoning_gym_scorer_uses_the_dataset():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=2, seed=1, min_terms=2, max_terms=2,
                                      min_digits=1, max_digits=1, operators=["+"])
    entries = [ds[0], ds[1]]
    right = [f"<answer>{e['answer']}</answer>" for e in entries]
    wrong = [f"Answer: {int(e['answer']) + 1}" for e in entries]
    vals = reasoning_gym_reward(None, right + wrong + ["nothing"], rg_entry=entries * 2 + [entries[0]],
                                rg_dataset=[ds] * 5)
    assert vals == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="reasoning-gym task"):
        reasoning_gym_reward(None, ["1"], answer=["1"])


def test_extractors_never_raise_on_arbitrary_text():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    alphabet = st.sampled_from(list("0123456789-.,/{}\\boxed answerAnswer:<>/ \n*=$"))

    @settings(max_examples=200, deadline=None)
    @given(st.one_of(st.text(), st.text(alphabet=alphabet)))
    def check(text):
        for fn in (extract_answer, extract_boxed, extract_answer_line, extract_last_number):
            out = fn(text)
            assert out is None or isinstance(out, str)

    check()
