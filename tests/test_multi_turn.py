"""Multi-turn rollouts with tools (rollout/multi_turn.py, rollout/tools.py): the tools' answers, where a
turn ends, which tokens the loss sees, and that generation and training read the same sequence."""

import json

import pytest
import torch

from anabranch.algorithms.advantages import discounted_returns, token_level_rewards
from anabranch.algorithms.ppo_value import gae
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, ModelConfig, RolloutConfig, TaskConfig
from anabranch.config_loading import load_config
from anabranch.models.loading import load_model
from anabranch.models.logprobs import position_ids_from_mask
from anabranch.models.tiny import char_tokenizer
from anabranch.rollout.multi_turn import NO_CALLS_LEFT, ToolUseBackend, prompt_task, result_text, with_tools
from anabranch.rollout.tools import ToolError, build_tools, calculate, notebook_cell, python_tool
from anabranch.trainer.step import policy_update
from scripted_backend import TOOL_RESULT, Scripted

TOK = char_tokenizer()
EOS = TOK.eos_token_id


# ------------------------------------------------------------------------------------------- the tools
@pytest.mark.parametrize("expr,expected", [
    ("2+3*4", "14"), ("7/2", "3.5"), ("2**10", "1024"), ("2^10", "1024"), ("0.1+0.2", "0.3"), ("-3//2", "-2"),
    ("sqrt(16)", "4"), ("max(3, 9, 4) - abs(-2)", "7"), ("(1+2)*(3+4)", "21"), ("10 % 4", "2"), ("6 × 7", "42"),
    ("123456789*987654321", "121932631112635269"),
])
def test_calculator_evaluates_arithmetic_as_python_does(expr, expected):
    assert calculate(expr) == expected


@pytest.mark.parametrize("expr,message", [
    ("1/0", "division by zero"), ("__import__('os').system('true')", "not an arithmetic expression"),
    ("10**10**10", "too large"), ("(1,2)", "not an arithmetic expression"), ("2 +", "cannot parse"),
    ("", "empty"), ("open('x')", "not an arithmetic expression"), ("sqrt(-1)", "math domain error"),
    ("'a'*3", "not an arithmetic expression"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr, message):
    with pytest.raises(ToolError, match=message):
        calculate(expr)


def test_notebook_cell_prints_a_final_expression_only():
    assert notebook_cell("x = 6\nx * 7").endswith("print(repr(__value))\n")
    assert notebook_cell("x = 6; x * 7").startswith("x = 6\n__value = x * 7\n")
    assert notebook_cell("print(1)\n") == "print(1)\n"          # a call to print: its value is None
    assert notebook_cell("x = 1\n") == "x = 1\n"
    assert notebook_cell("def f(:") == "def f(:"                 # left to the sandbox to report


def test_python_tool_shows_output_values_and_exceptions():
    run = python_tool(timeout_s=10.0).run
    assert run("print(6 * 7)") == "42"
    assert run("x = [i * i for i in range(4)]\nx") == "[0, 1, 4, 9]"
    assert run("```python\nprint('fenced')\n```") == "fenced"
    assert run("print('a')\n1/0") == "a\nZeroDivisionError: division by zero"
    assert run("import socket\nsocket.socket()").startswith("PermissionError")
    slow = python_tool(timeout_s=1.0).run("while True:\n    pass")
    assert "timed out" in slow or "killed" in slow


def test_tool_names_are_checked_with_the_key():
    with pytest.raises(ConfigError, match=r"rollout.tools\[1\].*calculator"):
        build_tools(["python", "calculater"])
    with pytest.raises(ConfigError, match="second tool named"):
        build_tools(["calculator", "calculator"])
    tools = build_tools(["calculator", "test_multi_turn:lookup"])
    assert [t.name for t in tools] == ["calculator", "lookup"]
    assert tools[1].description == "Looks a word up in a tiny dictionary."


def lookup(word: str) -> str:
    """Looks a word up in a tiny dictionary."""
    return {"pi": "3.14159"}[word.strip()]


# ------------------------------------------------------------------------------------------- the turns
def _mt(script, **cfg):
    backend = Scripted(script, TOOL_RESULT)
    return backend, with_tools(backend, TOK, RolloutConfig(**{"tools": ["calculator"], "max_new_tokens": 200, **cfg}))


def test_a_call_is_answered_and_only_the_policys_tokens_are_trained():
    backend, mt = _mt(["I compute <calculator>2+3*4</calculator> and so on", "So it is 14.<|im_end|><pad><pad>"])
    ro = mt.generate(["Q one\n", "Q2\n"], 2)
    first, second = "I compute <calculator>2+3*4</calculator>", "So it is 14."
    assert ro.completions == [first + result_text("14") + second] * 4
    obs = len(TOK(result_text("14"), add_special_tokens=False)["input_ids"])
    n1, n2 = len(first), len(second) + 1  # + EOS
    expected = [1] * n1 + [0] * obs + [1] * n2
    assert ro.loss_mask[0].tolist() == expected
    assert ro.response_mask.sum(-1).tolist() == [len(expected)] * 4
    assert ro.trained_mask.sum(-1).tolist() == [n1 + n2] * 4
    # the engine's log-probs on the policy's tokens, 0 on the tool's
    assert ro.sample_log_probs[0, :n1].eq(-0.5).all() and ro.sample_log_probs[0, n1:n1 + obs].eq(0).all()
    assert not ro.truncated.any()
    assert ro.metrics["tools/calls_mean"] == 1.0 and ro.metrics["tools/calculator/calls"] == 4.0
    assert ro.metrics["time/tools_s"] > 0
    assert ro.metrics["tools/output_token_frac"] == pytest.approx(obs / len(expected))
    # turn 1: every row with the whole budget; turn 2: what is left
    assert backend.calls[:2] == [4, 4] and backend.stops[:2] == [["</calculator>"]] * 2
    assert backend.budgets[0] == [200] * 4 and backend.budgets[1] == [200 - n1 - obs] * 4
    # prompts left-padded, as the backends give them
    assert ro.prompt_mask[2].tolist()[:2] == [0, 0] and ro.prompt_mask[0].all()


def test_the_turn_ends_at_the_token_that_closes_the_call():
    mt = _mt(["x"])[1]
    # a closing tag split over several tokens, text after it in the same output, then EOS
    ids = TOK("ab<calculator>1+1</calculator>zz<|im_end|>", add_special_tokens=False)["input_ids"]
    kept, how, (tool, arg) = mt.cut_turn(ids)
    assert TOK.decode(kept) == "ab<calculator>1+1</calculator>" and how == "call" and arg == "1+1"
    # EOS before any call: the turn ends at EOS, inclusive
    kept, how, call = mt.cut_turn(TOK("done<|im_end|><calculator>1</calculator>", add_special_tokens=False)["input_ids"])
    assert how == "eos" and kept[-1] == EOS and call is None
    # no opening tag: a call whose input is None (answered with an error)
    kept, how, (tool, arg) = mt.cut_turn(TOK("1+1</calculator>", add_special_tokens=False)["input_ids"])
    assert how == "call" and arg is None
    assert mt._run(tool, None) == ("error: no <calculator> before </calculator>", True)
    # with tools off (the last turn) a tag is text
    assert mt.cut_turn(TOK("a</calculator>b", add_special_tokens=False)["input_ids"], tools_on=False)[1] == "length"


def test_calls_past_the_limit_get_an_error_and_one_last_turn_without_tools():
    backend, mt = _mt(["<calculator>1+1</calculator>"] * 3 + ["The end.<|im_end|>"], max_tool_calls=2)
    ro = mt.generate(["Q\n"], 1)
    text = ro.completions[0]
    assert text.count("<calculator>1+1</calculator>") == 3
    assert text.count(result_text("2")) == 2 and text.count(result_text(NO_CALLS_LEFT)) == 1
    assert text.endswith("The end.")
    assert backend.stops == [["</calculator>"]] * 3 + [[]]
    assert ro.metrics["tools/calls_mean"] == 3.0 and ro.metrics["tools/calculator/calls"] == 2.0


def test_the_budget_holds_tool_outputs_and_outputs_are_cut():
    # the tool's output is long: cut to tool_output_max_tokens; the response never passes max_new_tokens
    backend, mt = _mt(["<calculator>2**200</calculator>", "and more text" * 20], max_new_tokens=90,
                      tool_output_max_tokens=8)
    ro = mt.generate(["Q\n"], 1)
    assert ro.response_mask.sum().item() == 90 and ro.truncated.all()
    assert "<result>\n16069380 ...(truncated)\n</result>\n" in ro.completions[0]
    # a call at the very end of the budget is not run
    backend, mt = _mt(["<calculator>1+1</calculator>"], max_new_tokens=len("<calculator>1+1</calculator>"))
    ro = mt.generate(["Q\n"], 1)
    assert ro.metrics["tools/calculator/calls"] == 0 and "<result>" not in ro.completions[0]


def test_tool_output_cannot_end_the_message_with_a_special_token():
    ids = ToolUseBackend(Scripted(["x"], TOOL_RESULT), TOK, build_tools(["calculator"]),
                         RolloutConfig(tools=["calculator"])).output_ids("a<|im_end|>b")
    assert EOS not in ids and TOK.decode(ids) == result_text("a<|im_end|>b")


def test_failing_and_hanging_tools_answer_with_errors(monkeypatch):
    def boom(text):
        raise RuntimeError("no such page")

    def hang(text):
        import time
        time.sleep(5)
        return "late"

    backend = Scripted(["x"], TOOL_RESULT)
    tools = build_tools(["calculator"])
    mt = ToolUseBackend(backend, TOK, tools, RolloutConfig(tools=["calculator"], tool_timeout_s=0.3))
    boom_tool = type(tools[0])("boom", "", boom)
    hang_tool = type(tools[0])("hang", "", hang)
    assert mt._run_all([(boom_tool, "q"), (hang_tool, "q"), (tools[0], "1+1")]) == [
        ("error: RuntimeError: no such page", True), ("error: timed out after 0.3 s", True), ("2", False)]


def test_tool_instructions_go_after_the_system_prompt_and_config_errors_name_keys():
    rc = RolloutConfig(tools=["calculator", "python"])
    task = prompt_task(TaskConfig(system_prompt="Be brief."), rc)
    assert task.system_prompt.startswith("Be brief.\n\nYou can use tools.")
    assert "- calculator: " in task.system_prompt and "- python: " in task.system_prompt
    assert prompt_task(TaskConfig(), RolloutConfig(tools=["calculator"], tool_instructions=False)).system_prompt is None
    assert prompt_task(TaskConfig(), RolloutConfig()).system_prompt is None
    with pytest.raises(ConfigError, match="rollout.min_new_tokens"):
        load_config(None, ["rollout.tools=calculator", "rollout.min_new_tokens=4"])
    with pytest.raises(ConfigError, match="rollout.max_tool_calls"):
        load_config(None, ["rollout.tools=calculator", "rollout.max_tool_calls=0"])
    assert load_config(None, ["rollout.tools=calculator,python"]).rollout.tools == ["calculator", "python"]
    _, mt = _mt(["x"])
    with pytest.raises(ConfigError, match="sharded"):
        mt.synced_gpus = True
    mt.share_prompt_prefix = False  # other options reach the backend underneath
    assert mt.inner.share_prompt_prefix is False


# ------------------------------------------------------------------------------------------- masks with gaps
def _compact(x, mask):
    return [row[m.bool()] for row, m in zip(x, mask)]


def test_rewards_returns_and_gae_skip_the_tool_outputs():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0]])
    rewards = torch.tensor([2.0, -1.0])
    tr = token_level_rewards(rewards, mask)
    assert tr.tolist() == [[0, 0, 0, 0, 0, 2.0, 0], [0, 0, -1.0, 0, 0, 0, 0]]
    ret = discounted_returns(tr, mask, 0.5)  # 4 policy tokens: 2·0.5³, 2·0.5², 2·0.5, 2
    assert ret[0].tolist() == [0.25, 0.5, 0, 0, 1.0, 2.0, 0]
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0], [0.5, 9.0, 0.6, 9.0, 9.0, 9.0, 9.0]])
    adv, returns = gae(tr, values, mask, 0.9, 0.8)
    for i in range(2):  # the same as GAE over the policy's tokens alone
        m = mask[i:i + 1]
        c_adv, c_ret = gae(_compact(tr[i:i + 1], m)[0][None], _compact(values[i:i + 1], m)[0][None],
                           torch.ones(1, int(m.sum())), 0.9, 0.8)
        torch.testing.assert_close(_compact(adv[i:i + 1], m)[0], c_adv[0])
        torch.testing.assert_close(_compact(returns[i:i + 1], m)[0], c_ret[0])
        assert adv[i][~m[0].bool()].eq(0).all()


# ------------------------------------------------------------------------------------------- a real model
def _memorized(model_dir, call_prompt: str, call: str, steps: int = 150):
    """The tiny model trained to answer ``call_prompt`` with ``call`` (so that greedy decoding makes a
    tool call); after the call's result it continues with whatever its random weights say."""
    model = load_model(ModelConfig(path=str(model_dir)), torch.device("cpu"), trainable=True)
    tok = TOK
    p = tok(call_prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + tok(call, add_special_tokens=False)["input_ids"]])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        logits = model(input_ids=ids).logits[0, len(p) - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, len(p):])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    return model


@pytest.fixture(scope="module")
def caller(tiny_model_dir):
    return _memorized(tiny_model_dir, "Q: 1+2?\n", "<calculator>1+2</calculator>")


def test_generate_backend_multi_turn_greedy_tokens_are_the_trainers_argmax(caller):
    """Generation after a tool's output reads the sequence the trainer reads: at every token the
    policy wrote (after the result too, where the weights are random) greedy decoding picked the
    trainer's argmax of that position, for rows of different prompt and response lengths."""
    from anabranch.rollout.hf_generate import HFGenerateBackend

    cfg = RolloutConfig(tools=["calculator"], max_new_tokens=60, temperature=1.0)
    mt = with_tools(HFGenerateBackend(caller, TOK, cfg), TOK, cfg)
    ro = mt.generate(["Q: 1+2?\n", "Something else, longer\n"], 1, greedy=True)
    assert ro.completions[0].startswith("<calculator>1+2</calculator>" + result_text("3"))
    assert ro.loss_mask is not None and (ro.loss_mask[0] == 0).sum() > 0
    policy_after_result = ro.loss_mask[0].nonzero().max().item() > (ro.loss_mask[0] == 0).nonzero().max().item()
    assert policy_after_result  # the policy wrote tokens after the tool's output
    mask = ro.attention_mask
    with torch.no_grad():
        logits = caller(input_ids=ro.input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    R = ro.response_ids.shape[1]
    argmax = logits[:, -R - 1:-1].argmax(-1)
    tm = ro.trained_mask.bool()
    assert torch.equal(argmax[tm], ro.response_ids[tm])


def test_the_update_trains_only_the_policys_tokens(caller):
    """The loss on a multi-turn rollout (one update per batch, token-mean) is
    −Σ_{policy tokens} Â·log π / #policy tokens: with advantages given on every response token, the
    tool outputs' included, the gradient equals that computed by hand over the policy's tokens only."""
    from anabranch.rollout.hf_generate import HFGenerateBackend

    cfg = RolloutConfig(tools=["calculator"], max_new_tokens=80, temperature=1.0)
    torch.manual_seed(3)
    ro = with_tools(HFGenerateBackend(caller, TOK, cfg), TOK, cfg).generate(["Q: 1+2?\n", "Q: 9?\n"], 2)
    gaps = ro.response_mask.bool() & ~ro.trained_mask.bool()
    last_policy = (ro.trained_mask * torch.arange(1, ro.trained_mask.shape[1] + 1)).argmax(-1)
    last_tool = (gaps.long() * torch.arange(1, gaps.shape[1] + 1)).argmax(-1)
    assert gaps.any() and (last_policy > last_tool).any()  # the policy wrote after a tool's output
    algo = resolve_algorithm(AlgorithmConfig(name="grpo", loss_agg_mode="token-mean"))
    adv = torch.randn(ro.response_ids.shape, generator=torch.Generator().manual_seed(0)) * ro.response_mask
    model = caller
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    policy_update(model, opt, ro, adv, torch.zeros(4), algo, micro_batch_size=2, grad_clip=0.0, temperature=1.0,
                  max_response_len=80, zero_advantage_rows="train")
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    mask = ro.attention_mask
    logits = model(input_ids=ro.input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    R = ro.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, -R - 1:-1], -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    tm = ro.trained_mask.float()
    (-(adv * logp * tm).sum() / tm.sum()).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    model.zero_grad()


def test_train_with_a_tool_logs_tool_use(caller, tmp_path, write_jsonl):
    from anabranch.cli import main

    model_dir = tmp_path / "caller"
    caller.save_pretrained(str(model_dir))
    TOK.save_pretrained(str(model_dir))
    data = write_jsonl([{"prompt": "Q: 1+2?", "answer": "3"}] * 6 + [{"prompt": "Q: 2+2?", "answer": "4"}] * 2)
    run = tmp_path / "run"
    code = main(["train", f"model.path={model_dir}", "task.name=file", f"task.path={data}", "task.eval_size=2",
                 "task.chat_template=false", "task.instruction=", "rollout.tools=[calculator]",
                 "rollout.tool_instructions=false", "rollout.n=2", "rollout.prompts_per_step=2",
                 "rollout.max_new_tokens=40", "trainer.steps=2", "trainer.eval_before=false",
                 "trainer.eval_after=false", "trainer.save_final=false", f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.progress=false",
                 "reward.functions=[math_verify]", "trainer.log_samples=2"])
    assert code == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "tools/calls_mean" in x]
    assert len(steps) == 2 and all(x["tools/calls_mean"] > 0 for x in steps)
    assert all(torch.isfinite(torch.tensor(x["loss"])) for x in steps)


def add(text: str) -> str:
    """Adds the numbers it is given."""
    return str(sum(int(x) for x in text.replace("+", " ").split()))


def test_grpo_learns_to_call_the_tool_that_answers(tiny_model_dir, tmp_path):
    """Reward rises because the policy learns to use its tool. The tiny model is first fitted to
    answer each of 8 additions in one of two ways, half and half: call ``<add>a+b</add>`` and stop after
    the result (the result's number is then the answer: reward 1), or write "0" (reward 0). GRPO with
    the tool then moves it to the calls: both the fraction of responses with a call and the reward
    rise, through rollouts whose tool outputs are masked out of the loss."""
    from transformers import AutoTokenizer

    from anabranch import load_config, train
    from anabranch.data.prompts import build_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    pairs = [(2, 5), (3, 4), (6, 1), (8, 9), (4, 4), (7, 5), (9, 3), (5, 6)]
    rows = [{"prompt": f"Q{i}: {a}+{b}", "answer": str(a + b)} for i, (a, b) in enumerate(pairs)]
    task = TaskConfig(chat_template=False, instruction="")

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    seqs = []
    for r, (a, b) in zip(rows, pairs):
        prompt = ids(build_prompt({"question": r["prompt"]}, task, tok))
        seqs += [(prompt, ids(f"<add>{a}+{b}</add>") + ids(result_text(str(a + b))) + [tok.eos_token_id]),
                 (prompt, ids("0") + [tok.eos_token_id])]
    model = load_model(ModelConfig(path=str(tiny_model_dir)), torch.device("cpu"), trainable=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(150):  # token sums, so that both answers' first tokens weigh the same: p(call) ≈ 1/2
        loss = sum(torch.nn.functional.cross_entropy(model(input_ids=torch.tensor([p + y])).logits[0, len(p) - 1:-1],
                                                     torch.tensor(y), reduction="sum") for p, y in seqs) / len(seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    fitted = tmp_path / "fitted"
    model.save_pretrained(str(fitted))
    tok.save_pretrained(str(fitted))
    data = tmp_path / "adds.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 5))
    cfg = load_config(None, [
        f"model.path={fitted}", "task.name=file", f"task.path={data}", "task.eval_size=0",
        "task.chat_template=false", "task.instruction=", "rollout.tools=[test_multi_turn:add]",
        "rollout.tool_instructions=false", "rollout.n=8", "rollout.prompts_per_step=4", "rollout.max_new_tokens=40",
        "trainer.steps=20", "trainer.lr=2e-4", f"trainer.output_dir={tmp_path}", "trainer.run_name=rl",
        "trainer.progress=false", "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=false",
        "reward.functions=[math_verify]", "trainer.device=cpu", "trainer.micro_batch_size=32"])
    history = train(cfg).history
    calls = [m["tools/with_call_frac"] for m in history]
    rewards = [m["reward/mean"] for m in history]
    assert 0.2 < sum(calls[:3]) / 3 < 0.8, calls  # both answers at the start
    assert sum(calls[-5:]) / 5 > sum(calls[:3]) / 3 + 0.25, calls
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert all(m["tools/add/calls"] > 0 for m in history[-5:])
