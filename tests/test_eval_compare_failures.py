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
