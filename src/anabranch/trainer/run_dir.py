"""The run directory ``runs/<name>/``: resolved config, metrics.jsonl, TensorBoard events,
sampled completions and checkpoints."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from anabranch.config import Config


def default_run_name(cfg: Config) -> str:
    return f"{cfg.algorithm.name}-{cfg.task.name}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunDir:
    def __init__(self, cfg: Config):
        name = cfg.trainer.run_name or default_run_name(cfg)
        self.path = Path(cfg.trainer.output_dir) / name
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(cfg.to_yaml())
        self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        self._samples = open(self.path / "samples.jsonl", "a", buffering=1)
        self._tb = None
        if cfg.trainer.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path / "tensorboard"))

    def resume_at(self, step: int) -> None:
        """Continue after checkpoint ``step``: TensorBoard hides events a crashed run logged past it
        (``purge_step``: the event files are append-only, so they are masked, not deleted)."""
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(str(self.path / "tensorboard"), purge_step=step + 1)

    def log_metrics(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        for s in samples:
            self._samples.write(json.dumps({"step": step, **s}) + "\n")

    def write_json(self, name: str, data) -> None:
        (self.path / name).write_text(json.dumps(data, indent=2))

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v
