"""Project pipelines: each lives in ``pipelines/<name>/pipeline.py``."""

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline


def register_pipelines() -> dict[str, Pipeline]:
    """Every pipeline by its folder name; ``__default__`` is data prep then training."""
    pipelines = find_pipelines(raise_errors=True)
    default = Pipeline([])
    for name in ("data_prep", "train"):
        default += pipelines.get(name, Pipeline([]))
    pipelines["__default__"] = default
    return pipelines
