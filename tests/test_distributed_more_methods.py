"""TRLOO, RLTF-SD, AMPO, scaffolding's IRT schedule, CURE and ROSE under data parallelism (2 gloo CPU processes
against one process).

docs/distributed.md says how each behaves when the batch is split over ranks (whole prompt groups per rank);
each claim is checked here on a fixed global batch of 4 prompts (rank 0 holds prompts 0-1, rank 1 prompts 2-3):

* TRLOO: the leave-one-out baseline is within a group, so within a rank: each rank's advantages are the
  one-process advantages of its rows.
* RLTF-SD: the distillation term is HPT's extra term, scaled by W/N with N the **all-reduced** distilled token
  count: one 2-process update (TRLOO + the term) gives the one-process gradient and weights, with the ranks
  distilling unequal amounts, and also when one rank distils nothing (it must still join the count).
* AMPO: each rank guides its own all-fail groups; the counts are **summed** over ranks, and a rank that injected
  nothing still takes the shaped path (an all-false mask). Rank 0 holds both all-fail groups, rank 1 none: the
  update is the one-process update and the ``ampo/*`` counts the one-process ones on both ranks.
* Scaffolding's ``schedule=irt``: each rank fits its own groups, then every rank's new per-prompt ratios are
  **all-gathered**, so both ranks hold the one-process table (and its counts, summed).
* CURE and ROSE: each rank branches (grows the trees of) its own prompts, with the entropy / leaf-scoring
  forwards of its own policy copy and no state: with a deterministic backend, each rank's rows, masks and tree
  rows and its advantages are the one-process ones of its prompts.

Everything runs in one spawn (a process group costs more than these tiny steps), the one-process baselines too:
each rank computes half of them before it joins the process group (a plain process, so no collective can reach
them), the two halves on the two cores at once, and loads the tiny model from disk once.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config
from anabranch.algorithms import resolve_algorithm
from anabranch.rollout.base import Rollout
from anabranch.trainer.distributed import Distributed
import test_ampo  # noqa: F401  (registers ampo_test_reward, in the spawned processes too)
import test_hint_irt  # noqa: F401  (registers irt_test_reward, likewise)
from hash_backend import HashBackend
from test_train_e2e import tiny_overrides
from two_process import join_gloo, spawn_two

PROMPTS, N, P, W, K = 4, 3, 5, 10, 3  # prompts, samples per prompt, prompt width, response width, attempts
SHARES = ([0, 1], [2, 3])
# Each sample's attempt grades (1 right, 0 wrong, −1 not made), per group. RLTF-SD's weights w = r_k − the group's
# mean first-attempt grade: rank 0 distils 6 retries (groups 0, 1), rank 1 three (groups 2, 3).
GRADES = [[[0, 1, -1], [0, 0, 1], [1, -1, -1]], [[0, 0, 0], [1, -1, -1], [0, 1, -1]],
          [[0, 0, 1], [1, -1, -1], [1, -1, -1]], [[1, -1, -1], [1, -1, -1], [0, 1, -1]]]
# Rank 1's groups solved at once: it distils nothing and must still join the token count's all-reduce.
ONE_SIDED = GRADES[:2] + [[[1, -1, -1]] * 3] * 2
RETRY_CASES = {"uneven": GRADES, "one_sided": ONE_SIDED}
# Scaffolding (irt): ratios stored at an earlier visit (a resume gives every rank rank 0's table).
IRT_STORED = {1: 0.5, 2: 0.25}
DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"


def rows_of(prompt_ids: list[int], n: int = N) -> list[int]:
    return [p * n + k for p in prompt_ids for k in range(n)]


def base_cfg(model_dir: str, *extra: str):
    return load_config(None, [f"model.path={model_dir}", f"rollout.prompts_per_step={PROMPTS}", "trainer.device=cpu",
                              "trainer.lr=1e-3", "trainer.grad_clip=0", "trainer.micro_batch_size=4", *extra])


_LOADED: dict = {}  # model path -> the model as loaded, never trained: each use gets a copy


def load(cfg, dist: Distributed):
    from anabranch.models.loading import load_model
    from anabranch.trainer.components import build_optimizer

    torch.manual_seed(0)
    if cfg.model.path not in _LOADED:  # every config here loads the model the same way (base_cfg)
        _LOADED[cfg.model.path] = load_model(cfg.model, torch.device("cpu"))
    model = copy.deepcopy(_LOADED[cfg.model.path])
    c = SimpleNamespace(cfg=cfg, model=model, optimizer=build_optimizer(cfg, model, {}))
    dist.prepare(c)
    return c


def update_result(model, metrics: dict, dist: Distributed) -> dict:
    return {"metrics": dist.mean_metrics(metrics),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ----------------------------------------------------------------------------- TRLOO and RLTF-SD: retry episodes

def retry_rollout(prompt_ids: list[int], grades=GRADES) -> tuple[Rollout, torch.Tensor]:
    """"Try again" episodes of the global prompts (no sampling): attempts of 1-2 tokens separated by one feedback
    token (loss_mask 0), the grades as ``attempt_correct``; the sequence reward is the last attempt's grade."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 90, (PROMPTS * N, P + W), generator=g)
    lens = torch.randint(1, 3, (PROMPTS * N, K), generator=g)
    table = torch.tensor([row for group in grades for row in group])
    rows = rows_of(prompt_ids)
    resp_mask, loss_mask = torch.zeros(len(rows), W, dtype=torch.long), torch.zeros(len(rows), W, dtype=torch.long)
    for i, r in enumerate(rows):
        pos, made = 0, int((table[r] >= 0).sum())
        for k in range(made):
            loss_mask[i, pos:pos + int(lens[r, k])] = 1
            pos += int(lens[r, k]) + (k < made - 1)  # the feedback token after every attempt but the last
        resp_mask[i, :pos] = 1
    prompt_mask = torch.ones(len(rows), P, dtype=torch.long)
    prompt_mask[:, 0] = torch.tensor([r % 2 for r in rows]) ^ 1  # some left padding
    solved = torch.tensor([float((table[r] == 1).any()) for r in rows])
    ro = Rollout(prompt_ids=ids[rows, :P] * prompt_mask, prompt_mask=prompt_mask, response_ids=ids[rows, P:] * resp_mask,
                 response_mask=resp_mask, group_index=torch.arange(len(prompt_ids)).repeat_interleave(N),
                 prompts=[f"q{p}" for p in prompt_ids], completions=[f"c{r}" for r in rows],
                 truncated=torch.zeros(len(rows), dtype=torch.bool), loss_mask=loss_mask, attempt_correct=table[rows])
    return ro, solved


def retry_cfg(model_dir: str, sd_coef: float = 0.0):
    return base_cfg(model_dir, f"rollout.n={N}", "rollout.retry_turns=3", "algorithm.advantage=trloo",
                    "reward.functions=[math_verify]", f"algorithm.rltf_sd_coef={sd_coef}")


def trloo_advantages(model_dir: str, dist: Distributed, prompt_ids: list[int]) -> torch.Tensor:
    from anabranch.trainer.advantage_pass import compute_advantages

    cfg = retry_cfg(model_dir)
    c = load(cfg, dist)
    rollout, rewards = retry_rollout(prompt_ids)
    return compute_advantages(resolve_algorithm(cfg.algorithm), c.model, rollout, rewards, micro_batch_size=4,
                              temperature=1.0, dist=dist.active).advantages


def rltf_update(model_dir: str, dist: Distributed, prompt_ids: list[int], case: str, coef: float = 0.5) -> dict:
    """One update of TRLOO with RLTF-SD's term (``coef``; 0: without it) on ``prompt_ids``, as the loop runs it."""
    from anabranch.models.tiny import char_tokenizer
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.rltf_sd_step import RLTFSD
    from anabranch.trainer.step import policy_update

    cfg = retry_cfg(model_dir, coef)
    c = load(cfg, dist)
    algo = resolve_algorithm(cfg.algorithm)
    rollout, rewards = retry_rollout(prompt_ids, RETRY_CASES[case])
    adv = compute_advantages(algo, c.model, rollout, rewards, micro_batch_size=4, temperature=1.0, dist=dist.active)
    extra, step_metrics, spans = None, {}, 0
    if coef > 0:
        sd = RLTFSD(cfg, char_tokenizer(), dist)
        part = sd.step(rollout)
        spans = 0 if part.batch is None else len(part.weight)
        extra = part.extra_loss(sd, dist.policy(c.model), dist.active)
        step_metrics = part.metrics
    metrics = policy_update(dist.policy(c.model), c.optimizer, rollout, adv.advantages, rewards, algo,
                            micro_batch_size=4, grad_clip=0.0, temperature=1.0, max_response_len=W,
                            dist=dist.active, extra_loss=extra)
    return {**update_result(c.model, {**metrics, **step_metrics}, dist), "spans": spans}


# ----------------------------------------------------------------------------- AMPO and scaffolding: built runs

def ampo_components(model_dir: str, data: str, out: str):
    from anabranch.trainer.components import build

    cfg = load_config(None, tiny_overrides(model_dir, data, out, **{
        "task.eval_size": 2, "rollout.n": N, "rollout.max_new_tokens": 6, "reward.isolation": "none",
        "reward.functions": "[ampo_test_reward]", "algorithm.ampo.enabled": True, "algorithm.ampo.num_replace": 1,
        "trainer.lr": 1e-3, "trainer.grad_clip": 0, "trainer.micro_batch_size": 4}))
    return cfg, build(cfg)


def ampo_step(model_dir: str, data: str, out: str, dist: Distributed) -> dict:
    """AMPO's step and one update on this rank's share of a batch of [fail, fail, free, free] prompts (sampled with
    the same seed everywhere, so rank r's rows are the one-process batch's rows of its groups)."""
    from anabranch.trainer.ampo_step import AMPO
    from anabranch.trainer.collect import generate_scored, select_groups
    from anabranch.trainer.step import policy_update

    cfg, c = ampo_components(model_dir, data, out)
    dist.prepare(c)
    fail = [i for i, r in enumerate(c.train_rows) if r["answer"] != "free"]
    free = [i for i, r in enumerate(c.train_rows) if r["answer"] == "free"]
    torch.manual_seed(1)  # after prepare's per-rank seed: the same samples on every rank and in one process
    batch = generate_scored(c, [fail[0], fail[1], free[0], free[1]], cfg, step=1)
    batch = select_groups(batch, dist.shard(list(range(PROMPTS))))
    part = AMPO.create(cfg, dist, c).step(c, batch)
    new = part.batch
    rewards = torch.tensor(new.total)
    adv = c.algo.advantage(rewards, new.rollout.group_index, new.rollout.trained_mask.float(), c.algo.cfg)
    metrics = policy_update(dist.policy(c.model), c.optimizer, new.rollout, adv, rewards, c.algo, micro_batch_size=4,
                            grad_clip=0.0, temperature=cfg.rollout.temperature,
                            max_response_len=cfg.rollout.max_new_tokens, dist=dist.active,
                            precomputed=part.precomputed({}))
    return {**update_result(c.model, metrics, dist), "step_metrics": dict(new.metrics),
            "injected": part.injected, "completions": list(new.rollout.completions), "total": list(new.total)}


def irt_step(model_dir: str, data: str, out: str, dist: Distributed) -> dict:
    """Scaffolding's IRT rounds on this rank's share of the 4 prompts (irt_test_reward: a group's accuracy is the
    share of its solution shown, whatever the samples), two of them starting from stored ratios."""
    from anabranch.trainer.collect import generate_scored
    from anabranch.trainer.components import build
    from anabranch.trainer.scaffold_step import Scaffold

    cfg = load_config(None, tiny_overrides(model_dir, data, out, **{
        "task.eval_size": 1, "rollout.n": 4, "rollout.max_new_tokens": 2, "reward.isolation": "none",
        "reward.functions": "[irt_test_reward]", "algorithm.scaffold.enabled": True,
        "algorithm.scaffold.schedule": "irt", "algorithm.scaffold.irt_tolerance": 0.1,
        "algorithm.scaffold.hint_template": "'Start: {prefix}'"}))
    c = build(cfg)
    dist.prepare(c)
    batch = generate_scored(c, dist.shard(list(range(PROMPTS))), cfg, step=1)
    scaffold = Scaffold.create(cfg, dist, c)
    scaffold.irt.stored.update({c.train_prompts[i]: v for i, v in IRT_STORED.items()})
    part = scaffold.step(c, batch, step=1)
    keys = {c.train_prompts[i]: i for i in range(PROMPTS)}
    return {"stored": {keys[k]: v for k, v in scaffold.irt.stored.items()}, "metrics": dict(part.metrics),
            "total": list(part.batch.total)}


# ----------------------------------------------------------------------------- CURE and ROSE: branching rollouts

BRANCH_CFGS = {
    "cure": ["rollout.n=4", "rollout.extra_rollouts=cure", "rollout.cure_originals=2", "rollout.cure_branches=1",
             "rollout.cure_top_k=1", "rollout.cure_min_token_chars=1", "rollout.max_new_tokens=6"],
    "rose": [f"rollout.n={N}", "rollout.semantic_tree.enabled=true", "rollout.semantic_tree.epsilon=0",
             "algorithm.advantage=rose", "rollout.max_new_tokens=6"],
}


def branch_rollout(model_dir: str, dist: Distributed, case: str, prompt_ids: list[int]) -> dict:
    """CURE's stage-1 rollout or ROSE's trees of ``prompt_ids`` (the deterministic backend), and their advantages
    for a reward read off the rows (1 when the response's token sum is even)."""
    from anabranch.models.tiny import char_tokenizer
    from anabranch.rollout.semantic_tree import tree_round
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.cure_rollouts import cure_generate

    cfg = base_cfg(model_dir, *BRANCH_CFGS[case])
    c = load(cfg, dist)
    with torch.no_grad():  # sharper logits than the random init's: entropies differ clearly between positions
        c.model.model.norm.weight.mul_(4.0)
    tok = char_tokenizer()
    c.backend, c.tokenizer = HashBackend(tok, cfg.rollout.max_new_tokens), tok
    prompts = [f"Q{p}: branch" for p in prompt_ids]
    rollout = (cure_generate if case == "cure" else tree_round)(c, prompts, cfg)
    rewards = torch.tensor([float(int(rollout.response_ids[i][rollout.response_mask[i].bool()].sum()) % 2 == 0)
                            for i in range(len(rollout.completions))])
    adv = compute_advantages(resolve_algorithm(cfg.algorithm), c.model, rollout, rewards, micro_batch_size=4,
                             temperature=1.0, dist=dist.active)
    return {"rows": [row_view(rollout, i) for i in range(len(rollout.completions))], "adv": adv.advantages,
            "rewards": rewards, "metrics": dict(rollout.metrics), "tree": rollout.semantic_tree}


def row_view(r: Rollout, i: int) -> dict:
    """Row ``i`` without its padding (ranks pad to their own batch's widths); a tree row as (leaf slot, the node it
    branched at, branch position). The node, not the parent slot: a leaf branched at position k holds its source
    leaf's context at k, so their scores there tie exactly in exact arithmetic and float noise of the batch's shape
    picks either; both are the same node, with the same prefix, tokens and advantages (algorithms/rose.py Tree.node)."""
    from anabranch.algorithms.rose import group_trees

    n = int(r.response_mask[i].sum())
    view = {"prompt": r.prompt_tokens(i), "response": r.response_ids[i, :n].tolist(),
            "trained": r.trained_mask[i, :n].tolist(), "truncated": bool(r.truncated[i]), "tree": None}
    if r.semantic_tree is not None:
        slot, _, k = r.semantic_tree[i].tolist()
        tree, _ = group_trees(r.semantic_tree, r.group_index, r.response_mask.sum(-1))[int(r.group_index[i])]
        view["tree"] = (slot, tree.node(slot, k), k)
    return view


# ----------------------------------------------------------------------------- the spawn

def write_data(out: Path) -> dict:
    """The two built runs' training files: AMPO's (fail/free rows with teacher solutions) and the IRT's."""
    from test_ampo import SOLUTIONS

    out.mkdir(parents=True, exist_ok=True)
    ampo = [{"prompt": f"Q{i}: count", "answer": "free" if i % 2 else "12345", "teacher_solutions": SOLUTIONS}
            for i in range(8)]
    sol = " ".join(f"s{j}" for j in range(1, 9))
    irt = [{"prompt": f"Q{i}: count", "answer": "x", "solution": sol} for i in range(PROMPTS + 1)]  # 1 held out
    paths = {}
    for name, rows in (("ampo", ampo), ("irt", irt)):
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def one_process(model_dir: str, data: dict, out: str) -> dict:
    """The one-process baselines (all 4 prompts, no process group), as callables; ``rltf/<case>/0``: without the
    term. Split between the ranks by cost (SINGLE_SHARES)."""
    full, none = list(range(PROMPTS)), Distributed()
    jobs = {"trloo": lambda: trloo_advantages(model_dir, none, full),
            "ampo": lambda: ampo_step(model_dir, data["ampo"], str(Path(out) / "ampo_single"), none),
            "irt": lambda: irt_step(model_dir, data["irt"], str(Path(out) / "irt_single"), none)}
    for case in RETRY_CASES:
        jobs[f"rltf/{case}"] = lambda case=case: rltf_update(model_dir, none, full, case)
        jobs[f"rltf/{case}/0"] = lambda case=case: rltf_update(model_dir, none, full, case, coef=0.0)
    for case in BRANCH_CFGS:
        jobs[case] = lambda case=case: branch_rollout(model_dir, none, case, full)
    return jobs


# The baselines each rank computes (about the same CPU time each; together, all of one_process's).
SINGLE_SHARES = (["trloo", "rltf/uneven", "rltf/uneven/0", "ampo", "cure"],
                 ["rltf/one_sided", "rltf/one_sided/0", "irt", "rose"])


def _worker(rank: int, world: int, port: int, model_dir: str, data: dict, out: str) -> None:
    torch.set_num_threads(1)  # as join_gloo sets it: one thread per rank on 2 cores
    jobs = one_process(model_dir, data, out)
    single = {name: jobs[name]() for name in SINGLE_SHARES[rank]}  # before the process group exists
    join_gloo(rank, world, port)  # one-minute collective timeout: a regression fails, not hangs
    dist = Distributed.start(base_cfg(model_dir))
    mine = dist.shard(list(range(PROMPTS)))
    res = {"prompts": mine, "trloo": trloo_advantages(model_dir, dist, mine)}
    res["rltf"] = {case: rltf_update(model_dir, dist, mine, case) for case in RETRY_CASES}
    res["ampo"] = ampo_step(model_dir, data["ampo"], str(Path(out) / f"ampo{rank}"), dist)
    res["irt"] = irt_step(model_dir, data["irt"], str(Path(out) / f"irt{rank}"), dist)
    res.update({case: branch_rollout(model_dir, dist, case, mine) for case in BRANCH_CFGS})
    torch.save({**res, "single": single}, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def data_paths(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("more_dp_data"))


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, data_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("more_dp")
    spawn_two(_worker, tiny_model_dir, data_paths, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def baselines(ranks):
    """The one-process baselines, by one_process's names (each computed once, by one of the ranks)."""
    out = {**ranks[0]["single"], **ranks[1]["single"]}
    assert sorted(out) == sorted(SINGLE_SHARES[0] + SINGLE_SHARES[1]) == sorted(one_process("", {}, ""))
    return out


def assert_same_update(got: dict, single: dict) -> None:
    for name, g in single["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    for name, w in single["weights"].items():  # Adam's first step: see test_extra_loss_distributed.py
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=2e-5)
    assert got["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-4, abs=1e-6)


def assert_replicas_equal(a: dict, b: dict) -> None:
    for name, w in a["weights"].items():
        assert torch.equal(w, b["weights"][name]), name


def grads_differ(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a["grads"][n], b["grads"][n], rtol=1e-3, atol=1e-6) for n in a["grads"])


# ----------------------------------------------------------------------------- the checks

def test_the_ranks_hold_whole_groups(ranks):
    assert [r["prompts"] for r in ranks] == list(SHARES)


def test_trloo_advantages_are_the_one_process_ones_row_by_row(ranks, baselines):
    single = baselines["trloo"]
    assert (single > 0).any() and (single < 0).any()  # a real leave-one-out, not all zeros
    for rank, share in zip(ranks, SHARES):
        torch.testing.assert_close(rank["trloo"], single[rows_of(share)], rtol=0, atol=1e-7)


@pytest.mark.parametrize("case", list(RETRY_CASES))
def test_rltf_sd_two_processes_give_the_one_process_update(ranks, baselines, case):
    single, without = baselines[f"rltf/{case}"], baselines[f"rltf/{case}/0"]
    assert grads_differ(single, without)  # the term is really in the update
    spans = [rank["rltf"][case]["spans"] for rank in ranks]
    assert spans == ([6, 3] if case == "uneven" else [6, 0])  # unequal amounts; one-sided: rank 1 distils none
    assert single["spans"] == sum(spans)
    for rank in ranks:
        got = rank["rltf"][case]
        assert_same_update(got, single)
        for key in ("rltf/sd_loss", "rltf/distilled_frac"):  # global values (N all-reduced; the episodes' fraction)
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-7), key
    assert_replicas_equal(ranks[0]["rltf"][case], ranks[1]["rltf"][case])


def test_ampo_guides_each_ranks_groups_sums_the_counts_and_gives_the_one_process_update(ranks, baselines):
    single = baselines["ampo"]
    assert single["injected"].tolist() == [False, False, True] * 2 + [False] * 6  # groups 0, 1 (rank 0's) guided
    assert single["step_metrics"]["ampo/guided_groups"] == 2
    r0, r1 = ranks[0]["ampo"], ranks[1]["ampo"]
    assert r0["injected"].tolist() == single["injected"][:6].tolist()
    # Rank 1 guided nothing but another rank did: an all-false mask (the shaped path), not None.
    assert r1["injected"] is not None and not r1["injected"].any() and len(r1["injected"]) == 6
    for rank, share in zip(ranks, SHARES):
        got = rank["ampo"]
        rows = rows_of(share)
        assert got["completions"] == [single["completions"][i] for i in rows]  # its groups, as one process has them
        assert got["total"] == [single["total"][i] for i in rows]
        for key in ("ampo/guided_groups", "ampo/no_candidate_groups", "ampo/selected_logprob", "ampo/pre_accuracy"):
            assert got["step_metrics"][key] == pytest.approx(single["step_metrics"][key], rel=1e-5), key
        assert_same_update(got, single)
    assert_replicas_equal(r0, r1)


def test_scaffold_irt_ratios_are_gathered_into_one_table(ranks, baselines):
    single = baselines["irt"]
    assert sorted(single["stored"]) == list(range(PROMPTS))  # every prompt was hinted and got a new ratio
    assert single["stored"] != {**single["stored"], **IRT_STORED}  # the step really refitted the stored ones
    for rank, share in zip(ranks, SHARES):
        got = rank["irt"]
        assert got["stored"] == pytest.approx(single["stored"], rel=1e-9)  # the whole table, not its own prompts'
        assert got["total"] == [single["total"][i] for i in rows_of(share, 4)]
        for key in ("scaffold/hinted_groups", "scaffold/hint_ratio", "scaffold/pre_accuracy",
                    "scaffold/irt_accuracy", "scaffold/irt_rounds"):
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-9), key


@pytest.mark.parametrize("case", list(BRANCH_CFGS))
def test_branching_rollouts_and_their_advantages_are_per_rank(ranks, baselines, case):
    single = baselines[case]
    n = 4 if case == "cure" else N
    if case == "cure":  # branches really were grown at different critical tokens (prefix + untrained part)
        assert any(0 in r["trained"] for r in single["rows"])
        assert len({r["trained"].index(1) for r in single["rows"] if 0 in r["trained"]}) > 1
    else:  # trees really branched inside responses, at different depths
        assert len({r["tree"][2] for r in single["rows"] if r["tree"][1] != ("root",)}) > 1
    assert (single["adv"] != 0).any()
    for rank, share in zip(ranks, SHARES):
        got, rows = rank[case], rows_of(share, n)
        assert got["rows"] == [single["rows"][i] for i in rows]
        torch.testing.assert_close(got["rewards"], single["rewards"][rows])
        width = got["adv"].shape[1]
        torch.testing.assert_close(got["adv"], single["adv"][rows, :width], rtol=0, atol=1e-7)
        assert not single["adv"][rows, width:].any()


def test_the_doc_states_what_these_tests_check():
    text = " ".join(DOC.read_text().split())
    for claim in ("`tests/test_distributed_more_methods.py` TRLOO, RLTF-SD, AMPO, scaffolding's IRT table, CURE and ROSE",
                  "TRLOO's leave-one-out is within a group, so within a rank",
                  "scaled by W/N with N all-reduced",
                  "act on each rank's own all-fail groups and sum their counts over ranks",
                  "then all-gathers the ratios each rank stored this step so that every rank holds",
                  "CURE branches each rank's own rows",
                  "ROSE (`rollout.semantic_tree`) grows each rank's own trees"):
        assert claim in text, claim
