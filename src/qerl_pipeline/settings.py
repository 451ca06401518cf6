"""Kedro project settings: hooks (config validation, MLflow tags) and config loading."""

from kedro.config import OmegaConfigLoader
from omegaconf.resolvers import oc

from qerl_pipeline.hooks import ValidateConfigHook

# Validation runs before any node, so a bad parameter fails before a model loads.
# kedro-mlflow registers its own hook through its entry point.
HOOKS = (ValidateConfigHook(),)

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "merge_strategy": {"parameters": "soft"},
    # ${oc.env:VAR,default} everywhere (Kedro enables it only for credentials by default):
    # conf/base/mlflow.yml lets MLFLOW_TRACKING_URI override the embedded SQLite store.
    "custom_resolvers": {"oc.env": oc.env},
}
