"""anabranch: reinforcement-learning post-training of language models with verifiable rewards.

    from anabranch import Config, load_config, train
    result = train(load_config("configs/grpo.yaml", ["trainer.steps=10"]))
"""

from anabranch.config import Config, ConfigError, load_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "load_config", "train", "__version__"]


def train(cfg: Config | None = None, **kwargs):
    """Train with ``cfg`` (defaults when None); see :func:`anabranch.trainer.loop.train`."""
    from anabranch.trainer.loop import train as _train

    return _train(cfg if cfg is not None else Config(), **kwargs)
