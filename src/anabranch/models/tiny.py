"""Tiny random-weight models and a character tokenizer, built locally for tests and benchmarks
(nothing is downloaded)."""

from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer(chat_template: bool = True):
    """A character-level fast tokenizer with a ChatML template (vocabulary of ~100)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(string.digits + string.ascii_letters + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", unk_token="?",
                                  additional_special_tokens=["<|im_start|>"])
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(path: str | Path, tokenizer=None, arch: str = "llama", hidden: int = 64,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                     seed: int = 0) -> Path:
    """Save a random ``arch`` causal LM with ``tokenizer`` (default: :func:`char_tokenizer`) to ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
    config = AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    path = Path(path)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
