"""A newcomer's terminal: a bad parameter prints a short message, not a traceback; the rest is quiet.

The fast tests check ``hooks.config_error_message`` (field, value, allowed values, where to
fix it), that a ``ParameterError`` is still a ``ConfigError`` and that click prints it in a
few lines with exit code 1, and that the hook converts only config errors (any other
exception, a bug, keeps its traceback). One ``kedro run`` (integration tier) checks the
whole path in a project copy: short output, non-zero exit, no traceback, no node and no
MLflow run started, and none of the deprecation warnings the project silenced. The training's
live progress line keeps its numbers whole at 80 columns; the known-harmless third-party
messages are silenced at their source only (``terminal.quiet_known_noise``).
"""

from __future__ import annotations

import io
import itertools
import re
import sqlite3

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from qerl_pipeline import metric_names
from qerl_pipeline.config import ConfigError, QerlConfig, validate
from qerl_pipeline.hooks import WHERE, ParameterError, ValidateConfigHook, config_error_message, section_keys
from qerl_pipeline.terminal import TrainProgress
from tests.helpers.project import project_copy, run_kedro


def _error(params: dict) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate(params, QerlConfig)
    return err.value


def test_message_names_field_value_and_allowed_values():
    msg = config_error_message(_error({"method": "foo"}))
    assert msg.splitlines()[0] == "invalid parameters (nothing ran):"
    assert (
        "  method: Input should be 'qerl', 'qerl_noaqn', 'qlora', 'lora', 'lora_aqn', 'mxfp4', 'mxfp4_noaqn' or "
        "'fp8' (got 'foo')" in msg.splitlines()
    )
    assert msg.splitlines()[-1] == WHERE and "conf/base/parameters.yml" in WHERE
    assert "Traceback" not in msg and len(msg.splitlines()) == 3


def test_misspelt_keys_list_what_their_section_allows():
    msg = config_error_message(_error({"optimm": {"lr": 1}, "optim": {"lrr": 1}}))
    lines = msg.splitlines()
    top = next(line for line in lines if line.startswith("  optimm:"))
    assert "unknown key" in top and "allowed: method, model, data," in top and "optim," in top
    nested = next(line for line in lines if line.startswith("  optim.lrr:"))
    assert "(got 1)" in nested and "allowed: name, lr, weight_decay" in nested
    assert section_keys("model.random_init.x")[:2] == ["hidden_size", "num_hidden_layers"]
    assert section_keys("method.x") is None  # `method` is a value, not a section


def test_a_message_without_validate_header_keeps_its_text():
    msg = config_error_message(ConfigError("model.norm_dtype: rounds the noise away"))
    assert msg.splitlines()[:2] == ["invalid parameters (nothing ran):", "  model.norm_dtype: rounds the noise away"]


def test_click_prints_a_parameter_error_short_with_exit_code_1():
    err = ParameterError(_error({"method": "foo", "optim": {"lr": {"qerl": -1}}}))
    assert isinstance(err, ConfigError) and isinstance(err, click.ClickException)

    @click.command()
    def run():
        raise err

    result = CliRunner().invoke(run, [])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    out = result.output
    assert out.startswith("Error: invalid parameters (nothing ran):\n")
    assert "(got 'foo')" in out and "lr.qerl must be > 0, got -1.0" in out
    assert "Traceback" not in out and len(out.splitlines()) == 4


class _Context:
    def __init__(self, params):
        self._params = params

    @property
    def params(self):
        if isinstance(self._params, Exception):
            raise self._params
        return self._params


def test_hook_turns_config_errors_into_parameter_errors_and_lets_bugs_through():
    hook = ValidateConfigHook()
    hook.after_context_created(_Context({"method": "foo"}))
    with pytest.raises(ParameterError, match=r"method: Input should be .*\(got 'foo'\)"):
        hook.before_pipeline_run(run_params={}, pipeline=None, catalog=None)
    bug = KeyError("not a config problem")
    hook.after_context_created(_Context(bug))
    with pytest.raises(KeyError) as err:
        hook.before_pipeline_run(run_params={}, pipeline=None, catalog=None)
    assert err.value is bug and not isinstance(err.value, click.ClickException)


@pytest.mark.kedro_run
def test_kedro_run_with_bad_parameters_prints_a_short_error(tmp_path):
    root = project_copy(tmp_path / "project")
    proc = run_kedro(
        root, "run", "--pipelines=train", "--env=smoke", "--params", "method=foo,optim.lrr=1", check=False, timeout=300
    )
    text = proc.stdout
    lines = text.splitlines()
    assert proc.returncode != 0, text
    assert "Traceback" not in text and "Error: invalid parameters (nothing ran):" in text, text
    assert (
        "method: Input should be 'qerl', 'qerl_noaqn', 'qlora', 'lora', 'lora_aqn', 'mxfp4', 'mxfp4_noaqn' or "
        "'fp8' (got 'foo')" in text
    ), text
    assert "optim.lrr: unknown key (got 1); allowed: name, lr," in text, text
    assert len(lines) < 15, f"{len(lines)} lines:\n{text}"
    assert "Running node" not in text and "has started" not in text, text  # no node, no MLflow run (tryfirst)
    assert "register_new_resolver" not in text and "KedroDeprecationWarning" not in text, text
    db = root / "mlflow.db"
    if db.exists():
        with sqlite3.connect(db) as con:
            assert con.execute("select count(*) from runs").fetchone()[0] == 0


@pytest.mark.parametrize("total, steps, tokens_per_s", [(24, 12, 1234.4), (1000, 10, 99999.0), (9999, 9998, 123456.0)])
def test_the_training_progress_line_is_whole_at_80_columns(total, steps, tokens_per_s):
    """The live line of a training, rendered by rich at 80 columns (a terminal's or a log's default width), keeps
    every number whole: step, reward, accuracy, tokens/s and the ETA (a wider line is cut to ``0:…``)."""
    out = io.StringIO()
    console = Console(width=80, file=out, force_terminal=False, color_system=None)
    clock = itertools.count(0.0, 2.0)  # two seconds a step: the ETA has a rate to go by
    bar = TrainProgress(total, total - steps, console=console, get_time=lambda: next(clock))
    for _ in range(steps - 1):
        bar.advance(
            {
                metric_names.REWARD_MEAN: -0.123,
                metric_names.REWARD_ACCURACY: 0.22,
                metric_names.ROLLOUT_TOKENS_PER_S: tokens_per_s,
            }
        )
    bar.close()
    line = out.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= 80 and "…" not in line, line
    expected = (
        rf"train ━+[╸ ]* +{total - 1}/{total} reward -0\.123 acc 0\.22 {tokens_per_s:.0f} tok/s "
        r"ETA \d+:\d\d:\d\d"
    )
    assert re.fullmatch(expected, line), line


def test_known_harmless_noise_is_silenced_at_its_source_only(caplog, monkeypatch):
    """MLflow's type-hint warning for a pyfunc model class (kedro-mlflow defines one as Kedro loads it, under
    MLflow's own warning filter) and bitsandbytes' note on its optional CPU kernel are dropped where Kedro's
    logging receives them; the same texts from elsewhere, and the other messages of those sources, still show."""
    import logging
    import warnings

    from mlflow.pyfunc import PythonModel

    from qerl_pipeline.terminal import BNB_CPU_KERNEL_NOTE, BNB_CPU_LOGGER, WARNINGS_LOGGER, quiet_known_noise

    for name in (WARNINGS_LOGGER, BNB_CPU_LOGGER):  # as before settings.py ran (another test's Kedro session may have)
        monkeypatch.setattr(logging.getLogger(name), "filters", [])

    def define_model():
        class Model(PythonModel):  # what kedro-mlflow's KedroPipelineModel does: predict() without type hints
            def predict(self, context, model_input, params=None):
                return model_input

    def logged() -> list[tuple[str, str]]:
        return [(r.name, r.getMessage()) for r in caplog.records]

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings():  # restores pytest's own capture of warnings after
        logging.captureWarnings(False)
        logging.captureWarnings(True)  # warnings to the py.warnings logger, as Kedro's RichHandler sets it
        try:
            define_model()
            assert any(n == "py.warnings" and "Add type hints to the `predict` method" in m for n, m in logged())
            caplog.clear()
            quiet_known_noise()
            define_model()
            warnings.warn_explicit("Add type hints to the `predict` method", UserWarning, "mine.py", 1, module="mine")
        finally:
            logging.captureWarnings(False)
    assert logged() == [("py.warnings", "mine.py:1: UserWarning: Add type hints to the `predict` method\n")]

    caplog.clear()
    logging.getLogger(BNB_CPU_LOGGER).warning(
        BNB_CPU_KERNEL_NOTE + ": %s. Please make sure ...", "No module named 'kernels'"
    )
    logging.getLogger(BNB_CPU_LOGGER).warning("another bitsandbytes warning")
    logging.getLogger("mine").warning(BNB_CPU_KERNEL_NOTE)
    assert logged() == [(BNB_CPU_LOGGER, "another bitsandbytes warning"), ("mine", BNB_CPU_KERNEL_NOTE)]
