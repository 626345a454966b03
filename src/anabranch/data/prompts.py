"""Turning a task row into the exact prompt text the model sees."""

from __future__ import annotations

from anabranch.config import ConfigError, TaskConfig


def build_prompt(row: dict, cfg: TaskConfig, tokenizer) -> str:
    """The question (plus instruction), wrapped in the tokenizer's chat template when enabled."""
    question = row["question"]
    if isinstance(question, list):  # already chat messages
        messages = list(question)
    else:
        text = f"{question} {cfg.instruction}" if cfg.instruction else str(question)
        messages = [{"role": "user", "content": text.strip()}]
    if cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    if not cfg.chat_template:
        return "\n".join(m["content"] for m in messages) + "\n"
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "the tokenizer has no chat template; set task.chat_template=false to use plain prompts, "
            "or point model.tokenizer at a tokenizer that has one"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
