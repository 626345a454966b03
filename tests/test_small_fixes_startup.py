"""Checks moved to the run's start, and a warning: DSDR's embedding package, the options of the
reward wrapped by noisy_verifier, and support comparisons of models sampled with different n."""

import importlib.util

import pytest

from anabranch import load_config
from anabranch.algorithms.dsdr import EMBEDDING_PACKAGE, check_embedding_package
from anabranch.config import AlgorithmConfig, ConfigError, RewardConfig, RewardFunctionConfig
from anabranch.eval.support import support_change
from anabranch.rewards import build_rewards

from test_support_entropy import BASE, TRAINED, problem


def _package_missing(monkeypatch):
    """Make only the MiniLM package look uninstalled; every other lookup is the real one."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == EMBEDDING_PACKAGE else real(name, *a, **k))


# --- 1. DSDR with dsdr_similarity=embedding needs the offline MiniLM package ---------------------

def test_dsdr_embedding_without_the_package_is_refused(monkeypatch):
    _package_missing(monkeypatch)
    for kw in ({"dsdr_global_coef": 0.1}, {"dsdr_local_coef": 1e-3}):
        with pytest.raises(ConfigError, match="algorithm.dsdr_similarity") as err:
            check_embedding_package(AlgorithmConfig(**kw))  # embedding is the default similarity
        assert "pip install 'anabranch[embeddings]'" in str(err.value)
        assert "algorithm.dsdr_similarity=ngram" in str(err.value)


def test_dsdr_ngram_or_off_or_installed_passes(monkeypatch):
    check_embedding_package(AlgorithmConfig(dsdr_global_coef=0.1))  # the real finder
    _package_missing(monkeypatch)
    check_embedding_package(AlgorithmConfig(dsdr_global_coef=0.1, dsdr_similarity="ngram"))
    check_embedding_package(AlgorithmConfig())  # DSDR off: the similarity is never used


def test_dsdr_missing_package_stops_the_run_before_the_data_and_model(tiny_model_dir, monkeypatch):
    import anabranch.trainer.components as components

    _package_missing(monkeypatch)
    monkeypatch.setattr(components, "load_task", lambda *_: pytest.fail("the data was read before the check"))
    cfg = load_config(None, ["algorithm.dsdr_global_coef=0.1", "reward.functions=[math_verify]",
                             f"model.path={tiny_model_dir}"])
    with pytest.raises(ConfigError, match="algorithm.dsdr_similarity"):
        components.build(cfg)
    # With ngram the start-time checks pass and the build goes on to read the data.
    cfg = load_config(None, ["algorithm.dsdr_global_coef=0.1", "algorithm.dsdr_similarity=ngram",
                             "reward.functions=[math_verify]", f"model.path={tiny_model_dir}"])
    with pytest.raises(pytest.fail.Exception, match="data was read"):
        components.build(cfg)


# --- 2. noisy_verifier: the wrapped reward's own options are checked at the start ----------------

def _check_threshold(params):
    if not 0 < params.get("threshold", 0.5) < 1:
        raise ConfigError(f"threshold must be in (0, 1) (got {params['threshold']!r})")


def threshold_reward(prompts, completions, threshold=0.5, **_):
    return [1.0 for _ in completions]


threshold_reward.anabranch_meta = {"check_params": _check_threshold}
WRAPPED = "test_small_fixes_startup:threshold_reward"


def _noisy(reward_params):
    return RewardConfig(functions=[RewardFunctionConfig(name="noisy_verifier", params={
        "reward": WRAPPED, "false_positive_rate": 0.1, "reward_params": reward_params})], isolation="none")


def test_noisy_verifier_checks_the_wrapped_rewards_options_at_build():
    with pytest.raises(ConfigError, match=r"reward\.functions\[noisy_verifier\]\.params\.reward_params") as err:
        build_rewards(_noisy({"threshold": 2.0}))
    assert "threshold must be in (0, 1)" in str(err.value)  # the wrapped reward's own message
    assert len(build_rewards(_noisy({"threshold": 0.3}))) == 1  # valid options: built as before
    assert len(build_rewards(_noisy({}))) == 1


# --- 3. support comparison of models sampled with different n -------------------------------------

def _warnings(capsys):
    return [line for line in capsys.readouterr().out.splitlines() if "warning" in line]


def test_support_equal_n_no_warning(capsys):
    sc = support_change(BASE, TRAINED)
    assert _warnings(capsys) == []
    assert (sc["n_base"], sc["n_trained"]) == (3, 3)


def test_support_different_n_warns_with_both_numbers_and_same_rates(capsys):
    # TRAINED with two more wrong samples per problem: the same correct answers, so the same cells.
    more = [problem(p["question"], [(s["answer"], s["correct"]) for s in p["samples"]] + [("x", False)] * 2)
            for p in TRAINED]
    same, wider = support_change(BASE, TRAINED), support_change(BASE, more)
    capsys.readouterr()
    support_change(BASE, more)
    (line,) = _warnings(capsys)
    assert "n=3" in line and "n=5" in line
    assert (wider["n_base"], wider["n_trained"]) == (3, 5)
    for key in ("problems", "answers", "shrunk_problems", "expanded_problems"):
        assert wider[key] == same[key]
    # Hand-computed rates (tests/test_support_entropy.py): unchanged by the warning.
    assert wider["problems"]["SRR"] == 0.5 and wider["answers"]["NSCR"] == -0.25


def test_support_uneven_n_is_recorded_per_side(capsys):
    uneven = [problem(p["question"], [(s["answer"], s["correct"]) for s in p["samples"]][: 2 + (i % 2)])
              for i, p in enumerate(BASE)]
    sc = support_change(uneven, TRAINED)
    assert sc["n_base"] == [2, 3] and sc["n_trained"] == 3
    (line,) = _warnings(capsys)
    assert "n=[2, 3]" in line and "n=3" in line
