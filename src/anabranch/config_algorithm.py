"""The ``algorithm`` section of the run configuration: the recipe, its advantage estimator and loss, and
every method's keys (with the paper each comes from and why its default), nested option groups in
config_algorithm_options.py (the multi-turn / agent methods' groups in config_agent_options.py).

Kept apart from config.py, which holds the run's other sections and imports this class, so
``from anabranch.config import AlgorithmConfig`` and the YAML/override loader see it as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from anabranch.config_algorithm_options import AgentRLVRConfig  # algorithm.agent_rlvr
from anabranch.config_algorithm_options import (AMPOConfig, DPHConfig, FDPGConfig, FlowRLConfig, GuideConfig,
                                                HPTConfig, KDRLConfig, RLPlusConfig, ScaffoldConfig, ScopeConfig)
from anabranch.config_algorithm_options import CalibRLConfig
from anabranch.config_algorithm_options import RECAPConfig
from anabranch.config_algorithm_options import ALPConfig
from anabranch.config_algorithm_options import SPEARConfig
from anabranch.config_algorithm_options import SAFEConfig
from anabranch.config_algorithm_options import RLFRConfig
from anabranch.config_algorithm_options import RefuelConfig  # algorithm.refuel
from anabranch.config_algorithm_options import HiPERConfig  # algorithm.hiper
from anabranch.config_algorithm_options import ArcherConfig  # algorithm.archer
from anabranch.config_algorithm_options import SvSConfig
from anabranch.config_algorithm_options import SSPConfig  # algorithm.ssp
from anabranch.config_algorithm_options import TCODConfig  # algorithm.tcod


@dataclass
class AlgorithmConfig:
    # A recipe name; it fills `advantage` and `loss` when those are left empty.
    name: str = "grpo"
    advantage: str = ""
    # advantage=weighted_grpo (Sheng et al. 2026, "Beyond Variance", arXiv 2602.03452;
    # algorithms/weighted_grpo.py; needs task.pairing=true): λ_neg, the weight of the q− prompt's
    # group advantages against q+'s (weight 1): Â = w(role)·(r − mean_g)/(std_g + ε). 1 is plain GRPO;
    # the paper's value was not found (assumed default).
    weighted_grpo_neg_weight: float = 1.0
    # advantage=canon (Chen et al. 2025, "Conditional Advantage Estimation ...", arXiv 2509.23962;
    # algorithms/canon.py): the metric each group is split on into a low and a high half, "entropy"
    # (mean −log π_old of the sampled tokens) or "length" (response tokens); and λ in [0, 1], the weight
    # of the inter-group term (r_i − mean of the other half) against the intra-group one (r_i − mean
    # of its own half). 1 (the authors' code default) is pure inter-group; 1/2 is Dr. GRPO.
    canon_metric: str = "entropy"
    canon_inter_weight: float = 1.0
    # advantage=mssr (Liu et al. 2025, "Stable and Efficient Single-Rollout RL for Multimodal Reasoning",
    # arXiv 2512.18215; algorithms/mssr.py; works with rollout.n=1): a persistent per-prompt Beta(α, β)
    # baseline p̂ = α/(α+β), Â = r − p̂ normalized over the batch; after each sample α ← ρ·α + r,
    # β ← ρ·β + (1 − r). mssr_rho: ρ in (0, 1], the tracker's forgetting factor (a constant here, SPO's
    # KL-adaptive ρ is not implemented; 0.9 assumed); mssr_prior: α₀ = β₀ of a prompt never seen (0.5,
    # SPO's value without offline estimates). algorithm.name=mssr also sets the entropy-shaped advantage.
    mssr_rho: float = 0.9
    mssr_prior: float = 0.5
    # PPL / position advantage shaping (Deng et al. 2025, "Decomposing the Entropy-Performance Exchange",
    # arXiv 2508.02260; algorithms/ppl_position.py), on top of any estimator; 0 is off. ppl_shaping_coef α:
    # Â × max(0, 1 − α·w_i), w_i the group z-score of the response's log-perplexity under π_old (low-PPL
    # responses weigh more; one extra no-grad forward when on). position_shaping_coef β in [0, 1]:
    # Â_t × (1 + β·(2·p_t − 1)), p_t ∈ [0, 1] the token's relative position in its response (later tokens
    # weigh more, mean factor 1). Forms and defaults assumed (the paper's equations were not found).
    ppl_shaping_coef: float = 0.0
    position_shaping_coef: float = 0.0
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
    # DSDR (Wan et al. 2026, algorithms/dsdr.py): diversity among a group's correct responses.
    # dsdr_global_coef λ_g in [0, 1): reward bonus λ_g·d_i for correct responses (d_i ∈ [0, 1] their
    # distance from the group's other correct ones); dsdr_local_coef λ_ℓ: −λ_ℓ·mean over correct
    # responses of γ_i·(their mean token entropy), γ_i = |C|·softmax(d/dsdr_tau) the global-to-local
    # coupling; both 0: off. dsdr_similarity: "embedding" (offline MiniLM, ~0.1 s per correct
    # response on CPU) or "ngram" (word-bigram Jaccard); dsdr_formula_weight: share of the
    # formula-uniqueness term in d_i.
    dsdr_global_coef: float = 0.0
    dsdr_local_coef: float = 0.0
    dsdr_tau: float = 1.0
    dsdr_similarity: str = "embedding"
    dsdr_formula_weight: float = 0.5
    # Dual-clip PPO (Ye et al. 2020): for Â<0 the per-token loss is capped at −c·Â; 0 turns it off.
    clip_ratio_c: float = 0.0
    # Where the KL to the reference goes: "loss" (kl_coef·KL added to the loss, GRPO) or "reward"
    # (−kl_coef·KL_t added to each token's reward before the advantage, PPO/REINFORCE++).
    kl_in: str = "loss"
    # Adaptive KL coefficient (Ziegler et al. 2019): the KL per sequence it steers to; None keeps
    # kl_coef fixed. kl_horizon is the controller's time constant in sequences.
    kl_target: Optional[float] = None
    kl_horizon: int = 10000
    # ProRL's reference reset (Liu et al. 2025, arXiv 2505.24864; trainer/ref_reset.py): every
    # ref_reset_every training steps the KL reference's weights are set to the current policy's
    # (0: off; needs a reference term, e.g. kl_coef > 0; refused with LoRA, FSDP and DeepSpeed), and
    # with ref_reset_optimizer the optimizer state (Adam moments, step counts) is cleared with it,
    # as the paper does. Checkpoints then hold the reset reference, so a resumed run uses it.
    ref_reset_every: int = 0
    ref_reset_optimizer: bool = True
    # Discount and GAE λ for the token-level estimators (reinforce_pp, gae).
    gamma: float = 1.0
    lam: float = 0.95
    # Critic of the gae estimator: loss weight, value clipping range (0 off), learning-rate multiple.
    vf_coef: float = 0.5
    vf_clip: float = 0.2
    vf_lr_multiplier: float = 10.0
    # SAFE's double soft-min critic (algorithms/double_critic.py): a second value head, the estimator reading
    # V_soft = −α·log(½e^{−V1/α} + ½e^{−V2/α}) (α = vf_soft_min_alpha), each head trained on the returns.
    vf_double_critic: bool = False
    vf_soft_min_alpha: float = 0.3
    # psr_nsr advantage: +psr_weight for rewards > positive_threshold, −nsr_weight otherwise
    # (PSR only: nsr_weight=0; NSR only: psr_weight=0; W-REINFORCE: psr_weight=0.1).
    psr_weight: float = 1.0
    nsr_weight: float = 1.0
    positive_threshold: float = 0.5
    # Entropy-shaped advantage (Cheng et al. 2025): A + min(α·H, |A|/κ); α=0 turns it off.
    entropy_adv_alpha: float = 0.0
    entropy_adv_kappa: float = 2.0
    # Forking-token mask (Wang et al. 2025): gradient only on the top-ρ entropy tokens; 1 is off.
    entropy_top_rho: float = 1.0
    # ER/ERV/ERA shaping (Huang et al. 2025, VERL; algorithms/er_shaping.py): Â + min(max(aux, 0), |Â|/er_shaping_kappa),
    # aux = er_shaping_coef·(g·tanh δ_ER + (1−g)·tanh δ_ERV), g = σ(er_shaping_gain·δ_ERA), δ_M the clipped relative
    # deviation of the response's hidden-state effective rank (velocity, acceleration over prefixes of
    # er_shaping_stride tokens) from an EMA (weight er_shaping_ema) of past batch means; 0 is off (authors: 1).
    er_shaping_coef: float = 0.0
    er_shaping_kappa: float = 2.0
    er_shaping_gain: float = 2.0
    er_shaping_ema: float = 0.3
    er_shaping_stride: int = 40
    # NGRPO advantage (Nan et al. 2025): the reward of the virtual best sample added to each group's
    # mean and std, so all-wrong groups get Â < 0; the largest reward a sample can get (1 for 0/1).
    ngrpo_max_reward: float = 1.0
    # ACE objective (Xu et al. 2026): negative advantages × (1 + ace_alpha·softplus(c_i)), c_i the
    # sequence log-ratio log π_old(y|x)/π_ref(y|x) (loads a reference model); 0 is plain ppo_clip.
    ace_alpha: float = 1.0
    # ETR objective (Zhang et al. 2026, arXiv 2601.03723; algorithms/etr.py; algorithm.name=etr): each token's clip
    # range is clip_ratio_low/high × (1 + etr_adv_coef·|Â|)·(1 + etr_var_coef·4σ_g²), σ_g² the variance of its
    # group's rewards; 0 and 0 give ppo_clip. Form and defaults assumed (the paper's were not found).
    etr_adv_coef: float = 0.2
    etr_var_coef: float = 0.5
    # PACS objective (Li et al. 2025, arXiv 2509.02522; algorithms/pacs.py; algorithm.name=pacs): BCE of the
    # reward (label in [0, 1]) on σ(ψ), ψ the group leave-one-out score of pacs_beta·log π_θ(y|x)/π_old(y|x);
    # pacs_class_balance weighs each group's right and wrong samples as balanced classes (the authors' runs).
    pacs_beta: float = 1.0
    pacs_class_balance: bool = True
    # ReasonMaxxer (Akgül et al. 2026, arXiv 2605.06241; algorithms/reasonmaxxer.py; algorithm.name=reasonmaxxer):
    # −log π on correct samples' tokens, −λ·log(1 − π) on incorrect ones' (λ = reasonmaxxer_neg_weight; correct:
    # reward above its group's mean), only where the reference (base) model's entropy is high: the top
    # reasonmaxxer_top_frac of the batch's trained response tokens, or those >= reasonmaxxer_entropy_threshold
    # (nats) when set. The entropy is of π_ref's logits / rollout.temperature (the base model's own at T = 1).
    # Contrast form, λ = 1 and ρ = 0.2 assumed (the paper's exact loss and gate were not found).
    reasonmaxxer_top_frac: float = 0.2
    reasonmaxxer_entropy_threshold: Optional[float] = None
    reasonmaxxer_neg_weight: float = 1.0
    # UCAS (Xie et al. 2025, algorithms/ucas.py): Â × exp(−ucas_beta_pos·ĉ) where Â > 0, × exp(ucas_beta_neg·ĉ)
    # elsewhere (ĉ the group z-score of the response's summed self-certainty under π_old), minus
    # ucas_token_coef × the batch min-max-normalized raw logit of each sampled token; false is off.
    ucas: bool = False
    ucas_beta_pos: float = 0.25
    ucas_beta_neg: float = 0.35
    ucas_token_coef: float = 0.05
    # ProGRPO's ARM (Li et al. 2026, algorithms/progrpo.py): Â + progrpo_alpha·(c(q) − c(o|q)), c(q) = 1/PPL
    # of the prompt, c(o|q) = exp(mean log π_old over the progrpo_low_frac lowest-probability answer
    # tokens); groups without a rewarded sample unchanged; 0 is off (one extra prompt-only forward when on).
    progrpo_alpha: float = 0.0
    progrpo_low_frac: float = 0.2
    # Clip-Cov: detach a random cov_clip_ratio of the tokens whose Cov(log π, A) is in [low, high].
    cov_clip_ratio: float = 2e-4
    cov_clip_low: float = 1.0
    cov_clip_high: float = 5.0
    # KL-Cov: |log π − log π_old| penalty of weight cov_kl_coef on the top cov_kl_ratio tokens by Cov.
    cov_kl_ratio: float = 2e-3
    cov_kl_coef: float = 1.0
    # STEER (Hao et al. 2025, arXiv 2510.10150; algorithms/steer.py; algorithm.name=steer, loss=steer only): each
    # token's PPO loss × λ_t = exp(−k·|Ω_t|), Ω_t the estimated entropy change of its update, k set so that the
    # micro-batch's largest |Ω| gets steer_weight_min (k's denominator at least steer_omega_floor); or, with
    # steer_mapping=linear, |Ω| mapped linearly onto [steer_weight_max, steer_weight_min]. The authors' run: 0.8, exp.
    steer_weight_min: float = 0.8
    steer_weight_max: float = 1.0
    steer_mapping: str = "exp"
    steer_omega_floor: float = 0.02
    # AEPO's policy update (Dong et al. 2025, arXiv 2510.14545; algorithms/aepo.py; algorithm.name=aepo, loss=aepo
    # only): Â·(1 + aepo_entropy_alpha·z_t), z_t the token entropy standardized over the micro-batch's response
    # tokens (0 is off), and, with aepo_balanced_clip, tokens clipped at 1 + clip_ratio_high (Â > 0) keep the
    # gradient (1 + ε_high)·Â·∇log π (the loss's value stays PPO-clip's). The authors' code: 0.2, on.
    aepo_entropy_alpha: float = 0.2
    aepo_balanced_clip: bool = True
    # Lp-Reg (Huang et al. 2025, algorithms/lp_reg.py): on the lowest-probability lp_reg_rho fraction of the
    # negative-advantage tokens of each micro-batch, lp_reg_coef × k3(π_θ ‖ π_proxy), π_proxy = π with the
    # tokens below lp_reg_kappa·max_v π(v) (or below lp_reg_tau, when > 0) removed and renormalized;
    # lp_reg_coef=0 turns it off (the authors' recipes: coef 1, rho 0.01, kappa 0.02).
    lp_reg_coef: float = 0.0
    lp_reg_rho: float = 0.01
    lp_reg_kappa: float = 0.02
    lp_reg_tau: float = 0.0
    # SIREN (Jiang et al. 2025, algorithms/siren.py): siren_coef × (H̄ − H_anchor)², H̄ the mean over responses of
    # the entropy of the top-p nucleus (siren_top_p, renormalized) averaged over each response's positions above
    # its (1 − siren_peak_frac)-quantile of that entropy; H_anchor is the first step's batch value (siren_anchor=
    # initial) or follows it as an EMA (ema, old weight siren_anchor_decay). 0 is off (the authors: 0.005, 0.8, 0.2).
    siren_coef: float = 0.0
    siren_top_p: float = 0.8
    siren_peak_frac: float = 0.2
    siren_anchor: str = "initial"
    siren_anchor_decay: float = 0.9
    # EPO's entropy smoothing (Xu et al. 2025, algorithms/epo.py): epo_coef × w_k × agg([epo_low·H̄ − H]₊ +
    # [H − epo_high·H̄]₊), H each token's entropy (epo_mode=token) or each response's mean (seq), H̄ the mean
    # batch entropy of the past steps (all, or the last epo_window); w_k the phase weight over epo_horizon
    # steps (late decay rate epo_gamma; horizon 0: w = 1). 0 is off (the authors' code: band 0.8–1.2, 150, 3).
    epo_coef: float = 0.0
    epo_low: float = 0.8
    epo_high: float = 1.2
    epo_mode: str = "token"
    epo_window: int = 0
    epo_horizon: int = 0
    epo_gamma: float = 3.0
    # DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until
    # rollout.prompts_per_step groups are kept, at most max_sample_batches generation rounds.
    dynamic_sampling: bool = False
    max_sample_batches: int = 10
    # What "all equal" is judged on: "accuracy" (DAPO: keep a group only if 0 < #correct < n) reads
    # the reward that says right/wrong, and falls back to the total reward where no reward does
    # (label-free runs); "reward" uses the total reward (with shaping terms such as the overlong
    # punishment, any difference keeps the group).
    dynamic_sampling_metric: str = "accuracy"
    # Which groups dynamic sampling keeps: "all_equal" (DAPO: rewards not all equal) or "std" (RLPR, Yu et
    # al. 2025, trainer/std_filter.py: reward std σ_g >= std_filter_beta · m, m an EMA with decay
    # std_filter_ema_decay of each step's mean group std; the first std_filter_warmup_steps steps keep
    # every group and m starts as the mean over their last std_filter_init_steps). m is saved in checkpoints.
    dynamic_sampling_filter: str = "all_equal"
    std_filter_beta: float = 0.5
    std_filter_ema_decay: float = 0.99
    std_filter_warmup_steps: int = 10
    std_filter_init_steps: int = 5
    # DAPO soft overlong punishment: the last overlong_buffer tokens before rollout.max_new_tokens
    # cost up to overlong_penalty reward, linearly; 0 turns it off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # DAPO overlong filtering: truncated responses are left out of the loss.
    overlong_filter: bool = False
    # Used only by algorithm.name=flowrl (loss=flowrl).
    flowrl: FlowRLConfig = field(default_factory=FlowRLConfig)
    # α-GFN mixing for FlowRL (algorithms/alpha_gfn.py; arXiv 2602.01749): the forward-move probability of
    # the mixed chain; 0.5 is FlowRL's own balance. Else it needs flowrl.length_norm=false, where on a token
    # tree it acts as a per-token length prior ((1-α)/α)^|y| on the target (α > 0.5 favours shorter answers).
    flowrl_alpha: float = 0.5
    # Used only by algorithm.name=fdpg (loss=fdpg).
    fdpg: FDPGConfig = field(default_factory=FDPGConfig)
    # DPH-RL rehearsal to the initial policy (any algorithm; off while dph.coef = 0).
    dph: DPHConfig = field(default_factory=DPHConfig)
    # HPT: SFT on a demonstration instead of RL for prompts the policy fails (any algorithm; off by default).
    hpt: HPTConfig = field(default_factory=HPTConfig)
    # Guide (algorithms/guide.py): prompts whose samples all fail are sampled again with a hint and trained
    # for the hint-free prompt with an importance ratio toward it (any ratio-based loss; off by default).
    guide: GuideConfig = field(default_factory=GuideConfig)
    # Agent-RLVR (algorithms/agent_rlvr.py): each failed attempt retried with guidance (its verifier feedback and
    # the task's reference); correct retries preferred over the attempt by a DPO term (off by default).
    agent_rlvr: AgentRLVRConfig = field(default_factory=AgentRLVRConfig)
    # Hint scaffolding, GHPO (algorithms/scaffold.py): all-fail prompts re-sampled with a growing prefix of their
    # reference solution and trained in that hinted context, on-policy (any loss; off by default).
    scaffold: ScaffoldConfig = field(default_factory=ScaffoldConfig)
    # AMPO (algorithms/ampo.py): all-fail groups get the teachers' correct solutions the student finds most
    # likely in place of num_replace samples, trained with LUFFY's shaped off-policy term (off by default).
    ampo: AMPOConfig = field(default_factory=AMPOConfig)
    # SCOPE (algorithms/scope.py, trainer/scope_rollouts.py): failed samples rewritten by a rectifier model from the
    # first step a PRM marks wrong; correct rewrites replace them (off by default).
    scope: ScopeConfig = field(default_factory=ScopeConfig)
    rl_plus: RLPlusConfig = field(default_factory=RLPlusConfig)  # RL-PLUS (algorithms/rl_plus.py)
    calibrl: CalibRLConfig = field(default_factory=CalibRLConfig)  # CalibRL (algorithms/calibrl.py)
    recap: RECAPConfig = field(default_factory=RECAPConfig)  # RECAP (algorithms/recap.py): replay, reweighted online
    # ALP (algorithms/alp.py): learnable layerwise noise in the update forward, the ratio's numerator only (off).
    alp: ALPConfig = field(default_factory=ALPConfig)
    # SPEAR (algorithms/spear.py, trainer/spear_replay.py): positive-advantage rows replayed later, advantages
    # recalibrated against a p50 reward baseline, Clip-Cov on their tokens (off by default).
    spear: SPEARConfig = field(default_factory=SPEARConfig)
    # SAFE (algorithms/safe.py): an entropy-gated KL to the reference, its threshold moved by a PID on the
    # reward's velocity (off by default).
    safe: SAFEConfig = field(default_factory=SAFEConfig)
    # RLFR (rewards/latent_flow.py, trainer/latent_flow_step.py): a flow net on one layer's latents; the velocity
    # deviation of each response token, as a token-level reward added to Â (off by default).
    rlfr: RLFRConfig = field(default_factory=RLFRConfig)
    # SvS (algorithms/svs.py, trainer/svs_step.py): problems synthesized from the policy's correct solutions to
    # challenging prompts, with the same answer, solved and trained beside the originals (off by default).
    svs: SvSConfig = field(default_factory=SvSConfig)
    # Search Self-play (algorithms/ssp.py, trainer/ssp_round.py): the policy proposes search questions for the
    # prompts' answers and solves the RAG-verified ones with the search tool (off by default).
    ssp: SSPConfig = field(default_factory=SSPConfig)
    # KDRL (algorithms/kdrl.py): β·KL(π_θ ‖ teacher) on the student's own samples, beside the reference KL;
    # off while kdrl.teacher is empty.
    kdrl: KDRLConfig = field(default_factory=KDRLConfig)
    # TCOD (algorithms/tcod.py): KDRL's teacher term on multi-turn episodes limited to the turns within a depth that
    # grows over training (off by default).
    tcod: TCODConfig = field(default_factory=TCODConfig)
    # REFUEL (algorithms/refuel.py, trainer/refuel_rollouts.py): options of algorithm.name=refuel only.
    refuel: RefuelConfig = field(default_factory=RefuelConfig)
    # HiPER's HAE (algorithms/hiper.py): options of algorithm.advantage=hiper only.
    hiper: HiPERConfig = field(default_factory=HiPERConfig)
    # ArCHer's turn-level critic (algorithms/archer.py, trainer/archer_critic.py): options of
    # algorithm.advantage=archer only.
    archer: ArcherConfig = field(default_factory=ArcherConfig)
    # SRPO (Li et al. 2026, algorithms/srpo.py, trainer/srpo_step.py): failed samples leave the GRPO term and are
    # distilled toward the policy itself conditioned on feedback (a correct sibling, else the reference answer),
    # srpo_coef β × agg(ω_t · ½(log π_θ − log π_T)²); 0 turns SRPO off. srpo_entropy_weight: ω_t =
    # exp(−H_teacher) normalized to mean 1 over the batch's distilled tokens (softmax) or 1 (none).
    # srpo_feedback_template: text between the prompt and the response in the teacher's context; must hold
    # '{solution}'.
    srpo_coef: float = 0.0
    srpo_entropy_weight: str = "softmax"
    srpo_feedback_template: str = "\n\nA correct solution to this problem:\n{solution}\n\nThe attempt, written knowing it:\n"
    # SPAE (Wu et al. 2026, algorithms/spae.py, trainer/spae_step.py): after each step of a response the policy
    # scores the gold answer behind spae_probe; potential Φ = 1.5·Acc·Conf + 0.5·Acc − Conf, and each token gets
    # Â − λ·|Â| after the first step with Φ ≥ τ, plus ξ·(Φ_k − Φ_{k−1}) of its step. spae_coef ξ >= 0 (0: off, no
    # cost; on: one extra no-grad forward of ≤ spae_max_steps probes per response). spae_delimiter: text that ends
    # a step. spae_probe: answer-forcing suffix after the step prefix. spae_saturation τ in (−1, 1].
    # spae_saturation_penalty λ in [0, 1]. spae_max_steps >= 1: probes per response (evenly spaced beyond it).
    spae_coef: float = 0.0
    spae_delimiter: str = "\n\n"
    spae_probe: str = "**Final Answer**\n\\boxed{"
    spae_saturation: float = 0.9
    spae_saturation_penalty: float = 0.5
    spae_max_steps: int = 8
    # RLTF-SD (Song et al. 2026, algorithms/rltf_sd.py, trainer/rltf_sd_step.py): the retries (attempt k >= 2)
    # of rollout.retry_turns episodes are trained in the first-turn context (prompt alone) as an extra term
    # λ · Σ −w·log π(attempt | prompt) / N; rltf_sd_coef λ >= 0 (0: off, no cost; needs retry_turns >= 2).
    # rltf_sd_weighting: advantage (the paper's w = grade − the group's mean first-attempt grade) or correct
    # (w = 1 on right retries only).
    rltf_sd_coef: float = 0.0
    rltf_sd_weighting: str = "advantage"
    # RoRecomp (Li et al. 2025, arXiv 2509.25958; algorithms/rorecomp.py, trainer/rorecomp.py): each step trains the
    # shortest rorecomp_fraction α of each group's correct and the longest α of its wrong responses (at least one
    # each), plus a compensation batch of rorecomp_compensation_rows earlier remaining rows (0: one step's batch)
    # once that many wait in a buffer of rorecomp_buffer_size rows (oldest dropped; rorecomp_max_age > 0 also drops
    # rows older than that many steps). α in (0, 1); 0: off, no cost. Both row counts are global (as
    # prompts_per_step): under DDP each rank buffers ⌈size/W⌉ and replays ⌈K/W⌉ of its own rows.
    rorecomp_fraction: float = 0.0
    rorecomp_compensation_rows: int = 0
    rorecomp_buffer_size: int = 1024
    rorecomp_max_age: int = 0
    # PROF (Ye et al. 2025, arXiv 2509.03403; algorithms/prof.py): of each prompt's rollout.n samples keep m =
    # prof_keep, the right ones with the highest and the wrong ones with the lowest mean PRM step score, as close to
    # m/2 of each as the group allows; needs one `prm` reward (the PRM only filters, it adds no reward). 0: off.
    prof_keep: int = 0
    # Truncated importance sampling cap C for rollouts from another engine (vLLM): each token's
    # advantage is scaled by min(π_old/π_sampler, C). 0 disables it (the mismatch is still logged).
    tis_cap: float = 0.0
    # ROVER (He et al. 2025, algorithms/rover.py; algorithm.name=rover): temperature ρ of the uniform-policy
    # Q-value Q(s, a) = ρ·(log π_θ(a|s) − log π_old(a|s)), fitted to r̃ + mean over the vocabulary of
    # Q(s', ·); must be > 0 (the authors' code: 1).
    rover_rho: float = 1.0
    # BRAIn (Pandey et al. 2024, arXiv 2402.02479; algorithms/brain.py; algorithm.name=brain): temperature β of the
    # reward likelihood p(G=1|x,y) ∝ exp(r/β) in the target posterior π_ref·exp(r/β)/Z (the KL coefficient whose
    # PPO optimum it is); positive and finite; only with loss=brain. 0.1 is assumed (the paper's value not found).
    brain_beta: float = 0.1
    # OREAL (Lyu et al. 2025, arXiv 2502.06781; algorithms/oreal.py; algorithm.name=oreal), only with loss=oreal:
    # η, the weight of the wrong samples' reshaped term (the authors' 0.5); whether the correct samples' behaviour
    # cloning is scaled by their RLOO value (the authors' pos_mult_adv, on); the token-level reward head that weights
    # each token (off: every token weighs 1) and its learning rate over the policy's (the authors' 4×).
    oreal_neg_weight: float = 0.5
    oreal_pos_mult_adv: bool = True
    oreal_token_rm: bool = False
    oreal_token_rm_lr_multiplier: float = 4.0
    # GiGPO (Feng et al. 2025, arXiv 2505.10978; algorithms/gigpo.py; advantage=gigpo, needs rollout.environment):
    # A = A_E + ω·A_S, the episode advantage over the prompt's group plus ω (gigpo_step_weight) times the step
    # advantage over the group's steps taken from the same environment state; G_t discounted by gigpo_gamma γ in
    # [0, 1]; gigpo_norm: none (F = 1, the authors' code's default) or std (F = the group's std + adv_epsilon).
    gigpo_step_weight: float = 1.0
    gigpo_gamma: float = 0.95
    gigpo_norm: str = "none"
    # Turn-level credit (algorithms/turn_credit.py; needs rollout.environment): advantage=turn_broadcast (Flow-GRPO,
    # arXiv 2510.05592), turn_norm (MARS, arXiv 2510.15414), spa (SPA-RL, arXiv 2505.20732). turn_credit_norm: std or
    # none (F of the group / same-turn-index sets); turn_credit_gamma: γ of turn_norm's and spa's turn returns;
    # turn_credit_turn_mean: turn_broadcast's 1/(T_i·|a_t|) token weight (needs loss_agg_mode=seq-mean-token-sum).
    turn_credit_norm: str = "std"
    turn_credit_gamma: float = 1.0
    turn_credit_turn_mean: bool = True
    # SPA (advantage=spa): r̂_t = spa_progress_coef·c_φ(h_t) + spa_grounding_coef·(environment step reward); the
    # progress head's AdamW learning rate and its fit steps per training step (trainer/spa_step.py).
    spa_progress_coef: float = 1.0
    spa_grounding_coef: float = 0.0
    spa_lr: float = 1e-3
    spa_fit_steps: int = 20
    # ROSE (Zhao et al. 2026, arXiv 2601.05053; algorithms/rose.py; advantage=rose, needs rollout.semantic_tree):
    # α of the length-aware term f = 1 − ((L_s − k)/(L_b − k))^α on longer correct leaves; >= 0, 0: off. 1.0 assumed.
    rose_length_alpha: float = 1.0
