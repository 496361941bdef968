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


def test_flags():
    cfg = bench_config(
        compose("bench", ["bench.steps=4", "model=gpt_nano", "bench.warmup=0", "bench.mlflow=true"])
    )
    assert (
        dict(cfg.bench)
        == {"warmup": 0, "steps": 4, "mlflow": True, "profile": False, "ladder": False}
        and cfg.model.name == "gpt_nano"
    )
    assert cfg.train.max_steps == 4 and cfg.tracking.mlflow is True and cfg.train.log_every == 1
    with pytest.raises(GptlabError, match="bench.steps"):
        compose("bench", ["bench.steps=x"])
    with pytest.raises(GptlabError, match="bench.steps"):
        bench_config(compose("bench", ["bench.steps=0"]))


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


@pytest.mark.slow
def test_gpu_check_script_on_the_cpu(tmp_path):
    """launch/gpu_check.sh with the device overridden to the CPU and both models shrunk."""
    import os
    import subprocess
    import sys

    shrink = (
        "model.n_layer=1 model.n_embd=32 model.n_head=2 model.block_size=32 model.ffn_dim=null "
        "train.batch_size=2 train.micro_batch_size=2 hardware.compile=false "
        "hardware.precision=fp32 optimizer.fused=false"
    )
    env = {
        **os.environ,
        "GPU_CHECK_HARDWARE": "hardware=cpu",
        "GPU_CHECK_SHRINK": shrink,
        "GPU_CHECK_WARMUP": "1",
        "GPU_CHECK_STEPS": "2",
        "GPU_CHECK_CHUNKED": "model=gpt_nano batch=2 vocab=5000 chunk=16 device=cpu steps=1",
        "GPU_CHECK_LADDER": "model=gpt_nano model.dropout=0.1",  # fused attention's rung skipped
        "CXX": "no-such-compiler",  # the ladder's compile rung is skipped: minutes on a CPU
        "PYTHON": sys.executable,
    }
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        ["bash", str(REPO / "launch" / "gpu_check.sh"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"gpt2_124m", "gpt1b", "gpt2_124m_fsdp", "gpt2_124m_muon"}
    for name, run in report["runs"].items():
        assert run["ok"], run.get("error")
        model = name.removesuffix("_fsdp").removesuffix("_muon")
        assert run["bench"]["model"] == model and run["plan"]["model"] == model
        assert run["measured_vs_plan"]["plan_mem_bytes"] > 0
    assert report["runs"]["gpt1b"]["bench"]["activation_checkpointing"] is True
    # a world of one is valid
    assert report["runs"]["gpt2_124m_fsdp"]["bench"]["strategy"] == "fsdp"
    chunked = report["chunked_loss"]
    assert chunked["chunked"]["peak_step_bytes"] < chunked["whole"]["peak_step_bytes"]
    rungs = {r["rung"]: r for r in report["ladder"]["ladder"]}
    assert rungs["plain fp32"]["tokens_per_s"] > 0 and "skipped" in rungs["+ torch.compile"]
