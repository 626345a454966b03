"""The one whole-config check (config_checks.check_whole_config): run by load_config and again first thing in
train(), so a Config built in code is refused as a loaded one is, before any model loads."""

import dataclasses
import json
import subprocess
import sys

import pytest

from anabranch import load_config
from anabranch.config import Config, ConfigError
from anabranch.config_checks import _METHOD_CHECKS, check_whole_config


@pytest.fixture
def no_model(monkeypatch):
    """train() with the model builder (and the process group before it) made to fail if ever reached."""
    import anabranch.trainer.loop as loop

    def reached(*a, **k):
        raise AssertionError("the run got past the config check (a model would have loaded)")

    monkeypatch.setattr(loop, "build", reached)
    monkeypatch.setattr(loop.Distributed, "start", reached)
    return loop.train


def code_built(**sections) -> Config:
    """Config() with some sections' fields replaced: {"trainer": {"lr": 0}, ...}."""
    cfg = Config()
    for name, fields in sections.items():
        cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields)})
    return cfg


@pytest.mark.parametrize("sections,match", [
    # a range check of the list
    ({"trainer": {"lr": 0.0}}, r"config key 'trainer\.lr' must be positive \(got 0\.0\)"),
    # a _GATED key: an EAD knob while the schedule is constant
    ({"rollout": {"ead_tau_max": 2.0}},
     r"'rollout\.ead_tau_max' has no effect unless rollout\.temperature_schedule=ead"),
    # a method check of the table, which before this ran only in PromptPairing.create, after the model loaded
    ({"algorithm": {"name": "grpo", "advantage": "weighted_grpo", "loss": "ppo_clip"}}, r"task\.pairing"),
    # a table check that train() ran by hand before (trainer/ref_reset.py)
    ({"algorithm": {"kl_coef": 0.05, "ref_reset_every": 2}, "model": {"lora": {"r": 8}}},
     r"algorithm\.ref_reset_every=2 is not supported with LoRA"),
    # an algorithm range (resolve.check_ranges), which before this only build() refused
    ({"algorithm": {"kl_target": 0.01}}, r"algorithm\.kl_target needs algorithm\.kl_coef > 0"),
])
def test_train_refuses_a_code_built_config_before_any_model_loads(no_model, sections, match):
    if "model" in sections:  # LoRAConfig is nested one level deeper
        lora = dataclasses.replace(Config().model.lora, **sections["model"]["lora"])
        sections = {**sections, "model": {"lora": lora}}
    cfg = code_built(**sections)
    with pytest.raises(ConfigError, match=match):
        no_model(cfg)
    with pytest.raises(ConfigError, match=match):  # the same check, the same message, at load
        check_whole_config(cfg)


def test_a_valid_code_built_config_gets_past_the_check(no_model):
    """The fixture's failure is what stops it: the check itself accepts the default Config()."""
    with pytest.raises(AssertionError, match="got past the config check"):
        no_model(Config())


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.kl_target=0.01"], r"algorithm\.kl_target needs algorithm\.kl_coef > 0"),
    (["algorithm.clip_ratio_low=2"], r"algorithm\.clip_ratio_low must be in \[0, 1\]"),
    (["algorithm.loss_agg_mode=sum"], r"algorithm\.loss_agg_mode 'sum' is not one of"),
    # OREAL's refusals (algorithms/oreal.py: check_oreal, from check_ranges) fire at load now, not only in train()
    (["algorithm.name=oreal", "algorithm.ppo_epochs=2"], r"algorithm\.ppo_epochs=2 with algorithm\.loss=oreal"),
    (["algorithm.name=oreal", "algorithm.loss_agg_mode=seq-mean-token-mean"],
     r"algorithm\.loss_agg_mode='seq-mean-token-mean' with algorithm\.loss=oreal"),
    (["algorithm.name=oreal", "algorithm.srpo_coef=0.5"], r"algorithm\.srpo_coef=0\.5 with algorithm\.loss=oreal"),
])
def test_algorithm_ranges_are_refused_at_load(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_check_leaves_the_callers_config_alone_and_can_run_twice():
    cfg = Config()  # never loaded: its recipe is applied only to the copy that is checked
    check_whole_config(cfg)
    check_whole_config(cfg)
    assert (cfg.algorithm.advantage, cfg.algorithm.loss) == ("", "")
    loaded = load_config(None, ["algorithm.name=dapo"])
    before = dataclasses.asdict(loaded)
    check_whole_config(loaded)  # train() runs it again on a loaded config
    assert dataclasses.asdict(loaded) == before


_STD_ON_ACCURACY = ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_filter=std",
                    "algorithm.dynamic_sampling_metric=accuracy"]


def _std_warnings(capsys) -> int:
    out = capsys.readouterr()
    return (out.out + out.err).count("dynamic_sampling_filter=std with")


def test_a_warning_is_printed_once_though_the_check_runs_twice(capsys):
    cfg = load_config(None, _STD_ON_ACCURACY)
    check_whole_config(cfg)  # train() checks the loaded config again
    assert _std_warnings(capsys) == 1  # at load, not again
    # A code-built config (recipe not applied: the check resolves a copy) is remembered as the caller's object.
    built = code_built(algorithm={"dynamic_sampling": True, "dynamic_sampling_filter": "std",
                                  "dynamic_sampling_metric": "accuracy"})
    check_whole_config(built)
    check_whole_config(built)
    assert _std_warnings(capsys) == 1


def test_each_config_warns_once_whatever_ran_before(capsys):
    # Per config, not per process: a second run in one process (eval/compare.py, a sweep) warns again, and
    # no test depends on which one ran first.
    first, second = load_config(None, _STD_ON_ACCURACY), load_config(None, _STD_ON_ACCURACY)
    assert _std_warnings(capsys) == 2
    for cfg in (first, second, first, second):
        check_whole_config(cfg)
    assert _std_warnings(capsys) == 0
    assert first == second  # what the check remembers is no field: == (and asdict, config.yaml) ignore it


def test_validate_still_imports_from_config_loading():
    from anabranch.config_checks import inactive_key_error
    from anabranch.config_loading import validate

    with pytest.raises(ConfigError, match="trainer.lr"):
        validate(code_built(trainer={"lr": -1.0}))
    assert "has no effect unless X" in inactive_key_error("a.b", 1, "X")


def test_every_table_entry_names_a_function_that_exists():
    import importlib

    for check in _METHOD_CHECKS:
        module, _, name = check.target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), check.target
        assert check.why


def test_the_table_is_off_and_its_heavy_modules_unimported_on_the_default_config():
    for cfg in (Config(), load_config()):
        on = [c.target for c in _METHOD_CHECKS if c.on(cfg)]
        assert on == [], on
    # In a fresh interpreter (this one may have imported them for other tests): loading the default config and
    # checking a code-built one import none of the table's modules that the algorithm checks do not need.
    heavy = ["anabranch.trainer.cure_rollouts", "anabranch.trainer.spae_step", "anabranch.trainer.ref_reset",
             "anabranch.trainer.extra_rollouts", "anabranch.rollout.retry_turns"]
    code = ("import json, sys\nfrom anabranch import load_config\nfrom anabranch.config import Config\n"
            "from anabranch.config_checks import check_whole_config\n"
            "load_config(); check_whole_config(Config())\n"
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_section_knob_error_names_the_first_changed_key():
    from anabranch.config_algorithm_options import AMPOConfig
    from anabranch.config_checks import section_knob_error

    on = "algorithm.ampo.enabled=true"
    assert section_knob_error(AMPOConfig(), "algorithm.ampo", on) is None
    assert section_knob_error(AMPOConfig(enabled=True), "algorithm.ampo", on) is None  # `enabled` is no knob
    # keys None: every field but `enabled`, in field order (num_replace comes before selection)
    assert section_knob_error(AMPOConfig(selection="x", num_replace=5), "algorithm.ampo", on) == (
        "config key 'algorithm.ampo.num_replace' has no effect unless algorithm.ampo.enabled=true (got 5); "
        "set algorithm.ampo.enabled=true or leave it at its default")
    # explicit keys: only those are looked at
    assert section_knob_error(AMPOConfig(num_replace=5), "algorithm.ampo", on, ("selection",)) is None


# One value per field type that differs from any default the nested sections hold.
_OTHER = {bool: lambda v: not v, int: lambda v: v + 7, float: lambda v: v + 0.125, str: lambda v: v + "x",
          list: lambda v: [0.5]}


@pytest.mark.parametrize("name", ["guide", "ampo", "scope", "calibrl", "alp", "recap", "scaffold"])
def test_every_knob_of_a_nested_section_is_refused_while_it_is_off(name):
    # The keys come from the dataclass, so a field added later is refused too (no list to drift).
    section = getattr(Config().algorithm, name)
    knobs = [f.name for f in dataclasses.fields(section) if f.name != "enabled"]
    assert knobs
    for key in knobs:
        value = getattr(section, key)
        changed = dataclasses.replace(section, **{key: _OTHER[type(value)](value)})
        cfg = code_built(algorithm={name: changed})
        with pytest.raises(ConfigError, match=rf"'algorithm\.{name}\.{key}' has no effect unless "
                                              rf"algorithm\.{name}\.enabled=true"):
            check_whole_config(cfg)


@pytest.mark.parametrize("loss", ["reasonmaxxer", "oreal", "pacs"])
@pytest.mark.parametrize("key, value", [("srpo_coef", 0.5), ("er_shaping_coef", 0.1), ("position_shaping_coef", 0.1)])
def test_advantage_options_are_refused_with_every_loss_that_ignores_advantages(loss, key, value):
    # One refusal (resolve.check_ranges, from registries.ADVANTAGE_OPTIONS) for each ignores_advantages objective.
    cfg = code_built(algorithm={"name": loss, key: value})
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}={value} with algorithm\.loss={loss}: this loss never "
                                          r"reads the advantages"):
        check_whole_config(cfg)


@pytest.mark.parametrize("loss", ["reasonmaxxer", "oreal", "pacs"])
@pytest.mark.parametrize("key, value, why", [
    ("srpo_coef", 0.5, r"SRPO takes a failed sample out of the main loss by zeroing its advantage "
                       r"\(srpo\.route_advantages\).*SRPO's routing cannot act"),
    ("dsdr_local_coef", 0.01, r"DSDR's local entropy term is weighted by γ_i, a softmax of the diversity d_i that its "
                              r"global scale adds to the correct rows' rewards before the advantages"),
    ("er_shaping_coef", 0.1, r"so this option would do nothing"),
])
def test_the_refusal_says_why_each_advantage_option_cannot_act(loss, key, value, why):
    # SRPO and DSDR's local term add a loss term of their own: "would do nothing" would be false for them.
    cfg = code_built(algorithm={"name": loss, key: value})
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}={value} with algorithm\.loss={loss}: .*{why}") as err:
        check_whole_config(cfg)
    assert ("would do nothing" in str(err.value)) == (key == "er_shaping_coef")


def test_resolve_algorithm_on_its_own_refuses_an_option_of_a_method_that_is_off():
    # The public API (benchmarks/ call it without load_config) refuses what config_checks._GATED refuses.
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig

    algo = AlgorithmConfig()
    cfg = dataclasses.replace(algo, name="grpo", loss="grpo", brain_beta=algo.brain_beta * 2 + 1)
    with pytest.raises(ConfigError, match=r"config key 'algorithm\.brain_beta' has no effect unless algorithm\.loss="
                                          r"brain \(algorithm\.name=brain\)"):
        resolve_algorithm(cfg)
    with pytest.raises(ConfigError, match=r"'algorithm\.scope\.max_per_group' has no effect unless "
                                          r"algorithm\.scope\.enabled=true"):
        resolve_algorithm(dataclasses.replace(algo, scope=dataclasses.replace(algo.scope, max_per_group=1)))
    resolve_algorithm(dataclasses.replace(algo, name="brain", loss="", advantage=""))  # on: resolved, no refusal
