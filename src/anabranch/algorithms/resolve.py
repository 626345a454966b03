"""From ``AlgorithmConfig`` to the functions the trainer calls."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from anabranch.algorithms.aggregation import MODES
from anabranch.algorithms.kl import ESTIMATORS
from anabranch.algorithms.registries import ADVANTAGES, OBJECTIVES, RECIPES
from anabranch.config import AlgorithmConfig, ConfigError


@dataclass
class Algorithm:
    cfg: AlgorithmConfig
    advantage: Callable
    objective: Callable
    needs: frozenset = field(default_factory=frozenset)
    # name -> factory(model_config, algorithm_cfg) -> nn.Module: extra trainable heads the
    # objective reads from ctx.modules (a log Z head, a value head). Registered with the
    # objective as ``modules={...}``; trained with the policy, saved in checkpoints, never exported.
    module_factories: dict = field(default_factory=dict)


def apply_recipe(cfg: AlgorithmConfig) -> AlgorithmConfig:
    """Fill the fields the user left at their defaults from the named recipe."""
    if cfg.name not in RECIPES:
        try:
            RECIPES.get(cfg.name)
        except KeyError as exc:
            raise ConfigError(f"algorithm.name: {exc.args[0]}") from None
    recipe = dict(RECIPES.get(cfg.name))
    defaults = AlgorithmConfig()
    updates = {}
    for key, value in recipe.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"recipe {cfg.name!r} sets unknown algorithm key {key!r}")
        if getattr(cfg, key) == getattr(defaults, key):  # the user did not set it
            updates[key] = value
    return dataclasses.replace(cfg, **updates)


def resolve_algorithm(cfg: AlgorithmConfig) -> Algorithm:
    cfg = apply_recipe(cfg)
    for key, registry in (("advantage", ADVANTAGES), ("loss", OBJECTIVES)):
        name = getattr(cfg, key)
        try:
            registry.get(name)
        except KeyError as exc:
            raise ConfigError(f"algorithm.{key}: {exc.args[0]}") from None
    if cfg.loss_agg_mode not in MODES:
        raise ConfigError(f"algorithm.loss_agg_mode {cfg.loss_agg_mode!r} is not one of {MODES}")
    if cfg.kl_estimator not in ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator {cfg.kl_estimator!r} is not one of {ESTIMATORS}")
    needs = set(_meta(OBJECTIVES, cfg.loss, "needs", cfg)) | set(_meta(ADVANTAGES, cfg.advantage, "needs", cfg))
    if cfg.kl_coef > 0:
        needs.add("ref_log_prob")
    if cfg.ppo_epochs > 1:
        needs.add("old_log_prob")
    factories = {**_meta(ADVANTAGES, cfg.advantage, "modules", cfg), **_meta(OBJECTIVES, cfg.loss, "modules", cfg)}
    return Algorithm(cfg=cfg, advantage=ADVANTAGES.get(cfg.advantage),
                     objective=OBJECTIVES.get(cfg.loss), needs=frozenset(needs), module_factories=factories)


def _meta(registry, name: str, key: str, cfg: AlgorithmConfig):
    """A registration's ``needs`` / ``modules``: a fixed value, or a function of the algorithm config
    for objectives whose inputs depend on their options (FlowRL needs a reference model only with
    ``flowrl.reference=ref``); such a function may raise ConfigError for bad options."""
    value = registry.meta(name).get(key, {} if key == "modules" else ())
    return value(cfg) if callable(value) else value
