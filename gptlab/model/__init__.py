"""The model: the GPT, its attention maps, and a trained model rebuilt for inference.

The GPT itself (gpt), attention maps over a prompt (attention), and a trained model rebuilt from a
checkpoint for inference (inference).
"""

from gptlab import moved_attribute


def __getattr__(name):  # gptlab.model was one module: its names still resolve, with a warning
    return moved_attribute(
        __name__, "gptlab.model.gpt", {"gpt", "config", "attention", "inference"}, name
    )
