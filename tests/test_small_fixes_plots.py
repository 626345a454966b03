"""The diversity bar plot: a count and fractions are not drawn against one shared y axis."""

import pytest

from anabranch.eval import plots


@pytest.fixture
def captured(monkeypatch):
    figs = []
    save = plots._save

    def keep(fig, path):
        figs.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figs


def bars_by_axes(fig):
    """Per axes that holds bars: its title and the bar heights in drawing order."""
    out = {}
    for ax in fig.axes:
        heights = [p.get_height() for p in ax.patches]
        if heights:
            out[ax.get_title()] = (ax, heights)
    return out


def test_each_metric_has_its_own_axis_with_the_runs_values(tmp_path, captured):
    groups = {"grpo": {"distinct_answers": 6.5, "distinct_1": 0.31, "distinct_2": 0.55, "embedding_diversity": 0.12},
              "flowrl": {"distinct_answers": 9.0, "distinct_1": 0.42, "distinct_2": 0.71, "embedding_diversity": 0.2}}
    path = plots.plot_bars(groups, tmp_path / "diversity.png", "diversity")
    assert path.exists()
    drawn = bars_by_axes(captured[-1])
    assert sorted(drawn) == sorted(groups["grpo"])
    for metric, (ax, heights) in drawn.items():
        assert heights == pytest.approx([groups["grpo"][metric], groups["flowrl"][metric]])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["grpo", "flowrl"]
    # The count's axis is not the fractions' axis: the fractions' panel is scaled to them, not to 9.
    count_ax = drawn["distinct_answers"][0]
    for metric in ("distinct_1", "distinct_2", "embedding_diversity"):
        ax = drawn[metric][0]
        assert ax is not count_ax
        assert ax.get_ylim()[1] < 1.0
    assert "count" in count_ax.get_ylabel()


def test_missing_metric_is_an_empty_bar_not_a_shift(tmp_path, captured):
    groups = {"a": {"distinct_answers": 2.0, "distinct_1": 0.5}, "b": {"distinct_answers": 3.0}}
    plots.plot_bars(groups, tmp_path / "d.png", "diversity")
    drawn = bars_by_axes(captured[-1])
    assert drawn["distinct_answers"][1] == [2.0, 3.0]
    a, b = drawn["distinct_1"][1]
    assert a == 0.5 and b != b  # NaN for the run without the metric
