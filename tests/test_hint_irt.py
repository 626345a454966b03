"""SEELE's IRT-fitted hint length (Li, Sun et al. 2025, arXiv 2509.06923; algorithms/hint_irt.py,
``algorithm.scaffold.schedule=irt``): the 3PL curve and its inverse against hand-computed values, the
least-squares fit against exact and optimal values, the hint chosen for given abilities, the online rounds
on a synthetic prompt and on the tiny model, the stored ratios through a checkpoint and a resume, and the
refusals."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.hint_irt import (LOWER, UPPER, HintIRT, bracket_words, fit_points, fit_three_pl, hint_words,
                                           inverse_ratio, three_pl)
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import ConfigError
from anabranch.config_algorithm_options import ScaffoldConfig
from anabranch.rewards.registry import REWARDS
from test_train_e2e import tiny_overrides

def _shown(prompt: str) -> list[str]:
    """The solution words s1 .. s8 the prompt shows (the chat template may follow the last without a space)."""
    return re.findall(r"\bs[1-8]\b", prompt)


if "irt_test_reward" not in REWARDS:
    @REWARDS.register("irt_test_reward", correctness=True)
    def irt_test_reward(prompts, completions, answer, **_):
        # Accuracy = (solution words shown)/8 exactly, whatever the completion: with n = 4 samples of a prompt
        # showing l of the 8 words "s1 .. s8", its first ⌊l/2⌋ samples are right (l/8 of 4).
        seen: dict[str, int] = {}
        out = []
        for p in prompts:
            i = seen[p] = seen.get(p, -1) + 1
            out.append(float(i < len(_shown(p)) // 2))
        return out


# ---------------------------------------------------------------- the model, by hand

def test_three_pl_inverse_and_word_count_against_hand_values():
    phi = (10.0, -0.4, 0.2)
    assert three_pl(0.4, phi) == pytest.approx(0.6)                       # σ(0) = ½: 0.2 + 0.8·½
    assert three_pl(0.5, phi) == pytest.approx(0.2 + 0.8 / (1 + math.exp(-1.0)))
    assert inverse_ratio(phi, 0.6) == pytest.approx(0.4)
    # a* = 0.5: (1 − b)/(a* − b) − 1 = 0.8/0.3 − 1 = 5/3, p* = 0.4 − ln(5/3)/10
    assert inverse_ratio(phi, 0.5) == pytest.approx(0.4 - math.log(5 / 3) / 10)
    assert inverse_ratio((10.0, -0.4, 0.5), 0.5) == 0.0                   # the floor already reaches a*
    assert inverse_ratio((1.0, -0.9, 0.0), 0.9) == 1.0                    # 0.9 + ln 9 > 1: clipped
    assert inverse_ratio((50.0, 0.0, 0.0), 0.3) == 0.0                    # −ln(7/3)/50 < 0: clipped
    # ⌊p·W + ½⌋ words, at least 1, at most W
    assert [hint_words(r, 10) for r in (0.0, 0.04, 0.34, 0.35, 0.96, 1.0)] == [1, 1, 3, 4, 10, 10]
    # The bracket of the observations: 6 of 8 words was above the band [0.4, 0.6], 2 below: 6 -> 5, 1 -> 3;
    # inside the bracket, or with no room (3 below, 4 above), the count is kept.
    seen = [(0.0, 0.0), (2 / 8, 0.25), (6 / 8, 0.75)]
    assert [bracket_words(w, 8, seen, 0.4, 0.6) for w in (6, 1, 4)] == [5, 3, 4]
    assert bracket_words(4, 8, [(3 / 8, 0.25), (4 / 8, 0.75)], 0.4, 0.6) == 4


@pytest.mark.parametrize("mu, words", [(-0.2, 2), (-0.5, 5), (-0.8, 8)])
def test_the_hint_shrinks_as_ability_over_difficulty_grows(mu, words):
    # b = 0, a* = ½: ln((1 − b)/(a* − b) − 1) = ln 1 = 0, so p* = −μ whatever k: μ = −0.2 (able, or an easy
    # prompt) needs 2 of 10 words, μ = −0.8 needs 8.
    for k in (3.0, 20.0):
        p = inverse_ratio((k, mu, 0.0), 0.5)
        assert p == pytest.approx(-mu)
        assert hint_words(p, 10) == words


def test_fit_points_average_equal_ratios_and_add_the_margins():
    p, a = fit_points([(0.0, 0.25), (0.5, 0.5), (0.5, 1.0)])
    assert p.tolist() == [0.0, 0.5, 1.0] and a.tolist() == [0.25, 0.75, 1.0]   # (1, 1) added, p = 0 observed
    p, a = fit_points([(0.5, 0.5)])
    assert p.tolist() == [0.0, 0.5, 1.0] and a.tolist() == [0.0, 0.5, 1.0]     # both margins


def test_fit_recovers_an_exact_curve_and_reaches_the_least_squares_optimum():
    true = np.array([12.0, -0.4, 0.1])
    pts = [(p, float(three_pl(p, true))) for p in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)]
    assert fit_three_pl(pts) == pytest.approx(true, abs=1e-3)             # zero residual: the generating φ
    # Noisy accuracies (8 samples a round): the fit's sum of squares is the box-constrained minimum, found
    # by SciPy's trust-region-reflective solver (the paper's LMFIT method) from several starts.
    least_squares = pytest.importorskip("scipy.optimize").least_squares
    rng = np.random.default_rng(0)
    for _ in range(40):
        phi0 = np.array([rng.uniform(1, 50), rng.uniform(-1, 0), rng.uniform(0, 0.5)])
        ps = sorted(set(rng.choice([0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875], size=4).tolist()))
        pts = [(p, rng.binomial(8, float(three_pl(p, phi0))) / 8) for p in ps]
        p, a = fit_points(pts)
        phi = fit_three_pl(pts)
        assert np.all(phi >= LOWER) and np.all(phi <= UPPER)
        ours = float(((three_pl(p, phi) - a) ** 2).sum())
        best = min(float((least_squares(lambda f: three_pl(p, f) - a, x0, bounds=(LOWER, UPPER)).fun ** 2).sum())
                   for x0 in ([5, -0.5, 0], [20, -0.3, 0.2], [1, -0.9, 0.5], [40, -0.1, 0], [2, -0.5, 0.1]))
        assert ours <= best + 1e-6, (pts, phi, ours, best)


def test_online_rounds_on_a_synthetic_prompt_reach_the_target_and_store_the_ratio():
    irt = HintIRT(ScaffoldConfig(schedule="irt", irt_tolerance=0.0))
    true = (15.0, -0.6, 0.05)                     # the prompt's real curve: a = ½ at p ≈ 0.597
    points = [(0.0, float(three_pl(0.0, true)))]  # its hint-free round
    assert irt.next_ratio("q", points) == 0.75    # no stored ratio: the cold start
    for _ in range(3):
        p = irt.next_ratio("q", points)
        points.append((p, float(three_pl(p, true))))
    assert abs(points[-1][1] - 0.5) < 0.02, points
    stored = irt.finish("q", points)
    assert irt.state_dict() == {"stored": {"q": stored}} and abs(stored - inverse_ratio(true, 0.5)) < 0.02
    assert irt.next_ratio("q", points[:1]) == stored  # the next visit starts from it
    other = HintIRT(ScaffoldConfig(schedule="irt"))
    other.load_state_dict(irt.state_dict())
    assert other.stored == irt.stored
    assert irt.in_band(0.5) and not irt.in_band(0.49)
    banded = HintIRT(ScaffoldConfig(schedule="irt", irt_tolerance=0.25))
    assert banded.in_band(0.25) and banded.in_band(0.75) and not banded.needs_hint(0.25) and banded.needs_hint(0.24)


# ---------------------------------------------------------------- the rounds on the tiny model

def _components(tiny_model_dir, write_jsonl, tmp_path, **extra):
    from anabranch.trainer.components import build

    sol = " ".join(f"s{j}" for j in range(1, 9))
    rows = [{"prompt": f"Q{i}: count", "answer": "x", "solution": sol} for i in range(4)]
    cfg = load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 1, "rollout.n": 4, "rollout.max_new_tokens": 2, "reward.isolation": "none",
        "reward.functions": "[irt_test_reward]", "algorithm.scaffold.enabled": True,
        "algorithm.scaffold.schedule": "irt", "algorithm.scaffold.hint_template": "'Start: {prefix}'", **extra}))
    torch.manual_seed(0)
    return cfg, build(cfg)


def test_rounds_hint_each_group_at_its_fitted_ratio_until_in_band(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored
    from anabranch.trainer.scaffold_step import Scaffold

    cfg, c = _components(tiny_model_dir, write_jsonl, tmp_path, **{"algorithm.scaffold.irt_tolerance": 0.1})
    batch = generate_scored(c, [0, 1], cfg, step=1)
    assert list(batch.total) == [0.0] * 8  # no words shown: accuracy 0, both groups below the band
    seen = []
    generate = c.backend.generate
    c.backend.generate = lambda prompts, n, **kw: (seen.append(list(prompts)), generate(prompts, n, **kw))[1]
    scaffold = Scaffold.create(cfg, None, c)
    scaffold.irt.stored[batch.rollout.prompts[1]] = 0.5  # group 1 was seen before: it starts from 0.5
    out = scaffold.step(c, batch, step=1).batch
    # Round 1: group 0 at the cold start 0.75 (6 words: accuracy 0.75, outside [0.4, 0.6]), group 1 at its
    # stored 0.5 (4 words: accuracy 0.5, in the band, done). Round 2: group 0 alone. The 3PL through (0, 0),
    # (0.75, 0.75) and the margin (1, 1) is a steep step crossing ½ at p* ≈ 0.728, i.e. 6 words again: the
    # bracket (6 words was above the band) takes it to 5, accuracy ⌊5/2⌋/4 = 0.5, in the band.
    p_star = inverse_ratio(fit_three_pl([(0.0, 0.0), (0.75, 0.75)]), 0.5)
    assert 0.70 < p_star < 0.75 and hint_words(p_star, 8) == 6
    words = 5
    assert [[_shown(p) for p in round_] for round_ in seen] == [
        [[f"s{j}" for j in range(1, 7)], [f"s{j}" for j in range(1, 5)]], [[f"s{j}" for j in range(1, words + 1)]]]
    assert out.total == [float(i < words // 2) for i in range(4)] + [1.0, 1.0, 0.0, 0.0]
    assert out.metrics["scaffold/hinted_groups"] == 1.0
    assert out.metrics["scaffold/hint_ratio"] == pytest.approx((words / 8 + 0.5) / 2)
    assert out.metrics["scaffold/irt_accuracy"] == pytest.approx(0.5)  # both groups trained on target
    assert out.metrics["scaffold/irt_rounds"] == pytest.approx(1.5)
    # The next visit's ratios: p* of each group's fit on this step's points.
    assert scaffold.irt.stored[batch.rollout.prompts[0]] == pytest.approx(
        inverse_ratio(fit_three_pl([(0.0, 0.0), (0.75, 0.75), (words / 8, (words // 2) / 4)]), 0.5))
    assert scaffold.irt.stored[batch.rollout.prompts[1]] == pytest.approx(
        inverse_ratio(fit_three_pl([(0.0, 0.0), (0.5, 0.5)]), 0.5))


def test_run_checkpoints_the_stored_ratios_and_a_resume_restores_them(tiny_model_dir, write_jsonl, tmp_path):
    sol = " ".join(f"s{j}" for j in range(1, 9))
    data = write_jsonl([{"prompt": f"Q{i}: count", "answer": "x", "solution": sol} for i in range(6)])
    common = {"task.eval_size": 1, "trainer.eval_before": False, "trainer.eval_after": False,
              "trainer.save_final": False, "rollout.n": 4, "rollout.prompts_per_step": 2,
              "rollout.max_new_tokens": 2, "reward.isolation": "none", "reward.functions": "[irt_test_reward]",
              "algorithm.scaffold.enabled": True, "algorithm.scaffold.schedule": "irt", "trainer.save_every": 1}
    res = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **common, **{"trainer.steps": 2})))
    for m in res.history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["scaffold/hinted_groups"] == 1.0 and m["scaffold/pre_accuracy"] == 0.0  # no hint: never right
        assert 0.25 <= m["scaffold/irt_accuracy"] <= 0.75  # every group trained inside the default band
    ckpt = Path(res.run_dir) / "checkpoints" / "step-000002"
    stored = torch.load(ckpt / "trainer_state.pt", weights_only=False)["stateful"]["scaffold_irt"]["stored"]
    assert len(stored) >= 2 and all(0.0 <= v <= 1.0 for v in stored.values())
    # Resumed for a third step: its checkpoint still holds the step-2 table (restored, then added to).
    res2 = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **common, **{
        "trainer.steps": 3, "trainer.resume": str(ckpt), "trainer.run_name": "resumed"})))
    after = torch.load(Path(res2.run_dir) / "checkpoints" / "step-000003" / "trainer_state.pt",
                       weights_only=False)["stateful"]["scaffold_irt"]["stored"]
    assert set(stored) <= set(after)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("overrides, match", [
    (["algorithm.scaffold.schedule=seele"], "algorithm.scaffold.schedule must be 'stages'"),
    (["algorithm.scaffold.schedule=irt", "algorithm.scaffold.irt_target=1.0"], "irt_target must be a target"),
    (["algorithm.scaffold.schedule=irt", "algorithm.scaffold.irt_tolerance=0.5"], "irt_tolerance must be in"),
    (["algorithm.scaffold.schedule=irt", "algorithm.scaffold.irt_rounds=0"], "irt_rounds must be a whole"),
    (["algorithm.scaffold.schedule=irt", "algorithm.scaffold.irt_initial_ratio=0"], "irt_initial_ratio must be"),
    (["algorithm.scaffold.irt_rounds=2"], r"'algorithm.scaffold.irt_rounds' has no effect unless "
                                          r"algorithm.scaffold.schedule=irt"),
    (["algorithm.scaffold.schedule=irt", "algorithm.scaffold.ratios=[0.5]"],
     r"'algorithm.scaffold.ratios' has no effect unless algorithm.scaffold.schedule=stages"),
])
def test_bad_or_inactive_irt_keys_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):  # refused at load now
        resolve_algorithm(load_config(None, ["algorithm.scaffold.enabled=true", *overrides]).algorithm)


def test_irt_keys_while_scaffolding_is_off_are_refused_and_the_defaults_resolve():
    resolve_algorithm(load_config(None, ["algorithm.scaffold.enabled=true", "algorithm.scaffold.schedule=irt"]).algorithm)
    assert ScaffoldConfig().schedule == "stages"  # off by default: GHPO's stages when scaffolding is on
    for key, value in (("schedule", "irt"), ("irt_target", "0.4")):
        with pytest.raises(ConfigError, match=rf"'algorithm.scaffold.{key}' has no effect unless "
                                              r"algorithm.scaffold.enabled=true"):
            resolve_algorithm(load_config(None, [f"algorithm.scaffold.{key}={value}"]).algorithm)


def test_group_accuracy_and_group_rows_against_hand_values():
    # Groups out of order and interleaved: group 2 has rows 0 and 3 (1 right of 2), group 0 rows 1, 2, 4
    # (2 right of 3), group 5 row 5 (0 of 1). group_rows: each group's first row.
    from types import SimpleNamespace

    from anabranch.trainer.extra_rollouts import group_accuracy
    from anabranch.trainer.scaffold_step import Scaffold

    gi = torch.tensor([2, 0, 0, 2, 0, 5])
    batch = SimpleNamespace(rollout=SimpleNamespace(group_index=gi, prompts=["p"] * 6), rows=[{"i": i} for i in range(6)])
    acc = group_accuracy(batch, correct=[1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert acc == [2 / 3, 0.0, 0.5, 0.0, 0.0, 0.0]  # groups 1, 3, 4 have no rows: 0
    assert Scaffold.group_rows(batch, [5, 0, 2]) == [{"i": 5}, {"i": 1}, {"i": 0}]
