"""SSRL (rollout/self_search.py, rewards/ssrl_format.py, data/ssrl_qa.py): the information spans and their loss
mask, the format and exact-match rewards, sim2real's search results as <information> blocks, the refusals, and a
short training run with self-search on."""

import pytest
import torch

from anabranch.config import ConfigError, RewardConfig, RewardFunctionConfig, RolloutConfig, SelfSearchConfig
from anabranch.config_loading import load_config
from anabranch.models.tiny import char_tokenizer
from anabranch.rewards import build_rewards, score
from anabranch.rewards.ssrl_format import qa_exact_match_reward, ssrl_format_reward
from anabranch.rollout.base import Rollout, right_padded
from anabranch.rollout.search_tool import format_results, index_for
from anabranch.rollout.self_search import (SelfSearchBackend, Sim2RealBackend, count_searches, evaluation_backend,
                                           information_spans, information_text, information_token_mask,
                                           mask_information, with_self_search)
from scripted_backend import Scripted

EOS_PIECE = "<eos>"


class PieceTokenizer:
    """Token k is the string ``pieces[k]`` (or bytes, decoded as UTF-8 with replacement, as byte-level BPE does);
    the EOS piece is a special token."""

    def __init__(self, pieces):
        self.pieces = list(pieces)
        self.eos_token_id = self.pieces.index(EOS_PIECE) if EOS_PIECE in self.pieces else None
        self.decoded = []  # the length of every decode call's ids, to count the decoding work

    def ids(self, *pieces):
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens=False):
        self.decoded.append(len(ids))
        parts = [self.pieces[i] for i in ids if not (skip_special_tokens and i == self.eos_token_id)]
        if parts and isinstance(parts[0], bytes):
            return b"".join(p if isinstance(p, bytes) else p.encode() for p in parts).decode("utf-8", "replace")
        return "".join(parts)


# ------------------------------------------------------------------------------------------- spans and masks
def test_information_spans_by_hand():
    text = "<think>a</think><search>q</search><information>xy</information><answer>b</answer>"
    assert information_spans(text) == [(34, 34 + len("<information>xy</information>"))]
    two = "<information>1</information>--<information>22"  # the second one unclosed: to the end
    assert information_spans(two) == [(0, 28), (30, len(two))]
    assert information_spans("no blocks </information>") == []


# The response: each piece a token. The opening tag starts inside "rch>\n<" (a token that also ends the query) and
# the closing tag is split over "</informa", "tion", ">\n".
PIECES = ["<thi", "nk>t</think>", "<search>q</sea", "rch>\n<", "inform", "ation>", "Everest is ", "high",
          "</informa", "tion", ">\n", "<answer>Everest</answer>", EOS_PIECE]
#          1        1               1                 0         0         0         0              0
#          0            0       0       1                            1 (EOS: no characters)
EXPECTED_KEEP = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]


def test_a_tag_split_across_tokens_masks_every_token_it_touches():
    tok = PieceTokenizer(PIECES)
    ids = list(range(len(PIECES)))
    assert information_token_mask(tok, ids) == EXPECTED_KEEP
    assert count_searches(tok.decode(ids, skip_special_tokens=True)) == 1


def test_an_unclosed_information_block_is_masked_to_the_end_of_the_text_but_not_eos():
    pieces = ["<think>t</think>", "<search>q</search>", "<informa", "tion>abc", "def", EOS_PIECE]
    tok = PieceTokenizer(pieces)
    assert information_token_mask(tok, list(range(len(pieces)))) == [1, 1, 0, 0, 0, 1]


def test_byte_tokens_inside_a_character_use_the_prefix_path_with_the_same_spans():
    # "é" is two byte tokens: each decodes alone to U+FFFD, so the per-token concatenation differs from the text
    pieces = [b"<think>caf", b"\xc3", b"\xa9</think>", b"<search>q</search>", b"<information>", b"cr\xc3", b"\xa8me",
              b"</information>", b"<answer>x</answer>"]
    tok = PieceTokenizer(pieces)
    ids = list(range(len(pieces)))
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)
    assert information_token_mask(tok, ids) == [1, 1, 1, 1, 0, 0, 0, 0, 1]
    # handed the decoded text (a Rollout's completion): the same mask
    assert information_token_mask(tok, ids, tok.decode(ids, skip_special_tokens=True)) == [1, 1, 1, 1, 0, 0, 0, 0, 1]


def _rollout(tok, rows, loss_mask=None):
    ids, mask = right_padded(rows, 0)
    b = len(rows)
    return Rollout(prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
                   response_ids=ids, response_mask=mask, group_index=torch.zeros(b, dtype=torch.long),
                   prompts=["p"], completions=[tok.decode(r, skip_special_tokens=True) for r in rows],
                   truncated=torch.zeros(b, dtype=torch.bool), loss_mask=loss_mask)


def test_the_rollouts_loss_mask_is_zero_exactly_on_information_tokens():
    tok = PieceTokenizer(PIECES + ["plain answer"])
    full = list(range(len(PIECES)))
    plain = tok.ids("<thi", "nk>t</think>", "plain answer", EOS_PIECE)
    ro = mask_information(_rollout(tok, [full, plain]), tok)
    assert ro.loss_mask[0].tolist() == EXPECTED_KEEP
    assert ro.loss_mask[1].tolist() == [1] * len(plain) + [0] * (len(full) - len(plain))  # padding: 0 as before
    assert ro.trained_mask[1].tolist() == ro.response_mask[1].tolist()
    assert ro.metrics["self_search/searches_mean"] == 0.5           # one search over two responses
    assert ro.metrics["self_search/masked_token_frac"] == pytest.approx(8 / (13 + 4))
    # a loss mask already there (e.g. a 0 on the first token) is kept and multiplied, not replaced
    pre = torch.ones(2, len(full), dtype=torch.long)
    pre[0, 0] = 0
    ro = mask_information(_rollout(tok, [full, plain], loss_mask=pre), tok)
    assert ro.loss_mask[0].tolist() == [0] + EXPECTED_KEEP[1:]
    # mask_information=false: nothing changes, the searches are still counted
    ro = mask_information(_rollout(tok, [full, plain]), tok, mask=False)
    assert ro.loss_mask is None and ro.metrics["self_search/masked_token_frac"] == 0.0
    assert ro.metrics["self_search/searches_mean"] == 0.5


def test_searches_come_from_the_completions_and_only_rows_with_information_decode_their_tokens():
    tok = PieceTokenizer(PIECES + ["plain answer"])
    full = list(range(len(PIECES)))
    plain = tok.ids("<thi", "nk>t</think>", "plain answer", EOS_PIECE)
    ro = _rollout(tok, [full, plain, plain])
    tok.decoded.clear()
    mask_information(ro, tok, mask=False)  # masking off: no token mapping, no decode at all
    assert tok.decoded == [] and ro.metrics["self_search/searches_mean"] == pytest.approx(1 / 3)
    mask_information(ro, tok)  # on: the one row holding <information>, each token alone once, never whole
    assert tok.decoded == [1] * len(full) and ro.loss_mask[0].tolist() == EXPECTED_KEEP


class _Generates:
    def __init__(self, rollout):
        self.rollout, self.eos_ids = rollout, [0]

    def generate(self, prompts, n, greedy=False, max_new_tokens=None, seed=None):
        return self.rollout


def test_the_training_wrapper_masks_each_generated_rollout_once():
    tok = PieceTokenizer(PIECES)
    cfg = RolloutConfig(self_search=SelfSearchConfig(enabled=True))
    ro = SelfSearchBackend(_Generates(_rollout(tok, [list(range(len(PIECES)))])), tok, cfg).generate(["p"], 1)
    assert ro.loss_mask[0].tolist() == EXPECTED_KEEP and ro.metrics["self_search/searches_mean"] == 1.0


class _Inner(_Generates):
    def continue_ids(self, seqs, max_new, stop=(), greedy=False, seed=None):
        raise AssertionError("not generated here")


def test_sharded_trainings_synced_gpus_is_refused_through_the_sim2real_loop_and_passed_on_without_it():
    tok = PieceTokenizer(PIECES)
    on = RolloutConfig(self_search=SelfSearchConfig(enabled=True, sim2real=True))
    inner = _Inner(None)
    backend = SelfSearchBackend(inner, tok, on)
    backend.share_prompt_prefix = False  # any other option reaches the inner backend through the sim2real loop
    assert inner.share_prompt_prefix is False
    with pytest.raises(ConfigError, match="rollout.self_search.sim2real does not combine with sharded training .*"
                                          "search tool at different turns"):
        backend.synced_gpus = True  # what Distributed.prepare sets under FSDP / ZeRO-3
    assert not hasattr(inner, "synced_gpus")
    plain = SelfSearchBackend(inner, tok, RolloutConfig(self_search=SelfSearchConfig(enabled=True)))
    plain.synced_gpus = True  # one generate call per process: lockstep holds
    assert inner.synced_gpus is True


# ------------------------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("text,expected", [
    ("<think>t</think><answer>Paris</answer>", 1.0),                                  # no search: well-formed
    ("<think>t</think>\n<search>q</search>\n<information>i</information>\n<answer> Paris </answer>", 1.0),
    ("<think>a</think><search>q1</search><information>i</information><think>b</think>"
     "<search>q2</search><information></information><answer>P</answer>\n", 1.0),     # two rounds, empty info ok
    ("<answer>Paris</answer>", 0.0),                                                  # no think
    ("<think>t</think><search>q</search><answer>Paris</answer>", 0.0),                # a search without information
    ("<think>t</think><information>i</information><answer>P</answer>", 0.0),          # information without search
    ("<think>t</think><search> </search><information>i</information><answer>P</answer>", 0.0),  # empty query
    ("<think>t</think><answer> </answer>", 0.0),                                      # empty answer
    ("<think>t</think><answer>P</answer> and more", 0.0),                             # text after the answer
    ("<think>t</think><answer>P</answer><answer>Q</answer>", 0.0),                    # two answers
    ("<think>t <search>q</search></think><answer>P</answer>", 0.0),                   # a tag inside a block
    ("<think>t</think><search>q</search><information>i</information>", 0.0),          # no answer (truncated)
    ("<think>t</think>stray<answer>P</answer>", 0.0),                                 # text between blocks
])
def test_ssrl_format_by_hand(text, expected):
    assert ssrl_format_reward(None, [text]) == [expected]


def test_exact_match_normalises_and_takes_the_last_answer():
    comps = ["<answer> The Vistula! </answer>", "<answer>x</answer><answer>baltic  sea</answer>", "Vistula",
             "<answer>Vistulas</answer>"]
    gold = ["Vistula", "Baltic Sea", "Vistula", "Vistula"]
    assert qa_exact_match_reward(None, comps, answer=gold) == [1.0, 1.0, 0.0, 0.0]
    assert qa_exact_match_reward(None, ["<answer>NZ</answer>"], answer=[["New Zealand", "nz"]]) == [1.0]
    # the library's answer-tag reader (rewards/extract.py): tags in any case, the last opening tag before the last
    # closing one, Unicode dashes and spaces normalised on both sides (a U+2212 minus is "-", removed as punctuation)
    comps = ["<ANSWER>Vistula</Answer>", "<answer>x<answer>Vistula</answer>", "<answer>Jean\u2212Paul</answer>",
             "<answer>Jean-Paul</answer>", "<answer>Jean Paul</answer>"]
    assert qa_exact_match_reward(None, comps, answer=["Vistula", "Vistula", "Jean-Paul", "Jean\u2011Paul",
                                                       "Jean-Paul"]) == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_weighted_sum_is_the_piecewise_reward():
    lam = 0.2
    sources = build_rewards(RewardConfig(functions=[RewardFunctionConfig("qa_exact_match", 1 - lam),
                                                    RewardFunctionConfig("ssrl_format", lam)], isolation="none"))
    comps = ["<think>t</think><answer>Paris</answer>", "<answer>Paris</answer>",
             "<think>t</think><answer>Rome</answer>", "Rome"]
    total, _ = score(sources, ["p"] * 4, comps, [{"answer": "Paris"}] * 4)
    assert total == pytest.approx([1.0, 1 - lam, lam, 0.0])


# ------------------------------------------------------------------------------------------- sim2real
TOK = char_tokenizer()


def test_sim2real_inserts_the_search_tools_passages_as_information():
    cfg = RolloutConfig(self_search=SelfSearchConfig(enabled=True, sim2real=True), max_new_tokens=3000,
                        search_top_k=1, tool_output_max_tokens=2000)
    first, second = "<think>t</think><search>Vistula river sea</search>", "<answer>Baltic Sea</answer><|im_end|>"
    inner = Scripted([first, second], marker="<information>", tok=TOK)  # turn k after k <information> blocks
    backend = with_self_search(inner, TOK, cfg, evaluation=True)
    assert isinstance(backend, Sim2RealBackend)
    ro = backend.generate(["Q\n"], 1, greedy=True)
    index = index_for("")
    passages = format_results(index, index.top("Vistula river sea", 1))
    assert passages.startswith("[1] Vistula\n")
    block = information_text(passages)
    assert ro.completions == [first + block + "<answer>Baltic Sea</answer>"]
    assert inner.stops[0] == ["</search>"]  # generation stops at the query's end
    n_block = len(TOK(block, add_special_tokens=False)["input_ids"])
    assert ro.loss_mask[0].tolist() == [1] * len(first) + [0] * n_block + [1] * (len("<answer>Baltic Sea</answer>") + 1)
    assert ro.metrics["tools/calls_mean"] == 1.0 and ro.metrics["tools/search/calls"] == 1.0
    # the trainer's held-out eval: the self-search training backend hands over its sim2real loop
    train_backend = with_self_search(inner, TOK, cfg)
    assert isinstance(train_backend, SelfSearchBackend) and evaluation_backend(train_backend) is train_backend.sim2real
    off = RolloutConfig(self_search=SelfSearchConfig(enabled=True))
    assert evaluation_backend(with_self_search(inner, TOK, off)).__class__ is SelfSearchBackend
    assert with_self_search(inner, TOK, off, evaluation=True) is inner
    assert with_self_search(inner, TOK, RolloutConfig()) is inner  # off: the backend itself


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("extra,match", [
    (["rollout.tools=[calculator]"], "does not combine with rollout.tools"),
    (["rollout.tools=[search]"], "does not combine with rollout.tools"),
    (["rollout.environment=number_guess", "task.name=number_guess", "reward.functions=[{name: env_return}]"],
     "does not combine with rollout.environment"),
    (["rollout.retry_turns=2"], "does not combine with rollout.retry_turns"),
    (["algorithm.name=flowrl"], "mask_information=true is not supported for algorithm.loss=flowrl"),
])
def test_combinations_self_search_cannot_take_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["rollout.self_search.enabled=true", *extra])


@pytest.mark.parametrize("extra,key", [
    (["rollout.extra_rollouts=cure", "rollout.n=16"], "rollout.extra_rollouts=cure: CURE generates"),
    (["rollout.arrol.enabled=true"], "rollout.arrol.enabled: ARRoL generates"),
    (["rollout.semantic_tree.enabled=true"], "rollout.semantic_tree.enabled: ROSE generates"),
    (["rollout.mcts.enabled=true", "algorithm.advantage=deepsearch"], "rollout.mcts.enabled: DeepSearch generates"),
])
def test_round_builders_are_refused_and_plain_sampling_ones_allowed(extra, key):
    with pytest.raises(ConfigError, match=f"does not combine with {key} the training round its own way"):
        load_config(None, ["rollout.self_search.enabled=true", *extra])


def test_a_new_round_builder_is_refused_without_being_named_and_refuel_dars_are_allowed(monkeypatch):
    from anabranch.trainer import round_builders

    for extra in ("algorithm.name=refuel", "rollout.extra_rollouts=dars"):  # plain samples through the wrapper
        load_config(None, ["rollout.self_search.enabled=true", extra])
    new = round_builders.RoundBuilder("Newer", "rollout.newer.enabled", "rollout.newer.enabled=false",
                                      lambda cfg: cfg.rollout.self_search.mask_information, "x:y")
    monkeypatch.setattr(round_builders, "BUILDERS", (*round_builders.BUILDERS, new))
    with pytest.raises(ConfigError, match="with rollout.newer.enabled: Newer generates .*set rollout.newer.enabled=false"):
        load_config(None, ["rollout.self_search.enabled=true"])


@pytest.mark.parametrize("launch,refused", [("fsdp2.yaml", "FSDP"), ("deepspeed_zero3.yaml", "DeepSpeed ZeRO-3"),
                                            ("deepspeed_zero2.yaml", None), ("multi_gpu_ddp.yaml", None)])
def test_sim2real_is_refused_with_a_sharded_launch_config(launch, refused):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / launch
    args = ["rollout.self_search.enabled=true", f"distributed.accelerate_config={path}"]
    load_config(None, args)  # without sim2real: one generate call per process, fine sharded
    if refused is None:
        assert load_config(None, [*args, "rollout.self_search.sim2real=true"]).rollout.self_search.sim2real
        return
    with pytest.raises(ConfigError, match=f"sim2real=true does not combine with sharded training .*{refused}.*"
                                          "set rollout.self_search.sim2real=false"):
        load_config(None, [*args, "rollout.self_search.sim2real=true"])


@pytest.mark.parametrize("env", [{"ACCELERATE_USE_FSDP": "true"},
                                 {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}])
def test_sim2real_is_refused_inside_a_sharded_accelerate_launch(env, monkeypatch):
    args = ["rollout.self_search.enabled=true", "rollout.self_search.sim2real=true"]
    load_config(None, args)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=f"does not combine with sharded training \\({list(env)[-1]}"):
        load_config(None, args)


def test_keys_set_while_off_and_a_bad_corpus_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="rollout.self_search.enabled=true"):
        load_config(None, ["rollout.self_search.sim2real=true"])
    with pytest.raises(ConfigError, match="no effect unless rollout.tools=\\[search\\]"):  # corpus without sim2real
        load_config(None, ["rollout.self_search.enabled=true", "rollout.search_top_k=2"])
    with pytest.raises(ConfigError, match="rollout.search_corpus: no file"):
        load_config(None, ["rollout.self_search.enabled=true", "rollout.self_search.sim2real=true",
                           f"rollout.search_corpus={tmp_path / 'none.jsonl'}"])
    ok = load_config(None, ["rollout.self_search.enabled=true", "rollout.self_search.sim2real=true",
                            "rollout.search_top_k=2", "algorithm.name=flowrl",
                            "rollout.self_search.mask_information=false"])
    assert ok.rollout.self_search.sim2real and ok.rollout.search_top_k == 2


# ------------------------------------------------------------------------------------------- end to end
# What the scripted sampler writes (the tiny char model: one token per character): rows alternate between a response
# with a self-written <information> block, characters [34, 63), and one without.
WITH_INFO = "<think>t</think><search>q</search><information>xy</information><answer>a</answer>"
NO_INFO = "<think>t</think><answer>b</answer>"


def test_training_masks_the_information_the_policy_wrote_and_evaluates_with_real_search(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    from anabranch.rollout.hf_generate import HFGenerateBackend
    from anabranch.trainer import loop
    from anabranch.trainer.loop import train
    from test_train_e2e import tiny_overrides

    assert WITH_INFO.index("<information>") == 34 and WITH_INFO.index("</answer>") + len("</answer>") == 81

    def scripted_chunks(self, prompt_ids, prompt_mask, chunk, device, kwargs):
        rows = [self.tokenizer(WITH_INFO if i % 2 == 0 else NO_INFO, add_special_tokens=False)["input_ids"]
                + [self.eos_ids[0]] for i in range(prompt_ids.shape[0])]
        ids, _ = right_padded(rows, self.tokenizer.pad_token_id)
        return [ids], None

    updates, real_update = [], loop.policy_update

    def spy_update(model, optimizer, rollout, *args, **kwargs):
        updates.append((list(rollout.completions), rollout.trained_mask.clone()))
        return real_update(model, optimizer, rollout, *args, **kwargs)

    searched, original = [], Sim2RealBackend.generate

    def spy_search(self, prompts, n, **kw):
        searched.append((len(prompts), kw.get("greedy")))
        return original(self, prompts, n, **kw)

    monkeypatch.setattr(HFGenerateBackend, "_generate_chunks", scripted_chunks)  # training rounds only: the
    monkeypatch.setattr(loop, "policy_update", spy_update)                      # sim2real eval uses continue_ids
    monkeypatch.setattr(Sim2RealBackend, "generate", spy_search)
    overrides = tiny_overrides(tiny_model_dir, "unused", tmp_path / "run", **{
        "task.name": "search_qa", "task.eval_size": 1, "trainer.steps": 2, "rollout.n": 2,
        "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 96, "task.max_prompt_tokens": 1024,
        "rollout.self_search.enabled": "true", "rollout.self_search.sim2real": "true",
        "reward.functions": "[{name: qa_exact_match, weight: 0.8}, {name: ssrl_format, weight: 0.2}]",
        "reward.isolation": "none"})
    result = train(load_config(None, [o for o in overrides if not o.startswith("task.path=")]))
    steps = [m for m in result.history if "self_search/searches_mean" in m]
    assert len(steps) == 2
    for m in steps:  # per step two rows of each: 2·29 information tokens of 2·82 + 2·35
        assert m["self_search/searches_mean"] == 0.5
        assert m["self_search/masked_token_frac"] == pytest.approx(58 / 234)
    with_info = [1] * 34 + [0] * 29 + [1] * 19  # the answer's 18 tokens and EOS trained
    no_info = [1] * 35 + [0] * 47                # through EOS, then padding
    assert len(updates) == 2
    for completions, trained in updates:
        assert sorted(completions) == sorted([WITH_INFO, NO_INFO] * 2)
        assert [row.tolist() for row in trained] == [with_info if c == WITH_INFO else no_info for c in completions]
    assert searched and all(greedy for _, greedy in searched)  # the held-out evals ran the sim2real loop
