"""SPAE: Step Potential Advantage Estimation, a step-level term on top of any estimator's advantages.

Wu, Zhang, Chang, Zhang, Liu, Du 2026, "Step Potential Advantage Estimation: Harnessing Intermediate
Confidence and Correctness for Efficient Mathematical Reasoning" (arXiv 2601.03823). A response o_i is cut
into steps at a delimiter; after each step k the policy is probed: context h_{i,k} = prompt ‖ o_i up to the
end of step k ‖ an answer-forcing suffix, and the gold answer y* is scored after it:

    Acc_k  = (1/|y*|) Σ_m π_θ(y*_m | h_{i,k}, y*_<m)            correctness (mean token probability)
    Conf_k = exp(−(1/|y*|) Σ_m H_m),  H_m the entropy of π_θ(· | h_{i,k}, y*_<m)     confidence
    Φ_k    = 1.5·Acc_k·Conf_k + 0.5·Acc_k − Conf_k  ∈ [−1, 1]   step potential
    ΔΦ_1 = 0,  ΔΦ_k = Φ_k − Φ_{k−1}

Φ is 1 when the model is right and sure, −1 when it is sure of a wrong answer (false confidence). With
k* the first step where Φ_k ≥ τ (saturation), every token j of step M(j) gets

    Â'_{i,j} = Â_{i,j} − λ·|Â_{i,j}|·𝟙[M(j) > k*]  +  ξ·ΔΦ_{M(j)}

(the paper's Â_i·f(Φ) + ξ·g(ΔΦ)): potential gains raise the advantage, drops lower it, and the steps
after saturation (over-checking) lose outcome credit (a correct response) or are penalised further (a
wrong one: a right-to-wrong overturn). ξ = ``algorithm.spae_coef`` (the switch; 0 is off, the default,
and costs nothing), τ = ``spae_saturation``, λ = ``spae_saturation_penalty``; the delimiter, probe suffix
and the cap on probed steps per response are ``spae_delimiter``, ``spae_probe``, ``spae_max_steps``.

Confirmed from the paper's abstract and summaries and the authors' released probing example
(github.com/cii030/SPAE-RL, read, not copied): steps split at "\\n\\n"; the probe suffix
``**Final Answer**\\n\\boxed{``; Acc as the mean per-token probability of the gold answer; Conf as exp of
minus the mean next-token entropy; the Φ formula above; ΔΦ_1 = 0; the token-level form Â·f(Φ) + ξ·g(ΔΦ);
0.9 as the potential at which the example counts a solution as reached.

ASSUMED (the paper's method section, f, g and its coefficients could not be read):
* f: 1 up to and including the saturating step k*, then 1 − λ·sign(Â) (so Â − λ|Â|); g(ΔΦ) = ΔΦ.
  Defaults τ = 0.9 (the example's threshold), λ = 0.5, ξ's recipe value unknown (it is the switch).
* The paper samples N short probe continuations and reads their entropies; here the gold answer is
  teacher-forced after the probe and both Acc and Conf come from that one deterministic forward (the
  entropies at the answer's positions), at temperature 1.
* The example probes only inside <think>…</think> at tokens ending in ".\\n\\n"; here every occurrence of
  the delimiter in the whole response ends a step (at the token where the delimiter's last character lies).
* Tokens after the last probed boundary (the final answer) get neither term. With more than
  ``spae_max_steps`` boundaries, that many are kept, evenly spaced, the last one included (steps merge).
"""

from __future__ import annotations

import bisect
import math

import torch


def spae_on(cfg) -> bool:
    return cfg.spae_coef > 0


def check_spae(cfg) -> str | None:
    """Error text for invalid ``algorithm.spae_*`` keys, else None."""
    c = cfg.spae_coef
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < math.inf:
        return (f"algorithm.spae_coef must be a finite number >= 0, the weight ξ of the ΔΦ term (0 turns SPAE off; "
                f"got {c!r})")
    if not isinstance(cfg.spae_delimiter, str) or not cfg.spae_delimiter:
        return (f"algorithm.spae_delimiter must be a non-empty string, the text that ends a step "
                f"(got {cfg.spae_delimiter!r})")
    if not isinstance(cfg.spae_probe, str):
        return (f"algorithm.spae_probe must be a string, the answer-forcing suffix of each probe "
                f"(got {cfg.spae_probe!r})")
    t = cfg.spae_saturation
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not -1.0 < t <= 1.0:
        return (f"algorithm.spae_saturation must be in (-1, 1], the potential τ at which a response counts as solved "
                f"(Φ lies in [-1, 1]; got {t!r})")
    p = cfg.spae_saturation_penalty
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        return (f"algorithm.spae_saturation_penalty must be in [0, 1], the share λ of |Â| taken from post-saturation "
                f"tokens (above 1 a correct response's advantage would change sign; got {p!r})")
    k = cfg.spae_max_steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return f"algorithm.spae_max_steps must be an integer >= 1, the most probes per response (got {k!r})"
    return None


def step_ends(pieces: list[str], delimiter: str) -> list[int]:
    """Inclusive end token of each step: the token holding the last character of each occurrence of
    ``delimiter`` in the concatenated ``pieces`` (one decoded string per token). A token that holds two
    occurrences ends one step (no empty steps)."""
    ends_at, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends_at.append(total)  # exclusive end offset of each token
    text, out, start = "".join(pieces), [], 0
    while True:
        at = text.find(delimiter, start)
        if at < 0:
            return out
        start = at + len(delimiter)
        token = bisect.bisect_left(ends_at, start)  # first token whose text reaches the delimiter's end
        if not out or token > out[-1]:
            out.append(token)


def select_steps(ends: list[int], max_steps: int) -> list[int]:
    """At most ``max_steps`` boundaries, evenly spaced over ``ends``, the last one kept."""
    n = len(ends)
    if n <= max_steps:
        return list(ends)
    if max_steps == 1:
        return [ends[-1]]
    picks = sorted({round(i * (n - 1) / (max_steps - 1)) for i in range(max_steps)})
    return [ends[i] for i in picks]


def step_potential(acc: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """Φ = 1.5·Acc·Conf + 0.5·Acc − Conf."""
    return 1.5 * acc * conf + 0.5 * acc - conf


def potential_deltas(phi: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, K] ΔΦ_k = Φ_k − Φ_{k−1}, 0 for the first step and on padding."""
    prev = torch.cat([phi[:, :1], phi[:, :-1]], dim=1)
    return (phi - prev) * valid.to(phi.dtype)


def post_saturation(phi: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """[B, K] bool: the steps after the first one whose Φ ≥ τ (the saturating step itself is not)."""
    sat = ((phi >= tau) & valid.bool()).long()
    before = torch.cumsum(sat, dim=1) - sat  # saturated steps strictly before k
    return (before > 0) & valid.bool()


def token_steps(ends: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """[B, T] the step holding each response token (step k spans ends[k−1] < t ≤ ends[k]); −1 after the
    last boundary (and on rows with none)."""
    big = torch.iinfo(torch.long).max
    e = torch.where(valid.bool(), ends.long(), torch.full_like(ends.long(), big))
    t = torch.arange(width)
    k = (e[:, None, :] < t[None, :, None]).sum(-1)  # boundaries strictly before t
    n = valid.long().sum(-1, keepdim=True)
    return torch.where(k < n, k, torch.full_like(k, -1))


def spae_advantages(advantages: torch.Tensor, mask: torch.Tensor, step_of_token: torch.Tensor,
                    delta: torch.Tensor, post: torch.Tensor, coef: float, penalty: float) -> torch.Tensor:
    """Â' = Â − λ·|Â|·𝟙[post-saturation step] + ξ·ΔΦ of each token's step; tokens outside any step
    unchanged."""
    has = step_of_token >= 0
    idx = step_of_token.clamp(min=0)
    d = torch.gather(delta, 1, idx) * has
    p = (torch.gather(post.long(), 1, idx) * has).to(advantages.dtype)
    out = advantages - penalty * advantages.abs() * p + coef * d.to(advantages.dtype)
    return out * mask.to(advantages.dtype)
