"""Scaling studies: fitting how loss falls with parameters and tokens (fit), and predicting the
compute-optimal run for a budget."""
