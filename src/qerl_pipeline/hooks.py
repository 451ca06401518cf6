"""Project hooks: validate every parameter before any node runs, and say what is wrong briefly.

Design. ``ValidateConfigHook.before_pipeline_run`` validates the whole parameter tree
(``config.validate``, the one home of the schema's error lines), the AQN noise precision and
the columns of the user's data sets (``data.user_sets.column_problems``),
``tryfirst`` so that it runs before kedro-mlflow's hook: a bad config starts no MLflow run
and loads no model. That typed config is what the nodes get, validated once: ``before_node_run`` hands each
``params:`` input as the tree holds it (``config.at_path``; ``QerlContext`` keeps Kedro from building the sections
again). A ``ConfigError`` leaves the hook as a ``ParameterError``: still a
``ConfigError`` (callers and tests that catch that keep working), and also a
``click.ClickException``, the one exception type that click, under Kedro's CLI, prints as a
short ``Error: ...`` message and turns into exit code 1, instead of the rich traceback Kedro
prints for anything else. So ``kedro run`` (and ``python -m qerl_pipeline``) shows a bad
parameter in a few lines, while every other exception, a real bug, keeps its full traceback.
``config_error_message`` composes those lines: the field by dotted path, the value given,
what is allowed (for a misspelt key: the keys its section has), and where parameters live.

Settings that pass alone but not together across sections (``cross_field_errors``) are checked
here, on the whole tree, and only for the nodes the run has, so these checks cannot live in ``QerlConfig``.

On a CUDA machine the memory planner is asked last (``planner_refusal``; ``planner.check``
turns it off): for the methods whose engines the run starts (its training, a compare's
branches, or evaluation alone), on the GPU's size as CUDA counts it (``platform.gpu_memory_bytes``,
through NVML: no CUDA context exists before vLLM forks its engine), settings that cannot start
or do not fit end the run as one ``Error:`` line (``PlannerRefusal``) naming the field, the
GPU's size and the value that fits (``planner/guard.py``).

The tracking store is tried in ``after_context_created``, ``tryfirst`` so before kedro-mlflow's
(which connects to the store there, and retries an unreachable server for minutes):
``tracking.check_store`` gives a one-line ``TrackingStoreUnusable`` within seconds.

``RunStatusHook`` makes the MLflow run of a ``kedro run`` say how it ended. Kedro calls no hook
for a ``KeyboardInterrupt`` and MLflow's exit handler closes the active run as FINISHED, so
during the run SIGINT and SIGTERM raise ``tracking.Interrupted`` (a KeyboardInterrupt naming
the signal: every ``finally`` runs, the engines close), and an exit handler, which runs before
MLflow's, ends the run KILLED with the signal and the last completed node. An error reaches
``on_pipeline_error``: the run is tagged with its one-line summary and kedro-mlflow ends it FAILED;
a training stopped by its tracking server away (``TrackingOutage``) leaves as one ``Error:`` line,
its runs taken off MLflow's stack without a request (the server cannot hear it; the resume reopens them).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import threading

import click
from kedro.config import MissingConfigException
from kedro.framework.context import KedroContext
from kedro.framework.hooks import hook_impl
from pydantic import BaseModel

from qerl_pipeline import tracking
from qerl_pipeline.config import ConfigError, QerlConfig, at_path, validate
from qerl_pipeline.data.user_sets import column_problems
from qerl_pipeline.platform import current_platform, gpu_memory_bytes
from qerl_pipeline.tracking_journal import TrackingOutage
from qerl_pipeline.tracking_view import mark_model_development

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


class PlannerRefusal(ConfigError, click.ClickException):
    """Settings the memory planner says cannot run on this GPU: one ``Error:`` line from the Kedro CLI, exit code 1."""

    def __init__(self, line: str) -> None:
        click.ClickException.__init__(self, f"{line}; nothing ran")


class TrackingStoreUnusable(click.ClickException):
    """The tracking store cannot be used: printed by the Kedro CLI as one ``Error:`` line, exit code 1."""

    def __init__(self, err: tracking.TrackingStoreError) -> None:
        super().__init__(
            f"{err} (nothing ran; set MLFLOW_TRACKING_URI, or server.mlflow_tracking_uri in conf/local/mlflow.yml)"
        )


class TrackingServerAway(click.ClickException):
    """A training stopped because its tracking server was away past ``tracking.outage_s``: one ``Error:`` line."""

    def __init__(self, err: TrackingOutage) -> None:
        super().__init__(str(err))


def _forget_active_runs() -> None:
    """Take this thread's MLflow runs off the fluent API's stack without waiting on a server that is away
    (``end_run`` pops each run, then its one request fails at once); the resume reopens the training's run."""
    import mlflow

    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "2"
    while mlflow.active_run() is not None:
        try:
            mlflow.end_run("FAILED")
        except Exception as err:  # the server is away: the run stays RUNNING there
            log.debug("MLflow run not ended: %s", err)


def tracking_uri(context) -> str | None:
    """The tracking URI kedro-mlflow will use for ``context`` (its ``mlflow.yml``, else MLFLOW_TRACKING_URI, else
    ``mlruns``); None when a run is already active (an orchestrator's: kedro-mlflow then uses its store) or the
    context has no config loader."""
    import mlflow
    from kedro.config import MissingConfigException

    loader = getattr(context, "config_loader", None)
    if loader is None or mlflow.active_run() is not None:
        return None
    if "mlflow" not in loader.config_patterns:  # the patterns kedro-mlflow registers, if it has not yet
        loader.config_patterns.update({"mlflow": ["mlflow*", "mlflow*/**", "**/mlflow*"]})
    try:
        server = (loader["mlflow"] or {}).get("server") or {}
    except MissingConfigException:
        server = {}
    return server.get("mlflow_tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI", "mlruns")


def cross_field_errors(cfg: QerlConfig, nodes: set[str] | None = None) -> list[str]:
    """Lines ``  field: why`` for settings of different sections that do not fit together.

    ``nodes``: the short names of the run's nodes (``train_policy``, ``evaluate_policies``, ``evaluate_export``, and
    ``compare:train_policy`` for a compare branch's training); a check runs only when a node
    that would fail on it is in the run. None: every check.
    """
    from qerl_pipeline.rollout.serving import VLLM_LORA_RANKS

    def runs(name: str) -> bool:
        return nodes is None or name in nodes

    errors = []
    if runs("evaluate_policies") or runs("evaluate_export"):
        sets = [*cfg.data.eval_sources, *cfg.data.eval_files]  # the user's sets are evaluated anyway, listed or not
        unknown = [b for b in cfg.evaluate.benchmarks if b not in sets]
        if unknown:
            errors.append(
                f"  evaluate.benchmarks: {', '.join(map(repr, unknown))} not an evaluation set; allowed: "
                f"{', '.join(sets)} (data.eval_sources, data.eval_files: data_prep writes prompts only for those)"
            )
        budget = cfg.model.max_seq_len - cfg.evaluate.max_new_tokens
        if budget <= 0:
            errors.append(
                f"  evaluate.max_new_tokens: {cfg.evaluate.max_new_tokens} must be below model.max_seq_len "
                f"({cfg.model.max_seq_len}): the prompt budget, max_seq_len - max_new_tokens, is {budget} tokens"
            )
    if runs("compare:train_policy") and (ranks := cfg.train.compare_ranks_error()):
        errors.append(f"  {ranks}")
    if runs("train_policy") or runs("compare:train_policy"):
        if cfg.lora.rank > VLLM_LORA_RANKS[-1]:
            errors.append(f"  lora.rank: {cfg.lora.rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")
        if cfg.rollout.sync == "merge" and cfg.rollout.tensor_parallel_size > 1:
            errors.append(
                f"  rollout.sync: merge needs each engine worker to hold whole linears, but "
                f"rollout.tensor_parallel_size {cfg.rollout.tensor_parallel_size} shards them; use adapter or auto"
            )
    return errors


def engine_runs(cfg: QerlConfig, pipeline) -> list[tuple[list[str], str, bool]]:
    """The engines ``pipeline`` starts, as ``(methods, the field naming them, evaluation only)``: its training
    (``method``), a compare's training branches (those of ``compare.methods`` in the run), and evaluation in runs
    that do not train the same methods."""
    train = evaluate = False
    branches: dict[str, set[str]] = {"train_policy": set(), "evaluate_policies": set()}
    for node in pipeline.nodes:
        short = node.name.rsplit(".", 1)[-1]
        space = (node.namespace or "").split(".")
        if space[0] == "compare" and len(space) > 1 and short in branches:
            branches[short].add(space[1])
        train |= short == "train_policy" and space[0] != "compare"
        evaluate |= short == "evaluate_policies" and space[0] != "compare"
    runs = []
    if train or evaluate:
        runs.append(([cfg.method], "method", not train))
    for short, engine_only in (("train_policy", False), ("evaluate_policies", True)):
        listed = [m for m in cfg.compare.methods if m in branches[short]]
        if engine_only:
            listed = [m for m in listed if m not in branches["train_policy"]]
        if listed:
            runs.append((listed, "compare.methods", engine_only))
    return runs


def planner_refusal(cfg: QerlConfig, pipeline, gpu_gib: float) -> str:
    """The memory planner's one line against this run's settings on a GPU of ``gpu_gib`` GiB ("" when its engines
    start and fit, or the planner cannot plan them: tensor parallelism, a model shape not known offline)."""
    runs = engine_runs(cfg, pipeline)
    if not runs:
        return ""
    if cfg.rollout.tensor_parallel_size > 1:
        log.info(
            "memory planner: not asked (rollout.tensor_parallel_size %d: it plans one GPU)",
            cfg.rollout.tensor_parallel_size,
        )
        return ""
    from qerl_pipeline.planner.guard import refusal  # the planner imports the model's pieces: only when a run starts
    from qerl_pipeline.planner.inputs import resolve_shape

    try:
        shape = resolve_shape(cfg)
    except ValueError as err:
        log.warning("memory planner: not asked (%s)", err)
        return ""
    for methods, field, engine_only in runs:
        line = refusal(cfg, methods, shape, gpu_gib, methods_field=field, engine_only=engine_only)
        if line:
            return line
    log.info(
        "memory planner: %s fit this %.1f GiB GPU at rollout.gpu_memory_utilization %g",
        ", ".join(dict.fromkeys(m for methods, _f, _e in runs for m in methods)),
        gpu_gib,
        cfg.rollout.gpu_memory_utilization,
    )
    return ""


def node_roles(pipeline) -> set[str]:
    """The short names of ``pipeline``'s nodes; a compare branch's also as ``compare:<name>``."""
    out = set()
    for node in pipeline.nodes:
        short = node.name.rsplit(".", 1)[-1]
        out.add(short)
        if (node.namespace or "").split(".")[0] == "compare":
            out.add(f"compare:{short}")
    return out


def gather_unbuilt(pipeline, catalog, cfg: QerlConfig) -> None:
    """Build each config bundle (``*_config``, ``config.gather``) the run reads but does not build (its nodes
    selected without their bundling node: ``--nodes``, ``--from-nodes``) as that node would, from this run's
    parameters, so no node reads a config an earlier run left."""
    from kedro.framework.project import pipelines

    missing = {name for name in pipeline.inputs() if name.endswith("_config")}
    if not missing:  # every whole-pipeline run: its bundling nodes are in it
        return
    for node in {n for registered in pipelines.values() for n in registered.nodes if set(n.outputs) & missing}:
        (name,) = node.outputs
        catalog.save(name, node.run({i: at_path(cfg, i.removeprefix("params:")) for i in node.inputs})[name])


class QerlContext(KedroContext):
    """Kedro's context with its parameters as written (``settings.CONTEXT_CLASS``).

    Kedro 1.7 would build each ``params:`` input whose node argument is a Pydantic model again, section by
    section, with its own error lines, and kedro-mlflow would then log each section's repr as one parameter.
    Here ``ValidateConfigHook`` validates the whole tree once and hands each node its typed sections."""

    @property
    def params(self) -> dict:
        try:
            return self.config_loader["parameters"]
        except MissingConfigException:
            return dict(self._runtime_params or {})


class ValidateConfigHook:
    """Fail a run at its start, before any model loads, when a parameter is wrong.

    The error names each bad field by its dotted path (e.g. ``optim.lr.qerl``) and the
    allowed values. Parameters that are not part of the schema (Kedro's own, or a user's
    extra top-level keys) are rejected too: a misspelt section would otherwise be ignored.
    """

    def __init__(self) -> None:
        self._context = None
        self._config: QerlConfig | None = None

    @hook_impl(tryfirst=True)  # before kedro-mlflow's, which connects to the tracking store
    def after_context_created(self, context) -> None:
        self._context, self._config = context, None
        tracking.bound_http_retries()
        uri = tracking_uri(context)
        if uri is not None:
            try:
                tracking.check_store(uri)
            except tracking.TrackingStoreError as err:
                raise TrackingStoreUnusable(err) from None

    @hook_impl(tryfirst=True)  # before kedro-mlflow's: a bad config starts no MLflow run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        if self._context is None:
            return
        try:
            cfg = validate(dict(self._context.params), QerlConfig)
            errors = cross_field_errors(cfg, node_roles(pipeline))
            if errors:
                raise ConfigError("\n".join(["invalid parameters:", *errors]))
            from qerl_pipeline.models import resolve_dtype  # torch and transformers: only when a run starts
            from qerl_pipeline.quantization.norms import check_noise_precision

            platform = current_platform()
            check_noise_precision(cfg, resolve_dtype(cfg.model, platform))
            problems = column_problems(cfg.data)  # the user's data sets name columns they have
            if problems:
                raise ConfigError("invalid parameters:\n" + "\n".join(f"  {p}" for p in problems))
        except ConfigError as err:
            raise ParameterError(err) from None
        if platform == "cuda" and cfg.planner.check:
            total = gpu_memory_bytes()
            if total is None:
                log.warning("memory planner: not asked (NVML cannot tell this GPU's memory)")
            elif line := planner_refusal(cfg, pipeline, total / 2**30):
                raise PlannerRefusal(line)
        self._config = cfg
        gather_unbuilt(pipeline, catalog, cfg)
        log.info("parameters valid: method=%s model=%s", cfg.method, cfg.model.name)

    @hook_impl
    def before_node_run(self, node, inputs) -> dict | None:
        """Each ``params:`` input as the validated config holds it (a typed section, ``compare.seeds`` a list);
        the catalog keeps the values as written, which kedro-mlflow logs as the run's parameters."""
        if self._config is None:
            return None
        cfg = self._config
        return {name: at_path(cfg, name.removeprefix("params:")) for name in inputs if name.startswith("params:")}


class RunStatusHook:
    """The MLflow run of a ``kedro run`` ends as the run did: FINISHED, FAILED with why, KILLED with the signal.

    See the module docstring. The signal handlers are this run's only: they are put back when
    the pipeline ends (after it, or on its error), and an ignored SIGINT (a background job) stays ignored.
    """

    def __init__(self) -> None:
        self._run_id: str | None = None
        self._open = False
        self._last_node: str | None = None
        self._signal: str | None = None
        self._handlers: dict[int, object] = {}
        self._exit_registered = False

    @hook_impl(trylast=True)  # after kedro-mlflow's, which starts the run
    def before_pipeline_run(self, run_params, pipeline, catalog) -> None:
        import mlflow

        active = mlflow.active_run()
        self._run_id = active.info.run_id if active is not None else None
        if active is not None:  # its experiment's kind: model development (tracking_view.py)
            mark_model_development(active.info.experiment_id)
        self._open, self._last_node, self._signal = True, None, None
        self._catch_signals()
        if not self._exit_registered:  # registered after MLflow's own, so it runs before it
            atexit.register(self._at_exit)
            self._exit_registered = True

    @hook_impl
    def after_node_run(self, node) -> None:
        self._last_node = node.name

    @hook_impl
    def after_pipeline_run(self) -> None:
        self._close()

    @hook_impl(tryfirst=True)  # before kedro-mlflow's, which ends the run FAILED
    def on_pipeline_error(self, error: Exception) -> None:
        if isinstance(error, TrackingOutage):
            self._close()
            _forget_active_runs()
            raise TrackingServerAway(error) from None  # skips kedro-mlflow's hook, which would wait on the server
        self._tag(tracking.end_tags(error))
        self._close()

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            if previous is not signal.SIG_IGN:
                self._handlers[sig] = previous
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._signal is None:
            log.warning("%s received: stopping the run (its MLflow run ends KILLED)", name)
        self._signal = name
        raise tracking.Interrupted(name)

    def _close(self) -> None:
        self._open = False
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}

    def _tag(self, tags: dict[str, str]) -> None:
        if self._run_id is None:
            return
        if self._last_node:
            tags = {**tags, tracking.LAST_NODE_TAG: self._last_node}
        try:
            from mlflow.tracking import MlflowClient

            for key, value in tags.items():
                MlflowClient().set_tag(self._run_id, key, value)
        except Exception as err:  # recording the end must not hide the error
            log.warning("could not tag MLflow run %s: %s", self._run_id, err)

    def _at_exit(self) -> None:
        """The process exits with the pipeline neither finished nor failed: an interrupt (or a SystemExit)."""
        if not self._open or self._run_id is None:
            return
        self._open = False
        exc = tracking.Interrupted(self._signal) if self._signal else SystemExit("the process exited during the run")
        self._tag(tracking.end_tags(exc))
        try:
            import mlflow

            status, ended = tracking.end_status(exc), set()
            # every run on this thread's stack: kedro-mlflow restarts its run before each node (nested: true in
            # mlflow.yml), so it can stand there several times, and MLflow's own exit handler would end the
            # copy left over FINISHED
            while (active := mlflow.active_run()) is not None:
                ended.add(active.info.run_id)
                mlflow.end_run(status)
            if self._run_id not in ended:  # started in another thread
                mlflow.tracking.MlflowClient().set_terminated(self._run_id, status)
        except Exception as err:  # the process is ending anyway
            log.warning("could not end MLflow run %s: %s", self._run_id, err)
