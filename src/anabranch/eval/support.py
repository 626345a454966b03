"""Answer-level entropy and empirical-support change between a base and a trained model.

After Wu, Xuan, Lu, Liu, Dong, Harchaoui & Choi 2025, "The Invisible Leash: Why RLVR May or May
Not Escape Its Origin" (arXiv 2507.14843).

**Answer entropy.** For one problem with n samples whose extracted final answers have empirical
distribution p(a) = count(a) / n, H = −Σ_a p(a) · ln p(a) (nats), averaged over problems. The
paper contrasts it with token-level entropy: RLVR can raise token entropy while this falls.
Assumption (the paper does not say): a sample with no extractable answer counts as one more
outcome, the single bucket "no answer", so n samples always make a distribution that sums to 1;
all-unanswered gives H = 0, and k distinct answers plus no-answers behave like k + 1 answers.

**Empirical support.** A problem (or a correct answer) is in a model's empirical support when it
is found among that model's k samples. Comparing a base B and a trained model T on the same
problems, each item falls in one of four cells:

- preserved: found by both;   shrunk: found by B only;   expanded: found by T only;
- out of support: found by neither (only at problem granularity: an answer nobody found is unknown).

with the paper's rates SRR = P / (P + S) (support retention), NDR = E / (P + E) (net discovery),
SDS = 2·SRR·NDR / (SRR + NDR) (support dynamic score, their harmonic mean) and
NSCR = (E − S) / (P + S + E) (net support change). "Found" at problem granularity: at least one
correct sample; at answer granularity: each distinct extracted answer of a correct sample is an
item (so a problem with several correct forms, e.g. code, counts each).
"""

from __future__ import annotations

import math
from collections import Counter

NO_ANSWER = object()  # the bucket for samples with no extractable answer (never equal to a real answer)


def answer_entropy(answers: list) -> float:
    """H = −Σ p(a) ln p(a) over the empirical answer distribution; ``None`` is one "no answer" bucket."""
    if not answers:
        raise ValueError("answer entropy needs at least one sample")
    counts = Counter(NO_ANSWER if a is None else a for a in answers)
    n = len(answers)
    return -sum((c / n) * math.log(c / n) for c in counts.values())


def mean_answer_entropy(per_problem_answers: list[list]) -> float:
    if not per_problem_answers:
        raise ValueError("no problems to score")
    return sum(answer_entropy(a) for a in per_problem_answers) / len(per_problem_answers)


def _rates(p: int, s: int, e: int) -> dict:
    srr = p / (p + s) if p + s else None
    ndr = e / (p + e) if p + e else None
    sds = 2 * srr * ndr / (srr + ndr) if srr is not None and ndr is not None and srr + ndr > 0 else None
    nscr = (e - s) / (p + s + e) if p + s + e else None
    return {"SRR": srr, "NDR": ndr, "SDS": sds, "NSCR": nscr}


def _samples_per_problem(problems: list[dict]):
    """The number of samples n per problem: one int when every problem has the same, else the sorted
    distinct counts."""
    counts = sorted({len(p["samples"]) for p in problems})
    return (counts[0] if len(counts) == 1 else counts) if counts else None


def support_change(base: list[dict], trained: list[dict]) -> dict:
    """Support of ``trained`` against ``base`` on the same problems.

    Each argument is the list of per-problem entries `anabranch eval` writes (``question`` and
    ``samples``: dicts with ``answer`` and ``correct``). Problems are matched by question text;
    a mismatch raises ValueError (the two evaluations did not score the same problems).
    Support grows with the number of samples n, so the n of each side is reported (``n_base``,
    ``n_trained``) and a console warning says when they differ (the rates are computed all the same).
    """
    if [str(p["question"]) for p in base] != [str(p["question"]) for p in trained]:
        raise ValueError("support comparison needs both models evaluated on the same problems, in the same order "
                         "(same task, task.eval_size and seed)")
    n_base, n_trained = _samples_per_problem(base), _samples_per_problem(trained)
    if [len(p["samples"]) for p in base] != [len(p["samples"]) for p in trained]:
        from anabranch.rewards.guard import warn

        warn(f"support comparison of models sampled with different numbers of samples per problem: n={n_base} "
             f"for the base, n={n_trained} for the trained model; support grows with n, so the shrunk/expanded "
             "counts partly reflect the sampling budget (evaluate both with the same n)")
    counts = {"preserved": 0, "shrunk": 0, "expanded": 0, "out_of_support": 0}
    answers = {"preserved": 0, "shrunk": 0, "expanded": 0}
    shrunk_problems, expanded_problems = [], []
    for i, (b, t) in enumerate(zip(base, trained)):
        b_ok = {s.get("answer") for s in b["samples"] if s["correct"]}
        t_ok = {s.get("answer") for s in t["samples"] if s["correct"]}
        cell = {(True, True): "preserved", (True, False): "shrunk", (False, True): "expanded",
                (False, False): "out_of_support"}[(bool(b_ok), bool(t_ok))]
        counts[cell] += 1
        if cell == "shrunk":
            shrunk_problems.append(i)
        elif cell == "expanded":
            expanded_problems.append(i)
        # Answer granularity: a correct sample with no extractable answer is still one item.
        b_ok, t_ok = {NO_ANSWER if a is None else a for a in b_ok}, {NO_ANSWER if a is None else a for a in t_ok}
        answers["preserved"] += len(b_ok & t_ok)
        answers["shrunk"] += len(b_ok - t_ok)
        answers["expanded"] += len(t_ok - b_ok)
    m = len(base)
    return {
        "num_problems": m,
        "n_base": n_base,
        "n_trained": n_trained,
        "problems": {**counts, **{f"{k}_fraction": v / m if m else None for k, v in counts.items()},
                     **_rates(counts["preserved"], counts["shrunk"], counts["expanded"])},
        "answers": {**answers, **_rates(answers["preserved"], answers["shrunk"], answers["expanded"])},
        "shrunk_problems": shrunk_problems,
        "expanded_problems": expanded_problems,
    }


def support_against_first(entries: list[dict]) -> dict:
    """``{label: support_change(first, entry)}`` for every entry after the first (the base).
    Entries that did not score the same problems as the first are reported with the reason."""
    out = {}
    if len(entries) < 2 or not isinstance(entries[0].get("problems"), list):
        return out
    for e in entries[1:]:
        try:
            out[e["label"]] = {"base": entries[0]["label"], **support_change(entries[0]["problems"], e["problems"])}
        except (ValueError, KeyError, TypeError) as exc:
            out[e["label"]] = {"base": entries[0]["label"], "error": str(exc)}
    return out
