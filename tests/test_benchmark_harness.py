"""benchmarks/harness.py: the matmul probes around an update are recorded and kept out of its timings."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # noqa: E402


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return harness.tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def test_matmul_probes_are_recorded_and_not_counted_in_the_step(tiny_folder):
    # Two probes of at least 2.5 s around the update. Counted, they would put the step (and the
    # update) at more than the whole run's wall time less the probes', however busy the host is.
    w = harness.Workload(model=tiny_folder, prompts_per_step=2, n=2, tokens=4, warmup=0, steps=1, probe_peak=True,
                         probe_seconds=2.5)
    runner = harness.AnabranchRunner(w, "hf")
    t0 = time.perf_counter()
    res = runner.run()
    total = time.perf_counter() - t0

    assert len(runner.probe.gflops) == 2 and runner.probe.wall_s >= 5.0
    assert res.adjacent_peak_gflops == [pytest.approx(sum(runner.probe.gflops) / 2)]
    assert res.adjacent_peak_gflops[0] > 1.0  # GFLOP/s: a real measurement, not a placeholder
    (step,), (gen,), (upd,) = res.step_s, res.generate_s, res.update_s
    assert step + runner.probe.wall_s <= total and upd + runner.probe.wall_s <= total
    # the rewards and advantages are the only parts of the step outside the rollout and the update
    assert gen + upd <= step + 1e-6 < gen + upd + 0.25


def test_without_probe_peak_nothing_is_probed(tiny_folder):
    w = harness.Workload(model=tiny_folder, prompts_per_step=2, n=2, tokens=4, warmup=0, steps=1)
    runner = harness.AnabranchRunner(w, "hf")
    res = runner.run()
    assert res.adjacent_peak_gflops == [] and runner.probe.wall_s == 0.0



@pytest.mark.parametrize("checkpointing", [False, True])
def test_both_sides_get_the_same_gradient_checkpointing(tiny_folder, checkpointing, tmp_path):
    # TRL's GRPOConfig turns gradient checkpointing on by default (TRL 1.16), which recomputes every
    # layer's forward in its update; the comparison must set the same value on both sides.
    w = harness.Workload(model=tiny_folder, prompts_per_step=2, n=2, tokens=4, warmup=0, steps=1,
                         gradient_checkpointing=checkpointing)
    runner = harness.AnabranchRunner(w, "hf")
    assert runner.model.is_gradient_checkpointing is checkpointing
    pytest.importorskip("trl", reason="trl not installed (benchmark extra: pip install 'anabranch[bench]')")
    assert harness.trl_config(w, str(tmp_path)).gradient_checkpointing is checkpointing
    assert harness.trl_config(w, str(tmp_path)).bf16 is False
