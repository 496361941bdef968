"""hydra/sweeper=gptlab_scaling: the Hydra face of gptlab.scaling.study (an isoFLOP study).

Hydra imports every module under hydra_plugins at start-up, so this one imports nothing heavy:
gptlab loads when a study actually starts.
"""

from typing import Any, List

from hydra.plugins.sweeper import Sweeper


class GptlabScalingSweeper(Sweeper):
    """Every (budget, size) point of config.scaling, each trained to its budget."""

    def __init__(self) -> None:
        self.config = self.launcher = self.hydra_context = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: List[str]) -> Any:
        from gptlab.scaling.study import Study

        loader = self.hydra_context.config_loader

        def compose(overrides: List[str]) -> Any:
            return loader.load_sweep_config(self.config, list(overrides))

        study = Study(self.config, self.launcher, compose)
        study.prepare(arguments)
        return study.run()
