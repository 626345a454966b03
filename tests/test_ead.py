"""EAD (rollout.temperature_schedule=ead, rollout/temperature_schedule.py): the schedule's values, the
tempered sampling log-probs the hf backend records, the constant path left as it was, the config
checks, and a short training run."""

import math

import pytest
import torch

from anabranch import load_config, train
from anabranch.config import ConfigError, RolloutConfig
from anabranch.rollout.temperature_schedule import EADSchedule, ead_decay, ead_temperatures
from test_train_e2e import digit_task, tiny_overrides


def hand_tau(t, step, tau_max=1.2, tau_min=0.1, d0=500.0, growth=5.0, d_max=40000.0, c=10):
    if t < c:
        return 1.0
    return max(1 + tau_max - math.exp(t / min(d0 + growth * step, d_max)), tau_min)


def test_schedule_values_match_the_formula():
    # Paper defaults, step 0: d = 500. t=10: 2.2 - e^0.02 = 1.17979...; t=300: 2.2 - e^0.6 = 0.37788...;
    # t=400: 2.2 - e^0.8 = -0.0255 -> floor 0.1.
    pos = torch.tensor([0, 9, 10, 100, 300, 400, 10_000_000])
    got = ead_temperatures(pos, 0, 1.2, 0.1, 500.0, 5.0, 40000.0, 10)
    want = [1.0, 1.0, 2.2 - math.exp(0.02), 2.2 - math.exp(0.2), 2.2 - math.exp(0.6), 0.1, 0.1]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert want[2] == pytest.approx(1.179799, abs=1e-6) and want[4] == pytest.approx(0.377881, abs=1e-6)
    # d grows 5 per step up to 40000: at step 100 d = 1000, so t=300 is warmer (2.2 - e^0.3).
    assert ead_decay(500.0, 5.0, 40000.0, 100) == 1000.0
    assert ead_decay(500.0, 5.0, 40000.0, 10**6) == 40000.0
    got = ead_temperatures(torch.tensor([300]), 100, 1.2, 0.1, 500.0, 5.0, 40000.0, 10)
    assert got.item() == pytest.approx(2.2 - math.exp(0.3), abs=1e-6)
    # Non-default keys reach the formula (a config's schedule).
    cfg = RolloutConfig(temperature_schedule="ead", ead_tau_max=1.5, ead_tau_min=0.3, ead_decay=50.0,
                        ead_decay_growth=1.0, ead_decay_max=60.0, ead_warmup_tokens=2)
    sched = EADSchedule(cfg)
    for t, step in ((0, 0), (1, 3), (2, 0), (20, 4), (30, 40), (80, 40)):
        want = hand_tau(t, step, 1.5, 0.3, 50.0, 1.0, 60.0, 2)
        assert sched.temperatures(torch.tensor([t]), step).item() == pytest.approx(want, abs=1e-6), (t, step)


def _backend(model_dir, **cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anabranch.rollout.hf_generate import HFGenerateBackend

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return HFGenerateBackend(model, tok, RolloutConfig(**cfg))


def _manual_log_probs(model, input_ids, attention_mask, start, taus):
    """log softmax(z_t / τ_t) of the tokens at columns start.., from one plain forward of the model."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    width = input_ids.shape[1] - start
    z = logits[:, start - 1:start - 1 + width].float() / taus[:, :width, None]
    return torch.log_softmax(z, -1).gather(-1, input_ids[:, start:, None]).squeeze(-1)


# Tiny schedule so that 8 tokens cross every regime: τ = 1 at t=0,1, then 2.5 − e^(t/4) ≥ 0.4.
SMALL = dict(temperature_schedule="ead", ead_tau_max=1.5, ead_tau_min=0.4, ead_decay=4.0,
             ead_warmup_tokens=2, max_new_tokens=8)


def test_recorded_log_probs_are_the_tempered_distribution(tiny_model_dir):
    be = _backend(tiny_model_dir, **SMALL)
    be.sync_weights(be.model)  # one optimizer step: d = 4 + 5·1 = 9, τ = 1, 1, 1.25, .., 0.4 from t = 7
    ro = be.generate(["ab", "abcdef"], n=3, seed=0)
    assert ro.sample_log_probs is not None and ro.sample_log_probs.shape == ro.response_ids.shape
    width = ro.response_ids.shape[1]
    taus = torch.tensor([hand_tau(t, 1, 1.5, 0.4, 4.0, 5.0, 40000.0, 2) for t in range(width)])
    assert taus[0] == 1.0 and 1.0 < taus[2] < 1.5 and taus.min() < 1.0  # the run crosses the regimes
    want = _manual_log_probs(be.model, ro.input_ids, ro.attention_mask, ro.prompt_ids.shape[1],
                             taus.expand(ro.response_ids.shape[0], -1))
    m = ro.response_mask.bool()
    assert torch.allclose(ro.sample_log_probs[m], want[m], atol=1e-4)
    assert (ro.sample_log_probs[~m] == 0).all()
    # Not the untempered policy's: the correction has something to correct.
    plain = _manual_log_probs(be.model, ro.input_ids, ro.attention_mask, ro.prompt_ids.shape[1],
                              torch.ones(ro.response_ids.shape))
    assert not torch.allclose(ro.sample_log_probs[m], plain[m], atol=1e-3)
    # Greedy (evaluation) ignores the schedule and records nothing.
    assert be.generate(["ab"], n=1, greedy=True).sample_log_probs is None


def test_multi_turn_positions_continue_the_response(tiny_model_dir):
    be = _backend(tiny_model_dir, **SMALL)
    # Row 0 has 5 response tokens already (budget 8 − 3 left), row 1 none: positions 5.. and 0..
    seqs = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7]]
    got = be.continue_ids(seqs, [3, 8], seed=0)
    from anabranch.rollout.base import left_padded

    for i, offset in ((0, 5), (1, 0)):
        new, lps = got[i]
        ids, mask = left_padded([seqs[i] + new], be.tokenizer.pad_token_id)
        taus = torch.tensor([[hand_tau(offset + k, 0, 1.5, 0.4, 4.0, 5.0, 40000.0, 2) for k in range(len(new))]])
        want = _manual_log_probs(be.model, ids, mask, len(seqs[i]), taus)[0]
        assert len(lps) == len(new)
        assert torch.allclose(torch.tensor(lps), want, atol=1e-4), i


def test_constant_schedule_is_unchanged(tiny_model_dir):
    be = _backend(tiny_model_dir, max_new_tokens=8)
    assert be.schedule is None
    kwargs = be._generation_kwargs(False, 8, 0)
    assert be._annealer(kwargs, 3, [0]) is None and "logits_processor" not in kwargs
    a = be.generate(["ab", "abcdef"], n=3, seed=1)
    assert a.sample_log_probs is None
    # EAD with τ = 1 at every position (warm-up past max_new_tokens) draws the same tokens from the same
    # seed: the processor changes nothing but the temperature.
    ead = _backend(tiny_model_dir, **{**SMALL, "ead_warmup_tokens": 100})
    b = ead.generate(["ab", "abcdef"], n=3, seed=1)
    assert torch.equal(a.response_ids, b.response_ids) and a.completions == b.completions
    # The same seed under the real schedule samples other tokens.
    c = _backend(tiny_model_dir, **SMALL).generate(["ab", "abcdef"], n=3, seed=1)
    assert not torch.equal(a.response_ids, c.response_ids)


def _cfg(tiny_model_dir, tmp_path, **extra):
    return load_config(None, tiny_overrides(tiny_model_dir, str(tmp_path / "x.jsonl"), tmp_path,
                                            **{"rollout.temperature_schedule": "ead", **extra}))


@pytest.mark.parametrize("extra, key", [
    ({"rollout.backend": "vllm"}, "rollout.backend"),
    ({"rollout.temperature": 0.7}, "rollout.temperature"),
    ({"rollout.top_p": 0.9}, "rollout.top_k"),
    ({"rollout.top_k": 20}, "rollout.top_k"),
    ({"rollout.temperature_schedule": "linear"}, "rollout.temperature_schedule"),
    ({"rollout.ead_tau_min": 0.0}, "rollout.ead_tau_min"),
    ({"rollout.ead_tau_max": 0.05}, "rollout.ead_tau_max"),
    ({"rollout.ead_decay": 0.0}, "rollout.ead_decay"),
    ({"rollout.ead_decay_growth": -1.0}, "rollout.ead_decay_growth"),
    ({"rollout.ead_decay_max": 100.0}, "rollout.ead_decay_max"),
    ({"rollout.ead_warmup_tokens": -1}, "rollout.ead_warmup_tokens"),
])
def test_config_errors_name_the_key(tiny_model_dir, tmp_path, extra, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _cfg(tiny_model_dir, tmp_path, **extra)


def test_missing_tis_warns(tiny_model_dir, tmp_path, capsys):
    _cfg(tiny_model_dir, tmp_path)
    assert "algorithm.tis_cap" in capsys.readouterr().out
    _cfg(tiny_model_dir, tmp_path, **{"algorithm.tis_cap": 2.0})
    assert "tis_cap" not in capsys.readouterr().out


def test_short_training_run_with_ead(tiny_model_dir, write_jsonl, tmp_path):
    overrides = tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "rollout.temperature_schedule": "ead", "rollout.ead_decay": 3.0, "rollout.ead_warmup_tokens": 1,
        "algorithm.tis_cap": 2.0, "trainer.steps": 3, "trainer.eval_before": False, "trainer.eval_after": False})
    result = train(load_config(None, overrides))
    assert len(result.history) == 3
    for m in result.history:
        assert math.isfinite(m["loss"])
        # The tempered log-probs reached the trainer: it measured and corrected the mismatch.
        assert math.isfinite(m["mismatch/kl"]) and m["mismatch/abs_mean"] > 1e-3
        assert 0 < m["mismatch/tis_weight_mean"] <= 2.0


def test_a_resumed_run_continues_the_schedule(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    """d_s grows with the training step s: the resumed run's rollouts use the steps of the uninterrupted run."""
    import anabranch.rollout.hf_generate as hf

    seen = []

    class Recording(hf.AnnealedTemperature):
        def __init__(self, schedule, step, *args):
            seen.append(step)
            super().__init__(schedule, step, *args)

    monkeypatch.setattr(hf, "AnnealedTemperature", Recording)
    data = digit_task(write_jsonl)

    def run(name, **extra):
        seen.clear()
        train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
            "rollout.temperature_schedule": "ead", "algorithm.tis_cap": 2.0, "trainer.steps": 4,
            "trainer.eval_before": False, "trainer.eval_after": False, "trainer.run_name": name, **extra})))
        return list(seen)

    assert run("full", **{"trainer.save_every": 2}) == [0, 1, 2, 3]
    ckpt = tmp_path / "full" / "checkpoints" / "step-000002"
    assert run("resumed", **{"trainer.resume": str(ckpt)}) == [2, 3]
