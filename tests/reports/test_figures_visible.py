"""The training figures as drawn: every method visible where lines coincide, endpoints that are Table 2's finals,
bands inside the quantity's range, the anchor of each method's ppo_kl named (rendered matplotlib artists, Agg)."""

from __future__ import annotations

import numpy as np
import pytest
from report_database import EVAL_SIZE, GRPO_VAL

from reports import queries
from reports.figures import draw as drawing
from reports.figures import training
from reports.labels import method_label, sweep_delta
from reports.tables.main_results import main_results

QWEN4 = "Qwen3-4B-Base · BF16"
E2E = "Qwen3-30B-A3B-Base · FP8 E2E"


@pytest.fixture
def drawn(ctx_factory, monkeypatch, tmp_path):
    """Draw a training figure for real (PNG into tmp_path) and keep its Figure: figure-name -> (result, fig)."""
    figs = []
    real_save = drawing.save_figure

    def keep(fig, out_dir, name, formats=("png", "pdf")):
        figs.append(fig)
        return real_save(fig, out_dir, name, formats)

    monkeypatch.setattr(drawing, "save_figure", keep)

    def draw(fn, **kw):
        ctx = ctx_factory(**kw)
        ctx.out, ctx.draw, ctx.formats = tmp_path, True, ("png",)
        result = fn(ctx)
        assert result.files and result.files[0].is_file()
        return result, figs[-1]

    return draw


def _axes(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_visible() and ax.get_title().split("\n")[0] == title)


def _by_gid(ax, kind: str) -> dict[str, object]:
    """label -> artist of the artists whose gid is "<kind>:<label>" (lines, bands, final markers)."""
    found = {}
    for artist in [*ax.lines, *ax.collections]:
        gid = artist.get_gid() or ""
        if gid.startswith(f"{kind}:"):
            found[gid.split(":", 1)[1]] = artist
    return found


def _marker_points(line) -> set[tuple[float, float]]:
    x, y = (np.asarray(a, dtype=float) for a in line.get_data())
    return {(float(x[i]), float(y[i])) for i in line.get_markevery()}


def test_coinciding_methods_each_show_their_own_markers(drawn):
    """In the cpu_s panel DPPO-TopK-KL and the aggregated tail are the same runs: exactly coinciding lines. Each
    line still shows: a marker shape of its own, on points where no other line of the panel puts a marker."""
    _, fig = drawn(training.fig1_main_comparison)
    ax = _axes(fig, QWEN4)
    lines = _by_gid(ax, "line")
    assert len(lines) == 3
    dppo = next(v for k, v in lines.items() if k.startswith("DPPO-TopK-KL"))
    agg = next(v for k, v in lines.items() if k.startswith("Predictive (aggregated tail)"))
    np.testing.assert_array_equal(dppo.get_xydata(), agg.get_xydata())  # the case: they coincide exactly
    assert len({line.get_marker() for line in lines.values()}) == 3
    points = {label: _marker_points(line) for label, line in lines.items()}
    for label, mine in points.items():
        others = set().union(*(p for k, p in points.items() if k != label))
        assert mine and not mine & others, (label, mine, others)


@pytest.mark.parametrize("n_points, n_lines", [(3, 3), (4, 3), (100, 4), (11, 2), (2, 3)])
def test_marker_slots_never_share_a_point_while_lines_have_points_enough(n_points, n_lines):
    slots = [training.marker_slots(n_points, n_lines, j) for j in range(n_lines)]
    assert all(s and all(0 <= i < n_points for i in s) for s in slots)
    if n_points >= n_lines:
        flat = [i for s in slots for i in s]
        assert len(flat) == len(set(flat))
    assert all(len(s) <= training.MARKERS_PER_LINE for s in slots)


def test_line_end_marks_table2_final_not_the_smoothed_value(drawn, ctx_factory):
    """fig1 draws EMA-smoothed lines; the hollow diamond at each line's end is Table 2's final of that method."""
    _, fig = drawn(training.fig1_main_comparison)
    ctx = ctx_factory()
    sel = queries.select_runs(ctx.runs, sweep_delta(queries.MAIN_SWEEP), ctx.sweeps, queries.MAIN_SWEEP)
    table, _ = main_results(ctx, sel.runs)
    checked = differs = 0
    for key, by_method in table:
        if not by_method:
            continue
        ax = _axes(fig, key.title.split("\n")[0])
        finals, lines = _by_gid(ax, "final"), _by_gid(ax, "line")
        for method, r in by_method.items():
            label = next(k for k in finals if k.startswith(f"{method_label(method)} ("))
            x, y = finals[label].get_data()
            line_x, line_y = lines[label].get_data()
            assert x[0] == line_x[-1]  # at the line's end
            assert y[0] == pytest.approx(r.final.mean, rel=1e-12)
            checked += 1
            differs += abs(line_y[-1] - r.final.mean) > 1e-6
    # the smoothed end differs somewhere: the marker is what shows the final
    assert checked >= 4 and differs >= 1


def _band_y(band) -> np.ndarray:
    return np.concatenate([p.vertices[:, 1] for p in band.get_paths()])


def test_bands_stay_inside_the_quantitys_range(drawn):
    """GRPO's three seeds on fp8_e2e (GRPO_VAL) give a t-interval reaching below 0 at steps 1, 3 and 4: the drawn
    band stops at 0 (an accuracy cannot be negative); fig8's clip-fraction bands stay in [0, 1]."""
    assert min(np.mean(v) for v in zip(*GRPO_VAL.values())) < 0.2  # low means with a wide spread: the case
    _, fig = drawn(training.fig1_main_comparison, raw=True)
    bands = _band_y(next(iter(_by_gid(_axes(fig, E2E), "band").values())))
    assert bands.min() == 0.0 and bands.max() <= 1.0
    _, fig8 = drawn(training.fig8_ppo_kl_clipfrac, raw=True)
    clip_row = [ax for ax in fig8.axes if ax.get_visible() and ax.get_subplotspec().rowspan.start == 1]
    assert clip_row
    for ax in clip_row:
        for band in _by_gid(ax, "band").values():
            y = _band_y(band)
            assert y.min() >= 0.0 and y.max() <= 1.0


def test_fig8_legend_names_each_methods_ppo_kl_anchor(drawn):
    result, fig = drawn(training.fig8_ppo_kl_clipfrac)
    texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    grpo = [t for t in texts if t.startswith(method_label("grpo_clip_higher"))]
    dppo = [t for t in texts if t.startswith(method_label("dppo_topk_kl"))]
    assert grpo and all("ppo_kl vs π_old" in t for t in grpo)
    assert dppo and all("ppo_kl vs μ" in t for t in dppo)
    assert "anchor" in result.caption and "π_old" in result.caption


def test_the_subtitle_states_the_evaluation_split_size_the_runs_recorded(drawn):
    """The runs of the test database record task.eval_size = EVAL_SIZE (not conf/'s default): the subtitle says so."""
    _, fig = drawn(training.fig6_aime24_aime25)
    assert f"n = {EVAL_SIZE} problems per evaluation split" in fig._suptitle.get_text().replace("\n", " ")
