"""A trained model as an MLflow model: logged, registered, loaded and served (serving), and the
models-from-code file MLflow runs to build it (pyfunc_model)."""
