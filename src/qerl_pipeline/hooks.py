"""Project hooks: validate every parameter before any node runs."""

from __future__ import annotations

import logging

from kedro.framework.hooks import hook_impl

from qerl_pipeline.config import QerlConfig, validate

log = logging.getLogger(__name__)


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

    @hook_impl
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        if self._context is None:
            return
        cfg = validate(dict(self._context.params), QerlConfig)
        import torch

        from qerl_pipeline.models import resolve_dtype
        from qerl_pipeline.rl.norms import check_noise_precision

        check_noise_precision(cfg, resolve_dtype(cfg.model, "cuda" if torch.cuda.is_available() else "cpu"))
        log.info("parameters valid: method=%s model=%s", cfg.method, cfg.model.name)
