"""WebAgent-R1's dynamic context compression of environment episodes (``rollout.context_compression``).

Wei, Yao, Liu, Zhang, Lu, Qiu, Yu, Xu, Zhang, Yin, Yun, Li 2025, "WebAgent-R1: Training Web Agents via End-to-End
Multi-Turn Reinforcement Learning" (arXiv 2505.16421). A web agent's observations (pages) are long, so the context
of turn j keeps the prompt, every earlier action, and in full only the last K observations; each older observation
o_k is replaced by a short stand-in õ (the same user turn around ``placeholder``):

    context_j = prompt · a_1 · õ_1 · a_2 · õ_2 · ... · a_{j−K} · o_{j−K} · ... · a_{j−1} · o_{j−1}     (K = keep_last)

(with a first observation from ``reset()`` before a_1, compressed like the others). The rows of an episode batch
(rollout/environments.py's TurnState) are rewritten in place when a new observation arrives, so the next turn is
sampled from the compressed context and the token budget (``rollout.max_new_tokens``) bounds that context, not the
whole history. The context each action was sampled from is recorded (``Rollout.turn_contexts``: per response, per
turn, the response-side tokens before the action), since later compressions change it: the trainer trains each turn
as its own row under exactly that context (trainer/turn_rows.py, M-GRPO). The episode's own response (what the
rewards and logs see) is the final compressed transcript.

Confirmed in the authors' released code (github.com/weizhepei/WebAgent-R1, Train/verifiers/verifiers/envs/
webarena_env.py, read, not copied): once the agent has acted on an observation it is replaced by a fixed dummy
string ("** Simplified html **"), so only the current observation is in full (K = 1, the default here), and the
action history is kept; the training script caps an episode at 15 steps (``rollout.max_env_turns``). Differences:
the released code then trains one sequence per trajectory in which every observation but the last is the dummy, so
action j is scored under a context other than the one it was sampled from (o_j in full at sampling, õ_j in training);
here each turn's row holds the exact sampling context. A truncation of older observations to their first tokens is
not offered (a first observation's text is not kept, and its template tokens cannot be cut).
"""

from __future__ import annotations

from collections import defaultdict

from anabranch.rollout.retry_turns import feedback_ids


def start_compression(backend):
    """A fresh :class:`ContextCompressor` for one episode batch of ``backend`` (an EnvironmentBackend), or None when
    ``rollout.context_compression`` is off (the environment loop then runs exactly as without this module)."""
    cc = getattr(backend.cfg, "context_compression", None)
    if cc is None or not cc.enabled:
        return None
    return ContextCompressor(cc.keep_last, cc.placeholder,
                             lambda text, eos: (feedback_ids(backend.tokenizer, backend.use_template, text)
                                                if eos is None else backend.observation_ids(text, eos)))


class ContextCompressor:
    """Per row of an episode batch: its observations' spans in the response (start, end, how it was rendered,
    whether compressed) and the context each of its turns was sampled from. ``render(text, eos)``: an observation's
    tokens (``eos`` None: a first observation, rendered whole; else the EOS the action before it ended with)."""

    def __init__(self, keep_last: int, placeholder: str, render):
        self.keep_last, self.placeholder, self.render = keep_last, placeholder, render
        self.observations: dict = defaultdict(list)  # row -> [[start, end, eos or None, compressed]]
        self.contexts: dict = defaultdict(list)      # row -> [response tokens before turn j's action]

    def before_turn(self, st, rows: list[int]) -> None:
        """Rows ``rows`` of TurnState ``st`` are about to sample their next action: record their contexts. A row's
        tokens before its first action are its first observation (``reset()``'s), registered here."""
        for i in rows:
            if not self.contexts[i] and not self.observations[i] and st.resp[i]:
                self.observations[i].append([0, len(st.resp[i]), None, False])
            self.contexts[i].append(list(st.resp[i]))

    def arrived(self, st, ep, i: int, ob: list[int], eos: int) -> None:
        """Observation ``ob`` (its tokens, about to be appended to row ``i``) arrived after an action that ended with
        ``eos``: the observations it pushes out of the last ``keep_last`` are compressed in place (the action spans
        ``ep.spans`` moved with them), then it is registered."""
        spans = self.observations[i]
        for span in spans[:max(len(spans) + 1 - self.keep_last, 0)]:
            if not span[3]:
                self._compress(st, ep, i, span)
        start = len(st.resp[i])
        spans.append([start, start + len(ob), eos, False])

    def _compress(self, st, ep, i: int, span: list) -> None:
        start, end = span[0], span[1]
        new = list(self.render(self.placeholder, span[2]))
        shift = len(new) - (end - start)
        st.resp[i][start:end] = new
        st.trained[i][start:end] = [0] * len(new)
        st.logps[i][start:end] = [0.0] * len(new)
        span[1], span[3] = start + len(new), True
        for other in self.observations[i]:
            if other[0] >= end:
                other[0], other[1] = other[0] + shift, other[1] + shift
        ep.spans[i] = [(b + shift, e + shift) if b >= end else (b, e) for b, e in ep.spans[i]]

    def turn_contexts(self, order: list[int]) -> list[list[list[int]]]:
        """Per row of ``order``, per turn, the response-side context its action was sampled from."""
        return [[list(c) for c in self.contexts[r]] for r in order]
