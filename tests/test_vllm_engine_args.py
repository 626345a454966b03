"""Engine arguments the vLLM backend derives from the model and config (no vllm package needed)."""

from types import SimpleNamespace

import pytest
import torch

from anabranch.config import ConfigError, RolloutConfig
from anabranch.rollout.vllm_backend import engine_args, engine_dtype, engine_max_model_len


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
    assert args["kv_cache_memory_bytes"] == 512 * 2**20 and "gpu_memory_utilization" not in args
    assert (args["model"], args["tokenizer"], args["max_model_len"]) == ("/m", "/m", 2048)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own variable wins
    assert "kv_cache_memory_bytes" not in engine_args(FakeModel("cpu"), "/m", RolloutConfig())
    assert engine_args(FakeModel("cpu", torch.bfloat16), "/m", RolloutConfig())["dtype"] == "bfloat16"


def test_gpu_engine_uses_the_autocast_precision_and_cuda_graphs():
    gpu = FakeModel("cuda")  # fp32 master weights
    args = engine_args(gpu, "/m", RolloutConfig(vllm_gpu_memory_utilization=0.4), mixed_precision="bf16")
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] is False
    assert args["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in args
    assert engine_args(gpu, "/m", RolloutConfig(), mixed_precision="fp16")["dtype"] == "float16"
    assert engine_args(gpu, "/m", RolloutConfig(), mixed_precision="no")["dtype"] == "float32"
    assert engine_args(gpu, "/m", RolloutConfig(vllm_cuda_graphs=False))["enforce_eager"] is True
    # An explicit precision wins over the launcher's.
    assert engine_args(gpu, "/m", RolloutConfig(vllm_dtype="float32"), mixed_precision="bf16")["dtype"] == "float32"


def test_unknown_engine_dtype_is_refused():
    with pytest.raises(ConfigError, match="rollout.vllm_dtype 'fp8'"):
        engine_dtype(FakeModel(), RolloutConfig(vllm_dtype="fp8"))
