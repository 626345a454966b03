"""The end of a run writes final/ before the held-out eval: a run killed during that eval (which can
take minutes: a scheduler's SIGKILL after its grace period) still leaves the trained model on disk."""

from pathlib import Path

import anabranch.trainer.loop as loop_mod
from anabranch import load_config, train

from test_train_e2e import digit_task, tiny_overrides


def test_final_model_is_written_before_the_eval_after(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    seen = []
    real = loop_mod.greedy_accuracy

    def watched(*args, **kwargs):
        seen.append((tmp_path / "tiny" / "final" / "config.json").is_file())
        return real(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "greedy_accuracy", watched)
    cfg = load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path,
                                           **{"trainer.steps": 1, "trainer.eval_before": True}))
    result = train(cfg)
    assert seen == [False, True]  # before training: nothing yet; after: final/ already written
    assert Path(result.final_model_dir) == tmp_path / "tiny" / "final"
    assert result.accuracy_after is not None and (tmp_path / "tiny" / "summary.json").is_file()
