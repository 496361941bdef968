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
from gptlab.model.gpt import GPT
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


@pytest.mark.integration
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


@pytest.mark.integration
def test_a_run_logs_hellaswag_at_its_steps_and_in_its_results(one_process):
    run_dir, _ = one_process
    rows = hellaswag_rows(run_dir)
    assert sorted(rows) == [10, 20]
    assert all(
        0 <= v <= 1 and round(v * N_EXAMPLES, 6).is_integer() for r in rows.values() for v in r
    )
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["hellaswag_acc"], results["hellaswag_acc_norm"]) == rows[20]


@pytest.mark.integration
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


@pytest.mark.integration
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
@pytest.mark.integration
def test_bad_data_is_one_line_at_start_up_and_nothing_is_trained(kind, says, tmp_path, shakespeare):
    good = hellaswag_file(shakespeare, tmp_path / "good.jsonl")
    args = [*run_overrides(shakespeare, good), *bad_file(kind, good, tmp_path)]
    with pytest.raises(GptlabError, match=says) as e:
        run_training(compose_config(args), tmp_path / "run")
    assert "\n" not in str(e.value)
    assert not read_metrics(tmp_path / "run") and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.integration
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


# ---- the shared scorer (gptlab/evaluation/scoring.py) and hellaswag.score, against a bigram model
# whose scores are computed by hand: each position's logits are a table row of the token there.


class Bigram(torch.nn.Module):
    """A causal model whose logits at a position depend on that position's token alone; it records
    the shape of every input it is given."""

    def __init__(self, vocab: int = 7, seed: int = 0):
        super().__init__()
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 3
        self.shapes = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.table[x], None


def bigram_score(table, ctx, cont, block):
    """(nats, tokens, greedy) of cont after ctx within a window of block tokens, by hand: each of
    the last n tokens predicted from the token before it, n as many as have one in the window."""
    whole = list(ctx) + list(cont)
    n = min(len(cont), block, len(whole) - 1)
    logp = torch.log_softmax(table, dim=-1)
    nats = sum(-logp[whole[j - 1], whole[j]].item() for j in range(len(whole) - n, len(whole)))
    greedy = all(
        int(table[whole[j - 1]].argmax()) == whole[j] for j in range(len(whole) - n, len(whole))
    )
    return nats, n, greedy


def test_crop_keeps_the_continuation_and_crops_the_context_from_the_left():
    from gptlab.evaluation.scoring import batches_for, crop

    assert crop(([1, 2, 3], [4, 5]), 10) == ([1, 2, 3, 4], 2)
    assert crop(([1, 2, 3], [4, 5]), 4) == ([1, 2, 3, 4], 2)  # exactly the window
    assert crop(([1, 2, 3], [4, 5]), 3) == ([2, 3, 4], 2)
    assert crop(([1, 2, 3], [4, 5, 6, 7, 8]), 3) == ([5, 6, 7], 3)  # only the last 3 scored
    assert crop(([], [4, 5, 6]), 8) == ([4, 5], 2)  # the first token has nothing before it
    with pytest.raises(ValueError, match="^a continuation to score has no tokens$"):
        crop(([1, 2], []), 8)
    assert [batches_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert batches_for(3, 0) == 3  # a batch size below 1 scores one pair at a time


def bigram_pairs(table):
    """Pairs of every kind: cropped or not, an empty context, a continuation longer than the
    window, one the model predicts greedily and one whose last token only it misses."""
    first = int(table[1].argmax())
    second = int(table[first].argmax())
    miss = (second + 1) % table.shape[0]
    return [
        ([1, 2, 3], [4]),
        ([5], [6, 0, 1]),
        ([0, 1, 2, 3, 4, 5, 6, 0], [1, 2]),
        ([2], [3, 4, 5, 6, 0, 1, 2, 3]),
        ([], [3, 4]),
        ([1], [first, second]),
        ([1], [first, miss]),
    ]


@pytest.mark.parametrize("batch_size, bucket", [(1, 0), (2, 4), (3, 64), (8, 0)])
def test_score_pairs_scores_each_continuation_as_by_hand_in_the_pairs_order(batch_size, bucket):
    model = Bigram()
    pairs = bigram_pairs(model.table)
    got = score_pairs(model, pairs, 6, torch.device("cpu"), batch_size=batch_size, bucket=bucket)
    want = [bigram_score(model.table, c, e, 6) for c, e in pairs]
    assert [(s.tokens, s.greedy) for s in got] == [(n, g) for _, n, g in want]
    assert [s.nats for s in got] == pytest.approx([nats for nats, _, _ in want], abs=1e-5)
    assert [g for _, _, g in want] == [False] * 5 + [True, False]  # both kinds are here


def test_score_pairs_batches_the_longest_first_padded_to_the_bucket_within_the_window():
    """Inputs of 3, 3, 6, 6, 1 tokens (the third and fourth cropped to the window of 6): batches
    of 2, longest first, each padded up to a multiple of 4 but never past the window; rounds
    beyond the batches are padding forwards of one row, and progress counts only real pairs."""
    model, done = Bigram(), []
    pairs = bigram_pairs(model.table)[:5]
    score_pairs(model, pairs, 6, torch.device("cpu"), batch_size=2, bucket=4, rounds=5,
                progress=done.append)  # fmt: skip
    assert model.shapes == [(2, 6), (2, 4), (1, 4), (1, 4), (1, 4)]
    assert done == [2, 2, 1]
    model.shapes.clear()
    score_pairs(model, pairs, 6, torch.device("cpu"), batch_size=2, bucket=0, rounds=4)
    assert model.shapes == [(2, 6), (2, 3), (1, 1), (1, 6)]  # no bucket: the longest's own length
    model.shapes.clear()
    score_pairs(model, pairs, 6, torch.device("cpu"), batch_size=2, bucket=4, rounds=1)
    assert len(model.shapes) == 3  # rounds never cut the batches the pairs need


def bigram_examples():
    """12 HellaSwag-like examples on the bigram model's 7 tokens, endings of 1 to 4 tokens, so the
    likeliest ending in sum and per token differ on some."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(12):
        ctx = torch.randint(0, 7, (3,), generator=g).tolist()
        ends = [torch.randint(0, 7, (k,), generator=g).tolist() for k in (1, 2, 3, 4)]
        out.append((ctx, ends, int(torch.randint(0, 4, (1,), generator=g))))
    return out


def bigram_accuracy(table, examples):
    right = right_norm = 0
    for ctx, ends, label in examples:
        scores = [bigram_score(table, ctx, e, 64) for e in ends]
        right += min(range(4), key=lambda k: scores[k][0]) == label
        right_norm += min(range(4), key=lambda k: scores[k][0] / scores[k][1]) == label
    return right / len(examples), right_norm / len(examples)


def test_hellaswag_acc_picks_the_least_summed_nats_and_acc_norm_the_least_per_token():
    model, examples = Bigram(seed=8), bigram_examples()
    want = bigram_accuracy(model.table, examples)
    assert want == (4 / 12, 3 / 12)  # the figures differ on this data
    got = hellaswag.score(model, examples, 64, torch.device("cpu"), batch_size=5)
    assert (got["hellaswag_acc"], got["hellaswag_acc_norm"]) == want
    assert len(model.shapes) == 10  # 48 pairs in batches of 5


def test_hellaswag_each_rank_scores_its_stride_and_a_sharded_one_pads_its_forwards(one_rank_group):
    """In a group of one the all-reduce adds nothing, so rank 1 of 2's figures are its own
    examples' (1, 3, 5, ...); sharded, it runs the forwards of the rank with the most examples."""
    model, examples = Bigram(seed=8), bigram_examples()[:11]
    got = hellaswag.score(model, examples, 64, torch.device("cpu"), rank=1, world_size=2,
                          batch_size=3)  # fmt: skip
    want = bigram_accuracy(model.table, examples[1::2])
    assert want == (3 / 5, 2 / 5)  # rank 0's examples score 1/6 and 1/6
    assert (got["hellaswag_acc"], got["hellaswag_acc_norm"]) == want
    assert len(model.shapes) == 7  # its 5 examples: 20 pairs in batches of 3
    model.shapes.clear()
    hellaswag.score(model, examples, 64, torch.device("cpu"), rank=1, world_size=2, batch_size=3,
                    sharded=True)  # fmt: skip
    assert len(model.shapes) == 8  # rank 0's 6 examples: 24 pairs, 8 forwards


def test_an_example_is_a_context_four_string_endings_and_a_label_0_to_3():
    good = {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 3}
    assert hellaswag.is_example(good) and hellaswag.is_example({**good, "label": 0})
    for bad in [
        {**good, "label": 4},
        {**good, "label": -1},
        {**good, "label": True},  # a bool is an int to Python, not a label
        {**good, "label": "1"},
        {**good, "ctx": ""},
        {**good, "ctx": 3},
        {**good, "endings": ["a", "b", "c"]},
        {**good, "endings": ["a", "b", "c", "d", "e"]},
        {**good, "endings": ["a", "b", "c", 4]},
        {**good, "endings": "abcd"},
        ["A man", ["a", "b", "c", "d"], 3],
        None,
    ]:
        assert not hellaswag.is_example(bad), bad


def test_reading_skips_blank_lines_names_the_bad_lines_number_and_counts_the_official_file(
    tmp_path, monkeypatch
):
    row = {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}
    f = tmp_path / "hs.jsonl"
    f.write_text("\n".join([json.dumps(row), "", "  ", json.dumps({**row, "label": 2})]) + "\n")
    assert [ex["label"] for ex in hellaswag.read_examples(f, official=False)] == [1, 2]
    monkeypatch.setattr(hellaswag, "OFFICIAL_EXAMPLES", 2)
    assert len(hellaswag.read_examples(f, official=True)) == 2
    monkeypatch.setattr(hellaswag, "OFFICIAL_EXAMPLES", 3)
    with pytest.raises(GptlabError, match=r"hs.jsonl holds 2 examples, not 3; pass a local copy"):
        hellaswag.read_examples(f, official=True)
    f.write_text(f.read_text() + "[1, 2]\n")
    with pytest.raises(GptlabError, match=r"hs.jsonl:5 is not an example .* a label 0-3\); pass"):
        hellaswag.read_examples(f, official=False)
    f.write_text("\n\n")
    with pytest.raises(GptlabError, match="holds 0 examples, not 3"):  # empty: never 0 examples
        hellaswag.read_examples(f, official=False)


def test_an_example_renders_as_its_endings_follow_the_context_in_text():
    tok = CharTokenizer.fit("A man sits. Hewalk")
    ctx, endings, label = hellaswag.render(
        {"ctx": "A man", "endings": ["sits.", "walks", "He", "a"], "label": 2}, tok
    )
    assert ctx == tok.encode("A man") and label == 2
    assert endings == [
        tok.encode(" sits."),
        tok.encode(" walks"),
        tok.encode(" He"),
        tok.encode(" a"),
    ]


def test_a_given_sha256_is_compared_in_any_case_and_a_recorded_one_is_kept(tmp_path):
    f = tmp_path / "hs.jsonl"
    f.write_text("text\n")
    digest = hellaswag.sha256_file(f)
    hellaswag.check_sha256(f, digest.upper(), "it", "fix it")  # a digest pasted in upper case
    hellaswag.check_sha256(f, None, "it", "fix it")  # nothing to compare with
    with pytest.raises(
        GptlabError, match=f"^HellaSwag: it has SHA-256 {digest}, expected 0+; fix it$"
    ):
        hellaswag.check_sha256(f, "0" * 64, "it", "fix it")
    record = tmp_path / "hs.jsonl.sha256"
    assert hellaswag.recorded_sha256(f, record) == digest  # recorded now
    assert record.read_text() == digest + "\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "hs.jsonl",
        "hs.jsonl.sha256",
    ]
    f.write_text("changed\n")
    assert hellaswag.recorded_sha256(f, record) == digest  # the record, not the file's digest now
    assert hellaswag.cached_file(str(tmp_path)) == tmp_path / "hellaswag" / "hellaswag_val.jsonl"


def test_a_local_copy_is_checked_and_a_bad_download_is_named_and_not_kept(tmp_path, monkeypatch):
    row = {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}
    source = tmp_path / "source.jsonl"
    source.write_text(json.dumps(row) + "\n")
    digest = hellaswag.sha256_file(source)
    missing = tmp_path / "no.jsonl"
    with pytest.raises(GptlabError) as e:
        hellaswag.fetch(settings(path=str(missing)), None)
    assert str(e.value) == (
        f"eval.hellaswag.path={missing}: no such file; give hellaswag_val.jsonl's path"
    )
    with pytest.raises(GptlabError) as e:
        hellaswag.fetch(settings(path=str(source), sha256="0" * 64), None)
    assert str(e.value) == (
        f"HellaSwag: eval.hellaswag.path={source} has SHA-256 {digest}, expected {'0' * 64}; "
        f"give the right file"
    )
    assert hellaswag.fetch(settings(path=str(source), sha256=digest), None) == source.resolve()
    monkeypatch.setattr(hellaswag, "URL", source.as_uri())
    cache = tmp_path / "cache"
    with pytest.raises(GptlabError) as e:
        hellaswag.fetch(settings(sha256="0" * 64), str(cache))
    assert str(e.value) == (
        f"HellaSwag: {source.as_uri()} has SHA-256 {digest}, expected {'0' * 64}; pass a local "
        f"copy with eval.hellaswag.path=/path/to/hellaswag_val.jsonl"
    )
    assert not list(cache.rglob("*.jsonl*"))  # the bad download is not kept
    cached = hellaswag.fetch(settings(), str(cache))
    cached.write_text(cached.read_text() + "\n")
    with pytest.raises(GptlabError) as e:
        hellaswag.fetch(settings(), str(cache))
    assert str(e.value).startswith(f"HellaSwag: the cached {cached} has SHA-256 ")


def test_an_example_the_tokenizer_cannot_encode_is_named_with_the_way_out(tmp_path):
    rows = [{"ctx": "ab", "endings": ["a", "b", "a", "b"], "label": 0},
            {"ctx": "a€", "endings": ["a", "b", "a", "b"], "label": 0}]  # fmt: skip
    f = tmp_path / "hs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(GptlabError) as e:
        hellaswag.load(settings(path=str(f)), CharTokenizer.fit(" ab"), None)
    assert str(e.value) == (
        f"HellaSwag: example 1 of {f.resolve()}: character '€' is not in this model's vocabulary "
        f"of 3 characters; score it with a tokenizer that encodes its text, or set "
        f"eval.hellaswag.every=0"
    )
