"""Option groups of single methods, nested in ``algorithm`` (``algorithm.flowrl.*``, ``algorithm.dph.*``,
``algorithm.fdpg.*``, ``algorithm.hpt.*``, ``algorithm.guide.*``,
``algorithm.scaffold.*``, ``algorithm.rl_plus.*``, ``algorithm.calibrl.*``, ``algorithm.kdrl.*``,
``algorithm.ampo.*``, ``algorithm.scope.*``, ``algorithm.recap.*``, ``algorithm.alp.*``, ``algorithm.spear.*``,
``algorithm.safe.*``, ``algorithm.rlfr.*``): their keys, defaults and why. The multi-turn / agent methods' groups
(``algorithm.agent_rlvr``, ``.tcod``, ``.refuel``, ``.hiper``, ``.archer``) live in config_agent_options.py, the
self-posed data methods' (``algorithm.svs``, ``.ssp``, ``task.sws``, ``task.eva``) in config_self_play_options.py;
both are re-exported here.

Kept apart from config.py, which holds the run's sections; config.py imports them, so
``from anabranch.config import HPTConfig`` and the YAML/override loader see them as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The multi-turn / agent methods' groups, re-exported: config_algorithm.py and config.py import them from here.
from anabranch.config_agent_options import AgentRLVRConfig, TCODConfig  # noqa: F401
from anabranch.config_agent_options import ArcherConfig, HiPERConfig, RefuelConfig  # noqa: F401
from anabranch.config_self_play_options import EvaConfig, SSPConfig, SvSConfig, SwSConfig  # noqa: F401


@dataclass
class FlowRLConfig:
    """Options of the FlowRL objective (``algorithm.name=flowrl``; arXiv 2509.15207)."""

    # Inverse temperature of the target π_ref·exp(β·r̂)/Z; the reference code hard-codes 15.
    beta: float = 15.0
    # Sequence importance weight w = exp(Σ_t log π_θ − log π_old), detached: "none" (w = 1),
    # "unclipped" (raw w, what the Sept-2025 release used), "clamp_max" (min(w, is_max), the later
    # code), "clip" (clip(w, 1 − is_eps, 1 + is_eps), the paper).
    is_mode: str = "clamp_max"
    is_max: float = 10.0
    is_eps: float = 0.2
    # The prior in the target: "ref" (frozen reference model, loaded for it), "old" (π_old, the
    # policy that sampled the batch) or "none" (uniform prior: plain reward matching).
    reference: str = "ref"
    # Divide log π_θ and log π_ref by the response length |y| (FlowRL); false gives plain
    # trajectory balance on whole-sequence log-probabilities.
    length_norm: bool = True
    # Where log Z(x) comes from: "head" (MLP on the mean-pooled prompt hidden states, as in the
    # reference code), "vargrad" (per-prompt group mean of the residual, no network) or "scalar"
    # (one learned number for the whole run).
    log_z: str = "head"
    # Learning rate of the log Z head / scalar = trainer.lr × this.
    log_z_lr_multiplier: float = 1.0


@dataclass
class DPHConfig:
    """DPH-RL rehearsal (``algorithm.dph``; Li et al. 2025, arXiv 2509.07430; algorithms/dph.py): a
    mass-covering f-divergence to the initial policy on samples drawn from it once, at the start."""

    # Weight of the rehearsal loss added to the RL loss in the same optimizer step; 0 turns DPH off
    # (the authors' ranges: 0.01-0.05 for forward_kl, 0.05-0.2 for js).
    coef: float = 0.0
    # "forward_kl" (f(u) = -log u) or "js" (f(u) = u log u - (u+1) log((u+1)/2)), u = pi_theta/pi_0 per token.
    divergence: str = "js"
    # Rehearsal sequences drawn (seeded, without replacement) from the buffer for each optimizer step.
    samples_per_step: int = 16
    # Training prompts pre-sampled with the initial policy at the start of the run (0: all of them).
    buffer_prompts: int = 64
    # Samples per pre-sampled prompt; a prompt is "perfect" when all of them are correct.
    buffer_n: int = 8
    # Of a perfect prompt's samples, how many enter the buffer (the paper keeps one per prompt).
    keep_per_prompt: int = 1
    # Leave the perfect prompts out of the RL prompts (the paper's D_exp / D_pef split).
    exclude_from_rl: bool = True


@dataclass
class FDPGConfig:
    """Options of the f-DPG objective (``algorithm.name=fdpg``; Go et al. 2023, arXiv 2302.08215)."""

    # The f-divergence D_f(π_θ || p) minimized toward p = π_ref·exp(β·r̂)/Z: "rkl" (reverse KL:
    # KL-regularized RL), "kl" (forward KL: DPG), "js" (Jensen-Shannon, the paper's best trade-off)
    # or "tv" (total variation).
    divergence: str = "js"
    # Inverse temperature of the target, as algorithm.flowrl.beta (here on whole-sequence log-probs).
    beta: float = 15.0
    # Subtracted from the pseudo-reward −f′(π_θ/p): "group" (mean over the prompt's samples) or "none".
    baseline: str = "group"
    # Cap on the detached sequence importance weight π_θ/π_old (only differs from 1 when
    # ppo_epochs > 1); 0 leaves it uncapped, as in the paper.
    is_max: float = 10.0


@dataclass
class HPTConfig:
    """HPT, Hybrid Post-Training (``algorithm.hpt``; Lv, Zuo et al. 2025, arXiv 2509.04419;
    algorithms/hpt.py): per prompt, RL on its group when the policy's accuracy P on it is above
    ``gamma``, else SFT on the prompt's demonstration instead (L = α·L_RL + β·L_SFT, (α, β) ∈ {(1, 0), (0, 1)})."""

    # Turn HPT on (works with any policy-gradient algorithm; off: plain RL).
    enabled: bool = False
    # Threshold on the group's accuracy P (fraction of full-credit samples): P > gamma trains the group
    # with RL, P <= gamma with SFT. 0 (the authors' setting): SFT only where all n samples fail.
    gamma: float = 0.0
    # Weight β of the SFT term (token-mean NLL of the switched prompts' demonstrations); the authors use 1.
    sft_coef: float = 1.0
    # For rows without a demonstration (task.demonstration_column): the demonstration written from the
    # row's reference answer, "{answer}" replaced by it; match what task.instruction asks for.
    demonstration_template: str = "<answer>{answer}</answer>"
    # Longest demonstration trained, in tokens (longer ones are cut, keeping their start; 0: no limit).
    max_demonstration_tokens: int = 1024


@dataclass
class GuideConfig:
    """Guide (``algorithm.guide``; Nath, Lau et al. 2025, arXiv 2506.13923; algorithms/guide.py): prompts
    whose n samples all fail are sampled again with a hint in the context, and those samples are trained
    for the hint-free prompt with the ratio r_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, h, o_<t)."""

    # Turn Guide on (with loss ppo_clip, cispo or gspo; off: plain RL).
    enabled: bool = False
    # The hint put after the question in a failed prompt, each {field} replaced by the row's field
    # ({answer}; {demonstration} from task.demonstration_column; any other column the rows carry).
    hint_template: str = "Hint: the final answer is {answer}."
    # Guided samples per failed prompt, replacing its group; 0: rollout.n.
    num_samples: int = 0


@dataclass
class ScaffoldConfig:
    """Hint scaffolding, GHPO (``algorithm.scaffold``; Liu, Gong et al. 2025, arXiv 2507.10628;
    algorithms/scaffold.py): prompts whose n samples all fail are sampled again with the first fraction ω
    of their reference solution after the question, ω raised stage by stage while they still fail, and the
    hinted prompt is their training context (on-policy, no ratio correction)."""

    # Turn scaffolding on (any objective; needs a reference solution in every training row,
    # task.demonstration_column; off: plain RL).
    enabled: bool = False
    # The hint ratios ω of the stages, strictly increasing in (0, 1]: a group still all wrong at ω_k is
    # re-sampled at ω_{k+1} in the same step (GHPO's linear schedule 0.25 -> 0.5 -> 0.75); ω counts words.
    ratios: list = field(default_factory=lambda: [0.25, 0.5, 0.75])
    # The hint put after the question, {prefix} replaced by the solution's first ⌈ω·W⌉ words (wording assumed).
    hint_template: str = "The beginning of a solution, which you may continue from:\n{prefix}"
    # How the hint ratio is chosen: "stages" (GHPO: the fixed ``ratios`` for the all-fail groups) or "irt"
    # (SEELE, arXiv 2509.06923; algorithms/hint_irt.py): each group below the accuracy band is hinted at the
    # ratio where a 3PL fit of its accuracy against the ratio predicts irt_target, refitted every round.
    schedule: str = "stages"
    # SEELE's target accuracy a* (the paper: 0.5, where E[a(1 - a)] peaks) and the band's half-width: groups
    # below irt_target - irt_tolerance are hinted; a round inside the band ends the group's rounds.
    irt_target: float = 0.5
    irt_tolerance: float = 0.25
    # Hinted rounds of n samples after the step's own hint-free round (the paper: m = 4 rounds in all).
    irt_rounds: int = 3
    # The first hinted round's ratio for a prompt with no stored ratio (the paper's pessimistic cold start).
    irt_initial_ratio: float = 0.75


@dataclass
class RLPlusConfig:
    """RL-PLUS (``algorithm.rl_plus``; Dong et al. 2025, arXiv 2508.00222; algorithms/rl_plus.py): each
    prompt's demonstration joins the objective, J = J_on-policy + coef·Σ_t r_t·Â_e·(1 − sg π_θ(e_t))^gamma,
    r_t = π_θ / (½π_old + ½π_ω) (Multiple Importance Sampling, π_ω ≈ ½(π_old + 1) as the authors' code)."""

    # Turn RL-PLUS on (with any policy-gradient objective; off: plain RL). One demonstration per prompt.
    enabled: bool = False
    # Weight of the external term (the paper: 1); its tokens weigh as the on-policy tokens at coef = 1.
    coef: float = 1.0
    # Exponent of the exploration weight C_t = (1 − π_θ(e_t))^gamma (the authors' code: 0.5; 0: no weight).
    gamma: float = 0.5
    # As HPT's: the demonstration written from the row's answer when it has none (task.demonstration_column).
    demonstration_template: str = "<answer>{answer}</answer>"
    # Longest demonstration trained, in tokens (longer ones are cut, keeping their start; 0: no limit).
    max_demonstration_tokens: int = 1024


@dataclass
class CalibRLConfig:
    """CalibRL (``algorithm.calibrl``; Huang et al. 2026, arXiv 2602.20197; algorithms/calibrl.py): the prompt's
    expert solution is a baseline, not a target: L = L_RL + coef·agg(|Â|·LeakyReLU_α(−sign(Â)·(log π_θ(y_t) − b_t))),
    b_t = log π_old(e_t) of the expert at position t (baseline=token, the authors' code) or its mean (mean)."""

    # Turn CalibRL on (with any objective linear in the advantage; off: plain RL). One expert per prompt.
    enabled: bool = False
    # λ, weight of the guided term (the authors' code: 0.1).
    coef: float = 0.1
    # α, the LeakyReLU slope past the expert baseline, in [0, 1] (the authors' code: 0.5; 1: no moderation).
    negative_slope: float = 0.5
    # "token": the expert's log-prob at the same position (the authors' code); "mean": its mean token log-prob.
    baseline: str = "token"
    # As HPT's: the expert solution written from the row's answer when it has none (task.demonstration_column).
    demonstration_template: str = "<answer>{answer}</answer>"
    # Longest expert solution scored, in tokens (longer ones are cut, keeping their start; 0: no limit).
    max_demonstration_tokens: int = 1024


@dataclass
class KDRLConfig:
    """KDRL (``algorithm.kdrl``; Xu et al. 2025, arXiv 2506.02208; algorithms/kdrl.py): GRPO plus
    β·KL(π_θ ‖ π_teacher) on the student's own samples, L_KD = β_s · agg(w_i · k2), k2 = ½(log π_θ − log π_T)²,
    w_i the reward-guided mask."""

    # The teacher: a local model folder, a Hugging Face Hub id or packaged:NAME (as model.path); "" turns
    # KDRL off. It must share the student's tokenizer (same vocabulary); it is frozen, loaded in model.dtype.
    teacher: str = ""
    # β of the KD term at the first step (the paper anneals 5e-3 -> 1e-3; must be > 0).
    coef: float = 5e-3
    # "constant" (β = coef) or "linear" (coef at step 1 to coef_final at step anneal_steps, then held; the
    # shape is assumed).
    schedule: str = "linear"
    coef_final: float = 1e-3
    # Steps of the linear anneal; 0: the whole run (trainer.steps).
    anneal_steps: int = 0
    # Per-token estimator of the reverse KL to the teacher: k2 (the paper's choice), k1 or k3 (algorithms/kl.py).
    estimator: str = "k2"
    # Reward-guided KD: "response" (no KD on correct responses, the paper), "group" (KD only on prompts with no
    # correct sample; assumed reading) or "none" (KD on every response).
    mask: str = "response"


@dataclass
class AMPOConfig:
    """AMPO (``algorithm.ampo``; Yuan, Ding et al. 2025, arXiv 2510.02227; algorithms/ampo.py): in a group whose
    n samples all fail, num_replace of them are replaced by the correct teacher solutions the student finds
    most likely; those rows are trained with LUFFY's shaped term −f(π_θ)·Â, f(p) = p / (p + shaping_gamma)."""

    # Turn AMPO on (with loss ppo_clip, cispo or gspo; needs the teachers' solutions in solutions_column).
    enabled: bool = False
    # Dataset column with each row's pre-collected teacher solutions: a list of texts (one per teacher) or one text.
    solutions_column: str = "teacher_solutions"
    # On-policy samples of an all-fail group replaced by teacher solutions (the authors' script: 2).
    num_replace: int = 2
    # How candidates are ranked: "mean_logprob" (the student's mean token log-prob of the solution, one
    # no-grad forward) or "order" (the column's order, no forward; an ablation).
    selection: str = "mean_logprob"
    # γ of the policy shaping f(p) = p / (p + γ) on the injected tokens (LUFFY's and the authors' 0.1).
    shaping_gamma: float = 0.1


@dataclass
class ScopeConfig:
    """SCOPE (``algorithm.scope``; Ren et al. 2026, arXiv 2602.24110; algorithms/scope.py, trainer/scope_rollouts.py):
    a PRM finds the first wrong step of a failed sample; a rectifier model re-writes the response from there, and a
    correct rewrite replaces the failed sample, its own prefix trained on-policy and the rectifier's tokens with
    LUFFY's shaped off-policy term −f(π_θ)·Â, f(p) = p / (p + shaping_gamma)."""

    # Turn SCOPE on (hf backend; loss ppo_clip or cispo; needs prm_path and rectifier).
    enabled: bool = False
    # Local Hugging Face PRM folder, scored as rewards/prm.py does (Math-Shepherd tags: step_tag "ки", "+"/"-").
    prm_path: str = ""
    # Local model folder of the off-policy rectifier (a stronger model sharing the policy's tokenizer).
    rectifier: str = ""
    # A step whose PRM score is below this is wrong; the first such step is where the rectifier takes over.
    step_threshold: float = 0.5
    # How a response is cut into steps (rewards/prm.py's split_steps).
    step_delimiter: str = "\n\n"
    # At most this many failed samples of a group are rewritten (those whose first wrong step comes latest).
    max_per_group: int = 2
    # γ of the policy shaping f(p) = p / (p + γ) on the rectifier's tokens (LUFFY's 0.1).
    shaping_gamma: float = 0.1


@dataclass
class RECAPConfig:
    """RECAP (``algorithm.recap``; Phan, Yang et al. 2025, arXiv 2510.21978; algorithms/recap.py,
    trainer/recap_step.py): replay of general-domain data (an NLL term on its demonstrations) beside the
    RL loss, L = (1/K) Σ_k λ_k L_k with λ = K·softmax((c + i)/T) re-computed each step from each
    objective's convergence c and instability i over the last 2·window steps."""

    # Turn RECAP on (any algorithm; off: plain RL).
    enabled: bool = False
    # The general-domain data replayed: a built-in task, a reasoning-gym dataset, or "file" (replay_path).
    replay_task: str = ""
    # With replay_task=file: a local file (.jsonl, .parquet, .csv) read with the task's prompt/answer/
    # demonstration columns (task.prompt_column, ...). Nothing is downloaded.
    replay_path: str = ""
    # Replay rows trained per optimizer step (a seeded draw, the same on resume).
    replay_rows_per_step: int = 8
    # W: each weight uses the last 2W steps of its objective's tracked loss (assumed default; see recap.py).
    window: int = 5
    # T of the softmax over the objectives' scores (the paper: 5; larger: closer to equal weights).
    temperature: float = 5.0
    # For replay rows without a demonstration: the target written from the row's reference answer.
    demonstration_template: str = "<answer>{answer}</answer>"
    # Longest replay target trained, in tokens (longer ones are cut, keeping their start; 0: no limit).
    max_replay_tokens: int = 256


@dataclass
class ALPConfig:
    """ALP (``algorithm.alp``; Ye et al. 2026, arXiv 2603.19470; algorithms/alp.py): in the update's forward only,
    each decoder layer's input hidden state gets σ_l·ε (ε ~ N(0, I), σ_l = exp(s_l) learnable per layer), so the
    ratio's numerator is the perturbed policy π_{θ,δ} against the unperturbed π_old. Ratio-based losses only."""

    # Turn ALP on (loss ppo_clip, gspo, cispo, clip_cov or kl_cov; forces π_old's no-grad forward).
    enabled: bool = False
    # σ_l's start, > 0 (the authors' model-config example 1e-2; their scripts 1e-6 to 0.02).
    init_std: float = 1e-2
    # Train s_l = log σ_l with the policy loss (false: σ fixed at init_std).
    learnable: bool = True
    # s_l's learning rate is trainer.lr × lr_multiplier (>= 0; the authors use an absolute 5e-4).
    lr_multiplier: float = 1.0
    # Perturbed layers: [start_layer, end_layer), end_layer=-1 through the last (the paper's best: all layers).
    start_layer: int = 0
    end_layer: int = -1
    # Mixed into each pass's noise seed (with the rank and a pass counter saved in checkpoints).
    seed: int = 0


@dataclass
class SPEARToolRewardConfig:
    """SPEAR's tool-call reward curriculum (``algorithm.spear.tool_reward``; needs rollout.tools; algorithms/spear.py):
    R_i += w_k · min(coef · calls_i, cap), w_k = (1 + cos(π k / decay_steps)) / 2 for k ≤ decay_steps, 0 after.
    The authors' run scripts: 0.1 per call, cap 1, 200 steps."""

    # Bonus per tool call of a response (0: off; the authors' 0.1).
    coef: float = 0.0
    # The bonus of one response is at most this (the authors' 1.0).
    cap: float = 1.0
    # Steps over which the weight w_k falls from 1 to 0 on a half-cosine (0: no decay, w = 1 throughout).
    decay_steps: int = 200


@dataclass
class SPEARConfig:
    """SPEAR's self-imitation replay (``algorithm.spear``; Qin et al. 2025, arXiv 2509.22601; algorithms/spear.py,
    trainer/spear_replay.py): this step's rows with positive advantage enter a buffer with their behaviour
    log-probs; their advantages are recalibrated against the 50th percentile of recent group reward means (rows no
    longer positive leave), and waiting rows train with the step's rows, against π_s, with Clip-Cov on their tokens
    and a half-cosine warm-up of their weight. Defaults: the authors' README/scripts where they exist."""

    # Turn the replay on (not with RoRecomp; losses must read the advantages: ppo_clip, cispo, gspo, clip_cov, ...).
    enabled: bool = False
    # Rows the buffer holds (global, split over DDP ranks; the oldest go first).
    buffer_size: int = 2048
    # K rows replayed per step once K wait (global; 0: one step's batch, prompts_per_step × the group size).
    replay_rows: int = 0
    # A row born at step s is dropped at step s + max_age + 1 if not yet replayed (the scripts' tolerate_steps; 0: never).
    max_age: int = 5
    # p50: Â = R − P50(recent group means) (÷ P50(group stds) with norm_adv_by_std); decay: Â = advantage_decay · A.
    recalibration: str = "p50"
    advantage_decay: float = 0.9
    # Groups whose reward mean/std form the p50 baseline (the most recent steps').
    baseline_groups: int = 10240
    # Weight of the replayed rows after the warm-up, and the warm-up's steps (half-cosine from 0; 0: none).
    coef: float = 1.0
    warmup_steps: int = 200
    # Clip-Cov on the replayed tokens: the fraction ρ detached among those with cov_low ≤ Cov ≤ cov_high (0: off).
    cov_clip_ratio: float = 0.02
    cov_clip_low: float = 1.0
    cov_clip_high: float = 40.0
    # joint: replayed rows join the step's one update (under its loss normalizer); separate: after the on-policy
    # update, one more optimizer step on the replayed rows alone, normalized over their own tokens (the authors').
    replay_step: str = "joint"
    # The intrinsic tool-call reward, decayed over training (needs rollout.tools).
    tool_reward: SPEARToolRewardConfig = field(default_factory=SPEARToolRewardConfig)


@dataclass
class SAFEConfig:
    """SAFE (``algorithm.safe``; Maity 2026, arXiv 2602.04651; algorithms/safe.py): L += β_t·g_t·agg(KL_est) to the
    reference, g_t = max(0.5, entropy_floor/(H + 0.1)) the entropy gate, β_t = min(beta_max, 2·coef·[K̄ − τ_t]₊),
    K̄ an EMA of the batch KL, τ_t = clip(threshold + PID(reward velocity), threshold_min, threshold_max). β and g
    from the previous step's detached batch statistics; the KL keeps its gradient. Defaults: the authors' code."""

    # Turn SAFE's gated KL on (needs algorithm.kl_coef=0 or kl_in=reward: it replaces the fixed KL term).
    enabled: bool = False
    # c of the released penalty c·(K̄ − τ)²; β = 2c·[K̄ − τ]₊ is its slope, clamped to [0, beta_max].
    coef: float = 0.1
    beta_max: float = 1.0
    # The per-token KL estimator of the term (algorithms/kl.py; the tracked K̄ is k1's token mean, as released).
    estimator: str = "k3"
    # τ_base and its clamp.
    threshold: float = 0.3
    threshold_min: float = 0.1
    threshold_max: float = 0.6
    # PID gains on the reward EMA's velocity error, its anti-windup clamp and target velocity.
    kp: float = 0.3
    ki: float = 0.01
    kd: float = 0.05
    integral_limit: float = 1.0
    target_velocity: float = 0.001
    # EMA decays of the reward (the PID's input) and of the batch KL (K̄).
    reward_ema: float = 0.95
    kl_ema: float = 0.9
    # H_floor of the gate: the batch's mean entropy below it amplifies the term (above 2·H_floor − 0.1: halves it).
    entropy_floor: float = 2.0


@dataclass
class RLFRConfig:
    """RLFR's latent flow reward (``algorithm.rlfr``; Zhang et al. 2025, arXiv 2510.10201;
    rewards/latent_flow.py, trainer/latent_flow_step.py): a velocity MLP fitted by flow matching on one layer's
    hidden states (reference solutions, then the correct rollouts); a token's velocity deviation
    s = mean_t t/(1−t)·‖v(x_t, t, c) − (x_1 − x_0)‖², min-max normalized per response, thresholded and top-k,
    gives r = −coef·s̃, added to Â as its reward-to-go. Defaults: the authors' script where they have one."""

    # Turn RLFR on (with any loss that trains on the advantages; off: no flow net, no hook, no cost).
    enabled: bool = False
    # coef of r = −coef·s̃ (the authors: 0.01).
    coef: float = 0.01
    # The hooked decoder layer as a fraction of the depth: round(layer·L) (the authors average 0.25, 0.5, 0.75).
    layer: float = 0.5
    # The velocity MLP: width and residual blocks (the authors: the model's width, 6 AdaLN blocks).
    width: int = 256
    depth: int = 2
    # The flow's own AdamW learning rate (the authors: 1e-4).
    flow_lr: float = 1e-4
    # Rewarding timesteps t in (0, 1), each weighted t/(1 − t) (the authors: [0.8]).
    timesteps: list = field(default_factory=lambda: [0.8])
    # Kept tokens: normalized score above threshold, and only the top_k largest per response (0: no cap).
    threshold: float = 0.6
    top_k: int = 15
    # true: each token's term is its reward-to-go Σ_{j≥i} r_j (the authors' γ = 1); false: Σ_j r_j on all tokens.
    token_level: bool = True
    # Warm-up at the first update: flow steps on the reference solutions' latents (0: none), from at most
    # warmup_rows training rows (0: all); a row without task.demonstration_column gets demonstration_template.
    warmup_fit_steps: int = 200
    warmup_rows: int = 256
    demonstration_template: str = "<answer>{answer}</answer>"
    max_demonstration_tokens: int = 1024
    # Online refresh: one flow step per update on the latents of rollouts with reward >= online_min_reward.
    online: bool = True
    online_min_reward: float = 1.0
