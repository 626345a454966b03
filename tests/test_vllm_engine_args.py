"""Engine arguments the vLLM backend derives from the model and config (no vllm package needed)."""

from types import SimpleNamespace

import pytest
import torch

from anabranch.config import ConfigError, RolloutConfig
from anabranch.rollout.vllm_backend import (cpu_kv_cache_bytes, engine_args, engine_dtype, engine_max_model_len,
                                           kv_bytes_per_token, kv_cache_tokens)


def model_with(**config):
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_context_is_capped_at_the_models_positions():
    # vLLM refuses max_model_len > max_position_embeddings (the benchmark's tiny Qwen2 has 1024).
    assert engine_max_model_len(model_with(max_position_embeddings=1024), RolloutConfig()) == 1024
    assert engine_max_model_len(model_with(max_position_embeddings=8192), RolloutConfig()) == 2048
    assert engine_max_model_len(model_with(max_position_embeddings=8192),
                                RolloutConfig(vllm_max_model_len=4096)) == 4096
    assert engine_max_model_len(model_with(), RolloutConfig(vllm_max_model_len=300)) == 300


class FakeModel:
    """What `engine_args` reads: the parameters' device, the dtype and the config."""

    def __init__(self, device="cpu", dtype=torch.float32):
        self.param = SimpleNamespace(device=torch.device(device))
        self.dtype = dtype
        self.config = SimpleNamespace(max_position_embeddings=8192)

    def parameters(self):
        return iter([self.param])


def test_cpu_engine_runs_eagerly_in_the_models_dtype_with_a_fixed_kv_cache(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = engine_args(FakeModel("cpu"), "/m", RolloutConfig(), mixed_precision="bf16")
    # bf16 autocast on CPU does not change the engine: the trainer's weights are fp32 there.
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert args["kv_cache_memory_bytes"] == 512 * 2**20 and "gpu_memory_utilization" not in args  # size unknown
    assert (args["model"], args["tokenizer"], args["max_model_len"]) == ("/m", "/m", 2048)
    # 32-token KV blocks, not vLLM-cpu's 128: only full blocks are shared between the n samples.
    assert args["block_size"] == 32
    assert engine_args(FakeModel("cpu"), "/m", RolloutConfig(vllm_cpu_compile=True))["enforce_eager"] is False
    assert engine_args(FakeModel("cpu"), "/m", RolloutConfig(vllm_cuda_graphs=True))["enforce_eager"] is True
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own variable wins
    assert "kv_cache_memory_bytes" not in engine_args(FakeModel("cpu"), "/m", RolloutConfig())
    assert engine_args(FakeModel("cpu", torch.bfloat16), "/m", RolloutConfig())["dtype"] == "bfloat16"


def test_gpu_engine_uses_the_autocast_precision_and_cuda_graphs():
    gpu = FakeModel("cuda")  # fp32 master weights
    args = engine_args(gpu, "/m", RolloutConfig(vllm_gpu_memory_utilization=0.4), mixed_precision="bf16")
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] is False
    assert args["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in args
    assert "block_size" not in args  # vLLM's GPU default (16)
    assert engine_args(gpu, "/m", RolloutConfig(), mixed_precision="fp16")["dtype"] == "float16"
    assert engine_args(gpu, "/m", RolloutConfig(), mixed_precision="no")["dtype"] == "float32"
    assert engine_args(gpu, "/m", RolloutConfig(vllm_cuda_graphs=False))["enforce_eager"] is True
    assert engine_args(gpu, "/m", RolloutConfig(vllm_cpu_compile=False))["enforce_eager"] is False  # CPU-only key
    # An explicit precision wins over the launcher's.
    assert engine_args(gpu, "/m", RolloutConfig(vllm_dtype="float32"), mixed_precision="bf16")["dtype"] == "float32"


def test_unknown_engine_dtype_is_refused():
    with pytest.raises(ConfigError, match="rollout.vllm_dtype 'fp8'"):
        engine_dtype(FakeModel(), RolloutConfig(vllm_dtype="fp8"))


SMOLLM2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                          max_position_embeddings=8192)


def test_kv_cache_is_counted_in_whole_blocks_of_keys_and_values():
    assert kv_cache_tokens(32, 37, 64) == 32 * 128  # 101 tokens take four 32-token blocks
    assert kv_cache_tokens(2, 100, 100) == 2 * 224
    # SmolLM2: 30 layers x (K and V) x 3 KV heads x head_dim 64 (576 / 9) x 4 bytes.
    assert kv_bytes_per_token(SMOLLM2, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(SMOLLM2, "bfloat16") == 23_040
    explicit = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, head_dim=32)
    assert kv_bytes_per_token(explicit, "float32") == 2 * 2 * 4 * 32 * 4  # no GQA: KV heads = heads


def test_cpu_kv_cache_is_sized_for_the_run_with_one_full_context_at_least(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model = FakeModel("cpu")
    model.config = SMOLLM2
    cfg = RolloutConfig()  # vllm_cpu_kv_cache_mib=0: sized from the run
    w1 = kv_cache_tokens(32, 37, 64)  # W1: 4 prompts x 8 samples x 64 tokens
    # Twice the step's blocks (with exactly them, vLLM decoded in two waves): 360 MiB.
    assert engine_args(model, "/m", cfg, kv_tokens=w1)["kv_cache_memory_bytes"] == 2 * 4096 * 46_080
    # Never less than one max_model_len (2048) sequence plus the block vLLM keeps back: it refuses to
    # start otherwise ("estimated maximum model length is 992" for a 1024 cache and max_model_len).
    assert cpu_kv_cache_bytes(model, cfg, "float32", 100) == (2048 + 32) * 46_080
    assert cpu_kv_cache_bytes(model, cfg, "float32", None) == 512 * 2**20  # batch unknown (anabranch eval)
    assert cpu_kv_cache_bytes(model, RolloutConfig(vllm_cpu_kv_cache_mib=64), "float32", w1) == 64 * 2**20


def test_largest_generate_call_of_a_run():
    from anabranch.config_loading import load_config
    from anabranch.trainer.components import largest_generate_kv

    cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.n=8", "rollout.max_new_tokens=64"])
    assert largest_generate_kv(cfg, 37, eval_prompts=0) == 32 * 128
    # 100 held-out prompts are decoded 64 at a time, with eval_max_new_tokens.
    cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.n=8", "rollout.max_new_tokens=64",
                             "trainer.eval_max_new_tokens=300"])
    assert largest_generate_kv(cfg, 37, eval_prompts=100) == 64 * 352  # 337 tokens in 32-token blocks


def test_engine_env_quiets_vllm_and_drops_only_its_benign_per_step_warnings(monkeypatch, caplog):
    import logging

    from anabranch.rollout.vllm_backend import _set_engine_env

    for name in ("VLLM_LOGGING_LEVEL", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)  # restored (unset) after the test
    _set_engine_env(torch.device("cpu"))
    _set_engine_env(torch.device("cpu"))  # a second engine adds no second filter
    import os

    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert len(layerwise.filters) == 1
    with caplog.at_level(logging.WARNING):
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        logging.getLogger("vllm.v1.worker.cpu_worker").warning(
            "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
        layerwise.warning("%s: something else", "Linear")
    assert [r.getMessage() for r in caplog.records] == ["Linear: something else"]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    _set_engine_env(torch.device("cpu"))
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"  # the user's choice stands
