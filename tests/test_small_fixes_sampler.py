"""PromptSampler: each (seed, epoch) has its own order; epoch 0 and checkpoint resume are unchanged."""

import itertools

import torch

from anabranch.trainer.sampler import PromptSampler


def epoch_orders(seed, size, epochs):
    s = PromptSampler(size, seed)
    return [s.next(size) for _ in range(epochs)]


def test_epoch_zero_is_the_plain_seeded_permutation():
    # The README quick start's documented trajectory lies in epoch 0: it must stay torch's
    # randperm under manual_seed(seed), exactly as before the per-epoch seeds were derived.
    for seed in (0, 1, 42, 1234):
        expected = torch.randperm(37, generator=torch.Generator().manual_seed(seed)).tolist()
        assert PromptSampler(37, seed).next(37) == expected


def test_neighbouring_seeds_do_not_share_epoch_orders():
    # With seed + epoch, seed 0's second epoch was seed 1's first (and so on down the diagonal).
    assert epoch_orders(0, 50, 2)[1] != epoch_orders(1, 50, 1)[0]
    orders = {(seed, epoch): tuple(order) for seed in range(8) for epoch, order in enumerate(epoch_orders(seed, 50, 4))}
    for (a, oa), (b, ob) in itertools.combinations(orders.items(), 2):
        assert oa != ob, (a, b)


def test_every_epoch_is_a_permutation():
    for order in epoch_orders(3, 20, 5):
        assert sorted(order) == list(range(20))


def test_resume_mid_epoch_continues_the_same_order():
    size = 11
    full = PromptSampler(size, 5)
    reference = full.next(4 * size)
    run = PromptSampler(size, 5)
    head = run.next(2 * size + 3)  # stop inside epoch 2
    state = run.state_dict()
    assert state == {"epoch": 2, "pos": 3}
    resumed = PromptSampler(size, 5)
    resumed.load_state_dict(state)
    assert head + resumed.next(4 * size - len(head)) == reference
