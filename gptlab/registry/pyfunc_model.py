"""The code of a logged gptlab model (MLflow's models-from-code).

MLflow runs this file to build the model it serves, instead of unpickling a Python object. The
model's behaviour is serving.GptlabModel; MLflow's PythonModel is added to it here, where MLflow is
imported anyway.
"""

from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

from gptlab.registry.serving import GptlabModel


class ServedModel(GptlabModel, PythonModel):
    """serving.GptlabModel as the MLflow pyfunc model that the scoring server loads."""


set_model(ServedModel())
