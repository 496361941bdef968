"""A trained model as an MLflow model: logged, registered, loaded and served.

Serving is in serving; the models-from-code file MLflow runs to build it is pyfunc_model.
"""
