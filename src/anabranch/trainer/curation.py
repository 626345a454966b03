"""Low-likelihood focus: train only on the problems the base model solves with low likelihood.

Nguyen, La, Nguyen, Chawla, Nguyen, Doan (2025), "The Reasoning Boundary Paradox: How Reinforcement
Learning Constrains Language Models" (arXiv 2510.02230). RLVR's on-policy sampling reinforces the
problems the base model already solves with high likelihood ("winner-take-all") and, through
negative interference, lowers the likelihood of correct solutions of the others, so Pass@k at
large k shrinks. Their remedy (SELF) is a data curation that focuses RLVR on low-likelihood problems.

What this module does (``task.curation=low_likelihood``):

    pre-pass   K = task.curation_prompts training rows (a seeded choice; 0: all) are sampled
               n = task.curation_samples times each by the initial policy π_0 and scored with the
               run's rewards:   p̂(q) = #{correct samples of q} / n
               (correct = full credit on the reward that says right/wrong, else on the total reward:
               ``rehearsal.presample`` / ``sample_correct``, shared with DPH-RL and prompt pairing)
    keep       Q_keep = {q : task.curation_min_rate <= p̂(q) <= task.curation_max_rate}
    training   every draw comes from Q_keep only: a seeded permutation of the kept rows per pass over
               them (rows never pre-sampled are not trained on).

What is from the paper and what is assumed. The paper's method text could not be read; its abstract,
README and released training code were. The released trainer (its "max" PPO trainer) measures the
likelihood online, per batch, with the *current* policy: each prompt is decoded once greedily and
only prompts whose greedy answer is wrong (reward != 1) are sampled and trained on. Here, as asked of
this project, the curation is one pre-pass with π_0 (the "base model" of the paper's analysis) before
training, and the likelihood of a correct solution is the sampled pass rate p̂ rather than the
correctness of one greedy decode. Assumed: p̂ <= 0.5 as "low likelihood" (curation_max_rate = 0.5:
a correct answer that is not the majority of the samples is roughly a wrong greedy/mode answer);
curation_min_rate = 0 keeps never-solved problems as the released code does (set it to 1/n to keep
only problems solved at least once, the catalog's "solved with low likelihood"); n = 8 samples (the
released runs' rollout.n). The paper also pairs the curation with a forward-KL term; that is not part
of this module. An empty kept set is an error naming the keys to change (no silent fallback).

The released code's online filter is ``task.curation=greedy_wrong`` (trainer/greedy_filter.py): every
round's drawn prompts are decoded once greedily by the current policy and only the wrong ones are sampled;
it has no pre-pass and no kept set (``Curation.create`` returns None, the curation_* keys are refused),
and runs in one process only.

Resume: the kept rows, every pre-sampled row's p̂ and the sampler's position are the sampler's
checkpoint state, so a resumed run keeps its kept set (never re-estimated from resumed weights) and
draws what the uninterrupted run would have.

Data parallelism (W ranks): the choice of the K prompts does not depend on W; each rank samples and
scores its share (``rehearsal.presample``), the ranks' p̂ are gathered (``rehearsal.gather_ranks``)
and every rank keeps the same rows from the same rates; every rank's sampler makes the same draws and
``Distributed.rank_sampler`` hands each rank its share of them. Resumed, every rank loads rank 0's
sampler state.
"""

from __future__ import annotations

from anabranch.config import Config, ConfigError, TaskConfig

CURATIONS = ("none", "low_likelihood", "greedy_wrong")
# Each rank would keep a different number of wrong-greedy prompts, so ranks would train on unequal batches
# and the sampler draws of an all-correct redraw would diverge; this is not checked, so it is refused.
ONE_PROCESS = ("task.curation=greedy_wrong runs in one process only (distributed.num_processes={n}): each rank "
                "would keep a different number of prompts whose greedy answer is wrong; launch one process or "
                "set task.curation=low_likelihood")
PREPASS_SEED_OFFSET = 3571      # pre-pass generation seed: trainer.seed + this (apart from pairing's and DPH's)
ORDER_SEED_BASE = 7_777_771     # order of the kept rows per pass: apart from PromptSampler's seed + epoch


def check_curation(t: TaskConfig) -> None:
    """Validate the ``task.curation*`` keys (TaskConfig's check path), naming the bad key."""
    if t.curation not in CURATIONS:
        raise ConfigError(f"config key 'task.curation' must be one of {', '.join(CURATIONS)} (got {t.curation!r})")
    for key, ok, why in (
            ("curation_samples", t.curation_samples >= 1, "must be >= 1"),
            ("curation_prompts", t.curation_prompts >= 0, "must be >= 0 (0: all training prompts)"),
            ("curation_max_rate", 0 <= t.curation_max_rate < 1,
             "must be in [0, 1) (1 would keep every prompt: no curation)"),
            ("curation_min_rate", 0 <= t.curation_min_rate <= t.curation_max_rate,
             f"must be in [0, task.curation_max_rate={t.curation_max_rate}]")):
        if not ok:
            raise ConfigError(f"config key 'task.{key}' {why} (got {getattr(t, key)!r})")
    if t.curation == "none":
        return
    if t.curation == "greedy_wrong":  # the online filter (trainer/greedy_filter.py) has no pre-pass
        default = TaskConfig.__dataclass_fields__
        for key in ("curation_samples", "curation_prompts", "curation_min_rate", "curation_max_rate"):
            if getattr(t, key) != default[key].default:
                raise ConfigError(f"config key 'task.{key}' has no effect with task.curation=greedy_wrong (got "
                                  f"{getattr(t, key)!r}): the online filter keeps a prompt when the current "
                                  "policy's one greedy answer is wrong, with no pre-pass; leave it at its default "
                                  "or set task.curation=low_likelihood")
    n = t.curation_samples
    # Some rate k/n of n samples must fall in [min, max], or no prompt can ever be kept.
    if t.curation == "low_likelihood" and not any(t.curation_min_rate - 1e-9 <= k / n <= t.curation_max_rate + 1e-9 for k in range(n + 1)):
        raise ConfigError(f"config keys 'task.curation_min_rate'={t.curation_min_rate} and 'task.curation_max_rate'="
                          f"{t.curation_max_rate}: no success rate k/{n} of task.curation_samples={n} samples lies "
                          "between them, so no prompt could be kept; widen them or change task.curation_samples")
    # curriculum before mixture: a curriculum needs a mixture, so naming the mixture would hide the key that was set.
    for key, on in (("pairing", t.pairing), ("curriculum", t.curriculum != "none"), ("mixture", bool(t.mixture))):
        if on:
            what = ("curation restricts training to its kept prompts and replaces the run's prompt sampler, which "
                    f"task.{key} also replaces" if t.curation == "low_likelihood" else "online filter drops prompts "
                    f"from each draw, which task.{key}'s sampler (its pairs, per-task weights) is not built for")
            raise ConfigError(f"config key 'task.curation'={t.curation} cannot be combined with task.{key}: the "
                              f"{what}; use one of them")


def check_curation_config(cfg: Config) -> None:
    """The cross-section refusals, before any model loads: at config load and again first thing in train()
    (config_checks._METHOD_CHECKS runs it while task.curation is on)."""
    if cfg.task.curation == "greedy_wrong" and cfg.distributed.num_processes > 1:
        raise ConfigError(ONE_PROCESS.format(n=cfg.distributed.num_processes))
    d = cfg.algorithm.dph
    if cfg.task.curation == "low_likelihood" and d.coef > 0 and d.exclude_from_rl:
        raise ConfigError(f"task.curation={cfg.task.curation} with algorithm.dph.exclude_from_rl: DPH-RL's own "
                          "pre-pass (other samples) would drop from RL prompts the curation kept, so the trained "
                          "prompts would not be the kept set of curation.json; set algorithm.dph.exclude_from_rl=false "
                          "(or task.curation=none)")


class CurationError(ConfigError):
    """The pre-pass kept no prompt."""


def keep_rows(rates: dict[int, float], min_rate: float, max_rate: float) -> list[int]:
    """``rates``: training row -> p̂. The rows with min_rate <= p̂ <= max_rate, in row order."""
    return sorted(i for i, p in rates.items() if min_rate <= p <= max_rate)


class CuratedSampler:
    """``next(k)``: k training rows drawn from the kept rows only, a seeded permutation per pass."""

    def __init__(self, seed: int, settings: dict | None = None):
        # The task.curation_* values the kept set was chosen with: a resume under other values is refused.
        self.seed, self.settings = seed, dict(settings or {})
        self.kept: list[int] = []
        self.rates: dict[int, float] = {}
        self.stats: dict = {}
        self.epoch, self.pos = 0, 0

    @property
    def built(self) -> bool:
        return bool(self.kept)

    def set_kept(self, kept, rates: dict[int, float], stats: dict) -> None:
        self.kept, self.rates, self.stats = [int(i) for i in kept], dict(rates), dict(stats)
        self.epoch, self.pos = 0, 0

    def _order(self) -> list[int]:
        import torch  # here, not at the top: config validation imports this module (check_curation)

        g = torch.Generator().manual_seed(self.seed * 1_000_033 + ORDER_SEED_BASE + self.epoch)
        return torch.randperm(len(self.kept), generator=g).tolist()

    def next(self, k: int) -> list[int]:
        if not self.built:
            raise RuntimeError("low-likelihood curation: no prompts kept yet (Curation.prepare runs the pre-pass)")
        out, order = [], self._order()
        while len(out) < k:
            if self.pos >= len(self.kept):
                self.epoch, self.pos = self.epoch + 1, 0
                order = self._order()
            out.append(self.kept[order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"curation": {"kept": list(self.kept), "rates": {str(i): p for i, p in self.rates.items()},
                             "stats": dict(self.stats), "epoch": self.epoch, "pos": self.pos,
                             "settings": dict(self.settings)}}

    def load_state_dict(self, state: dict) -> None:
        if "curation" not in state:
            raise ConfigError("task.curation=low_likelihood but the checkpoint being resumed was written without it: "
                              "the kept prompts cannot be estimated from resumed weights; resume with the "
                              "checkpoint's own config or start afresh")
        st = state["curation"]
        saved = st.get("settings", {})
        changed = [k for k in sorted(saved) if k in self.settings and saved[k] != self.settings[k]]
        if changed:
            k = changed[0]
            raise ConfigError(f"task.{k}={self.settings[k]!r} but the checkpoint being resumed kept its prompts with "
                              f"task.{k}={saved[k]!r}: the kept set would not match the settings; resume with the "
                              "checkpoint's values or start afresh")
        self.set_kept(st["kept"], {int(i): float(p) for i, p in st["rates"].items()}, st["stats"])
        self.epoch, self.pos = st["epoch"], st["pos"]


class Curation:
    """What the training loop holds for the curation: the sampler, the pre-pass and the report."""

    def __init__(self, cfg: Config, dist=None):
        self.cfg, self.t = cfg, cfg.task
        self.dist = dist if dist is not None and dist.world_size > 1 else None  # None: one process
        self.sampler = CuratedSampler(cfg.trainer.seed, {k: getattr(cfg.task, k) for k in (
            "curation_samples", "curation_prompts", "curation_min_rate", "curation_max_rate")})

    @classmethod
    def create(cls, cfg: Config, dist=None) -> "Curation | None":
        """None unless ``task.curation`` is set; refuses what cannot hold with a fixed kept set."""
        if cfg.task.curation == "none":
            return None
        if cfg.task.curation == "greedy_wrong":  # filtered per round in collect_batch: no kept set, no pre-pass
            return None
        return cls(cfg, dist)

    def prepare(self, c, start: int) -> dict:
        """The pre-pass on a fresh run (policy still π_0); a resumed run restored the kept set.
        Several ranks: each estimates p̂ on its share of the prompts; all keep from the gathered rates."""
        if not self.sampler.built:
            if start > 0:
                raise ConfigError("task.curation=low_likelihood but the resumed checkpoint holds no kept prompts")
            from anabranch.trainer.rehearsal import choose_prompts, gather_ranks, presample, sample_correct

            t, seed = self.t, self.cfg.trainer.seed + PREPASS_SEED_OFFSET
            idx = choose_prompts(len(c.train_prompts), t.curation_prompts, seed)
            mine: dict[int, float] = {}
            for part, batch in presample(c, self.cfg, idx, t.curation_samples, seed, self.dist):
                ok, groups = sample_correct(batch, c.rewards).float(), batch.rollout.group_index
                for g in groups.unique().tolist():
                    mine[part[g]] = float(ok[groups == g].mean())
            # Every rank's rates, merged in the choice's order: all ranks keep the same rows.
            got = {row: p for part in gather_ranks(self.dist, mine) for row, p in part.items()}
            rates = {row: got[row] for row in idx}
            kept = keep_rows(rates, t.curation_min_rate, t.curation_max_rate)
            if not kept:
                raise CurationError(
                    f"task.curation=low_likelihood kept no prompt: none of the {len(rates)} pre-sampled prompts has a "
                    f"success rate in [task.curation_min_rate={t.curation_min_rate}, task.curation_max_rate="
                    f"{t.curation_max_rate}]; success rates seen (rate: prompts): {_histogram(rates)}. Raise "
                    "task.curation_max_rate or task.curation_prompts, or lower task.curation_min_rate")
            stats = {"curation/prompts_sampled": float(len(idx)), "curation/prompts_kept": float(len(kept)),
                     "curation/kept_success_rate": sum(rates[q] for q in kept) / len(kept),
                     "curation/sampled_success_rate": sum(rates.values()) / len(rates)}
            self.sampler.set_kept(kept, rates, stats)
        return dict(self.sampler.stats)

    def report(self, train_rows: list[dict]) -> dict:
        """The run directory's ``curation.json``: the rule, every pre-sampled row's p̂, the kept rows."""
        s, kept = self.sampler, set(self.sampler.kept)
        return {"curation": self.t.curation, "samples_per_prompt": self.t.curation_samples,
                "min_rate": self.t.curation_min_rate, "max_rate": self.t.curation_max_rate, "stats": dict(s.stats),
                "rates": {str(i): p for i, p in sorted(s.rates.items())},
                "kept": [{"row": i, "question": str(train_rows[i]["question"]), "answer": train_rows[i].get("answer"),
                          "success_rate": s.rates[i]} for i in s.kept],
                "dropped_rows": [i for i in sorted(s.rates) if i not in kept]}

    def describe(self) -> str:
        s = self.sampler.stats
        return (f"low-likelihood curation: kept {int(s['curation/prompts_kept'])} of "
                f"{int(s['curation/prompts_sampled'])} pre-sampled prompts (success rate in "
                f"[{self.t.curation_min_rate}, {self.t.curation_max_rate}]); kept mean success "
                f"{s['curation/kept_success_rate']:.3f}, all sampled {s['curation/sampled_success_rate']:.3f}")


def _histogram(rates: dict[int, float]) -> dict:
    hist: dict = {}
    for p in rates.values():
        hist[round(p, 4)] = hist.get(round(p, 4), 0) + 1
    return dict(sorted(hist.items()))
