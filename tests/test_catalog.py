"""Every dataset a registered pipeline passes between nodes, or leaves as an output, has a catalog entry.

A dataset without one would be a Kedro ``MemoryDataset``: lost when a later node fails, and
invisible to a rerun of the later nodes alone. Checked in the base and the smoke environment,
with the project's own config loader settings; dataset factory patterns count as entries.
Also checked: the smoke and cpu_compare environments write every file dataset of the base one under
the same path with ``/<env>`` after its data layer (conf/*/globals.yml ``env_subdir``).
"""

from __future__ import annotations

import re

import pytest
from kedro.config import OmegaConfigLoader
from kedro.framework.project import configure_project
from kedro.io.catalog_config_resolver import CatalogConfigResolver

from qerl_pipeline import settings
from tests.helpers.project import PROJECT

ENVS = ("base", "smoke", "cpu_compare")


def _loader(env: str, runtime: dict | None = None) -> OmegaConfigLoader:
    """The project's config loader for ``env`` ("base": conf/base under the empty conf/local, as `kedro run`)."""
    return OmegaConfigLoader(
        str(PROJECT / "conf"),
        env="local" if env == "base" else env,
        runtime_params=runtime,
        **settings.CONFIG_LOADER_ARGS,
    )


def _catalog(env: str) -> dict:
    return _loader(env)["catalog"]


@pytest.fixture(scope="module")
def pipelines():
    configure_project("qerl_pipeline")
    from qerl_pipeline.pipeline_registry import register_pipelines

    return register_pipelines()


def _needing_entries(pipeline) -> set[str]:
    """Datasets between nodes (one's output, another's input) and every free output; not params."""
    outputs = pipeline.all_outputs()
    between = outputs & pipeline.all_inputs()
    return {d for d in between | pipeline.outputs() if not d.startswith("params:") and d != "parameters"}


@pytest.mark.parametrize("env", ENVS)
def test_every_dataset_between_nodes_is_in_the_catalog(pipelines, env):
    resolver = CatalogConfigResolver(_catalog(env))
    missing = {}
    for name, pipeline in pipelines.items():
        for ds in sorted(_needing_entries(pipeline)):
            if ds not in resolver.config and resolver.match_dataset_pattern(ds) is None:
                missing.setdefault(name, []).append(ds)
    assert not missing, f"{env}: datasets without a catalog entry (they would live in memory only): {missing}"


def _filepaths(entry, out, name):
    if isinstance(entry, dict):
        for key, value in entry.items():
            if key == "filepath":
                out[name] = value
            else:
                _filepaths(value, out, name)


@pytest.mark.parametrize("env", ["smoke", "cpu_compare"])
def test_env_paths_are_the_base_paths_under_the_env(env):
    base, other = {}, {}
    for name, entry in _catalog("base").items():
        _filepaths(entry, base, name)
    for name, entry in _catalog(env).items():
        _filepaths(entry, other, name)
    assert set(base) == set(other) and base
    for name, path in base.items():
        assert other[name] == re.sub(r"^(data/\d\d_[a-z_]+)", rf"\1/{env}", path), name


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("runtime", [None, {"compare": {"report_dir": "/elsewhere/report"}}])
def test_the_report_parameter_names_the_report_catalog_folder(env, runtime):
    """``compare.report_dir`` (what the run logs as its parameter) is the folder the report's
    catalog entries write to: from globals.yml by default, from a ``--params`` value when given."""
    loader = _loader(env, runtime)
    folder = loader["parameters"]["compare"]["report_dir"]
    entries = {k: v for k, v in loader["catalog"].items() if k.startswith("compare_report_{stem}")}
    assert len(entries) == 4
    for name, entry in entries.items():
        assert entry["dataset"]["filepath"].rpartition("/")[0] == folder, name
    if runtime:
        assert folder == "/elsewhere/report"
