"""Best-of-n and the optimal tilted policy as a reward-vs-KL frontier (Yang et al. 2024; Beirami et al. 2024)."""

import itertools
import json
import math
import random

import pytest
import torch

from anabranch.eval import bon_frontier as bf
from anabranch.eval.passk import pass_at_k

from test_eval_e2e import eval_overrides
from test_sparse_selection import perturbed, random_sequences
from test_train_e2e import digit_task


def brute_force_bon(rewards, n):
    """The mean over every n-subset of the k samples of its max."""
    subsets = list(itertools.combinations(rewards, n))
    return sum(max(s) for s in subsets) / len(subsets)


def test_bon_estimator_matches_enumeration_of_all_subsets():
    rng = random.Random(0)
    for k in range(1, 8):
        for _ in range(5):
            # Ties on purpose (rounded values): the sorted-weights formula must not depend on tie order.
            rewards = [round(rng.uniform(-1, 2), 1) for _ in range(k)]
            for n in range(1, k + 1):
                assert bf.bon_reward(rewards, n) == pytest.approx(brute_force_bon(rewards, n), abs=1e-12)


def test_bon_of_zero_one_rewards_is_pass_at_k():
    for k, c in [(5, 0), (5, 1), (5, 3), (8, 2), (8, 8)]:
        rewards = [1.0] * c + [0.0] * (k - c)
        random.Random(k + c).shuffle(rewards)
        for n in range(1, k + 1):
            assert bf.bon_reward(rewards, n) == pytest.approx(pass_at_k(k, c, n), abs=1e-12)


def test_bon_kl_bound_values_and_n_out_of_range():
    assert bf.kl_bon(1) == 0.0
    assert bf.kl_bon(2) == pytest.approx(0.693147180559945 - 0.5)
    assert bf.kl_bon(4) == pytest.approx(1.386294361119891 - 0.75)
    assert bf.kl_bon(16) == pytest.approx(2.772588722239781 - 15 / 16)
    with pytest.raises(ValueError, match="n >= 1"):
        bf.kl_bon(0)
    with pytest.raises(ValueError, match="1 <= n <= k=2"):
        bf.bon_reward([0.0, 1.0], 3)


def test_tilted_policy_on_three_samples_by_hand():
    # β = 1/ln 2: exp(r/β) = 2^r. Rewards 0, 1, 1 → weights 1/5, 2/5, 2/5.
    beta = 1 / math.log(2)
    reward, kl = bf.tilted([0.0, 1.0, 1.0], beta)
    assert reward == pytest.approx(0.8)
    # KL = E*[r]/β − log mean(2^r) = 0.8 ln 2 − ln(5/3) ≈ 0.04371
    assert kl == pytest.approx(0.8 * math.log(2) - math.log(5 / 3))
    assert kl == pytest.approx(0.043700, abs=1e-5)
    # Rewards 0, ½, 1: weights 1, √2, 2 over 3 + √2.
    reward, kl = bf.tilted([0.0, 0.5, 1.0], beta)
    z = 3 + math.sqrt(2)
    assert reward == pytest.approx((0.5 * math.sqrt(2) + 2) / z)
    assert kl == pytest.approx(reward * math.log(2) - math.log(z / 3))


def test_tilted_limits_base_mean_at_large_beta_and_best_sample_at_small_beta():
    rewards = [0.2, 0.9, 0.4, 0.9]
    reward, kl = bf.tilted(rewards, 1e9)
    assert reward == pytest.approx(sum(rewards) / 4) and kl == pytest.approx(0.0, abs=1e-9)
    reward, kl = bf.tilted(rewards, 1e-4)  # all mass on the two best samples: KL = log(4/2)
    assert reward == pytest.approx(0.9) and kl == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="beta > 0"):
        bf.tilted(rewards, 0.0)


def test_frontier_averages_problems_and_is_monotone():
    front = bf.frontier([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert front["k"] == 4 and front["base_mean_reward"] == pytest.approx(0.375)
    assert [p["reward"] for p in front["bon"]] == pytest.approx(
        [(pass_at_k(4, 2, n) + pass_at_k(4, 1, n)) / 2 for n in range(1, 5)])
    assert [p["kl"] for p in front["bon"]] == pytest.approx([bf.kl_bon(n) for n in range(1, 5)])
    kls, rewards = [p["kl"] for p in front["tilted"]], [p["reward"] for p in front["tilted"]]
    assert kls == sorted(kls) and rewards == sorted(rewards)
    # β → 0: each problem's mass on its correct samples; KL = mean(log 2, log 4).
    assert kls[-1] == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-6) and rewards[-1] == pytest.approx(1.0)


def test_reward_at_kl_interpolates_and_refuses_beyond_the_curve():
    curve = [{"kl": 0.0, "reward": 0.2}, {"kl": 0.2, "reward": 0.4}, {"kl": 0.6, "reward": 0.5}]
    assert bf.reward_at_kl(curve, 0.1) == pytest.approx(0.3)
    assert bf.reward_at_kl(curve, 0.5) == pytest.approx(0.475)
    assert bf.reward_at_kl(curve, -0.01) == pytest.approx(0.2)  # a noisy KL below 0: the base
    assert bf.reward_at_kl(curve, 0.7) is None


def entry(label, rewards, kl=None):
    e = {"label": label, "problems": [{"question": f"q{i}", "samples": [{"correct": r >= 1, "reward": r} for r in rs]}
                                      for i, rs in enumerate(rewards)]}
    if kl is not None:
        e["kl_to_base"] = {"kl": kl, "kl_stderr": 0.0, "sequences": sum(map(len, rewards)), "temperature": 1.0}
    return e


def test_trained_point_against_bon_by_hand():
    base = entry("base", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # Base BoN: n=1 0.375, n=2 (0.5 + 5/6)/2 = 2/3. At KL = ½·KL_BoN(2) the curve reads (0.375 + 2/3)/2.
    kl = bf.kl_bon(2) / 2
    trained = entry("rl", [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], kl=kl)  # mean reward 0.625
    out = bf.against_base(base, trained)
    t = out["trained"]
    assert out["base"] == "base" and t["mean_reward"] == pytest.approx(0.625) and t["kl"] == kl
    assert t["bon_reward_at_kl"] == pytest.approx((0.375 + 2 / 3) / 2)
    assert t["beats_bon"] is True
    assert 1 < t["bon_n_at_kl"] < 2 and bf.kl_bon(2) / 2 == pytest.approx(
        math.log(t["bon_n_at_kl"]) - (t["bon_n_at_kl"] - 1) / t["bon_n_at_kl"])
    worse = bf.against_base(base, entry("rl", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]], kl=kl))
    assert worse["trained"]["beats_bon"] is False
    tie = bf.against_base(base, entry("rl", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]], kl=0.0))
    assert tie["trained"]["bon_reward_at_kl"] == pytest.approx(0.375) and tie["trained"]["beats_bon"] is False
    far = bf.against_base(base, entry("rl", [[1.0] * 4] * 2, kl=5.0))  # past KL_BoN(4) ≈ 0.64
    assert far["trained"]["bon_reward_at_kl"] is None and far["trained"]["beats_bon"] is None
    assert "beyond the base's best-of-k" in bf.summary_line("rl", far)


def test_pairs_that_cannot_be_compared_give_an_error_entry():
    base = entry("base", [[1.0, 0.0], [0.0, 0.0]])
    assert "no KL to the base" in bf.against_base(base, entry("rl", [[1.0, 0.0], [0.0, 0.0]]))["error"]
    other = entry("rl", [[1.0, 0.0], [0.0, 0.0]], kl=0.1)
    other["problems"][1]["question"] = "another"
    assert "same problems" in bf.against_base(base, other)["error"]


@torch.no_grad()
def test_sequence_log_ratios_match_an_unbatched_reference_and_vanish_for_the_same_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    same = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    other = AutoModelForCausalLM.from_pretrained(perturbed(tiny_model_dir, tmp_path / "p")).eval()
    seqs = random_sequences()  # the third holds an uncounted tool output
    assert bf.sequence_log_ratios(same, base, seqs, 1.0, chunk=2) == [0.0] * len(seqs)
    for temperature in (1.0, 0.7):
        got = bf.sequence_log_ratios(other, base, seqs, temperature, chunk=2)
        want = []
        for s in seqs:
            ids = torch.cat([s.prompt, s.response])[None]
            p = len(s.prompt)
            lt = (other(input_ids=ids).logits[0, p - 1:-1] / temperature).log_softmax(-1)
            lb = (base(input_ids=ids).logits[0, p - 1:-1] / temperature).log_softmax(-1)
            tok = s.response[:, None]
            want.append(float(((lt.gather(-1, tok) - lb.gather(-1, tok)).squeeze(-1) * s.counted).sum()))
        assert got == pytest.approx(want, abs=1e-4)
        assert any(abs(w) > 1e-2 for w in want)


def test_cli_eval_writes_the_frontier_section_and_the_same_model_has_zero_kl(tiny_model_dir, write_jsonl, tmp_path,
                                                                              capsys):
    from anabranch.cli import main

    out = tmp_path / "ev"
    flags = ["--n", "3", "--no-greedy", "--no-embeddings", "--no-effective-rank", "--sparse-tokens", "0"]
    overrides = eval_overrides(tiny_model_dir, digit_task(write_jsonl))
    assert main(["eval", tiny_model_dir, tiny_model_dir, *overrides, *flags, "--bon-frontier", "-o", str(out)]) == 0
    saved = json.loads((out / "passk.json").read_text())
    base, trained = saved["models"]
    assert "bon_frontier" not in base and "kl_to_base" not in base
    sec = trained["bon_frontier"]
    assert sec["base"] == "model#1" and sec["frontier"]["k"] == 3 and len(sec["frontier"]["bon"]) == 3
    assert sec["frontier"]["bon"][0]["reward"] == pytest.approx(base["mean@n"])  # a 0/1 correctness reward
    assert sec["trained"]["kl"] == 0.0 and sec["trained"]["sequences"] == 9
    assert sec["trained"]["bon_reward_at_kl"] == pytest.approx(sec["frontier"]["base_mean_reward"])
    assert (out / "bon_frontier.png").is_file()
    assert "best-of-n frontier of model#2 vs model#1: reward" in capsys.readouterr().out
    # Off (the default): no KL pass, no section, no plot.
    out2 = tmp_path / "ev2"
    assert main(["eval", tiny_model_dir, tiny_model_dir, *overrides, *flags, "-o", str(out2)]) == 0
    assert "kl_to_base" not in json.loads((out2 / "passk.json").read_text())["models"][1]
    assert not (out2 / "bon_frontier.png").exists()


def test_report_shows_the_frontier_table(tmp_path):
    from test_eval_report import fake_run

    from anabranch.eval.report import read_run, write_report

    base = fake_run(tmp_path, "base", 1.0, 2.0)
    run = fake_run(tmp_path, "grpo", 1.0, 2.0)
    saved = json.loads((run / "eval_passk.json").read_text())
    b = entry("base", [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    saved["models"][0]["bon_frontier"] = bf.against_base(
        b, entry("grpo", [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], kl=bf.kl_bon(2) / 2))
    (run / "eval_passk.json").write_text(json.dumps(saved))
    page = write_report([base, run], tmp_path / "r.html").read_text()
    assert "<h2>Best-of-n frontier</h2>" in page
    assert "<tr><td>grpo</td><td>base</td><td>0.625</td><td>0.097</td><td>0.521</td>" in page
    assert "<td>yes</td></tr>" in page
    assert bf.report_table([read_run(base)]) == ""


def test_the_frontier_is_refused_with_one_sample_or_one_model_before_any_model_loads(tiny_model_dir, write_jsonl,
                                                                                       tmp_path, monkeypatch, capsys):
    import anabranch.models.loading as loading
    from anabranch.cli import main
    from anabranch.config import ConfigError
    from anabranch.eval.runner import EvalSettings, run_eval

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setattr(loading, "load_tokenizer", no_load)
    # n = 1: best-of-n has a single point (n = 1, KL 0), no curve to compare with.
    assert main(["eval", tiny_model_dir, tiny_model_dir, "--bon-frontier", "--n", "1"]) == 2
    assert "--bon-frontier needs --n >= 2" in capsys.readouterr().err
    # One model: no base to measure the KL to.
    overrides = eval_overrides(tiny_model_dir, digit_task(write_jsonl))
    with pytest.raises(ConfigError, match="--bon-frontier needs at least two models"):
        run_eval([tiny_model_dir], None, overrides, EvalSettings(n=2, bon_frontier=True), tmp_path / "ev")
    assert not (tmp_path / "ev").exists()


def test_sparse_selection_and_the_kl_share_one_loaded_base_per_trained_model(tiny_model_dir, write_jsonl, tmp_path,
                                                                             monkeypatch):
    import anabranch.models.loading as loading
    from anabranch.eval.runner import EvalSettings, run_eval

    real, loads = loading.load_model, []

    def counting(*args, **kwargs):
        loads.append(args[0].path)
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", counting)
    other = perturbed(tiny_model_dir, tmp_path / "other" / "model")
    settings = EvalSettings(n=2, greedy=False, embeddings=False, effective_rank=False, sparse_tokens=5,
                            bon_frontier=True)
    out = run_eval([tiny_model_dir, other], None, eval_overrides(tiny_model_dir, digit_task(write_jsonl)), settings,
                   tmp_path / "ev")
    # The base evaluated, the trained model evaluated, the base once beside it (not once per analysis).
    assert loads == [tiny_model_dir, other, tiny_model_dir]
    trained = out["models"][1]
    assert trained["sparse_selection"]["positions"] == 5 and trained["sparse_selection"]["changed_positions"] > 0
    assert trained["kl_to_base"]["sequences"] == 6 and trained["kl_to_base"]["kl"] != 0.0
    assert "frontier" in trained["bon_frontier"]
