"""The training loop: rollouts -> rewards -> advantages -> update, with logging and checkpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from anabranch.config import Config
from anabranch.eval.accuracy import correctness_source, greedy_accuracy
from anabranch.rewards import score
from anabranch.trainer.checkpoint import export_hf, save_checkpoint
from anabranch.trainer.components import build, lr_lambda, quiet_libraries
from anabranch.trainer.progress import Progress
from anabranch.trainer.run_dir import RunDir
from anabranch.trainer.sampler import PromptSampler
from anabranch.trainer.step import policy_update


@dataclass
class TrainResult:
    run_dir: Path
    final_model_dir: Path | None
    accuracy_before: float | None
    accuracy_after: float | None
    history: list[dict] = field(default_factory=list)


def train(cfg: Config) -> TrainResult:
    """Run the whole job described by ``cfg`` and return where it wrote its outputs."""
    quiet_libraries()
    c = build(cfg)
    run = RunDir(cfg)
    sampler = PromptSampler(len(c.train_rows), cfg.trainer.seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(c.optimizer, lr_lambda(cfg))
    acc_src = correctness_source(c.rewards)
    eval_tokens = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens
    result = TrainResult(run.path, None, None, None)
    progress = Progress(cfg.trainer.steps, enabled=cfg.trainer.progress)

    def evaluate(tag: str, step: int) -> float | None:
        if not c.eval_rows:
            return None
        res = greedy_accuracy(c.backend, c.eval_prompts, c.eval_rows, c.rewards, eval_tokens)
        key = "accuracy" if "accuracy" in res else "reward"
        run.log_metrics(step, {f"eval/{key}": res[key]})
        run.write_json(f"eval_{tag}.json", {key: res[key], "n": res["n"], "examples": [
            {"question": str(r["question"]), "answer": r["answer"], "completion": comp, "score": s}
            for r, comp, s in zip(c.eval_rows, res["completions"], res["scores"])]})
        progress.write(f"held-out {key} ({tag}, greedy, {res['n']} problems): {res[key]:.3f}")
        return res[key]

    if cfg.trainer.eval_before:
        result.accuracy_before = evaluate("before", 0)
    for step in range(1, cfg.trainer.steps + 1):
        t0 = time.perf_counter()
        idx = sampler.next(cfg.rollout.prompts_per_step)
        rollout = c.backend.generate([c.train_prompts[i] for i in idx], cfg.rollout.n)
        t_gen = time.perf_counter() - t0
        rows = [c.train_rows[idx[g]] for g in rollout.group_index.tolist()]
        seq_prompts = [rollout.prompts[g] for g in rollout.group_index.tolist()]
        total, per_source = score(c.rewards, seq_prompts, rollout.completions, rows,
                                  group_index=rollout.group_index.tolist())
        rewards = torch.tensor(total, dtype=torch.float32)
        advantages = c.algo.advantage(rewards, rollout.group_index, rollout.response_mask.float(), c.algo.cfg)
        metrics = policy_update(
            c.model, c.optimizer, rollout, advantages, rewards, c.algo,
            micro_batch_size=cfg.trainer.micro_batch_size, grad_clip=cfg.trainer.grad_clip,
            temperature=cfg.rollout.temperature, max_response_len=cfg.rollout.max_new_tokens,
            ref_model=c.ref_model, modules=c.modules, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        )
        scheduler.step()
        c.backend.sync_weights(c.model)
        metrics.update(rollout_metrics(rewards, per_source, rollout, acc_src))
        metrics.update({"lr": scheduler.get_last_lr()[0], "time/step_s": time.perf_counter() - t0,
                        "time/generate_s": t_gen})
        run.log_metrics(step, metrics)
        run.log_samples(step, [{"question": str(rows[i]["question"]), "answer": rows[i]["answer"],
                                "completion": rollout.completions[i], "reward": total[i]}
                               for i in range(min(cfg.trainer.log_samples, len(rows)))])
        result.history.append(metrics)
        progress.update(step, metrics)
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < cfg.trainer.steps:
            evaluate(f"step{step}", step)
        if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
            save_checkpoint(run.path, step, c.model, c.tokenizer, c.optimizer,
                            {"sampler": sampler.state_dict(), "scheduler": scheduler.state_dict()})
    progress.close()
    if cfg.trainer.eval_after:
        result.accuracy_after = evaluate("after", cfg.trainer.steps)
    if cfg.trainer.save_final:
        result.final_model_dir = export_hf(c.model, c.tokenizer, run.path / "final")
    run.write_json("summary.json", {"accuracy_before": result.accuracy_before,
                                    "accuracy_after": result.accuracy_after, "steps": cfg.trainer.steps})
    run.close()
    return result


def rollout_metrics(rewards: torch.Tensor, per_source: dict, rollout, acc_src) -> dict:
    lengths = rollout.response_lengths.float()
    groups = rollout.group_index
    # Groups whose rewards are all equal give GRPO no signal.
    same = [bool((rewards[groups == g] == rewards[groups == g][0]).all()) for g in groups.unique()]
    out = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "response_length/mean": lengths.mean().item(),
        "response_length/truncated_frac": rollout.truncated.float().mean().item(),
        "groups/all_equal_frac": sum(same) / max(len(same), 1),
    }
    for name, values in per_source.items():
        out[f"reward/{name}"] = sum(values) / max(len(values), 1)
    if acc_src is not None:
        out["accuracy"] = out[f"reward/{acc_src.name}"]
    return out
