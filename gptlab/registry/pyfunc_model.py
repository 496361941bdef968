"""The code of a logged gptlab model (MLflow's models-from-code).

MLflow runs this file to build the model it serves, instead of unpickling a Python object; a copy
of it is kept in each logged model, so what it imports stays importable. The model itself is
serving.GptlabModel.
"""

from mlflow.models import set_model

from gptlab.registry.serving import GptlabModel

set_model(GptlabModel())
