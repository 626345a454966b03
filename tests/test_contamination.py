"""Partial-prompt leakage audit (Wu et al. 2025): truncation, ROUGE-L, the audit, and `anabranch eval`."""

import json

import pytest

from anabranch.config import ConfigError
from anabranch.eval.contamination import audit, report_table, rouge_l, truncate
from anabranch.eval.runner import EvalSettings, run_eval

ROWS = [
    {"question": "What is the sum of three and four apples in the basket?", "answer": "7"},
    {"question": "Compute the product of six and seven then report it", "answer": "42"},
    {"question": "How many legs do two spiders have in total together?", "answer": "16"},
]


def test_truncation_is_at_word_boundaries_and_keeps_one_word_each_side():
    assert truncate("a b c d e", 0.6) == ("a b c", ["d", "e"])
    assert truncate("a b c d e", 0.4) == ("a b", ["c", "d", "e"])
    assert truncate("a b c d e", 0.5) == ("a b c", ["d", "e"])  # 2.5 rounds half up
    assert truncate("a b c d e", 0.01) == ("a", ["b", "c", "d", "e"])
    assert truncate("a b c d e", 0.99) == ("a b c d", ["e"])
    # The original spacing of the kept part is kept; no word is ever cut in the middle.
    assert truncate("x  =  12345\n+ 678", 0.5) == ("x  =  12345", ["+", "678"])
    assert truncate("single", 0.5) is None


def test_rouge_l_against_hand_computed_values():
    # LCS("the cat sat on mat", "the cat on the mat") = "the cat on mat" = 4: P = R = 4/5.
    assert rouge_l("the cat sat on mat".split(), "the cat on the mat".split()) == pytest.approx(0.8)
    # LCS = 2, P = 2/2, R = 2/4: F1 = 2·1·0.5/1.5; F(β=2) = 5·1·0.5/(0.5 + 4·1).
    assert rouge_l(["a", "b"], ["a", "c", "b", "d"]) == pytest.approx(2 / 3)
    assert rouge_l(["a", "b"], ["a", "c", "b", "d"], beta=2) == pytest.approx(2.5 / 4.5)
    # Order matters (a subsequence, not a bag): LCS("b a", "a b") = 1.
    assert rouge_l(["b", "a"], ["a", "b"]) == pytest.approx(0.5)
    assert rouge_l(["x"], ["a", "b"]) == 0.0 and rouge_l([], ["a"]) == 0.0
    assert rouge_l(["a", "b", "c"], ["a", "b", "c"]) == 1.0


def scripted_model(memorized: dict[str, str]):
    """Greedy "model": continues the one memorized problem word for word (and then answers it),
    anything else with unrelated text."""
    def generate(prompts):
        out = []
        for p in prompts:
            full = next((q for q in memorized if q.startswith(p)), None)
            out.append(full[len(p):] + f" Answer: {memorized[full]}" if full else " lorem ipsum dolor")
        return out
    return generate


def judge(prompts, completions, rows):
    return [f"Answer: {r['answer']}" in c for c, r in zip(completions, rows)]


def test_scripted_model_that_memorized_one_problem_completes_it_exactly():
    gen = scripted_model({ROWS[1]["question"]: ROWS[1]["answer"]})
    res = audit(gen, judge, ROWS, [0.4, 0.8])["ratios"]
    assert list(res) == ["0.4", "0.8"]
    for v in res.values():
        assert v["problems"] == 3 and v["skipped"] == 0
        assert v["memorized"] == [1]
        assert v["completion_exact_match"] == pytest.approx(1 / 3)
        assert v["answer_accuracy"] == pytest.approx(1 / 3)
        assert v["rouge_l"] == pytest.approx(1 / 3)  # 1.0 on the memorized problem, 0 on the others
    only = audit(gen, judge, [ROWS[1]], [0.6])["ratios"]["0.6"]
    assert only["completion_exact_match"] == 1.0 and only["rouge_l"] == 1.0 and only["answer_accuracy"] == 1.0


def test_partial_recall_gives_rouge_between_zero_and_one_and_no_exact_match():
    q = "alpha beta gamma delta epsilon zeta eta theta"  # 8 words; 0.5 keeps 4, reference: 4 words
    res = audit(lambda ps: [" epsilon zeta WRONG theta and more"], judge, [{"question": q, "answer": "1"}],
                [0.5])["ratios"]["0.5"]
    # candidate = first 4 words "epsilon zeta WRONG theta": LCS 3 of 4, P = R = 3/4.
    assert res["completion_exact_match"] == 0.0 and res["rouge_l"] == pytest.approx(0.75)
    assert res["memorized"] == []


def test_rows_that_cannot_be_cut_are_skipped_and_counted():
    rows = [{"question": "one", "answer": "1"}, {"question": [{"role": "user", "content": "chat"}], "answer": "2"},
            ROWS[0]]
    res = audit(lambda ps: [" x"] * len(ps), judge, rows, [0.5])["ratios"]["0.5"]
    assert res["problems"] == 1 and res["skipped"] == 2


@pytest.mark.parametrize("ratios", [[0.0], [1.0], [0.5, 1.5], []])
def test_bad_ratios_are_refused_naming_the_flag(ratios):
    with pytest.raises(ConfigError, match="--contamination"):
        audit(lambda ps: ps, judge, ROWS, ratios)
    if ratios:
        with pytest.raises(ConfigError, match="--contamination"):
            EvalSettings(n=1, contamination=ratios).check()


def test_cli_parses_the_flag_and_refuses_text():
    import argparse

    from anabranch.eval.cli_eval import add_subcommands, settings_from

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "m", "--contamination", "0.4,0.6,0.8"])
    assert settings_from(args).contamination == [0.4, 0.6, 0.8]
    assert settings_from(parser.parse_args(["eval", "m"])).contamination == []  # off by default
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "m", "--contamination", "half"])


def eval_overrides(model_dir):
    return [f"model.path={model_dir}", "task.name=random_calculation", "task.eval_size=3", "task.train_size=10",
            "rollout.max_new_tokens=6", "trainer.eval_max_new_tokens=6", "trainer.device=cpu"]


QUIET = dict(n=1, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=0)


def test_eval_flag_on_tiny_model_reports_rates_in_range(tiny_model_dir, tmp_path):
    out = run_eval([tiny_model_dir], None, eval_overrides(tiny_model_dir),
                   EvalSettings(**QUIET, contamination=[0.4, 0.8]), tmp_path / "ev")
    res = out["models"][0]["contamination"]["ratios"]
    assert list(res) == ["0.4", "0.8"]
    for v in res.values():
        assert v["problems"] == 3 and v["skipped"] == 0
        for key in ("completion_exact_match", "rouge_l", "answer_accuracy"):
            assert 0.0 <= v[key] <= 1.0
    saved = json.loads((tmp_path / "ev" / "passk.json").read_text())
    assert saved["models"][0]["contamination"] == json.loads(json.dumps(out["models"][0]["contamination"]))
    page = report_table([{"label": "tiny", "evals": [out["models"][0]]}])
    assert "Partial-prompt leakage" in page and page.count("<tr>") == 3  # head + one row per ratio
    # Off (the default): no audit in the entry.
    off = run_eval([tiny_model_dir], None, eval_overrides(tiny_model_dir), EvalSettings(**QUIET), tmp_path / "ev2")
    assert "contamination" not in off["models"][0]
    assert report_table([{"label": "tiny", "evals": [off["models"][0]]}]) == ""


def test_audit_with_tools_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    from anabranch.eval import runner

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(runner, "evaluate_model", no_load)
    with pytest.raises(ConfigError, match="rollout.tools"):
        run_eval([tiny_model_dir], None, eval_overrides(tiny_model_dir) + ["rollout.tools=[calculator]"],
                 EvalSettings(**QUIET, contamination=[0.5]), tmp_path / "ev")
