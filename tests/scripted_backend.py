"""One scripted generation backend for the turn-based rollout tests (tools, asynchronous tools, environments, retry
turns, void turns): the wrappers under test call its ``continue_ids`` once per turn, and it answers each row with the
next turn of that row's script, so a test knows every token of an episode in advance."""

from __future__ import annotations

TOOL_RESULT = "<result>"         # multi_turn.result_text's opening: one per answered tool call
USER_TURN = "<|im_start|>user"   # an environment's observation (a user message): one per finished action


class Scripted:
    """A ``continue_ids`` backend whose next turn in a row is ``turns[k]``, k = how often ``marker`` occurs in the row's
    text so far (the last turn once past the end), tokenized with ``tok`` (default: the tiny char tokenizer), cut to
    the call's budget, each token at log-prob -0.5.

    ``script``: one list of turns for every row, or ``{prompt: turns}`` for the rows whose text starts with that
    prompt. ``marker``: what closes a turn (default an environment's user message; ``TOOL_RESULT`` for tools, the
    retry feedback for retry turns). Records per call: ``calls`` (its number of sequences), ``budgets`` and ``stops``
    (its max_new and stop lists), ``seeds``, ``log`` (its rows as (prompt, k); prompt None for a list script);
    ``on_call(log)`` runs after each call (a test can release a held tool call from there)."""

    def __init__(self, script, marker: str = USER_TURN, tok=None, on_call=None):
        if tok is None:  # imported here: env_configs re-exports this class and stays light to import
            from anabranch.models.tiny import char_tokenizer

            tok = char_tokenizer()
        self.tok = tok
        self.script, self.marker, self.on_call, self.eos_ids = script, marker, on_call, [self.tok.eos_token_id]
        self.calls, self.budgets, self.stops, self.seeds, self.log = [], [], [], [], []

    def turns_of(self, text: str):
        """(prompt key or None, the row's list of turns)."""
        if not isinstance(self.script, dict):
            return None, self.script
        prompt = next(p for p in self.script if text.startswith(p))
        return prompt, self.script[prompt]

    def continue_ids(self, seqs, max_new, stop=(), greedy=False, seed=None):
        self.calls.append(len(seqs))
        self.budgets.append(list(max_new))
        self.stops.append(list(stop))
        self.seeds.append(seed)
        out, rows = [], []
        for s, budget in zip(seqs, max_new):
            text = self.tok.decode(s, skip_special_tokens=False)
            prompt, turns = self.turns_of(text)
            k = text.count(self.marker)
            rows.append((prompt, k))
            ids = self.tok(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"][:budget]
            out.append((ids, [-0.5] * len(ids)))
        self.log.append(rows)
        if self.on_call is not None:
            self.on_call(self.log)
        return out

    def generate(self, prompts, n, greedy=False, max_new_tokens=None, seed=None):
        # The wrappers under test reach the inner single-turn generate only for evaluation (retry turns: greedy or
        # an unknown prompt); a test asserts that path with this message.
        raise AssertionError("single-turn generate is for evaluation only")

    def sync_weights(self, model):
        pass
