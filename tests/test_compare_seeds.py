"""Seeds as replicates and what a run cost: `gptlab.compare` groups runs that differ only in
train.seed into one configuration (mean ± std, Welch's t-test against a baseline, compare.json,
the seeds' PNG), results.json's device_hours and cost, a sweep's parent summing its jobs', and
gptlab.plan's prediction of both.

The run folders are built in tmp_path as gptlab writes them (results.json, metrics.jsonl,
config_resolved.yaml, .hydra/overrides.yaml): no training. The tests that run the command (its
PNGs) are integration tests."""

import json
from pathlib import Path

import pytest
import yaml
from helpers import compose_config, typed

from gptlab.compare import main as compare_main
from gptlab.config import to_config
from gptlab.errors import GptlabError
from gptlab.records.identity import RunIdentity
from gptlab.records.store import default_uri
from gptlab.records.tracker import Tracker, device_usage, sacct_device_hours

# best val losses of three seeds each: lr=1e-3 is far better than lr=1e-4; log_every changes nothing
FAR_APART = {"optimizer.lr=1e-3": [2.441, 2.445, 2.457], "optimizer.lr=1e-4": [2.729, 2.745, 2.763]}
NO_OP = {"train.log_every=10": [2.501, 2.532, 2.474], "train.log_every=20": [2.518, 2.466, 2.509]}


def make_run(folder: Path, overrides, best: float, wall_s: float = 30.0, nproc: int = 1) -> Path:
    """A finished run folder as gptlab writes it (no device_hours in results.json: a run of before
    they were recorded, or one whose figures compare derives from its config)."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    rows = [{"step": s, "tokens": s * 256, "val_loss": best + 0.1 * (2 - i)} for i, s in
            enumerate((10, 20, 30))]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hardware = {"nodes": 1, "nproc_per_node": nproc, "cost_per_device_hour": 2.0}
    (folder / "config_resolved.yaml").write_text(yaml.safe_dump({"hardware": hardware}))
    results = {"steps": 30, "best_val_loss": best, "best_val_bpb": best * 1.44, "wall_s": wall_s,
               "tokens_per_s": 1000.0, "mfu": 0.01, "stopped_by": None}  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def make_sweep(root: Path, configs) -> Path:
    """A sweep folder of configs' seeds: job i's overrides are its config's and train.seed=k."""
    job = 0
    for config, values in configs.items():
        for seed, best in enumerate(values):
            make_run(root / str(job), [f"train.seed={seed}", config, "model=gpt_nano"], best)
            job += 1
    return root


def compare(folder: Path, *overrides, capsys) -> str:
    compare_main([str(folder), *overrides])
    return capsys.readouterr().out


@pytest.mark.integration
def test_three_seeds_of_a_large_difference_are_significant(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep", FAR_APART)
    path = tmp_path / "table.json"
    out = compare(
        sweep, "compare.baseline=optimizer.lr=1e-4", f"compare.json={path}", capsys=capsys
    )
    rows = json.loads(path.read_text())["rows"]
    assert [r["overrides"] for r in rows] == [
        {"optimizer.lr": "1e-3", "model": "gpt_nano"},
        {"optimizer.lr": "1e-4", "model": "gpt_nano"},
    ]
    best, base = rows
    assert best["n"] == 3 and best["mean"] == pytest.approx(sum(FAR_APART["optimizer.lr=1e-3"]) / 3)
    assert best["std"] == pytest.approx(0.008327, rel=1e-3)
    assert best["p_value"] < 0.05 and best["significant"] is True
    low, high = best["interval"]
    assert low < best["diff"] < high < 0  # lr=1e-3 is lower, the whole interval below zero
    assert base["baseline"] and base["p_value"] is None and base["significant"] is None
    # 3 seeds x 30 s x 1 process, priced at 2.0 a device-hour
    assert best["device_hours"] == pytest.approx(3 * 30 / 3600)
    assert best["cost"] == pytest.approx(2.0 * 3 * 30 / 3600)
    assert "seeds as replicates: 6 runs, 2 configurations" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("optimizer.lr=1e-3 ") and "[" in ln)
    assert line.split()[-3:] == ["yes", "0.025", "0.05"]  # the verdict, device-h, cost
    png = sweep / "compare_val_loss_seeds.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_a_no_op_key_is_not_significant(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep", NO_OP)
    path = tmp_path / "table.json"
    out = compare(sweep, f"compare.json={path}", capsys=capsys)  # the baseline: the best
    rows = json.loads(path.read_text())["rows"]
    assert rows[0]["baseline"] and rows[1]["p_value"] > 0.05 and rows[1]["significant"] is False
    assert "not significant" in out
    # a stricter alpha changes the verdict's level and the interval's (99%), not the p-value
    strict = tmp_path / "strict.json"
    compare(sweep, "compare.alpha=0.01", f"compare.json={strict}", capsys=capsys)
    again = json.loads(strict.read_text())
    assert again["alpha"] == 0.01 and again["rows"][1]["p_value"] == rows[1]["p_value"]
    assert again["rows"][1]["interval"][0] < rows[1]["interval"][0]


@pytest.mark.integration
def test_a_baseline_by_job_or_folder_and_the_bad_ones_in_one_line(tmp_path, capsys):
    sweep = make_sweep(tmp_path / "sweep", FAR_APART)
    make_run(sweep / "6", ["train.seed=0", "optimizer.lr=3e-3", "model=gpt_nano"], 2.6)
    for spec in ("4", str(sweep / "5"), "optimizer.lr=0.0001"):  # a job, a folder, 1e-4 as typed
        path = tmp_path / "by.json"
        compare(sweep, f"compare.baseline={spec}", f"compare.json={path}", capsys=capsys)
        rows = json.loads(path.read_text())["rows"]
        assert [r["overrides"]["optimizer.lr"] for r in rows if r["baseline"]] == ["1e-4"]
        assert next(r for r in rows if r["n"] == 1)["p_value"] is None  # one seed: no test
    with pytest.raises(GptlabError, match="compare.baseline=optimizer.lr=9: no configuration"):
        compare(sweep, "compare.baseline=optimizer.lr=9", capsys=capsys)
    with pytest.raises(GptlabError, match="needs at least 2 seeds per side; the baseline has 1"):
        compare(sweep, "compare.baseline=optimizer.lr=3e-3", capsys=capsys)
    with pytest.raises(GptlabError, match=r"compare.alpha=1.5: must be between 0 and 1"):
        compare(sweep, "compare.alpha=1.5", capsys=capsys)


@pytest.mark.integration
def test_device_hours_are_wall_time_times_processes_and_cost_their_price(tmp_path, capsys):
    """A 2-process run: its results.json's wall time x 2; SLURM's accounting where a job record
    says SLURM ran it (sacct's elapsed x GPUs)."""
    assert device_usage(tmp_path, 1800.0, 2, 3.0) == {"device_hours": 1.0, "cost": 3.0}
    assert device_usage(tmp_path, 1800.0, 2, None) == {"device_hours": 1.0, "cost": None}
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["train.seed=0"], 2.5, wall_s=900.0, nproc=2)
    path = tmp_path / "t.json"
    compare(sweep, f"compare.json={path}", capsys=capsys)
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["device_hours"], row["cost"]) == (0.5, 1.0)
    # sacct -X -n -P -o ElapsedRaw,AllocTRES of a 2-node job with 8 GPUs each, for 30 minutes
    text = "1800|billing=128,cpu=128,gres/gpu=16,mem=1T,node=2\n"
    assert sacct_device_hours(text) == 8.0
    assert sacct_device_hours("1800|cpu=4,mem=8G,node=1\n") is None  # no GPU: processes count
    assert sacct_device_hours("") is None


def test_results_json_of_a_2_process_run_has_its_device_hours_and_cost(tmp_path):
    """The tracker's results.json: the training wall time x 2 processes (hardware=cpu_x2), priced
    by hardware.cost_per_device_hour from the resolved config."""
    cfg = typed("tracking", mlflow=False, plots=False)
    tracker = Tracker(tmp_path / "run", cfg, default_uri(tmp_path), RunIdentity("e", "n", {}))
    hardware = {"nodes": 1, "nproc_per_node": 2, "cost_per_device_hour": 4.0}
    tracker.write_config({"hardware": hardware}, {})
    tracker.write_results({"steps": 10, "wall_s": 900.0})
    tracker.finish()
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (saved["device_hours"], saved["cost"]) == (0.5, 2.0)  # 900 s x 2 = 0.5 h, x 4.0


@pytest.mark.integration
def test_a_sweeps_parent_sums_its_jobs_cost_and_tests_its_seeds(tmp_path):
    """records.parent.end, as the sweep callback calls it: the parent's summary/device_hours and
    summary/cost are its children's sums; seeds/<configuration>/... its seeds' figures."""
    from gptlab.records import parent
    from gptlab.records.store import local_uri, mlflow_client

    uri = local_uri(tmp_path / "mlflow.db")
    client = mlflow_client(uri)
    sweep = {"sweep_dir": str(tmp_path / "s"), "experiment": "seeds", "run_name": "seeds sweep",
             "overrides": ["train.seed=0,1,2", "optimizer.lr=1e-3,1e-4"]}  # fmt: skip
    run = parent.create(client, uri, sweep)
    parent_id = run.info.run_id
    costs = []
    for job, (config, seed, best) in enumerate(
        (c, s, b) for c, values in FAR_APART.items() for s, b in enumerate(values)
    ):
        tags = {**parent.child_tags(sweep, parent_id), "run_dir": f"{sweep['sweep_dir']}/{job}",
                "overrides": f"train.seed={seed} {config}"}  # fmt: skip
        child = client.create_run(run.info.experiment_id, run_name=str(job), tags=tags)
        costs.append(0.25 * (job + 1))
        for key, value in {"summary/best_val_loss": best, "summary/device_hours": job + 1.0,
                           "summary/cost": costs[-1]}.items():  # fmt: skip
            client.log_metric(child.info.run_id, key, value)
        client.set_terminated(child.info.run_id, "FINISHED")
    parent.end(client, run.info.experiment_id, parent_id, stopped=False)
    done = client.get_run(parent_id)
    m, tags = done.data.metrics, done.data.tags
    assert m["summary/cost"] == pytest.approx(sum(costs))
    assert m["summary/device_hours"] == pytest.approx(sum(range(1, 7)))
    assert m["seeds/optimizer.lr_1e-4/n"] == 3
    assert m["seeds/optimizer.lr_1e-4/p_value"] < 0.05
    assert tags["seeds.baseline"] == "seeds/optimizer.lr_1e-3"
    assert tags["seeds/optimizer.lr_1e-4/significant"] == "yes"


def test_plan_predicts_device_hours_and_cost():
    from gptlab.perf.costs import predicted_cost

    cfg = to_config(compose_config(["hardware=a100x8", "hardware.cost_per_device_hour=2.5"]))
    assert predicted_cost(900.0, cfg) == {"device_hours": 2.0, "cost": 5.0}  # 8 GPUs x 15 min
    free = to_config(compose_config(["hardware=a100x8"]))
    assert predicted_cost(900.0, free) == {"device_hours": 2.0}
    local = to_config(compose_config(["local=cost_example"]))
    assert local.hardware.cost_per_device_hour == 2.0  # conf/local's example, set once
