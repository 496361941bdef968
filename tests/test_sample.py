"""gptlab.sample rebuilds the model from a checkpoint alone and continues a prompt; a run without
checkpoints is one line from sample and export alike."""

import pytest
from helpers import compose_config, nano_overrides, run_cli

from gptlab.train import run_training


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_training(compose_config(nano_overrides(shakespeare, "train.max_steps=30")), run_dir)
    return run_dir


@pytest.mark.slow
def test_sample_command_continues_the_prompt(trained, tmp_path):
    r = run_cli(
        ["gptlab.sample", f"run={trained}", "prompt=ROMEO:", "max_new_tokens=40", "seed=1"],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) >= 40
    again = run_cli(
        ["gptlab.sample", f"run={trained}", "prompt=ROMEO:", "max_new_tokens=40", "seed=1"],
        cwd=tmp_path,
    )
    assert again.stdout == r.stdout  # seeded


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,fragment",
    [
        (["run=/nonexistent"], "run=/nonexistent: no such folder or file"),
        (["run={run}", "temprature=0.5"], "temprature"),
        (["run={run}", "max_new_tokens=lots"], "max_new_tokens"),
        (["run={run}", "prompt=€"], "not in"),
    ],
)
def test_sample_bad_arguments_are_one_line(trained, tmp_path, args, fragment):
    r = run_cli(["gptlab.sample", *[a.format(run=trained) for a in args]], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("gptlab.sample: error:") and fragment in lines[0]
    ), r.stderr


@pytest.mark.slow
def test_a_run_without_checkpoints_names_where_they_would_be(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    for command in ("gptlab.sample", "gptlab.export"):
        r = run_cli([command, f"run={empty}"], cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0] == (
            f"{command}: error: run={empty}: no checkpoint found (expected "
            f"{empty}/checkpoints/ckpt_<step>.pt "
            f"such as ckpt_00000030.pt, or a sharded {empty}/checkpoints/ckpt_<step>/)"
        )
