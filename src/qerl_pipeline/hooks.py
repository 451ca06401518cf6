"""Project hooks: validate every parameter before any node runs, and say what is wrong briefly.

Design. ``ValidateConfigHook.before_pipeline_run`` validates the whole parameter tree
(``config.validate``, the one home of the schema's error lines) and the AQN noise precision,
``tryfirst`` so that it runs before kedro-mlflow's hook: a bad config starts no MLflow run
and loads no model. A ``ConfigError`` leaves the hook as a ``ParameterError``: still a
``ConfigError`` (callers and tests that catch that keep working), and also a
``click.ClickException``, the one exception type that click, under Kedro's CLI, prints as a
short ``Error: ...`` message and turns into exit code 1, instead of the rich traceback Kedro
prints for anything else. So ``kedro run`` (and ``python -m qerl_pipeline``) shows a bad
parameter in a few lines, while every other exception, a real bug, keeps its full traceback.
``config_error_message`` composes those lines: the field by dotted path, the value given,
what is allowed (for a misspelt key: the keys its section has), and where parameters live.
"""

from __future__ import annotations

import logging
import re

import click
from kedro.framework.hooks import hook_impl
from pydantic import BaseModel

from qerl_pipeline.config import ConfigError, QerlConfig, validate
from qerl_pipeline.platform import current_platform

log = logging.getLogger(__name__)

#: where a newcomer fixes a parameter (printed under every config error)
WHERE = (
    "Every parameter is described in conf/base/parameters.yml; override it in conf/<env>/parameters.yml "
    "or with `kedro run --params <field>=<value>`."
)
_EXTRA = re.compile(r"^(\s*)(\S+): Extra inputs are not permitted(.*)$")


def section_keys(path: str, root: type[BaseModel] = QerlConfig) -> list[str] | None:
    """The keys allowed beside the last part of dotted ``path`` (its section's fields), or
    None when the path does not lead through sections of ``root``."""
    model = root
    for part in path.split(".")[:-1]:
        field = model.model_fields.get(part)
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return list(model.model_fields)


def config_error_message(err: ConfigError) -> str:
    """The short text a config error prints: ``config.validate``'s lines (field, message,
    value), each unknown key followed by the keys its section allows, and where to fix it."""
    lines = []
    for line in str(err).splitlines():
        m = _EXTRA.match(line)
        keys = section_keys(m.group(2)) if m else None
        if m and keys is not None:
            line = f"{m.group(1)}{m.group(2)}: unknown key{m.group(3)}; allowed: {', '.join(keys)}"
        lines.append(line)
    if lines and lines[0].endswith(":"):  # config.validate's header line
        head, lines = lines[0][:-1], lines[1:]
    else:
        head, lines = "invalid parameters", [f"  {line}" for line in lines]
    return "\n".join([f"{head} (nothing ran):", *lines, WHERE])


class ParameterError(ConfigError, click.ClickException):
    """A ConfigError that the Kedro CLI prints as a short message (exit code 1), no traceback."""

    def __init__(self, err: ConfigError) -> None:
        click.ClickException.__init__(self, config_error_message(err))


class ValidateConfigHook:
    """Fail a run at its start, before any model loads, when a parameter is wrong.

    The error names each bad field by its dotted path (e.g. ``optim.lr.qerl``) and the
    allowed values. Parameters that are not part of the schema (Kedro's own, or a user's
    extra top-level keys) are rejected too: a misspelt section would otherwise be ignored.
    """

    def __init__(self) -> None:
        self._context = None

    @hook_impl
    def after_context_created(self, context) -> None:
        self._context = context

    @hook_impl(tryfirst=True)  # before kedro-mlflow's: a bad config starts no MLflow run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        if self._context is None:
            return
        try:
            cfg = validate(dict(self._context.params), QerlConfig)
            from qerl_pipeline.models import resolve_dtype  # torch and transformers: only when a run starts
            from qerl_pipeline.quantization.norms import check_noise_precision

            check_noise_precision(cfg, resolve_dtype(cfg.model, current_platform()))
        except ConfigError as err:
            raise ParameterError(err) from None
        log.info("parameters valid: method=%s model=%s", cfg.method, cfg.model.name)
