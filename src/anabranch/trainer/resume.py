"""What a checkpoint holds and how a run continues from one.

A checkpoint holds the policy weights (Hugging Face folder), the optimizer, the LR scheduler, the
extra trainable heads (``modules``: log Z, value head), a LoRA policy's unmerged adapters
(``adapter``; ``model/`` holds them merged, for plain transformers), every RNG state (python,
numpy, torch CPU and CUDA; HF ``generate`` samples from the torch generators), the prompt
sampler's position, the step, the metrics history and the non-finite counters. Restoring all of them makes the resumed
run take exactly the trajectory the uninterrupted one would have taken.

:class:`Checkpointer` is what the loop talks to: ``restore()`` before the first step, and
``after_step()`` after each one (periodic saves, stopping on a signal or on non-finite numbers).
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
from pathlib import Path

from anabranch.config import Config, ConfigError
from anabranch.trainer.checkpoint import (DamagedCheckpoint, adapter_state, checkpoint_dir, discard_after,
                                          list_checkpoints, load_model_weights, load_module_states, load_state,
                                          module_states, rng_state, save_checkpoint, set_rng_state, staging_dir)
from anabranch.trainer.distributed import Distributed
from anabranch.trainer.sharded_state import (full_model_state, full_optimizer_state, is_fsdp2, load_engine_state,
                                             load_full_optimizer_state, save_engine_state, uses_engine_state)
from anabranch.trainer.nonfinite import NonFiniteGuard
from anabranch.trainer.signals import GracefulStop, RunStopped


def find_checkpoint(cfg: Config, run_path: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` points at, or None for a fresh start."""
    resume = cfg.trainer.resume
    if not resume:
        return None
    if resume == "auto":
        done = list_checkpoints(Path(run_path) / "checkpoints")
        return done[-1] if done else None
    path = Path(resume).expanduser()
    if (path / "checkpoints").is_dir():  # a run directory: its latest checkpoint
        done = list_checkpoints(path / "checkpoints")
        if done:
            return done[-1]
    if not (path / "trainer_state.pt").is_file():
        raise ConfigError(f"trainer.resume={resume!r} is not a checkpoint folder (no trainer_state.pt) "
                          "nor a run directory with complete checkpoints; use trainer.resume=auto or "
                          "a path such as runs/NAME/checkpoints/step-000100")
    if not (path / "model" / "config.json").is_file():
        raise ConfigError(f"trainer.resume={resume!r} is an incomplete checkpoint: it has trainer_state.pt but no "
                          f"model/config.json{_others(path)}")
    return path


def _others(path: Path) -> str:
    """Where else to resume from, for an error about checkpoint ``path``."""
    others = [p for p in list_checkpoints(Path(path).parent) if p.resolve() != Path(path).resolve()]
    if not others:
        return ""
    return f"; resume from another checkpoint of the run instead: trainer.resume={others[-1]}"


def check_resume_path(cfg: Config) -> None:
    """Fail before any model is loaded when ``trainer.resume`` names a path that does not exist."""
    resume = cfg.trainer.resume
    if resume and resume != "auto" and not Path(resume).expanduser().exists():
        raise ConfigError(f"trainer.resume={resume!r}: no such folder; give a checkpoint folder "
                          "(runs/NAME/checkpoints/step-000120), a run directory, or auto")


def resume_command(cfg: Config, run_path: Path) -> str:
    """The exact command that continues this run."""
    return " ".join(["anabranch", "train", "--config", shlex.quote(str(Path(run_path) / "config.yaml")),
                     shlex.quote(f"trainer.output_dir={Path(run_path).parent}"),
                     shlex.quote(f"trainer.run_name={Path(run_path).name}"), "trainer.resume=auto"])


# Keys that may differ between a run and its resumption without changing its trajectory
# (trainer.steps only under a constant LR: it is the length of a cosine or linear schedule).
RESUME_MAY_CHANGE = {"trainer.resume", "trainer.steps", "trainer.run_name", "trainer.output_dir",
                     "trainer.save_every", "trainer.keep_last", "trainer.progress", "trainer.eval_after",
                     "trainer.save_final", "trainer.max_nonfinite_in_a_row", "trainer.tensorboard"}


def changed_keys(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted config keys whose values differ between two ``Config.to_dict()`` results."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b, name = saved.get(key), current.get(key), prefix + key
        if isinstance(a, dict) and isinstance(b, dict) and name not in ("task.params",):
            out += changed_keys(a, b, name + ".")
        elif a != b and name not in RESUME_MAY_CHANGE:
            out.append(name)
    if not prefix:
        ta, tb = saved.get("trainer") or {}, current.get("trainer") or {}
        if (ta.get("steps") != tb.get("steps") and "trainer" in saved
                and {ta.get("lr_schedule"), tb.get("lr_schedule")} - {"constant"}):
            out = sorted(out + ["trainer.steps"])
    return out


def cut_log(path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (by a run that went on past its last checkpoint and crashed)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except ValueError:  # a line cut short by the crash
            continue
    # Rewritten in place: the run directory's append-mode handles keep appending at the new end.
    with open(path, "r+") as f:
        f.writelines(keep)
        f.truncate()


class Checkpointer:
    def __init__(self, cfg: Config, c, run, sampler, scheduler, result, progress, stop: GracefulStop,
                 stateful: dict | None = None, dist: Distributed | None = None):
        """``stateful``: other objects with state_dict/load_state_dict (the adaptive KL controller);
        ``dist``: this process's place in a data-parallel run (rank 0 writes; every rank takes part
        in gathering a sharded model's state and saves its own RNG state through rank 0)."""
        self.cfg, self.c, self.run, self.sampler, self.scheduler = cfg, c, run, sampler, scheduler
        self.stateful, self.dist = dict(stateful or {}), dist or Distributed()
        self.result, self.progress, self.stop = result, progress, stop
        self.guard = NonFiniteGuard(cfg.trainer.max_nonfinite_in_a_row)
        self.last_saved_step = None

    # ------------------------------------------------------------------ saving
    def save(self, step: int) -> Path:
        """Write checkpoint ``step`` (a collective in a data-parallel run: every rank calls it)."""
        c, dist = self.c, self.dist
        state = {
            "sampler": self.sampler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "modules": module_states(c.modules),
            # LoRA: model/ is merged. Under FSDP2 a collective that gathers the adapters' shards.
            "adapter": adapter_state(c.model),
            "history": list(self.result.history),
            "accuracy_before": self.result.accuracy_before,
            "nonfinite": self.guard.state_dict(),
            "config": self.cfg.to_dict(),
            "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
            # Each rank samples from its own generators: keep every rank's, restore each its own.
            "rng_ranks": dist.gather_objects(rng_state()),
        }
        model_state = full_model_state(dist, c.model)  # None unless the policy is sharded
        optim_state = full_optimizer_state(dist, c.model, c.optimizer, c.modules)
        staged = uses_engine_state(dist)
        if staged:  # DeepSpeed: every rank writes its optimizer partition into the staging folder
            tmp = staging_dir(self.run.path, step)
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier()
            save_engine_state(dist, tmp / "engine")
            dist.barrier()
        path = checkpoint_dir(self.run.path, step)
        if dist.is_main:
            save_checkpoint(self.run.path, step, c.model, c.tokenizer, c.optimizer, state,
                            keep_last=self.cfg.trainer.keep_last, model_state=model_state,
                            optimizer_state=optim_state, staged=staged)
        dist.barrier()  # the checkpoint is complete before any rank goes on (or exits on a stop)
        self.last_saved_step = step
        return path

    # ------------------------------------------------------------------ restoring
    def restore(self) -> int:
        """Load the checkpoint ``trainer.resume`` names, if any; return the step it ended at."""
        self.stop.training = True  # from here a first signal waits for the step to finish
        path = find_checkpoint(self.cfg, self.run.path)
        if path is None:
            if self.cfg.trainer.resume:
                self.progress.write(f"trainer.resume={self.cfg.trainer.resume}: no complete checkpoint "
                                    f"in {self.run.path / 'checkpoints'}, starting from step 0")
                # What a run that stopped before its first checkpoint logged is logged again from step 0.
                for name in ("metrics.jsonl", "samples.jsonl") if self.dist.is_main else ():
                    cut_log(self.run.path / name, -1)
                if hasattr(self.run, "resume_at"):
                    self.run.resume_at(-1)
            return 0
        c = self.c
        try:
            st = load_state(path)
            load_model_weights(c.model, path, st)
            if is_fsdp2(c.model):  # a full optimizer state: each rank takes its shard
                load_full_optimizer_state(c.model, c.optimizer, c.modules, st["optimizer"])
            elif uses_engine_state(self.dist):
                load_engine_state(self.dist, path / "engine")
            else:
                c.optimizer.load_state_dict(st["optimizer"])
        except DamagedCheckpoint as exc:
            raise ConfigError(f"checkpoint {path} is damaged or incomplete: {exc}{_others(path)}") from exc
        except (RuntimeError, ValueError, KeyError) as exc:
            why = " ".join(line.strip() for line in str(exc).splitlines()[:2])  # torch lists every tensor
            raise ConfigError(f"checkpoint {path} does not fit this run's model.path={self.cfg.model.path!r} "
                              f"and algorithm ({why} ...); resume with the config the checkpoint was written "
                              f"with ({path.parent.parent / 'config.yaml'})") from exc
        self.scheduler.load_state_dict(st["scheduler"])
        self.sampler.load_state_dict(st["sampler"])
        try:
            load_module_states(c.modules, st)
        except ValueError as exc:
            raise ConfigError(f"checkpoint {path}: {exc}") from None
        for name, obj in self.stateful.items():
            if name in st.get("stateful", {}):
                obj.load_state_dict(st["stateful"][name])
        self.guard.load_state_dict(st["nonfinite"])
        self.result.history = list(st["history"])
        self.result.accuracy_before = st.get("accuracy_before")
        c.backend.sync_weights(c.model)
        step = st["step"]
        changed = changed_keys(st.get("config", {}), self.cfg.to_dict())
        if changed:
            self.progress.write(f"anabranch: warning: resuming with a config that differs from the checkpoint's in "
                                f"{', '.join(changed)}: the run will not follow the trajectory it would have taken")
        # The main process alone writes the run's logs (the others log nowhere): it alone cuts them.
        for name in ("metrics.jsonl", "samples.jsonl") if self.dist.is_main else ():
            cut_log(self.run.path / name, step)
        if self.dist.is_main:  # checkpoints of this run after `step` belong to the trajectory being replaced
            stale = discard_after(self.run.path / "checkpoints", step)
            if stale:
                self.progress.write(f"anabranch: set aside {len(stale)} checkpoint(s) written after step {step} by the "
                                    f"run this one replaces: {', '.join(p.name for p in stale)}")
        if hasattr(self.run, "resume_at"):
            self.run.resume_at(step)
        ranks = st.get("rng_ranks") or [st["rng"]]
        if len(ranks) != self.dist.world_size:
            self.progress.write(f"anabranch: warning: the checkpoint was written by {len(ranks)} process(es) and "
                                f"this run has {self.dist.world_size}: sampling will not repeat the original run's")
        set_rng_state(ranks[self.dist.rank % len(ranks)])  # last: nothing above draws from them
        self.last_saved_step = step
        if step >= self.cfg.trainer.steps:
            # The loop then runs no step and goes straight to the end-of-run work: this is how a run
            # stopped by a signal during its last step (see after_step) is finished.
            self.progress.write(f"resumed from {path} at step {step}, which already reaches "
                                f"trainer.steps={self.cfg.trainer.steps}: no step left to train, running only "
                                f"the end-of-run work ({self._end_work()}; raise trainer.steps to train longer)")
        else:
            self.progress.write(f"resumed from {path}: continuing at step {step + 1} of {self.cfg.trainer.steps}")
        return step

    # ------------------------------------------------------------------ after each step
    def observe(self, step: int, metrics: dict) -> None:
        """Count non-finite steps into ``metrics`` and warn about them."""
        warning = self.guard.observe(step, metrics)
        if warning:
            self.progress.write(f"anabranch: warning: {warning}")

    def after_step(self, step: int) -> None:
        """Periodic save; on too many non-finite steps or a signal, save and raise :class:`RunStopped`."""
        every = self.cfg.trainer.save_every
        if every and step % every == 0:
            self.save(step)
        if self.guard.should_stop:
            path = self._save_once(step)
            self._close()
            raise RunStopped(f"{self.guard.stop_message(step)}\nlast checkpoint: {path}", path, exit_code=3)
        if self.dist.any(self.stop.requested):  # a signal to one rank stops them all, together
            path = self._save_once(step)
            # The signal may have reached another rank only (this one's signum is then None): every
            # rank reports, and exits with, the first rank's that got one.
            signum = next(s for s in self.dist.gather_objects(self.stop.signum) if s is not None)
            name = signal.Signals(signum).name
            self._close()
            # After the last step the run still stops here: the end-of-run work (a held-out eval
            # can take minutes) would outlast a scheduler's grace period between SIGTERM and
            # SIGKILL. Resuming this checkpoint trains nothing and runs that work alone.
            last = (f"; all {self.cfg.trainer.steps} steps are trained, resuming runs only the end-of-run "
                    f"work ({self._end_work()})" if step >= self.cfg.trainer.steps else "")
            raise RunStopped(f"stopped by {name} after step {step}; checkpoint: {path}{last}\n"
                             f"resume with:\n  {resume_command(self.cfg, self.run.path)}",
                             path, exit_code=128 + signum)

    def _end_work(self) -> str:
        """What the loop does after its last step, as the messages name it."""
        t = self.cfg.trainer
        return ", ".join((["eval_after"] if t.eval_after else []) + (["final/"] if t.save_final else [])
                         + ["summary.json"])

    def _close(self) -> None:
        self.progress.close()
        self.run.close()

    def _save_once(self, step: int) -> Path:
        if self.last_saved_step != step:
            self.save(step)
        return checkpoint_dir(self.run.path, step)
