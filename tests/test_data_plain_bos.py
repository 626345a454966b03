"""Plain prompts (task.chat_template=false) carry the BOS token when the tokenizer puts one before
every text, since every later tokenization runs without special tokens."""

from anabranch.config import ModelConfig, TaskConfig
from anabranch.data.prompts import bos_prefix, build_prompt
from anabranch.models.loading import load_tokenizer


class BosTokenizer:
    """A Llama-like tokenizer: BOS id 1 first when special tokens are added; "<s>" in text is BOS."""

    bos_token, bos_token_id, chat_template = "<s>", 1, None

    def __call__(self, text, add_special_tokens=True):
        ids = [1] if add_special_tokens else []
        if text.startswith("<s>"):
            ids, text = ids + [1], text[3:]
        return {"input_ids": ids + [ord(c) for c in text]}


def test_plain_prompt_starts_with_the_bos_the_tokenizer_would_add():
    cfg = TaskConfig(chat_template=False, instruction="Answer briefly.")
    tok = BosTokenizer()
    prompt = build_prompt({"question": "2+3?"}, cfg, tok)
    assert prompt == "<s>2+3? Answer briefly.\n"
    # Encoded as the rollouts encode it (no special tokens): exactly one BOS, first.
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 1
    # A question that already starts with the BOS text does not get a second one.
    assert build_prompt({"question": "<s>2+3?"}, TaskConfig(chat_template=False), tok) == "<s>2+3?\n"


def test_no_bos_where_the_tokenizer_adds_none():
    tok = load_tokenizer(ModelConfig())  # the packaged SmolLM2: no BOS before a text
    assert bos_prefix(tok) == ""
    assert build_prompt({"question": "2+3?"}, TaskConfig(chat_template=False), tok) == "2+3?\n"
