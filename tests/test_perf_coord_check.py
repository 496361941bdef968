"""python -m gptlab.bench bench.coord_check=true: muP's coordinate check, and the transfer check
(flat under muP, growing with the width under the standard form)."""

import json

import pytest
from helpers import REPO, run_cli

from gptlab.bench import BenchConfig
from gptlab.cli import compose
from gptlab.config import to_config
from gptlab.perf import coord_check


def bench(*overrides):
    return to_config(compose("bench", ["bench.coord_check=true", *overrides]), BenchConfig)


def transfer_check(optimizer, widths):
    standard = bench(f"optimizer={optimizer}")
    mup = bench(f"optimizer={optimizer}", "model.parametrization=mup")
    grows = coord_check.growth(coord_check.coord_check(standard.model, standard.optimizer, widths))
    flat = coord_check.growth(coord_check.coord_check(mup.model, mup.optimizer, widths))
    assert all(0.5 <= g <= 2.0 for g in flat.values()), flat  # within 2x from 64 to 512 wide
    assert grows["logits"] > 2.0 and grows["h.1.mlp"] > 2.0, grows


def test_mup_is_flat_and_the_standard_forms_logits_grow_with_the_width():
    transfer_check("adamw", (32, 256))  # 8x wider: the default widths' range, at less cost


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, widths", [("adamw", coord_check.WIDTHS), ("muon", (64, 512))])
def test_the_transfer_check_at_the_default_widths(optimizer, widths):
    transfer_check(optimizer, widths)


def test_the_check_prints_one_json_line_and_writes_its_plot(tmp_path, capsys):
    result = coord_check.run(bench("model.parametrization=mup"), tmp_path, [32, 64], steps=2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == result
    assert result["parametrization"] == "mup" and result["widths"] == [32, 64]
    names = ["embedding", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp", "logits"]
    assert list(result["layers"]) == names and all(len(v) == 2 for v in result["layers"].values())
    assert json.loads((tmp_path / coord_check.RESULT).read_text()) == result
    assert (tmp_path / coord_check.PLOT).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_bench_command_runs_the_check(tmp_path):
    out = run_cli(
        ["gptlab.bench", "bench.coord_check=true", "optimizer=adamw",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["parametrization"] == "standard" and result["widths"] == [64, 128, 256, 512]
    assert (tmp_path / "run" / coord_check.PLOT).is_file()
