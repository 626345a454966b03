"""Shared pieces of the benchmarks: models, prompts, the two GRPO runners, FLOPs and the matmul peak.

A runner does ``warmup + steps`` GRPO steps (rollout → reward → advantage → one update) on the same
prompts and returns per-step timings. Both sides get the same model files, prompts, n, completion
length (min = max new tokens, so every completion has exactly that many tokens), reward function,
AdamW settings (torch's fused AdamW on both sides: TRL's default, and anabranch's) and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from anabranch.trainer.host_memory import keep_freed_host_memory

SMOLLM2 = "packaged:smollm2-135m-instruct"
LR = 1e-6


@dataclass
class Workload:
    model: str             # a model folder
    prompts_per_step: int = 4
    n: int = 8
    tokens: int = 64       # new tokens per completion, fixed (min = max)
    warmup: int = 1
    steps: int = 3
    threads: int = 2
    micro_batch_tokens: int = 8192  # anabranch's token budget per micro-batch
    share_prompt_prefix: bool = True  # anabranch's trainer.share_prompt_prefix (each prompt runs once per group)
    # glibc keeps freed memory for reuse (anabranch's trainer.keep_freed_host_memory, on by default on
    # CPU); run_trl applies it only when asked, to show what the same setting does for TRL.
    keep_freed_memory: bool = True
    vllm_cpu_kv_cache_mib: int = 0  # 0: sized for the workload, as `anabranch train` does
    compile_layers: bool = False  # anabranch's trainer.compile_layers (models/fused_layers.py)
    vllm_cpu_compile: bool = False  # anabranch's rollout.vllm_cpu_compile (vLLM compiles the CPU engine's model)
    # Both sides: recompute activations in the backward pass. TRL's GRPOConfig turns it on unless told
    # otherwise (TRL 1.16: gradient_checkpointing=True by default), anabranch's model config does not;
    # the comparison sets the same value on both (off: the faster choice when memory allows).
    gradient_checkpointing: bool = False
    # anabranch's trainer.zero_advantage_rows: sequences with Â = 0 everywhere (a prompt whose n
    # samples got the same reward) get a forward pass without gradient (forward, the trainer's
    # default), none (skip), or forward and backward (train). The benchmarks default to train, as
    # TRL does, so both sides compute the same work: the random tiny model never earns a reward,
    # so with forward its updates would hold no backward pass at all.
    zero_advantage_rows: str = "train"
    # anabranch only: the matmul peak of the moment, probed for probe_seconds right before and after
    # each update (see MatmulProbe); the probes' time is taken out of the step's timings.
    probe_peak: bool = False
    probe_seconds: float = 1.0


@dataclass
class RunResult:
    system: str
    backend: str
    step_s: list = field(default_factory=list)
    cpu_s: list = field(default_factory=list)  # CPU time of the process per step (robust to a busy machine)
    generate_s: list = field(default_factory=list)
    update_s: list = field(default_factory=list)
    # anabranch only: the update's forward+backward passes (policy_update's `time/forward_backward_s`)
    forward_backward_s: list = field(default_factory=list)
    # anabranch with Workload.probe_peak: per timed step, the mean of the probes before and after its update
    adjacent_peak_gflops: list = field(default_factory=list)
    # anabranch: per timed step, the fraction of sequences with Â = 0 everywhere (no share in the gradient)
    zero_advantage_frac: list = field(default_factory=list)
    generated_tokens: int = 0     # per step
    trained_tokens: int = 0       # per step: real (non-pad) prompt + response tokens
    prompt_tokens: list = field(default_factory=list)  # per sequence of the last step
    peak_rss_mib: float = 0.0
    startup_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def cpu_time() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --------------------------------------------------------------------------- models and prompts


def tiny_qwen2(folder: str | Path) -> str:
    """A random Qwen2 with 4 layers, hidden 256 and SmolLM2's tokenizer (16.5M parameters)."""
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_tokenizer
    from anabranch.models.tiny import build_tiny_model

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        tok = load_tokenizer(ModelConfig(path=SMOLLM2))
        build_tiny_model(folder, tokenizer=tok, arch="qwen2", hidden=256, layers=4, heads=4, kv_heads=2,
                         intermediate=1024, seed=0)
    return str(folder)


def model_folder(name: str) -> str:
    from anabranch.models.loading import resolve_model_path

    if name == "tiny":
        return tiny_qwen2(Path(tempfile.gettempdir()) / "anabranch-bench-tiny-qwen2")
    if name == "smollm2":
        return resolve_model_path(SMOLLM2)
    return resolve_model_path(name)


def arithmetic_prompts(tokenizer, count: int) -> tuple[list[str], list[str]]:
    """``count`` basic_arithmetic questions in the chat template, and their answers."""
    from anabranch.config import TaskConfig
    from anabranch.data.prompts import build_prompt
    from anabranch.data.tasks import load_task

    cfg = TaskConfig(name="basic_arithmetic", train_size=count, eval_size=0, seed=0)
    rows, _ = load_task(cfg)
    rows = (rows * (count // max(len(rows), 1) + 1))[:count]
    return [build_prompt(r, cfg, tokenizer) for r in rows], [str(r["answer"]) for r in rows]


def random_rollout(tokenizer, prompts: int, n: int, tokens: int):
    """W1's shapes for timing an update: ``prompts`` arithmetic prompts, each repeated ``n`` times, with
    random response tokens, all ``tokens`` long (an update's cost does not depend on what was sampled)."""
    from anabranch.rollout.base import Rollout

    texts, _ = arithmetic_prompts(tokenizer, prompts)
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = prompts * n
    return Rollout(enc["input_ids"].repeat_interleave(n, 0), enc["attention_mask"].repeat_interleave(n, 0),
                   torch.randint(100, 1000, (rows, tokens)), torch.ones(rows, tokens, dtype=torch.long),
                   torch.arange(prompts).repeat_interleave(n), texts, [""] * rows, torch.ones(rows, dtype=torch.bool))


def batch_parser(description: str, model: str = "smollm2", prompts: int = 4) -> argparse.ArgumentParser:
    """A benchmark's argument parser holding the batch it measures: ``--model`` (tiny, smollm2 or a
    folder), ``--prompts`` × ``--n`` samples of ``--tokens`` new tokens (W1's 4 × 8 × 64 by default)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model)
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    return ap


@dataclass
class UpdateBatch:
    path: str
    model: torch.nn.Module
    rollout: object  # anabranch.rollout.base.Rollout
    algo: object
    optimizer: torch.optim.Optimizer
    rewards: torch.Tensor
    advantages: torch.Tensor


def update_batch(model: str, prompts: int, n: int, tokens: int, device: str = "cpu") -> UpdateBatch:
    """What timing ``policy_update`` alone needs: the model loaded as the trainer loads it, a
    :func:`random_rollout`, GRPO advantages of random rewards and the trainer's fused AdamW."""
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig, ModelConfig
    from anabranch.models.loading import load_model, load_tokenizer
    from anabranch.trainer.components import adamw

    path = model_folder(model)
    tok = load_tokenizer(ModelConfig(path=path))
    policy = load_model(ModelConfig(path=path), torch.device(device))
    ro = random_rollout(tok, prompts, n, tokens)
    algo = resolve_algorithm(AlgorithmConfig())
    rewards = torch.rand(prompts * n)
    adv = algo.advantage(rewards, ro.group_index, ro.response_mask.float(), algo.cfg)
    return UpdateBatch(path, policy, ro, algo, adamw(policy.parameters(), lr=LR), rewards, adv)


def in_turns(variants: list, run, rounds: int, label=str) -> dict:
    """Time each of ``variants`` once per round, in turns (A B ... then ... B A, so the host's drift
    hits them alike); ``run(variant, round)`` returns seconds, or (seconds, note) to print beside
    them. Returns {variant: [seconds per round]}."""
    times = {v: [] for v in variants}
    width = max(len(label(v)) for v in variants)
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            out = run(v, r)
            seconds, note = out if isinstance(out, tuple) else (out, "")
            times[v].append(seconds)
            print(f"round {r}: {label(v):<{width}} {seconds:7.2f} s{note}", flush=True)
    return times


def engine_kv_tokens(tokenizer, prompts: list[str], sequences: int, tokens: int) -> int:
    """The KV cache `anabranch train` would give the vLLM engine (trainer/components.py) for calls of
    ``sequences`` sequences of the longest of ``prompts`` plus ``tokens`` new tokens."""
    from anabranch.rollout.vllm_backend import kv_cache_tokens

    longest = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    return kv_cache_tokens(sequences, longest, tokens)


def contains_answer(completions: list[str], answers: list[str]) -> list[float]:
    """The reward both systems use: 1 when the answer string occurs in the completion."""
    return [float(a in c) for c, a in zip(completions, answers)]


# --------------------------------------------------------------------------- anabranch


class AnabranchRunner:
    """anabranch's GRPO step, as in trainer/loop.py, with its timings."""

    def __init__(self, w: Workload, backend: str):
        from anabranch.algorithms.resolve import resolve_algorithm
        from anabranch.config import AlgorithmConfig, ModelConfig, RolloutConfig
        from anabranch.models.loading import load_model, load_tokenizer
        from anabranch.rollout import ROLLOUT_BACKENDS
        from anabranch.trainer.components import adamw

        torch.set_num_threads(w.threads)
        torch.manual_seed(0)
        if w.keep_freed_memory:
            keep_freed_host_memory()
        t0 = time.perf_counter()
        self.w, self.backend_name = w, backend
        self.tok = load_tokenizer(ModelConfig(path=w.model))
        self.model = load_model(ModelConfig(path=w.model, gradient_checkpointing=w.gradient_checkpointing),
                                torch.device("cpu"), trainable=True)
        if w.compile_layers:  # compiled in the first (warm-up) update
            from anabranch.models.fused_layers import install

            install(self.model)
        self.rollout_cfg = RolloutConfig(backend=backend, n=w.n, prompts_per_step=w.prompts_per_step,
                                         max_new_tokens=w.tokens, min_new_tokens=w.tokens,
                                         vllm_max_model_len=1024, vllm_cpu_kv_cache_mib=w.vllm_cpu_kv_cache_mib,
                                         vllm_cpu_compile=w.vllm_cpu_compile)
        self.prompts, self.answers = arithmetic_prompts(self.tok, w.prompts_per_step * (w.warmup + w.steps))
        extra = {}
        if backend == "vllm":
            extra["kv_tokens"] = engine_kv_tokens(self.tok, self.prompts, w.prompts_per_step * w.n, w.tokens)
        self.backend = ROLLOUT_BACKENDS.get(backend)(self.model, self.tok, self.rollout_cfg, **extra)
        if hasattr(self.backend, "share_prompt_prefix"):  # generate's shared prefill, as trainer/components.py
            self.backend.share_prompt_prefix = w.share_prompt_prefix
        self.algo = resolve_algorithm(AlgorithmConfig(name="grpo"))
        self.opt = adamw(self.model.parameters(), lr=LR, weight_decay=0.0)  # fused, as in the trainer
        self.startup_s = time.perf_counter() - t0

    def step(self, prompts: list[str], answers: list[str], n: int | None = None, tokens: int | None = None):
        from anabranch.trainer.step import policy_update

        n = n or self.w.n
        tokens = tokens or self.w.tokens
        self.rollout_cfg.min_new_tokens = tokens
        self.probe = MatmulProbe(self.w.threads, self.w.probe_seconds, enabled=self.w.probe_peak)
        t0 = time.perf_counter()
        ro = self.backend.generate(prompts, n, max_new_tokens=tokens)
        t1 = time.perf_counter()
        rewards = torch.tensor(contains_answer(ro.completions, [answers[g] for g in ro.group_index.tolist()]))
        adv = self.algo.advantage(rewards, ro.group_index, ro.response_mask.float(), self.algo.cfg)
        self.probe()
        self.last_stats = policy_update(
            self.model, self.opt, ro, adv, rewards, self.algo, micro_batch_size=ro.response_ids.shape[0],
            grad_clip=1.0, temperature=self.rollout_cfg.temperature, max_response_len=tokens,
            micro_batch_tokens=self.w.micro_batch_tokens, share_prompt_prefix=self.w.share_prompt_prefix,
            zero_advantage_rows=self.w.zero_advantage_rows)
        self.probe()
        self.backend.sync_weights(self.model)
        t2 = time.perf_counter()
        return ro, t1 - t0, t2 - t1 - self.probe.wall_s

    def run(self, gate=None) -> RunResult:
        """``gate``, if given, is called before each step (interleave.wait_for_turn: the parent's turn)."""
        w = self.w
        prompts, answers = self.prompts, self.answers
        res = RunResult("anabranch", self.backend_name, startup_s=self.startup_s)
        for i in range(w.warmup + w.steps):
            if gate:
                gate()
            sl = slice(i * w.prompts_per_step, (i + 1) * w.prompts_per_step)
            t0, c0 = time.perf_counter(), cpu_time()
            ro, t_gen, t_upd = self.step(prompts[sl], answers[sl])
            if i >= w.warmup:
                res.step_s.append(time.perf_counter() - t0 - self.probe.wall_s)
                res.cpu_s.append(cpu_time() - c0 - self.probe.cpu_s)
                res.generate_s.append(t_gen)
                res.update_s.append(t_upd)
                res.forward_backward_s.append(self.last_stats["time/forward_backward_s"])
                res.zero_advantage_frac.append(self.last_stats.get("update/zero_advantage_frac", 0.0))
                if w.probe_peak:
                    res.adjacent_peak_gflops.append(sum(self.probe.gflops) / len(self.probe.gflops))
        res.generated_tokens = int(ro.response_mask.sum())
        res.trained_tokens = int(ro.attention_mask.sum())
        res.prompt_tokens = ro.prompt_mask.sum(-1).tolist()
        res.peak_rss_mib = peak_rss_mib()
        return res


# --------------------------------------------------------------------------- TRL


def trl_config(w: Workload, out_dir: str):
    """TRL's GRPOConfig for the workload: the settings anabranch's runner uses (fp32 on CPU, one
    optimizer step per batch, fused AdamW, constant LR, clip 1.0, β = 0, exactly ``w.tokens`` new
    tokens), with TRL's own defaults overridden where they differ (bf16, gradient checkpointing)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=w.prompts_per_step * w.n, gradient_accumulation_steps=1,
        num_generations=w.n, max_completion_length=w.tokens, generation_kwargs={"min_new_tokens": w.tokens},
        temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1, learning_rate=LR, weight_decay=0.0,
        max_grad_norm=1.0, lr_scheduler_type="constant", optim="adamw_torch_fused", max_steps=w.warmup + w.steps,
        use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no", logging_steps=1,
        shuffle_dataset=False, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=w.gradient_checkpointing,
    )


def run_trl(w: Workload, gate=None) -> RunResult:
    """TRL's GRPOTrainer on the same workload; `_generate` is wrapped to time the rollouts. ``gate``,
    if given, is called before each step, outside its timing (interleave.wait_for_turn)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_tokenizer

    torch.set_num_threads(w.threads)
    torch.manual_seed(0)
    if w.keep_freed_memory:
        keep_freed_host_memory()
    t0 = time.perf_counter()
    tok = load_tokenizer(ModelConfig(path=w.model))
    prompts, answers = arithmetic_prompts(tok, w.prompts_per_step * (w.warmup + w.steps))
    by_prompt = dict(zip(prompts, answers))

    def reward(prompts, completions, **_):
        return contains_answer(completions, [by_prompt[p] for p in prompts])

    model = AutoModelForCausalLM.from_pretrained(w.model, dtype=torch.float32)
    args = trl_config(w, tempfile.mkdtemp(prefix="trl-bench-"))
    ds = Dataset.from_list([{"prompt": p} for p in prompts])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    res = RunResult("trl", "generate", startup_s=time.perf_counter() - t0)
    gen_times: list[float] = []
    inner = trainer._generate

    def timed_generate(*a, **k):
        s = time.perf_counter()
        out = inner(*a, **k)
        gen_times.append(time.perf_counter() - s)
        return out

    trainer._generate = timed_generate
    starts: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            if gate:
                gate()
            starts.append((time.perf_counter(), cpu_time()))

        def on_step_end(self, state_args, state, *_a, **_k):
            if state.global_step > w.warmup:
                res.step_s.append(time.perf_counter() - starts[-1][0])
                res.cpu_s.append(cpu_time() - starts[-1][1])

    trainer.add_callback(Clock())
    torch.set_num_threads(w.threads)
    trainer.train()
    res.generate_s = gen_times[w.warmup:]
    res.update_s = [s - g for s, g in zip(res.step_s, res.generate_s)]
    res.generated_tokens = w.prompts_per_step * w.n * w.tokens
    plen = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts[-w.prompts_per_step:]]
    res.trained_tokens = w.n * sum(plen) + res.generated_tokens
    res.peak_rss_mib = peak_rss_mib()
    return res


# --------------------------------------------------------------------------- FLOPs


def best_mm_gflops(size: int, seconds: float, min_calls: int = 1) -> float:
    """Best fp32 GFLOP/s of a square ``torch.mm`` of ``size`` timed for about ``seconds`` (after one untimed call)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best, calls, end = 0.0, 0, time.perf_counter() + seconds
    while time.perf_counter() < end or calls < min_calls:
        s = time.perf_counter()
        torch.mm(a, b)
        best, calls = max(best, 2 * size ** 3 / (time.perf_counter() - s) / 1e9), calls + 1
    return best


def matmul_peak_gflops(threads: int, seconds: float = 3.0) -> float:
    """Best fp32 GFLOP/s of square ``torch.mm`` on this machine with ``threads`` threads."""
    torch.set_num_threads(threads)
    return max(best_mm_gflops(size, seconds / 3) for size in (512, 1024, 2048))


class MatmulProbe:
    """The fp32 matmul peak of this moment: the best GFLOP/s of a square ``torch.mm`` (2048) over about
    ``seconds``, the measure of :func:`matmul_peak_gflops` taken briefly and often.

    This host's speed drifts by ±15% within minutes (docs/benchmarks.md), so a peak measured once,
    minutes away from an update, mixes that drift into the update's MFU; probed right before and
    after the update, it is read under the conditions the update ran in. Each call appends to
    ``gflops`` and adds its own wall and CPU time to ``wall_s`` / ``cpu_s``, which the runner takes
    out of the step's timings. Disabled, a call does nothing."""

    SIZE = 2048

    def __init__(self, threads: int, seconds: float = 1.0, enabled: bool = True):
        self.threads, self.seconds, self.enabled = threads, seconds, enabled
        self.gflops: list[float] = []
        self.wall_s = self.cpu_s = 0.0

    def __call__(self) -> None:
        if not self.enabled:
            return
        wall, cpu = time.perf_counter(), cpu_time()
        torch.set_num_threads(self.threads)
        self.gflops.append(best_mm_gflops(self.SIZE, self.seconds, min_calls=3))
        self.wall_s += time.perf_counter() - wall
        self.cpu_s += cpu_time() - cpu


def update_flops(model_dir: str, prompt_tokens: list[int], response_tokens: int, group_size: int = 1) -> float:
    """Model FLOPs of one forward+backward over the batch (the usual 6·N·T count, Kaplan et al. 2020),
    counting the tokens that are actually computed.

    6·N_body·T for the transformer body over every computed token, 6·V·H·T_resp for the LM head at
    the response positions (the only ones whose log-probs are used), and 6·L·H·S² per sequence of
    length S for causal attention scores and values. ``prompt_tokens`` holds each sequence's real
    prompt length; with ``group_size`` > 1 (trainer.share_prompt_prefix: the n samples of a prompt,
    consecutive, run its prompt once) a group's prompt counts once in the body and its attention
    (P² per group, then 2·P·R + R² per response), so sharing lowers the FLOPs, not just the time.
    Activation recomputation is not counted.
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    h, v, layers, inter = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    r = response_tokens
    t_resp = r * len(prompt_tokens)
    prompts_computed = prompt_tokens[::group_size]  # the first sequence of each group
    t_body = sum(prompts_computed) + t_resp
    attn = 6 * layers * h * (sum(p * p for p in prompts_computed) + sum(2 * p * r + r * r for p in prompt_tokens))
    return 6 * body * t_body + 6 * v * h * t_resp + attn


def summarize(r: RunResult) -> dict:
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    step = mean(r.step_s)
    out = {"s/step": step, "cpu s/step": mean(r.cpu_s), "gen s": mean(r.generate_s), "update s": mean(r.update_s),
           "gen tok/s (rollout)": r.generated_tokens / max(mean(r.generate_s), 1e-9),
           "gen tok/s (step)": r.generated_tokens / max(step, 1e-9),
           "trained tok/s": r.trained_tokens / max(step, 1e-9), "peak RSS MiB": r.peak_rss_mib}
    if r.forward_backward_s:
        out["fwd+bwd s"] = mean(r.forward_backward_s)
        out["zero-adv. seqs"] = mean(r.zero_advantage_frac)
    return out


def set_thread_env(threads: int) -> None:
    """Before torch/vLLM start: the thread count the workers must use."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
