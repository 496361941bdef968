"""The lr transfer check and the search's best configuration for the big run (docs/mup.md, "The
transfer check"): records/transfer.py's best lr per width and drift, gptlab.compare's table, PNG,
compare.json and compare.export_best (search/best.py), a sweep parent's transfer figures, and a
real width x lr sweep through `python -m gptlab.train -m hparams_search=lr_transfer`.

The run folders are built in tmp_path as gptlab writes them (results.json, metrics.jsonl,
config_resolved.yaml, .hydra/overrides.yaml), as in test_compare_seeds.py."""

import json
from pathlib import Path

import pytest
import yaml
from helpers import compose_config, run_cli
from omegaconf import OmegaConf

from gptlab.compare import main as compare_main
from gptlab.errors import GptlabError
from gptlab.records import transfer

LRS = ("1e-3", "3e-3", "1e-2")
# best val loss per (width, lr), seeds 0 and 1: the narrow model's best lr is 1e-2, the middle's
# 3e-3, the wide one's 1e-3 (drift 0.1). At width 64 seed 0 alone would pick 3e-3: the mean decides.
LOSSES = {
    64: {"1e-3": (2.30, 2.32), "3e-3": (2.10, 2.30), "1e-2": (2.15, 2.15)},
    128: {"1e-3": (2.20, 2.22), "3e-3": (2.00, 2.02), "1e-2": (2.40, 2.42)},
    256: {"1e-3": (1.90, 1.92), "3e-3": (1.95, 1.97), "1e-2": (2.60, 2.62)},
}
MODEL = {"parametrization": "mup", "mup_base_width": 64}  # the runs' resolved model section


def points(losses=LOSSES, **extra):
    return [
        ({"model.n_embd": str(w), "optimizer.lr": lr, "train.seed": str(s), **extra}, value)
        for w, by_lr in losses.items()
        for lr, values in by_lr.items()
        for s, value in enumerate(values)
    ]


def make_run(folder: Path, overrides, best: float) -> Path:
    """A finished run folder as gptlab writes it."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    rows = [{"step": s, "tokens": s * 256, "val_loss": best + 0.1 * (2 - i)} for i, s in
            enumerate((10, 20, 30))]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config_resolved.yaml").write_text(yaml.safe_dump({"model": MODEL}))
    results = {"steps": 30, "best_val_loss": best, "best_val_bpb": best * 1.44, "wall_s": 30.0}
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def make_sweep(root: Path, shared=("model=gpt_nano", "optimizer=adamw")) -> Path:
    for job, (o, value) in enumerate(points()):
        make_run(root / str(job), [*shared, *(f"{k}={v}" for k, v in o.items())], value)
    return root


def test_each_widths_best_lr_is_the_best_mean_over_seeds_and_the_drift_their_ratio():
    (t,) = transfer.transfers(points())
    assert t.widths == [64, 128, 256]
    assert t.best_lr == {64: 1e-2, 128: 3e-3, 256: 1e-3}
    assert t.drift == pytest.approx(0.1)
    assert t.at_edge == [64, 256]  # their optimum is the grid's largest or smallest lr
    assert t.curves[64][1] == (3e-3, pytest.approx(2.20), 2)  # (lr, mean, seeds)
    assert transfer.detect(points()) == "model.n_embd"
    assert transfer.parent_metrics([t]) == {
        "transfer/drift": pytest.approx(0.1),
        "transfer/best_lr/n_embd_64": 1e-2,
        "transfer/best_lr/n_embd_128": 3e-3,
        "transfer/best_lr/n_embd_256": 1e-3,
    }


def test_runs_that_differ_in_more_than_width_lr_and_seed_are_separate_transfers():
    flat = {w: {lr: (2.0,) for lr in LRS} for w in (64, 256)}
    flat[64]["3e-3"] = flat[256]["3e-3"] = (1.0,)
    mixed = [(dict(o, **{"model.parametrization": "mup"}), v) for o, v in points(flat)]
    mixed += [(dict(o, **{"model.parametrization": "standard"}), v) for o, v in points()]
    mixed.append(({"model.n_embd": "64", "optimizer.lr": "1e-3"}, float("nan")))  # diverged
    mup, standard = transfer.transfers(mixed)
    assert mup.group == {"model.parametrization": "mup"} and mup.drift == 1.0
    assert standard.group == {"model.parametrization": "standard"}
    assert standard.drift == pytest.approx(0.1)
    assert "transfer/model.parametrization=mup/drift" not in transfer.parent_metrics([mup])
    assert set(transfer.parent_metrics([mup, standard])) >= {
        "transfer/model.parametrization_mup/drift",
        "transfer/model.parametrization_standard/drift",
    }
    assert transfer.detect(points(flat)[:3]) is None  # one width: no transfer sweep


@pytest.mark.integration
def test_compare_reports_the_transfer_its_plot_and_json(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep")
    path = tmp_path / "table.json"
    compare_main([str(sweep), f"compare.json={path}"])
    out = capsys.readouterr().out
    assert "n_embd=64: best lr 0.01, loss 2.1500 (2 seeds, 3 lrs)" in out
    assert "n_embd=256: best lr 0.001" in out and "drift (n_embd 256 / 64): 0.1" in out
    assert (sweep / "compare_transfer.png").stat().st_size > 10_000
    (doc,) = json.loads(path.read_text())["transfer"]
    assert doc["widths"] == [64, 128, 256] and doc["drift"] == pytest.approx(0.1)
    assert doc["best_lr"] == {"64": 0.01, "128": 0.003, "256": 0.001}
    with pytest.raises(GptlabError, match="^compare.transfer=train.batch_size: the runs need 2"):
        compare_main([str(sweep), "compare.transfer=train.batch_size"])


@pytest.mark.integration
def test_export_best_writes_an_experiment_the_big_run_uses_as_is(tmp_path, capsys):
    """The best configuration over seeds (width 256, lr 1e-3: mean 1.91) as conf/experiment/x.yaml:
    composed with a wider model it equals the best run's overrides with the width left out."""
    sweep = make_sweep(tmp_path / "sweep", shared=("optimizer=adamw", "train.batch_size=16"))
    conf = tmp_path / "conf"
    target = conf / "experiment" / "my_best.yaml"
    compare_main([str(sweep), f"compare.export_best={target}"])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out == (
        f"best configuration written to {target}: python -m gptlab.train experiment=my_best "
        "model.n_embd=<wide>"
    )
    text = target.read_text()
    assert text.startswith("# @package _global_\n")
    assert "Left out (the big run's own): model.n_embd." in text.replace("\n# ", " ")
    search = f"hydra.searchpath=[file://{conf}]"
    big = compose_config(["experiment=my_best", search, "model.n_embd=512"])
    by_hand = compose_config(
        ["optimizer=adamw", "train.batch_size=16", "optimizer.lr=1e-3", "model.n_embd=512",
         "model.parametrization=mup", "model.mup_base_width=64"]
    )  # fmt: skip
    for section in ("model", "optimizer", "train", "data"):
        assert OmegaConf.to_container(big[section]) == OmegaConf.to_container(by_hand[section])
    assert big.optimizer.lr == 1e-3 and big.model.parametrization == "mup"


@pytest.mark.integration
def test_a_sweeps_parent_gets_the_drift_each_widths_best_lr_and_the_plot(tmp_path):
    from gptlab.records import parent
    from gptlab.records.store import local_uri, mlflow_client

    uri = local_uri(tmp_path / "mlflow.db")
    client = mlflow_client(uri)
    sweep = {"sweep_dir": str(tmp_path / "s"), "experiment": "transfer", "run_name": "t",
             "overrides": ["hparams_search=lr_transfer", "train.seed=0,1"]}  # fmt: skip
    run = parent.create(client, uri, sweep)
    for job, (o, value) in enumerate(points()):
        tags = {**parent.child_tags(sweep, run.info.run_id), "run_dir": f"{tmp_path}/s/{job}",
                "overrides": " ".join(f"{k}={v}" for k, v in o.items())}  # fmt: skip
        child = client.create_run(run.info.experiment_id, run_name=str(job), tags=tags)
        client.log_metric(child.info.run_id, "summary/best_val_loss", value)
        client.set_terminated(child.info.run_id, "FINISHED")
    parent.end(client, run.info.experiment_id, run.info.run_id, stopped=False)
    m = client.get_run(run.info.run_id).data.metrics
    assert m["transfer/drift"] == pytest.approx(0.1)
    assert m["transfer/best_lr/n_embd_128"] == pytest.approx(3e-3)
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert transfer.TRANSFER_PNG in artifacts


@pytest.mark.slow
def test_a_real_transfer_sweep_reports_its_drift_in_the_parent_and_compare(
    shakespeare, tmp_path, capsys
):
    """python -m gptlab.train -m hparams_search=lr_transfer on gpt_nano (widths 32, 64 x 2 lrs,
    30 steps), tracked in a SQLite store under tmp_path; then gptlab.compare on its folder."""
    from gptlab.records.store import local_uri, mlflow_client

    outputs = tmp_path / "outputs"
    r = run_cli(
        ["gptlab.train", "-m", "hparams_search=lr_transfer", "model=gpt_nano", "optimizer=adamw",
         "model.parametrization=mup", "model.mup_base_width=32", "model.n_embd=32,64",
         "optimizer.lr=3e-3,3e-2", "train.max_steps=30", "train.eval_every=15",
         "train.eval_steps=2", "train.batch_size=8", "optimizer.warmup_steps=5",
         f"data.path={shakespeare}", f"paths.outputs={outputs}"],
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sweep,) = (outputs / "sweeps").glob("lr_transfer-*")
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]
    recorded = json.loads((sweep / "sweep.json").read_text())
    client = mlflow_client(local_uri(outputs / "mlflow.db"))
    m = client.get_run(recorded["parent_run_id"]).data.metrics
    assert {"transfer/best_lr/n_embd_32", "transfer/best_lr/n_embd_64"} <= set(m)
    best = {w: m[f"transfer/best_lr/n_embd_{w}"] for w in (32, 64)}
    assert m["transfer/drift"] == pytest.approx(best[64] / best[32])
    artifacts = [a.path for a in client.list_artifacts(recorded["parent_run_id"])]
    assert transfer.TRANSFER_PNG in artifacts
    compare_main([str(sweep), f"tracking.uri={local_uri(outputs / 'mlflow.db')}"])
    assert "drift (n_embd 64 / 32)" in capsys.readouterr().out
    assert (sweep / transfer.TRANSFER_PNG).is_file()
