"""gptlab: pre-train GPT-style language models from scratch with Hydra, PyTorch and MLflow."""

__version__ = "0.1.0"
