"""trainer.micro_batch_tokens=-1 on a GPU (trainer/gpu_budget.py): the budget measured from the
update's own peak memory, with the allocator's counters replaced by numbers written here."""

import pytest
import torch

from anabranch.trainer.gpu_budget import MeasuredTokenBudget, measured_budget
from anabranch.trainer.microbatch import MicroBatch, plan_micro_batches


class FakeMemory:
    def __init__(self):
        self.alloc, self.peak_bytes, self.free = 0, 0, 0

    def allocated(self):
        return self.alloc

    def peak(self):
        return self.peak_bytes

    def reset_peak(self):
        self.peak_bytes = self.alloc

    def available(self):
        return self.free


def update(budget, mem, *, base, added, largest, free):
    """One step: the update starts with `base` allocated and `free` available, peaks `added` above."""
    mem.alloc, mem.free = base, free
    tokens = budget.before_update()
    mem.peak_bytes = base + added
    budget.after_update(largest)
    return tokens


def test_first_update_in_rows_then_measured_fit_capped_by_growth():
    mem = FakeMemory()
    budget = MeasuredTokenBudget(mem, safety=0.5, growth=4.0)
    # Nothing measured yet: 0, i.e. rows of trainer.micro_batch_size.
    assert update(budget, mem, base=1000, added=1000, largest=100, free=10_000) == 0
    assert budget.bytes_per_token == 10.0
    # 0.5 * 10_000 / 10 = 500 would fit, but at most 4x the 100 tokens seen: 400.
    assert update(budget, mem, base=1000, added=4000, largest=400, free=10_000) == 400
    # Seen 400 (cap 1600); 10 B/token against 10_000 free: 500 fit.
    assert update(budget, mem, base=1000, added=5000, largest=500, free=10_000) == 500
    # The card fills (another process, a larger cache): the budget shrinks with the free memory.
    assert update(budget, mem, base=1000, added=100, largest=10, free=2_000) == 100
    # 10 B/token measured on 10 tokens; growth is capped by the largest micro-batch ever seen (500).
    assert budget.before_update() == 100 and budget.largest_seen == 500


def test_a_costlier_token_lowers_the_next_budget():
    mem = FakeMemory()
    budget = MeasuredTokenBudget(mem, safety=0.5, growth=4.0)
    update(budget, mem, base=0, added=1000, largest=100, free=100_000)   # 10 B/token
    update(budget, mem, base=0, added=12_000, largest=400, free=100_000)  # longer rows: 30 B/token
    mem.free = 40_000  # at 10 B/token 2,000 would fit (capped at 4 x 400 = 1,600); at 30, 666
    assert budget.before_update() == int(0.5 * 40_000 / 30)


def test_an_update_that_measured_nothing_keeps_the_last_measurement():
    mem = FakeMemory()
    budget = MeasuredTokenBudget(mem, safety=0.5, growth=4.0)
    update(budget, mem, base=0, added=1000, largest=100, free=100_000)
    update(budget, mem, base=0, added=0, largest=0, free=100_000)  # every row inert: no backward pass
    assert budget.bytes_per_token == 10.0


def test_run_peak_survives_the_resets():
    mem = FakeMemory()
    budget = MeasuredTokenBudget(mem)
    mem.alloc, mem.peak_bytes = 100, 9_000  # the rollout's KV cache peaked before the update
    budget.before_update()
    mem.peak_bytes = 3_000
    budget.after_update(10)
    assert budget.run_peak() == 9_000
    assert budget.metrics() == {"update/micro_batch_tokens": 0.0, "update/bytes_per_token": 2_900 / 10}


def test_only_auto_on_an_unsharded_cuda_model_is_measured():
    cuda = torch.device("cuda", 0)
    assert measured_budget(-1, cuda, sharded=False) is not None
    assert measured_budget(-1, cuda, sharded=True) is None  # ranks need equal micro-batch counts
    assert measured_budget(0, cuda, sharded=False) is None and measured_budget(2048, cuda, sharded=False) is None
    assert measured_budget(-1, torch.device("cpu"), sharded=False) is None


def test_computed_tokens_by_hand():
    # Batch P=5, R=4; this micro-batch keeps prompt columns 2..4 (3) and response columns 0..2 (3).
    mb = MicroBatch(rows=torch.tensor([0, 1, 2, 3]), left=2, right=8, prompt_width=5, response_width=4)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert mb.computed_tokens() == 4 * 3 + 4 * 3
    assert mb.computed_tokens(groups, shared=True) == 2 * 3 + 4 * 3  # one prompt per group


def test_packed_micro_batches_fit_their_budget_as_computed_tokens_count_it():
    gen = torch.Generator().manual_seed(0)
    b, p, r = 24, 9, 11
    p_len, r_len = torch.randint(2, p + 1, (b,), generator=gen), torch.randint(1, r + 1, (b,), generator=gen)
    prompt_mask = (torch.arange(p) >= p - p_len[:, None]).long()  # left-padded prompts
    response_mask = (torch.arange(r) < r_len[:, None]).long()
    groups = torch.arange(b) // 4
    for shared in (False, True):
        plan = plan_micro_batches(prompt_mask, response_mask, 16, 60, group_index=groups, share_prefix=shared)
        assert sorted(torch.cat([mb.rows for mb in plan]).tolist()) == list(range(b))
        sizes = [mb.computed_tokens(groups, shared) for mb in plan]
        assert all(s <= 60 or len(mb.rows) == 1 or (shared and len(set(groups[mb.rows].tolist())) == 1)
                   for s, mb in zip(sizes, plan)), sizes
        assert max(sizes) > 30  # the packing uses the budget (not one row per micro-batch)


# --- the update's out-of-memory retry (policy_update(oom_retry=True), used with the measured budget) ---

def _oom_setup(tiny_model_dir):
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig, ModelConfig
    from anabranch.models.loading import load_model
    from test_dapo_batch import fake_rollout

    torch.manual_seed(0)
    r = fake_rollout(2, 3, 3, 4)
    r.prompt_ids = torch.randint(3, 60, r.prompt_ids.shape)
    r.response_ids = torch.randint(3, 60, r.response_ids.shape)
    r.response_mask[1, 2:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    algo = resolve_algorithm(AlgorithmConfig(name="grpo"))
    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
    return r, rewards, algo, model


def _update(tiny_model_dir, **kwargs):
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.step import policy_update

    r, rewards, algo, model = _oom_setup(tiny_model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adv = compute_advantages(algo, model, r, rewards, micro_batch_size=6, temperature=1.0)
    metrics = policy_update(model, opt, r, adv.advantages, rewards, algo, grad_clip=0.0, temperature=1.0,
                            max_response_len=4, precomputed=adv.precomputed, **kwargs)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), metrics


def _oom_above(monkeypatch, rows: int):
    """Make every training pass over more than ``rows`` sequences fail as CUDA's allocator would."""
    import anabranch.trainer.step as step

    real, calls = step.forward_micro_batch, []

    def forward(model, mb, *args, **kwargs):
        calls.append(len(mb.rows))
        if torch.is_grad_enabled() and len(mb.rows) > rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, mb, *args, **kwargs)

    monkeypatch.setattr(step, "forward_micro_batch", forward)
    return calls


def test_an_update_out_of_memory_is_redone_in_smaller_micro_batches_with_the_same_gradient(
        tiny_model_dir, monkeypatch):
    expected, _ = _update(tiny_model_dir, micro_batch_size=1)  # single rows: never out of memory
    calls = _oom_above(monkeypatch, rows=2)
    grad, metrics = _update(tiny_model_dir, micro_batch_size=6, micro_batch_tokens=10_000, oom_retry=True,
                            share_prompt_prefix=False)
    assert metrics["update/oom_retries"] >= 1 and calls[0] == 6  # one micro-batch of all 6, then halved
    assert max(calls[-int(metrics["micro_batches"]):]) <= 2
    assert torch.allclose(grad, expected, rtol=1e-3, atol=1e-6) and expected.abs().sum() > 0


def test_without_retry_or_with_nothing_left_to_split_the_error_stands(tiny_model_dir, monkeypatch):
    _oom_above(monkeypatch, rows=2)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _update(tiny_model_dir, micro_batch_size=6, micro_batch_tokens=10_000, oom_retry=False)
    calls = _oom_above(monkeypatch, rows=0)  # even one sequence does not fit
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _update(tiny_model_dir, micro_batch_size=6, micro_batch_tokens=10_000, oom_retry=True,
                share_prompt_prefix=False)
    assert calls[-1] == 1 and len(calls) < 10  # halved down to single rows, then gave up
