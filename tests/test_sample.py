"""gptlab.sample rebuilds the model from a checkpoint alone and continues a prompt; a run without
checkpoints is one line from sample and export alike."""

import pytest
from helpers import compose_config, nano_overrides, run_cli

from gptlab import export, sample
from gptlab.errors import GptlabError
from gptlab.train import run_training


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_training(compose_config(nano_overrides(shakespeare, "train.max_steps=30")), run_dir)
    return run_dir


@pytest.mark.slow
def test_sample_command_continues_the_prompt(trained, tmp_path, capsys):
    args = [f"run={trained}", "prompt=ROMEO:", "max_new_tokens=40", "seed=1"]
    r = run_cli(["gptlab.sample", *args], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) >= 40
    capsys.readouterr()
    sample.main(args)  # the same command again, in this process
    assert capsys.readouterr().out == r.stdout  # seeded


@pytest.mark.integration
@pytest.mark.parametrize(
    "args,fragment",
    [
        (["run=/nonexistent"], "run=/nonexistent: no such folder or file"),
        (["run={run}", "temprature=0.5"], "temprature"),
        (["run={run}", "max_new_tokens=lots"], "max_new_tokens"),
        (["run={run}", "prompt=€"], "not in"),
    ],
)
def test_sample_bad_arguments_are_one_line(trained, args, fragment):
    """In this process: a GptlabError is the command's one line and exit code 2, as the real
    processes of test_a_run_without_checkpoints_names_where_they_would_be and test_cli.py show."""
    with pytest.raises(GptlabError) as e:
        sample.main([a.format(run=trained) for a in args])
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_a_run_without_checkpoints_names_where_they_would_be(tmp_path):
    empty = tmp_path / "run"
    empty.mkdir()
    said = (
        f"run={empty}: no checkpoint found (expected {empty}/checkpoints/ckpt_<step>.pt "
        f"such as ckpt_00000030.pt, or a sharded {empty}/checkpoints/ckpt_<step>/)"
    )
    r = run_cli(["gptlab.sample", f"run={empty}"], cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == f"gptlab.sample: error: {said}"
    # export's, in this process: its real process's one line is test_cli.py's
    with pytest.raises(GptlabError) as e:
        export.main([f"run={empty}"])
    assert str(e.value) == said
