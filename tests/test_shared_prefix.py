"""Running each prompt once for its group (models/shared_prefix.py) gives the unshared numbers:
log-probs, entropies, hidden states, parameter gradients, whole updates and the advantage pass."""

import pytest
import torch

from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, FlowRLConfig
from anabranch.models.logprobs import response_forward
from anabranch.models.shared_prefix import prefix_groups, supports_shared_prefix
from anabranch.rollout.base import Rollout
from anabranch.trainer.advantage_pass import compute_advantages
from anabranch.trainer.microbatch import plan_micro_batches
from anabranch.trainer.step import policy_update


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()


def grouped_rollout(vocab: int, sizes=(3, 2, 4), p_lens=(2, 6, 4), seed: int = 1) -> Rollout:
    """Groups of ``sizes`` rows sharing a left-padded prompt of ``p_lens`` tokens (width 6), with
    ragged responses (1..7 of 7 columns)."""
    g = torch.Generator().manual_seed(seed)
    B, P, R = sum(sizes), 6, 7
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    row = 0
    for size, p in zip(sizes, p_lens):
        ids = torch.randint(3, vocab, (p,), generator=g)
        prompt_ids[row:row + size, P - p:] = ids
        prompt_mask[row:row + size, P - p:] = 1
        row += size
    r_lens = torch.randint(1, R + 1, (B,), generator=g)
    r_lens[0] = R
    response_ids = torch.randint(3, vocab, (B, R), generator=g)
    response_mask = (torch.arange(R)[None] < r_lens[:, None]).long()
    response_ids = response_ids * response_mask
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask,
                   group_index=torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes)),
                   prompts=[str(i) for i in range(len(sizes))], completions=[""] * B,
                   truncated=torch.zeros(B, dtype=torch.bool))


def _forward_and_grads(model, ro, share: bool, **kw):
    model.zero_grad()
    R = ro.response_ids.shape[1]
    out = response_forward(model, ro.input_ids, ro.attention_mask, R, share_prefix=share, **kw)
    mask = ro.response_mask.float()
    w = torch.linspace(0.5, 1.5, R)  # different weights per position, so that a mix-up shows
    loss = (out.log_probs * mask * w).sum()
    if out.entropy is not None and out.entropy.requires_grad:
        loss = loss + 0.3 * (out.entropy * mask).sum()
    if out.hidden is not None:  # the log Z head reads prompt positions, the value head response ones
        loss = loss + 0.01 * (out.hidden * torch.linspace(-1, 1, out.hidden.shape[-1])).sum(-1)[
            torch.cat([ro.prompt_mask, ro.response_mask], 1).bool()].sum()
    loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("temperature,budget,entropy_grad,hidden", [
    (1.0, 0, False, False),        # logits recomputed in the backward pass, entropy as a metric
    (0.7, 2 ** 30, True, True),    # logits kept, entropy with grad, hidden states used
])
def test_shared_prefix_equals_unshared_forward_and_gradients(model, temperature, budget, entropy_grad, hidden):
    assert supports_shared_prefix(model)
    ro = grouped_rollout(model.config.vocab_size)
    kw = dict(temperature=temperature, entropy=True, entropy_grad=entropy_grad, hidden=hidden, chunk_rows=4,
              logits_budget_bytes=budget)
    ref, g_ref = _forward_and_grads(model, ro, False, **kw)
    shapes: list = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    got, g_got = _forward_and_grads(model, ro, True, **kw)
    hook.remove()
    assert shapes == [(3, 6), (9, 7)]  # 3 prompts once, then the 9 rows' responses
    m = ro.response_mask.bool()
    assert torch.allclose(got.log_probs[m], ref.log_probs[m], atol=1e-5)
    assert torch.allclose(got.entropy[m], ref.entropy[m], atol=1e-5)
    if hidden:
        real = torch.cat([ro.prompt_mask, ro.response_mask], 1).bool()
        assert torch.allclose(got.hidden[real], ref.hidden[real], atol=1e-5)
    assert sum(float(g.abs().sum()) for g in g_ref.values()) > 0
    for n in g_ref:
        assert torch.allclose(g_got[n], g_ref[n], atol=1e-5, rtol=1e-4), n
    model.zero_grad()


def test_shared_prefix_with_lora_adapters(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from anabranch.config import LoraConfig
    from anabranch.models.lora import apply_lora

    lora = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, alpha=8)).train()
    with torch.no_grad():  # non-zero adapters, so that they change the outputs
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    assert supports_shared_prefix(lora)
    ro = grouped_rollout(lora.config.vocab_size)
    ref, g_ref = _forward_and_grads(lora, ro, False, entropy=True)
    got, g_got = _forward_and_grads(lora, ro, True, entropy=True)
    m = ro.response_mask.bool()
    assert torch.allclose(got.log_probs[m], ref.log_probs[m], atol=1e-5)
    assert g_ref and all(".lora_" in n for n in g_ref)
    for n in g_ref:
        assert torch.allclose(g_got[n], g_ref[n], atol=1e-5, rtol=1e-4), n


def test_prefix_groups_only_joins_adjacent_rows_with_identical_prompts():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 7], [0, 5, 6], [0, 5, 6], [9, 5, 6]])
    mask = torch.tensor([[0, 1, 1]] * 5 + [[1, 1, 1]])
    assert prefix_groups(ids, mask).tolist() == [0, 0, 1, 2, 2, 3]
    # Same ids, different mask: not the same prompt.
    assert prefix_groups(ids[:2], torch.tensor([[0, 1, 1], [1, 1, 1]])) is None
    assert prefix_groups(ids[1:4], mask[1:4]) is None  # no two adjacent rows share


def test_unsupported_models_fall_back(model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    class Wrapper(torch.nn.Module):  # what DDP / DeepSpeed engines look like from the outside
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def get_output_embeddings(self):
            return self.module.get_output_embeddings()

        def get_decoder(self):
            return self.module.get_decoder()

    assert supports_shared_prefix(model)
    assert not supports_shared_prefix(Wrapper(model))
    ckpt = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    ckpt.gradient_checkpointing_enable()
    assert not supports_shared_prefix(ckpt)      # transformers drops the cache under checkpointing
    assert supports_shared_prefix(ckpt.eval())   # ... only in training mode
    drop = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.1).train()
    assert not supports_shared_prefix(drop)      # one dropout mask would serve n rows
    assert supports_shared_prefix(drop.eval())
    zero3 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    next(zero3.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 puts on its partitioned weights
    assert not supports_shared_prefix(zero3)  # each rank must run the same collectives
    # A fallback still gives the right numbers (the ordinary forward runs).
    ro = grouped_rollout(model.config.vocab_size)
    R = ro.response_ids.shape[1]
    with torch.no_grad():
        a = response_forward(ckpt.train(), ro.input_ids, ro.attention_mask, R, share_prefix=True).log_probs
        b = response_forward(model, ro.input_ids, ro.attention_mask, R, share_prefix=False).log_probs
    assert torch.allclose(a, b, atol=1e-5)


def test_sliding_window_models_fall_back(tmp_path):
    from transformers import AutoModelForCausalLM

    from anabranch.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "mistral", arch="mistral")
    sliding = AutoModelForCausalLM.from_pretrained(path, sliding_window=4)
    assert not supports_shared_prefix(sliding)


def test_group_plan_keeps_whole_groups_within_the_computed_token_budget():
    ro = grouped_rollout(50, sizes=(3, 2, 4, 1), p_lens=(2, 6, 4, 5))
    p_len, r_len = ro.prompt_mask.sum(-1), ro.response_mask.sum(-1)
    for budget in (12, 25, 40, 1000):
        plan = plan_micro_batches(ro.prompt_mask, ro.response_mask, 100, budget, ro.group_index, share_prefix=True)
        rows = torch.cat([mb.rows for mb in plan]).sort().values
        assert rows.tolist() == list(range(10))
        for mb in plan:
            groups = ro.group_index[mb.rows]
            keep_p, keep_r = int(p_len[mb.rows].max()), int(r_len[mb.rows].max())
            assert mb.right - mb.left == keep_p + keep_r
            computed = len(groups.unique()) * keep_p + len(mb.rows) * keep_r
            whole = all(int((ro.group_index == g).sum()) == int((groups == g).sum()) for g in groups.unique())
            if budget >= 40:  # every group fits: none is split, and the budget holds
                assert whole and computed <= budget
            else:  # a split group's chunk fits unless it is a single row
                assert computed <= budget or len(mb.rows) == 1
            # rows of a group are adjacent in the micro-batch (their prompt runs once)
            assert prefix_groups(ro.prompt_ids[mb.rows], ro.prompt_mask[mb.rows]) is None or \
                len(prefix_groups(ro.prompt_ids[mb.rows], ro.prompt_mask[mb.rows]).unique()) == len(groups.unique())
    assert len(plan) == 1  # budget 1000: one micro-batch
    assert len(plan_micro_batches(ro.prompt_mask, ro.response_mask, 100, 40, ro.group_index, share_prefix=True)) > 1


def _update(model, start, ro, algo, modules=None, ref_model=None, **kw):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    params = list(model.parameters()) + [p for m in (modules or {}).values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1.0)
    rewards = torch.linspace(0, 1, ro.response_ids.shape[0])
    adv = compute_advantages(algo, model, ro, rewards, micro_batch_size=kw["micro_batch_size"], temperature=1.0,
                             modules=modules, share_prompt_prefix=kw["share_prompt_prefix"], ref_model=ref_model)
    metrics = policy_update(model, opt, ro, adv.advantages, rewards, algo, grad_clip=0.0, temperature=1.0,
                            max_response_len=7, modules=modules, precomputed=adv.precomputed, ref_model=ref_model,
                            **kw)
    return torch.cat([p.detach().flatten().clone() for p in params]), metrics


@pytest.mark.parametrize("algo_cfg", [
    AlgorithmConfig(name="grpo", entropy_coef=0.01),
    AlgorithmConfig(name="flowrl", flowrl=FlowRLConfig(log_z="head")),   # log Z from prompt hidden states
    AlgorithmConfig(name="ppo"),                                        # values from response hidden states
], ids=["grpo", "flowrl", "ppo"])
def test_whole_update_is_the_same_with_and_without_sharing(model, tiny_model_dir, algo_cfg):
    from transformers import AutoModelForCausalLM

    ro = grouped_rollout(model.config.vocab_size)
    algo = resolve_algorithm(algo_cfg)
    ref_model = None
    if "ref_log_prob" in algo.needs:  # a reference a little away from the policy
        ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        with torch.no_grad():
            for p in ref_model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    results, computed = {}, {}
    seen: list[int] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    for share in (False, True):
        for tokens in (0, 40):  # fixed micro-batches of whole groups; a token budget over groups
            torch.manual_seed(3)
            modules = {k: f(model.config, algo.cfg) for k, f in algo.module_factories.items()}
            for m in modules.values():  # non-zero heads, so that their gradients reach the trunk
                m.eval()  # the log Z head's dropout would draw differently for each micro-batch plan
                for p in m.parameters():
                    torch.nn.init.normal_(p, std=0.1)
            seen.clear()
            results[share, tokens] = _update(model, start, ro, algo, modules, ref_model, micro_batch_size=5,
                                             micro_batch_tokens=tokens, share_prompt_prefix=share)
            computed[share, tokens] = sum(seen)
    hook.remove()
    # The shared path really ran: fewer tokens went through the decoder (prompts of 2-6 tokens
    # computed once per group instead of once per row).
    assert computed[True, 0] < computed[False, 0] and computed[True, 40] < computed[False, 40], computed
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    ref, m_ref = results[False, 0]
    start_flat = torch.cat([p.flatten() for p in start.values()])
    moved = ref[:start_flat.numel()] - start_flat
    assert moved.abs().sum() > 0
    for key, (params, metrics) in results.items():
        # Updates (lr = 1: the gradient itself) agree to float rounding, whichever plan and path:
        # rounding (sums over rows in another order) is relative to the gradient's scale, so an
        # entry near zero may differ by more than its own size times a tolerance.
        delta = params[:start_flat.numel()] - start_flat
        err = float((delta - moved).abs().max())
        assert err <= 1e-5 * float(moved.abs().max()), (key, err, float(moved.abs().max()))
        head = params[start_flat.numel():] - ref[start_flat.numel():]
        assert float(torch.cat([head.abs(), torch.zeros(1)]).max()) <= 1e-5 * float(ref.abs().max()), key
        assert metrics["loss"] == pytest.approx(m_ref["loss"], rel=1e-4, abs=1e-6), key
