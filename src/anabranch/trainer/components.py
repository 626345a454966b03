"""Building everything a run needs from its config, in the order that fails fastest:
config checks, data and rewards first (cheap), models last (expensive)."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anabranch.algorithms import ADVANTAGES, Algorithm, resolve_algorithm
from anabranch.algorithms.dsdr import check_embedding_package as check_dsdr_embedding_package
from anabranch.config import Config, ConfigError
from anabranch.data.mixture import source_prompts
from anabranch.eval.accuracy import correctness_source
from anabranch.data.prompts import build_prompt
from anabranch.data.tasks import load_task
from anabranch.models.loading import load_model, load_tokenizer
from anabranch.models.lora import apply_lora, reference_policy
from anabranch.rewards import RewardSource, build_rewards
from anabranch.rewards.compose import check_row_fields
from anabranch.rollout import ROLLOUT_BACKENDS
from anabranch.rollout.multi_turn import prompt_task, with_tools
from anabranch.rollout.retry_turns import check_data as check_retry_data, with_retry_turns
from anabranch.rollout.environments import environment_table, with_environment
from anabranch.rollout.tools import build_tools
from anabranch.trainer.host_memory import keep_freed_host_memory
from anabranch.trainer.kdrl_step import check_teacher_path, load_teacher
from anabranch.trainer.preflight import check_paths, check_prompt_lengths

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: Config
    algo: Algorithm
    rewards: list[RewardSource]
    tokenizer: Any
    model: Any
    ref_model: Any
    backend: Any
    optimizer: Any
    device: torch.device
    train_rows: list[dict]
    eval_rows: list[dict]
    train_prompts: list[str]
    eval_prompts: list[str]
    modules: dict
    teacher: Any = None  # KDRL's frozen teacher (trainer/kdrl_step.py); None unless algorithm.kdrl.teacher
    inspo: Any = None  # INSPO's instruction population (trainer/instruction_population.py); None unless task.inspo


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build(cfg: Config, mixed_precision: str = "no") -> Components:
    """Everything a run needs. ``mixed_precision`` (``no``/``bf16``/``fp16``, the launcher's autocast)
    sets the vLLM engine's precision when ``rollout.vllm_dtype=auto``."""
    check_paths(cfg)  # model.path, model.tokenizer, trainer.resume exist
    check_teacher_path(cfg)  # algorithm.kdrl.teacher (KDRL), likewise
    algo = resolve_algorithm(cfg.algorithm)
    if ADVANTAGES.meta(algo.cfg.advantage).get("group") and cfg.rollout.n < 2:
        raise ConfigError("rollout.n must be >= 2 for group-relative advantages (got 1)")
    try:
        ROLLOUT_BACKENDS.get(cfg.rollout.backend)
    except KeyError as exc:
        raise ConfigError(f"rollout.backend: {exc.args[0]}") from None
    rewards = build_rewards(cfg.reward)
    if (algo.cfg.dsdr_global_coef or algo.cfg.dsdr_local_coef) and correctness_source(rewards) is None:
        raise ConfigError("algorithm.dsdr_global_coef / dsdr_local_coef need a reward that says right or wrong "
                          "(a correctness reward such as math_verify, which may have weight 0) in reward.functions")
    check_dsdr_embedding_package(algo.cfg)  # dsdr_similarity=embedding without its package: stop before any model loads
    # a bad tool name (or search corpus) fails here, not after loading
    build_tools(list(cfg.rollout.tools), cfg.rollout.tool_timeout_s, cfg.rollout)
    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    seed_everything(cfg.trainer.seed)
    device = pick_device(cfg.trainer.device)
    if device.type == "cpu" and cfg.trainer.keep_freed_host_memory:
        keep_freed_host_memory()

    train_rows, eval_rows = load_task(cfg.task)  # first: a data error is reported before any model file is read
    check_row_fields(rewards, train_rows + eval_rows)  # e.g. the reasoning_gym reward on a file task
    task = prompt_task(cfg.task, cfg.rollout)  # with the tools' instructions when rollout.tools is set
    tokenizer = load_tokenizer(cfg.model)
    train_prompts = [build_prompt(r, task, tokenizer) for r in train_rows]
    eval_prompts = [build_prompt(r, task, tokenizer) for r in eval_rows]
    if cfg.task.mixture:  # each source's own instruction and system prompt (data/mixture.py)
        train_prompts = source_prompts(cfg, train_rows, train_prompts, tokenizer)
        eval_prompts = source_prompts(cfg, eval_rows, eval_prompts, tokenizer)
    # rollout.retry_turns: gold answers, before the model (the table, kept for with_retry_turns below)
    retry_answers = check_retry_data(cfg, tokenizer, train_rows, train_prompts)
    # rollout.environment: every task row's environment, checked before the model (None when unset)
    env_table = environment_table(cfg, train_rows + eval_rows, train_prompts + eval_prompts)
    longest_prompt = check_prompt_lengths(train_prompts + eval_prompts, tokenizer, cfg)

    model = apply_lora(load_model(cfg.model, device, trainable=True), cfg.model.lora, cfg.model.gradient_checkpointing)
    warn_low_precision_weights(cfg, model)
    if cfg.trainer.compile_layers:
        compile_policy_layers(model, device, cfg)
    ref_model = (reference_policy(model, cfg.model, lambda: load_model(cfg.model, device, trainable=False))
                 if "ref_log_prob" in algo.needs else None)
    teacher = load_teacher(cfg, tokenizer, device)  # KDRL (trainer/kdrl_step.py): None unless kdrl.teacher
    backend_kwargs = {}
    if cfg.rollout.backend == "vllm":  # the engine's precision and KV cache are fixed when it starts
        backend_kwargs = {"mixed_precision": mixed_precision,
                          "kv_tokens": largest_generate_kv(cfg, longest_prompt, len(eval_prompts))}
    backend = ROLLOUT_BACKENDS.get(cfg.rollout.backend)(model, tokenizer, cfg.rollout, **backend_kwargs)
    if hasattr(backend, "share_prompt_prefix"):  # generate: one prefill per prompt for its n samples
        backend.share_prompt_prefix = cfg.trainer.share_prompt_prefix
    # multi-turn rollouts when rollout.tools is set; the policy: rollout.arpo's entropies (branching training rollouts)
    backend = with_tools(backend, tokenizer, cfg.rollout, policy=model)
    if cfg.rollout.self_search.enabled:  # SSRL: <information> spans out of the loss, sim2real at evaluation
        from anabranch.rollout.self_search import with_self_search

        backend = with_self_search(backend, tokenizer, cfg.rollout)
    backend = with_retry_turns(backend, tokenizer, cfg, train_rows, train_prompts,  # rollout.retry_turns (UFO)
                               answers=retry_answers)  # the table check_data built, not built again
    backend = with_environment(backend, tokenizer, cfg, env_table)  # rollout.environment's episodes
    if cfg.task.cobalt.enabled:  # Cobalt: the reference's partial trajectories become the training prompts
        from anabranch.data.cobalt_contexts import online_contexts

        train_rows, train_prompts = online_contexts(cfg, tokenizer, backend, rewards, train_rows, train_prompts, device)
    warn_per_micro_batch_selection(cfg, algo, model, device, longest_prompt)
    warn_unused_tis(cfg)
    modules = {name: factory(model.config, algo.cfg).to(device) for name, factory in algo.module_factories.items()}
    optimizer = build_optimizer(cfg, model, modules)
    return Components(cfg, algo, rewards, tokenizer, model, ref_model, backend, optimizer, device,
                      train_rows, eval_rows, train_prompts, eval_prompts, modules=modules, teacher=teacher)


def compile_policy_layers(model, device: torch.device, cfg: Config) -> None:
    """``trainer.compile_layers``: the compiled norm, MLP and rotary functions (models/fused_layers.py),
    measured and tested on CPU in a single process only, so refused elsewhere rather than assumed."""
    if (device.type != "cpu" or cfg.distributed.num_processes > 1 or torch.distributed.is_initialized()
            or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ConfigError("trainer.compile_layers=true is supported for single-process CPU training only "
                          f"(device {device.type}, {cfg.distributed.num_processes} processes)")
    if cfg.model.gradient_checkpointing:
        raise ConfigError("trainer.compile_layers=true does not combine with model.gradient_checkpointing")
    from anabranch.models.fused_layers import install

    counts = install(model)
    if not (counts["rms_norm"] or counts["mlp"] or counts["rotary"]):
        raise ConfigError("trainer.compile_layers=true: no RMSNorm, gated SiLU MLP or rotary function of "
                          f"{type(model).__name__} matches the compiled formulas; set it to false")


# Significant bits of the low-precision float types a policy may be loaded in.
_SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11}


def warn_low_precision_weights(cfg: Config, model) -> str | None:
    """Trainable weights in bf16/fp16 (``model.dtype``, full fine-tuning) are updated without an fp32
    master copy, so an AdamW step (about ``trainer.lr`` per weight) is rounded away on every weight
    larger than lr·2^(bits+1) in magnitude: at lr 2e-5 in bf16, every weight above ~0.01 never moves
    (on the tiny test model 70% of the weights did not change in a step). LoRA adapters stay fp32
    (peft). Said once, at the start; returns the warning."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    low = sorted((d for d in dtypes if d in _SIGNIFICANT_BITS), key=str)
    if not low:
        return None
    from anabranch.rewards.guard import warn

    bits = min(_SIGNIFICANT_BITS[d] for d in low)
    name = str(low[0]).removeprefix("torch.")
    text = (f"model.dtype={cfg.model.dtype}: the trained weights are {name} with no fp32 master copy, so an "
            f"AdamW step of about trainer.lr={cfg.trainer.lr:g} is rounded away on every weight larger than "
            f"about {cfg.trainer.lr * 2 ** (bits + 1):.2g} in magnitude; train in model.dtype=float32 (with "
            "distributed.mixed_precision=bf16 on GPUs) or with LoRA (model.lora.r > 0: fp32 adapters)")
    warn(text)
    return text


def warn_per_micro_batch_selection(cfg: Config, algo: Algorithm, model, device: torch.device,
                                   longest_prompt: int) -> str | None:
    """The high-entropy token mask (``entropy_top_rho``), Clip-Cov and KL-Cov select tokens within
    each micro-batch (algorithms/exploration.py, cov_control.py): the paper's selection over the
    step batch only when one micro-batch holds it. Say so (once, at the start) when a step's batch
    may span several micro-batches, instead of silently approximating; returns the warning."""
    a = algo.cfg
    controls = ([f"algorithm.entropy_top_rho={a.entropy_top_rho}"] if a.entropy_top_rho < 1 else []) + \
        ([f"algorithm.loss={a.loss}"] if a.loss in ("clip_cov", "kl_cov") else [])
    if not controls:
        return None
    from anabranch.models.shared_prefix import supports_shared_prefix
    from anabranch.trainer.microbatch import resolve_micro_batch_tokens

    r, t = cfg.rollout, cfg.trainer
    rows = r.prompts_per_step * r.n
    budget = resolve_micro_batch_tokens(t.micro_batch_tokens, device, model.config.vocab_size)
    world = max(cfg.distributed.num_processes, int(os.environ.get("WORLD_SIZE", "1")))
    if world > 1:  # each process selects within its own share of the batch
        splits, setting = True, f"{world} data-parallel processes"
    elif budget > 0:
        shared = t.share_prompt_prefix and supports_shared_prefix(model)
        tokens = (r.prompts_per_step * longest_prompt + rows * r.max_new_tokens if shared
                  else rows * (longest_prompt + r.max_new_tokens))
        splits, setting = tokens > budget, f"trainer.micro_batch_tokens={budget} (up to {tokens} tokens a step)"
    else:
        splits, setting = t.micro_batch_size < rows, f"trainer.micro_batch_size={t.micro_batch_size}"
    if not splits:
        return None
    from anabranch.rewards.guard import warn

    verb = "selects" if len(controls) == 1 else "select"
    text = (f"{' and '.join(controls)} {verb} tokens within each micro-batch, and a step's {rows} sequences may "
            f"span several with {setting}: the selection is then per micro-batch, not over the step batch. "
            f"For the batch-wide selection set trainer.micro_batch_tokens=0 trainer.micro_batch_size={rows}"
            + (" and train in one process" if world > 1 else ""))
    warn(text)
    return text


def warn_unused_tis(cfg: Config) -> str | None:
    """``algorithm.tis_cap`` corrects the gap between an inference engine's sampling log-probs and the
    trainer's; the generate backend samples from the trained model itself and returns none, so the
    setting does nothing there. Said once, at the start; returns the warning."""
    # With EAD the generate backend samples from a tempered distribution and records its log-probs,
    # so the cap does correct something there.
    if cfg.algorithm.tis_cap <= 0 or cfg.rollout.backend != "hf" or cfg.rollout.temperature_schedule != "constant":
        return None
    from anabranch.rewards.guard import warn

    text = (f"algorithm.tis_cap={cfg.algorithm.tis_cap:g} has no effect with rollout.backend=hf: the generate "
            "backend samples from the trained model itself, so there is no sampler mismatch to correct "
            "(it applies to rollout.backend=vllm)")
    warn(text)
    return text


def largest_generate_kv(cfg: Config, longest_prompt: int, eval_prompts: int) -> int:
    """KV-cache tokens of the vLLM engine's largest generate call: a training step (every sample of
    the step in one call) or an evaluation batch (``greedy_accuracy`` decodes up to 64 prompts at once).
    With ``task.cobalt`` a training prompt is a context up to Cobalt's context budget long."""
    from anabranch.eval.accuracy import EVAL_BATCH_SIZE
    from anabranch.rollout.vllm_backend import kv_cache_tokens

    r = cfg.rollout
    train_prompt = longest_prompt
    if cfg.task.cobalt.enabled:  # Cobalt's contexts (built after the engine starts) replace the training prompts
        from anabranch.data.cobalt_contexts import context_budget

        train_prompt = max(longest_prompt, context_budget(cfg))
    train = kv_cache_tokens(r.prompts_per_step * r.n, train_prompt, r.max_new_tokens)
    eval_new = cfg.trainer.eval_max_new_tokens or r.max_new_tokens
    return max(train, kv_cache_tokens(min(eval_prompts, EVAL_BATCH_SIZE), longest_prompt, eval_new))


def build_optimizer(cfg: Config, model, modules: dict):
    """AdamW over the policy and any extra heads; a head may set ``lr_multiplier``."""
    t = cfg.trainer
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": t.lr}]
    for module in modules.values():
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            groups.append({"params": params, "lr": t.lr * getattr(module, "lr_multiplier", 1.0)})
    return adamw(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay)


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with its fused kernel where torch has one for these parameters (CPU and
    CUDA, float dtypes): one pass over each tensor instead of a loop of element-wise ops, about 3x
    faster on CPU, with the same update up to float rounding (tests/test_fused_adamw.py). Otherwise
    torch's default implementation."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, **kwargs)


def lr_lambda(cfg: Config):
    t = cfg.trainer

    def fn(step: int) -> float:
        warm = min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps > 0 else 1.0
        if t.lr_schedule == "cosine" and t.steps > 0:
            import math

            return warm * 0.5 * (1 + math.cos(math.pi * min(step, t.steps) / t.steps))
        if t.lr_schedule == "linear" and t.steps > 0:
            return warm * max(0.0, 1 - step / t.steps)
        return warm

    return fn  # trainer.lr_schedule is checked with the config (config_checks)


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("transformers", "datasets", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - transformers always present in practice
        pass
