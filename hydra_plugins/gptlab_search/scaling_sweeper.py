"""hydra/sweeper=gptlab_scaling: the Hydra face of gptlab.scaling.study (an isoFLOP study).

Hydra imports every module under hydra_plugins at start-up, so this one imports nothing heavy:
gptlab loads when a study actually starts.
"""

from typing import Any, List

from hydra_plugins.gptlab_search.launching import LaunchingSweeper


class GptlabScalingSweeper(LaunchingSweeper):
    """Every (budget, size) point of config.scaling, each trained to its budget."""

    def sweep(self, arguments: List[str]) -> Any:
        from gptlab.scaling.study import Study

        loader = self.hydra_context.config_loader

        def compose(overrides: List[str]) -> Any:
            return loader.load_sweep_config(self.config, list(overrides))

        study = Study(self.config, self.launcher, compose)
        study.prepare(arguments)
        return study.run()
