"""`anabranch eval` refuses bad models and sampling settings in one line, before any model loads."""

import json

import pytest

from anabranch import cli
from anabranch.config import ConfigError
from anabranch.eval.runner import EvalSettings, resolve_model


class Loaded(Exception):
    """Raised by the patched loaders: the command got as far as loading a model."""


@pytest.fixture
def no_loading(monkeypatch):
    # Imported before patching: a module first imported while the loaders are patched would keep the
    # patched functions in its own namespace (``from ... import load_model``) for later tests.
    import anabranch.trainer.components as components
    from anabranch.models import loading

    def refuse(*args, **kwargs):
        raise Loaded("a model or tokenizer was loaded")

    for name in ("load_model", "load_tokenizer", "resolve_model_path"):
        monkeypatch.setattr(loading, name, refuse)
    for name in ("load_model", "load_tokenizer"):
        monkeypatch.setattr(components, name, refuse)


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def eval_cli(capsys, tmp_out, *args):
    # Positionals (models, then overrides) come first: argparse does not mix them with the options.
    args = [str(a) for a in args]
    flags = next((i for i, a in enumerate(args) if a.startswith("--")), len(args))
    # --out: a check that wrongly passed must not leave an eval-<time> folder in the working directory.
    out = ["--out", str(tmp_out / "ev")]
    code = cli.main(["eval", *args[:flags], "task.eval_size=2", *out, *args[flags:]])
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *fragments):
    assert code == 2, err
    assert err.startswith("anabranch eval: error: ") and err.count("\n") == 1, err
    for f in fragments:
        assert f in err, err


@pytest.mark.parametrize("flags, fragments", [
    (["--n", "0"], ["--n must be >= 1"]),
    (["--n", "4", "--k", "0,1"], ["--k values [0]", "1..n=4"]),
    (["--n", "4", "--k", "1,8"], ["--k values [8]"]),
    (["--temperature", "-1"], ["--temperature must be >= 0"]),
    (["--n", "4", "--temperature", "0"], ["would be identical"]),
    (["--top-p", "0"], ["--top-p must be in (0, 1]"]),
    (["--top-p", "1.5"], ["--top-p must be in (0, 1]"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens must be >= 0"]),
])
def test_bad_sampling_settings_fail_before_any_model_loads(flags, fragments, tmp_path, hf_folder, no_loading, capsys):
    assert_one_line_error(*eval_cli(capsys, tmp_path, hf_folder, *flags), *fragments)


def test_bad_models_fail_before_any_model_loads(tmp_path, hf_folder, no_loading, capsys):
    assert_one_line_error(*eval_cli(capsys, tmp_path, tmp_path / "nope", "--n", "2"), "no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(*eval_cli(capsys, tmp_path, empty), "folder without config.json", "step-NNNNNN")
    run = tmp_path / "run"  # a run directory with no final/ model
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    assert_one_line_error(*eval_cli(capsys, tmp_path, run), "no final/ model", f"{run}/checkpoints/step-NNNNNN")
    assert_one_line_error(*eval_cli(capsys, tmp_path, "nope"), "neither a local folder nor a Hub id")
    assert_one_line_error(*eval_cli(capsys, tmp_path, "packaged:gpt-17"), "not a packaged model", "packaged:smollm2")
    # A good model beside a bad one: still nothing is loaded.
    assert_one_line_error(*eval_cli(capsys, tmp_path, hf_folder, tmp_path / "nope"), "no such folder")


def test_good_arguments_reach_the_model_load(tmp_path, hf_folder, no_loading, capsys):
    common = ["eval", str(hf_folder), "task.eval_size=2", "--out", str(tmp_path / "ev")]
    # Temperature 0 is greedy decoding: allowed for a single sample per problem.
    with pytest.raises(Loaded):
        cli.main(common + ["--n", "1", "--temperature", "0"])
    with pytest.raises(Loaded):
        cli.main(common + ["--n", "4", "--k", "1,4", "--top-p", "1"])
    assert not (tmp_path / "ev").exists()  # a load that fails leaves no empty output folder


def test_accepted_model_forms_resolve(tmp_path, hf_folder):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "final" / "config.json").write_text("{}")
    spec = resolve_model(str(run))
    assert (spec.path, spec.run_dir, spec.config_file) == (str(run / "final"), run, run / "config.yaml")
    ckpt = run / "checkpoints" / "step-000002"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_bytes(b"")
    (ckpt / "model" / "config.json").write_text("{}")
    spec = resolve_model(str(ckpt))
    assert (spec.label, spec.path, spec.config_file) == ("run/step-000002", str(ckpt / "model"), run / "config.yaml")
    assert resolve_model(str(hf_folder)).path == str(hf_folder)
    assert resolve_model("packaged:smollm2-135m-instruct").path == "packaged:smollm2-135m-instruct"
    assert resolve_model("org/some-model").path == "org/some-model"  # a Hub id: not checked offline


def test_settings_check_directly():
    EvalSettings(n=1, temperature=0.0).check()
    EvalSettings(n=16, ks=[1, 16], top_p=0.9).check()
    with pytest.raises(ConfigError, match="identical"):
        EvalSettings(n=2, temperature=0.0).check()


def test_compare_checks_eval_n_before_training(no_loading, capsys):
    assert cli.main(["compare", "--algorithms", "grpo", "--eval-n", "-1"]) == 2
    assert "--eval-n must be >= 0" in capsys.readouterr().err


def test_run_eval_passk_file_records_n_and_problems(tmp_path, monkeypatch, capsys):
    # evaluate_model is stubbed: this checks what run_eval writes into the run directory.
    from anabranch.eval import plots, runner

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "final" / "config.json").write_text("{}")

    def fake_evaluate(cfg, spec, settings):
        return {"label": spec.label, "n": settings.n, "num_problems": 3, "pass@k": {"1": 0.5}}, {}

    monkeypatch.setattr(runner, "evaluate_model", fake_evaluate)
    monkeypatch.setattr(plots, "plot_passk", lambda *a: None)
    monkeypatch.setattr(plots, "plot_high_reward_map", lambda *a: None)
    runner.run_eval([str(run)], None, [], EvalSettings(n=4), tmp_path / "ev")
    saved = json.loads((run / "eval_passk.json").read_text())
    assert (saved["n"], saved["num_problems"], saved["models"][0]["n"]) == (4, 3, 4)
    capsys.readouterr()
    runner.run_eval([str(run)], None, [], EvalSettings(n=8), tmp_path / "ev")
    assert "(n=4, 3 problems) with n=8, 3 problems" in capsys.readouterr().out  # said aloud
    assert json.loads((run / "eval_passk.json").read_text())["n"] == 8
