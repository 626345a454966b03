"""SSRL's self-search rollouts (``rollout.self_search``): the policy is its own search engine.

Fan, Zhang, Zhou, Zuo, Chen, Fu, Long, Zhu, Jiang, Zhang, Kang, Chen, Huang, He, Wang, Bai, Ding & Zhou 2025,
"SSRL: Self-Search Reinforcement Learning" (arXiv 2508.10874). The policy answers a knowledge question in the
Search-R1 format (Jin et al. 2025, arXiv 2503.09516)::

    <think> ... </think> <search> query </search> <information> ... </information> ... <answer> a </answer>

but no search engine is called: the policy writes the ``<information>`` block itself, in the same single-turn
generation. Training is GRPO on an outcome reward (exact match of the answer, ``qa_exact_match``) plus a format
reward (``ssrl_format``; both in rewards/ssrl_format.py, where the combination is written out).

Information masking (``mask_information``, default on): after generation, every ``<information>...</information>``
span of a response (tags included) gets ``loss_mask`` 0, so the loss, the advantages' token mask, KL and entropy
terms leave out the text the policy wrote "as the search engine", as Search-R1 leaves out a real engine's passages;
the model still reads them (``response_mask`` keeps them). Spans are found in the decoded response text and mapped
to tokens by their character offsets: a token is masked when its characters overlap a span (a tag split over
several tokens, or a token holding the tag's ``<`` with text before it, masks all of them). An ``<information>``
left unclosed (a truncated response) is masked to the end of the text; the EOS token (no characters) stays
trained. Offsets come from each token decoded alone when their concatenation is the decoded response (the usual
case, one pass); else (a byte-level token inside a multi-byte character decodes to U+FFFD alone) from the lengths
of decoded prefixes, found by binary search for each span boundary.

Sim2Real (``sim2real``): at evaluation, the trainer's held-out eval and ``anabranch eval``, generation stops at each
``</search>``, the BM25 search tool (rollout/search_tool.py: rollout.search_corpus, search_top_k) answers the query,
and its passages enter as ``"\\n<information>\\n...\\n</information>\\n"`` (not sampled, ``loss_mask`` 0), then the
policy resumes. This is the multi-turn tool loop (rollout/multi_turn.py) with the search tool, whose call tags are
already ``<search>...</search>``; :class:`Sim2RealBackend` changes only the result block's tag
(``ToolUseBackend.result_tag``, ``<result>`` by default).

Metrics (``self_search/...``): ``searches_mean``, complete ``<search>...</search>`` pairs per response (counted in
the decoded completions); ``masked_token_frac``, the share of response tokens masked as information (0 with
mask_information off, which maps no token at all).

Sharded training (FSDP / ZeRO-3): training is one generate call per process, but the sim2real held-out eval searches
a different number of times on each process, so sim2real is refused with a sharded launch at config load (the
accelerate config file or launch environment) and, failing that, when Distributed.prepare sets ``synced_gpus``.

What is confirmed and what is assumed. Confirmed (the abstract; the authors' released example script,
TsinghuaC3I/SSRL ``examples/ssrl/example.sh``): the four tags, format-based plus rule-based rewards, GRPO
(``adv_estimator=grpo``, 5 samples per prompt, KL loss 0.001), an information loss mask switch set to True, and
``sim2real`` / ``use_entropy`` switches. Assumed (the method section was not available to read): that the tags
themselves are masked with the block, the handling of an unclosed block, the format reward's exact conditions
(rewards/ssrl_format.py), and that sim2real replaces every search (the paper's entropy-guided variant, which calls
the real engine only for some searches, is not implemented: its rule could not be read).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from anabranch.config import RolloutConfig
from anabranch.rollout.base import BackendWrapper, Rollout
from anabranch.rollout.multi_turn import ToolUseBackend, result_text

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
INFO_TAG = "information"
INFO_OPEN, INFO_CLOSE = f"<{INFO_TAG}>", f"</{INFO_TAG}>"
_SEARCH_PAIR = re.compile(re.escape(SEARCH_OPEN) + r".*?" + re.escape(SEARCH_CLOSE), re.DOTALL)


# ---------------------------------------------------------------------------------------------- spans
def information_spans(text: str, open_tag: str = INFO_OPEN, close_tag: str = INFO_CLOSE) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the ``open_tag ... close_tag`` blocks of ``text``, tags included, in
    order; an unclosed last block runs to the end of the text."""
    spans, pos = [], 0
    while (start := text.find(open_tag, pos)) >= 0:
        close = text.find(close_tag, start + len(open_tag))
        if close < 0:
            spans.append((start, len(text)))
            break
        pos = close + len(close_tag)
        spans.append((start, pos))
    return spans


def _prefix_lengths(tokenizer, ids: list[int], text: str) -> tuple[Callable[[int], int], str]:
    """(L, decoded): L(m) = the number of characters of the first ``m`` tokens decoded (without special tokens), and
    the text those lengths index. ``text`` is the response as decoded once already (Rollout.completions): when the
    tokens decoded one by one concatenate to it, L comes from their lengths and nothing is decoded whole again."""
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    if "".join(pieces) == text:
        ends = [0]
        for p in pieces:
            ends.append(ends[-1] + len(p))
        return ends.__getitem__, text
    memo: dict[int, int] = {0: 0}

    def length(m: int) -> int:
        if m not in memo:
            memo[m] = len(tokenizer.decode(ids[:m], skip_special_tokens=True))
        return memo[m]

    return length, tokenizer.decode(ids, skip_special_tokens=True)


def _first(length: Callable[[int], int], n: int, above: int, strict: bool) -> int:
    """The smallest m in [0, n] with L(m) > above (strict) or L(m) >= above; n when none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if (length(mid) > above) if strict else (length(mid) >= above):
            hi = mid
        else:
            lo = mid + 1
    return lo


def information_token_mask(tokenizer, ids: list[int], text: str | None = None) -> list[int]:
    """``keep[k]`` 0 where token k's characters overlap an information span of the decoded ``ids``, else 1.
    ``text``: ``ids`` decoded without special tokens when the caller has it (a Rollout's completion), saving a decode
    (checked against the tokens' own decodes; decoded afresh when they differ)."""
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    keep = [1] * len(ids)
    if INFO_OPEN not in text:  # most rows: no token decoding at all
        return keep
    length, decoded = _prefix_lengths(tokenizer, ids, text)
    for a, b in information_spans(decoded):
        first = _first(length, len(ids), a, strict=True) - 1  # the token holding character a
        last = _first(length, len(ids), b, strict=False)      # tokens up to the one ending at or after b
        for k in range(max(first, 0), last):
            keep[k] = 0
    return keep


def count_searches(text: str) -> int:
    """The complete ``<search>...</search>`` pairs of ``text``."""
    return len(_SEARCH_PAIR.findall(text))


def mask_information(rollout: Rollout, tokenizer, mask: bool = True) -> Rollout:
    """``rollout`` (changed in place and returned) with its information tokens out of ``loss_mask`` (when ``mask``)
    and the ``self_search/*`` metrics. Applied once per generate call, after generation. Searches are counted in the
    decoded completions; the token mask is built only when ``mask``, and only rows holding ``<information>`` decode
    their tokens (each once, alone)."""
    rows = rollout.response_ids.shape[0]
    searches = sum(count_searches(c) for c in rollout.completions)
    masked = 0
    if mask:
        keep = torch.ones_like(rollout.response_mask)
        for i, text in enumerate(rollout.completions):
            if INFO_OPEN in text:
                ids = rollout.response_tokens(i)
                keep[i, :len(ids)] = torch.tensor(information_token_mask(tokenizer, ids, text), dtype=keep.dtype)
        masked = int(((1 - keep) * rollout.response_mask).sum())
        if masked:
            # none yet (single turn): every response token sampled; padding 0, as the tool loop's masks are padded
            base = rollout.loss_mask if rollout.loss_mask is not None else rollout.response_mask
            rollout.loss_mask = base.to(rollout.response_mask.dtype) * keep
    rollout.metrics["self_search/searches_mean"] = searches / max(rows, 1)
    rollout.metrics["self_search/masked_token_frac"] = masked / max(int(rollout.response_mask.sum()), 1)
    return rollout


# ---------------------------------------------------------------------------------------------- backends
class SelfSearchBackend(BackendWrapper):
    """Single-turn generation by ``inner`` with :func:`mask_information` applied to each Rollout; ``sim2real``: the
    :class:`Sim2RealBackend` the evaluations use (None unless rollout.self_search.sim2real)."""

    KEY = "rollout.self_search"

    def __init__(self, backend, tokenizer, cfg: RolloutConfig):
        # Not BackendWrapper.__init__: a single-turn wrapper needs no continue_ids (only sim2real does, below).
        self.__dict__["inner"] = backend
        self.__dict__.update(eos_ids=list(backend.eos_ids), tokenizer=tokenizer, cfg=cfg,
                             sim2real=Sim2RealBackend(backend, tokenizer, cfg) if cfg.self_search.sim2real else None)

    def __setattr__(self, name, value):
        # Training makes one generate call per process, so sharded training's synced_gpus would be fine for it; but
        # the held-out eval runs the sim2real tool loop, whose processes search different numbers of times: set
        # through that loop (a BackendWrapper: it refuses synced_gpus, and passes the rest on to the same inner).
        setattr(self.sim2real if self.sim2real is not None else self.inner, name, value)

    def generate(self, prompts: list[str], n: int, greedy: bool = False, max_new_tokens: int | None = None,
                 seed: int | None = None) -> Rollout:
        ro = self.inner.generate(prompts, n, greedy=greedy, max_new_tokens=max_new_tokens, seed=seed)
        return mask_information(ro, self.tokenizer, self.cfg.self_search.mask_information)


def information_text(output: str) -> str:
    return result_text(output, INFO_TAG)


class Sim2RealBackend(ToolUseBackend):
    """The tool loop over ``backend`` with the search tool of ``cfg`` (rollout.search_corpus, search_top_k), its
    results written as ``<information>`` blocks: generation stops at ``</search>`` and resumes after the passages."""

    KEY = "rollout.self_search.sim2real"
    SHARDED_REASON = "the held-out eval's responses call the search tool at different turns"
    result_tag = INFO_TAG  # ToolUseBackend.output_ids writes <information> blocks, cut as any tool output

    def __init__(self, backend, tokenizer, cfg: RolloutConfig):
        from anabranch.rollout.tools import build_tools

        super().__init__(backend, tokenizer, build_tools(["search"], cfg.tool_timeout_s, cfg), cfg)


def with_self_search(backend, tokenizer, cfg: RolloutConfig, evaluation: bool = False):
    """``backend`` for ``rollout.self_search`` (unchanged when off). Training: the masking wrapper. ``evaluation``
    (``anabranch eval``): the sim2real tool loop when sim2real is on, else the plain backend."""
    if not cfg.self_search.enabled:
        return backend
    if evaluation:
        return Sim2RealBackend(backend, tokenizer, cfg) if cfg.self_search.sim2real else backend
    return SelfSearchBackend(backend, tokenizer, cfg)


def evaluation_backend(backend):
    """The backend the trainer's held-out eval generates with: the sim2real loop when the training backend is a
    self-search one with sim2real on, else ``backend`` itself."""
    if isinstance(backend, SelfSearchBackend) and backend.sim2real is not None:
        return backend.sim2real
    return backend


# ---------------------------------------------------------------------------------------------- config
# Settings a self-search rollout cannot take: (holds when refused, key, why).
_REFUSED = (
    (lambda c: bool(c.rollout.tools), "rollout.tools",
     "self-search means no tool during training (sim2real evaluation builds its own search tool from "
     "rollout.search_corpus); set rollout.tools=[] and, for real search at evaluation, "
     "rollout.self_search.sim2real=true"),
    (lambda c: bool(c.rollout.environment), "rollout.environment",
     "an environment episode is not a single self-search response; set rollout.environment=\"\""),
    (lambda c: c.rollout.retry_turns >= 2, "rollout.retry_turns",
     "a retry episode's feedback turns are not a single self-search response; set rollout.retry_turns=0"),
)
# Round builders (trainer/round_builders.BUILDERS) generate a training round without backend.generate, so the
# wrapper's masking never sees their rows: every one is refused, a new one too, except those whose round is plain
# sampling in any configuration self-search allows: REFUEL's pairs are two plain samples without rollout.environment
# (REBEL), which self-search refuses above. (DARS's extra samples are plain backend.generate calls: masked.)
_PLAIN_ROUND_BUILDERS = ("REFUEL",)


def _sharded_launch(cfg) -> str | None:
    """What announces sharded training (FSDP or DeepSpeed ZeRO-3) at config load, else None: the environment
    ``accelerate launch`` gives its processes, or the accelerate config file of distributed.accelerate_config.
    Unreadable or unannounced: None (SelfSearchBackend.__setattr__ still refuses the synced_gpus that
    Distributed.prepare sets under sharding, before the first step)."""
    import os

    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "ACCELERATE_USE_FSDP=true: accelerate launch with FSDP"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and \
            os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        return "ACCELERATE_DEEPSPEED_ZERO_STAGE=3: accelerate launch with DeepSpeed ZeRO-3"
    path = cfg.distributed.accelerate_config
    if not path:
        return None
    try:
        import yaml

        with open(path) as f:
            launch = yaml.safe_load(f)
    except (OSError, ValueError):  # yaml's errors are ValueErrors; a missing file is the launcher's to report
        return None
    if not isinstance(launch, dict):
        return None
    kind = str(launch.get("distributed_type", "")).upper()
    stage = (launch.get("deepspeed_config") or {}).get("zero_stage")
    if kind == "FSDP" or (kind == "DEEPSPEED" and str(stage) == "3"):
        return f"distributed.accelerate_config={path}: {'FSDP' if kind == 'FSDP' else 'DeepSpeed ZeRO-3'}"
    return None


def check_config(cfg) -> str | None:
    """The refusal's text for a self-search run that cannot work, else None (config_checks' _METHOD_CHECKS)."""
    from anabranch.trainer.round_builders import TARGETS_OVER_WHOLE_RESPONSES, enabled_builders

    for refused, key, why in _REFUSED:
        if refused(cfg):
            return f"rollout.self_search.enabled=true does not combine with {key}: {why}"
    for b in enabled_builders(cfg):
        if b.name not in _PLAIN_ROUND_BUILDERS:
            return (f"rollout.self_search.enabled=true does not combine with {b.key}: {b.name} generates the training "
                    "round its own way, outside the self-search wrapper, whose information masking would not reach "
                    f"its rows; set {b.off}")
    ss = cfg.rollout.self_search
    if ss.sim2real and (launch := _sharded_launch(cfg)) is not None:
        return (f"rollout.self_search.sim2real=true does not combine with sharded training ({launch}): the held-out "
                "eval's sim2real loop searches a different number of times on each process, while a sharded model's "
                "forwards must run in step on all of them; set rollout.self_search.sim2real=false (and evaluate with "
                "`anabranch eval` afterwards) or train with DDP (configs/accelerate/multi_gpu_ddp.yaml) or ZeRO-2")
    # A loss whose target is a distribution over whole responses: masking tokens inside a response changes it.
    if ss.mask_information and cfg.algorithm.loss in TARGETS_OVER_WHOLE_RESPONSES:
        return (f"rollout.self_search.mask_information=true is not supported for algorithm.loss={cfg.algorithm.loss}: "
                "its target is the probability of whole responses, which masking the <information> tokens out of "
                "the loss would change; choose another algorithm.loss or set mask_information=false")
    if ss.sim2real:
        from anabranch.rollout.search_tool import check_config as check_search

        check_search(cfg)  # search_top_k >= 1 and a readable rollout.search_corpus (empty: the demo corpus)
    return None


__all__ = ["SelfSearchBackend", "Sim2RealBackend", "check_config", "count_searches", "evaluation_backend",
           "information_spans", "information_token_mask", "mask_information", "with_self_search"]
