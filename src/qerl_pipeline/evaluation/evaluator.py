"""Benchmark evaluation of a policy: base weights served by vLLM, optionally with a LoRA adapter.

One vLLM engine (``rollout.engine.RolloutEngine``, its own process) serves one base; every
policy on that base is evaluated on it in turn: the trained adapter, other adapters over
the same base (compare), and the base alone. The adapter is really applied: it goes to
vLLM as ``lora_path`` (a ``LoRARequest``) on every generate call. (The paper's GSM8K
script loaded the adapter but never passed it to generation, so it scored the base.)

Decoding (paper, Sec. 5 / App. C): ``temperature 0.6, top_p 0.95``, ``k`` samples per
problem (pass@1 averaged over k), plus greedy decoding (temperature 0) when
``evaluate.greedy``. Every request carries the same sampling seed (``evaluate.seed``), so
results do not depend on how prompts are batched.

How the adapter reaches vLLM (``evaluate.adapter_mode``):

* ``lora``: as a ``LoRARequest`` on every generate call (vLLM's LoRA kernels).
* ``merged``: ``W + scale * B @ A`` is written into the served dense weights for the
  policy's turn by the engine process (``RolloutEngine.merge_adapter``, the training's
  ``rollout.sync: merge`` path) and the checkpoint's clean linears are served again after it
  (``unmerge``; bit-exact). Same function, other float rounding.
  Only possible where the served linears are dense (``rollout.serving.ServedModel.dense``):
  on CPU every base is served dense and vLLM-CPU's LoRA path is slower than the plain one
  (docs/performance.md), so evaluation there is faster merged; on CUDA the
  NVFP4 base (and the NF4 base as bitsandbytes) is served packed and cannot take dense
  weights: ``merged`` is refused there with an error.
* ``auto`` (default): ``merged`` where the served base is dense, else ``lora``
  (``rollout.serving``'s table: merged on CPU and for the bf16 base, lora for packed bases).

Trainable norms (``lora.train_norms``; ``norms.safetensors`` in the adapter folder, which
a ``LoRARequest`` would ignore) are written into the served norms in both modes and
restored after the policy's turn.

Scoring: ``rewards.scorer.RewardScorer``: the full math-verify comparison of the extracted
answer with the gold (never a first-character compare, the paper script's other defect).
A sample is correct when its accuracy reward is 1.

Subsets: ``limit`` keeps a deterministic subset per benchmark: the ``limit`` problems with
the smallest SHA-1 of their id, in their original order. It does not depend on file order
and spreads over the set (a prefix of MATH-500 would be one subject).

Prompts longer than ``max_model_len - max_new_tokens`` cannot be served; they are skipped
with a warning and listed in ``EvalResult.skipped`` (never silently truncated, which
would change the question).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_pipeline.config import EvaluateConfig, RewardConfig, RolloutConfig
from qerl_pipeline.tracking_view import EVALUATION, dataset_input

log = logging.getLogger(__name__)

ADAPTER_MODES = ("auto", "lora", "merged")

#: Prompts per generate call (progress granularity; vLLM batches inside a call anyway).
CHUNK = 64


@dataclass
class EvalResult:
    """Per-problem records of every policy, plus what was skipped and how fast it ran."""

    records: list[dict[str, Any]]
    skipped: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: MLflow tags of the engine that served (``rollout.serving.served_tags``).
    tags: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-ready data (the ``eval_result`` dataset, ``eval/result.json`` of a run)."""
        return {"records": self.records, "skipped": self.skipped, "timings": self.timings, "tags": self.tags}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        """The result ``as_dict`` wrote."""
        return cls(
            records=data["records"],
            skipped=data.get("skipped", []),
            timings=data.get("timings", {}),
            tags=data.get("tags", {}),
        )


def subset(records: Sequence[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The ``limit`` records with the smallest SHA-1 of their id, in their original order."""
    records = list(records)
    if limit is None or limit >= len(records):
        return records
    keyed = sorted(range(len(records)), key=lambda i: hashlib.sha1(str(records[i]["id"]).encode()).hexdigest())
    keep = set(keyed[:limit])
    return [r for i, r in enumerate(records) if i in keep]


def group_by_source(
    records: Sequence[dict[str, Any]], benchmarks: Sequence[str] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Records by ``source``, in ``benchmarks`` order (all sources when None)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for i, r in enumerate(records):
        for key in ("id", "source", "messages", "gold"):
            if key not in r:
                raise ValueError(f"prompt record {i} (id={r.get('id')!r}) has no {key!r} field")
        groups.setdefault(r["source"], []).append(r)
    if benchmarks is None:
        return groups
    return {b: groups[b] for b in benchmarks if b in groups}


def chat_prompts(records: Sequence[dict[str, Any]], tokenizer) -> tuple[list[str], list[list[int]]]:
    """Chat-template text and token ids of each record's ``messages`` (generation prompt added)."""
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in records]
    ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return texts, ids


def adapter_rank(adapter_dir: str | Path) -> int:
    """LoRA rank ``r`` from a PEFT adapter folder's ``adapter_config.json``."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter folder)")
    cfg = json.loads(path.read_text())
    ranks = [int(cfg["r"]), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())]
    return max(ranks)


def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]eval[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=False,
    )


def _generate_chunks(engine, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed, lora_path, progress, task):
    samples, seconds, tokens = [], 0.0, 0
    for start in range(0, len(prompt_ids), CHUNK):
        chunk = prompt_ids[start : start + CHUNK]
        out = engine.generate(
            chunk,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            lora_path=lora_path,
        )
        samples.extend(out.samples)
        seconds += out.seconds
        tokens += out.output_tokens
        progress.advance(task, len(chunk))
    return samples, seconds, tokens


def resolve_adapter_mode(mode: str, served=None, tensor_parallel_size: int = 1) -> str:
    """``auto`` -> ``merged`` where the served linears are dense, else ``lora``; else ``mode`` itself.

    ``tensor_parallel_size > 1``: the engine's linears are sharded over its workers and cannot
    take a merge (rollout/worker_ext.py), so ``auto`` is ``lora`` and ``merged`` is refused.

    ``served``: the engine's ``rollout.serving.ServedModel``. Without it (served base
    unknown) the platform decides: ``merged`` on CPU, where every base is served dense,
    ``lora`` on CUDA, where it may be packed. ``merged`` on a served base that is not dense
    (NVFP4, or NF4 as bitsandbytes, on CUDA) raises ``ValueError``.
    """
    if mode not in ADAPTER_MODES:
        raise ValueError(f"evaluate.adapter_mode {mode!r} unknown; allowed: {', '.join(ADAPTER_MODES)}")
    if tensor_parallel_size > 1:
        if mode == "merged":
            raise ValueError(
                f"evaluate.adapter_mode merged: the engine spans {tensor_parallel_size} GPUs "
                "(rollout.tensor_parallel_size), whose workers each hold a shard of the linears and cannot take a "
                "merge; use adapter_mode lora or auto"
            )
        return "lora"
    if served is None:
        import torch

        dense = not torch.cuda.is_available()
    else:
        dense = served.dense
    if mode == "merged" and served is not None and not dense:
        raise ValueError(
            f"evaluate.adapter_mode merged: the engine serves {served.path} as {served.served_format!r} (packed "
            f"weights), which cannot take merged dense weights; use adapter_mode lora or auto"
        )
    if mode != "auto":
        return mode
    return "merged" if dense else "lora"


@contextmanager
def applied_adapter(engine, adapter_dir: str | Path | None, mode: str) -> Iterator[str | Path | None]:
    """Within the block the engine serves ``adapter_dir``; yields the ``lora_path`` to generate with.

    ``merged``: dense ``W + scale * B @ A`` written into the served weights by the engine
    (yields None), the clean linears served again on exit; ``lora``: yields ``adapter_dir``.
    Trained norms (``norms.safetensors``) are written in both modes, read first and written
    back on exit.
    """
    if adapter_dir is None:
        yield None
        return
    from safetensors.torch import load_file

    from qerl_pipeline.adapter import NORMS_FILE

    adapter_dir = Path(adapter_dir)
    norms_file = adapter_dir / NORMS_FILE
    updates = load_file(str(norms_file)) if norms_file.exists() else {}
    clean = engine.read_weights(sorted(updates)) if updates else {}
    merged = False
    try:
        if updates:
            engine.update_weights(updates)
        if mode == "merged":
            engine.merge_adapter(adapter_dir)
            merged = True
        yield None if mode == "merged" else adapter_dir
    finally:
        if merged:
            engine.unmerge()
        if clean:
            engine.update_weights(clean)


def evaluate_on_engine(
    engine,
    tokenizer,
    records: Sequence[dict[str, Any]],
    cfg: EvaluateConfig,
    scorer,
    *,
    policy: str,
    lora_path: str | Path | None = None,
    max_model_len: int,
    show_progress: bool = True,
    served=None,
) -> EvalResult:
    """Evaluate one policy (the engine's base, plus ``lora_path`` when given) on ``records``.

    The adapter is applied as ``cfg.adapter_mode`` says (``applied_adapter``;
    ``resolve_adapter_mode`` with ``served``, the engine's ``ServedModel``) for the whole
    call and removed after it.

    ``records`` are prompt records (any mix of sources); ``cfg.limit`` is applied per
    source here. Returns one record per problem with ``policy, id, source, split, level,
    question, gold, prompt, completions, extracted, correct, finish_reasons,
    completion_tokens`` and, with ``cfg.greedy``, ``greedy_completion, greedy_extracted,
    greedy_correct, greedy_finish_reason``.
    """
    groups = {b: subset(rs, cfg.limit) for b, rs in group_by_source(records, cfg.benchmarks).items()}
    missing = [b for b in cfg.benchmarks if b not in groups]
    if missing:
        log.warning("evaluate: no prompt records for benchmark(s) %s (skipped)", ", ".join(missing))
    result = EvalResult(records=[])
    gen_s = gen_tokens = 0.0
    t_apply = time.perf_counter()
    mode = resolve_adapter_mode(cfg.adapter_mode, served, getattr(engine, "tensor_parallel_size", 1))
    with applied_adapter(engine, lora_path, mode) as lora_path, _progress(show_progress) as progress:
        apply_s = time.perf_counter() - t_apply
        for bench, recs in groups.items():
            texts, ids = chat_prompts(recs, tokenizer)
            keep = []
            for r, t, p in zip(recs, texts, ids, strict=True):
                if len(p) + cfg.max_new_tokens > max_model_len:
                    result.skipped.append({"policy": policy, "id": r["id"], "source": bench, "prompt_tokens": len(p)})
                else:
                    keep.append((r, t, p))
            if len(keep) < len(recs):
                log.warning(
                    "evaluate %s/%s: %d prompt(s) longer than max_model_len - max_new_tokens skipped",
                    policy,
                    bench,
                    len(recs) - len(keep),
                )
            if not keep:
                continue
            prompt_ids = [p for _, _, p in keep]
            runs = [("sampled", cfg.samples_k, cfg.temperature, cfg.top_p, cfg.seed)]
            if cfg.greedy:
                runs.append(("greedy", 1, 0.0, 1.0, None))
            outputs = {}
            for kind, n, temp, top_p, seed in runs:
                task = progress.add_task(f"{policy} {bench} {kind}", total=len(prompt_ids))
                samples, secs, toks = _generate_chunks(
                    engine,
                    prompt_ids,
                    n=n,
                    temperature=temp,
                    top_p=top_p,
                    max_new_tokens=cfg.max_new_tokens,
                    seed=seed,
                    lora_path=lora_path,
                    progress=progress,
                    task=task,
                )
                outputs[kind] = samples
                gen_s += secs
                gen_tokens += toks
            for kind, groups_ in outputs.items():
                flat = [s.text for g in groups_ for s in g]
                golds = [r["gold"] for (r, _, _), g in zip(keep, groups_, strict=True) for _ in g]
                scores = scorer.score(flat, golds)
                it = iter(scores)
                outputs[kind] = [[(s, next(it)) for s in g] for g in groups_]
            for i, (r, text, _) in enumerate(keep):
                sampled = outputs["sampled"][i]
                row = {
                    "policy": policy,
                    "id": r["id"],
                    "source": bench,
                    "split": r.get("split"),
                    "level": r.get("level"),
                    "question": r.get("question"),
                    "gold": r["gold"],
                    "prompt": text,
                    "completions": [s.text for s, _ in sampled],
                    "extracted": [sc["extracted"] for _, sc in sampled],
                    "correct": [sc["accuracy"] >= 0.5 for _, sc in sampled],
                    "finish_reasons": [s.finish_reason for s, _ in sampled],
                    "completion_tokens": [len(s.completion_ids) for s, _ in sampled],
                }
                if "greedy" in outputs:
                    g, gs = outputs["greedy"][i][0]
                    row.update(
                        greedy_completion=g.text,
                        greedy_extracted=gs["extracted"],
                        greedy_correct=gs["accuracy"] >= 0.5,
                        greedy_finish_reason=g.finish_reason,
                    )
                result.records.append(row)
    result.timings = {
        "generate_s": gen_s,
        "output_tokens": gen_tokens,
        "tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
        "adapter_apply_s": apply_s,
    }
    return result


def evaluate_policies(
    model,
    records: Sequence[dict[str, Any]],
    cfg: EvaluateConfig,
    reward_cfg: RewardConfig,
    policies: dict[str, str | Path | None],
    *,
    model_cfg: Any,
    rollout_cfg: RolloutConfig | None = None,
    tokenizer=None,
    show_progress: bool = True,
    engine=None,
) -> EvalResult:
    """Start one engine and evaluate each policy (name -> adapter folder or None) on it.

    ``model``: the ``rollout.serving.ServedModel`` to serve, or a base folder (then
    ``served_model(model)`` decides what is served). ``model_cfg`` (``ModelConfig``): the
    engine's compute dtype, norm dtype (fp32 RMSNorm weights, so trained norms written for a
    policy's turn are served as trained, also in a bf16 engine) and ``max_seq_len``; the
    engine is built by ``serving.open_engine``. The result's ``tags`` are the engine's
    ``rollout.served_format`` / ``rollout.served_dtype``.

    LoRA is enabled in the engine only when some policy has an adapter and the adapter
    mode is ``lora``, with ``max_lora_rank`` the smallest vLLM rank that fits the largest adapter.

    ``engine``: an engine already serving ``model`` (compare's shared one, ``rollout/pool.py``);
    it is used as it is and left open.
    """
    from transformers import AutoTokenizer

    from qerl_pipeline.config import ModelConfig, parse
    from qerl_pipeline.rewards.scorer import RewardScorer
    from qerl_pipeline.rollout.serving import ServedModel, open_engine, served_model, served_tags

    mc = model_cfg if isinstance(model_cfg, ModelConfig) else parse(ModelConfig, dict(model_cfg or {}), "model")
    max_model_len = mc.max_seq_len
    served = model if isinstance(model, ServedModel) else served_model(Path(model))
    adapters = {name: Path(p) for name, p in policies.items() if p is not None}
    for name, path in adapters.items():
        if not path.is_dir():
            raise FileNotFoundError(f"policy {name!r}: adapter folder {path} does not exist")
    tp = int(getattr(engine, "tensor_parallel_size", None) or getattr(rollout_cfg, "tensor_parallel_size", 1) or 1)
    lora_needed = bool(adapters) and resolve_adapter_mode(cfg.adapter_mode, served, tp) == "lora"
    rank = max(adapter_rank(p) for p in adapters.values()) if lora_needed else None
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(served.path)
    total = EvalResult(records=[])
    t0 = time.perf_counter()
    started = engine is None and open_engine(served, mc, rollout=rollout_cfg, lora_rank=rank, seed=cfg.seed)
    with started or nullcontext(engine) as engine, RewardScorer(reward_cfg) as scorer:
        # 0: a shared engine, started before
        total.timings["engine_start_s"] = engine.start_seconds if started else 0.0
        total.tags = served_tags(served, engine)
        log.info(
            "evaluate: serving %s as %s (%s)", served.path, served.served_format, total.tags["rollout.served_dtype"]
        )
        for name, path in policies.items():
            res = evaluate_on_engine(
                engine,
                tokenizer,
                records,
                cfg,
                scorer,
                policy=name,
                lora_path=path,
                max_model_len=max_model_len,
                show_progress=show_progress,
                served=served,
            )
            total.records += res.records
            total.skipped += res.skipped
            for key, value in res.timings.items():
                total.timings[f"{name}/{key}"] = value
    total.timings["total_s"] = time.perf_counter() - t0
    return total


def evaluation_metrics(result: EvalResult, rows: list[dict[str, Any]]) -> dict[str, float]:
    """The MLflow metrics of one evaluation: ``eval/<policy>/<benchmark>/<name>`` (``metrics.metric_dict``),
    ``eval/<timing>``, ``base/weight_mib`` and ``eval/skipped_prompts``: the same names in a
    separate evaluation run and in a compare branch's run, so the report reads both."""
    from qerl_pipeline.evaluation.metrics import metric_dict

    out = metric_dict(rows)
    for key, value in result.timings.items():
        out[key if key.startswith("base/") else f"eval/{key}"] = float(value)
    out["eval/skipped_prompts"] = float(len(result.skipped))
    return out


def log_evaluation(logger, result: EvalResult, rows: list[dict[str, Any]], key: str | None = None) -> None:
    """Log one evaluation into a run (compare branches: the training run): metrics, tags, the
    ``eval/accuracy.json`` and ``eval/records.json`` tables and, with ``key``
    (``evaluation_key``), the whole result (``eval/result.json``) for ``logged_evaluation``."""
    logger.set_tags(result.tags)
    logger.log_metrics(evaluation_metrics(result, rows), step=0)
    logger.log_table(rows, "eval/accuracy.json")
    logger.log_table(result.records, "eval/records.json")
    if key is not None:
        logger.log_text(json.dumps(result.as_dict(), default=str), RESULT_ARTIFACT)
        logger.set_tags({EVALUATED_TAG: key})


def log_benchmark_inputs(logger, records: Sequence[dict[str, Any]], cfg: EvaluateConfig) -> None:
    """Each benchmark's evaluated prompts (``cfg.limit`` applied as ``evaluate_policies`` applies it) as a dataset
    input of the run (``tracking_view``: MLflow's Dataset column; the same prompts, one dataset)."""
    for rows in group_by_source(records, cfg.benchmarks).values():
        if rows:
            logger.log_input(dataset_input(subset(rows, cfg.limit), "eval_prompts"), EVALUATION)


#: Tag of a run whose evaluation was logged by ``log_evaluation(..., key=...)``: what was evaluated.
EVALUATED_TAG = "qerl.evaluation_key"
RESULT_ARTIFACT = "eval/result.json"


def evaluation_key(
    adapter_dir: str | Path | None, cfg: EvaluateConfig, records: Sequence[dict[str, Any]], served=None
) -> str:
    """A digest of what an evaluation depends on: the adapter's files, the evaluate settings, the
    prompt records and what is served. Equal keys: the logged evaluation stands for this one."""
    h = hashlib.sha256()
    if adapter_dir is not None:
        for f in sorted(Path(adapter_dir).iterdir()):
            if f.is_file() and f.suffix in (".safetensors", ".json") and f.name != "qerl_adapter.json":
                h.update(f.name.encode())
                h.update(f.read_bytes())
    h.update(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode())
    h.update(json.dumps([[r.get("id"), r.get("source"), r.get("gold")] for r in records], default=str).encode())
    if served is not None:
        h.update(f"{served.served_format}|{Path(served.path).name}".encode())
    return h.hexdigest()[:20]


def logged_evaluation(run_id: str, key: str) -> EvalResult | None:
    """The evaluation logged into ``run_id`` under ``key`` (``log_evaluation``), or None."""
    import tempfile

    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    if client.get_run(run_id).data.tags.get(EVALUATED_TAG) != key:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, RESULT_ARTIFACT, tmp)
        except Exception:  # no stored result: evaluate again
            return None
        return EvalResult.from_dict(json.loads(Path(path).read_text()))
