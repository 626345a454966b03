"""Edge cases of multi-turn rollouts with tools (rollout/multi_turn.py, rollout/tools.py): tool calls
that hang, tools that return megabytes, programs whose output is long or whose exception message has
several lines, and a tool whose tag is the result tag."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from anabranch.config import ConfigError, RolloutConfig
from anabranch.models.tiny import char_tokenizer
from anabranch.rollout.multi_turn import MAX_PARALLEL_CALLS, ToolUseBackend, result_text
from anabranch.rollout.tools import Tool, build_tools, python_tool

TOK = char_tokenizer()


class _NoEngine:
    eos_ids = [TOK.eos_token_id]

    def continue_ids(self, *args, **kwargs):  # never called: these tests run tools and tokenize outputs
        raise AssertionError("not used")


def _backend(tok=TOK, **cfg) -> ToolUseBackend:
    return ToolUseBackend(_NoEngine(), tok, build_tools(["calculator"]), RolloutConfig(tools=["calculator"], **cfg))


# ------------------------------------------------------------------------------------------- deadlines
def test_each_call_gets_its_own_deadline_and_waiting_calls_still_run():
    """More hanging calls than run at once: every one is answered with a time-out after about one
    deadline from its own start (not one deadline per call before it, in turn), and a quick call
    queued behind them gets its real answer."""
    release = threading.Event()
    hang = Tool("hang", "", lambda text: "late" if release.wait(30) else "never")
    mt = _backend(tool_timeout_s=0.4)
    calc = mt.tools[0]
    calls = [(hang, "x")] * (MAX_PARALLEL_CALLS + 4) + [(calc, "6*7")]
    try:
        t0 = time.monotonic()
        out = mt._run_all(calls)
        took = time.monotonic() - t0
    finally:
        release.set()  # let the abandoned threads finish
    assert out[:-1] == [("error: timed out after 0.4 s", True)] * (MAX_PARALLEL_CALLS + 4)
    assert out[-1] == ("42", False)
    # two waves of 0.4 s (8 calls, then the 4 waiting and the calculator); waiting deadline after
    # deadline, in turn, took 13 × 0.4 s
    assert took < 2.0, took


def test_a_tool_that_never_returns_does_not_keep_the_process_from_exiting(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import threading\n"
        "from anabranch.config import RolloutConfig\n"
        "from anabranch.rollout.tools import Tool\n"
        f"sys_path = {str(Path(__file__).parent)!r}\n"
        "import sys; sys.path.insert(0, sys_path)\n"
        "from test_multi_turn_edges import _backend\n"
        "forever = Tool('forever', '', lambda text: threading.Event().wait())\n"
        "print(_backend(tool_timeout_s=0.2)._run_all([(forever, 'x')]))\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "timed out after 0.2 s" in done.stdout
    assert time.monotonic() - t0 < 60  # (the imports take seconds; a worker thread joined at exit: forever)


# ------------------------------------------------------------------------------------------- outputs
class _Counting:
    """The character tokenizer, recording the length of every text it tokenizes."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tok(text, **kwargs)

    def decode(self, ids, **kwargs):
        return self.tok.decode(ids, **kwargs)


def test_a_huge_output_is_cut_without_tokenizing_all_of_it():
    tok = _Counting(TOK)
    mt = _backend(tok, tool_output_max_tokens=8)
    ids = mt.output_ids("0123456789" * 1_000_000)  # 10 MB, as a program printing in a loop gives
    assert TOK.decode(ids) == result_text("01234567 ...(truncated)")
    assert max(tok.lengths) < 10_000
    # the same cut as tokenizing it all, at every length around the limit
    for n in (7, 8, 9, 200, 2000):
        text = "ab cd" * n
        kept = text if len(text) <= 8 else text[:8] + " ...(truncated)"
        assert TOK.decode(mt.output_ids(text)) == result_text(kept)


def test_python_tool_shows_the_start_of_a_long_output():
    run = python_tool(timeout_s=10.0).run
    # only the output's last 16 KB were kept: the model was shown "..., 7276, 7277, ..." first
    assert run("print(list(range(10000)))").startswith("[0, 1, 2, 3, ")
    flood = run("for i in range(10**7):\n    print(i)")  # stopped at the output file's limit
    assert flood.startswith("0\n1\n2\n") and flood.endswith("\nerror: killed before finishing (limit reached)")


def test_python_tool_shows_whole_exception_messages_on_their_own_line():
    run = python_tool(timeout_s=10.0).run
    # a message of several lines was shown as its last line alone, without the exception's type
    assert run("raise ValueError('first line\\nsecond line')") == "ValueError: first line\nsecond line"
    # output without a final newline ran into the exception's name
    assert run("print('partial', end='')\n1/0") == "partial\nZeroDivisionError: division by zero"
    # what the program writes to stderr before raising is not the exception
    assert run("import sys\nprint('warning', file=sys.stderr)\nraise KeyError('k')") == "KeyError: 'k'"
    assert run("print('a')\nraise RuntimeError") == "a\nRuntimeError"


# ------------------------------------------------------------------------------------------- names
def result(text: str) -> str:
    """A user's tool whose tag would be the result tag."""
    return text


def test_a_tool_cannot_take_the_result_tag():
    with pytest.raises(ConfigError, match=r"rollout.tools\[1\].*'result'"):
        build_tools(["calculator", "test_multi_turn_edges:result"])


# ------------------------------------------------------------------------------------------- calculator
def test_calculator_refuses_a_round_that_would_run_for_minutes():
    """round(n, -k) on an int computes 10**k, holding the GIL (no deadline can interrupt it): refused
    like a large exponent. Run in a child process so that without the bound the test fails at its time
    limit instead of hanging."""
    code = ("from anabranch.rollout.tools import calculate, ToolError\n"
            "try:\n    print(calculate('round(12345, -(999*999*999))'))\n"
            "except ToolError as exc:\n    print('ToolError:', exc)\n"
            "print(calculate('round(12345, -2)'), calculate('round(3.14159, 2)'), calculate('round(2.5)'))\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("round(12345, -(999*999*999)) ran for more than a minute")
    assert done.stdout.splitlines() == ["ToolError: round to -997002999 digits is too many (at most 4300)",
                                        "12300 3.14 2"], done.stderr


def test_python_tool_stopped_by_the_deadline_still_shows_what_it_printed():
    """The sandbox's clock ends before the multi-turn loop's deadline for the call, so a program that
    runs too long answers with its output so far and a time-out, not only the loop's time-out."""
    from anabranch.rollout.multi_turn import ToolUseBackend
    from anabranch.rollout.tools import build_tools
    from anabranch.config import RolloutConfig
    from anabranch.models.tiny import char_tokenizer

    class Idle:  # a backend the test never generates with
        eos_ids = [0]

        def continue_ids(self, *args, **kwargs):
            raise AssertionError("not used")

    tools = build_tools(["python"], timeout_s=2.0)
    mt = ToolUseBackend(Idle(), char_tokenizer(), tools, RolloutConfig(tools=["python"], tool_timeout_s=2.0))
    [(out, failed)] = mt._run_all([(tools[0], "print('started', flush=True)\nwhile True:\n    pass")])
    # stopped by the sandbox (its CPU or wall clock), not abandoned by the loop at 2 s with nothing shown
    assert failed is False and out.startswith("started\nerror: "), out
