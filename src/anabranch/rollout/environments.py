"""Stateful multi-turn text environments (``rollout.environment``): the policy acts, the environment answers.

An environment is an object made per trajectory from its task row, ``cls.from_row(row)`` (a plain
``cls(row)`` when the class has no ``from_row``), with

- ``reset()`` (optional): called once before the first action; returns None (the prompt is the first observation)
  or a string, the first observation, put after the prompt as an observation (below) before the first action: the
  chat template's user turn, which closes the assistant turn the prompt opened (an empty assistant message, then
  the user's observation, then the assistant header). Anything else is refused at the first episode;
- ``step(action_text) -> (observation_text, reward, done)``: the policy's action (its turn's text, without
  the EOS) applied; ``reward`` is the step reward r_t; ``done`` ends the episode;
- ``state_key()``: a hashable key of the environment's *state* before an action (not the whole history:
  GiGPO's anchor states, algorithms/gigpo.py, group the steps of a prompt's trajectories on it);
- optionally ``solved`` (a bool attribute): whether the episode reached its goal (the ``env_solved`` reward).

``rollout.environment`` names a built-in (:data:`anabranch.rollout.env_games.BUILT_IN`: ``number_guess``)
or ``package.module:Class``. With it every backend with ``continue_ids`` (hf, vllm) is wrapped in
:class:`EnvironmentBackend`. As with retry turns (rollout/retry_turns.py) one response is the whole
episode, in one sequence:

    action_1 EOS · observation_1 · action_2 EOS · observation_2 · ... · action_k EOS

``observation`` is the chat template's rendering of a user message holding the environment's text
(:func:`anabranch.rollout.retry_turns.feedback_ids`; ``"\\n\\n" + text + "\\n\\n"`` without a template). It is
context, not action: ``response_mask`` 1, ``loss_mask`` 0. An episode ends when the environment says done,
after ``rollout.max_env_turns`` actions, when an action has no EOS within the token budget (that action is
still applied), or when the next observation does not fit in the budget. Only the first is the episode's own
end: the other three cut it, so the response is marked ``truncated`` (what overlong filtering and shaping
read), as a single-turn response cut by the token budget is. Evaluation calls, greedy or sampled (the
trainer's and ``anabranch eval``'s, which wraps its backend as the trainer does), play the same episodes, so
held-out accuracy is the solved fraction.

The rollout records, per response, each turn's ``(state_key, step reward)`` (``Rollout.env_turns``) and its action
text (``Rollout.env_actions``: what ``step`` got; HiPER's ``segments=tags`` reads it); turn t's tokens are the t-th
maximal run of trained tokens (``algorithms/turn_spans.turn_index``). The rewards:

- ``env_return``: the episode's return Σ_t r_t;
- ``env_solved`` (a correctness reward: the trainer's right/wrong and held-out accuracy): 1 when the episode
  ended ``solved`` (for an environment without that attribute: when it ended done with a positive return).

Reward functions see only prompts and completion texts, so the wrapper keeps every episode's result in a
bounded in-process ledger keyed by (prompt, completion), which these two read (registered ``in_process``:
they run on a thread of the process that played the episodes: the trainer's, or ``anabranch eval``'s).
Outside such a process they find nothing and fail, said in the error. The completion text holds the actions
and the observations, so two episodes with one key took the same actions and saw the same answers; a
deterministic environment (as ``number_guess``) then gave them the same result. A stochastic one may not (a
hidden draw that no observation shows), so the episodes of one generate call that share a key share the
*mean* of their returns and of their solved flags (:func:`record_call`): the two rows are one token sequence,
whose policy-gradient term is the sum of their rewards, which the mean keeps; ``env_solved`` can then be a
fraction (below a correctness threshold of 1). A later call's episode with the same key replaces the entry
(the earlier one was scored right after its call). Write environments whose results the observations show,
or that are deterministic given the task row, to avoid the mean.

Metrics (``env/...``): ``turns_mean`` (actions per episode), ``return_mean``, ``solved_frac``,
``obs_token_frac`` (share of response tokens that are observations) and ``repeated_state_frac`` (share of
steps whose state another step of the same prompt's group also stands in: what GiGPO's anchors can use).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from anabranch.config import ConfigError, RolloutConfig
from anabranch.registry import load_object
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import BackendWrapper, Rollout, cut_at_eos, field_of_all, turns_rollout
from anabranch.rollout.context_compression import start_compression
from anabranch.rollout.retry_turns import feedback_ids

LEDGER_SIZE = 200_000  # episodes remembered for the rewards (oldest dropped): far more than a step's
_LEDGER: "OrderedDict[tuple[str, str], tuple[float, float]]" = OrderedDict()


def environment_class(name: str):
    """The environment class ``rollout.environment`` names (a built-in or ``package.module:Class``)."""
    from anabranch.rollout.env_games import BUILT_IN

    if name in BUILT_IN:
        return BUILT_IN[name]
    if ":" not in name:
        raise ConfigError(f"rollout.environment={name!r}: not a built-in environment ({', '.join(sorted(BUILT_IN))}) "
                          "nor package.module:Class")
    try:
        cls = load_object(name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"rollout.environment={name!r}: {exc}") from None
    missing = [m for m in ("step", "state_key") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"rollout.environment={name!r}: the class has no {', '.join(missing)} method")
    return cls


def make_env(cls, row: dict):
    return cls.from_row(row) if hasattr(cls, "from_row") else cls(row)


def initial_observation(env) -> str | None:
    """``env.reset()``'s first observation: None (no reset method, or it returned None or ""), else its string; any
    other return is a RuntimeError (at the first episode, since reset runs only there)."""
    if getattr(env, "reset", None) is None:
        return None
    obs = env.reset()
    if obs is None or obs == "":
        return None
    if not isinstance(obs, str):
        raise RuntimeError(f"rollout.environment: reset() must return a string or None (the first observation, or "
                           f"none beyond the prompt), got {type(obs).__name__}: {obs!r:.80}")
    return obs


def record(prompt: str, completion: str, episode_return: float, solved: float) -> None:
    _LEDGER[(prompt, completion)] = (float(episode_return), float(solved))
    _LEDGER.move_to_end((prompt, completion))
    while len(_LEDGER) > LEDGER_SIZE:
        _LEDGER.popitem(last=False)


def record_call(prompts: list[str], completions: list[str], returns: list[float], solved: list[bool]) -> None:
    """One generate call's episodes into the ledger; episodes sharing (prompt, completion) get the mean of their
    returns and solved flags (the module docstring says why), so no episode's result overwrites another's."""
    sums: dict = {}
    for key in zip(prompts, completions, strict=True):
        sums.setdefault(key, [0.0, 0.0, 0])
    for key, ret, ok in zip(zip(prompts, completions), returns, solved, strict=True):
        acc = sums[key]
        acc[0], acc[1], acc[2] = acc[0] + float(ret), acc[1] + float(ok), acc[2] + 1
    for (p, c), (ret, ok, count) in sums.items():
        record(p, c, ret / count, ok / count)


def _lookup(prompts, completions) -> list[tuple[float, bool]]:
    out = []
    for p, c in zip(prompts, completions):
        if (p, c) not in _LEDGER:
            raise ValueError("the env_return / env_solved rewards read the episodes an environment rollout played "
                             "(rollout.environment); this completion was not played by one in this process")
        out.append(_LEDGER[(p, c)])
    return out


@REWARDS.register("env_return", in_process=True, needs_episode=True)
def env_return_reward(prompts, completions, **_):
    """The episode's return Σ_t r_t (the environment's step rewards)."""
    return [r for r, _ in _lookup(prompts, completions)]


@REWARDS.register("env_solved", correctness=True, in_process=True, needs_episode=True)
def env_solved_reward(prompts, completions, **_):
    """1.0 when the episode reached the environment's goal, else 0.0."""
    return [float(s) for _, s in _lookup(prompts, completions)]


class EnvironmentBackend(BackendWrapper):
    """Episodes of ``rollout.environment`` over a backend that offers ``continue_ids``."""

    KEY = "rollout.environment"
    SHARDED_REASON = "episodes end at different turns"

    def __init__(self, backend, tokenizer, cfg: RolloutConfig, rows_by_prompt: dict, use_template: bool = True,
                 env_class=None):
        super().__init__(backend, tokenizer=tokenizer, cfg=cfg, rows=dict(rows_by_prompt), use_template=use_template,
                         env_class=env_class if env_class is not None else environment_class(cfg.environment))

    def observation_ids(self, text: str, eos: int) -> list[int]:
        """The user turn holding ``text``; the template's leading end-of-turn token is the EOS the policy wrote."""
        ids = feedback_ids(self.tokenizer, self.use_template, text)
        return ids[1:] if ids and ids[0] == eos else ids

    def generate(self, prompts: list[str], n: int, greedy: bool = False,
                 max_new_tokens: int | None = None, seed: int | None = None) -> Rollout:
        budget = max_new_tokens or self.cfg.max_new_tokens
        enc, st, ep = self.start_episodes(prompts, n, budget)
        self.play(st, ep, list(range(len(ep.envs))), budget, greedy, seed)
        return self.episodes_rollout(prompts, enc, n, st, ep)

    # The three steps of an episode batch, shared with REFUEL's pairs (trainer/refuel_rollouts.py), which rolls in,
    # copies prefixes into new rows and plays those on with the same loop.

    def start_episodes(self, prompts: list[str], n: int, budget: int):
        """(prompt tokens, TurnState, Episodes) of ``n`` adjacent rows per prompt, each with its environment made from
        its prompt's task row and ``reset()``'s first observation, if any, already in its response."""
        missing = [p for p in prompts if p not in self.rows]
        if missing:
            raise RuntimeError(f"rollout.environment: {len(missing)} prompt(s) are not task rows of this run, so no "
                               f"environment can be made for them (first: {missing[0][:80]!r})")
        from anabranch.rollout.multi_turn import TurnState  # here: rewards -> this module -> multi_turn -> rewards

        enc = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        st = TurnState.start([list(enc[g]) for g in range(len(prompts)) for _ in range(n)], [])
        ep = Episodes(compression=start_compression(self))  # WebAgent-R1's compressor, None when off
        for g in range(len(prompts)):
            for _ in range(n):
                ep.add(make_env(self.env_class, self.rows[prompts[g]]))
        for i, env in enumerate(ep.envs):
            self.add_first_observation(st, i, env, budget)
        return enc, st, ep

    def add_first_observation(self, st, i: int, env, budget: int) -> None:
        """``env.reset()``'s first observation, when it gives one, as context on row ``i`` before its first action."""
        if (first := initial_observation(env)) is None:
            return
        ob = feedback_ids(self.tokenizer, self.use_template, first)  # whole: it closes the turn the prompt opened
        if len(ob) >= budget:
            raise RuntimeError(f"rollout.environment: reset()'s first observation is {len(ob)} tokens, which leaves no "
                               f"room for an action in the {budget}-token budget; raise rollout.max_new_tokens (and "
                               "trainer.eval_max_new_tokens) or shorten it")
        st.add_context(i, ob)

    def play(self, st, ep: "Episodes", active: list[int], budget: int, greedy: bool = False,
             seed: int | None = None) -> None:
        """Play rows ``active`` of ``st`` to their episodes' ends, from wherever each stands (its prompt, or a prefix
        of turns), recording each turn in ``ep``."""
        tok, resp, turn = self.tokenizer, st.resp, 0
        while active:
            if ep.compression is not None:  # the contexts these actions are sampled from (trainer/turn_rows.py)
                ep.compression.before_turn(st, active)
            got = st.continue_active(self.inner, active, budget, [], greedy, seed, turn)
            still = []
            for i, (ids, lps) in zip(active, got):
                ids, ended = cut_at_eos(list(ids), self.eos_ids)  # a backend may pad past EOS
                key = ep.envs[i].state_key()
                text = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=True)
                obs, reward, ep.done[i] = ep.envs[i].step(text)
                ep.turns[i].append((key, float(reward)))
                ep.actions[i].append(text)
                start = len(resp[i])
                st.add_sampled(i, ids, lps)
                ep.spans[i].append((start, len(resp[i])))
                if ep.done[i]:
                    continue
                go_on = ended and len(ep.turns[i]) < self.cfg.max_env_turns  # no EOS: the budget ran out
                ob = self.observation_ids(str(obs), ids[-1]) if go_on else []
                if go_on and ep.compression is not None:  # older observations replaced (rollout/context_compression.py)
                    ep.compression.arrived(st, ep, i, ob, ids[-1])
                if not go_on or len(resp[i]) + len(ob) >= budget:  # or no room for the observation and one token
                    ep.cut[i] = True  # stopped by a limit before the environment said done: truncated
                    continue
                st.add_context(i, ob)
                still.append(i)
            active = still
            turn += 1

    def episodes_rollout(self, prompts: list[str], enc, n: int, st, ep: "Episodes", order: list[int] | None = None,
                         masks: list[list[int]] | None = None, extra_metrics: dict | None = None) -> Rollout:
        """The Rollout of rows ``order`` of ``st`` / ``ep`` (default: all), ``n`` adjacent ones per prompt, with loss
        masks ``masks`` (default: every sampled token); their episodes put in the rewards' ledger and the ``env/...``
        metrics (with ``extra_metrics``) taken over them."""
        order = list(range(len(ep.envs))) if order is None else order
        rows, resp = len(order), [st.resp[r] for r in order]
        turns = [ep.turns[r] for r in order]
        returns = [sum(x for _, x in t) for t in turns]
        # Observations: the tokens outside every action (a copied prefix's actions are actions, even untrained).
        obs_tokens = sum(len(st.resp[r]) - sum(e - b for b, e in ep.spans[r]) for r in order)
        metrics = {"env/turns_mean": sum(len(t) for t in turns) / rows, "env/return_mean": sum(returns) / rows,
                   "env/obs_token_frac": obs_tokens / max(sum(len(r) for r in resp), 1),
                   "env/repeated_state_frac": repeated_state_fraction(turns, n), **(extra_metrics or {})}
        ro = turns_rollout(self.tokenizer, self.eos_ids[0], prompts, enc, n, resp,
                           [st.trained[r] for r in order] if masks is None else masks,
                           [st.logps[r] for r in order] if st.has_logps else None, [ep.cut[r] for r in order],
                           metrics, env_turns=[tuple(t) for t in turns],
                           env_actions=[list(ep.actions[r]) for r in order],
                           **({} if ep.compression is None else {"turn_contexts": ep.compression.turn_contexts(order)}))
        flags = [getattr(ep.envs[r], "solved", None) for r in order]  # without it: ended done with a positive return
        solved = [bool(f) if f is not None else ep.done[r] and ret > 0 for r, f, ret in zip(order, flags, returns)]
        record_call([prompts[k // n] for k in range(rows)], ro.completions, returns, solved)
        ro.metrics["env/solved_frac"] = sum(solved) / rows  # each episode's own flag, not the ledger's mean
        return ro


@dataclass
class Episodes:
    """Per row of a TurnState (rollout/multi_turn.py), its episode so far: its environment, each turn's (state key
    before the action, step reward), action text and (start, end) of its sampled tokens in the response, whether the
    environment said done, and whether a limit cut it before that (truncated)."""

    envs: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    done: list = field(default_factory=list)
    cut: list = field(default_factory=list)
    compression: object = None  # rollout.context_compression's ContextCompressor of this batch, None when off

    def add(self, env, turns=(), actions=(), spans=()) -> None:
        """A new row's episode, its first turns given (a prefix copied from another row) or none."""
        self.envs.append(env)
        self.turns.append(list(turns))
        self.actions.append(list(actions))
        self.spans.append(list(spans))
        self.done.append(False)
        self.cut.append(False)


def repeated_state_fraction(turns: list[list[tuple]], n: int) -> float:
    """The share of steps whose state key another step of the same group (``n`` adjacent rows) stands in too."""
    from collections import Counter

    repeated = total = 0
    for g in range(0, len(turns), n):
        counts = Counter(key for t in turns[g:g + n] for key, _ in t)
        repeated += sum(c for c in counts.values() if c > 1)
        total += sum(counts.values())
    return repeated / max(total, 1)


def concat_env_turns(parts: list, what: str = "environment turns (Rollout.env_turns)") -> list | None:
    """The rounds' ``Rollout.env_turns`` (or ``env_actions``, named by ``what``) joined (collect.concat_batches); None
    when no round has them. A mix is an error: the rows without them would have no turns for GiGPO, silently."""
    turns = field_of_all(parts, f"some rounds carry {what} and others not; rows added to a batch under "
                                "rollout.environment must come from its backend too")
    return None if turns is None else [t for p in turns for t in p]


def rows_table(rows: list, prompts: list[str]) -> dict:
    """{prompt text: its task row}; a ConfigError when one prompt text is two different games (rows that differ)."""
    table: dict = {}
    for i, (p, r) in enumerate(zip(prompts, rows)):
        if table.setdefault(p, r) is not r and table[p] != r:
            raise ConfigError(f"rollout.environment makes each episode's environment from the task row of its prompt "
                              f"text, and row {i + 1}'s prompt is also an earlier, different row's: give each game "
                              "its own prompt text (e.g. name the game in the question)")
    return table


def check_config(cfg) -> None:
    """Combinations ``rollout.environment`` cannot take, refused at config load (called when it is set or an env_*
    reward is named)."""
    from anabranch.rollout.retry_turns import reward_entries
    from anabranch.trainer.method_sets import row_generating_methods

    r, a = cfg.rollout, cfg.algorithm
    names = [name for name, _ in reward_entries(cfg)]
    env_rewards = [n for n in names if n in ("env_return", "env_solved")]
    if not r.environment:
        if env_rewards:
            raise ConfigError(f"reward.functions: {env_rewards[0]} reads the episodes of rollout.environment; set "
                              "rollout.environment=NAME or remove it")
        return
    environment_class(r.environment)
    for on, what in ((bool(r.tools), "rollout.tools (set rollout.tools=[])"),
                     (r.retry_turns >= 2, "rollout.retry_turns >= 2 (set rollout.retry_turns=0)"),
                     (r.extra_rollouts == "cure", "rollout.extra_rollouts=cure: its branches re-generate single-turn "
                      "responses from a token inside them"),
                     (r.min_new_tokens > 0, "rollout.min_new_tokens > 0: an action must be able to end early"),
                     # SvS refuses an environment in its own check (algorithms/svs.py); Agent-RLVR is not refused here (as before)
                     *((True, f"{key}: its rows (hinted prompts, teachers' responses, rewrites) are not episodes of "
                        "the environment") for key in row_generating_methods(cfg)
                       if key not in ("algorithm.svs.enabled", "algorithm.agent_rlvr.enabled")),
                     (a.srpo_coef > 0, "algorithm.srpo_coef > 0: its feedback is built from whole episodes"),
                     (a.spae_coef > 0, "algorithm.spae_coef > 0: its probes cut responses at text delimiters")):
        if on:
            raise ConfigError(f"rollout.environment does not combine with {what}")
    if not env_rewards:
        raise ConfigError("rollout.environment: reward.functions has neither env_return nor env_solved, so the "
                          "environment's rewards would be ignored; add {name: env_return} (and env_solved, weight 0, "
                          "for accuracy)")


def environment_table(cfg, rows: list, prompts: list[str]) -> dict | None:
    """Before the model loads: {prompt text: task row} of every task row (training and held-out), each row's
    environment made once to check it can be (a ConfigError if not); None when ``rollout.environment`` is unset."""
    if not cfg.rollout.environment:
        return None
    table, cls = rows_table(rows, prompts), environment_class(cfg.rollout.environment)
    for prompt, row in table.items():
        try:
            make_env(cls, row)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"rollout.environment={cfg.rollout.environment!r} cannot be made from the task row of "
                              f"prompt {prompt[:60]!r}: {exc}") from None
    return table


def with_environment(backend, tokenizer, cfg, table: dict | None):
    """``backend`` wrapped for ``rollout.environment`` (unchanged when ``table``, :func:`environment_table`'s, is
    None): each episode's environment is made from the task row of its prompt text."""
    if table is None:
        return backend
    return EnvironmentBackend(backend, tokenizer, cfg.rollout, table, use_template=cfg.task.chat_template)
