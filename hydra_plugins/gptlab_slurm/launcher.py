"""RestartingSlurmLauncher: hydra-submitit-launcher's SLURM launcher, which also submits a job again
when one of its tasks or nodes died (gptlab/distributed/slurm_launcher.py), for the SLURM presets
(conf/hydra/launcher/slurm_*.yaml).

Imports nothing heavy: Hydra imports every plugin module at each start.
"""

from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


class RestartingSlurmLauncher(SlurmLauncher):
    """submitit's SLURM launcher; its launch waits through gptlab.distributed.slurm_launcher."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        from gptlab.distributed.slurm_launcher import launch

        return launch(self, job_overrides, initial_job_idx)
