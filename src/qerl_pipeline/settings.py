"""Kedro project settings: hooks (config validation, MLflow tags), config loading, and a quiet terminal.

Kedro imports this module when a session starts, before it loads any configuration or its
plugins' commands, so ``terminal.quiet_known_noise`` called here covers every ``kedro run``
(and in-process session): it silences the third-party messages this project knows to be
harmless, each at its source and no other (``terminal.py`` says why each is harmless).
"""

from kedro.config import OmegaConfigLoader

from qerl_pipeline.config import CONFIG_LOADER_ARGS  # noqa: F401 - Kedro reads it from this module
from qerl_pipeline.hooks import QerlContext, RunStatusHook, ValidateConfigHook
from qerl_pipeline.rollout.pool import SharedEngineHook
from qerl_pipeline.terminal import quiet_known_noise

quiet_known_noise()

# Validation runs before any node, so a bad parameter (or an unusable tracking store) fails before a model loads.
# kedro-mlflow registers its own hook through its entry point.
# RunStatusHook makes the run's MLflow status say how it ended (KILLED on SIGINT/SIGTERM, FAILED with why).
# SharedEngineHook closes the engine compare's branches share when the run ends (rollout/pool.py).
HOOKS = (ValidateConfigHook(), RunStatusHook(), SharedEngineHook())

CONFIG_LOADER_CLASS = OmegaConfigLoader
# its parameters as written: ValidateConfigHook validates them once and hands the nodes typed sections
CONTEXT_CLASS = QerlContext
