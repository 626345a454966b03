"""OREAL and ALP under data parallelism (2 gloo CPU processes against one process).

docs/distributed.md says how each behaves when the batch is split over ranks (whole prompt groups per rank).
Both claims are checked here on tests/test_distributed.py's fixed batch (4 prompts × 3 samples, ragged responses;
rank 0 holds prompts 0-1, rank 1 prompts 2-3):

* OREAL (``algorithms/oreal.py``): its precompute hook's normalizers (the correct and wrong samples' token counts
  T+ / T−, the token head's sequence count N) are summed over the ranks and divided by W, as DDP averages the
  gradients, so one 2-process update is the one-process update of the union batch: the policy's gradient,
  weights and loss, and with the token-level reward head (an extra head, its gradient averaged by
  ``Distributed.clip_grad_norm``) the head's gradient too. The outcomes are chosen so that the ranks' T+ and T−
  both differ (rank 0: 10 and 8 tokens, rank 1: 11 and 3), so per-rank counts would fail the check.
* ALP (``algorithms/alp.py``): each rank draws its own noise (the seed mixes in the rank) and DDP averages the
  gradients, so the policy's and log σ's gradients are the mean of what each rank computes alone, in one
  process, on its rows with its own noise; both ranks then hold the same σ. ``seq-mean-token-mean`` with 6
  sequences per rank makes DDP's average the plain mean (with ``token-mean`` it would be the mean weighted by the
  ranks' token counts).

Everything runs in one spawn (a process group costs more than these tiny updates).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config
from anabranch.algorithms import resolve_algorithm
from anabranch.trainer.distributed import Distributed
from test_distributed import N, PROMPTS, R, fixed_rollout
from two_process import join_gloo, spawn_two

SHARES = ([0, 1], [2, 3])  # each rank's prompts
# OREAL's outcomes per group (reward > 0.5 is correct): every group mixed but group 3's split differs, so that
# T+ = 10, T− = 8 on rank 0 and T+ = 11, T− = 3 on rank 1 (response lengths [[2,5,3],[2,3,3],[1,5,4],[2,1,1]]).
OREAL_REWARDS = [[0, 1, 0], [1, 1, 0], [0, 1, 1], [1, 0, 0]]
ALP_SEED = 7
DOC = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"

CFGS = {"oreal": ["algorithm.name=oreal", "algorithm.kl_coef=0"],
        "oreal_rm": ["algorithm.name=oreal", "algorithm.kl_coef=0", "algorithm.oreal_token_rm=true"],
        # A large σ so that the noise moves the log-probs (and each rank's draw gives another gradient).
        "alp": ["algorithm.name=grpo", "algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.alp.enabled=true",
                "algorithm.alp.init_std=0.3", f"algorithm.alp.seed={ALP_SEED}", "algorithm.alp.lr_multiplier=10"]}


def step_cfg(model_dir: str, extra: list[str]):
    return load_config(None, [f"model.path={model_dir}", f"rollout.prompts_per_step={PROMPTS}", f"rollout.n={N}",
                              "trainer.device=cpu", "trainer.lr=1e-3", "trainer.grad_clip=0",
                              "trainer.micro_batch_size=4", *extra])


def update(model_dir: str, dist: Distributed, case: str, prompt_ids: list[int], noise_rank: int | None = None,
           unscaled: bool = False) -> dict:
    """One policy update of ``case`` on ``prompt_ids``. ``noise_rank``: ALP's noise as that rank draws it (one
    process computing a rank's alone-update); ``unscaled``: OREAL's precompute hook without the division by W."""
    import dataclasses

    from anabranch.algorithms.oreal import TOKEN_RM, oreal_precompute
    from anabranch.models.loading import load_model
    from anabranch.trainer.components import build_optimizer
    from anabranch.trainer.step import policy_update

    cfg = step_cfg(model_dir, CFGS[case])
    algo = resolve_algorithm(cfg.algorithm)
    torch.manual_seed(0)
    model = load_model(cfg.model, torch.device("cpu"))
    modules = {name: make(model.config, algo.cfg) for name, make in algo.module_factories.items()}
    if TOKEN_RM in modules:  # a head that has learned something: ω ≠ 0 (zero-initialized, no token is weighted)
        with torch.no_grad():
            modules[TOKEN_RM].proj.weight.copy_(torch.randn(modules[TOKEN_RM].proj.weight.shape,
                                                            generator=torch.Generator().manual_seed(1)))
    if noise_rank is not None:
        scales = modules["alp"]
        real = type(scales).perturb
        scales.perturb = lambda m, rank=0: real(scales, m, rank=noise_rank)
    if unscaled:
        def times_w(cfg_, pre, mask, rewards, groups, dist=None):  # the counts summed over ranks, not divided by W
            out = oreal_precompute(cfg_, pre, mask, rewards, groups, dist)
            w = 1 if dist is None else dist.world_size
            out.update(oreal_coef=out["oreal_coef"] / w, oreal_rm_weight=out["oreal_rm_weight"] / w)
            return out

        algo = dataclasses.replace(algo, precompute=times_w)
    c = SimpleNamespace(cfg=cfg, model=model, optimizer=build_optimizer(cfg, model, modules))
    dist.prepare(c)
    rollout, rewards = fixed_rollout(prompt_ids)
    if case.startswith("oreal"):
        rewards = torch.tensor([float(r) for p in prompt_ids for r in OREAL_REWARDS[p]])
    adv = algo.advantage(rewards, rollout.group_index, rollout.response_mask.float(), algo.cfg)
    metrics = policy_update(dist.policy(c.model), c.optimizer, rollout, adv, rewards, algo, micro_batch_size=4,
                            grad_clip=0.0, temperature=1.0, max_response_len=R, dist=dist.active, modules=modules)
    heads = {f"{m}.{n}": p for m, mod in modules.items() for n, p in mod.named_parameters()}
    return {"metrics": dist.mean_metrics(metrics),
            "grads": {n: p.grad.clone() for n, p in c.model.named_parameters() if p.grad is not None},
            "weights": {n: p.detach().clone() for n, p in c.model.named_parameters()},
            "head_grads": {n: p.grad.clone() for n, p in heads.items()},
            "heads": {n: p.detach().clone() for n, p in heads.items()},
            "passes": int(modules["alp"].passes) if "alp" in modules else None}


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_gloo(rank, world, port)  # one-minute collective timeout: a regression fails, not hangs
    dist = Distributed.start(step_cfg(model_dir, []))
    mine = dist.shard(list(range(PROMPTS)))
    res = {case: update(model_dir, dist, case, mine) for case in CFGS}
    res["oreal_unscaled"] = update(model_dir, dist, "oreal", mine, unscaled=True)
    res["prompts"] = mine
    torch.save(res, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("oreal_alp_dp")
    spawn_two(_worker, tiny_model_dir, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_close_grads(got: dict, want: dict, key: str = "grads") -> None:
    for name, g in want[key].items():
        torch.testing.assert_close(got[key][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def same_as_one_process(ranks: list[dict], case: str, single: dict) -> None:
    for rank in ranks:
        got = rank[case]
        assert_close_grads(got, single)
        assert_close_grads(got, single, "head_grads")
        for name, w in single["weights"].items():  # Adam's first step: see test_extra_loss_distributed.py
            torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=2e-5)
        assert got["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-4, abs=1e-6)
    for key in ("weights", "heads"):  # the replicas stay identical
        for name, w in ranks[0][case][key].items():
            assert torch.equal(w, ranks[1][case][key][name]), name


def grads_differ(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a["grads"][n], b["grads"][n], rtol=1e-3, atol=1e-6) for n in b["grads"])


def test_the_ranks_hold_whole_groups(ranks):
    assert [r["prompts"] for r in ranks] == list(SHARES)


def test_oreal_normalizers_differ_between_the_ranks():
    """The batch is built so that per-rank T+ / T− are not the global ones (else the DDP test could not tell)."""
    counts = []
    for share in SHARES:
        ro, _ = fixed_rollout(share)
        tokens = ro.response_mask.sum(-1)
        correct = torch.tensor([r > 0.5 for p in share for r in OREAL_REWARDS[p]])
        counts.append((int(tokens[correct].sum()), int(tokens[~correct].sum())))
    assert counts == [(10, 8), (11, 3)]


@pytest.mark.parametrize("case", ["oreal", "oreal_rm"])
def test_oreal_two_processes_give_the_one_process_update(tiny_model_dir, ranks, case):
    single = update(tiny_model_dir, Distributed(), case, list(range(PROMPTS)))
    assert max(g.abs().max() for g in single["grads"].values()) > 1e-5  # the update is not empty
    assert single["metrics"]["oreal/pos_token_frac"] > 0
    if case == "oreal_rm":
        assert single["head_grads"] and all(g.abs().max() > 0 for g in single["head_grads"].values())
        assert single["metrics"]["oreal/pos_weight_mean"] + single["metrics"]["oreal/neg_weight_mean"] > 0
    same_as_one_process(ranks, case, single)


def test_oreal_counts_not_divided_by_the_world_size_give_another_update(tiny_model_dir, ranks):
    # The check above fails for a hook that sums the counts over ranks without dividing by W: half the gradient.
    single = update(tiny_model_dir, Distributed(), "oreal", list(range(PROMPTS)))
    assert grads_differ(ranks[0]["oreal_unscaled"], single)
    torch.testing.assert_close(ranks[0]["oreal_unscaled"]["grads"], {n: g / 2 for n, g in single["grads"].items()},
                               rtol=1e-4, atol=1e-7)


def test_alp_gradients_are_the_mean_of_each_ranks_own_noise(tiny_model_dir, ranks):
    alone = [update(tiny_model_dir, Distributed(), "alp", share, noise_rank=r) for r, share in enumerate(SHARES)]
    mean = {key: {n: (alone[0][key][n] + alone[1][key][n]) / 2 for n in alone[0][key]}
            for key in ("grads", "head_grads")}
    assert mean["head_grads"]["alp.log_sigma"].abs().min() > 0  # σ gets a gradient in every layer
    for rank, own in zip(ranks, alone):
        got = rank["alp"]
        assert_close_grads(got, mean)
        assert_close_grads(got, mean, "head_grads")
        assert got["passes"] == own["passes"] >= 1  # the same draws (pass counter) as the rank's alone-update
    torch.testing.assert_close(ranks[0]["alp"]["heads"]["alp.log_sigma"], ranks[1]["alp"]["heads"]["alp.log_sigma"],
                               rtol=0, atol=0)  # the same σ everywhere after the step
    for name, w in ranks[0]["alp"]["weights"].items():
        assert torch.equal(w, ranks[1]["alp"]["weights"][name]), name
    # Rank 1's rows with rank 0's noise give another gradient: the ranks' draws really differ, and the check
    # above would fail if both ranks drew the same noise.
    same_noise = update(tiny_model_dir, Distributed(), "alp", SHARES[1], noise_rank=0)
    assert grads_differ(same_noise, alone[1])
    assert not torch.allclose(same_noise["head_grads"]["alp.log_sigma"], alone[1]["head_grads"]["alp.log_sigma"],
                              rtol=1e-3)


def test_the_doc_states_how_oreal_and_alp_behave_under_ddp():
    text = " ".join(DOC.read_text().split())
    for claim in ("ALP's noise (`algorithms/alp.py`) is drawn per rank",
                  "its gradient averaged over ranks with the others', so σ is the same everywhere",
                  "so its update is the one-process update of the union batch, with or without its token head",
                  "tests/test_distributed_oreal_alp.py"):
        assert claim in text, claim
    assert "not yet in the 2-process test" not in text


# ----------------------------------------------------------------------------- SAFE's double critic under DDP
# docs/distributed.md: the double critic's V2 (algorithms/double_critic.py) is an extra trainable head like V1, its
# gradient averaged over the ranks before clipping, so both heads get the one-process gradient of the union batch
# (their loss is token-mean with the global token count; the returns are per row) and stay identical on every rank.
# Its own spawn (appended to this file, whose first spawn runs the OREAL and ALP cases).

DOUBLE_CRITIC = ["algorithm.name=ppo", "algorithm.vf_double_critic=true", "algorithm.kl_coef=0",
                 "algorithm.ppo_epochs=1"]


def double_critic_update(model_dir: str, dist: Distributed, prompt_ids: list[int]) -> dict:
    """One PPO update with the double critic on ``prompt_ids``: GAE on the heads' rollout values, then the step."""
    from anabranch.models.loading import load_model
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.components import build_optimizer
    from anabranch.trainer.step import policy_update

    cfg = step_cfg(model_dir, DOUBLE_CRITIC)
    algo = resolve_algorithm(cfg.algorithm)
    torch.manual_seed(0)
    model = load_model(cfg.model, torch.device("cpu"))
    modules = {name: make(model.config, algo.cfg) for name, make in algo.module_factories.items()}
    c = SimpleNamespace(cfg=cfg, model=model, optimizer=build_optimizer(cfg, model, modules))
    dist.prepare(c)
    rollout, rewards = fixed_rollout(prompt_ids)
    adv = compute_advantages(algo, c.model, rollout, rewards, micro_batch_size=4, temperature=1.0, modules=modules,
                             dist=dist.active)
    policy_update(dist.policy(c.model), c.optimizer, rollout, adv.advantages, rewards, algo, micro_batch_size=4,
                  grad_clip=0.0, temperature=1.0, max_response_len=R, dist=dist.active, modules=modules,
                  precomputed=adv.precomputed)
    heads = {f"{m}.{n}": p for m, mod in modules.items() for n, p in mod.named_parameters()}
    return {"head_grads": {n: p.grad.clone() for n, p in heads.items()},
            "heads": {n: p.detach().clone() for n, p in heads.items()}}


def _double_critic_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_gloo(rank, world, port)
    dist = Distributed.start(step_cfg(model_dir, DOUBLE_CRITIC))
    torch.save(double_critic_update(model_dir, dist, dist.shard(list(range(PROMPTS)))), Path(out) / f"dc{rank}.pt")


def test_double_critic_heads_get_the_union_gradient_and_stay_identical(tiny_model_dir, tmp_path):
    spawn_two(_double_critic_worker, tiny_model_dir, str(tmp_path))
    ranks = [torch.load(tmp_path / f"dc{r}.pt", weights_only=False) for r in range(2)]
    single = double_critic_update(tiny_model_dir, Distributed(), list(range(PROMPTS)))
    alone = double_critic_update(tiny_model_dir, Distributed(), SHARES[0])
    assert set(single["head_grads"]) == {"value.proj.weight", "value.proj.bias", "value2.proj.weight",
                                         "value2.proj.bias"}
    for name, g in single["head_grads"].items():
        assert g.abs().max() > 0, name
        # rank 0's rows alone give another gradient: the ranks' agreement below is the all-reduce's
        assert not torch.allclose(alone["head_grads"][name], g, rtol=1e-3, atol=1e-7), name
        for rank in ranks:
            torch.testing.assert_close(rank["head_grads"][name], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    for name, w in single["heads"].items():  # V1 and V2 after the step: the same on both ranks, the union's
        assert torch.equal(ranks[0]["heads"][name], ranks[1]["heads"][name]), name
        torch.testing.assert_close(ranks[0]["heads"][name], w, rtol=1e-5, atol=2e-5)
