"""How good a model is, beyond its own validation loss.

- ``scoring``: the one scorer of continuations (summed log-likelihood of target tokens after a
  context), batched by length and padded to fixed shapes; what both of the below use.
- ``hellaswag``: HellaSwag's validation file, scored completion-style in the training loop.
- ``harness``: an lm-evaluation-harness model over gptlab's own model and tokenizer
  (``python -m gptlab.eval``).
"""
