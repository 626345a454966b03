"""Rollouts with ``transformers``' ``generate`` on the training model itself.

Prompts are left-padded whatever the tokenizer's ``padding_side`` (every response starts at the same
column). ``seed`` makes a call reproducible: it seeds torch's generators (forked for the call, so the
caller's are left as they were), which ``generate`` draws every sample from.

With ``rollout.temperature_schedule=ead`` (:mod:`anabranch.rollout.temperature_schedule`) sampled
rollouts draw each token at its position's temperature τ_t and return the log-probs of the tempered
distribution as ``sample_log_probs``; greedy calls (evaluation) and the constant schedule are unchanged.
"""

from __future__ import annotations

import functools

import torch

from anabranch.config import RolloutConfig
from anabranch.models.shared_prefix import shared_prompt_cache
from anabranch.rollout.base import ROLLOUT_BACKENDS, Rollout, left_padded, response_mask_from_eos, seeded_torch
from anabranch.rollout.temperature_schedule import AnnealedTemperature, make_schedule


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


# Settings a model's generation_config.json may carry (Qwen2.5-Instruct's: repetition_penalty=1.1,
# top_k=20, ...) that ``generate`` would otherwise apply on top of rollout.*: the trainer's log-probs and
# the vLLM backend know nothing of them, so the samples would come from another policy. Given here
# explicitly (``generate``'s own arguments win over the model's defaults), they change nothing.
_NEUTRAL_GENERATION = dict(
    num_beams=1, num_return_sequences=1, repetition_penalty=None, encoder_repetition_penalty=None,
    no_repeat_ngram_size=None, encoder_no_repeat_ngram_size=None, bad_words_ids=None, sequence_bias=None,
    suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
    exponential_decay_length_penalty=None, guidance_scale=None, min_length=0, min_p=None, typical_p=None,
    top_h=None, epsilon_cutoff=None, eta_cutoff=None, watermarking_config=None, stop_strings=None,
    diversity_penalty=None, renormalize_logits=False, remove_invalid_values=False,
)


@functools.lru_cache(maxsize=1)
def _neutral_generation_kwargs() -> dict:
    """:data:`_NEUTRAL_GENERATION`, restricted to the fields this transformers' GenerationConfig has
    (an unknown keyword would be passed on to the model's forward)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig()
    return {k: v for k, v in _NEUTRAL_GENERATION.items() if hasattr(defaults, k)}


@ROLLOUT_BACKENDS.register("hf")
class HFGenerateBackend:
    def __init__(self, model, tokenizer, cfg: RolloutConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.eos_ids = eos_token_ids(model, tokenizer)
        # Prefill each prompt once for its n samples (models/shared_prefix.py) where the model allows.
        self.share_prompt_prefix = True
        # EAD's schedule (None: constant temperature) and its training step s, counted in weight syncs
        # (one per optimizer step): d_s grows with it.
        self.schedule = make_schedule(cfg)
        self.schedule_step = 0

    def sync_weights(self, model) -> None:  # samples from the training model: nothing to sync
        self.model = model
        self.schedule_step += 1

    def _annealer(self, kwargs: dict, width: int, offsets: list[int]) -> AnnealedTemperature | None:
        """EAD's logits processor for one ``generate`` call that samples, else None."""
        if self.schedule is None or not kwargs["do_sample"]:
            return None
        from transformers import LogitsProcessorList

        proc = AnnealedTemperature(self.schedule, self.schedule_step, width, torch.tensor(offsets))
        kwargs["logits_processor"] = LogitsProcessorList([proc])
        return proc

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, greedy: bool = False,
                 max_new_tokens: int | None = None, seed: int | None = None) -> Rollout:
        tok = self.tokenizer
        max_new = max_new_tokens or self.cfg.max_new_tokens
        # Left padding whatever the tokenizer's padding_side: generate appends after the last column.
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        device = next(self.model.parameters()).device
        prompt_ids = enc["input_ids"].repeat_interleave(n, dim=0)
        prompt_mask = enc["attention_mask"].repeat_interleave(n, dim=0)
        group_index = torch.arange(len(prompts)).repeat_interleave(n)
        chunk = self.cfg.generation_batch_size or prompt_ids.shape[0]
        kwargs = self._generation_kwargs(greedy, max_new, min(self.cfg.min_new_tokens, max_new))
        was_training = self.model.training
        self.model.eval()
        try:
            with seeded_torch(seed, device):
                pieces, lps = self._generate_chunks(prompt_ids, prompt_mask, chunk, device, kwargs)
        finally:
            self.model.train(was_training)
        return self._rollout(pieces, prompt_ids, prompt_mask, group_index, prompts, lps)

    def _generation_kwargs(self, greedy: bool, max_new: int, min_new: int) -> dict:
        tok = self.tokenizer
        sample = not greedy and self.cfg.temperature > 0
        kwargs = dict(
            **_neutral_generation_kwargs(), do_sample=sample, max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
            eos_token_id=self.eos_ids, use_cache=True, min_new_tokens=min_new or None,
        )
        if getattr(self, "synced_gpus", False):  # set by the trainer for FSDP / ZeRO-3 (sharded weights)
            kwargs["synced_gpus"] = True
        if sample:
            kwargs.update(temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k or None)
        else:  # silence generation_config's sampling defaults
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    @torch.no_grad()
    def continue_ids(self, sequences: list[list[int]], max_new: list[int], stop: list[str] = (),
                     greedy: bool = False, seed: int | None = None) -> list[tuple[list[int], None]]:
        """Sample a continuation of each token sequence (a prompt and the response so far: the
        multi-turn rollouts' next turn, :mod:`anabranch.rollout.multi_turn`), at most ``max_new[i]``
        tokens for row ``i``, stopping early at EOS or after any of the ``stop`` strings. Returns the
        raw new tokens of each row (cut at its budget, not at EOS or a stop string: the caller cuts)
        and no sampling log-probs (the sampler is the trained model itself), except with EAD: the
        tempered log-probs, the position of a row's next token being its response length so far,
        ``rollout.max_new_tokens − max_new[i]`` (the multi-turn rollout's budget left)."""
        tok = self.tokenizer
        ids, mask = left_padded(sequences, tok.pad_token_id)
        width = ids.shape[1]
        kwargs = self._generation_kwargs(greedy, max(max_new), 0)
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=tok)
        device = next(self.model.parameters()).device
        chunk = self.cfg.generation_batch_size or len(sequences)
        pieces, lps = [], []
        was_training = self.model.training
        self.model.eval()
        try:
            with seeded_torch(seed, device):
                for start in range(0, len(sequences), chunk):
                    ead = self._annealer(kwargs, width, [max(self.cfg.max_new_tokens - m, 0)
                                                         for m in max_new[start:start + chunk]])
                    out = self.model.generate(input_ids=ids[start:start + chunk].to(device),
                                              attention_mask=mask[start:start + chunk].to(device), **kwargs)
                    pieces += out[:, width:].cpu().tolist()
                    if ead is not None:
                        lps += ead.log_probs(out[:, width:]).tolist()
        finally:
            self.model.train(was_training)
        if not lps:
            return [(row[:budget], None) for row, budget in zip(pieces, max_new)]
        return [(row[:budget], lp[:budget]) for row, lp, budget in zip(pieces, lps, max_new)]

    def _generate_chunks(self, prompt_ids, prompt_mask, chunk, device, kwargs):
        """The generated columns of each chunk, and with EAD their tempered log-probs (else None)."""
        pieces, lps = [], []
        for start in range(0, prompt_ids.shape[0], chunk):
            ids = prompt_ids[start:start + chunk].to(device)
            mask = prompt_mask[start:start + chunk].to(device)
            # The n samples of a prompt share its prefill (a KV cache computed once per prompt);
            # not under synced_gpus, where every rank must run the same forwards.
            cache = None if kwargs.get("synced_gpus") or not self.share_prompt_prefix \
                else shared_prompt_cache(self.model, ids, mask)
            ead = self._annealer(kwargs, ids.shape[1], [0] * ids.shape[0])
            out = self.model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kwargs)
            pieces.append(out[:, ids.shape[1]:].cpu())
            if ead is not None:
                lps.append(ead.log_probs(pieces[-1]))
        return pieces, (lps or None)

    def _rollout(self, pieces, prompt_ids, prompt_mask, group_index, prompts, lps=None) -> Rollout:
        tok = self.tokenizer
        width = max(p.shape[1] for p in pieces)
        pad = tok.pad_token_id
        response_ids = torch.cat(
            [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in pieces]
        )
        response_mask, truncated = response_mask_from_eos(response_ids, self.eos_ids)
        response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, pad))
        completions = [
            tok.decode(row[m.bool()], skip_special_tokens=True)
            for row, m in zip(response_ids, response_mask)
        ]
        sample_lp = None
        if lps is not None:  # as the vLLM backend gives them: 0 past the response
            sample_lp = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in lps])
            sample_lp = sample_lp * response_mask
        return Rollout(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_mask=response_mask, group_index=group_index, prompts=list(prompts),
            completions=completions, truncated=truncated, sample_log_probs=sample_lp,
        )
