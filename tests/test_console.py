"""gptlab.console: the lines a run says, e.g. where the next start resumes and the command for
it."""


def test_the_stop_line_names_the_checkpoint_the_next_start_resumes_and_the_command(tmp_path):
    """A run folder is named by its start time: the command names it (a sweep's job: the
    sweep's)."""
    from gptlab.checkpoint.state import checkpoint_path
    from gptlab.console import next_start

    folder = tmp_path / "run" / "checkpoints"
    assert next_start(folder, "auto") == (
        f"the next start begins at step 0 (no checkpoint yet): run the same command with "
        f"hydra.run.dir={tmp_path / 'run'}"
    )
    folder.mkdir(parents=True)
    for step in (10, 20):
        checkpoint_path(folder, step, sharded=step == 20).mkdir()
    assert next_start(folder, "never") == (
        f"the next start resumes from {folder / 'ckpt_00000020'} (step 20): "
        f"run the same command with hydra.run.dir={tmp_path / 'run'} train.resume=auto"
    )
    # Hydra's record of a sweep, in the sweep's folder
    (tmp_path / "multirun.yaml").write_text("{}")
    assert next_start(folder, "auto").endswith(
        f"(step 20): run the sweep again with hydra.sweep.dir={tmp_path}"
    )
