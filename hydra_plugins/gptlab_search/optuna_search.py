"""hydra/sweeper=gptlab_optuna: the Hydra face of gptlab.search.sweeper.

Hydra imports every module under hydra_plugins at start-up, so this one imports nothing heavy:
gptlab and Optuna load when a search actually starts.
"""

from typing import Any, Dict, List, Optional

from hydra.plugins.sweeper import Sweeper


class GptlabOptunaSweeper(Sweeper):
    """A Bayesian search: hydra.sweeper.params is the search space, hparams_search the settings."""

    def __init__(self, params: Optional[Dict[str, Any]] = None, seeds: Any = 1) -> None:
        self.params = dict(params or {})
        self.seeds = seeds
        self.config = self.launcher = self.hydra_context = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: List[str]) -> Any:
        from gptlab.search.sweeper import Search

        search = Search(self.config, self.launcher, self.params, self.seeds)
        search.prepare(arguments)
        return search.run()
