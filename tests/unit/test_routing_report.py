"""The routing report: counts that add up to T·k, load statistics, dead experts, table, JSON and plots."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from random_tokens import RandomTokenLoader

from moetron.eval.plots import (
    expert_load_heatmap,
    heatmap_colours,
    load_ratios,
    loss_curves,
    matplotlib_missing,
    read_jsonl,
)
from moetron.eval.routing_report import RoutingRecorder, _LayerSums, format_table
from moetron.model.config import ModelConfig
from moetron.model.gpt import create_model
from moetron.train.validation import evaluate

MBS, SEQ = 2, 16


def FixedBatches(vocab: int, seed: int = 0) -> RandomTokenLoader:
    """A loader of random [MBS, SEQ + 1] token batches from one seed."""
    return RandomTokenLoader(MBS, SEQ, vocab, seed)


def moe_model(topk: int, num_experts=(4, 8), capacity_factor: float = 1.0) -> torch.nn.Module:
    cfg = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=SEQ,
        vocab_size=64,
        num_experts=list(num_experts),  # pyramid: layer 1 has 4 experts, layer 3 has 8
        topk=topk,
        moe_eval_capacity_factor=capacity_factor,
        moe_top2_2nd_expert_sampling=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return create_model(cfg, seed=3)


@pytest.mark.parametrize("topk", [1, 2])
def test_counts_add_up_to_routed_tokens_and_match_the_model(topk):
    model = moe_model(topk)
    recorder = RoutingRecorder(model)
    torch.manual_seed(0)  # top-1 drops by random token selection: the same draws for both passes
    result = evaluate(recorder, FixedBatches(64), iters=3)
    torch.manual_seed(0)
    plain = evaluate(model, FixedBatches(64), iters=3)
    assert result["valid_loss"] == plain["valid_loss"]  # recording changes nothing
    report = recorder.report()
    assert [r.layer for r in report] == [1, 3] and [r.num_experts for r in report] == [4, 8]
    tokens = 3 * MBS * SEQ
    for r in report:
        assert r.tokens == tokens and r.topk == topk
        assert sum(r.tokens_per_expert) == tokens * topk
        assert all(k <= n for k, n in zip(r.kept_per_expert, r.tokens_per_expert, strict=True))
        assert r.dropped_fraction == pytest.approx(1 - sum(r.kept_per_expert) / (tokens * topk))
        assert 0.0 <= r.entropy <= r.max_entropy == pytest.approx(math.log(r.num_experts))
        assert r.load_max_over_mean == pytest.approx(max(r.tokens_per_expert) / (tokens * topk / r.num_experts))
        assert r.aux_loss > 0
    assert report[0].dead_experts == [e for e, n in enumerate(report[0].tokens_per_expert) if n == 0]


def test_dropless_routing_drops_nothing_and_a_small_factor_drops():
    model = moe_model(1, capacity_factor=0.25)
    recorder = RoutingRecorder(model)
    evaluate(recorder, FixedBatches(64), iters=2)
    assert all(r.dropped_fraction > 0 for r in recorder.report())
    dropless = RoutingRecorder(model)
    with model.inference_routing(dropless=True):
        evaluate(dropless, FixedBatches(64), iters=2)
    assert all(r.dropped_fraction == 0 for r in dropless.report())


def test_statistics_of_known_counts():
    sums = _LayerSums(layer=1, num_experts=4)
    sums.routes_E = torch.tensor([6, 2, 0, 0])
    sums.kept_E = torch.tensor([4, 2, 0, 0])
    sums.tokens, sums.topk, sums.passes, sums.aux_sum = 8, 1, 1, 1.5
    r = sums.report()
    assert r.load_max_over_mean == 3.0  # 6 / mean 2
    assert r.load_cv == pytest.approx(math.sqrt((16 + 0 + 4 + 4) / 4) / 2)
    assert r.dropped_fraction == 0.25 and r.dead_experts == [2, 3] and r.aux_loss == 1.5
    table = format_table([r])
    assert "dead: [2, 3]" in table and "25.00%" in table and "6 2 0 0" in table
    # one line each on reading CV, entropy and the aux loss, with this report's expert count filled in
    legend = {line.split()[0]: line for line in table.splitlines() if line.startswith("  ") and "layer" not in line}
    assert "0 = perfectly even, 1.73 = all on one of the 4" in legend["CV"]  # sqrt(E - 1)
    assert "log E (a uniform router)" in legend["entropy"] and "1.0 = balanced" in legend["aux"]
    assert json.loads(json.dumps(r.to_dict()))["tokens_per_expert"] == [6, 2, 0, 0]


def test_dense_model_report_says_so():
    assert "no MoE layer" in format_table([])


def test_plots_are_pngs(tmp_path):
    if matplotlib_missing():
        pytest.skip("matplotlib is not installed (pip install moetron[plot])")
    routing = [{"layer": 1, "tokens_per_expert": [5, 3, 0, 8]}, {"layer": 3, "tokens_per_expert": [1] * 8}]
    heatmap = expert_load_heatmap(routing, tmp_path / "load.png")
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"iteration": i, "lm_loss": 9 - i}) for i in (1, 2)))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"iteration": 2, "valid_loss": 7.5}) + "\n{torn")
    curves = loss_curves(tmp_path, tmp_path / "curves.png")
    for path in (heatmap, curves):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(read_jsonl(tmp_path / "eval.jsonl")) == 1  # the torn line of a killed run is skipped
    assert loss_curves(tmp_path / "empty", tmp_path / "none.png") is None


def test_the_heatmap_is_centred_on_the_balanced_share():
    """White at 1/E of a layer's routes, red above, blue below, whatever the layer's expert count (a pyramid)."""
    if matplotlib_missing():
        pytest.skip("matplotlib is not installed")
    routing = [{"layer": 1, "tokens_per_expert": [4, 4, 4, 4]}, {"layer": 3, "tokens_per_expert": [0, 1, 2, 3] * 2}]
    ratios = load_ratios(routing)
    assert ratios[0][:4] == [1.0] * 4
    assert ratios[1] == pytest.approx([0, 2 / 3, 4 / 3, 2] * 2)
    rgba, norm, _ = heatmap_colours(ratios)
    assert float(norm(1.0)) == 0.5  # the colour scale's middle is the balanced share
    assert (rgba[0, :4, :3] > 0.9).all()  # balanced: white
    assert all(math.isnan(v) for v in ratios[0][4:]) and (rgba[0, 4:, 3] == 0).all()  # no such expert: none
    hot, cold, dead = rgba[1, 3], rgba[1, 1], rgba[1, 0]
    assert hot[0] > hot[2] and cold[2] > cold[0] and dead[2] > dead[0] and dead[:3].sum() < cold[:3].sum()


@pytest.mark.parametrize("experts", [4, 8, 64])
def test_the_heatmaps_title_fits_and_its_colour_bar_marks_one_and_a_half(experts):
    if matplotlib_missing():
        pytest.skip("matplotlib is not installed")
    from moetron.eval.plots import _pyplot, colour_bar_ticks, heatmap_figure

    fig = heatmap_figure([{"layer": 1, "tokens_per_expert": [1] * (experts - 1) + [experts]}])
    title = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1  # nothing clipped
    assert 1.5 in fig.axes[1].get_yticks()
    _pyplot().close(fig)
    assert colour_bar_ticks(2.0) == [0.0, 0.5, 1.0, 1.5, 2] and colour_bar_ticks(9.0)[-1] == 8


def test_missing_matplotlib_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert "pip install moetron[plot]" in matplotlib_missing()


def test_ep_load_columns_of_known_counts():
    """EP 2 over 4 experts (rank 0: experts 0-1): all 8 kept routes on expert 0 are 8 / mean 4 = 2.0 routed; one
    replica slot moves 4 of them to rank 1 (1.0 computed)."""
    for replicas, computed in ((0, 2.0), (1, 1.0)):
        sums = _LayerSums(layer=1, num_experts=4, ep=2, replicas=replicas)
        assert sums.ep_loads(torch.tensor([8, 0, 0, 0])) == (2.0, computed)
    one_process = _LayerSums(layer=1, num_experts=4)
    assert one_process.ep_loads(torch.tensor([8, 0, 0, 0])) == (1.0, 1.0)
    sums = _LayerSums(layer=1, num_experts=4, ep=2, replicas=1)
    sums.ep_load_sum, sums.passes, sums.tokens, sums.topk = [4.0, 2.0], 2, 8, 1
    r = sums.report()
    assert (r.ep_load_routed, r.ep_load_computed) == (2.0, 1.0) and "2.000→1.000" in format_table([r])
