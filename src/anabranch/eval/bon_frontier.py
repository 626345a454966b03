"""Did RL beat best-of-n at the same KL? The base model's best-of-n and optimal KL-constrained
(tilted) reward-vs-KL frontiers, and each trained model's own point against them.

The optimal KL-constrained policy (Yang, Salamatian, Sun, Suresh & Beirami 2024, "Asymptotics of
Language Model Alignment", arXiv 2404.01730): max E_φ[r] subject to KL(φ‖π_ref) ≤ Δ is solved by
the exponential tilt

    π*_β(y|x) = π_ref(y|x)·exp(r(x,y)/β) / Z_β(x),   Z_β(x) = E_{y∼π_ref}[exp(r(x,y)/β)],

with E*[r] rising and KL(π*_β‖π_ref) = E*[r]/β − log Z_β falling in β. The paper proves that
best-of-N is asymptotically equivalent to it (memoryless model, linear reward, sequence length → ∞):
at matched KL their expected rewards are asymptotically equal and the KL between the two vanishes
relative to the length. Best-of-n's KL is at most log n − (n−1)/n (Beirami, Agarwal, Berant,
D'Amour, Eisenstein, Nagpal & Suresh 2024, "Theoretical guarantees on the best-of-n alignment
policy", arXiv 2401.01879: the formula used in the literature is an upper bound, tight when the
reward has no ties and the outputs are many).

Measured here, per problem x over the base model's k samples with rewards r_1..r_k (the eval's
correctness reward; 0/1 for a verifier), then averaged over the m problems:

- **Best-of-n** for n = 1..k: the unbiased estimator of E[max of n i.i.d. draws], the mean of the
  max over all n-subsets of the k samples: with r_(1) ≤ … ≤ r_(k) sorted,
  R_BoN(n) = Σ_{i=n}^{k} C(i−1, n−1)/C(k, n) · r_(i). For 0/1 rewards it is pass@n (Chen et al. 2021).
  KL_BoN(n) = log n − (n−1)/n (the bound above, so BoN is placed at no less than its true KL).
- **Tilted frontier** for a sweep of β: self-normalized importance weights over the k samples,
  w_j = exp(r_j/β) / Σ_l exp(r_l/β); E*[r] ≈ Σ_j w_j r_j and KL ≈ E*[r]/β − log((1/k) Σ_j exp(r_j/β))
  (= Σ_j w_j log(k·w_j), computed so). With k samples this is an estimate: π* is supported on the
  k samples drawn, its KL is at most log k, and a reward the base never sampled is invisible. One
  β for all problems: the Lagrangian of the prompt-averaged constraint E_x KL ≤ Δ has one multiplier.
- **The trained model's point**: its mean reward over its own samples, and
  KL(π_θ‖π_ref) ≈ (1/m) Σ_x mean over its samples y of Σ_t [log π_θ(y_t|x,y_<t) − log π_ref(y_t|x,y_<t)],
  both log-probs from one forward pass of each model over the trained model's samples (base
  loaded beside the trained one). The BoN (and tilted) reward at that KL is read off the curve by
  linear interpolation in KL between neighbouring n (β); ``beats_bon``: the trained reward is higher.

Assumed (not in the papers): log-probs at the eval's ``--temperature`` (the distribution the samples
came from), ignoring ``--top-p`` truncation (an approximation when top-p < 1); only the tokens the
model sampled count (tool outputs are context); a KL estimate below 0 (sampling noise) reads the
curve at KL 0, one above the base's k samples' reach (KL_BoN(k)) gives no comparison (None).
"""

from __future__ import annotations

import math

import torch

# β sweep of the tilted frontier: geometric from 100 (≈ the base) down to 0.01 (≈ best of the k).
BETAS = tuple(10 ** (2 - 4 * i / 24) for i in range(25))


def kl_bon(n: int) -> float:
    """log n − (n−1)/n: the upper bound on KL(best-of-n ‖ π_ref) (Beirami et al. 2024)."""
    if n < 1:
        raise ValueError(f"best-of-n needs n >= 1, got {n}")
    return math.log(n) - (n - 1) / n


def bon_reward(rewards: list[float], n: int) -> float:
    """Unbiased estimate of E[max of n draws] from k ≥ n samples: the mean of the max over every
    n-subset, Σ_{i=n}^{k} C(i−1, n−1)/C(k, n)·r_(i) over the rewards sorted increasingly (r_(i) is
    the max of exactly C(i−1, n−1) subsets: itself and n−1 of the i−1 below it)."""
    k = len(rewards)
    if not 1 <= n <= k:
        raise ValueError(f"best-of-n needs 1 <= n <= k={k} samples, got n={n}")
    srt = sorted(rewards)
    total = math.comb(k, n)
    # Exact integer weights, then one division: no cancellation for large k.
    return sum(math.comb(i - 1, n - 1) * srt[i - 1] for i in range(n, k + 1)) / total


def tilted(rewards: list[float], beta: float) -> tuple[float, float]:
    """(E*[r], KL(π*_β‖π_ref)) estimated on one problem's k samples by self-normalized weights."""
    if beta <= 0:
        raise ValueError(f"the tilted policy needs beta > 0, got {beta}")
    k = len(rewards)
    z = [r / beta for r in rewards]
    top = max(z)  # log-sum-exp shift: exp(r/β) overflows for small β
    e = [math.exp(v - top) for v in z]
    s = sum(e)
    w = [v / s for v in e]
    reward = sum(wi * r for wi, r in zip(w, rewards))
    # Σ w log(k w): the same as E*[r]/β − log mean exp(r/β), without the cancellation for large β.
    kl = sum(wi * math.log(k * wi) for wi in w if wi > 0)
    return reward, max(kl, 0.0)


def frontier(per_problem: list[list[float]], betas=BETAS) -> dict:
    """The base's best-of-n curve (n = 1..min k) and tilted curve, averaged over problems."""
    if not per_problem or any(not r for r in per_problem):
        raise ValueError("the best-of-n frontier needs at least one sample with a reward for every problem")
    m, k = len(per_problem), min(len(r) for r in per_problem)
    bon = [{"n": n, "kl": kl_bon(n), "reward": sum(bon_reward(r, n) for r in per_problem) / m}
           for n in range(1, k + 1)]
    tilt = []
    for beta in sorted(betas, reverse=True):  # increasing KL
        pts = [tilted(r, beta) for r in per_problem]
        tilt.append({"beta": beta, "kl": sum(p[1] for p in pts) / m, "reward": sum(p[0] for p in pts) / m})
    return {"k": k, "num_problems": m, "base_mean_reward": bon[0]["reward"], "bon": bon, "tilted": tilt}


def reward_at_kl(curve: list[dict], kl: float) -> float | None:
    """The curve's reward at ``kl`` by linear interpolation in KL between its neighbouring points
    (sorted by KL); below the first point its reward, past the last None (out of the curve's reach)."""
    pts = sorted((p["kl"], p["reward"]) for p in curve)
    if kl <= pts[0][0]:
        return pts[0][1]
    for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
        if kl <= k1:
            return r0 if k1 == k0 else r0 + (r1 - r0) * (kl - k0) / (k1 - k0)
    return None


def rewards_of(problems: list[dict]) -> list[list[float]]:
    """Per problem, each sample's reward from an `anabranch eval` entry's ``problems``."""
    return [[float(s["reward"]) for s in p["samples"]] for p in problems]


def compare(base_entry: dict, entry: dict) -> dict:
    """The base's frontier and the trained entry's point on it (needs ``entry["kl_to_base"]``)."""
    front = frontier(rewards_of(base_entry["problems"]))
    rewards = rewards_of(entry["problems"])
    if len(rewards) != front["num_problems"] or any(not r for r in rewards):
        raise ValueError("the trained model needs samples on the base's problems")
    kl_info = entry.get("kl_to_base")
    if not isinstance(kl_info, dict) or "error" in kl_info:
        raise ValueError("no KL to the base: " + (kl_info or {}).get("error", "not measured"))
    mean = sum(sum(r) / len(r) for r in rewards) / len(rewards)
    kl = kl_info["kl"]
    bon, tilt = reward_at_kl(front["bon"], kl), reward_at_kl(front["tilted"], kl)
    return {"frontier": front, "trained": {
        "mean_reward": mean, **kl_info, "bon_reward_at_kl": bon, "tilted_reward_at_kl": tilt,
        "beats_bon": None if bon is None else mean > bon,
        # Best-of-n's n whose KL bound equals the trained model's KL (fractional).
        "bon_n_at_kl": _n_at_kl(kl, front["k"])}}


def _n_at_kl(kl: float, k: int) -> float | None:
    if kl <= 0:
        return 1.0
    if kl > kl_bon(k):
        return None
    lo, hi = 1.0, float(k)  # log n − (n−1)/n increases in n ≥ 1: bisection
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.log(mid) - (mid - 1) / mid < kl else (lo, mid)
    return (lo + hi) / 2


def against_base(base_entry: dict, entry: dict) -> dict:
    """:func:`compare` through :func:`anabranch.eval.gain_decomposition.against_base` (same problems
    in the same order, the base's label, ``{"base", "error"}`` for a pair that cannot be compared)."""
    from anabranch.eval import gain_decomposition

    return gain_decomposition.against_base(lambda _b, _t, _k: compare(base_entry, entry), base_entry, entry, 1)


@torch.no_grad()
def sequence_log_ratios(trained, base, sequences: list, temperature: float, chunk: int = 8) -> list[float]:
    """Σ_t [log π_θ − log π_ref] over the counted tokens of each sequence
    (:class:`anabranch.eval.sparse_selection.Sequence`), one forward pass of each model per chunk."""
    from anabranch.eval.sparse_selection import pad_batch
    from anabranch.models.logprobs import response_forward

    device = next(trained.parameters()).device
    out: list[float] = []
    for start in range(0, len(sequences), chunk):
        ids, mask, counted, r = pad_batch(sequences[start:start + chunk], device)
        lp_t = response_forward(trained, ids, mask, r, temperature=temperature).log_probs
        lp_b = response_forward(base, ids, mask, r, temperature=temperature).log_probs
        out += ((lp_t.float() - lp_b.float()) * counted).sum(-1).tolist()
    return out


def kl_to_base(trained, base, sequences: list, temperature: float) -> dict:
    """KL(π_θ‖π_ref) estimated on the trained model's samples, the base loaded beside ``trained``
    (by :func:`anabranch.eval.beside_base.load_comparable_base`, shared with sparse selection)."""
    out = {"temperature": temperature}
    ratios = sequence_log_ratios(trained, base, sequences, temperature)
    by_problem: dict[int, list[float]] = {}
    for s, v in zip(sequences, ratios):
        by_problem.setdefault(s.problem, []).append(v)
    means = [sum(v) / len(v) for v in by_problem.values()]
    m = len(means)
    var = sum((x - sum(ratios) / len(ratios)) ** 2 for x in ratios) / max(len(ratios) - 1, 1) if ratios else 0.0
    return {**out, "kl": sum(means) / m if m else 0.0, "kl_stderr": math.sqrt(var / max(len(ratios), 1)),
            "sequences": len(ratios)}


def summary_line(label: str, bf: dict) -> str:
    if "error" in bf:
        return f"best-of-n frontier of {label} vs {bf['base']}: {bf['error']}"
    t = bf["trained"]
    bon = "beyond the base's best-of-k (no comparison)" if t["bon_reward_at_kl"] is None else (
        f"best-of-n at that KL {t['bon_reward_at_kl']:.3f} (n≈{t['bon_n_at_kl']:.2f}): "
        + ("RL beats best-of-n" if t["beats_bon"] else "RL does not beat best-of-n"))
    return (f"best-of-n frontier of {label} vs {bf['base']}: reward {t['mean_reward']:.3f} at KL "
            f"{t['kl']:.3f} nats; {bon}")


def plot_entries(entries: list[dict], path) -> bool:
    """:func:`plot` of the later entries' ``bon_frontier`` (those that have one); False when none has."""
    done = [e for e in entries[1:] if "frontier" in e.get("bon_frontier", {})]
    if done:
        plot(done[0]["bon_frontier"]["frontier"],
             {e["label"]: (e["bon_frontier"]["trained"]["kl"], e["bon_frontier"]["trained"]["mean_reward"])
              for e in done}, path)
    return bool(done)


def plot(frontier_: dict, points: dict[str, tuple[float, float]], path) -> None:
    """Reward against KL: the base's best-of-n and tilted curves and each trained model's point."""
    from anabranch.eval.plots import _save, plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, style in (("bon", "o-"), ("tilted", "--")):
        ax.plot([p["kl"] for p in frontier_[name]], [p["reward"] for p in frontier_[name]], style,
                label="best-of-n (KL bound)" if name == "bon" else "optimal tilted π*_β (estimate)")
    for label, (kl, reward) in points.items():
        ax.plot([kl], [reward], "*", markersize=12, label=label)
    ax.set_xlabel("KL to the base (nats)")
    ax.set_ylabel("mean reward")
    ax.set_title("reward vs KL")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def report_table(runs: list[dict]) -> str:
    """`anabranch report`'s table of each run's ``bon_frontier`` from its latest ``anabranch eval BASE
    RUN --bon-frontier``; empty when no run has one."""
    import html

    from anabranch.eval.report import _fmt

    rows = [(r["label"], r["evals"][0]["bon_frontier"]) for r in runs
            if r["evals"] and isinstance(r["evals"][0].get("bon_frontier"), dict)]
    if not rows:
        return ""
    head = ["run", "base", "reward", "KL to base (nats)", "best-of-n reward at that KL", "n at that KL",
            "tilted π* reward at that KL", "beats best-of-n"]
    lines = ["<h2>Best-of-n frontier</h2><p>Each run's mean reward and KL to its base against the base's "
             "best-of-n at the same KL (KL bound log n − (n−1)/n) and the optimal KL-constrained policy "
             "π* ∝ π_ref·exp(r/β) estimated from the base's samples (Yang et al. 2024, \"Asymptotics of "
             "Language Model Alignment\").</p><table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for label, d in rows:
        if "error" in d:
            lines.append(f"<tr><td>{html.escape(label)}</td><td>{html.escape(str(d.get('base', '')))}</td>"
                         f"<td colspan='{len(head) - 2}'>{html.escape(str(d['error']))}</td></tr>")
            continue
        t = d.get("trained") or {}
        cells = [label, d.get("base"), t.get("mean_reward"), t.get("kl"), t.get("bon_reward_at_kl"),
                 t.get("bon_n_at_kl"), t.get("tilted_reward_at_kl"),
                 None if t.get("beats_bon") is None else ("yes" if t["beats_bon"] else "no")]
        lines.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"
