"""`python -m gptlab.compare` on a real sweep made by `python -m gptlab.train -m`: on its folder,
its parent run id and its experiment.

The sweep is made once per session (tests/test_sweep.py checks its MLflow parent run and children,
tests/test_browser.py renders them)."""

import json
from pathlib import Path

import pytest
from helpers import run_cli

from gptlab.compare import RunRecord, differing_keys, table
from gptlab.compare import main as compare_main
from gptlab.errors import GptlabError

_MADE = {}


def make_sweep(tmp_path_factory, shakespeare):
    """(cwd, the sweep folder, sweep.json, the command's result) of a 3-job lr sweep of gpt_nano
    whose third job (lr=-1) fails its config check before it trains."""
    if "sweep" not in _MADE:
        cwd = tmp_path_factory.mktemp("sweep")
        r = run_cli(
            [
                "gptlab.train",
                "-m",
                "model=gpt_nano",
                f"data.path={shakespeare}",
                "train.max_steps=12",
                "train.eval_every=6",
                "train.eval_steps=2",
                "train.log_every=3",
                "train.batch_size=8",
                "train.sample_tokens=0",
                "train.save_checkpoints=false",
                "optimizer.warmup_steps=2",
                "optimizer.lr=1e-3,3e-3,-1",
            ],
            cwd=cwd,
            timeout=600,
        )
        sweeps = list((cwd / "outputs" / "sweeps").glob("*/sweep.json"))
        assert len(sweeps) == 1, r.stdout[-3000:] + r.stderr[-3000:]
        _MADE["sweep"] = (cwd, sweeps[0].parent, json.loads(sweeps[0].read_text()), r)
    return _MADE["sweep"]


@pytest.fixture(scope="session")
def sweep(tmp_path_factory, shakespeare):
    return make_sweep(tmp_path_factory, shakespeare)


def client_for(cwd: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")


@pytest.mark.slow
def test_compare_a_sweep_folder_prints_the_table_and_writes_the_png(sweep):
    cwd, sweep_dir, info, _ = sweep
    r = run_cli(["gptlab.compare", str(sweep_dir)], cwd=cwd)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "run",
        "optimizer.lr",
        "status",
        "best",
        "val",
        "loss",
        "best",
        "val",
        "bpb",
        "tokens/s",
        "MFU",
        "wall",
    ]
    rows = [ln.split() for ln in lines[2:5]]
    results = {j: json.loads((sweep_dir / j / "results.json").read_text()) for j in ("0", "1")}
    best = {j: r["best_val_loss"] for j, r in results.items()}
    order = sorted(best, key=best.get)
    assert [row[0] for row in rows] == [*order, "2"]  # best val loss first, the failed job last
    assert rows[0][1:4] == [
        {"0": "0.001", "1": "0.003"}[order[0]],
        "FINISHED",
        f"{best[order[0]]:.4f}",
    ]
    assert rows[0][4] == f"{results[order[0]]['best_val_bpb']:.4f}"
    # status and error from the sweep's MLflow children
    assert rows[2][1:6] == ["-1", "FAILED", "-", "-", "-"]
    assert rows[0][6].endswith("%") and rows[0][7].endswith("s")
    assert "errors:" in lines and any("2: GptlabError: optimizer.lr" in ln for ln in lines)
    png = sweep_dir / "compare_val_loss.png"
    assert f"val loss curves: {png}" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_compare_a_parent_run_id_or_an_experiment_gives_the_same_table(sweep, monkeypatch, capsys):
    cwd, sweep_dir, info, _ = sweep
    monkeypatch.chdir(cwd)
    compare_main([str(sweep_dir)])
    from_folder = capsys.readouterr().out.splitlines()[:5]
    compare_main([info["parent_run_id"]])
    out = capsys.readouterr().out
    assert out.splitlines()[:5] == from_folder
    png = cwd / "outputs" / "compare" / f"{info['parent_run_id']}.png"
    assert png.is_file() and f"val loss curves: {Path('outputs') / 'compare' / png.name}" in out
    compare_main(["gpt_nano-shakespeare_char", f"compare.out={cwd / 'exp.png'}"])
    # by experiment: the runs by name, the sweep parent left out
    rows = capsys.readouterr().out.splitlines()[2:5]
    assert [r.split()[0] for r in rows] == ["gpt_nano-shakespeare_char-cpu"] * 3
    assert (cwd / "exp.png").is_file()


def test_compare_says_what_a_target_is_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GptlabError, match="no MLflow store at .*outputs/mlflow.db"):
        compare_main(["no-such-thing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(GptlabError, match="holds no run folders"):
        compare_main([str(tmp_path / "empty")])


def test_table_shows_only_differing_overrides_best_first():
    common = {"model": "gpt_nano", "train.max_steps": "100"}
    records = [
        RunRecord(
            "0", {**common, "optimizer.lr": "1e-3"}, "FINISHED", 2.5, 3.6, 1000.0, 0.01, 30.0
        ),
        RunRecord(
            "1", {**common, "optimizer.lr": "3e-3"}, "FINISHED", 2.1, 3.0, 1200.0, 0.012, 28.0
        ),
        RunRecord(
            "2", {**common, "optimizer.lr": "1e-2"}, "FAILED", None, error="GptlabError: diverged"
        ),
    ]
    assert differing_keys(records) == ["optimizer.lr"]
    lines = table(records).splitlines()
    assert lines[0].split()[:3] == ["run", "optimizer.lr", "status"]
    assert [ln.split()[:4] for ln in lines[2:5]] == [
        ["1", "3e-3", "FINISHED", "2.1000"],
        ["0", "1e-3", "FINISHED", "2.5000"],
        ["2", "1e-2", "FAILED", "-"],
    ]
    assert lines[2].split()[4:] == ["3.0000", "1,200", "1.20%", "28s"]
    assert lines[-2:] == ["errors:", "  2: GptlabError: diverged"]


def test_table_by_bits_per_byte_puts_the_best_bpb_first_and_shows_downstream_scores():
    """Two tokenizers: the lower loss in nats is not the better model per byte; the runs' eval
    scores get a column each, '-' where a run has none."""
    char = RunRecord("char", {"data": "shakespeare_char"}, "FINISHED", 1.5, 2.16)
    char.scores = {"hellaswag_acc_norm": 0.26}
    bpe = RunRecord("bpe", {"data": "shakespeare"}, "FINISHED", 3.2, 1.9)
    bpe.scores = {"mc/acc": 0.7, "hellaswag_acc_norm": 0.28}
    by_loss = table([bpe, char]).splitlines()
    assert [ln.split()[0] for ln in by_loss[2:]] == ["char", "bpe"]
    by_bpb = table([char, bpe], "bpb").splitlines()
    assert by_bpb[0].split() == [
        "run", "data", "status", "best", "val", "loss", "best", "val", "bpb",
        "hellaswag_acc_norm", "mc/acc", "tokens/s", "MFU", "wall",
    ]  # fmt: skip
    assert [ln.split()[:6] for ln in by_bpb[2:]] == [
        ["bpe", "shakespeare", "FINISHED", "3.2000", "1.9000", "0.2800"],
        ["char", "shakespeare_char", "FINISHED", "1.5000", "2.1600", "0.2600"],
    ]
    assert by_bpb[3].split()[6] == "-"  # char has no mc/acc
    with pytest.raises(GptlabError, match="compare.metric=nats: must be one of loss, bpb"):
        compare_main(["compare.target=.", "compare.metric=nats"])
