"""Scaling studies: how loss falls with parameters and tokens, and compute-optimal runs.

Fitting how loss falls with parameters and tokens (fit), and predicting the compute-optimal run for
a budget.
"""
