"""Engine arguments the vLLM backend derives from the model and config (no vllm package needed)."""

from types import SimpleNamespace

from anabranch.config import RolloutConfig
from anabranch.rollout.vllm_backend import engine_max_model_len


def model_with(**config):
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_context_is_capped_at_the_models_positions():
    # vLLM refuses max_model_len > max_position_embeddings (the benchmark's tiny Qwen2 has 1024).
    assert engine_max_model_len(model_with(max_position_embeddings=1024), RolloutConfig()) == 1024
    assert engine_max_model_len(model_with(max_position_embeddings=8192), RolloutConfig()) == 2048
    assert engine_max_model_len(model_with(max_position_embeddings=8192),
                                RolloutConfig(vllm_max_model_len=4096)) == 4096
    assert engine_max_model_len(model_with(), RolloutConfig(vllm_max_model_len=300)) == 300
