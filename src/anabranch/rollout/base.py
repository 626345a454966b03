"""What a rollout backend returns, and the registry of backends.

A backend is built as ``ROLLOUT_BACKENDS[name](model, tokenizer, rollout_cfg)`` and offers
``generate(prompts, n, greedy=False, max_new_tokens=None, seed=None) -> Rollout`` and
``sync_weights(model)`` (called after each optimizer step; a no-op when the backend samples
from the training model itself). ``seed``: the same call with the same seed and weights gives the
same tokens (None: the process's generators, whose state the trainer seeds).

Both backends return the same layout: ``n`` adjacent rows per prompt (``group_index`` 0,0,..,1,1,..),
prompts left-padded, responses right-padded with the tokenizer's pad id (which may equal EOS, as
SmolLM2's does: only ``response_mask`` tells them apart), the mask covering the generated tokens
through the first EOS inclusive (the loss trains the model to stop), and ``completions`` the decoded
masked tokens without special tokens.

A multi-turn rollout with tools (:mod:`anabranch.rollout.multi_turn`) puts the tools' outputs inside
the response: ``response_mask`` then covers them too (they are context the model reads), and
``loss_mask`` marks the tokens the policy sampled; :attr:`Rollout.trained_mask` is what the loss,
the advantages and the metrics are taken over.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from anabranch.registry import Registry

ROLLOUT_BACKENDS: Registry = Registry("rollout backend")


@contextlib.contextmanager
def seeded_torch(seed: int | None, device: torch.device | None = None):
    """Seed torch's generators (CPU, and ``device``'s when it is a GPU) for the block, then put the
    caller's states back (a forked state); nothing changes when ``seed`` is None. Both backends'
    ``generate(seed=...)`` draw their samples inside it."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device is not None and device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@dataclass
class Rollout:
    prompt_ids: torch.Tensor        # [B, P] left-padded
    prompt_mask: torch.Tensor       # [B, P]
    response_ids: torch.Tensor      # [B, R] right-padded after EOS
    response_mask: torch.Tensor     # [B, R] 1 for generated tokens up to and including EOS
    group_index: torch.Tensor       # [B] which prompt each sequence answers
    prompts: list                   # [num_prompts] prompt texts
    completions: list               # [B] decoded response texts
    truncated: torch.Tensor         # [B] bool: hit max_new_tokens without EOS
    sample_log_probs: Optional[torch.Tensor] = None  # [B, R] from the sampler, when it gives them
    # [B, R] 1 where the policy sampled the token, 0 on tool outputs inserted into the response;
    # None: every response token was sampled (single-turn).
    loss_mask: Optional[torch.Tensor] = None
    # [B, K] each attempt's outcome in a "Try again" episode (rollout.retry_turns=K): 1 right, 0 wrong,
    # -1 not made; the per-turn rewards of algorithm.advantage=trloo. None: not a multi-attempt rollout.
    attempt_correct: Optional[torch.Tensor] = None
    # [B, R] process (step) rewards added to the token-level rewards: PRM-Clip/Delta's α·r_k at each step's
    # end token (reward.prm_shaping, algorithms/prm_shaping.py). None: no process rewards (the default).
    process_rewards: Optional[torch.Tensor] = None
    # [B] per response, each turn's (environment state key before the action, step reward) in an episode of
    # rollout.environment (rollout/environments.py; GiGPO's anchor states). None: not an environment rollout.
    env_turns: Optional[list] = None
    # [B] per response, each of those turns' action text (what the environment's step() got; HiPER's segments=tags
    # reads its <switch> tags). None: not an environment rollout.
    env_actions: Optional[list[list[str]]] = None
    # [B] per response, each turn's context (the response-side tokens its action was sampled from) under
    # rollout.context_compression (rollout/context_compression.py; trainer/turn_rows.py: a row per turn). None: off.
    turn_contexts: Optional[list] = None
    # [B] per response, ARPO's tree segments (segment id, start, end) covering its response tokens; rows holding
    # the same id share those tokens (a prefix up to a branch point). rollout.arpo.attribution=hard only
    # (rollout/arpo_branching.py, algorithms/arpo.py). None: the rows share nothing by construction (the default).
    branch_segments: Optional[list] = None
    # [B, 3] per response, ROSE's tree (leaf slot, parent slot or −1, branch position) within its prompt's tree
    # (rollout.semantic_tree, rollout/semantic_tree.py; algorithms/rose.py). None: not a tree rollout.
    semantic_tree: Optional[torch.Tensor] = None
    # [B, R] per response token, DeepSearch's node value of the tree step holding it (rollout.mcts,
    # rollout/mcts_search.py; algorithms/deepsearch.py). None: not a search-tree rollout.
    mcts_values: Optional[torch.Tensor] = None
    metrics: dict = field(default_factory=dict)  # the rollout's own metrics (tool calls, ...)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.to(self.prompt_mask.dtype)], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, R] the response tokens the policy sampled: the loss, advantages and metrics' mask."""
        if self.loss_mask is None:
            return self.response_mask
        return self.response_mask * self.loss_mask.to(self.response_mask.dtype)

    def prompt_tokens(self, i: int) -> list[int]:
        """Row ``i``'s prompt tokens without its left padding (to build a new context after it)."""
        return self.prompt_ids[i][self.prompt_mask[i].bool()].tolist()

    def response_tokens(self, i: int) -> list[int]:
        """Row ``i``'s response tokens as sampled (through its EOS when it wrote one), without the padding."""
        return self.response_ids[i][self.response_mask[i].bool()].tolist()

    def take(self, rows) -> "Rollout":
        """The sequences ``rows`` (indices, in that order, repeats allowed): every per-row field sliced,
        whatever fields the class holds (tensors on dim 0, lists picked, None kept), so that a new field
        cannot be dropped by a caller that forgets it. ``group_index`` keeps its numbers and ``prompts``
        (one per group) and ``metrics`` are copied whole: callers that renumber groups set both after."""
        keep = [int(i) for i in rows]
        sel = torch.tensor(keep, dtype=torch.long)
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in NOT_PER_ROW:
                v = type(v)(v)
            elif isinstance(v, torch.Tensor):
                v = v[sel]
            elif isinstance(v, list):
                v = [v[i] for i in keep]
            elif v is not None:
                raise TypeError(f"Rollout.{f.name}: take() does not know how to slice a {type(v).__name__}")
            out[f.name] = v
        return Rollout(**out)


# Rollout fields that are not one entry per sequence: take() copies them whole.
NOT_PER_ROW = frozenset({"prompts", "metrics"})


def first_rows(group_index: torch.Tensor) -> dict[int, int]:
    """{group: index of its first row}, in ascending group order (``group_index.unique()``'s): where the
    methods that need one thing per prompt (its dataset row, its prompt tokens) read it, since every row of
    a group answers the same prompt. One pass over the rows, not one comparison per group."""
    first: dict[int, int] = {}
    for i, g in enumerate(group_index.tolist()):
        first.setdefault(int(g), i)
    return dict(sorted(first.items()))


def field_of_all(parts: list, mix: str) -> list | None:
    """``parts`` (one round's optional field each, for collect.concat_batches) when every round has it, None when
    none does. A mix is an error (``ValueError("concat_batches: " + mix)``): the rows of the rounds without it
    would silently lack what the method reads from it (tree values, tree rows, environment turns)."""
    have = [p is not None for p in parts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"concat_batches: {mix}")
    return parts


def left_padded(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each [len(sequences), longest], the sequences padded on the left with
    ``pad``: every row's next token is at the same column (prompts, and continuations of responses)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
    return ids, mask


class BackendWrapper:
    """A rollout backend that generates in turns over an ``inner`` one offering ``continue_ids`` (tool
    turns, retry turns). Options the trainer sets on whatever it holds (``share_prompt_prefix``, ...)
    are the inner backend's, so attributes read and written here go through to it; ``synced_gpus``
    (sharded training) is refused with ``SHARDED_REASON``, because responses end at different turns and
    the processes would run different numbers of generate calls while their forwards must stay in step."""

    KEY = ""             # the config key that turns the wrapper on, for the errors
    SHARDED_REASON = ""  # why its turns differ between processes

    def __init__(self, backend, **fields):
        if not hasattr(backend, "continue_ids"):
            from anabranch.config import ConfigError

            raise ConfigError(f"{self.KEY}: the {type(backend).__name__} backend cannot continue a response "
                              "in a new turn (no continue_ids)")
        self.__dict__["inner"] = backend  # set directly: __setattr__ forwards to the inner backend
        self.__dict__.update(eos_ids=list(backend.eos_ids), **fields)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name, value):
        if name == "synced_gpus" and value:
            from anabranch.config import ConfigError

            raise ConfigError(f"{self.KEY} does not combine with sharded training (FSDP / ZeRO-3): "
                              f"{self.SHARDED_REASON}, so the processes would run different numbers of generate "
                              "calls while their forward passes must stay in step")
        setattr(self.inner, name, value)

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)


def innermost(backend, cls=None):
    """``backend`` with its :class:`BackendWrapper` layers taken off: down to the first instance of ``cls`` when
    given (e.g. the tool backend inside a retry wrapper; the innermost backend when none is one), else to the
    plain backend that generates single turns."""
    while not (cls is not None and isinstance(backend, cls)) and isinstance(backend, BackendWrapper):
        backend = backend.inner
    return backend


def right_padded(sequences: list[list[int]], pad: int, min_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each [len(sequences), width], the sequences padded on the right with ``pad``: the
    counterpart of :func:`left_padded` for what follows a prompt (responses, targets). ``width`` is the
    longest sequence, at least ``min_width`` (default 1: a batch of empty responses still has a column)."""
    width = max([min_width] + [len(s) for s in sequences])
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[i, :len(seq)] = 1
    return ids, mask


def right_padded_values(values: list[list[float]], width: int, fill: float = 0.0,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(values), width] of ``dtype``, row i ``values[i]`` then ``fill``: per-token floats (log-probs,
    advantages) aligned with :func:`right_padded`'s ids of the same rows (each ``values[i]`` at most ``width``
    long), or any ragged per-row table."""
    out = torch.full((len(values), width), float(fill), dtype=dtype)
    for i, v in enumerate(values):
        if v:
            out[i, :len(v)] = torch.tensor(v, dtype=dtype)
    return out


def pad_id(tokenizer, fallback: int | None = None) -> int | None:
    """The tokenizer's pad id, else ``fallback`` (callers pass their EOS: padding is masked out anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fallback


def cut_at_eos(ids: list[int], eos_ids) -> tuple[list[int], bool]:
    """(``ids`` through the first token in ``eos_ids``, inclusive; whether there was one). Without one,
    ``ids`` whole: a backend may overshoot past EOS (padding), and the loss trains the stop token."""
    for k, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[:k + 1], True
    return ids, False


def response_mask_from_eos(response_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask through the first EOS (inclusive); rows with no EOS are truncated."""
    is_eos = torch.zeros_like(response_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= response_ids == e
    # Number of EOS tokens strictly before each position.
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (before == 0).long()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def turns_rollout(tok, eos: int, prompts: list[str], enc: list[list[int]], n: int, resp: list[list[int]],
                  trained: list[list[int]], logps: list[list[float]] | None, truncated: list[bool], metrics: dict,
                  **fields) -> Rollout:
    """The Rollout of a turn-based backend (tools, retry turns, environments): ``n`` adjacent rows per prompt of
    ``enc`` (its prompts' tokens, left-padded as the backends give them), row i's response ``resp[i]`` right-padded
    with ``loss_mask`` ``trained[i]`` (1 sampled, 0 context; as long as ``resp[i]``), ``logps[i]`` the sampler's
    log-probs (None: some turn had none), ``completions`` decoded; ``fields``: the backend's own Rollout fields."""
    pad = pad_id(tok, eos)
    prompt_ids, prompt_mask = left_padded(enc, pad)
    response_ids, response_mask = right_padded(resp, pad)
    loss_mask = right_padded(trained, 0)[0]  # trained[i] is as long as resp[i]: the same width
    # logps[i] is as long as resp[i]: the same width
    sample_lp = None if logps is None else right_padded_values(logps, response_ids.shape[1])
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0), prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
        response_ids=response_ids, response_mask=response_mask,
        group_index=torch.arange(len(prompts)).repeat_interleave(n), prompts=list(prompts),
        completions=[tok.decode(r, skip_special_tokens=True) for r in resp],
        truncated=torch.tensor(list(truncated), dtype=torch.bool), sample_log_probs=sample_lp,
        loss_mask=loss_mask, metrics=metrics, **fields)


def leaves_rollout(tok, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor,
                   paths: list[list[int]], ended: list[bool], prompts: list[str], **fields) -> Rollout:
    """The Rollout of a search tree's leaves (DeepSearch's MCTS, ROSE's semantic tree): row i is its prompt row
    ``prompt_ids[i]``/``prompt_mask[i]`` (left-padded, group ``group_index[i]``) and the whole root-to-leaf path
    ``paths[i]`` as its response, right-padded with the pad id (else 0), truncated unless ``ended[i]``, decoded into
    ``completions``; ``fields``: the method's own Rollout fields (its tree's values or layout, metrics)."""
    response_ids, response_mask = right_padded(paths, pad_id(tok, 0))
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, group_index=group_index, prompts=list(prompts),
                   completions=[tok.decode(p, skip_special_tokens=True) for p in paths],
                   truncated=torch.tensor([not e for e in ended], dtype=torch.bool), **fields)
