"""One answer-extraction order everywhere (<answer> tag, then \\boxed, ...) and Unicode minus/spaces."""

import pytest

from anabranch.eval.answers import canonical_number
from anabranch.eval.answers import extract_answer as eval_answer
from anabranch.rewards.extract import extract_answer, extract_last_number
from anabranch.rewards.majority_vote import majority_vote_reward
from anabranch.rewards.math_answer import answers_equivalent, math_verify_reward
from anabranch.rewards.reasoning_gym_score import reasoning_gym_reward

# An intermediate result boxed in the reasoning, then the explicit final answer in the tag.
BOXED_THEN_TAG = "First \\boxed{3} apples, then twice as many plus one.\n<answer>7</answer>"


class Scorer:
    """Stands in for a reasoning-gym dataset: records what the reward passes to score_answer."""

    def __init__(self):
        self.seen = []

    def score_answer(self, answer, entry):
        self.seen.append(answer)
        return float(answer == entry["answer"])


def test_answer_tag_wins_over_an_earlier_boxed():
    assert extract_answer(BOXED_THEN_TAG) == "7"
    assert eval_answer(BOXED_THEN_TAG) == "7"


def test_boxed_inside_the_answer_tag_is_unwrapped():
    assert extract_answer("<answer>\\boxed{\\frac{1}{2}}</answer>") == "\\frac{1}{2}"
    assert extract_answer("<answer>so it is \\boxed{12}.</answer>") == "12"
    # Without a tag, \boxed still comes before the "Answer:" line and the last number.
    assert extract_answer("\\boxed{5} Answer: 6, then 8") == "5"
    # An empty tag carries no answer: the next form is used.
    assert extract_answer("<answer> </answer> so \\boxed{4}") == "4"


def test_reasoning_gym_uses_the_shared_order():
    scorer = Scorer()
    texts = [BOXED_THEN_TAG, "<answer>\\boxed{7}</answer>", "\\boxed{7}", "<answer>\u22127</answer>"]
    out = reasoning_gym_reward(None, texts, rg_entry=[{"answer": "7"}] * 3 + [{"answer": "-7"}],
                               rg_dataset=[scorer] * 4)
    assert scorer.seen == ["7", "7", "7", "-7"]
    assert out == [1.0, 1.0, 1.0, 1.0]


def test_math_verify_gives_the_answer_tag_the_same_precedence():
    assert math_verify_reward(None, [BOXED_THEN_TAG, BOXED_THEN_TAG], answer=["7", "3"]) == [1.0, 0.0]
    tagged = ["<answer>\\boxed{\\frac{1}{2}}</answer>", "<answer>\\sqrt{2}</answer>", "<answer>x = 4</answer>"]
    assert math_verify_reward(None, tagged, answer=["1/2", "\\sqrt{2}", "4"]) == [1.0, 1.0, 1.0]
    # No tag: math-verify's own choice (the boxed answer) as before.
    assert math_verify_reward(None, ["it is \\boxed{3}, not 5"], answer=["3"]) == [1.0]


def test_majority_vote_reads_the_same_answer():
    out = majority_vote_reward(None, [BOXED_THEN_TAG, "<answer>7</answer>", "\\boxed{3}"], group_index=[0, 0, 0])
    assert list(out.values) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("minus", ["\u2212", "\u2013", "\u2012", "\ufe63", "\uff0d"])
def test_unicode_minus_matches_an_ascii_gold(minus):
    text = f"The total change is {minus}5"
    assert extract_last_number(text) == "-5"  # the sign was dropped: "5" would even match a gold 5
    assert extract_answer(f"\\boxed{{{minus}5}}") == "-5"
    assert eval_answer(f"Answer: {minus}5.") == "-5"
    assert canonical_number(f"{minus}2.50") == "-2.5"
    assert math_verify_reward(None, [text, f"so x = {minus}5", text], answer=["-5", "-5", "5"]) == [1.0, 1.0, 0.0]
    assert math_verify_reward(None, ["x = -5"], answer=[f"{minus}5"]) == [1.0]
    assert answers_equivalent(f"{minus}5", "-5")


def test_unicode_spaces_and_invisible_characters():
    from anabranch.rewards.extract import normalize_text

    assert normalize_text("1\u00a0000\u2009m\u200b2\u202f") == "1 000 m2 "
    assert extract_answer("<answer>\u00a0blue\u00a0</answer>") == "blue"
    assert eval_answer("Answer: 1\u200b2") == "12"
    # The em dash is punctuation, not a minus.
    assert extract_last_number("it was 5 \u2014 5 apples") == "5"
