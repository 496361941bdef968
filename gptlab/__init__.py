"""gptlab: pre-train GPT-style language models from scratch with Hydra, PyTorch and MLflow."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"


def is_dtensor(x) -> bool:
    """x is a DTensor (a tensor sharded by fully_shard), answered without importing DTensor.

    None can exist before torch.distributed.tensor is imported, and importing it costs every
    unsharded run's start; the one answer for the model, the optimizer and the checkpoint alike.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


# Modules that moved into packages (2026-12): the old path still imports, with a deprecation
# warning, so a user's script, notebook or logged MLflow model written against it keeps working.
MOVED = {
    "gptlab.attention": "gptlab.model.attention",
    "gptlab.inference": "gptlab.model.inference",
    "gptlab.safe_dcp": "gptlab.checkpoint.safe_dcp",
    "gptlab.build": "gptlab.training.build",
    "gptlab.run": "gptlab.training.run",
    "gptlab.loop": "gptlab.training.loop",
    "gptlab.profiling": "gptlab.training.profiling",
    "gptlab.slurm": "gptlab.distributed.slurm",
    "gptlab.runtime": "gptlab.perf.runtime",
    "gptlab.costs": "gptlab.perf.costs",
    "gptlab.fastpath": "gptlab.perf.fastpath",
    "gptlab.metrics": "gptlab.perf.measure",
    "gptlab.ladder": "gptlab.perf.ladder",
    "gptlab.serving": "gptlab.registry.serving",
    "gptlab.pyfunc_model": "gptlab.registry.pyfunc_model",
    "gptlab.sweep": "gptlab.search.callbacks",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module at its new one (the same module object)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}", DeprecationWarning, stacklevel=2)
        # the import system reads the module back from sys.modules: the real one is returned
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def moved_attribute(package: str, module: str, submodules: set, name: str):
    """A package's __getattr__ for the names of the flat module it replaced.

    gptlab.model's GPT is gptlab.model.gpt's: the name, with a deprecation warning; its own
    submodules import as such.
    """
    if name.startswith("__") or name in submodules:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    warnings.warn(f"{package}.{name} moved to {module}.{name}", DeprecationWarning, stacklevel=3)
    setattr(sys.modules[package], name, value)  # warned once
    return value
