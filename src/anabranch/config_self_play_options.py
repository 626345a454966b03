"""Option groups of the self-posed data methods: SvS's variational problem synthesis (``algorithm.svs.*``),
Search Self-play's proposer/solver (``algorithm.ssp.*``), SwS's weakness-driven synthesis (``task.sws.*``) and eva's
creator/solver evolution (``task.eva.*``): their keys, defaults and why.

Split out of config_algorithm_options.py to keep that file small; it re-exports these classes, so
``from anabranch.config_algorithm_options import SvSConfig`` (and ``from anabranch.config import SwSConfig``) keep
working. Imports nothing from the other config modules, so no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from anabranch.data.svs_prompts import DEFAULT_TEMPLATE as SVS_TEMPLATE  # algorithm.svs.synthesis_template
from anabranch.data.ssp_prompts import PROPOSER_TEMPLATE as SSP_PROPOSER_TEMPLATE  # algorithm.ssp.*
from anabranch.data.ssp_prompts import RAG_TEMPLATE as SSP_RAG_TEMPLATE
from anabranch.data.eva_prompts import EVOLVE_TEMPLATE  # task.eva.evolve_template


@dataclass
class SvSConfig:
    """SvS (``algorithm.svs``; Liang et al. 2025, arXiv 2508.14029; algorithms/svs.py, trainer/svs_step.py): the
    policy's correct solutions to challenging prompts (accuracy in [acc_low, acc_high]) prompt it to synthesize
    ``variants`` problems with the same answer; each is solved rollout.n times and kept when its accuracy is in
    [accept_low, accept_high]; synthesis rows get R_v = synthesis_reward·1[kept]; originals, syntheses and the
    kept problems' solutions train together."""

    # Turn SvS on (any loss that trains on group advantages; the task's rows need answers).
    enabled: bool = False
    # The challenging band of a prompt's own accuracy (the authors' script: [0.125, 0.5] with rollout.n = 8).
    acc_low: float = 0.125
    acc_high: float = 0.5
    # The band a synthesized problem's solve accuracy must reach to be kept (the authors' script: [0.125, 0.625]).
    accept_low: float = 0.125
    accept_high: float = 0.625
    # Problems synthesized per correct solution, one group (assumed; the paper's G_v was not readable here).
    variants: int = 4
    # Correct solutions of each challenging prompt synthesized from (the first in sampling order; assumed).
    solutions_per_prompt: int = 1
    # R_v of a kept problem's synthesis (others 0); 0: the synthesis rows are not trained (no self-play on posing).
    synthesis_reward: float = 1.0
    # Token budget of a synthesis response (the problem statement between <problem> markers).
    max_synth_tokens: int = 256
    # The synthesis request; {solution} is the correct solution, {problem} (optional) the original question.
    synthesis_template: str = SVS_TEMPLATE


@dataclass
class SSPConfig:
    """Search Self-play (``algorithm.ssp``; Lu et al. 2025, arXiv 2510.18821; algorithms/ssp.py, trainer/ssp_round.py):
    each step the policy, as proposer, gets each prompt's answer and writes ``proposals`` questions after searching;
    a question passing the rule filters and the RAG check (answered right from the proposer's retrieved documents)
    is solved rollout.n times with the search tool; solver rows train on correctness, proposer rows on
    1 − solver success (invalid proposals: ``invalid_reward``). Needs rollout.tools=[search]."""

    enabled: bool = False
    # Proposals per prompt, one group (group-relative advantages; the authors' code: GRPO when this is > 1).
    proposals: int = 4
    # Token budget of a proposer response (its searches' outputs included) and of the RAG check's answer.
    max_propose_tokens: int = 512
    max_rag_tokens: int = 128
    # The reward of a proposal that fails the filters or the RAG check (the authors' code: a format penalty).
    invalid_reward: float = 0.0
    # Rule filters (the authors' code): at least this many distinct search calls, this many words in the question.
    min_search_calls: int = 2
    min_question_words: int = 10
    # The proposer's request ({answer}: the prompt's answer) and the RAG check's ({documents}, {question}).
    proposer_template: str = SSP_PROPOSER_TEMPLATE
    rag_template: str = SSP_RAG_TEMPLATE


@dataclass
class SwSConfig:
    """SwS (``task.sws``; Liang, Li, Gong et al. 2025, arXiv 2506.08989; algorithms/sws.py, trainer/sws_synthesis.py):
    every ``every`` steps the training rows the policy keeps failing (max accuracy <= max_accuracy, slope <= 0 over
    their recorded visits) give their concepts, new problems are synthesized from them, labelled by the policy's
    majority answer over ``vote_samples`` samples (kept at vote share >= confidence), kept when the policy's accuracy
    on them is in [band_low, band_high], and join the training rows (at most ``max_new_rows`` over the run)."""

    enabled: bool = False
    every: int = 50                 # synthesize after every this many steps (the paper: once, between two phases)
    min_records: int = 2            # visits a row needs before it can count as a weakness (a slope needs 2)
    max_accuracy: float = 0.5       # weakness: max over visits of its group accuracy <= this (the paper: 50%)
    weakest_fraction: float = 1.0   # share of the failed rows synthesized from, lowest mean accuracy first
    num_concepts: int = 3           # concepts asked for per failed problem (assumed)
    problems_per_concept: int = 2   # problems synthesized from one failed problem's concept list (assumed)
    vote_samples: int = 8           # the labeller's samples per problem (the authors' script: 8)
    confidence: float = 0.5         # label kept when its vote share >= this (the authors' code: 4 of 8)
    band_low: float = 0.125         # kept when the policy's accuracy on it is in [band_low, band_high]
    band_high: float = 0.875        # (the authors' augmented-training script: [0.125, 0.875])
    max_new_rows: int = 256         # cap on synthesized rows added over the whole run
    max_synth_tokens: int = 256     # token budget of a concept-extraction / problem-synthesis response


@dataclass
class EvaConfig:
    """eva (``task.eva``; Ye, Agarwal, Liu et al. 2024, arXiv 2411.00062; algorithms/eva.py, trainer/eva_evolve.py):
    every ``every`` steps a creator round samples ``num_prompts`` rows by informativeness info(x) (max − min, or max −
    mean, of the solver's rewards on the row's last visit), the policy rewrites each into ``variants`` harder related
    prompts, each is labelled by the policy's majority answer over ``vote_samples`` samples (kept at vote share >=
    confidence), and the kept ones join the training rows (at most ``max_new_rows`` over the run). Defaults assumed."""

    enabled: bool = False
    every: int = 20                 # steps between creator rounds (assumed)
    proxy: str = "max_min"          # info(x): "max_min" (r_max − r_min) or "max_mean" (r_max − mean r)
    selection: str = "weighted"     # "weighted": drawn w.p. ∝ info (the paper's Algorithm 1); "top": largest info
    num_prompts: int = 4            # rows evolved from per round (assumed)
    variants: int = 2               # evolved prompts asked for per selected row (assumed)
    vote_samples: int = 8           # the labeller's samples per evolved prompt (as SwS)
    confidence: float = 0.5         # label kept when its vote share >= this (as SwS)
    max_new_rows: int = 256         # cap on evolved rows added over the whole run
    max_evolve_tokens: int = 256    # token budget of an evolve response
    evolve_template: str = EVOLVE_TEMPLATE  # the evolve request; {problem} is the prompt to evolve
