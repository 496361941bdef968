"""HellaSwag in the training loop: the scorer against a by-hand computation and against lm_eval's
acc, the figures in the run's records, 2 processes (ddp, fsdp) against 1, and bad data refused at
start-up in one line. All offline, on a HellaSwag-format file built from Tiny Shakespeare."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config, model_config, nano_overrides, run_cli

from gptlab.data import CharTokenizer
from gptlab.errors import GptlabError
from gptlab.evaluation import hellaswag
from gptlab.evaluation.next_line import next_line_examples, write_jsonl
from gptlab.evaluation.scoring import score_pairs
from gptlab.model import GPT
from gptlab.records.layout import read_metrics
from gptlab.train import run_training

N_EXAMPLES = 23  # odd: two ranks get 12 and 11 examples


def hellaswag_file(shakespeare: Path, path: Path, n: int = N_EXAMPLES) -> Path:
    """n examples in HellaSwag's format: a line or two of the validation text, the real next line
    among 4 endings (no trailing space after the context, none around an ending)."""
    text = Path(shakespeare).read_text()
    rows = []
    for ex in next_line_examples(text[int(0.9 * len(text)) :], n, context_lines=2, seed=3):
        endings = [c.strip() for c in ex["choices"]]
        rows.append({"ctx": ex["context"].rstrip(), "endings": endings, "label": ex["label"]})
    return write_jsonl(rows, path)


def settings(**changes):
    """eval.hellaswag as conf/config.yaml sets it, with fields changed."""
    base = {"every": 10, "limit": None, "path": None, "sha256": None, "batch_size": 16}
    return SimpleNamespace(**{**base, **changes})


def by_hand(model, examples):
    """(acc, acc_norm): each ending's full-logits cross-entropy after its context, one forward per
    (context, ending) within the window."""
    right = right_norm = 0
    for ctx, endings, label in examples:
        sums, means = [], []
        for end in endings:
            with torch.no_grad():
                logits, _ = model(torch.tensor([ctx + end[:-1]]))
            nats = torch.nn.functional.cross_entropy(
                logits[0, len(ctx) - 1 :], torch.tensor(end), reduction="sum"
            ).item()
            sums.append(nats)
            means.append(nats / len(end))
        right += min(range(4), key=sums.__getitem__) == label
        right_norm += min(range(4), key=means.__getitem__) == label
    return right / len(examples), right_norm / len(examples)


def test_the_scorer_equals_a_by_hand_computation(tmp_path, shakespeare):
    f = hellaswag_file(shakespeare, tmp_path / "hs.jsonl")
    tok = CharTokenizer.fit(Path(shakespeare).read_text())
    examples = hellaswag.load(settings(path=str(f)), tok, None)
    assert len(examples) == N_EXAMPLES
    ctx, endings, label = examples[0]
    row = json.loads(f.read_text().splitlines()[0])
    assert ctx == tok.encode(row["ctx"]) and endings[2] == tok.encode(" " + row["endings"][2])
    torch.manual_seed(0)
    model = GPT(model_config(vocab_size=tok.vocab_size, block_size=256)).eval()
    for p in model.parameters():  # sharper predictions than at initialisation: fewer near-ties
        p.data.mul_(4)
    examples = examples[:12]
    assert all(len(c) + max(map(len, e)) <= 256 for c, e, _ in examples)  # no cropping
    want = by_hand(model, examples)
    # 3 pairs per forward: an example's endings fall in different batches
    got = hellaswag.score(model, examples, 256, torch.device("cpu"), batch_size=3)
    assert (got["hellaswag_acc"], got["hellaswag_acc_norm"]) == pytest.approx(want, abs=1e-9)
    assert want[0] != want[1]  # this data tells the summed figure from the per-token one
    # as the shared scorer scores the same pairs
    pairs = [(c, e) for c, ends, _ in examples for e in ends]
    nats = [s.nats for s in score_pairs(model, pairs, 256, torch.device("cpu"), batch_size=5)]
    picks = [min(range(4), key=lambda k, i=i: nats[4 * i + k]) for i in range(len(examples))]
    assert sum(p == lab for p, (_, _, lab) in zip(picks, examples)) / len(examples) == want[0]


def test_the_first_download_is_recorded_and_checked_afterwards(tmp_path, shakespeare, monkeypatch):
    """eval.hellaswag.sha256=null: the download's SHA-256 is recorded beside it, and a cached file
    that no longer matches is refused; a given sha256 must match."""
    source = hellaswag_file(shakespeare, tmp_path / "source.jsonl")
    monkeypatch.setattr(hellaswag, "URL", source.as_uri())
    monkeypatch.setattr(hellaswag, "OFFICIAL_EXAMPLES", N_EXAMPLES)
    tok = CharTokenizer.fit(Path(shakespeare).read_text())
    cache = tmp_path / "cache"
    assert len(hellaswag.load(settings(), tok, str(cache))) == N_EXAMPLES
    cached = cache / "hellaswag" / "hellaswag_val.jsonl"
    digest = hellaswag.sha256_file(source)
    assert (cached.parent / "hellaswag_val.jsonl.sha256").read_text().strip() == digest
    with pytest.raises(GptlabError, match="has SHA-256 .*, expected 0{64}"):
        hellaswag.load(settings(sha256="0" * 64), tok, str(cache))  # downloads again; no match
    assert len(hellaswag.load(settings(sha256=digest), tok, str(cache))) == N_EXAMPLES
    cached.write_text(cached.read_text().replace("e", "a"))  # corruption keeps the structure
    with pytest.raises(GptlabError, match=f"expected {digest}; delete it to download it again"):
        hellaswag.load(settings(), tok, str(cache))
    cached.write_text(source.read_text() + source.read_text().splitlines()[0] + "\n")
    (cached.parent / "hellaswag_val.jsonl.sha256").unlink()
    with pytest.raises(GptlabError, match="holds 24 examples, not 23"):  # the official count
        hellaswag.load(settings(), tok, str(cache))


def test_offline_the_download_is_one_line_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(hellaswag, "URL", "http://127.0.0.1:9/hellaswag_val.jsonl")
    with pytest.raises(GptlabError) as e:
        hellaswag.fetch(settings(), str(tmp_path))
    assert "\n" not in str(e.value) and "eval.hellaswag.path=/path/to/hellaswag_val.jsonl" in str(
        e.value
    )
    assert not list(tmp_path.rglob("*.jsonl*"))  # no partial file left behind


def run_overrides(shakespeare, hs_file, *extra):
    return nano_overrides(
        shakespeare, "train.max_steps=20", "train.sample_tokens=0", "model.block_size=64",
        "eval.hellaswag.every=10", f"eval.hellaswag.path={hs_file}", "eval.hellaswag.batch_size=4",
        *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, shakespeare):
    """A 20-step nano run scoring HellaSwag every 10 steps: (its folder, the HellaSwag file)."""
    root = tmp_path_factory.mktemp("hellaswag")
    hs_file = hellaswag_file(shakespeare, root / "hs.jsonl")
    run_dir = root / "run"
    run_training(compose_config(run_overrides(shakespeare, hs_file)), run_dir)
    return run_dir, hs_file


def hellaswag_rows(run_dir):
    return {
        r["step"]: (r["hellaswag_acc"], r["hellaswag_acc_norm"])
        for r in read_metrics(run_dir)
        if "hellaswag_acc" in r
    }


def test_a_run_logs_hellaswag_at_its_steps_and_in_its_results(one_process):
    run_dir, _ = one_process
    rows = hellaswag_rows(run_dir)
    assert sorted(rows) == [10, 20]
    assert all(
        0 <= v <= 1 and round(v * N_EXAMPLES, 6).is_integer() for r in rows.values() for v in r
    )
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["hellaswag_acc"], results["hellaswag_acc_norm"]) == rows[20]


def test_a_run_resumed_at_its_last_step_keeps_its_hellaswag_figures(one_process, shakespeare,
                                                                    tmp_path):  # fmt: skip
    """A crash after the last checkpoint, before results.json: the rerun resumes at the last step
    and its results still carry the last scoring's figures (kept in the checkpoint)."""
    import shutil

    run_dir, hs_file = one_process
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "results.json").unlink()
    results = run_training(compose_config(run_overrides(shakespeare, hs_file)), copy)
    assert results["tokens_this_session"] == 0
    assert (results["hellaswag_acc"], results["hellaswag_acc_norm"]) == hellaswag_rows(run_dir)[20]


def test_the_progress_line_shows_the_figures(caplog):
    from gptlab.console import Reporter

    figures = {"train_loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": 0.0, "val_loss": 2.1}
    with caplog.at_level("INFO", logger="gptlab.console"):
        Reporter(True, 20).progress(
            10, {**figures, "hellaswag_acc": 0.25, "hellaswag_acc_norm": 0.5}, 2.1
        )
    assert "| val 2.1000 | hellaswag 0.2500 (norm 0.5000) | lr" in caplog.text


def test_hellaswag_at_a_step_that_neither_logs_nor_evaluates(tmp_path, shakespeare):
    """every=7 with logging every 5 and evaluation every 10: step 7 and 14 are scored too."""
    hs_file = hellaswag_file(shakespeare, tmp_path / "hs.jsonl", n=4)
    args = run_overrides(shakespeare, hs_file, "eval.hellaswag.every=7", "train.max_steps=15")
    run_training(compose_config(args), tmp_path / "run")
    assert sorted(hellaswag_rows(tmp_path / "run")) == [7, 14, 15]


@pytest.mark.slow
def test_lm_evals_acc_on_the_checkpoint_equals_the_loops(one_process, tmp_path):
    """lm_eval's acc (argmax of summed log-likelihood of " " + ending) is the loop's hellaswag_acc;
    its acc_norm divides by bytes, not tokens, and is not compared."""
    pytest.importorskip("lm_eval")
    from gptlab.eval import main as evaluate
    from gptlab.evaluation.next_line import task_yaml

    run_dir, hs_file = one_process
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task = task_yaml("hs_local", hs_file, text="ctx", choices="endings", delimiter=" ",
                     metrics=("acc",))  # fmt: skip
    (tasks / "hs_local.yaml").write_text(task)
    out = evaluate([f"run={run_dir}", "tasks=[hs_local]", f"eval.include={tasks}",
                    "eval.mlflow=false"])  # fmt: skip
    body = json.loads(Path(out).read_text())
    acc = {r["metric"]: r["value"] for r in body["results"] if r["task"] == "hs_local"}["acc"]
    assert body["step"] == 20
    assert acc == pytest.approx(hellaswag_rows(run_dir)[20][0], abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_score_as_one_does(one_process, shakespeare, tmp_path, strategy):
    """2 gloo processes (12 and 11 examples; under fsdp the shorter rank pads its forwards) give
    the 1-process figures at every scoring step."""
    run_dir, hs_file = one_process
    args = run_overrides(shakespeare, hs_file, "hardware=cpu_x2", f"parallelism={strategy}",
                         "parallelism.timeout_s=60")  # fmt: skip
    run_training(compose_config(args), tmp_path / "run")
    assert hellaswag_rows(tmp_path / "run") == hellaswag_rows(run_dir)


def bad_file(kind: str, good: Path, tmp_path: Path) -> list:
    """The overrides of a run whose HellaSwag data is bad in one way."""
    lines = good.read_text().splitlines()
    if kind == "missing":
        return [f"eval.hellaswag.path={tmp_path / 'nowhere.jsonl'}"]
    if kind == "bad_line":
        row = json.loads(lines[3])
        row["endings"] = row["endings"][:3]
        lines[3] = json.dumps(row)
    if kind == "not_json":
        lines[5] = lines[5][:-1]
    if kind == "char":  # a character Tiny Shakespeare's vocabulary lacks
        lines[2] = lines[2].replace('"ctx": "', '"ctx": "\u20ac')
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return [
        f"eval.hellaswag.path={path}",
        *(["eval.hellaswag.sha256=" + "0" * 64] * (kind == "sha")),
    ]


@pytest.mark.parametrize(
    "kind, says",
    [
        ("missing", "eval.hellaswag.path=.*nowhere.jsonl: no such file"),
        ("bad_line", r"bad_line.jsonl:4 is not an example \(a JSON object with ctx, 4 endings"),
        ("not_json", r"not_json.jsonl:6 is not an example"),
        ("sha", "has SHA-256 [0-9a-f]{64}, expected 0{64}"),
        ("char", "example 2 of .*: character '\u20ac' is not in this model's vocabulary"),
    ],
)
def test_bad_data_is_one_line_at_start_up_and_nothing_is_trained(kind, says, tmp_path, shakespeare):
    good = hellaswag_file(shakespeare, tmp_path / "good.jsonl")
    args = [*run_overrides(shakespeare, good), *bad_file(kind, good, tmp_path)]
    with pytest.raises(GptlabError, match=says) as e:
        run_training(compose_config(args), tmp_path / "run")
    assert "\n" not in str(e.value)
    assert not read_metrics(tmp_path / "run") and not (tmp_path / "run" / "checkpoints").exists()


def test_the_command_line_says_it_in_one_line(tmp_path, shakespeare):
    good = hellaswag_file(shakespeare, tmp_path / "good.jsonl")
    args = [*run_overrides(shakespeare, good), f"eval.hellaswag.path={tmp_path / 'no.jsonl'}"]
    r = run_cli(["gptlab.train", *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "eval.hellaswag.path=" in r.stderr


@pytest.mark.parametrize(
    "override, says",
    [
        ("eval.hellaswag.every=-1", "eval.hellaswag.every: must be >= 0"),
        ("eval.hellaswag.limit=0", "eval.hellaswag.limit: must be positive"),
        ("eval.hellaswag.batch_size=0", "eval.hellaswag.batch_size: must be positive"),
    ],
)
def test_bad_settings_name_their_key(override, says):
    from gptlab.config import to_config

    with pytest.raises(GptlabError, match=says):
        to_config(compose_config([override]))


def test_limit_takes_the_first_examples(tmp_path, shakespeare):
    f = hellaswag_file(shakespeare, tmp_path / "hs.jsonl")
    tok = CharTokenizer.fit(Path(shakespeare).read_text())
    every = hellaswag.load(settings(path=str(f)), tok, None)
    assert hellaswag.load(settings(path=str(f), limit=5), tok, None) == every[:5]
