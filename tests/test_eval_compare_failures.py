"""`anabranch compare`: one algorithm's failure does not lose the others' runs or the report, and a
bad combination stops the command before any training."""

import json

import pytest

from anabranch.config import ConfigError
from anabranch import cli
from anabranch.eval import compare
from anabranch.trainer import loop


def fake_train(fail: set):
    trained = []

    def train(cfg):
        algo = cfg.algorithm.name
        trained.append(algo)
        run = __import__("pathlib").Path(cfg.trainer.output_dir) / cfg.trainer.run_name
        run.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "reward/mean": 0.1 * s, "entropy": 1.0 - 0.1 * s} for s in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if algo in fail:
            raise RuntimeError(f"{algo} diverged at step 2")
        (run / "summary.json").write_text(json.dumps({"steps": 2}))
        return type("R", (), {"run_dir": run, "final_model_dir": None})()

    return train, trained


def test_a_failed_algorithm_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    train, trained = fake_train({"dapo"})
    monkeypatch.setattr(loop, "train", train)
    code = cli.main(["compare", "--algorithms", "grpo,dapo,flowrl",
                     f"trainer.output_dir={tmp_path}", "trainer.run_name=cmp"])
    captured = capsys.readouterr()
    assert code == 1 and trained == ["grpo", "dapo", "flowrl"]  # flowrl still trained after dapo failed
    assert "1 of 3 algorithms failed (dapo: RuntimeError: dapo diverged at step 2)" in captured.err
    html = (tmp_path / "cmp" / "report.html").read_text()
    for algo in ("grpo", "dapo", "flowrl"):  # dapo's two logged steps are in the report too
        assert f"<td>{algo}</td>" in html
    assert "2 (unfinished)" in html


def test_a_bad_combination_stops_compare_before_any_training(tmp_path, monkeypatch):
    train, trained = fake_train(set())
    monkeypatch.setattr(loop, "train", train)
    # FlowRL refuses tis_cap (algorithms/resolve.py); GRPO would take it.
    with pytest.raises(ConfigError, match=r"--algorithms flowrl: algorithm\.tis_cap"):
        compare.run_compare(["grpo", "flowrl"], None, [f"trainer.output_dir={tmp_path}", "algorithm.tis_cap=2"])
    assert trained == []


def test_report_plots_the_held_out_reward_of_runs_without_a_right_wrong_reward(tmp_path):
    """A run whose held-out problems have no right/wrong reward logs eval/reward: the report plots
    it, instead of a placeholder asking for trainer.eval_every."""
    from anabranch.eval.report import make_plots, read_run

    run = tmp_path / "judge-run"
    run.mkdir()
    rows = [{"step": 0, "eval/reward": 0.2}, {"step": 1, "reward/mean": 0.3}, {"step": 2, "eval/reward": 0.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plots"
    out.mkdir()
    assert make_plots([read_run(run)], out)["accuracy"][1] == "held-out reward"
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.3}) + "\n")
    assert make_plots([read_run(empty)], out)["accuracy"][1] == "held-out accuracy"
