"""Partial-prompt leakage audit: can the model finish a problem it is shown only the start of?

After Wu, Zhang, Dong, Xi, Zhao, Jin, Fan, Zhou, Lv, Zhang, Fu, Liu, Zhang & Zhang 2025,
"Reasoning or Memorization? Unreliable Results of Reinforcement Learning Due to Data
Contamination" (arXiv 2507.10532). The paper truncates each benchmark problem to its first x%
(80%, 60%, 40%), lets the model continue the text greedily without a chat template, and
measures how much of the hidden rest it reproduces (exact match and ROUGE-L) and how often the
answer it then gives is right. A model that completes held-out problems word for word has seen
them (Qwen2.5 on MATH-500 in the paper); on clean problems the rates are near zero.

Per truncation ratio r, for each problem text q of n whitespace-separated words (rows whose
question is not a plain text, or has fewer than 2 words, are skipped and counted):

- prefix = q up to the end of word k, k = round(r·n) clamped to [1, n−1]; reference = the
  remaining m = n − k words (truncation is at a word boundary);
- the model continues the prompt BOS + prefix greedily (no chat template, no instruction);
  candidate = the first m words of its continuation;
- exact match EM = [candidate words == reference words];
- ROUGE-L (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries"), word level:
  L = LCS(candidate, reference), R = L/|reference|, P = L/|candidate|,
  F = (1+β²)·P·R / (R + β²·P), β = 1 (0 when L = 0);
- answer accuracy = [the correctness reward of the whole continuation, against the row's answer,
  reaches full credit] (the eval's truth source, as greedy accuracy).

Reported per ratio: ``completion_exact_match`` (mean EM), ``rouge_l`` (mean F),
``answer_accuracy``, ``problems`` (scored), ``skipped``, and ``memorized`` (indices of the
problems completed exactly). Assumed where the paper's text we could read is silent: words as
the unit of truncation and of ROUGE-L, rounding of r·n, the candidate cut to the reference's
length (the model goes on past the problem, e.g. into a solution), and answer accuracy read from
the same greedy continuation.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable

WORD = re.compile(r"\S+")
DEFAULT_RATIOS = (0.4, 0.6, 0.8)


def truncate(text: str, ratio: float) -> tuple[str, list[str]] | None:
    """(prefix text up to the end of word k, the reference's words), or None under 2 words."""
    words = list(WORD.finditer(text))
    n = len(words)
    if n < 2:
        return None
    k = min(max(int(ratio * n + 0.5), 1), n - 1)  # round half up, keep >= 1 word on each side
    return text[: words[k - 1].end()], [w.group() for w in words[k:]]


def lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence of two token lists, O(|a|·|b|) time, O(|b|) memory."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: list[str], reference: list[str], beta: float = 1.0) -> float:
    """ROUGE-L F-measure of two token lists (Lin 2004); 0 when either is empty or nothing is shared."""
    lcs = lcs_length(candidate, reference) if candidate and reference else 0
    if lcs == 0:
        return 0.0
    r, p = lcs / len(reference), lcs / len(candidate)
    return (1 + beta ** 2) * p * r / (r + beta ** 2 * p)


def check_ratios(ratios) -> list[float]:
    from anabranch.config import ConfigError

    bad = [r for r in ratios if not 0 < r < 1]
    if bad or not ratios:
        raise ConfigError(f"--contamination ratios must be in (0, 1) (the kept fraction of each problem's words, "
                          f"e.g. 0.4,0.6,0.8), got {list(ratios)}")
    return sorted(set(ratios))


def audit(generate: Callable[[list[str]], list[str]], judge: Callable[[list[str], list[str], list[dict]], list[bool]],
          rows: list[dict], ratios, prefix: str = "") -> dict:
    """The audit above. ``generate(prompts)``: one greedy continuation per prompt; ``judge(prompts,
    continuations, rows)``: whether each continuation's answer is right; ``prefix``: text put before
    every truncated problem (the tokenizer's BOS where it expects one)."""
    result = {"ratios": {}}
    for ratio in check_ratios(ratios):
        cut = [(i, truncate(r["question"], ratio)) for i, r in enumerate(rows) if isinstance(r.get("question"), str)]
        cut = [(i, c) for i, c in cut if c is not None]
        prompts = [prefix + c[0] for _, c in cut]
        outs = generate(prompts) if prompts else []
        em, rl, memorized = [], [], []
        for (i, (_, ref)), out in zip(cut, outs):
            cand = WORD.findall(out)[: len(ref)]
            em.append(float(cand == ref))
            rl.append(rouge_l(cand, ref))
            if cand == ref:
                memorized.append(i)
        right = judge(prompts, outs, [rows[i] for i, _ in cut]) if prompts else []
        m = len(cut)
        result["ratios"][f"{ratio:g}"] = {
            "ratio": ratio, "problems": m, "skipped": len(rows) - m,
            "completion_exact_match": sum(em) / m if m else None,
            "rouge_l": sum(rl) / m if m else None,
            "answer_accuracy": sum(map(float, right)) / m if m else None,
            "memorized": memorized,
        }
    return result


def backend_audit(backend, tokenizer, rows: list[dict], ratios, source, max_new_tokens: int,
                  threshold: float = 1.0, batch_size: int = 16) -> dict:
    """:func:`audit` with a rollout backend's greedy decoding and the eval's truth ``source``."""
    from anabranch.data.prompts import bos_prefix
    from anabranch.rewards import score

    def generate(prompts):
        out = []
        for start in range(0, len(prompts), batch_size):
            out += backend.generate(prompts[start:start + batch_size], 1, greedy=True,
                                    max_new_tokens=max_new_tokens).completions
        return out

    def judge(prompts, completions, judged_rows):
        from anabranch.eval.accuracy import correct_flags

        _, per_source = score([source], prompts, completions, judged_rows)
        return [bool(v) for v in correct_flags(per_source[source.name], threshold)]

    return audit(generate, judge, rows, ratios, prefix=bos_prefix(tokenizer))


def summary_line(label: str, result: dict) -> str:
    parts = [f"{k}: EM {_f(v['completion_exact_match'])}, ROUGE-L {_f(v['rouge_l'])}, "
             f"answer acc {_f(v['answer_accuracy'])}" for k, v in result["ratios"].items()]
    return f"partial-prompt audit of {label} (kept fraction: completion / answer): " + "; ".join(parts)


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def report_table(runs: list[dict]) -> str:
    """The report's table of each run's latest audit (``anabranch eval --contamination``); empty if none."""
    rows = [(r["label"], r["evals"][0]["contamination"]) for r in runs
            if r["evals"] and isinstance(r["evals"][0].get("contamination"), dict)]
    if not rows:
        return ""
    lines = ["<h2>Partial-prompt leakage</h2><p>Each held-out problem cut to its first fraction of words and "
             "continued greedily: exact completion of the rest, its ROUGE-L, and the accuracy of the answer "
             "given from the cut problem; high values mean the problems were seen in training (Wu et al. 2025, "
             "\"Reasoning or Memorization? Unreliable Results of Reinforcement Learning Due to Data "
             "Contamination\").</p><table><tr><th>run</th><th>kept</th><th>problems</th><th>exact match</th>"
             "<th>ROUGE-L</th><th>answer accuracy</th></tr>"]
    for label, res in rows:
        for key, v in (res.get("ratios") or {}).items():
            cells = [html.escape(label), key, v.get("problems"), _f(v.get("completion_exact_match")),
                     _f(v.get("rouge_l")), _f(v.get("answer_accuracy"))]
            lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"
