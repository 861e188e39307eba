"""fedcore: the federated-learning library behind the platform.

Everything below this package imports with torch, numpy and scipy alone. Scheduling (Prefect),
placement (Ray) and tracking (MLflow) live in ``flows/`` and call into the step functions here.
"""

__version__ = "0.1.0"
