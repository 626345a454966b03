"""Judge reward: a local Hugging Face causal LM grades each completion from a prompt template.

The judge sees the template filled with ``{question}``, ``{reference}`` (the row's answer, or
``reference=`` a rubric text given as a param), ``{completion}``, ``{min_score}``, ``{max_score}``,
and generates greedily (``max_new_tokens``). Its output is parsed strictly:

* exactly one line of the output, stripped, must read ``Score: N`` — the word ``Score``, a colon,
  one space, an integer N — and nothing else on that line; other lines (reasoning) are ignored;
* N must lie in [min_score, max_score];
* no such line, two or more such lines, or N out of range → unparseable: reward 0 and counted in
  ``reward/<name>/unparseable`` (never a silently guessed number).

Reward = (N − min_score) / (max_score − min_score).

Adversarial completions ("One Token to Fool LLM-as-a-Judge", Zhao et al. 2025: a lone ":", ".",
"Solution:", "Thought process:", "Let's solve this problem step by step.", "解", "かいせつ",
"Respuesta" make generative judges answer positively; ``anabranch eval --judge-probe`` measures a
configured judge's false-positive rate on them, eval/judge_probe.py). The parser reads only the
judge's output, so it cannot tell whether the judge was fooled; what it does about such
completions: with ``reject_trivial=true`` (default), a completion that has no letter or digit left
once those lead-in phrases are removed scores 0 without asking the judge (counted in
``reward/<name>/trivial_rejected``). Completions with real but wrong content that fool the judge
are not caught: use a judge trained against them.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

from anabranch.rewards.guard import RewardOutput, deadline_passed
from anabranch.rewards.registry import REWARDS

DEFAULT_TEMPLATE = (
    "You grade answers. Compare the answer with the reference.\n"
    "Question:\n<<<\n{question}\n>>>\n"
    "Reference answer:\n<<<\n{reference}\n>>>\n"
    "Answer to grade:\n<<<\n{completion}\n>>>\n"
    "Reply with a single line of the form \"Score: N\", N an integer from {min_score} to {max_score}."
)
_SCORE_LINE = re.compile(r"Score: (-?\d{1,6})")
# Lead-ins the paper found to fool judges on their own; removed before the "has content" check.
# Its multilingual keys too ("解", Japanese "かいせつ", Spanish "Respuesta"): kana count as letters.
_MASTER_KEYS = re.compile(
    r"(?i)(let'?s solve this problem step by step|thought process|solution|answer|respuesta|step \d+|解|かいせつ)")
_lock = threading.Lock()


def parse_score(text: str | None, min_score: int = 0, max_score: int = 10) -> int | None:
    """The judge's score, or ``None`` when the output does not follow the format exactly."""
    if not text:
        return None
    found = [m for m in (_SCORE_LINE.fullmatch(line.strip()) for line in text.splitlines()) if m]
    if len(found) != 1:
        return None
    value = int(found[0].group(1))
    return value if min_score <= value <= max_score else None


def is_trivial(completion: str) -> bool:
    """No letter or digit once the known judge-fooling lead-ins are removed."""
    rest = _MASTER_KEYS.sub("", completion or "")
    return not any(ch.isalnum() for ch in rest)


@lru_cache(maxsize=2)
def _load(model_path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    return model, tok


def judge_generate(texts: list[str], model_path: str, max_new_tokens: int = 16, chat_template: bool = True,
                   device: str = "cpu", batch_size: int = 8) -> list[str]:
    """Greedy judge outputs for the filled-in templates."""
    import torch

    model, tok = _load(model_path, device)
    if chat_template and getattr(tok, "chat_template", None):
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    outs = []
    with _lock, torch.no_grad():  # one judge model shared by threads
        for s in range(0, len(texts), batch_size):
            if deadline_passed():  # the guard gave up on this call: free the judge for the next one
                raise TimeoutError(f"the reward's deadline passed after {s} of {len(texts)} judge prompts")
            enc = tok(texts[s:s + batch_size], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
            outs.extend(tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return outs


@REWARDS.register("judge", in_process=True)
def judge_reward(prompts, completions, question=None, answer=None, model_path: str | None = None,
                 template: str = DEFAULT_TEMPLATE, reference: str | None = None, min_score: int = 0,
                 max_score: int = 10, max_new_tokens: int = 16, chat_template: bool = True,
                 reject_trivial: bool = True, device: str = "cpu", **_):
    if not model_path:
        raise ValueError("the judge reward needs params.model_path (a local Hugging Face model folder)")
    if max_score <= min_score:
        raise ValueError(f"judge needs max_score > min_score (got {min_score}, {max_score})")
    n = len(completions)
    questions = question if question is not None else prompts
    refs = [reference] * n if reference is not None else (answer if answer is not None else [""] * n)
    ask = [i for i in range(n) if not (reject_trivial and is_trivial(completions[i]))]
    filled = [template.format(question=questions[i], reference=refs[i], completion=completions[i],
                              min_score=min_score, max_score=max_score) for i in ask]
    outputs = judge_generate(filled, model_path, max_new_tokens, chat_template, device) if ask else []
    values, unparseable = [0.0] * n, 0
    for i, out in zip(ask, outputs):
        s = parse_score(out, min_score, max_score)
        if s is None:
            unparseable += 1
        else:
            values[i] = (s - min_score) / (max_score - min_score)
    return RewardOutput(values, {"unparseable": float(unparseable), "trivial_rejected": float(n - len(ask))})
