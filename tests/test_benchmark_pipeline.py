"""benchmark pipeline: one real Kedro run in the smoke env; every figure is produced (never its value).

The run happens in a temporary copy of the project's configuration, so it writes neither
into data/ nor into the project's mlflow.db. It starts real vLLM engines (one per base
format), trains in child processes, and times TRL when the ``bench`` extra is installed
(otherwise the table must say why the peer was skipped).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from qerl_pipeline.config import BenchmarkConfig
from tests.helpers.models import fake_base
from tests.helpers.project import kedro_session, project_copy

PROJECT = Path(__file__).resolve().parents[1]
HAVE_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("project"))
    with kedro_session(root) as session:
        session.run(pipeline_name="benchmark")
        params = session.load_context().params
    (root / "params.json").write_text(json.dumps(params, default=str))
    return root


def _settings(root: Path) -> dict:
    base = yaml.safe_load((root / "conf/base/parameters.yml").read_text())["benchmark"]
    smoke = yaml.safe_load((root / "conf/smoke/parameters.yml").read_text())["benchmark"]
    grpo = {
        **yaml.safe_load((root / "conf/base/parameters.yml").read_text())["grpo"],
        **yaml.safe_load((root / "conf/smoke/parameters.yml").read_text()).get("grpo", {}),
    }
    return {**base, **smoke, "group": grpo["num_generations"]}


def _mlflow_metrics(root: Path) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return runs[0].data.metrics, client.list_artifacts(runs[0].info.run_id, "benchmark")


def _expected_metrics(s: dict) -> list[str]:
    fmt = {"qerl": "nvfp4", "qerl_noaqn": "nvfp4", "qlora": "nf4", "lora": "bf16"}
    batches = sorted(set(s["batch_sizes"]) | {s["train_prompts"] * s["group"]})
    names = ["bench.hardware.cpu.copy_bandwidth", "bench.hardware.cpu.matmul_rate"]
    for f in dict.fromkeys(fmt[m] for m in s["methods"]):
        names.append(f"bench.sync.{f}.adapter_sync_s")
        for b in batches:
            for kind in ("lora", "no_lora"):
                names += [
                    f"bench.rollout.{f}.tokens_per_s_{kind}.batch{b}" + sfx
                    for sfx in ("", ".limit", ".fraction_of_limit")
                ]
    for m in s["methods"]:
        names += [
            f"bench.training.{m}.{k}"
            for k in (
                "step_time_s",
                "tokens_per_s",
                "tokens_per_s.limit",
                "tokens_per_s.fraction_of_limit",
                "peak_memory",
                "param_bytes_packed_base",
                "param_bytes_lora",
                "optimizer_state_bytes",
            )
        ]
        names.append(f"bench.peer.{m}.our_step_time_s")
        if HAVE_TRL:
            names.append(f"bench.peer.{m}.our_over_trl_step_time")
    if HAVE_TRL:
        names += ["bench.peer.trl.step_time_s", "bench.peer.trl.generation_s", "bench.peer.trl.peak_memory"]
    return names


@pytest.mark.kedro_run
@pytest.mark.vllm
def test_every_figure_reaches_mlflow_and_the_table(run):
    s = _settings(run)
    metrics, artifacts = _mlflow_metrics(run)
    missing = [n for n in _expected_metrics(s) if n not in metrics]
    assert not missing, f"not logged: {missing}"
    for name in _expected_metrics(s):
        assert math.isfinite(metrics[name])
    assert {Path(a.path).name for a in artifacts} >= {
        "benchmark.csv",
        "benchmark.md",
        "benchmark.html",
        "benchmark_raw.json",
    }

    report = run / s["report_dir"]
    with (report / "benchmark.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert rows and set(rows[0]) == {
        "section",
        "subject",
        "metric",
        "value",
        "unit",
        "limit",
        "fraction_of_limit",
        "note",
    }
    from qerl_pipeline.benchmarking.table import metric_name

    logged = {metric_name(r) for r in rows if r["value"] != ""}
    assert logged >= {n for n in _expected_metrics(s) if not n.endswith((".limit", ".fraction_of_limit"))}
    sections = {r["section"] for r in rows}
    assert sections == {"hardware", "rollout", "sync", "training", "peer"}
    if not HAVE_TRL:
        skipped = [r for r in rows if r["section"] == "peer" and r["metric"] == "skipped"]
        assert skipped and "trl" in skipped[0]["note"]
    md = (report / "benchmark.md").read_text()
    assert "| section | subject | metric |" in md and "tokens_per_s_lora@batch1" in md
    assert "<table>" in (report / "benchmark.html").read_text()
    # no half-written files left behind by the atomic writes
    assert not [p for p in report.iterdir() if p.name.endswith(".tmp")]

    summary = json.loads((run / "data/08_reporting/smoke/benchmark/summary.json").read_text())
    assert summary["n_metrics"] == len(summary["metrics"]) > 0
    raw = json.loads((report / "benchmark_raw.json").read_text())
    # rollouts decoded exactly the fixed completion length (EOS ignored)
    for r in raw["rollout"]["rows"]:
        assert r["output_tokens"] == r["expected_tokens"] == r["batch_size"] * s["completion_len"]
    for t in raw["training"]:
        assert t["sequences"] == s["train_prompts"] * s["group"]
        assert t["tokens_per_step"] == t["sequences"] * (s["prompt_len"] + s["completion_len"])
        assert t["step_impl"] == "rl.update.policy_update"
    if HAVE_TRL:
        assert raw["trl"]["prompt_len"] == s["prompt_len"]
        assert raw["trl"]["completion_len_mean"] == s["completion_len"]
        assert raw["trl"]["sequences"] == s["train_prompts"] * s["group"]


@pytest.mark.kedro_run
@pytest.mark.vllm
def test_packed_bases_are_smaller_and_bases_are_reused(run):
    raw = json.loads((run / _settings(run)["report_dir"] / "benchmark_raw.json").read_text())
    by = {t["method"]: t for t in raw["training"]}
    # NVFP4 codes + scales: 4.5 bits a weight against 32 (float32 plain base on CPU)
    ratio = by["qerl"]["param_bytes_packed_base"] / by["lora"]["param_bytes_packed_base"]
    assert ratio == pytest.approx(4.5 / 32, rel=0.01)
    assert by["qerl"]["param_bytes_lora"] == by["lora"]["param_bytes_lora"] > 0
    # AdamW: two moments per LoRA weight (plus a scalar step count per tensor)
    assert by["qerl"]["optimizer_state_bytes"] == pytest.approx(2 * by["qerl"]["param_bytes_lora"], rel=0.01)
    bases = run / "data/06_models/smoke/benchmark"
    assert sorted(p.name for p in bases.iterdir()) == ["base_bf16", "base_nvfp4"]
    # the bases are the store's (quantization.store): stamped, and reused by a second prepare
    # with the same settings (no file rewritten)
    from qerl_pipeline.benchmarking.bases import prepare_bases
    from qerl_pipeline.config import BenchmarkConfig, ModelConfig, QuantizeConfig
    from qerl_pipeline.quantization.store import stored_fingerprint

    for fmt in ("bf16", "nvfp4"):
        assert stored_fingerprint(bases / f"base_{fmt}")["format"] == fmt
    before = {p: p.stat().st_mtime_ns for p in bases.rglob("*") if p.is_file()}
    params = json.loads((run / "params.json").read_text())
    bcfg = BenchmarkConfig.model_validate({**params["benchmark"], "bases_dir": str(bases)})
    again = prepare_bases(
        ModelConfig.model_validate(params["model"]), QuantizeConfig.model_validate(params["quantize"]), bcfg
    )
    assert again == {"nvfp4": str(bases / "base_nvfp4"), "bf16": str(bases / "base_bf16")}
    assert {p: p.stat().st_mtime_ns for p in bases.rglob("*") if p.is_file()} == before


@pytest.mark.kedro_run
@pytest.mark.vllm
def test_rollout_engines_honour_model_dtype(run):
    """benchmark_rollout gets params:model: each engine ran at engine_dtype(model), its norms as model.norm_dtype."""
    from qerl_pipeline.config import ModelConfig
    from qerl_pipeline.rollout.serving import engine_dtype

    raw = json.loads((run / _settings(run)["report_dir"] / "benchmark_raw.json").read_text())
    params = json.loads((run / "params.json").read_text())
    want = engine_dtype(ModelConfig.model_validate(params["model"]))
    assert raw["rollout"]["served"] and all(s["dtype"] == want for s in raw["rollout"]["served"].values())
    assert all(r["served_dtype"] == want for r in raw["rollout"]["rows"])


def test_build_table_ratios_and_limits_on_fixed_numbers(tmp_path):
    """Results without ``used``/``reward``/engine memory (older ones): our step = rollout of the training batch +
    the configured sync (the recommended one under auto) + the training step; ratios against TRL."""
    from qerl_pipeline.benchmarking.table import metric_name
    from qerl_pipeline.pipelines.benchmark.nodes import build_table

    fake_base(tmp_path / "base_nvfp4", 1)
    hw = {
        "device": "cpu",
        "cpu": "x",
        "cpu_cores": 2,
        "bandwidth_gbs": 10.0,
        "matmul_flops": 1e12,
        "matmul_dtype": "float32",
    }
    rollout = {
        "train_batch": 4,
        "rows": [
            {
                "format": "nvfp4",
                "batch_size": 4,
                "lora": True,
                "tokens_per_s": 100.0,
                "seconds": 2.0,
                "is_train_batch": True,
            },
            {
                "format": "nvfp4",
                "batch_size": 4,
                "lora": False,
                "tokens_per_s": 300.0,
                "seconds": 0.5,
                "is_train_batch": True,
            },
        ],
        "sync": {
            "nvfp4": {"configured": "adapter", "recommended": "merge", "adapter_sync_s": 0.5, "merge_sync_s": 0.25}
        },
    }
    training = [
        {
            "method": "qerl",
            "format": "nvfp4",
            "step_time_s": 1.5,
            "tokens_per_s": 40.0,
            "tokens_per_step": 60,
            "flops_per_step": 6e12,
            "sequences": 4,
            "step_impl": "x",
            "peak_memory_bytes": 2**30,
            "param_bytes_packed_base": 2**20,
            "param_bytes_lora": 2**20,
            "param_bytes_other": 0,
            "optimizer_state_bytes": 2**21,
        }
    ]
    trl = {
        "skipped": False,
        "trl_version": "1.16.0",
        "generation": "transformers",
        "step_time_s": 8.0,
        "generation_s": 5.0,
        "update_s": 3.0,
        "peak_memory_bytes": 2**31,
    }
    table = build_table(
        hw,
        {"nvfp4": str(tmp_path / "base_nvfp4")},
        rollout,
        training,
        trl,
        BenchmarkConfig(methods=["qerl"], prompt_len=8, completion_len=4),
    )
    got = {metric_name(r): r for r in table["rows"]}
    assert got["bench.peer.qerl.our_step_time_s"]["value"] == pytest.approx(2.0 + 0.5 + 1.5)
    assert got["bench.peer.qerl.our_over_trl_step_time"]["value"] == pytest.approx(4.0 / 8.0)
    # generation: our rollout + sync against TRL's generate call (which includes TRL's weight sync)
    assert got["bench.peer.qerl.our_over_trl_generation"]["value"] == pytest.approx((2.0 + 0.5) / 5.0)
    assert got["bench.peer.qerl.our_over_trl_update"]["value"] == pytest.approx(1.5 / 3.0)
    # no engine memory in these (older) results: the trainer alone, and the note says so
    assert got["bench.peer.qerl.our_over_trl_peak_memory"]["value"] == pytest.approx(0.5)
    assert "TRAINER ONLY" in got["bench.peer.qerl.our_over_trl_peak_memory"]["note"]
    # training: 6e12 FLOPs at 1e12 FLOP/s = 6 s at best for 60 tokens -> 10 tokens/s limit
    tps = got["bench.training.qerl.tokens_per_s"]
    assert tps["limit"] == pytest.approx(10.0) and tps["fraction_of_limit"] == pytest.approx(4.0)
    # rollout: served dense bytes = (10*16 + 16*16) * 4; batch 4 at 10 GB/s (compute bound far above)
    served = (160 + 256) * 4
    roll = got["bench.rollout.nvfp4.tokens_per_s_lora.batch4"]
    assert roll["limit"] == pytest.approx(4 * 10e9 / served)
    assert roll["fraction_of_limit"] == pytest.approx(100.0 / roll["limit"])
    assert got["bench.rollout.nvfp4.weight_bytes_in_format"]["value"] == 160 * 4 + 256
    # older results with sync "auto": the recommended path (merge: no-LoRA rollout + merge sync)
    rollout["sync"]["nvfp4"]["configured"] = "auto"
    table = build_table(
        hw,
        {"nvfp4": str(tmp_path / "base_nvfp4")},
        rollout,
        training,
        trl,
        BenchmarkConfig(methods=["qerl"], prompt_len=8, completion_len=4),
    )
    got = {metric_name(r): r for r in table["rows"]}
    assert got["bench.peer.qerl.our_step_time_s"]["value"] == pytest.approx(0.5 + 0.25 + 1.5)
    # a skipped peer leaves our step time and a row that says why
    table = build_table(
        hw,
        {"nvfp4": str(tmp_path / "base_nvfp4")},
        rollout,
        training,
        {"skipped": True, "reason": "trl is not installed"},
        BenchmarkConfig(methods=["qerl"]),
    )
    rows = {metric_name(r): r for r in table["rows"]}
    assert "bench.peer.qerl.our_over_trl_step_time" not in rows
    assert rows["bench.peer.trl.skipped"]["note"] == "trl is not installed"


def test_rollout_node_is_wired_with_the_model_section():
    """model.dtype / model.norm_dtype reach the rollout engines: the measuring nodes' config gathers params:model."""
    from qerl_pipeline.pipelines.benchmark import create_pipeline

    nodes = {n.name: n for n in create_pipeline().nodes}
    assert "params:model" in nodes["benchmark_config"].inputs
    for name in ("benchmark_rollout", "benchmark_training", "benchmark_trl"):
        assert nodes[name].inputs == ["benchmark_bases", "benchmark_config"], name


class _DenseOnlyEngine:
    """Stands in for an engine serving a quantized base (packed NVFP4 / bnb NF4 exist on CUDA
    only): adapter loads work, any merge or dense read/write fails the test."""

    model_dir = Path("base_nvfp4")

    def __init__(self):
        self.calls: list[str] = []

    def generate(self, prompts, **kw):
        self.calls.append("generate")

    def merge_adapter(self, lora_path):
        raise AssertionError("merge attempted on a quantized served base (merge_adapter)")

    def unmerge(self):
        raise AssertionError("merge attempted on a quantized served base (unmerge)")

    def read_weights(self, names):
        raise AssertionError("merge attempted on a quantized served base (read_weights)")

    def load_dense_weights(self, tensors):
        raise AssertionError("merge attempted on a quantized served base (load_dense_weights)")

    update_weights = load_dense_weights


def test_measure_sync_tries_no_merge_on_a_quantized_served_base(tmp_path):
    from qerl_pipeline.benchmarking.rollout import measure_sync, recommend_sync

    engine = _DenseOnlyEngine()
    report = measure_sync(engine, [tmp_path / "step-1", tmp_path / "step-2"], dense=False)
    assert report["merge_supported"] is False and report["merge_sync_s"] is None
    assert "quantized" in report["merge_error"]
    assert report["adapter_supported"] is True and engine.calls == ["generate"] * 4
    assert recommend_sync(report, 100.0, 300.0, 40)["sync"] == "adapter"
