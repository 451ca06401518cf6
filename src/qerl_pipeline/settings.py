"""Kedro project settings: hooks (config validation, MLflow tags), config loading, and a quiet terminal.

Kedro imports this module when a session starts, before it loads any configuration, so the
warning filter below applies to every ``kedro run`` (and in-process session). It drops one
known, harmless deprecation warning that Kedro 1.7 and kedro-mlflow trigger in omegaconf
2.4 (five 13-line WARNING blocks at every run start, none of them about this project);
the filter matches only calls from those two packages, so our own code would still warn.
"""

import warnings

from kedro.config import OmegaConfigLoader

from qerl_pipeline.config import CONFIG_LOADER_ARGS  # noqa: F401 - Kedro reads it from this module
from qerl_pipeline.hooks import RunStatusHook, ValidateConfigHook
from qerl_pipeline.rollout.pool import SharedEngineHook

# omegaconf 2.4 deprecates register_new_resolver(); Kedro's OmegaConfigLoader and kedro-mlflow
# still call it (their concern, not a newcomer's): the new API is called underneath, same result.
warnings.filterwarnings(
    "ignore", message=r"register_new_resolver\(\) is deprecated", category=UserWarning, module=r"(kedro|kedro_mlflow)\."
)

# Validation runs before any node, so a bad parameter (or an unusable tracking store) fails before a model loads.
# kedro-mlflow registers its own hook through its entry point.
# RunStatusHook makes the run's MLflow status say how it ended (KILLED on SIGINT/SIGTERM, FAILED with why).
# SharedEngineHook closes the engine compare's branches share when the run ends (rollout/pool.py).
HOOKS = (ValidateConfigHook(), RunStatusHook(), SharedEngineHook())

CONFIG_LOADER_CLASS = OmegaConfigLoader
