"""One-step-off-policy asynchronous rollouts (trainer/async_rollouts.py) and AReaL's decoupled PPO weight
(algorithms/decoupled_ppo.py; Fu et al. 2025, arXiv 2505.24298; ASearcher, arXiv 2508.07976): the loss by hand
(clip around π_prox, the truncated / filtered weight), the weight inside policy_update, the versions each batch
was generated with and the generator's weights, errors in either thread, resume, reproducibility, learning, and
the refusals."""

import copy
import dataclasses
import hashlib
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.decoupled_ppo import behaviour_weights, decoupled_advantages
from anabranch.algorithms.grpo import ppo_clip_loss
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.rewards.time_limit import TimeLimitExceeded, time_limit
from anabranch.rollout.hf_generate import HFGenerateBackend
from anabranch.trainer.async_rollouts import AsyncRollouts, tensors_in
from anabranch.trainer.replay import behaviour_pass
from anabranch.trainer.step import LossContext, no_grad_log_probs, policy_update
from test_hpt import ToyLM, toy_rollout
from test_train_e2e import digit_task, tiny_overrides


# ---------------------------------------------------------------- the objective by hand

def test_decoupled_loss_by_hand_with_the_clip_around_prox_and_the_truncated_weight():
    # Four tokens of one row (the last is padding). π_θ/π_prox = e^{0.1}, e^{0.5}, 1; π_prox/π_behav = e^{0.5},
    # e^{-0.3}, e^{2} (> C = 5: truncated to 5). Â = +1, +1, −0.5. ε = 0.2.
    prox = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    behav = torch.tensor([[-1.5, -1.7, -2.5, -9.0]])
    lp = (prox + torch.tensor([[0.1, 0.5, 0.0, 3.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    cfg = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.2)
    ctx = LossContext(cfg=cfg, aggregate=lambda mat, m: (mat * m).sum() / m.sum())
    wa, metrics = decoupled_advantages(adv, prox, behav, mask, 5.0, "truncate")
    loss, _ = ppo_clip_loss(lp, prox, wa, mask, ctx)
    w = [math.exp(0.5), math.exp(-0.3), 5.0]
    # token 0: r = e^{0.1} inside [0.8, 1.2]: −w·r·Â; token 1: r = e^{0.5} > 1.2 with Â > 0: −w·1.2·Â (no gradient);
    # token 2: r = 1, Â < 0: −5·1·(−0.5)
    per_token = [-w[0] * math.exp(0.1), -w[1] * 1.2, 2.5]
    assert loss.item() == pytest.approx(sum(per_token) / 3, rel=1e-6)
    loss.backward()
    # d/d lp of −w·e^{lp−prox}·Â / 3 is −w·r·Â/3 where unclipped; 0 at the clipped token; padding 0
    want = [-w[0] * math.exp(0.1) / 3, 0.0, 5.0 * 0.5 / 3, 0.0]
    assert lp.grad[0].tolist() == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert metrics["async/behaviour_weight_mean"] == pytest.approx(sum(w) / 3, rel=1e-6)
    assert metrics["async/behaviour_capped_frac"] == pytest.approx(1 / 3)
    assert metrics["async/behaviour_kl"] == pytest.approx((-0.5 + 0.3 - 2.0) / 3, rel=1e-6)


def test_filter_mode_drops_the_tokens_over_the_cap_as_areal_does():
    prox, behav = torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[-0.5, -2.0, 0.3]])
    assert behaviour_weights(prox, behav, 5.0, "filter")[0].tolist() == pytest.approx(
        [math.exp(0.5), 0.0, math.exp(-0.3)], rel=1e-6)
    assert behaviour_weights(prox, behav, 5.0, "truncate")[0].tolist() == pytest.approx(
        [math.exp(0.5), 5.0, math.exp(-0.3)], rel=1e-6)


def test_policy_update_applies_the_weight_against_its_own_prox():
    # π_behav = π_prox − log 2 on every token: w = 2 (cap 5) moves the weights exactly as Â·2 does without it; cap 1.5
    # truncates to Â·1.5; filter at 1.5 drops every token (no movement).
    rollout = toy_rollout([[[1, 2], [3, 1], [1, 1]]])
    adv = torch.tensor([[0.8, 0.8], [-0.4, -0.4], [-0.4, -0.4]])
    algo = resolve_algorithm(AlgorithmConfig())
    prox = no_grad_log_probs(ToyLM(), rollout, 4, 1.0)

    def update(a, pre=None):
        model = ToyLM()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out = policy_update(model, opt, rollout, a, torch.tensor([1.0, 0.0, 0.0]), algo, micro_batch_size=2,
                            grad_clip=0.0, temperature=1.0, max_response_len=2, precomputed=pre)
        return model.w.detach(), out

    def pre(cap, mode):
        return {"decoupled_behaviour_log_prob": prox - math.log(2.0), "decoupled_weight_cap": (cap, mode),
                "stale_rows": torch.ones(3, dtype=torch.bool)}

    start = ToyLM().w.detach()
    w2, out = update(adv, pre(5.0, "truncate"))
    assert torch.allclose(w2, update(adv * 2)[0], atol=1e-6) and not torch.allclose(w2, start)
    assert out["async/behaviour_weight_mean"] == pytest.approx(2.0, rel=1e-5)
    assert torch.allclose(update(adv, pre(1.5, "truncate"))[0], update(adv * 1.5)[0], atol=1e-6)
    assert torch.allclose(update(adv, pre(1.5, "filter"))[0], start, atol=1e-7)


# ---------------------------------------------------------------- runs on the tiny model

def even_first_char(prompts, completions, **_):
    """About half of a random model's replies start with a character of even code point: a dense 0/1 label."""
    return [float(len(str(c)) > 0 and ord(str(c)[0]) % 2 == 0) for c in completions]


DENSE = {"reward.functions": "[test_async_rollouts:even_first_char]", "reward.isolation": "none"}


def async_cfg(tiny_model_dir, write_jsonl, tmp_path, **extra):
    overrides = {"trainer.async_rollouts.enabled": True, "trainer.steps": 4, "trainer.eval_before": False,
                 "trainer.eval_after": False, "rollout.n": 4, "rollout.prompts_per_step": 2,
                 "trainer.micro_batch_size": 8, "trainer.save_final": False, "trainer.tensorboard": False, **extra}
    return load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **overrides))


def digest(model) -> str:
    h = hashlib.sha1()
    for t in model.state_dict().values():
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def test_each_batch_comes_from_the_previous_steps_weights(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.trainer.loop as loop

    gen, after, weights, behav, probe = {}, {}, {}, {}, {}
    updated = [threading.Event() for _ in range(5)]  # updated[k]: update k has returned
    real_generate, real_after, real_update = AsyncRollouts._generate, AsyncRollouts.after_update, loop.policy_update

    def generate(self, step, idx, version, stale):
        gen[step] = (version, digest(self.generator if self.generator is not None else self.c.model),
                     threading.current_thread() is threading.main_thread())
        if step == 1:  # a model to recompute log-probs with, and the initial weights (version 0)
            probe["model"], weights[0] = copy.deepcopy(self.c.model), copy.deepcopy(self.c.model.state_dict())
        if stale:  # behaviour pass after update step−1: a pass with the training model would see its new weights
            assert updated[step - 1].wait(120)
        out = real_generate(self, step, idx, version, stale)
        behav[step] = (out["behaviour_lp"], out["batch"].rollout)
        return out

    def after_update(self, model):
        after[len(after) + 1] = digest(model)  # the policy after update k (before the generator gets it)
        weights[len(after)] = copy.deepcopy(model.state_dict())
        real_after(self, model)

    def update(*a, **k):
        out = real_update(*a, **k)
        updated[len(after) + 1].set()
        return out

    def no_cuda(*a, **k):
        raise AssertionError("a CUDA stream on the CPU path")

    monkeypatch.setattr(AsyncRollouts, "_generate", generate)
    monkeypatch.setattr(AsyncRollouts, "after_update", after_update)
    monkeypatch.setattr(loop, "policy_update", update)
    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)  # the CPU path: no stream made, none entered or waited on
    monkeypatch.setattr(torch.cuda, "stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    cfg = async_cfg(tiny_model_dir, write_jsonl, tmp_path, **DENSE)
    result = train(cfg)
    h = result.history
    assert [m["async/staleness"] for m in h] == [0.0, 1.0, 1.0, 1.0]  # the first step is on-policy
    assert [m["async/behaviour_version"] for m in h] == [0.0, 0.0, 1.0, 2.0]
    # batch 1 by the initial weights in the main thread; batch 2 in the thread by the same (version 0) weights;
    # batch k >= 3 in the thread by exactly the policy after update k−2
    assert gen[1][0] == 0 and gen[1][2] and gen[2][1] == gen[1][1] and not gen[2][2]
    for k in (3, 4):
        assert gen[k][0] == k - 2 and gen[k][1] == after[k - 2] and not gen[k][2]
    assert len(set(after.values())) == 4  # every update moved the policy (else equal digests prove nothing)
    # the on-policy step carries no behaviour weight; the stale ones do
    assert "async/behaviour_weight_mean" not in h[0] and behav[1][0] is None
    assert all(m["async/behaviour_weight_mean"] > 0 for m in h[1:])
    # π_behav of batch k: the log-probs of exactly the weights after update k−2 (version 0: the initial weights),
    # not those of the policy that was updating meanwhile (update k−1)
    t = cfg.trainer
    for k in (2, 3, 4):
        lp, rollout = behav[k]
        for version, same in ((k - 2, True), (k - 1, False)):
            probe["model"].load_state_dict(weights[version])
            want = behaviour_pass(probe["model"], rollout, {}, t.micro_batch_size, cfg.rollout.temperature,
                                  t.share_prompt_prefix)
            mask = rollout.response_mask.bool()
            assert torch.allclose(lp[mask], want[mask], atol=1e-5) is same, (k, version)
    assert not any(t.name == "anabranch-async-rollouts" for t in threading.enumerate())


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log, self.device = name, log, None

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


def test_the_join_orders_the_main_stream_after_the_threads_and_finds_every_tensor_handed_across(monkeypatch):
    # No GPU here: fake streams check the join's ordering; tensors_in finds the tensors a batch hands across.
    log = []
    ar = AsyncRollouts.__new__(AsyncRollouts)
    ar.stream, ar.ready = FakeStream("side", log), None
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream("main", log))
    rollout = toy_rollout([[[1, 2], [3, 1]]])
    ar._out = {"batch": rollout, "version": 0, "behaviour_lp": torch.zeros(2, 2)}
    ar.thread = threading.Thread(target=lambda: log.append("thread ran"))
    ar.thread.start()
    ar._join()
    assert log == ["thread ran", "main waits side"] and ar.ready["batch"] is rollout
    found = {id(t) for t in tensors_in(ar.ready)}
    assert {id(rollout.response_ids), id(rollout.response_mask), id(rollout.prompt_ids),
            id(ar.ready["behaviour_lp"])} <= found


def test_an_error_in_the_thread_is_raised_in_the_main_thread(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.trainer.collect as collect

    real = collect.generate_round

    def failing(c, idx, cfg, step=None, *a, **k):
        if step == 2:  # the first batch the thread generates
            raise ValueError("generation failed at step 2")
        return real(c, idx, cfg, step, *a, **k)

    monkeypatch.setattr(collect, "generate_round", failing)
    with pytest.raises(ValueError, match="generation failed at step 2"):
        train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 3}))
    assert not any(t.name == "anabranch-async-rollouts" and t.is_alive() for t in threading.enumerate())


def test_an_error_in_the_main_thread_joins_the_thread(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.trainer.loop as loop

    real, seen = loop.policy_update, []

    def failing(*a, **k):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("update failed")
        return real(*a, **k)

    monkeypatch.setattr(loop, "policy_update", failing)
    with pytest.raises(RuntimeError, match="update failed"):
        train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 3}))
    assert not any(t.name == "anabranch-async-rollouts" and t.is_alive() for t in threading.enumerate())


def test_resume_drops_the_batch_in_flight_and_regenerates_it(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.trainer.collect as collect

    real, drawn = collect.generate_round, []

    def record(c, idx, cfg, step=None, *a, **k):
        drawn.append((step, list(idx)))
        return real(c, idx, cfg, step, *a, **k)

    monkeypatch.setattr(collect, "generate_round", record)
    full = train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.save_every": 2,
                                                                       "trainer.run_name": "full"}))
    full_idx, drawn[:] = dict(drawn), []
    half = Path(full.run_dir) / "checkpoints" / "step-000002"
    resumed = train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.resume": str(half),
                                                                          "trainer.run_name": "resumed"}))
    # batch 3 (generated during step 2, not saved) is generated again first, for the same prompts, by the
    # resumed weights: on-policy; batch 4 then comes from the thread as before
    assert [s for s, _ in drawn] == [3, 4] and dict(drawn) == {3: full_idx[3], 4: full_idx[4]}
    assert [m["async/staleness"] for m in resumed.history[2:]] == [0.0, 1.0]
    assert [m["async/staleness"] for m in full.history[2:]] == [1.0, 1.0]


def test_a_stateful_rewards_state_after_resume_equals_the_uninterrupted_runs(tiny_model_dir, write_jsonl, tmp_path,
                                                                             monkeypatch):
    # OLR's histories hold one visit per training group. The checkpoint after step 2 must hold batches 1-2 only
    # (batch 3, generated in the thread, is regenerated and committed on resume): every prompt of the 4 batches
    # has exactly one visit, in the uninterrupted run and in the resumed one.
    import anabranch.trainer.components as components

    built, real_build = [], components.build_rewards

    def build(cfg):
        built.append(real_build(cfg))
        return built[-1]

    monkeypatch.setattr(components, "build_rewards", build)
    olr = {"reward.functions": "[olr]", "reward.isolation": "none"}
    full = train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **olr, **{"trainer.save_every": 2,
                                                                             "trainer.run_name": "full"}))
    half = Path(full.run_dir) / "checkpoints" / "step-000002"
    train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **olr, **{"trainer.resume": str(half),
                                                                      "trainer.run_name": "resumed"}))
    visits = [{k: len(v) for k, v in srcs[0].state.pass_rates.items()} for srcs in built]
    assert sum(visits[0].values()) == 8 and set(visits[0].values()) == {1}  # 4 batches x 2 prompts, once each
    assert visits[1] == visits[0]


def test_seeded_runs_repeat_themselves(tiny_model_dir, write_jsonl, tmp_path):
    keys = ("reward/mean", "loss", "grad_norm", "async/behaviour_kl")
    runs = [train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 2, "trainer.run_name": f"r{i}",
                                                                      **DENSE})) for i in range(2)]
    a, b = ([{k: m[k] for k in keys if k in m} for m in r.history] for r in runs)
    assert a == b


def test_reward_rises_with_one_step_off_policy_batches(tiny_model_dir, write_jsonl, tmp_path):
    result = train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.steps": 12, "rollout.n": 8,
                                                                       "rollout.prompts_per_step": 4,
                                                                       "trainer.micro_batch_size": 32, **DENSE}))
    rewards = [m["reward/mean"] for m in result.history]
    assert all(m["async/staleness"] == 1.0 for m in result.history[1:])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards


class FakeVLLM(HFGenerateBackend):
    """rollout.backend=vllm stand-in: an engine with its own weights (pushed by sync_weights), made-up sample
    log-probs, a log of generate/sync calls. A generation in the thread for batch j+1 starts after update j
    returned and then sleeps, so a push that did not wait for it would find it running."""
    events, returned, updated = [], [], []

    def __init__(self, model, tokenizer, cfg, **_):
        super().__init__(copy.deepcopy(model), tokenizer, cfg)
        self.busy = False

    def generate(self, prompts, n, greedy=False, **k):
        if greedy:  # evaluation
            return super().generate(prompts, n, greedy=greedy, **k)
        if threading.current_thread() is not threading.main_thread():
            assert FakeVLLM.updated[len(FakeVLLM.returned)].wait(120)
        self.busy = True
        FakeVLLM.events.append("generate")
        time.sleep(0.3)
        ro = super().generate(prompts, n, greedy=greedy, **k)
        ro.sample_log_probs = -0.01 * (1 + len(FakeVLLM.returned)) * torch.arange(1, ro.response_ids.numel() + 1,
                                                                                   dtype=torch.float32
                                                                                   ).view_as(ro.response_ids.float())
        FakeVLLM.returned.append(ro.sample_log_probs.clone())
        self.busy = False
        return ro

    def sync_weights(self, model):
        FakeVLLM.events.append("sync while generating" if self.busy else "sync")
        from anabranch.trainer.ref_reset import copy_weights

        copy_weights(model, self.model)


def test_vllm_joins_then_pushes_and_trains_on_the_engines_sample_log_probs(tiny_model_dir, write_jsonl, tmp_path,
                                                                          monkeypatch):
    import anabranch.trainer.loop as loop
    from anabranch.rollout import ROLLOUT_BACKENDS

    monkeypatch.setitem(ROLLOUT_BACKENDS._items, "vllm", FakeVLLM)
    monkeypatch.setattr(FakeVLLM, "events", [])
    monkeypatch.setattr(FakeVLLM, "returned", [])
    monkeypatch.setattr(FakeVLLM, "updated", [threading.Event() for _ in range(6)])
    real, pre = loop.policy_update, []

    def update(*a, **k):
        pre.append(k["precomputed"])
        out = real(*a, **k)
        FakeVLLM.updated[len(pre)].set()
        return out

    monkeypatch.setattr(loop, "policy_update", update)
    train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **DENSE, **{"rollout.backend": "vllm"}))
    # batch 1 in the main thread, batch 2 in the thread; after each update: join, push, then the next generation
    assert FakeVLLM.events == ["generate", "generate", "sync", "generate", "sync", "generate", "sync", "sync"]
    assert "decoupled_behaviour_log_prob" not in pre[0]  # the on-policy first step
    for k in (2, 3, 4):  # log π_behav of batch k: the engine's sample log-probs of that batch
        assert torch.equal(pre[k - 1]["decoupled_behaviour_log_prob"], FakeVLLM.returned[k - 1])


def inner_limited(prompts, completions, **_):
    """1.0 when a verifier's signal-based limit (rewards/time_limit.py) stopped its busy loop, else 0.0."""
    start = time.monotonic()
    try:
        with time_limit(0.2):
            while time.monotonic() - start < 3.0:
                pass
        return [0.0] * len(completions)
    except TimeLimitExceeded:
        return [1.0] * len(completions)


def hangs(prompts, completions, **_):
    time.sleep(3.0)
    return [1.0] * len(completions)


def test_rewards_scored_in_the_thread_keep_their_deadline_and_verifier_limits(tiny_model_dir, write_jsonl, tmp_path):
    # reward.isolation=process (the default): the guard kills a call at reward.timeout_s from any thread, and in the
    # forked child (its own main thread) a verifier's signal limit acts: batches 2-3 are scored in the thread.
    result = train(async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{
        "trainer.steps": 3, "reward.functions": "[test_async_rollouts:inner_limited, test_async_rollouts:hangs]",
        "reward.isolation": "process", "reward.timeout_s": 1.0}))
    for m in result.history:
        limited = [v for k, v in m.items() if k.startswith("reward/") and k.endswith("inner_limited")]
        failed = [v for k, v in m.items() if k.endswith("hangs/failures")]
        assert limited == [1.0] and failed == [1.0], m
    assert [m["async/staleness"] for m in result.history] == [0.0, 1.0, 1.0]


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("extra,match", [
    ({"algorithm.dynamic_sampling": True}, r"dynamic_sampling.*drawn before"),
    ({"task.curation": "greedy_wrong"}, r"curation=greedy_wrong"),
    ({"algorithm.name": "flowrl"}, r"loss='flowrl'.*algorithm\.loss=ppo_clip"),
    ({"distributed.num_processes": 2}, r"one process only.*num_processes=1"),
    ({"rollout.extra_rollouts": "dars"}, r"extra_rollouts=dars.*rollout rounds"),
    ({"rollout.arrol.enabled": True}, r"rollout\.arrol\.enabled.*rollout rounds"),
    ({"algorithm.rorecomp_fraction": 0.5}, r"rorecomp_fraction.*replays rows"),
    ({"rollout.temperature_schedule": "ead"}, r"temperature_schedule.*constant"),
    ({"trainer.async_rollouts.weight_cap": 0.5}, r"weight_cap must be >= 1"),
    ({"trainer.async_rollouts.weight_cap_mode": "clip"}, r"weight_cap_mode must be one of truncate, filter"),
    ({"rollout.backend": "test_async_rollouts:FakeVLLM"}, r"rollout\.backend='test_async_rollouts:FakeVLLM'.*hf or vllm"),
])
def test_settings_that_cannot_run_asynchronously_are_refused_at_load(tiny_model_dir, write_jsonl, tmp_path, extra,
                                                                       match):
    with pytest.raises(ConfigError, match=match):
        async_cfg(tiny_model_dir, write_jsonl, tmp_path, **extra)


def test_auto_micro_batch_tokens_is_refused_at_train_start_on_cuda(tiny_model_dir, write_jsonl, tmp_path,
                                                                   monkeypatch):
    # On CUDA the auto budget (trainer/gpu_budget.py) reads torch.cuda.max_memory_allocated, which would count the
    # generation thread's memory too: refused where the device is known (train start), before any step.
    import anabranch.trainer.async_rollouts as async_rollouts

    monkeypatch.setattr(async_rollouts, "on_cuda", lambda c: True)  # a GPU stand-in: the model stays on the CPU
    cfg = async_cfg(tiny_model_dir, write_jsonl, tmp_path)
    assert cfg.trainer.micro_batch_tokens == -1  # the default: auto
    with pytest.raises(ConfigError, match=r"micro_batch_tokens=-1 \(auto\) on a CUDA device.*fixed "
                                          r"trainer\.micro_batch_tokens"):
        train(cfg)
    # A fixed budget runs (one step), as does auto on the CPU (the other tests here)
    result = train(async_cfg(tiny_model_dir, write_jsonl, tmp_path,
                             **{"trainer.micro_batch_tokens": 4096, "trainer.steps": 1}))
    assert len(result.history) == 1


def test_its_knobs_are_refused_while_it_is_off(tiny_model_dir, write_jsonl, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.async_rollouts\.weight_cap.*enabled=true"):
        async_cfg(tiny_model_dir, write_jsonl, tmp_path, **{"trainer.async_rollouts.enabled": False,
                                                             "trainer.async_rollouts.weight_cap": 2.0})


def test_off_by_default():
    from anabranch.config import Config

    assert Config().trainer.async_rollouts.enabled is False
    assert dataclasses.asdict(Config().trainer.async_rollouts) == {"enabled": False, "weight_cap": 5.0,
                                                                    "weight_cap_mode": "truncate"}
