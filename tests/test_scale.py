"""python -m gptlab.scale: a CSV or run folders in, the fit's table, scaling.json and a plot out."""

from __future__ import annotations

import csv
import json

import pytest
from test_scaling_fit import LAW, isoflop_grid

from gptlab import scale
from gptlab.errors import GptlabError


def write_csv(path, points):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["flops", "params", "tokens", "loss", "note"])  # other columns are ignored
        w.writerows([[p.flops, p.params, p.tokens, p.loss, "x"] for p in points])


def test_a_csv_gives_the_table_the_json_the_plot_and_the_prediction(tmp_path, capsys):
    write_csv(tmp_path / "study.csv", isoflop_grid())
    result = scale.main([f"scale.source={tmp_path / 'study.csv'}", "scale.target_flops=1e21",
                         "scale.bootstrap=5"])  # fmt: skip
    written = json.loads((tmp_path / "scaling.json").read_text())
    assert written["a"] == pytest.approx(result["a"]) and {"alpha", "beta", "E", "A", "B"} <= set(
        written
    )
    assert set(written["intervals"]) >= {"a", "b", "alpha", "beta"}
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    target = written["target"]
    assert target["d_opt"] == pytest.approx(1e21 / 6 / target["n_opt"])
    assert target["loss"] < min(b["loss"] for b in written["budgets"])  # more compute, lower loss
    out = capsys.readouterr().out
    assert "N_opt ~ C^a: a = 0.45" in out and "held out (1e+20 FLOPs" in out


def test_run_folders_are_read_from_their_records(tmp_path):
    """A folder of run folders: FLOPs = tokens x derived.json's flops_per_token."""
    for i, p in enumerate(isoflop_grid(budgets=(1e17, 1e18, 1e19), sizes=5)):
        run = tmp_path / "study" / str(i)
        run.mkdir(parents=True)
        (run / "results.json").write_text(
            json.dumps({"params": p.params, "tokens": p.tokens, "best_val_loss": p.loss})
        )
        (run / "derived.json").write_text(json.dumps({"flops_per_token": p.flops / p.tokens}))
    (tmp_path / "study" / "unfinished").mkdir()
    (tmp_path / "study" / "unfinished" / "results.json").write_text("{}")
    result = scale.main([f"scale.source={tmp_path / 'study'}", "scale.bootstrap=0"])
    assert result["points"] == 15 and len(result["budgets"]) == 3
    assert result["alpha"] == pytest.approx(LAW["alpha"], rel=0.02)


def test_a_missing_source_is_one_line(tmp_path):
    with pytest.raises(GptlabError, match="no such CSV file or folder"):
        scale.main([f"scale.source={tmp_path / 'none.csv'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(GptlabError, match="no finished run"):
        scale.main([f"scale.source={tmp_path / 'empty'}"])
