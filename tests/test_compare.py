"""`python -m gptlab.compare` on a real sweep made by `python -m gptlab.train -m`: on its folder,
its parent run id and its experiment.

The sweep is made once per session (tests/test_search_callbacks.py checks its MLflow parent run and
children, tests/system/test_browser.py renders them)."""

import json
from pathlib import Path

import pytest
from helpers import run_cli

from gptlab.compare import WIDTH, RunRecord, differing_keys, table, val_figure
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


EXPERIMENT = "gpt_nano-shakespeare_char"
LONG_PATH = "/home/someone/projects/language-models/data/shakespeare/tinyshakespeare_input.txt"


def _job(client, experiment_id, name, overrides, tags, best, scores=None):
    """A finished job's MLflow run: its overrides, a 3-point val curve ending at best, summary/*
    and downstream scores."""
    tags = {**tags, "overrides": " ".join(overrides), "model": "gpt_nano"}
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    for i, step in enumerate((4, 8, 12)):
        client.log_metric(run.info.run_id, "tokens", step * 256, step=step)
        client.log_metric(run.info.run_id, "val/loss", best + 0.3 * (2 - i), step=step)
    figures = {"best_val_loss": best, "tokens_per_s": 1234.56789 * best, "mfu": 0.0031415926,
               "wall_s": 31.41592653589793}  # fmt: skip
    for key, value in {**{f"summary/{k}": v for k, v in figures.items()}, **(scores or {})}.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run


def long_float_experiment(folder: Path):
    """(store uri, experiment) of an experiment as `gptlab.compare` finds it after a sweep, a
    search and two runs of their own: a sweep parent with 3 jobs and a search parent (run_type
    search) with 4 trials whose sampled hyperparameters are 16-digit floats, the parents made with
    records.parent as the sweep callback makes them."""
    from gptlab.records import parent
    from gptlab.records.identity import sweep_run_name
    from gptlab.records.store import local_uri, mlflow_client

    uri = local_uri(folder / "mlflow.db")
    client = mlflow_client(uri)
    base = f"gpt_nano-{EXPERIMENT.split('-')[1]}-cpu"
    common = ["model=gpt_nano", f"data.path={LONG_PATH}", "train.max_steps=12"]
    sweeps = {
        "sweep": ["optimizer.lr=1e-3,3e-3,1e-2", *common],
        "search": ["hparams_search=default_job", *common],
    }
    for kind, overrides in sweeps.items():
        sweep_dir = str(folder / kind)
        sweep = {"sweep_dir": sweep_dir, "experiment": EXPERIMENT, "overrides": overrides,
                 "swept": ["optimizer.lr"] if kind == "sweep" else [],
                 "run_name": f"{base} {kind} {overrides[0]}"}  # fmt: skip
        run = parent.create(client, uri, sweep)
        sweep.update(experiment_id=run.info.experiment_id, parent_run_id=run.info.run_id)
        if kind == "search":
            client.set_tag(run.info.run_id, "run_type", "search")
        for job in range(3 if kind == "sweep" else 4):
            if kind == "sweep":
                own = [f"optimizer.lr={('1e-3', '3e-3', '1e-2')[job]}"]
            else:
                own = [f"hparams_search.trial={job}", f"hparams_search.storage=sqlite:///{folder}/s.db",
                       f"optimizer.lr={0.0072309178517815 * (job + 1) / 3}",
                       f"optimizer.weight_decay={0.012345678901234567 * (job + 2)}",
                       f"optimizer.warmup_steps={3 + job}"]  # fmt: skip
            tags = {**parent.child_tags(sweep, run.info.run_id), "run_dir": f"{sweep_dir}/{job}"}
            name = sweep_run_name(base, [*common, *own], sweep)
            scores = {"eval/shakespeare_next_line/acc_norm": 0.31234567 + job / 100,
                      "hellaswag/acc_norm": 0.2512345} if kind == "search" else None  # fmt: skip
            _job(client, run.info.experiment_id, name, [*common, *own], tags, 2 + job / 10, scores)
        parent.end(client, run.info.experiment_id, run.info.run_id, stopped=False)
    for i, lr in enumerate(("6e-4", "0.00091234567890123")):
        own = [*common, f"optimizer.lr={lr}", f"train.batch_size={8 * (i + 1)}"]
        _job(client, run.info.experiment_id, base, own, {"run_dir": f"{folder}/runs/{i}"}, 2.5 + i)
    return uri, EXPERIMENT


def client_for(cwd: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")


def body(lines):
    """A table's lines below its heads' rule, up to its end (an empty line, the errors, the PNG)."""
    start = next(i for i, ln in enumerate(lines) if ln and set(ln) <= {"-", " "}) + 1
    ends = [i for i, ln in enumerate(lines) if i > start and (not ln or ln[0] in "ev")]
    return lines[start : (ends or [len(lines)])[0]]


@pytest.mark.slow
def test_compare_a_sweep_folder_prints_the_table_and_writes_the_png(sweep, monkeypatch, capsys):
    """In this process: the command is run by
    test_an_experiment_shows_its_sweep_and_search_parents_over_their_jobs."""
    cwd, sweep_dir, info, _ = sweep
    monkeypatch.chdir(cwd)
    compare_main([str(sweep_dir)])
    out = capsys.readouterr().out
    lines = out.splitlines()
    # a column the same in every row (the wall time, 0s in runs this short) is said above the heads
    said = lines[0] if lines[0].startswith("every run: ") else ""
    heads = ["run", "best val loss", "best val bpb", "status", "optimizer.lr", "tokens/s", "MFU",
             "wall", "device-h"]  # fmt: skip
    assert (
        lines[1 if said else 0].split()
        == " ".join(h for h in heads if f" {h}=" not in said).split()
    )
    rows = [ln.split() for ln in body(lines)]
    results = {j: json.loads((sweep_dir / j / "results.json").read_text()) for j in ("0", "1")}
    best = {j: r["best_val_loss"] for j, r in results.items()}
    order = sorted(best, key=best.get)
    assert [row[0] for row in rows] == [*order, "2"]  # best val loss first, the failed job last
    assert rows[0][1:5] == [
        f"{best[order[0]]:.4f}",
        f"{results[order[0]]['best_val_bpb']:.4f}",
        "FINISHED",
        {"0": "0.001", "1": "0.003"}[order[0]],
    ]
    # status and error from the sweep's MLflow children
    assert rows[2][1:5] == ["-", "-", "FAILED", "-1"]
    assert rows[0][6].endswith("%") and ("wall=" in said or rows[0][7].endswith("s"))
    assert float(rows[0][-1]) == pytest.approx(results[order[0]]["device_hours"], rel=1e-2)
    assert all(len(ln) <= WIDTH for ln in lines[:-1]), lines  # all but the PNG's path
    assert "errors:" in lines and any("2: GptlabError: optimizer.lr" in ln for ln in lines)
    png = sweep_dir / "compare_val_loss.png"
    assert f"val loss curves: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_compare_a_parent_run_id_or_an_experiment_gives_the_same_table(sweep, monkeypatch, capsys):
    cwd, sweep_dir, info, _ = sweep
    monkeypatch.chdir(cwd)
    compare_main([str(sweep_dir)])
    from_folder = capsys.readouterr().out.splitlines()[:6]
    compare_main([info["parent_run_id"]])
    out = capsys.readouterr().out
    assert out.splitlines()[:6] == from_folder
    png = cwd / "outputs" / "compare" / f"{info['parent_run_id']}.png"
    assert png.is_file() and f"val loss curves: {Path('outputs') / 'compare' / png.name}" in out
    compare_main(["gpt_nano-shakespeare_char", f"compare.out={cwd / 'exp.png'}"])
    # by experiment: the sweep's parent a heading over its jobs, not a row among them
    heading, *jobs = body(capsys.readouterr().out.splitlines())
    assert heading.startswith("A: sweep 'gpt_nano-shakespeare_char-cpu sweep optimizer.lr=")
    assert heading.endswith(", FAILED, 3 jobs")  # its third job failed
    assert [ln.split()[0] for ln in jobs] == [f"A/{ln.split()[0]}" for ln in body(from_folder)]
    assert (cwd / "exp.png").is_file()


@pytest.mark.integration
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
    assert lines[0].split()[:5] == ["run", "best", "val", "loss", "best"]
    assert [ln.split()[:5] for ln in lines[2:5]] == [
        ["1", "2.1000", "3.0000", "FINISHED", "3e-3"],
        ["0", "2.5000", "3.6000", "FINISHED", "1e-3"],
        ["2", "-", "-", "FAILED", "1e-2"],
    ]
    assert lines[2].split()[5:] == ["1,200", "1.20%", "28s"]
    assert lines[-2:] == ["errors:", "  2: GptlabError: diverged"]


def test_table_by_bits_per_byte_puts_the_best_bpb_first_and_shows_downstream_scores():
    """Two tokenizers: the lower loss in nats is not the better model per byte; the runs' eval
    scores get a column each, '-' where a run has none."""
    char = RunRecord("char", {"data": "shakespeare_char"}, "FINISHED", 1.5, 2.16)
    char.scores = {"hellaswag_acc_norm": 0.26}
    bpe = RunRecord("bpe", {"data": "shakespeare"}, "FINISHED", 3.2, 1.9)
    bpe.scores = {"mc/acc": 0.7, "hellaswag_acc_norm": 0.28}
    by_loss = table([bpe, char]).splitlines()
    # the columns the same in both (status, no speed figures) are said once, above the table
    assert by_loss[0] == "every run: status=FINISHED, tokens/s=-, MFU=-, wall=-"
    assert [ln.split()[0] for ln in by_loss[3:]] == ["char", "bpe"]
    by_bpb = table([char, bpe], "bpb").splitlines()
    assert by_bpb[1].split() == [
        "run", "best", "val", "bpb", "best", "val", "loss", "data", "mc/acc", "hellaswag_acc_norm",
    ]  # fmt: skip
    assert [ln.split() for ln in by_bpb[3:]] == [
        ["bpe", "1.9000", "3.2000", "shakespeare", "0.7000", "0.2800"],
        ["char", "2.1600", "1.5000", "shakespeare_char", "-", "0.2600"],  # char has no mc/acc
    ]
    with pytest.raises(GptlabError, match="compare.metric=nats: must be one of loss, bpb"):
        compare_main(["compare.target=.", "compare.metric=nats"])


def long_records(n: int):
    """n finished runs of a search: 16-digit sampled floats, long names, downstream scores."""
    records = []
    for i in range(n):
        values = {
            "optimizer.lr": str(0.0072309178517815 * (i + 1)),
            "optimizer.weight_decay": str(0.012345678901234567 * (i + 2)),
            "optimizer.warmup_steps": str(3 + i),
            "model.dropout": str(0.1 + i / 100),
            "data.path": f"/home/someone/projects/language-models/data/shakespeare/{i}/input.txt",
            "train.max_steps": "12",
        }
        name = f"gpt_nano-shakespeare_char-cpu trial={i} lr={values['optimizer.lr']}"
        r = RunRecord(name, values, "FINISHED", 2 + i / 7, 3 + i / 7, 1234.5 * (i + 1), 0.003, 31.0)
        r.scores = {"shakespeare_next_line/acc_norm": 0.3 + i / 100, "hellaswag_acc_norm": 0.26}
        r.val_curve = [(t * 256, 3 - t / 10 + i / 50) for t in range(1, 40)]
        records.append(r)
    return records


def test_a_wide_table_fits_in_100_columns_with_what_every_run_shares_said_once():
    """Long names and paths cut, floats to 4 digits, long keys by their last part, the columns the
    same in every row said above the table, and what does not fit in 100 columns continued below
    it, each part led by the run's name."""
    lines = table(long_records(5)).splitlines()
    assert all(len(ln) <= WIDTH for ln in lines), max(lines, key=len)
    # the words every name begins with, and what every row has, once
    assert " ".join(lines[:2]).split() == [
        "every", "run:", "name=gpt_nano-shakespeare_char-cpu", "\u2026,", "status=FINISHED,",
        "hellaswag_acc_norm=0.2600,", "MFU=0.30%,", "wall=31s",
    ]  # fmt: skip
    heads = [ln.split() for ln in lines if ln.startswith("run ")]
    assert len(heads) == 2 and heads[0][:4] == ["run", "best", "val", "loss"]
    assert heads[0][7:] == ["optimizer.lr", "weight_decay", "warmup_steps"]
    assert heads[1] == ["run", "dropout", "data.path", "\u2026_next_line/acc_norm", "tokens/s"]
    rows = [ln.split() for ln in lines if ln.startswith("trial=0 ")]  # once in each part
    assert (
        rows[0][2:5] == ["2.0000", "3.0000", "0.007231"] and rows[1][3] == "\u2026are/0/input.txt"
    )


@pytest.mark.integration
def test_the_legend_is_short_and_inside_the_png_without_warnings(tmp_path):
    """40 runs: a legend below the axes in columns, each entry a short name and values to 3
    significant digits, the whole legend inside the figure, and no warning (the old legend's
    labels held whole 16-digit floats and tight_layout warned that they did not fit)."""
    import warnings

    for n in (3, 40):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig = val_figure(long_records(n), "gpt_nano-shakespeare_char " * 6)
            fig.savefig(tmp_path / "val.png")
        assert [str(w.message) for w in caught] == []
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        assert len(labels) == n and all(len(label) <= (90 if n < 10 else 40) for label in labels)
        # the words every name begins with left out
        assert labels[0].startswith("trial=0 lr=0")
        assert n > 10 or ": lr=0.00723 weight_decay=0.0247 warmup_steps=3 " in labels[0]
        renderer = fig.canvas.get_renderer()
        box, inside = legend.get_window_extent(renderer), fig.bbox
        assert box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0, (n, box)
        title = fig.axes[0].title.get_window_extent(renderer)
        assert title.x0 >= inside.x0 and title.x1 <= inside.x1 and title.y1 <= inside.y1


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    return long_float_experiment(tmp_path_factory.mktemp("experiment"))


@pytest.mark.slow
def test_an_experiment_shows_its_sweep_and_search_parents_over_their_jobs(experiment, tmp_path):
    """An experiment with a sweep, a search (16-digit floats sampled) and two runs of their own:
    each parent is a heading over its jobs, never a row; every line fits in 100 columns; the PNG
    is written with no warning."""
    uri, name = experiment
    out = tmp_path / "x.png"
    r = run_cli(["gptlab.compare", name, f"tracking.uri={uri}", f"compare.out={out}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Warning" not in r.stderr and "warn" not in r.stderr.lower(), r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == f"val loss curves: {out}"
    assert all(len(ln) <= WIDTH for ln in lines[:-1]), max(lines, key=len)
    rows = body(lines)
    assert rows[0].startswith("A: sweep 'gpt_nano-shakespeare_char-cpu sweep optimizer.lr=")
    assert [ln.split()[0] for ln in rows[1:4]] == ["A/0", "A/1", "A/2"]
    assert rows[4].startswith("B: search ") and rows[4].endswith(", FINISHED, 4 trials")
    assert [ln.split()[:2] for ln in rows[5:9]] == [
        [f"B/{i}", f"{2 + i / 10:.4f}"] for i in range(4)
    ]
    assert rows[9] == "runs of no sweep or search" and len(rows) == 12
    # the parents are no row: no row is named like one, and no parent's override is a column
    assert not any(" sweep " in ln or " search " in ln for ln in rows if ln.startswith("  "))
    assert "hparams_search" not in lines[1] + lines[2]
    assert out.is_file()


def test_the_table_names_the_weights_a_run_started_from():
    """model.init_from (results.json's init_from, or the run's gptlab.init_from tag): a `from`
    column where any run had starting weights, none where all ran from scratch."""
    from gptlab.compare import RunRecord, columns

    rows = [
        RunRecord(name="0", overrides={}, status="FINISHED", best_val_loss=2.0, init_from="gpt2"),
        RunRecord(name="1", overrides={}, status="FINISHED", best_val_loss=2.1),
    ]
    table = {head: cells for head, cells, _ in columns(rows, "", "loss")}
    assert table["from"] == ["gpt2", "-"]
    assert "from" not in {head for head, _, _ in columns(rows[1:], "", "loss")}


def test_a_mixtures_source_figure_sorts_the_table_and_a_bad_metric_is_one_line(tmp_path):
    """compare.metric=val/<source>/loss: the runs best first by that source's last figure, its
    column first; any other name is one line."""
    from gptlab.compare import RunRecord, main, table

    rows = [
        RunRecord(name="a", overrides={}, status="FINISHED", best_val_loss=2.0,
                  sources={"val/books/loss": 3.0}),
        RunRecord(name="b", overrides={}, status="FINISHED", best_val_loss=2.5,
                  sources={"val/books/loss": 1.0}),
    ]  # fmt: skip
    lines = table(rows, "val/books/loss").splitlines()
    header = next(line for line in lines if line.startswith("run"))
    assert header.split()[1] == "val/books/loss"
    names = [line.split()[0] for line in lines[lines.index(header) + 2 :] if line.strip()]
    assert names[:2] == ["b", "a"]  # a is better overall, b on books
    with pytest.raises(GptlabError, match="compare.metric=val/books/accuracy: must be one of"):
        main([f"compare.target={tmp_path}", "compare.metric=val/books/accuracy"])
