"""gptlab.bench: the real loop timed, one JSON line out."""

import json

import pytest
from helpers import REPO, run_cli

from gptlab.bench import bench_config, run_bench
from gptlab.cli import compose
from gptlab.errors import GptlabError

KEYS = {
    "tokens_per_s",
    "step_ms",
    "mfu",
    "hfu",
    "peak_mem_bytes",
    "plan_mem_bytes",
    "model",
    "params",
    "hardware",
    "precision",
    "compile",
    "micro_batch_size",
    "accum_steps",
    "threads",
    "timed_steps",
}


def tiny(shakespeare):
    return [
        "model=gpt_nano",
        "optimizer=adamw",
        f"data.path={shakespeare}",
        "train.batch_size=4",
        "tracking.mlflow=false",
    ]


@pytest.mark.integration
def test_flags():
    cfg = bench_config(
        compose("bench", ["bench.steps=4", "model=gpt_nano", "bench.warmup=0", "bench.mlflow=true"])
    )
    assert (
        dict(cfg.bench)
        == {"warmup": 0, "steps": 4, "mlflow": True, "profile": False, "ladder": False}
        | {"coord_check": False}
        and cfg.model.name == "gpt_nano"
    )
    assert cfg.train.max_steps == 4 and cfg.tracking.mlflow is True and cfg.train.log_every == 1
    with pytest.raises(GptlabError, match="bench.steps"):
        compose("bench", ["bench.steps=x"])
    with pytest.raises(GptlabError, match="bench.steps"):
        bench_config(compose("bench", ["bench.steps=0"]))


@pytest.mark.integration
def test_bench_in_process(shakespeare, tmp_path, capsys):
    cfg = compose(
        "bench",
        [
            *tiny(shakespeare),
            "parallelism.activation_checkpointing=true",
            "bench.warmup=1",
            "bench.steps=3",
        ],
    )
    result = run_bench(cfg, tmp_path)
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and json.loads(line[0]) == result
    assert result.keys() >= KEYS and result["timed_steps"] == 3
    assert result["tokens_per_s"] > 0 and result["step_ms"] > 0 and result["peak_mem_bytes"] > 0
    assert result["hfu"] > result["mfu"] > 0  # checkpointing's recomputation is hardware work
    assert (tmp_path / "bench.json").is_file() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_bench_cli_prints_one_json_line(shakespeare, tmp_path):
    out = run_cli(
        [
            "gptlab.bench",
            "bench.warmup=1",
            "bench.steps=2",
            *tiny(shakespeare),
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert (
        result.keys() >= KEYS
        and result["timed_steps"] == 2
        and result["peak_mem_source"] == "peak_rss"
    )


@pytest.mark.slow
def test_bench_cli_user_error_is_one_line(tmp_path):
    out = run_cli(
        ["gptlab.bench", "model.n_embd=33", f"hydra.run.dir={tmp_path}"], cwd=REPO, timeout=120
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "model.n_embd" in out.stderr
