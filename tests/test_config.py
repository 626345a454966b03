import pytest

from anabranch.config import Config, ConfigError, RewardFunctionConfig, load_config


def test_defaults_are_the_default_recipe():
    cfg = load_config()
    assert cfg.algorithm.name == "grpo"
    assert cfg.model.path == "packaged:smollm2-135m-instruct"
    assert cfg.model.dtype == "float32"
    assert cfg.task.name == "basic_arithmetic"


def test_yaml_then_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 4\ntrainer:\n  steps: 3\n  lr: 1e-5\n")
    cfg = load_config(path, ["rollout.n=8", "algorithm.name=grpo", "task.params={max_digits: 2}",
                             "trainer.lr=3e-6", "model.path=/some/dir"])
    assert cfg.rollout.n == 8  # command line wins over the file
    assert cfg.trainer.steps == 3  # file wins over defaults
    assert cfg.trainer.lr == pytest.approx(3e-6)
    assert cfg.task.params == {"max_digits": 2}
    assert cfg.model.path == "/some/dir"


def test_yaml_scientific_notation_string_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 1e-5\n")  # PyYAML reads this as a string
    assert load_config(path).trainer.lr == pytest.approx(1e-5)


def test_unknown_key_names_it_and_suggests_closest():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.nn=8"])
    assert "'rollout.nn'" in str(e.value) and "'rollout.n'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.stepz=8"])
    assert "'trainer.steps'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["lr=1e-5"])  # a leaf without its section
    assert "'trainer.lr'" in str(e.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  nmae: grpo\n")
    with pytest.raises(ConfigError, match=r"algorithm\.nmae.*algorithm\.name"):
        load_config(path)


@pytest.mark.parametrize("item,key", [
    ("rollout.n=eight", "rollout.n"),
    ("trainer.lr=fast", "trainer.lr"),
    ("trainer.progress=maybe", "trainer.progress"),
    ("rollout.n=2.5", "rollout.n"),
    ("task.params=3", "task.params"),
])
def test_wrong_type_names_the_key(item, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [item])


@pytest.mark.parametrize("item,key", [
    ("trainer.lr=-1e-5", "trainer.lr"),
    ("rollout.n=0", "rollout.n"),
    ("model.dtype=int8", "model.dtype"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("trainer.keep_last=-1", "trainer.keep_last"),
    ("trainer.max_nonfinite_in_a_row=0", "trainer.max_nonfinite_in_a_row"),
    ("trainer.save_every=-2", "trainer.save_every"),
    ("rollout.top_k=-5", "rollout.top_k"),
    ("rollout.min_new_tokens=100000", "rollout.min_new_tokens"),
    ("rollout.generation_batch_size=-1", "rollout.generation_batch_size"),
    ("trainer.weight_decay=-1", "trainer.weight_decay"),
    ("trainer.adam_beta2=1", "trainer.adam_beta1"),
    ("trainer.warmup_steps=-2", "trainer.warmup_steps"),
    ("trainer.lr_schedule=bogus", "trainer.lr_schedule"),
    ("trainer.grad_clip=-1", "trainer.grad_clip"),
    ("trainer.eval_every=-1", "trainer.eval_every"),
    ("trainer.device=tpu", "trainer.device"),
    ("algorithm.overlong_buffer=100000", "algorithm.overlong_buffer"),
])
def test_bad_values_are_rejected(item, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [item])


@pytest.mark.parametrize("item,key", [
    ("algorithm.clip_ratio_low=-0.5", "algorithm.clip_ratio_low"),
    ("algorithm.clip_ratio_high=-0.1", "algorithm.clip_ratio_high"),
    ("algorithm.flowrl.beta=-1", "algorithm.flowrl.beta"),
])
def test_bad_algorithm_values_are_rejected_before_the_model_loads(item, key):
    from anabranch.algorithms import resolve_algorithm

    name = "flowrl" if "flowrl" in item else "grpo"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_algorithm(load_config(None, [f"algorithm.name={name}", item]).algorithm)


def test_valid_devices_and_dapo_buffer_pass():
    for device in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        assert load_config(None, [f"trainer.device={device}"]).trainer.device == device
    cfg = load_config(None, ["algorithm.name=dapo", "rollout.max_new_tokens=32"])
    assert cfg.algorithm.overlong_buffer == 8
    with pytest.raises(ConfigError, match=r"overlong_buffer.*max_new_tokens=8"):
        load_config(None, ["algorithm.name=dapo", "rollout.max_new_tokens=8"])  # the recipe's buffer is 8


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["rollout.n"])


def test_reward_functions_forms():
    cfg = load_config(None, ["reward.functions=[math_verify, 'mypkg.mod:fn*0.5']"])
    assert cfg.reward.functions == [RewardFunctionConfig("math_verify", 1.0),
                                    RewardFunctionConfig("mypkg.mod:fn", 0.5)]
    cfg = load_config(None, ["reward.functions=[{name: math_verify, weight: 2}]"])
    assert cfg.reward.functions[0].weight == 2.0


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/file.yaml")


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["rollout.n=3", "reward.functions=[math_verify]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_packaged_recipes_load():
    from pathlib import Path

    # kdrl.yaml leaves its teacher to the command line and is refused at load without one (tests/test_kdrl.py).
    needs = {"kdrl.yaml": ["algorithm.kdrl.teacher=some/teacher"]}
    for path in sorted(Path(__file__).parents[1].glob("configs/*.yaml")):
        assert isinstance(load_config(path, needs.get(path.name)), Config), path


def test_grpo_yaml_is_the_default_recipe():
    from pathlib import Path

    assert load_config(Path(__file__).parents[1] / "configs" / "grpo.yaml") == load_config()


def test_recipe_fills_unset_keys_and_explicit_values_win():
    ppo = load_config(None, ["algorithm.name=ppo"]).algorithm
    assert (ppo.advantage, ppo.loss) == ("gae", "ppo_clip") and ppo.kl_coef > 0
    # An explicit value equal to the dataclass default still overrides the recipe.
    assert load_config(None, ["algorithm.name=ppo", "algorithm.kl_coef=0"]).algorithm.kl_coef == 0.0
    dr = load_config(None, ["algorithm.name=dr_grpo"]).algorithm
    assert dr.norm_adv_by_std is False


def test_unknown_algorithm_fails_at_load_time():
    with pytest.raises(ConfigError, match="algorithm.name.*'grpo'"):
        load_config(None, ["algorithm.name=grop"])


@pytest.mark.parametrize("override, turn_on", [
    ("rollout.ead_tau_min=0.2", "rollout.temperature_schedule=ead"),
    ("algorithm.std_filter_beta=1.0", "algorithm.dynamic_sampling_filter=std"),
    ("algorithm.ref_reset_optimizer=false", "algorithm.ref_reset_every > 0"),
])
def test_options_of_a_method_that_is_off_are_refused(override, turn_on):
    from anabranch.config import ConfigError

    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"'{key}' has no effect unless {turn_on}"):
        load_config(None, [override])
