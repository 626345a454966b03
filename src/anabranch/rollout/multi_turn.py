"""Multi-turn rollouts: the policy calls tools in the middle of its response and reads their output.

With ``rollout.tools`` set, every backend is wrapped in :class:`ToolUseBackend`. A response is
generated in turns. The policy calls a tool by writing ``<name>input</name>``
(:mod:`anabranch.rollout.tools`); its turn ends right after the closing tag, the tool runs on
``input``, and the output is appended to the response as the tokens of
``"\\n<result>\\noutput\\n</result>\\n"``; then the policy continues from there, until it writes
EOS, the response reaches ``rollout.max_new_tokens`` (tool outputs count: the budget bounds the
sequence the trainer runs), or it has made ``rollout.max_tool_calls`` calls. A call past that
limit gets ``error: no tool calls left`` and one last turn without tools.

This is the tool-integrated reasoning setup of ToRL (Li et al. 2025, "ToRL: Scaling Tool-Integrated
RL") and ReTool (Feng et al. 2025): calls and results are text inside the assistant's message, so
any causal LM and chat template works, and the trainer's log-probs are of exactly the tokens the
sampler saw. Every turn continues from token ids (the backends' ``continue_ids``): nothing the
model wrote is tokenized again, and a tool's output is tokenized with its special-token strings
split (a program printing ``<|im_end|>`` cannot end the model's message).

The tool outputs are context, not actions: ``Rollout.loss_mask`` is 0 on them, so the loss, the
advantages (rewards land on the policy's last token), KL terms, entropy and the sampler-mismatch
metrics leave them out, while the model reads them in every forward pass (``response_mask`` covers
them). Masking the observation tokens out of the loss is what ToRL, ReTool and Search-R1 (Jin et
al. 2025) do. The reward functions see the whole transcript (``completions``), tool outputs included.

Metrics (``tools/...``): calls per response (``calls_mean``: every call the policy wrote, those
refused past the limit included), the fraction of responses with a call, the fraction of run calls
that returned an error, the share of response tokens that are tool output, and the calls run per
tool (``tools/<name>/calls``); ``time/tools_s``, the wall time spent waiting for tools. Under
dynamic sampling they are the last generated round's, as the reward metrics are.

``rollout.void_turn_filter`` (SimpleTIR, :mod:`anabranch.rollout.void_turns`): the trainer asks the
backend (:meth:`ToolUseBackend.filter_void_turns`) which trajectories have a turn with neither a
tool call nor a final answer, and empties their loss masks after the advantages
(``tools/void_turn_frac``).

``rollout.arpo`` (ARPO, :mod:`anabranch.rollout.arpo_branching`): the training round's rollouts (asked for by
``arpo_round`` from ``trainer/collect.generate_scored``, not by their sample count) are built by the brancher over
the same turns (:meth:`ToolUseBackend.turn` on a :class:`TurnState`), which adds rows that re-sample a response from
the end of a tool result; every ``generate`` call runs the loop below unchanged.

``rollout.async_tools`` (VerlTool, :mod:`anabranch.rollout.async_turns`): ``generate`` runs the asynchronous loop
instead, which builds each row with the same three parts of a turn (:meth:`ToolUseBackend.sample_turn`,
:meth:`~ToolUseBackend.end_turn`, :meth:`~ToolUseBackend.answer`) but lets the rows whose results are back generate
while slow calls run.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Optional

from anabranch.config import RolloutConfig, TaskConfig
from anabranch.rollout.base import BackendWrapper, Rollout, turns_rollout
from anabranch.rollout.tools import RESULT_TAG, Tool, ToolError, build_tools, tool_instructions
from anabranch.rollout.void_turns import filter_void_turns

log = logging.getLogger(__name__)

NO_CALLS_LEFT = "error: no tool calls left"
MAX_PARALLEL_CALLS = 8  # tool calls running at once (python calls are sandbox processes)


def result_text(output: str, tag: str = RESULT_TAG) -> str:
    """A tool's output as the block appended to the response (``tag``: SSRL's sim2real writes ``information``)."""
    return f"\n<{tag}>\n{output}\n</{tag}>\n"


class ToolPool:
    """Tool calls running on daemon threads, at most ``width`` at once, the others queued and started in submission
    order. A call still running ``timeout_s`` after its own start is answered with a time-out error and abandoned (a
    thread cannot be killed), which frees its slot for the calls waiting; its late answer is dropped. Daemon threads,
    so that a tool that never returns does not keep the process from exiting. The synchronous loop runs a turn's
    calls with :meth:`run_all`; the asynchronous one (rollout/async_turns.py) submits each call when its turn is
    cut and collects what is back between generation rounds (:meth:`collect`)."""

    def __init__(self, run, timeout_s: float, width: int = MAX_PARALLEL_CALLS):
        self.run, self.timeout_s, self.width = run, timeout_s, width  # run: (tool, input) -> (output, is error)
        self.waiting: deque = deque()
        self.running: dict[int, float] = {}  # call key -> deadline
        self.done: queue.SimpleQueue = queue.SimpleQueue()  # (key, result) as calls finish
        self._keys = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, tool: Tool, arg: Optional[str]) -> int:
        """Queue a call of ``tool`` on ``arg``; returns its key (its result comes back under it)."""
        key = next(self._keys)
        self.waiting.append((key, tool, arg))
        self._start()
        return key

    def run_all(self, calls: list[tuple[Tool, Optional[str]]]) -> list[tuple[str, bool]]:
        """The calls' (output, is error), in call order: all submitted, collected until none is left. On a pool
        with nothing in flight (the results of earlier calls would be taken with these)."""
        if self.busy:
            raise RuntimeError("ToolPool.run_all needs a pool with no call in flight")
        keys = [self.submit(tool, arg) for tool, arg in calls]
        got = dict(self.collect(wait_first=False, grace_s=math.inf))  # returns once nothing waits or runs
        return [got[k] for k in keys]

    def _start(self) -> None:
        while self.waiting and len(self.running) < self.width:
            key, tool, arg = self.waiting.popleft()
            threading.Thread(target=self._work, args=(key, tool, arg), daemon=True, name=f"tool-{tool.name}").start()
            self.running[key] = time.monotonic() + self.timeout_s

    def _work(self, key: int, tool: Tool, arg: Optional[str]) -> None:
        result = (f"error: {tool.name} stopped without an output", True)
        try:
            result = self.run(tool, arg)
        finally:  # also when the tool raises SystemExit, which the runner lets through
            self.done.put((key, result))

    def collect(self, wait_first: bool, grace_s: float) -> list[tuple[int, tuple[str, bool]]]:
        """The (key, result) of the calls answered now: with ``wait_first`` block until one is (a result or a
        time-out), then take what comes within ``grace_s`` more (returns early once nothing waits or runs)."""
        out: list = []
        end = None
        while True:
            self._start()
            if not self.running:
                return out
            now = time.monotonic()
            if end is None and (out or not wait_first):
                end = now + grace_s
            limit = min(self.running.values()) if end is None else min(end, *self.running.values())
            try:
                key, result = self.done.get(timeout=max(0.0, limit - now))
            except queue.Empty:
                now = time.monotonic()
                for key in [k for k, deadline in self.running.items() if deadline <= now]:
                    del self.running[key]
                    out.append((key, (f"error: timed out after {self.timeout_s:g} s", True)))
                if end is not None and now >= end:
                    return out
                continue
            if key in self.running:  # else the late answer of a call already given up on
                del self.running[key]
                out.append((key, result))


@dataclasses.dataclass
class TurnState:
    """The responses being built, one entry per row: each row's prompt tokens (``starts``), response tokens,
    which of them the policy sampled (1) or a tool wrote (0), the sampler's log-probs, its calls, errors and
    whether it ended at EOS; the calls run per tool and the wall time spent waiting for tools."""

    starts: list
    resp: list
    trained: list
    logps: list
    calls: list
    errors: list
    ended_eos: list
    per_tool: dict
    tools_s: float = 0.0
    has_logps: bool = True

    @classmethod
    def start(cls, starts: list[list[int]], tools: list[Tool]) -> "TurnState":
        rows = len(starts)
        return cls(starts, [[] for _ in range(rows)], [[] for _ in range(rows)], [[] for _ in range(rows)],
                   [0] * rows, [0] * rows, [False] * rows, {t.name: 0 for t in tools})

    def continue_active(self, inner, rows: list[int], budget: int, stops: list, greedy: bool, seed, turn: int,
                        k: int = 0) -> list:
        """One turn of generation for ``rows``, each continued from its prompt and response so far within what is left
        of ``budget``; a seeded call draws each turn's k-th call from its own seed."""
        return inner.continue_ids([self.starts[i] + self.resp[i] for i in rows], [budget - len(self.resp[i]) for i in rows],
                                  stops, greedy=greedy, seed=None if seed is None else seed + 1_000_003 * turn + k)

    def add_sampled(self, i: int, ids: list[int], lps) -> None:
        """Tokens the policy sampled onto row ``i`` (trained), with the sampler's log-probs ``lps`` (None: the
        backend gave none, and the rollout then carries no sampler log-probs)."""
        self.resp[i] += ids
        self.trained[i] += [1] * len(ids)
        self.has_logps = self.has_logps and lps is not None
        self.logps[i] += list(lps[:len(ids)]) if lps is not None else [0.0] * len(ids)

    def add_context(self, i: int, ids: list[int]) -> None:
        """Tokens written into row ``i``'s response by something else (a tool, feedback, an observation): read by
        the model, not trained."""
        self.resp[i] += ids
        self.trained[i] += [0] * len(ids)
        self.logps[i] += [0.0] * len(ids)

    def add_row(self, start: list[int], resp: list[int], trained: list[int], logps: list[float], calls: int) -> int:
        """A new row after prompt tokens ``start`` holding a response so far (its masks, log-probs and calls made;
        no errors yet: they count the calls the row itself runs), not ended; returns its index."""
        self.starts.append(start)
        self.resp.append(resp)
        self.trained.append(trained)
        self.logps.append(logps)
        self.calls.append(calls)
        self.errors.append(0)
        self.ended_eos.append(False)
        return len(self.resp) - 1


class ToolUseBackend(BackendWrapper):
    """Multi-turn generation with tools over a backend that offers ``continue_ids``."""

    KEY = "rollout.tools"
    SHARDED_REASON = "the processes' responses call tools at different turns"
    result_tag = RESULT_TAG  # the tag of the blocks tool outputs are appended in (result_text)

    def __init__(self, backend, tokenizer, tools: list[Tool], cfg: RolloutConfig, arpo=None):
        # arpo: rollout.arpo's brancher (rollout/arpo_branching.py), None when off
        super().__init__(backend, tokenizer=tokenizer, tools=list(tools), cfg=cfg,
                         _by_close={t.close_tag: t for t in tools}, arpo=arpo)

    def filter_void_turns(self, rollout: Rollout) -> tuple[Rollout, dict]:
        """SimpleTIR's filter with this backend's tokenizer and tools: ``rollout`` with the loss masks
        of its trajectories that have a void turn emptied, and ``tools/void_turn_frac``. Done on the
        step's final batch rather than while generating, so that dynamic sampling's regrouping of
        rounds (which rebuilds the Rollout) cannot lose the flags: the turns are the loss mask's runs."""
        return filter_void_turns(rollout, self.tokenizer, self.tools)

    # ------------------------------------------------------------------ one response's text, cut at its turn's end
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _first_close(self, text: str) -> Optional[tuple[int, Tool]]:
        hits = [(text.find(tag), tool) for tag, tool in self._by_close.items() if tag in text]
        return min(hits, key=lambda h: h[0]) if hits else None

    def cut_turn(self, ids: list[int], tools_on: bool = True) -> tuple[list[int], str, Optional[tuple[Tool, str]]]:
        """(the turn's tokens, how it ended, the call): ``eos`` (kept through the first EOS), ``call``
        (kept through the token that completes the first closing tag; the call is ``(tool, input)``,
        input ``None`` without an opening tag), or ``length``. Tokens after the end are dropped: a
        backend may overshoot (a stop string inside a token, padding after EOS)."""
        eos = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        body = ids if eos is None else ids[:eos]
        hit = self._first_close(self._decode(body)) if tools_on else None
        if hit is None:
            return (ids, "length", None) if eos is None else (ids[:eos + 1], "eos", None)
        tool = hit[1]
        lo, hi = 1, len(body)  # the fewest tokens whose text holds the closing tag (monotone in the count)
        while lo < hi:
            mid = (lo + hi) // 2
            if tool.close_tag in self._decode(body[:mid]):
                hi = mid
            else:
                lo = mid + 1
        text = self._decode(body[:lo])
        end = text.find(tool.close_tag)
        start = text.rfind(tool.open_tag, 0, end)
        arg = None if start < 0 else text[start + len(tool.open_tag):end]
        return body[:lo], "call", (tool, arg)

    # ------------------------------------------------------------------ tools
    def _run(self, tool: Tool, arg: Optional[str]) -> tuple[str, bool]:
        """(output, whether it is an error)."""
        if arg is None:
            return f"error: no {tool.open_tag} before {tool.close_tag}", True
        try:
            return str(tool.run(arg)), False
        except ToolError as exc:
            return f"error: {exc}", True
        except Exception as exc:  # noqa: BLE001 - a user's tool failing is an output, not a crash
            log.debug("tool %s raised", tool.name, exc_info=True)
            return f"error: {type(exc).__name__}: {exc}", True

    def _run_all(self, calls: list[tuple[Tool, Optional[str]]]) -> list[tuple[str, bool]]:
        """The calls' (output, is error), in order: a :class:`ToolPool` of :data:`MAX_PARALLEL_CALLS` threads,
        each call with ``rollout.tool_timeout_s`` from its own start."""
        return ToolPool(self._run, self.cfg.tool_timeout_s).run_all(calls)

    def output_ids(self, output: str) -> list[int]:
        """The tokens of a tool's result block, the output cut to ``rollout.tool_output_max_tokens``."""
        tok, limit = self.tokenizer, self.cfg.tool_output_max_tokens
        ids, cut = _head_ids(tok, output, limit)
        if cut:
            output = tok.decode(ids, skip_special_tokens=False) + " ...(truncated)"
        return _encode(tok, result_text(output, self.result_tag))

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[str], n: int, greedy: bool = False,
                 max_new_tokens: int | None = None, seed: int | None = None) -> Rollout:
        budget = max_new_tokens or self.cfg.max_new_tokens
        enc = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        st = TurnState.start([list(enc[g]) for g in range(len(prompts)) for _ in range(n)], self.tools)
        extra: dict = {}
        if self.cfg.async_tools:  # each row's calls run while the other rows generate (rollout/async_turns.py)
            from anabranch.rollout.async_turns import run_async_turns

            extra = run_async_turns(self, st, budget, greedy, seed)
        else:
            active, turn = list(range(len(st.starts))), 0
            while active:
                active = self.turn(st, active, turn, budget, greedy, seed)
                turn += 1
        ro = self._rollout(prompts, enc, n, st.resp, st.trained, st.logps if st.has_logps else None, st.ended_eos,
                           st.calls, st.errors, st.per_tool)
        ro.metrics["time/tools_s"] = st.tools_s
        ro.metrics.update(extra)
        return ro

    def turn(self, st: "TurnState", active: list[int], turn: int, budget: int, greedy: bool,
             seed: int | None) -> list[int]:
        """One turn of the rows ``active`` of ``st``: each continues its response (a seeded call draws turn
        ``turn``'s own seeds), the turn is cut at its end, the calls run and their results are appended.
        Returns the rows that go on (a call answered and budget left)."""
        outs, tools_on = self.sample_turn(st, active, turn, budget, greedy, seed)
        pending = []
        for i in active:
            call = self.end_turn(st, i, outs[i], tools_on[i], budget)
            if call is not None:
                pending.append((i, call))
        t_tools = time.perf_counter()
        results = self._run_all([call for i, call in pending if st.calls[i] < self.cfg.max_tool_calls])
        st.tools_s += time.perf_counter() - t_tools
        it = iter(results)
        still = []
        for i, (tool, arg) in pending:
            if self.answer(st, i, tool, next(it) if st.calls[i] < self.cfg.max_tool_calls else None, budget):
                still.append(i)
        return still

    # The three parts of a turn, shared with the asynchronous loop (rollout/async_turns.py), so that both modes
    # build each row's response by the same code.
    def sample_turn(self, st: "TurnState", rows: list[int], turn: int, budget: int, greedy: bool,
                    seed: int | None) -> tuple[dict, dict]:
        """({row: (ids, log-probs)} of one generation of ``rows``, {row: whether its tools are on}). Past the call
        limit a response gets one last turn without tools (it can only answer or stop)."""
        tools_on = {i: st.calls[i] <= self.cfg.max_tool_calls for i in rows}
        stop = [t.close_tag for t in self.tools]
        outs: dict[int, tuple] = {}
        for k, (group, stops) in enumerate((([i for i in rows if tools_on[i]], stop),
                                            ([i for i in rows if not tools_on[i]], []))):
            if group:  # a seeded call: each turn's two calls draw from their own seeds
                got = st.continue_active(self.inner, group, budget, stops, greedy, seed, turn, k)
                outs.update(zip(group, got))
        return outs, tools_on

    def end_turn(self, st: "TurnState", i: int, out: tuple, tools_on: bool, budget: int):
        """Row ``i``'s new turn ``out`` (ids, log-probs) cut at its end and appended; returns its call ``(tool,
        input)`` when one is to be answered (the turn ended at a call with budget left), else None."""
        ids, how, call = self.cut_turn(list(out[0]), tools_on)
        st.add_sampled(i, ids, out[1])
        if how == "eos":
            st.ended_eos[i] = True
        elif how == "call" and len(st.resp[i]) < budget:
            return call
        return None

    def answer(self, st: "TurnState", i: int, tool: Tool, result: Optional[tuple[str, bool]], budget: int) -> bool:
        """Row ``i``'s call of ``tool`` answered: ``result`` the run's (output, is error), None past the call limit
        (no run: :data:`NO_CALLS_LEFT`). The result block is appended within ``budget``; returns whether the row
        goes on (budget left)."""
        if result is not None:
            output, failed = result
            st.per_tool[tool.name] += 1
            st.errors[i] += failed
        else:
            output = NO_CALLS_LEFT
        st.calls[i] += 1
        st.add_context(i, self.output_ids(output)[:budget - len(st.resp[i])])
        return len(st.resp[i]) < budget

    def _rollout(self, prompts, enc, n, resp, trained, logps, ended_eos, calls, errors, per_tool) -> Rollout:
        rows = len(resp)
        tool_tokens = sum(len(t) - sum(t) for t in trained)
        total_calls = sum(calls)
        metrics = {
            "tools/calls_mean": total_calls / rows,
            "tools/with_call_frac": sum(c > 0 for c in calls) / rows,
            "tools/error_frac": sum(errors) / max(sum(per_tool.values()), 1),
            "tools/output_token_frac": tool_tokens / max(sum(len(r) for r in resp), 1),
            **{f"tools/{name}/calls": float(k) for name, k in per_tool.items()},
        }
        return turns_rollout(self.tokenizer, self.eos_ids[0], prompts, enc, n, resp, trained, logps,
                             [not e for e in ended_eos], metrics)


def _encode(tok, text: str) -> list[int]:
    """Tokens of a tool's text with special-token strings split: printed text cannot end a message."""
    try:
        return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    except TypeError:  # a tokenizer without that option
        return tok(text, add_special_tokens=False)["input_ids"]


def _head_ids(tok, text: str, limit: int) -> tuple[list[int], bool]:
    """(the first ``limit`` tokens of ``text``, whether it has more). Only a prefix of the text is
    tokenized, grown until it holds more than ``limit`` tokens: a tool may return megabytes (a program
    printing in a loop), of which ``limit`` tokens are kept."""
    chars = 16 * (limit + 1)
    while True:
        ids = _encode(tok, text[:chars])
        if len(ids) > limit or chars >= len(text):
            return ids[:limit], len(ids) > limit
        chars *= 4


def prompt_task(task: TaskConfig, cfg: RolloutConfig) -> TaskConfig:
    """``task`` with the tool instructions after its system prompt when ``rollout.tools`` and
    ``rollout.tool_instructions`` are on (the model must know its tools and their call format)."""
    if not cfg.tools or not cfg.tool_instructions:
        return task
    text = tool_instructions(build_tools(list(cfg.tools), cfg.tool_timeout_s, cfg), RESULT_TAG)
    system = f"{task.system_prompt.rstrip()}\n\n{text}" if task.system_prompt else text
    return dataclasses.replace(task, system_prompt=system)


def with_tools(backend, tokenizer, cfg: RolloutConfig, policy=None):
    """``backend`` wrapped for ``rollout.tools`` (unchanged when there are none). ``policy``: the trained model,
    given by the trainer only, which turns on ``rollout.arpo``'s branching of the training rollouts when that is
    enabled (its entropies are the policy's; evaluation and other callers sample without branching)."""
    if not cfg.tools:
        return backend
    arpo = None
    if policy is not None and cfg.arpo.enabled:
        from anabranch.rollout.arpo_branching import ARPOBrancher

        arpo = ARPOBrancher(policy, cfg)
    return ToolUseBackend(backend, tokenizer, build_tools(list(cfg.tools), cfg.tool_timeout_s, cfg), cfg, arpo=arpo)
