"""gptlab.eval: lm-evaluation-harness on gptlab's own model and tokenizer.

Checked against lm_eval's own Hugging Face model on the export of the same checkpoint, against a
by-hand computation, across processes, and on bad input; all offline, on tasks the tests write.
"""

import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_config, nano_overrides, run_cli, trained_hf_export

from gptlab.errors import GptlabError
from gptlab.evaluation.next_line import next_line_examples, task_yaml, write_jsonl
from gptlab.evaluation.taskdata import local_spec
from gptlab.train import run_training

lm_eval = pytest.importorskip("lm_eval")


def val_text(shakespeare: Path) -> str:
    text = Path(shakespeare).read_text()
    return text[int(0.9 * len(text)) :]  # data=shakespeare_char's validation split


def next_line_task(folder: Path, shakespeare: Path, n: int, name: str = "next_line") -> Path:
    """A folder holding one local multiple-choice task over n next-line examples."""
    folder.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(
        next_line_examples(val_text(shakespeare), n, seed=1), folder / f"{name}.jsonl"
    )
    (folder / f"{name}.yaml").write_text(task_yaml(name, data))
    return folder


def eval_json(run_dir: Path) -> dict:
    body = json.loads((run_dir / "eval.json").read_text())
    return {(r["task"], r["metric"]): r["value"] for r in body["results"]} | {"_body": body}


def tiny_lm(block_size=16, **changes):
    from helpers import model_config

    from gptlab.data import CharTokenizer
    from gptlab.evaluation.harness import GptlabLM
    from gptlab.model.gpt import GPT

    tok = CharTokenizer("\n abcdefgh")
    torch.manual_seed(0)
    model = GPT(model_config(vocab_size=tok.vocab_size, block_size=block_size, **changes)).eval()
    return GptlabLM(model, tok, torch.device("cpu"), batch_size=3), model, tok


def by_hand_nats(model, ids):
    """Summed cross-entropy of ids[1:] after ids[:1], one forward (ids within the window)."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    return torch.nn.functional.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="sum")


def instance(kind, args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.mark.parametrize("pos_emb", ["learned", "rotary"])
@pytest.mark.integration
def test_loglikelihood_is_the_continuations_log_probability_cropped_from_the_left(pos_emb):
    lm, model, tok = tiny_lm(pos_emb=pos_emb)
    pairs = [("ab", "cd"), ("a b", " c"), ("hgfedcbahgfedcba\nabc", "de")]  # the last is cropped
    got = lm.loglikelihood([instance("loglikelihood", p) for p in pairs])
    for (context, continuation), (logp, _) in zip(pairs, got):
        ids = tok.encode(context + continuation)[-17:]  # window 16 + the last target
        n = len(tok.encode(continuation))
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids[:-1]]))
        logprobs = torch.log_softmax(logits[0, -n:], dim=-1)
        expected = logprobs.gather(1, torch.tensor(ids[-n:])[:, None]).sum().item()
        assert logp == pytest.approx(expected, abs=1e-5)


@pytest.mark.integration
def test_rolling_loglikelihood_covers_every_token_once_with_overlapping_windows():
    """A text shorter than the window: one window after the prefix token (a newline here); a longer
    one: the windows' log-likelihoods add up, each token predicted once."""
    lm, model, tok = tiny_lm(block_size=8)
    short = "abc de"
    (got,) = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (short,))])
    prefix = tok.encode("\n")
    assert got == pytest.approx(-by_hand_nats(model, prefix + tok.encode(short)).item(), abs=1e-5)
    long = "abcdefgh abcdefgh abc"
    (whole,) = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (long,))])
    ids = prefix + tok.encode(long)
    expected, done = 0.0, 1
    while done < len(ids):  # predict ids[done:end] from the 8 tokens before end
        end = min(done + 8, len(ids))
        window = ids[max(0, end - 9) : end]
        n = end - done
        with torch.no_grad():
            logits, _ = model(torch.tensor([window[:-1]]))
        logp = torch.log_softmax(logits[0, -n:], dim=-1)
        expected += logp.gather(1, torch.tensor(window[-n:])[:, None]).sum().item()
        done = end
    assert whole == pytest.approx(expected, abs=1e-4)


@pytest.mark.integration
def test_generate_until_is_greedy_kv_cache_decoding_cut_at_the_stop_sequence():
    lm, model, tok = tiny_lm()
    context = "abc "
    full = model.generate(torch.tensor([tok.encode(context)]), 10, temperature=0)
    greedy = tok.decode(full[0, len(context) :].tolist())
    (plain,) = lm.generate_until([instance("generate_until", (context, {"max_gen_toks": 10}))])
    assert plain == greedy
    stop = greedy[2:4]
    (cut,) = lm.generate_until(
        [instance("generate_until", (context, {"until": [stop], "max_gen_toks": 10}))]
    )
    assert cut == greedy.split(stop)[0]


@pytest.mark.integration
def test_a_char_vocabulary_that_cannot_encode_the_task_says_so():
    lm, _, _ = tiny_lm()
    with pytest.raises(GptlabError, match="'z' is not in this model's vocabulary.*cannot encode"):
        lm.loglikelihood([instance("loglikelihood", ("ab", "z"))])


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, shakespeare):
    """A char model trained 800 steps, recorded in a local MLflow store."""
    root = tmp_path_factory.mktemp("eval")
    run_dir = root / "run"
    overrides = nano_overrides(
        shakespeare, "train.max_steps=800", "train.eval_every=800", "train.sample_tokens=0",
        "model.block_size=64", "tracking.mlflow=true", f"paths.outputs={root / 'outputs'}",
    )  # fmt: skip
    run_training(compose_config(overrides), run_dir)
    return run_dir


@pytest.mark.slow
def test_a_trained_model_beats_chance_on_next_line_and_is_recorded_beside_its_run(
    char_run, shakespeare, tmp_path
):
    """Which of 4 lines follows: the trained model's acc_norm is clearly above 1/4; eval.json and
    the run's own MLflow run (eval/<task>/<metric> at the checkpoint's step) hold the figures,
    and compare shows them."""
    from mlflow.tracking import MlflowClient

    from gptlab.compare import from_folder, table
    from gptlab.eval import main as evaluate

    tasks = next_line_task(tmp_path / "tasks", shakespeare, 200)
    evaluate([f"run={char_run}", "tasks=[next_line]", f"eval.include={tasks}"])
    got = eval_json(char_run)
    assert got["_body"]["step"] == 800 and got["_body"]["lm_eval_version"] == lm_eval.__version__
    assert got[("next_line", "acc_norm")] >= 0.36  # chance: 0.25; 200 examples: stderr 0.034
    results = json.loads((char_run / "results.json").read_text())
    client = MlflowClient(f"sqlite:///{char_run.parent / 'outputs' / 'mlflow.db'}")
    history = client.get_metric_history(results["mlflow_run_id"], "eval/next_line/acc_norm")
    assert [(p.step, p.value) for p in history] == [(800, got[("next_line", "acc_norm")])]
    row = table(from_folder(char_run.parent)).splitlines()
    assert "next_line/acc_norm" in row[0]
    assert f"{got[('next_line', 'acc_norm')]:.4f}" in row[2]


@pytest.mark.slow
def test_an_untrained_model_does_not_beat_chance(tmp_path, shakespeare):
    from gptlab.eval import main as evaluate

    run_dir = tmp_path / "run"
    overrides = nano_overrides(
        shakespeare, "train.max_steps=1", "optimizer.lr=1e-9", "train.sample_tokens=0",
        "model.block_size=64",
    )  # fmt: skip
    run_training(compose_config(overrides), run_dir)
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 200)
    evaluate([f"run={run_dir}", "tasks=[next_line]", f"eval.include={tasks}"])
    assert eval_json(run_dir)[("next_line", "acc_norm")] <= 0.33


@pytest.mark.slow
def test_gptlab_eval_equals_lm_evals_hf_model_on_the_export(tmp_path, shakespeare):
    """A GPT-2-shaped model with a trained BPE: per-request log-likelihoods within 1e-4 of
    lm_eval --model hf on its export folder, and the same acc / acc_norm."""
    pytest.importorskip("transformers")
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from gptlab.eval import main as evaluate
    from gptlab.eval import task_manager
    from gptlab.evaluation.harness import GptlabLM
    from gptlab.model.inference import load_model

    run_dir, hf_dir = trained_hf_export(
        tmp_path, shakespeare, "train.max_steps=40", "train.sample_tokens=0", "model.block_size=64",
        "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=512",
    )  # fmt: skip
    model, tok, _ = load_model(str(run_dir))
    ours = GptlabLM(model, tok, torch.device("cpu"), batch_size=4)
    theirs = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=4)
    examples = next_line_examples(val_text(shakespeare), 12, seed=3)
    requests = [
        instance("loglikelihood", (e["context"], choice))
        for e in examples
        for choice in e["choices"]
    ]
    requests.append(instance("loglikelihood", ("", "ROMEO: what?")))  # the empty context
    got, expected = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert max(abs(a[0] - b[0]) for a, b in zip(got, expected)) <= 1e-4
    assert [a[1] for a in got] == [b[1] for b in expected]
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 30)
    evaluate([f"run={run_dir}", "tasks=[next_line]", f"eval.include={tasks}", "eval.mlflow=false"])
    mine = eval_json(run_dir)
    hf = evaluator.simple_evaluate(
        model=theirs, tasks=["next_line"], task_manager=task_manager(str(tasks), ["next_line"]),
        log_samples=False, bootstrap_iters=0,
    )["results"]["next_line"]  # fmt: skip
    assert mine[("next_line", "acc")] == hf["acc,none"]
    assert mine[("next_line", "acc_norm")] == hf["acc_norm,none"]


@pytest.mark.slow
def test_two_processes_score_a_sharded_checkpoint_as_one_does(tmp_path, shakespeare):
    """An fsdp run's sharded checkpoint, evaluated by 1 and by 2 processes (gloo): equal figures."""
    from gptlab.eval import main as evaluate

    run_dir = tmp_path / "run"
    overrides = nano_overrides(
        shakespeare, "train.max_steps=20", "train.sample_tokens=0", "hardware=cpu_x2",
        "parallelism=fsdp",
    )  # fmt: skip
    run_training(compose_config(overrides), run_dir)
    assert any(p.is_dir() for p in (run_dir / "checkpoints").glob("ckpt_*"))  # sharded
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 25)
    figures = []
    # in this process: test_two_processes_leave_stderr_clean runs the command on 2 processes
    for hardware in ("cpu", "cpu_x2"):
        evaluate([f"run={run_dir}", "tasks=[next_line]", f"eval.include={tasks}",
                  f"hardware={hardware}", "eval.mlflow=false"])  # fmt: skip
        body = eval_json(run_dir)["_body"]
        assert body["processes"] == (1 if hardware == "cpu" else 2)
        figures.append({(x["task"], x["metric"]): x["value"] for x in body["results"]})
    assert figures[0].keys() == figures[1].keys() and len(figures[0]) == 2
    for key, value in figures[0].items():
        assert math.isclose(figures[1][key], value, rel_tol=1e-12), key


@pytest.mark.slow
def test_bad_input_is_one_line_and_writes_nothing(trained_char, tmp_path, shakespeare, monkeypatch):
    from gptlab.eval import main as evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 5)
    run = f"run={trained_char}"
    cases = [
        ([run, "tasks=[next_lin]", f"eval.include={tasks}"], "'next_lin' is not in .*next_line"),
        # the shipped tasks' folder is searched too, and the line says where tasks come from
        (
            [run, "tasks=[shakespeare_nextline]", f"eval.include={tasks}"],
            r"'shakespeare_nextline' is not in lm_eval's registry or .*conf/eval_tasks or "
            r".*did you mean shakespeare_next_line\?\); tasks are lm_eval's .*eval.include=DIR",
        ),
        ([f"run={tmp_path}", "tasks=[next_line]", f"eval.include={tasks}"], "no checkpoint found"),
        ([run, "tasks=[next_line]", f"eval.include={tasks}", "eval.limit=0"], "eval.limit=0"),
        (
            [run, "tasks=[arc_easy]", f"eval.include={tasks}"],
            "task 'arc_easy': its data .* not in the local cache, and HF_HUB_OFFLINE=1 .*include",
        ),
        ([run, "tasks=[]"], "name at least one task"),
    ]
    for argv, message in cases:
        with pytest.raises(GptlabError, match=message):
            evaluate(argv)
        assert not (trained_char / "eval.json").exists()
    unicode_task = tmp_path / "unicode"
    unicode_task.mkdir()
    data = write_jsonl([{"context": "ROMEO:\n", "choices": ["caf\u00e9", "tea"], "label": 0}],
                       unicode_task / "u.jsonl")  # fmt: skip
    (unicode_task / "u.yaml").write_text(task_yaml("u", data))
    with pytest.raises(GptlabError, match="'\u00e9' is not in this model's vocabulary"):
        evaluate([run, "tasks=[u]", f"eval.include={unicode_task}"])
    assert not (trained_char / "eval.json").exists()


@pytest.fixture(scope="module")
def trained_char(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("bad") / "run"
    run_training(compose_config(nano_overrides(shakespeare, "train.sample_tokens=0")), run_dir)
    return run_dir


@pytest.mark.slow
def test_the_command_line_prints_the_table_and_help(trained_char, tmp_path, shakespeare):
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 6)
    r = run_cli(
        ["gptlab.eval", f"run={trained_char}", "tasks=[next_line]", f"eval.include={tasks}",
         "eval.limit=4", "eval.mlflow=false"],
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "|next_line|" in r.stdout.replace(" ", "") and "acc_norm" in r.stdout
    # redirected output: no progress bars (nor lm_eval's git lookup), one line instead
    assert r.stderr == ""
    assert "eval: scoring 16 loglikelihood requests" in r.stdout
    assert eval_json(trained_char)["_body"]["results"][0]["n"] == 4
    help_text = run_cli(["gptlab.eval", "--help"], cwd=tmp_path).stdout
    assert "python -m gptlab.eval run=PATH tasks=" in help_text and "eval.include" in help_text


ROWS = [{"context": f"line {i}\n", "choices": ["ab", "ba"], "label": 0} for i in range(4)]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# a broken data file of a local task: its text, and the one line that names what is wrong
BROKEN = {
    "cut": (
        jsonl(ROWS[:2]) + '{"context": "x", "choi\n',
        r"cut\.jsonl line 3 is not valid JSON \(Unterminated string.*fix or remove",
    ),
    "no_field": (
        jsonl({"ctx" if k == "context" else k: v for k, v in r.items()} for r in ROWS),
        r"doc_to_text reads the field 'context', which no row of .*no_field\.jsonl has "
        r"\(the rows have choices, ctx, label\)",
    ),
    "one_row": (
        jsonl([*ROWS[:2], {"choices": ["a"], "label": 0}]),
        r"one_row\.jsonl line 3 has no field 'context' \(doc_to_text reads it\)",
    ),
    "empty": ("", r"empty\.jsonl holds no rows: the task has no documents"),
}


def broken_task(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text(BROKEN[name][0])
    (folder / f"{name}.yaml").write_text(task_yaml(name, folder / f"{name}.jsonl"))
    return folder


@pytest.mark.parametrize("name", sorted(BROKEN))
@pytest.mark.integration
def test_a_local_tasks_broken_data_is_named_by_file_and_line_or_field(tmp_path, name):
    from gptlab.eval import task_manager

    folder = broken_task(tmp_path, name)
    with pytest.raises(GptlabError, match=f"task '{name}'.*{BROKEN[name][1]}"):
        local_spec(task_manager(str(folder), [name]), name)


@pytest.mark.integration
def test_a_relative_data_file_is_read_from_the_working_folder_else_from_the_yamls(
    tmp_path, monkeypatch
):
    """The shipped task's path is relative to its folder: handed to lm_eval made absolute. A data
    file found from the working folder is left to datasets as written."""
    from gptlab.eval import TASKS, task_manager

    monkeypatch.chdir(tmp_path)
    spec = local_spec(task_manager(None, ["shakespeare_next_line"]), "shakespeare_next_line")
    assert spec["dataset_kwargs"]["data_files"] == {
        "test": [str(TASKS.resolve() / "shakespeare_next_line.jsonl")]
    }
    folder = tmp_path / "tasks"
    folder.mkdir()
    write_jsonl(ROWS, tmp_path / "rows.jsonl")
    (folder / "here.yaml").write_text(task_yaml("here", Path("rows.jsonl")).replace(
        str(tmp_path / "rows.jsonl"), "rows.jsonl"))  # fmt: skip
    (folder / "gone.yaml").write_text(task_yaml("gone", tmp_path / "gone.jsonl"))
    manager = task_manager(str(folder), ["here", "gone"])  # indexed once: both written first
    assert local_spec(manager, "here") == "here"
    with pytest.raises(GptlabError, match=r"task 'gone' .*data file .*gone\.jsonl not found"):
        local_spec(manager, "gone")


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the tasks' data were checked")


@pytest.mark.slow
def test_broken_task_files_stop_before_any_model_work_without_datasets_noise(
    trained_char, tmp_path, monkeypatch, capfd
):
    from gptlab import eval as eval_command

    monkeypatch.setattr(eval_command, "load_scored", no_model)
    (trained_char / "eval.json").unlink(missing_ok=True)  # another test's
    for name in ("cut", "no_field", "empty"):
        folder = broken_task(tmp_path / name, name)
        argv = [f"run={trained_char}", f"tasks=[{name}]", f"eval.include={folder}"]
        with pytest.raises(GptlabError, match=BROKEN[name][1]):
            eval_command.main(argv)
    out, err = capfd.readouterr()
    assert "Generating" not in out + err and "Failed to load" not in out + err
    assert not (trained_char / "eval.json").exists()


@pytest.mark.slow
def test_a_broken_task_file_is_one_line_on_the_command_line(trained_char, tmp_path):
    folder = broken_task(tmp_path / "tasks", "cut")
    r = run_cli(["gptlab.eval", f"run={trained_char}", "tasks=[cut]", f"eval.include={folder}"],
                cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gptlab.eval: error: task 'cut'")
    assert "line 3 is not valid JSON" in r.stderr and "offline" not in r.stderr


@pytest.mark.slow
def test_the_shipped_task_runs_by_name_from_any_folder(trained_char, tmp_path, monkeypatch):
    """conf/eval_tasks is always included, its data path read from its own folder."""
    from gptlab.eval import main as evaluate

    monkeypatch.chdir(tmp_path)
    evaluate([f"run={trained_char}", "tasks=[shakespeare_next_line]", "eval.limit=4",
              "eval.mlflow=false"])  # fmt: skip
    body = eval_json(trained_char)["_body"]
    (trained_char / "eval.json").unlink()
    assert {(r["task"], r["n"]) for r in body["results"]} == {("shakespeare_next_line", 4)}


HUB_TASK = """task: on_the_hub
dataset_path: gptlab-tests/no-such-dataset
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
"""


@pytest.mark.slow
def test_a_hub_task_when_the_hub_does_not_answer_fails_in_seconds(
    trained_char, tmp_path, monkeypatch
):
    """One quick question to the Hub; no answer: the offline modes (the local cache only), so the
    line comes at once, naming the local way, and not after the hub client's retries."""
    import datasets

    from gptlab import eval as eval_command

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "on_the_hub.yaml").write_text(HUB_TASK)
    argv = [f"run={trained_char}", "tasks=[on_the_hub]", f"eval.include={tmp_path}"]
    start = time.monotonic()
    with pytest.raises(GptlabError, match=(
        r"task 'on_the_hub': its data \(gptlab-tests/no-such-dataset\) are not in the local "
        r"cache, and the Hugging Face Hub does not answer \(127.0.0.1:9: .*\); copy the data into "
        r"a file and point a task YAML at it .*eval.include=DIR"
    )):  # fmt: skip
        eval_command.main(argv)
    assert time.monotonic() - start < 10
    assert "HF_HUB_OFFLINE" not in os.environ and not datasets.config.HF_HUB_OFFLINE  # restored


@pytest.mark.slow
def test_two_processes_leave_stderr_clean(trained_char, tmp_path, shakespeare):
    """No "leaked semaphore" warning (tqdm's lock in a spawned rank), no progress bars."""
    tasks = next_line_task(tmp_path / "tasks", shakespeare, 6)
    r = run_cli(
        ["gptlab.eval", f"run={trained_char}", "tasks=[next_line]", f"eval.include={tasks}",
         "hardware=cpu_x2", "eval.limit=4", "eval.mlflow=false"],
        cwd=tmp_path,
    )  # fmt: skip
    (trained_char / "eval.json").unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""
    assert (
        "eval: scoring 8 loglikelihood requests" in r.stdout
        and "|next_line|" in r.stdout.replace(" ", "")
    )


@pytest.mark.parametrize("capability,expected", [((7, 0), "fp32"), ((8, 0), "bf16")])
def test_eval_precision_auto_follows_trainings_rule_on_a_gpu(monkeypatch, capability, expected):
    """A V100 (sm_70) emulates bf16, which torch.cuda.is_bf16_supported() counts: auto is fp32
    there, as training chooses; bf16 from Ampere on."""

    from gptlab import eval as eval_command
    from gptlab.perf import fastpath

    monkeypatch.setattr(fastpath, "gpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    _, precision = eval_command.autocast_for("auto", torch.device("cuda", 0))
    assert precision == expected
    assert eval_command.autocast_for("auto", torch.device("cpu"))[1] == "fp32"


# ---- the lm-eval adapter's own rules (gptlab/evaluation/harness.py), in process


def test_an_empty_context_is_conditioned_on_bos_else_eos_else_a_newline():
    from gptlab.data import CharTokenizer
    from gptlab.evaluation.harness import prefix_token

    assert prefix_token(SimpleNamespace(bos_id=7, eos_id=9)) == 7
    assert prefix_token(SimpleNamespace(bos_id=0, eos_id=9)) == 0  # id 0 is a token
    assert prefix_token(SimpleNamespace(bos_id=None, eos_id=0)) == 0
    assert prefix_token(CharTokenizer("\n ab")) == 0
    assert prefix_token(CharTokenizer(" ab\n")) == 3
    two = SimpleNamespace(bos_id=None, eos_id=None, encode=lambda text: [1, 2])
    for tok in (CharTokenizer("ab"), two):  # no newline, or not one token
        with pytest.raises(GptlabError) as e:
            prefix_token(tok)
        assert str(e.value) == (
            "this tokenizer has no end-of-text token and no newline to condition an empty "
            "context on"
        )


class Scripted(torch.nn.Module):
    """A model whose generate appends `then` (stopping where stop says) and records its call."""

    def __init__(self, then, block_size=16):
        super().__init__()
        self.config, self.then, self.calls = SimpleNamespace(block_size=block_size), then, []

    def generate(self, x, max_new, temperature, generator, stop):
        self.calls.append((x[0].tolist(), max_new, temperature, generator.initial_seed()))
        seq = x
        for t in self.then[:max_new]:
            seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
            if stop(seq):
                break
        return seq


def scripted_lm(then, **kw):
    from gptlab.data import CharTokenizer
    from gptlab.evaluation.harness import GptlabLM

    tok = CharTokenizer("\n abc", specials=["<|eos|>"])  # \n 0, ' ' 1, a 2, b 3, c 4, eos 5
    model = Scripted(then)
    return GptlabLM(model, tok, torch.device("cpu"), **kw), model


def generated(lm, context, **kwargs):
    (text,) = lm.generate_until([instance("generate_until", (context, kwargs))])
    return text


def test_generation_stops_at_end_of_text_and_at_the_first_stop_sequence():
    lm, model = scripted_lm([2, 3, 5, 4, 4])
    assert generated(lm, "ab", max_gen_toks=10) == "ab"  # cut before <|eos|>
    assert model.calls == [([2, 3], 10, 0, 0)]  # greedy, seed 0
    lm, model = scripted_lm([2, 1, 3, 4, 4])
    assert generated(lm, "ab", until=[" b"], max_gen_toks=10) == "a"
    assert generated(lm, "ab", until=" b", max_gen_toks=10) == "a"  # one string is one stop
    assert generated(lm, "ab", until=["c", " b"], max_gen_toks=10) == "a"
    assert [call[1] for call in model.calls] == [10, 10, 10]
    assert generated(lm, "ab", max_gen_toks=2) == "a "
    assert generated(lm, "ab") == "a bcc"  # 256 tokens by default; the script ends first
    assert model.calls[-1][1] == 256


def test_generation_samples_only_when_asked_and_keeps_room_for_the_new_tokens():
    lm, model = scripted_lm([2])
    generated(lm, "ab", temperature=0.7, max_gen_toks=4)
    generated(lm, "ab", do_sample=True, temperature=0.7, seed=5, max_gen_toks=4)
    generated(lm, "ab", do_sample=True, max_gen_toks=4)
    assert [(c[2], c[3]) for c in model.calls] == [(0, 0), (0.7, 5), (0.0, 0)]
    context = "abcabcabcabcabcabc"  # 18 tokens, a window of 16
    generated(lm, context, max_gen_toks=10)
    assert model.calls[-1][0] == lm.tok_encode(context)[-6:]
    generated(lm, context, max_gen_toks=20)
    assert model.calls[-1][0] == lm.tok_encode(context)[-1:]  # at least the last token
    generated(lm, "", max_gen_toks=3)
    assert model.calls[-1][0] == [5]  # an empty context: the prefix token


def test_the_adapter_reports_its_window_prefix_and_ranks_and_gathers_alone():
    lm, _ = scripted_lm([], rank=1, world_size=1, rolling_context=0, progress=True)
    assert (lm.eot_token_id, lm.max_length, lm.device) == (5, 16, torch.device("cpu"))
    assert lm.rolling_context == 1 and lm.show_progress is False  # only rank 0 shows progress
    assert (lm.rank, lm.world_size) == (1, 1)
    lm0, model0 = scripted_lm([], progress=True)
    assert lm0.show_progress is True and not model0.training  # made in training mode: now eval
    assert scripted_lm([], progress=False)[0].show_progress is False
    t = torch.tensor([1.0, 2.0])
    assert lm0.all_gather(t) is t and lm0.gather_object({"a": 1}) == [{"a": 1}]
    lm0.barrier()
    assert lm0.tok_decode([2, 3, 4]) == "abc"


def test_loglikelihood_says_whether_the_continuation_is_the_greedy_one():
    lm, model, tok = tiny_lm()
    full = model.generate(torch.tensor([tok.encode("abc")]), 3, temperature=0)
    greedy = tok.decode(full[0, 3:].tolist())
    other = greedy[:2] + ("a" if greedy[2] != "a" else "b")  # only its last token differs
    got = lm.loglikelihood([instance("loglikelihood", ("abc", c)) for c in (greedy, other)])
    assert [g for _, g in got] == [True, False]
    assert all(logp < 0 for logp, _ in got)
