"""Asynchronous tool rollouts (rollout.async_tools, rollout/async_turns.py): the same rows as the synchronous loop,
built while slow calls run; the rows waiting on a call sit out generation rounds, the others do not wait."""

import threading
import time

import pytest
import torch

from anabranch.config import ConfigError, ModelConfig, RolloutConfig
from anabranch.config_loading import load_config
from anabranch.models.loading import load_model
from anabranch.models.tiny import char_tokenizer
from anabranch.rollout.async_turns import AsyncTurnLoop
from anabranch.rollout.multi_turn import NO_CALLS_LEFT, ToolPool, TurnState, result_text, with_tools
from scripted_backend import TOOL_RESULT, Scripted

TOK = char_tokenizer()
SLOW_RELEASED = threading.Event()  # the slow call returns once this is set (or after its wait runs out)
SLOW_WAITED: list = []             # what each slow call's wait returned: True when released, False on time-out


def nap(text: str) -> str:
    """Answers after a latency its input names: fast, slow (held until released), 0.2 (seconds), or never."""
    text = text.strip()
    if text == "slow":
        SLOW_WAITED.append(SLOW_RELEASED.wait(timeout=4.0))
        return "s"
    if text == "never":
        time.sleep(3.0)
    elif text not in ("fast", ""):
        time.sleep(float(text))
    return "f"


def _backend(scripts, on_call=None, **cfg):
    rc = RolloutConfig(**{"tools": ["test_async_tools:nap"], "max_new_tokens": 200, "tool_timeout_s": 1.0, **cfg})
    return with_tools(Scripted(scripts, TOOL_RESULT, on_call=on_call), TOK, rc)


def _same_rollout(a, b):
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask", "sample_log_probs",
                 "group_index", "truncated"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert a.completions == b.completions


# ------------------------------------------------------------------------------------------- scheduling
FAST_ROWS = {"F1\n": ["<nap>fast</nap>", "<nap>fast</nap>", "F done.<|im_end|>"],
             "F2\n": ["<nap>fast</nap>", "ok<|im_end|>"]}
SCRIPTS = {"S\n": ["<nap>slow</nap>", "S done.<|im_end|>"], **FAST_ROWS}


def _release_when_fast_rows_ended(log):
    """Releases the slow call once the fast rows' last turns have been generated."""
    done = {(p, len(s) - 1) for p, s in FAST_ROWS.items()}
    if done <= {row for call in log for row in call}:
        SLOW_RELEASED.set()


def test_fast_rows_finish_while_a_slow_call_runs_and_the_rows_are_the_synchronous_ones():
    """The slow call is held until the fast rows have generated their last turns: in the asynchronous mode those
    turns are generated while it runs (its row sits out those rounds), so the wait is released, not timed out;
    the rollout (tokens, masks, log-probs, row order) is the synchronous loop's."""
    SLOW_RELEASED.clear()
    SLOW_WAITED.clear()
    mt = _backend(SCRIPTS, _release_when_fast_rows_ended, async_tools=True, tool_timeout_s=6.0)
    ro = mt.generate(list(SCRIPTS), 1)
    assert SLOW_WAITED == [True]
    log = mt.inner.log
    assert log[0] == [("S\n", 0), ("F1\n", 0), ("F2\n", 0)]      # round 0: every row, in row order
    assert log[-1] == [("S\n", 1)]                                # the slow row's last turn comes last, alone
    sat_out = len(log) - 2                                        # the rounds between its two turns
    assert sat_out >= 2 and all(("S\n", 1) not in call for call in log[1:-1])
    assert ro.metrics["tools/async_rounds"] == len(log)
    assert ro.metrics["tools/async_sat_out_mean"] * 3 >= sat_out

    SLOW_RELEASED.set()  # the synchronous loop: every call waits for the slow one, released at once here
    sync = _backend(SCRIPTS).generate(list(SCRIPTS), 1)
    _same_rollout(ro, sync)
    assert ro.completions[0] == "<nap>slow</nap>" + result_text("s") + "S done."
    for key in ("tools/calls_mean", "tools/with_call_frac", "tools/error_frac", "tools/output_token_frac",
                "tools/nap/calls"):
        assert ro.metrics[key] == sync.metrics[key], key
    assert ro.metrics["tools/nap/calls"] == 4.0 and "tools/async_rounds" not in sync.metrics


def test_the_loop_counts_the_rounds_each_row_sat_out():
    """Per row: a 0.6 s call against instant ones. Every round generated while the slow call ran is one the slow
    row sat out; the time spent blocked on tools (time/tools_s) is at most the wall time of the rollout. Round r of
    a seeded call draws from the seed of the synchronous loop's turn r."""
    scripts = {"S\n": ["<nap>0.6</nap>", "end<|im_end|>"],
               "F\n": ["<nap>fast</nap>"] * 3 + ["end<|im_end|>"]}
    mt = _backend(scripts, async_tools=True)
    st = TurnState.start([TOK(p, add_special_tokens=False)["input_ids"] for p in scripts], mt.tools)
    loop = AsyncTurnLoop(mt, st, 200, False, 7)
    t0 = time.perf_counter()
    metrics = loop.run()
    wall = time.perf_counter() - t0
    slow_rounds = [k for k, rows in enumerate(loop.rounds) if 0 in rows]
    assert slow_rounds[0] == 0 and len(slow_rounds) == 2
    between = [rows for rows in loop.rounds[1:slow_rounds[1]]]
    assert loop.sat_out[0] == len(between) >= 1                 # the fast row's turns went on meanwhile
    assert all(rows == [1] for rows in between)
    assert st.calls == [1, 3] and st.ended_eos == [True, True]
    assert metrics["tools/async_sat_out_mean"] == sum(loop.sat_out) / 2
    assert 0 < st.tools_s <= wall
    assert mt.inner.seeds == [7 + 1_000_003 * r for r in range(len(loop.rounds))]


def test_limits_errors_and_timeouts_are_answered_as_in_the_synchronous_loop():
    """Calls past the limit (answered without a run), a call that times out, and a budget that cuts a result:
    the same rollout and the same tool metrics in both modes."""
    scripts = {"A\n": ["<nap>fast</nap>"] * 4 + ["A.<|im_end|>"],       # past max_tool_calls=2
               "B\n": ["<nap>never</nap>", "B.<|im_end|>"],              # timed out
               "C\n": ["<nap>0.05</nap>x" * 3]}                          # cut at its turn's end
    args = dict(max_tool_calls=2, tool_timeout_s=0.5, max_new_tokens=120)  # A's and C's last results are cut
    a = _backend(scripts, async_tools=True, **args).generate(list(scripts), 2)
    s = _backend(scripts, **args).generate(list(scripts), 2)
    _same_rollout(a, s)
    assert NO_CALLS_LEFT[:20] in a.completions[0] and a.response_mask.sum(-1).tolist()[0] == 120
    assert a.truncated.tolist() == [True, True, False, False, True, True]
    assert "error: timed out after 0.5 s" in a.completions[2]
    for key, value in s.metrics.items():
        if key != "time/tools_s":
            assert a.metrics[key] == value, key
    assert a.metrics["tools/error_frac"] == 2 / a.metrics["tools/nap/calls"] > 0


def test_the_pool_runs_calls_in_the_background_with_deadlines():
    mt = _backend({"x": ["x"]})
    tool = mt.tools[0]
    pool = ToolPool(mt._run, timeout_s=0.3, width=1)
    keys = [pool.submit(tool, "never"), pool.submit(tool, "fast"), pool.submit(tool, None)]
    assert pool.busy and len(pool.running) == 1                  # one slot: the others queue in order
    got = {}
    while pool.busy:
        got.update(pool.collect(wait_first=True, grace_s=0.0))
    assert got == {keys[0]: ("error: timed out after 0.3 s", True), keys[1]: ("f", False),
                   keys[2]: ("error: no <nap> before </nap>", True)}
    # run_all (the synchronous loop's _run_all): the answers in call order, not in the order they came back
    wide = ToolPool(mt._run, timeout_s=0.3, width=3)
    assert wide.run_all([(tool, "never"), (tool, "0.1"), (tool, None)]) == [
        ("error: timed out after 0.3 s", True), ("f", False), ("error: no <nap> before </nap>", True)]
    assert not wide.busy and wide.run_all([]) == []
    pool.submit(tool, "fast")                                    # run_all needs a pool with nothing in flight
    with pytest.raises(RuntimeError, match="no call in flight"):
        pool.run_all([(tool, "fast")])


# ------------------------------------------------------------------------------------------- a real model
CALLS = {"Q: a?\n": "<nap>1.0</nap>", "Q: b?\n": "<nap>fast</nap>", "Q: c?\n": "<nap>fast</nap>"}


@pytest.fixture(scope="module")
def caller(tiny_model_dir):
    """The tiny model trained to open each prompt of CALLS with its call (one slow, two instant); after the results
    it writes whatever its random weights say. One batch, right-padded (a causal model: the padding after a
    sequence changes nothing before it)."""
    model = load_model(ModelConfig(path=str(tiny_model_dir)), torch.device("cpu"), trainable=True)
    seqs = [(TOK(p, add_special_tokens=False)["input_ids"], TOK(c, add_special_tokens=False)["input_ids"])
            for p, c in CALLS.items()]
    width = max(len(p) + len(c) for p, c in seqs)
    ids, labels = torch.zeros(len(seqs), width, dtype=torch.long), torch.full((len(seqs), width), -100)
    for r, (p, c) in enumerate(seqs):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c)
        labels[r, len(p):len(p) + len(c)] = torch.tensor(c)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    assert loss.item() < 0.02
    return model


def test_greedy_outputs_are_identical_in_both_modes_on_the_tiny_model(caller, monkeypatch):
    """Greedy decoding: the asynchronous rollout is the synchronous one, token for token, though the rows of the
    slow call (1 s) sat out rounds that the others generated (no grace wait: the instant calls' rows need not
    rejoin together, so the rounds differ from the synchronous turns all the more)."""
    from anabranch.rollout import async_turns
    from anabranch.rollout.hf_generate import HFGenerateBackend

    monkeypatch.setattr(async_turns, "GRACE_FRACTION", 0.0)
    out = {}
    for mode in (False, True):
        cfg = RolloutConfig(tools=["test_async_tools:nap"], max_new_tokens=48, max_tool_calls=2, async_tools=mode)
        out[mode] = with_tools(HFGenerateBackend(caller, TOK, cfg), TOK, cfg).generate(list(CALLS), 2, greedy=True)
    _same_rollout(out[False], out[True])
    assert all(c.startswith(CALLS[p]) for c, p in zip(out[True].completions, [p for p in CALLS for _ in range(2)]))
    assert out[True].metrics["tools/async_sat_out_mean"] > 0    # the rows did not move in lock-step
    assert out[True].loss_mask is not None and (out[True].loss_mask == 0).any()


# ------------------------------------------------------------------------------------------- refusals
def test_async_tools_needs_tools_and_refuses_arpo():
    assert load_config(None, []).rollout.async_tools is False
    assert load_config(None, ["rollout.tools=[calculator]", "rollout.async_tools=true"]).rollout.async_tools
    with pytest.raises(ConfigError, match="rollout.async_tools.*rollout.tools"):
        load_config(None, ["rollout.async_tools=true"])
    with pytest.raises(ConfigError, match="rollout.async_tools does not combine with rollout.arpo"):
        load_config(None, ["rollout.tools=[calculator]", "rollout.async_tools=true", "rollout.arpo.enabled=true",
                           "rollout.n=4", "algorithm.loss=ppo_clip"])
