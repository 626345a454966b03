"""The lean step computes the same numbers as the naive one: chunked LM head, token-budget micro-batches."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig
from anabranch.models.chunked_logprobs import supports_chunked_head
from anabranch.models.logprobs import response_forward
from anabranch.rollout.base import Rollout
from anabranch.trainer.microbatch import plan_micro_batches
from anabranch.trainer.step import policy_update


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()


def _rollout(vocab: int) -> Rollout:
    """6 sequences: left-padded prompts of 2..5 tokens, responses of 1..6 tokens (EOS=2 ends them)."""
    g = torch.Generator().manual_seed(1)
    p_lens, r_lens, P, R = [2, 5, 3, 5, 4, 2], [6, 1, 3, 6, 2, 4], 5, 6
    prompt_ids = torch.zeros(6, P, dtype=torch.long)
    prompt_mask = torch.zeros(6, P, dtype=torch.long)
    response_ids = torch.zeros(6, R, dtype=torch.long)
    response_mask = torch.zeros(6, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        prompt_ids[i, P - p:] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        response_ids[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask,
                   group_index=torch.tensor([0, 0, 0, 1, 1, 1]), prompts=["a", "b"], completions=[""] * 6,
                   truncated=torch.zeros(6, dtype=torch.bool))


def test_chunked_head_equals_full_log_softmax_values_entropy_and_gradients(model):
    assert supports_chunked_head(model)
    ro = _rollout(model.config.vocab_size)
    ids, mask, R = ro.input_ids, ro.attention_mask, ro.response_ids.shape[1]
    for temperature, budget in ((1.0, 0), (0.7, 0), (0.7, 2**30)):  # recomputed, and kept, logits
        model.zero_grad()
        lean = response_forward(model, ids, mask, R, temperature, entropy=True, entropy_grad=True,
                                chunk_rows=4, lean=True, logits_budget_bytes=budget)
        (lean.log_probs.sum() + lean.entropy.sum()).backward()
        g_lean = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        # Naive: every position's full log-softmax from the model's own logits.
        from anabranch.models.logprobs import position_ids_from_mask

        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        logits = logits[:, -R - 1:-1] / temperature
        logp = torch.log_softmax(logits, -1)
        ref_lp = logp.gather(-1, ids[:, -R:, None]).squeeze(-1)
        ref_ent = -(logp.exp() * logp).sum(-1)
        (ref_lp.sum() + ref_ent.sum()).backward()
        assert torch.allclose(lean.log_probs, ref_lp, atol=1e-5)
        assert torch.allclose(lean.entropy, ref_ent, atol=1e-5)
        for n, p in model.named_parameters():
            assert torch.allclose(g_lean[n], p.grad, atol=1e-5, rtol=1e-4), n
    model.zero_grad()


class _LargestTensor(TorchDispatchMode):
    """Records the largest vocabulary-wide tensor (last dimension ``vocab``, other than the
    transposed LM-head weight [hidden, vocab]) any op produces."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == self.vocab \
                    and tuple(t.shape) != (self.hidden, self.vocab):
                self.largest = max(self.largest, t.numel())
        return out


def test_lean_forward_backward_never_holds_whole_batch_logits(model):
    ro = _rollout(model.config.vocab_size)
    ids, mask, R, V = ro.input_ids, ro.attention_mask, ro.response_ids.shape[1], model.config.vocab_size
    B = ids.shape[0]
    for lean, bound_ok in ((True, lambda n: n <= 2 * R * V), (False, lambda n: n >= B * R * V)):
        rec = _LargestTensor(V, model.config.hidden_size)
        with rec:
            out = response_forward(model, ids, mask, R, entropy=True, chunk_rows=2, lean=lean,
                                   logits_budget_bytes=0)
            out.log_probs.sum().backward()
        model.zero_grad()
        assert bound_ok(rec.largest), (lean, rec.largest, B * R * V)


def test_token_budget_plan_covers_every_row_once_within_budget():
    ro = _rollout(50)
    plan = plan_micro_batches(ro.prompt_mask, ro.response_mask, micro_batch_size=4, micro_batch_tokens=20)
    rows = torch.cat([mb.rows for mb in plan]).sort().values
    assert rows.tolist() == list(range(6))
    lengths = (ro.prompt_mask.sum(-1) + ro.response_mask.sum(-1)).tolist()  # [8, 6, 6, 11, 6, 6]
    for mb in plan:
        width = mb.right - mb.left
        assert len(mb.rows) * width <= 20 or len(mb.rows) == 1
        # The kept columns are exactly the longest prompt and longest response of the micro-batch.
        assert width == max(int(ro.prompt_mask[r].sum()) for r in mb.rows) + \
            max(int(ro.response_mask[r].sum()) for r in mb.rows)
    # Longest first: the 11-token sequence (row 3) is alone, since 2 × 11 > 20.
    assert plan[0].rows.tolist() == [3] and lengths[3] == 11
    # Without a budget: fixed size, input order, full width.
    fixed = plan_micro_batches(ro.prompt_mask, ro.response_mask, micro_batch_size=4)
    assert [mb.rows.tolist() for mb in fixed] == [[0, 1, 2, 3], [4, 5]]
    assert all(mb.left == 0 and mb.right == 11 for mb in fixed)


def _whole_and_packed_updates(model, ro, adv, rewards, algo):
    """One SGD step (lr 1) from the same weights, the batch in one micro-batch and then packed by a
    20-token budget: ``(start, (weights, metrics), (weights, metrics))``; the weights are put back."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(**kw):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        metrics = policy_update(model, opt, ro, adv, rewards, algo, grad_clip=0.0, temperature=1.0,
                                max_response_len=6, **kw)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics

    whole, packed = update(micro_batch_size=6), update(micro_batch_size=6, micro_batch_tokens=20)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    return start, whole, packed


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_full_batch_update(model, mode):
    ro = _rollout(model.config.vocab_size)
    algo = resolve_algorithm(AlgorithmConfig(loss_agg_mode=mode, entropy_coef=0.01))
    adv = torch.randn(6, 1).expand(6, ro.response_ids.shape[1]).contiguous()
    rewards = torch.arange(6.0)
    start, (full, m_full), (packed, m_packed) = _whole_and_packed_updates(model, ro, adv, rewards, algo)
    moved = sum(float((full[n] - start[n]).abs().sum()) for n in start)
    assert moved > 0
    for n in start:
        assert torch.allclose(full[n], packed[n], atol=1e-6), n
    assert m_full["loss"] == pytest.approx(m_packed["loss"], abs=1e-6)
    assert m_full["entropy"] == pytest.approx(m_packed["entropy"], rel=1e-5)


@pytest.mark.parametrize("temperature,entropy_grad", [(1.0, False), (0.6, False), (1.0, True), (0.6, True)])
def test_fused_log_prob_entropy_matches_log_softmax_in_float64(temperature, entropy_grad):
    from anabranch.models.chunked_logprobs import token_log_prob_entropy

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 300, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 300, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    lp, ent = token_log_prob_entropy(logits, targets, 1.0 / temperature, True, entropy_grad)
    assert ent.requires_grad == entropy_grad  # a metric unless asked for with grad
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
    (grad,) = torch.autograd.grad(loss, logits)

    ref_logits = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(ref_logits / temperature, -1)
    ref_lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ref_loss = (ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert torch.allclose(grad.double(), ref_grad, atol=1e-6)
    assert ref_grad.abs().max() > 0.1


def test_fused_log_prob_entropy_refuses_a_second_backward():
    """Its backward pass writes the gradient into the saved softmax; reusing the graph must fail."""
    from anabranch.models.chunked_logprobs import token_log_prob_entropy

    logits = torch.randn(2, 7, requires_grad=True)
    lp, _ = token_log_prob_entropy(logits, torch.tensor([1, 3]))
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_update_reports_forward_backward_and_optimizer_time_apart(model):
    """`time/forward_backward_s` holds the passes (here a 0.05 s sleep in every forward) and not the
    optimizer step (a 0.4 s sleep per epoch), which `time/optimizer_s` holds: benchmarks/vs_trl.py
    divides the model FLOPs by the first."""
    import time

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.4)
            return super().step(closure)

    ro = _rollout(model.config.vocab_size)
    algo = resolve_algorithm(AlgorithmConfig(ppo_epochs=2))
    adv = torch.randn(6, 1).expand(6, ro.response_ids.shape[1]).contiguous()
    forwards = []
    # On the decoder body: the fused LM head runs outside the model's own forward.
    hook = model.get_decoder().register_forward_pre_hook(lambda *_: (forwards.append(1), time.sleep(0.05)) and None)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        t0 = time.perf_counter()
        m = policy_update(model, SlowSGD(model.parameters(), lr=0.0), ro, adv, torch.arange(6.0), algo,
                          micro_batch_size=3, grad_clip=0.0, temperature=1.0, max_response_len=6)
        wall = time.perf_counter() - t0
    finally:
        hook.remove()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
    # 2 epochs x 2 micro-batches in the spans, plus the old log-probs' passes before them.
    assert len(forwards) == 6
    assert m["time/optimizer_s"] >= 0.8
    assert 4 * 0.05 <= m["time/forward_backward_s"]
    # Neither span holds the other's time (a fixed bound on the passes failed on a busy host).
    assert m["time/forward_backward_s"] + m["time/optimizer_s"] <= wall


def test_vargrad_under_a_token_budget_keeps_groups_whole_and_gives_the_full_batch_update(model):
    """FlowRL's VarGrad log Z is a group mean: a budget that would split the groups (20 tokens hold
    no group of three) must not, or each part's mean stands in for the group's."""
    from anabranch.config import FlowRLConfig

    ro = _rollout(model.config.vocab_size)
    algo = resolve_algorithm(AlgorithmConfig(name="flowrl", flowrl=FlowRLConfig(beta=1.0, log_z="vargrad",
                                                                               reference="none")))
    assert "whole_groups" in algo.needs
    plan = plan_micro_batches(ro.prompt_mask, ro.response_mask, 6, 20, ro.group_index, whole_groups=True)
    assert sorted(mb.rows.tolist() for mb in plan) == [[0, 1, 2], [3, 4, 5]]  # each group alone: 3 × 11 > 20
    shared = plan_micro_batches(ro.prompt_mask, ro.response_mask, 6, 20, ro.group_index, share_prefix=True,
                                whole_groups=True)  # one prompt + 3 responses: 5 + 3 × 6 > 20
    assert sorted(mb.rows.tolist() for mb in shared) == [[0, 1, 2], [3, 4, 5]]
    for kw in ({}, {"share_prefix": True}):  # without the need, both modes split the groups
        split = plan_micro_batches(ro.prompt_mask, ro.response_mask, 6, 20, ro.group_index, **kw)
        assert any(len(mb.rows) < 3 for mb in split), kw

    adv = torch.tensor([1.0, -0.5, 0.3, 0.8, -1.2, 0.1])[:, None].expand(6, 6).contiguous()
    start, (full, m_full), (packed, m_packed) = _whole_and_packed_updates(model, ro, adv, torch.zeros(6), algo)
    assert sum(float((full[n] - start[n]).abs().sum()) for n in start) > 0
    for n in start:
        assert torch.allclose(full[n], packed[n], atol=1e-6), n
    assert m_full["loss"] == pytest.approx(m_packed["loss"], abs=1e-6)


def test_auto_micro_batch_tokens_is_a_cpu_budget_that_keeps_the_logits_in_theirs_and_rows_elsewhere():
    from anabranch.models.logprobs import LOGITS_BUDGET_BYTES
    from anabranch.trainer.microbatch import resolve_micro_batch_tokens

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert LOGITS_BUDGET_BYTES == 512 * 2**20
    assert resolve_micro_batch_tokens(-1, cpu, 49152) == 2730  # 2730 × 49,152 × 4 B ≤ 512 MiB < 2731 × ...
    assert resolve_micro_batch_tokens(-1, cpu, 151936) == 883  # Qwen2.5's vocabulary
    assert resolve_micro_batch_tokens(-1, cpu, 99) == 3072  # the cap
    assert resolve_micro_batch_tokens(-1, cpu, 1_000_000) == 512  # the floor
    assert resolve_micro_batch_tokens(-1, cuda, 49152) == 0
    assert resolve_micro_batch_tokens(-1, cpu, 49152, sharded=True) == 0  # FSDP/ZeRO-3: same count on every rank
    assert resolve_micro_batch_tokens(0, cpu, 49152) == 0 and resolve_micro_batch_tokens(4096, cuda, 49152) == 4096


def test_micro_batch_tokens_below_minus_one_is_refused():
    from anabranch.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens"):
        load_config(None, ["trainer.micro_batch_tokens=-2"])
