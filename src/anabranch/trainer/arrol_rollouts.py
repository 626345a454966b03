"""ARRoL's two-phase rollout with online pruning (``rollout.arrol.enabled``); the head and rule: algorithms/arrol.py.

Xu et al. 2026, "Prune as You Generate: Online Rollout Pruning for Faster and Better RLVR" (arXiv 2603.24840).
A training step's rollout of each prompt, once the head has had ``warmup_steps`` updates:

1. phase 1: n' = round(n·(1 + ``oversample``)) samples, each at most ``prune_at`` tokens (``backend.generate``
   with that budget; a sample that ends before is finished);
2. scoring: the head reads layer ``layer``'s hidden state at each prefix's last token. The states come from
   **one no-grad forward of the policy** over prompt ⊕ prefix (at most P + ``prune_at`` tokens a row; in
   micro-batches of ``trainer.micro_batch_size`` rows, or packed by ``trainer.micro_batch_tokens``), not from
   the sampler: neither backend returns hidden states (vLLM's engine holds other weights and cannot), and the
   forward is cheap beside the generation. A causal model's state at a position does not depend on what
   follows, so it is the state the finished rollout has there too;
3. pruning: :func:`anabranch.algorithms.arrol.balanced_keep` keeps n of the n' per prompt (the k = ⌊ρn + ½⌋ most
   likely correct and the n − k least); the pruned ones stop;
4. phase 2: the unfinished survivors continue from their token ids (``backend.continue_ids``, budget
   ``max_new_tokens − prune_at``); the rollout returned holds the survivors only, n per prompt in the
   backend's layout, so the rest of the trainer (scoring, advantages, re-batched log-probs, update) is unchanged;
5. the head's update: after the round is scored (trainer/collect.generate_round) the head takes
   ``head_updates`` Adam steps on BCE(p, correct) over the survivors' stored prefix states. Under DDP the head's
   gradient and row count are summed over ranks first (every rank holds the same head, so every rank prunes
   with the same rule); it is saved in checkpoints (``stateful`` "arrol").

During the warm-up (the head's first ``warmup_steps`` updates) nothing is pruned: plain n samples per prompt,
whose prefix states (the first ``prune_at`` tokens of each) train the head. Generation cost per prompt once
pruning: n'·min(L, L_p) + n·(L − L_p) tokens against n'·L for n' full samples.

Assumed (see algorithms/arrol.py for the paper facts): over-sampling 1.0 (n' = 2n), ρ = 0.5 (the summary's
"usually"), prune_at as a token count (default ``max_new_tokens // 4`` when 0), the last layer's state, a
linear head with Adam at 1e-3, warm-up 5 updates. The head's weighted vote at test time: ``anabranch eval
--arrol-vote`` (eval/arrol_vote.py).

With ``head_probe`` > 0 (trainer/arrol_probe.py), after step 4 a seeded uniform fraction of each group's pruned
prefixes also finishes, on its own seed in forked generators (the batch and the RNG are as without it), and
step 5 trains the head on survivors ⊕ probed rows with importance weights 1 and m/k_p: an unbiased loss over all
n' prefixes, where the survivors alone are the head's own selection. The probed rows are judged by the
correctness reward alone and reach nothing else.

Metrics (per rank, averaged by the loop): ``arrol/pruning`` (1 once the warm-up is over), ``arrol/pruned_frac``
(pruned / n'), ``arrol/phase1_tokens``, ``arrol/phase2_tokens``, ``arrol/tokens_saved`` (the continuation budget
the pruned unfinished rows did not spend: an upper bound of the tokens saved against n' full samples),
``arrol/head_loss``, ``arrol/head_acc`` and ``arrol/head_auc`` (of the head's predictions before its update, on
the survivors: on a pruned step the survivors are a selected sample, not a random one); with the probe also
``arrol/probe_tokens`` (the probed rows' continuation tokens), ``arrol/probe_rows``, ``arrol/probe_acc`` (the head
on the probed middle of its ranking) and ``arrol/head_acc_all`` (importance-weighted: over all n' prefixes).
"""

from __future__ import annotations

import torch

from anabranch.algorithms.arrol import QualityHead, balanced_keep, binary_auc, head_loss_sum
from anabranch.config import ConfigError
from anabranch.range_checks import first_failed
from anabranch.rollout.base import Rollout, cut_at_eos, right_padded, right_padded_values
from anabranch.trainer.aux_head import all_reduce_grads, hidden_at, seeded, static_token_budget


def prune_length(cfg) -> int:
    """The pruning point in response tokens (``prune_at``, or ``max_new_tokens // 4`` when 0; at least 1)."""
    a = cfg.rollout.arrol
    return a.prune_at if a.prune_at > 0 else max(cfg.rollout.max_new_tokens // 4, 1)


def oversampled(cfg) -> int:
    """n' = round(n·(1 + oversample)) samples per prompt in phase 1."""
    return int(cfg.rollout.n * (1.0 + cfg.rollout.arrol.oversample) + 0.5)


def prefix_features(model, rollout: Rollout, upto: int, layer: int, micro_batch_size: int,
                    micro_batch_tokens: int = 0) -> torch.Tensor:
    """[B, H] fp32: layer ``layer``'s hidden state (``hidden_states[layer]``: 0 the embeddings, −1 the last) at the
    last token of prompt ⊕ the first ``upto`` response tokens of each row (the prompt's last token for an empty
    response), from no-grad eval-mode forwards of that prefix (trainer/aux_head.hidden_at: micro-batches of
    ``micro_batch_size`` rows, or packed by ``micro_batch_tokens`` when > 0), as the policy samples."""
    # Left-padded prompt, right-padded response: the row's last real token is at P + its prefix length − 1.
    last = rollout.prompt_ids.shape[1] + rollout.response_mask[:, :upto].sum(-1) - 1
    feats = hidden_at(model, rollout, [[int(p)] for p in last], layer, micro_batch_size, micro_batch_tokens, upto=upto)
    return torch.cat(feats)


def continue_survivors(backend, first: Rollout, rows: list[int], budget: int, pad: int, tokenizer,
                       seed: int | None = None) -> Rollout:
    """Rollout of ``first``'s rows ``rows``: a finished row as it is, an unfinished one's prefix ⊕ its continuation
    from ``backend.continue_ids`` (at most ``budget`` tokens, cut at EOS). Sampler log-probs are kept only when
    both phases give them. ``seed``: passed to ``continue_ids`` (forked generators; the probe's), None: not passed."""
    sub = first.take(rows)
    open_rows = [i for i in range(len(rows)) if bool(sub.truncated[i])]
    prefixes = [sub.response_tokens(i) for i in range(len(rows))]
    tokens, truncated = list(prefixes), [bool(t) for t in sub.truncated]
    lps = [None if sub.sample_log_probs is None else sub.sample_log_probs[i, :len(prefixes[i])].tolist()
           for i in range(len(rows))]
    if open_rows and budget > 0:
        seqs = [sub.prompt_tokens(i) + prefixes[i] for i in open_rows]
        outs = (backend.continue_ids(seqs, [budget] * len(open_rows)) if seed is None else
                backend.continue_ids(seqs, [budget] * len(open_rows), seed=seed))
        eos = set(backend.eos_ids)
        for i, (cont, clp) in zip(open_rows, outs):
            kept, ended = cut_at_eos(list(cont), eos)
            tokens[i] = prefixes[i] + kept
            truncated[i] = not ended
            lps[i] = None if (clp is None or lps[i] is None) else lps[i] + list(clp[:len(kept)])
    resp, rmask = right_padded(tokens, pad)
    slp = right_padded_values(lps, resp.shape[1]) if all(lp is not None for lp in lps) else None
    sub.response_ids, sub.response_mask, sub.sample_log_probs = resp, rmask, slp
    sub.truncated = torch.tensor(truncated)
    sub.completions = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return sub


class ARRoL:
    """The quality head, its optimizer and update count; the survivors' prefix states of the last rollout."""

    def __init__(self, cfg, model, dist=None):
        self.cfg, self.a, self.dist, self.model = cfg, cfg.rollout.arrol, dist, model
        self.device = next(model.parameters()).device
        # The same initial head on every rank (the run's RNG untouched).
        self.head = seeded(lambda: QualityHead(model.config.hidden_size, self.a.head_hidden), cfg.trainer.seed)
        self.head.to(self.device)
        self.micro_batch_tokens = static_token_budget(cfg, model, dist)  # the prefix pass's (trainer.micro_batch_tokens)
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=self.a.head_lr)
        self.updates = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # survivors' (states, predicted p)
        self.probe = None  # with head_probe: the round's probed pruned rows, finished (trainer/arrol_probe.Probe)
        self.metrics: dict = {}

    @classmethod
    def create(cls, cfg, dist, c) -> "ARRoL | None":
        """None unless ``rollout.arrol.enabled``; else the state, attached as ``c.arrol`` for trainer/collect.py."""
        if not cfg.rollout.arrol.enabled:
            return None
        from anabranch.trainer.distributed import require_plain_ddp

        require_plain_ddp(dist, "rollout.arrol.enabled", "ARRoL's prefix forward runs on each rank's own rows",
                          "rollout.arrol.enabled=false")
        state = cls(cfg, c.model, dist.active)
        c.arrol = state
        return state

    @property
    def pruning(self) -> bool:
        return self.updates >= self.a.warmup_steps

    @torch.no_grad()
    def predict(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=self.device.type, enabled=False):
            return torch.sigmoid(self.head(h.to(self.device))).cpu()

    def generate(self, backend, tokenizer, prompts: list[str], cfg) -> Rollout:
        """A training round's rollout of ``prompts``: n survivors per prompt (plain n samples in the warm-up)."""
        r, n, lp = cfg.rollout, cfg.rollout.n, prune_length(cfg)
        micro = cfg.trainer.micro_batch_size
        if not self.pruning:
            out = backend.generate(prompts, n)
            h = prefix_features(self.model, out, lp, self.a.layer, micro, self.micro_batch_tokens)
            self.pending = (h, self.predict(h))
            self.metrics = {"arrol/pruning": 0.0, "arrol/pruned_frac": 0.0, "arrol/tokens_saved": 0.0,
                            "arrol/phase1_tokens": float(out.response_mask.sum()), "arrol/phase2_tokens": 0.0}
            if self.a.head_probe > 0:  # nothing pruned, nothing to probe
                self.metrics["arrol/probe_tokens"] = 0.0
            return out
        n_prime = oversampled(cfg)
        first = backend.generate(prompts, n_prime, max_new_tokens=lp)
        h = prefix_features(self.model, first, lp, self.a.layer, micro, self.micro_batch_tokens)
        p = self.predict(h)
        keep = balanced_keep(p.view(len(prompts), n_prime), n, self.a.target_ratio)
        rows = (keep + torch.arange(len(prompts))[:, None] * n_prime).flatten().tolist()
        out = continue_survivors(backend, first, rows, r.max_new_tokens - lp, tokenizer.pad_token_id, tokenizer)
        out.group_index = torch.arange(len(prompts)).repeat_interleave(n)
        self.pending = (h[rows], p[rows])
        pruned = sorted(set(range(first.response_ids.shape[0])) - set(rows))
        open_pruned = float(first.truncated[pruned].sum()) if pruned else 0.0
        phase1 = float(first.response_mask.sum())
        self.metrics = {"arrol/pruning": 1.0, "arrol/pruned_frac": len(pruned) / first.response_ids.shape[0],
                        "arrol/phase1_tokens": phase1,
                        "arrol/phase2_tokens": float(out.response_mask.sum()) - float(first.response_mask[rows].sum()),
                        "arrol/tokens_saved": open_pruned * (r.max_new_tokens - lp)}
        if self.a.head_probe > 0:  # after the survivors' continuation, on its own seed: the batch is unchanged
            from anabranch.trainer.arrol_probe import draw_probe

            self.probe = draw_probe(self, backend, tokenizer, first, h, p, keep, n_prime, r.max_new_tokens - lp)
            self.metrics["arrol/probe_tokens"] = self.probe.tokens if self.probe is not None else 0.0
        return out

    def observe(self, correct: list[float], probe_correct: list[float] | None = None) -> dict:
        """The head's update on the last rollout's survivors (``correct``: their 0/1 flags, in row order), and with
        a probe its probed rows (``probe_correct``), importance-weighted; returns the head's metrics (its
        predictions before this update). Every rank calls it each round."""
        h, p = self.pending if self.pending is not None else (torch.zeros(0, self.head_size()), torch.zeros(0))
        probe, self.pending, self.probe = self.probe, None, None
        y = torch.tensor(correct, dtype=torch.float32)
        if y.numel() != h.shape[0]:
            raise RuntimeError(f"rollout.arrol: {y.numel()} correctness flags for {h.shape[0]} stored prefix states")
        metrics = dict(self.metrics)
        w = None
        if probe is not None:  # survivors ⊕ probed rows, weights 1 and m/k_p (trainer/arrol_probe.py)
            from anabranch.trainer.arrol_probe import with_probe

            h_all, y_all, _, w, probe_metrics = with_probe(h, y, p, probe, probe_correct or [])
            metrics.update(probe_metrics)
        if y.numel():
            metrics["arrol/head_acc"] = float(((p >= 0.5).float() == y).float().mean())
            auc = binary_auc(p, y)
            if auc is not None:
                metrics["arrol/head_auc"] = auc
        loss = self.train_head(h, y) if w is None else self.train_head(h_all, y_all, w)
        if loss is not None:
            metrics["arrol/head_loss"] = loss
        metrics["arrol/head_updates"] = float(self.updates)
        return metrics

    def head_size(self) -> int:
        return self.model.config.hidden_size

    def train_head(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> float | None:
        """``head_updates`` Adam steps on the mean BCE over all ranks' rows (the summed gradient and row count are
        all-reduced under DDP); the mean loss of the first step, or None when no rank had a row. ``w``: per-row
        weights (the probe's importance weights): the loss is then Σ w·BCE / Σ w over all ranks' rows."""
        h, y = h.to(self.device), y.to(self.device)
        w = None if w is None else w.to(self.device)
        count = y.numel() if w is None else float(w.sum())
        first = None
        params = [q for q in self.head.parameters()]
        for _ in range(max(self.a.head_updates, 1)):
            self.optimizer.zero_grad(set_to_none=False)
            with torch.autocast(device_type=self.device.type, enabled=False), torch.enable_grad():
                loss = head_loss_sum(self.head(h), y, w) if y.numel() else sum(q.sum() * 0.0 for q in params)
                loss.backward()
            total, loss_total = all_reduce_grads(params, self.dist, count, loss.detach())
            if total == 0:
                return None
            first = float(loss_total[0]) / total if first is None else first
            self.optimizer.step()
        self.updates += 1
        return first

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


def arrol_round(c, prompts: list[str], cfg) -> Rollout:
    """The hook trainer/collect.generate_scored calls for a training round with ``rollout.arrol.enabled``."""
    return c.arrol.generate(c.backend, c.tokenizer, prompts, cfg)


def arrol_observe(c, batch) -> None:
    """The hook trainer/collect.generate_round calls once the round is scored: the head's update on its
    survivors' right/wrong flags (the correctness reward's full credit, as dynamic sampling counts them)."""
    from anabranch.eval.accuracy import batch_correct

    probe_y = None
    if c.arrol.probe is not None:  # the probed pruned rows: judged here, for the head only (trainer/arrol_probe.py)
        from anabranch.trainer.arrol_probe import probe_correct

        probe_y = probe_correct(c, c.arrol.probe, batch)
    batch.metrics.update(c.arrol.observe(batch_correct(batch, c.rewards), probe_y))


def check_config(cfg) -> None:
    """ARRoL's key ranges and refused combinations (config_checks, when ``rollout.arrol`` differs from its defaults);
    the restrictions it shares with the other round builders come from trainer/round_builders.py."""
    a, r = cfg.rollout.arrol, cfg.rollout
    if not a.enabled:
        return
    from anabranch.trainer.method_sets import refuse_row_generators
    from anabranch.trainer.round_builders import branching_rollout_refusals

    own = [
        (a.prune_at >= 0, "prune_at", "must be >= 0 (response tokens before the pruning point; 0: "
         "rollout.max_new_tokens // 4)"),
        (prune_length(cfg) < r.max_new_tokens, "prune_at", "must be below rollout.max_new_tokens "
         "(the survivors continue after it)"),
        (a.oversample > 0 and oversampled(cfg) > r.n, "oversample", "must make round(n·(1 + oversample)) "
         "> rollout.n (phase 1 samples more than the n survivors kept)"),
        (0.0 <= a.target_ratio <= 1.0, "target_ratio", "must be in [0, 1]"),
        (a.head_lr > 0, "head_lr", "must be > 0"),
        (a.head_hidden >= 0, "head_hidden", "must be >= 0 (0: a linear head)"),
        (a.head_updates >= 1, "head_updates", "must be >= 1"),
        (a.warmup_steps >= 1, "warmup_steps", "must be >= 1 (the head trains before it prunes)"),
    ]
    from anabranch.trainer.arrol_probe import check_probe

    error = first_failed(own, "rollout.arrol", a)
    if error is None and (probe_error := check_probe(cfg)) is not None:  # after own: it reads n' − n
        error = f"rollout.arrol.{probe_error}"
    error = error or branching_rollout_refusals(
        cfg, "rollout.arrol.enabled", "but ARRoL's survivors are selected by the quality head, not such draws",
        why={"backend": "the two-phase rollout is implemented and tested with the hf sampler only",
             "tools": "a tool output inside the prefix is not the policy's text, and the continuation would not run "
             "the tools",
             "retry_turns": "a retry episode's attempts and feedback are not a single response to continue",
             "extra_rollouts": "CURE's branches and DARS's extra samples are groups of another size and origin than "
             "ARRoL's n survivors",
             "min_new_tokens": "the continuation sampler has no per-row minimum length",
             "temperature_schedule": "EAD's per-position temperatures across the two phases are not tested"})
    if error is not None:
        raise ConfigError(error)
    # Agent-RLVR is not refused: its guided retries feed its own DPO term, and the RL batch stays ARRoL's survivors.
    # SvS is (as by ROSE): its solve rounds add plain rows to the step that ARRoL's head did not prune.
    refuse_row_generators(cfg, "rollout.arrol.enabled", "ARRoL's pruned rollout", allow=("algorithm.agent_rlvr.enabled",))
