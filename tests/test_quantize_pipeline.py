"""quantize pipeline: real Kedro runs (smoke env) for the three methods, MLflow in a temporary SQLite store.

The runs happen in a temporary copy of the project's configuration (conf/, pyproject.toml),
so that they write neither into data/ nor into the project's mlflow.db. One Kedro session
per method, in this process (imports are paid once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_pipeline.datasets.hf_model_folder import HFModelFolderDataset
from qerl_pipeline.quantization import checkpoint, nvfp4
from qerl_pipeline.rollout.serving import served_model
from tests.helpers.files import rewritten, snapshot
from tests.helpers.project import project_copy, run_kedro, tracking_uri

PROJECT = Path(__file__).resolve().parents[1]
METHODS = {"qerl": "nvfp4", "qlora": "nf4", "lora": "bf16"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run ``kedro run --pipeline=quantize --env smoke --params method=<m>`` for each method."""
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    root = project_copy(tmp_path_factory.mktemp("project"))
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    try:
        bootstrap_project(root)
        import mlflow

        for method in METHODS:
            with KedroSession.create(project_path=root, env="smoke", runtime_params={"method": method}) as session:
                session.run(pipeline_names=["quantize"])
            # In one process, kedro-mlflow leaves its run active after a session (a CLI run
            # ends with the process); close it so each method gets its own run.
            while mlflow.active_run():
                mlflow.end_run()
        yield root
    finally:
        mp.undo()


def _latest_json(folder: Path) -> dict:
    versions = sorted(p for p in folder.iterdir() if p.is_dir())
    return json.loads((versions[-1] / folder.name).read_text())


def _mlflow_runs(root: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = client.search_runs([exp.experiment_id])
    return client, {r.data.tags.get("quantize.format"): r for r in runs}


@pytest.mark.kedro_run
def test_bases_written_for_each_method(runs):
    models = runs / "data" / "06_models" / "smoke"
    for method, fmt in METHODS.items():
        base = checkpoint.base_dir_for(models, method)
        assert base == models / f"base_{fmt}"
        assert checkpoint.base_format(base) == fmt
        assert not (base / "serving").exists()  # the dense copy is written by the first engine that serves it
        assert (base / "tokenizer_config.json").is_file()
    # no temporary folders left behind
    assert sorted(p.name for p in models.iterdir()) == ["base_bf16", "base_nf4", "base_nvfp4"]


@pytest.mark.kedro_run
def test_nvfp4_base_reloads_through_compressed_tensors(runs):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    base = runs / "data" / "06_models" / "smoke" / "base_nvfp4"
    cfg = json.loads((base / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized" and "lm_head" in cfg["ignore"]
    ours = checkpoint.read_tensors(base)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=CompressedTensorsConfig(dequantize=True))
    theirs = model.state_dict()
    owners = [k.removesuffix(".weight_packed") for k in ours if k.endswith(".weight_packed")]
    assert len(owners) == 2 * 7
    for owner in owners:
        want = nvfp4.decode(*(ours[f"{owner}.{s}"] for s in nvfp4.CODEC.suffixes), dtype=torch.bfloat16)
        assert torch.equal(theirs[f"{owner}.weight"], want), owner
    # the serving copy (written on first use, as a CPU engine start does) holds the same codes decoded in float32
    served = checkpoint.read_tensors(served_model(base, platform="cpu").path)
    assert "quantization_config" not in json.loads((base / "serving" / "config.json").read_text())
    for owner in owners:
        assert torch.equal(served[f"{owner}.weight"].to(torch.bfloat16), theirs[f"{owner}.weight"])


@pytest.mark.kedro_run
def test_reports_and_mlflow_records(runs):
    summary = _latest_json(runs / "data" / "08_reporting" / "smoke" / "quantize_summary.json")
    assert summary["format"] == "bf16"  # the last run
    client, by_format = _mlflow_runs(runs)
    assert set(by_format) == set(METHODS.values())
    expected_ratio = {"nvfp4": 0.28125, "nf4": 0.28125, "bf16": 1.0}
    for fmt, run in by_format.items():
        m = run.data.metrics
        assert m["quantize.linear_bytes_ratio"] == pytest.approx(expected_ratio[fmt], abs=0.002), fmt
        assert m["quantize.checkpoint_bytes"] > 0 and m["quantize.quantize_seconds"] > 0
        assert m["policy.peak_param_bytes"] >= m["policy.resident_total"] > 0
        history = client.get_metric_history(run.info.run_id, "quantize.layer_rel_error")
        assert len(history) == 2 * 7  # the tied lm_head is not a separate weight
        errors = [h.value for h in history]
        if fmt == "bf16":
            assert max(errors) == 0.0  # the bf16 base is the bf16 master itself
            assert m["policy.peak_dense_transient"] == 0
        else:
            assert 0.05 < min(errors) and max(errors) < 0.15  # 4-bit on Gaussian weights: ~0.09
            assert m["quantize.n_quantized_linears"] == 14
            assert 0 < m["policy.peak_dense_transient"] <= 256 * 128 * 4  # one layer at most
        assert run.data.params["method"] in METHODS


@pytest.mark.kedro_run
def test_second_run_reuses_the_base_untouched(tmp_path):
    """`kedro run --pipelines=quantize` twice on one config: the second keeps every file and says so;
    force rewrites."""
    from mlflow.tracking import MlflowClient

    root = project_copy(tmp_path / "project")
    args = ("run", "--pipelines=quantize", "--env=smoke")
    base = root / "data" / "06_models" / "smoke" / "base_nf4"  # Kedro makes catalog paths absolute
    first = run_kedro(root, *args, "--params=method=qlora")
    assert f"base_nf4 quantized into {base}: no base there yet" in first.stdout, first.stdout[-3000:]
    before = snapshot(base)
    second = run_kedro(root, *args, "--params=method=qlora")
    assert snapshot(base) == before  # inode, mtime_ns and size of every file and folder
    assert f"base_nf4 reused: {base} (fingerprint " in second.stdout, second.stdout[-3000:]
    assert "base_nf4 quantized into" not in second.stdout
    third = run_kedro(root, *args, "--params=method=qlora,quantize.force=true")
    assert f"base_nf4 quantized into {base}: quantize.force=true" in third.stdout, third.stdout[-3000:]
    assert rewritten(before, snapshot(base))
    assert sorted(p.name for p in base.parent.iterdir()) == ["base_nf4"]  # no staging folder left
    client = MlflowClient(tracking_uri=tracking_uri(root))
    exp = client.get_experiment_by_name("qerl_pipeline")
    runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    assert [r.data.tags.get("quantize.reused") for r in runs] == ["false", "true", "false"]
    # the reused run reports the stored numbers: the same as the first run's
    for key in ("quantize.linear_bytes_ratio", "quantize.rel_error_mean", "quantize.checkpoint_bytes"):
        assert runs[1].data.metrics[key] == runs[0].data.metrics[key]


def test_dataset_saves_folders_atomically_and_versioned(tmp_path):
    src = tmp_path / "made"
    src.mkdir()
    (src / "config.json").write_text("{}")
    ds = HFModelFolderDataset(str(tmp_path / "models" / "one"))
    assert not ds.exists()
    ds.save(src)
    assert ds.load() == tmp_path / "models" / "one" and (ds.load() / "config.json").is_file()
    assert not src.exists()  # moved
    # mapping: subfolders, others left alone, an existing one replaced
    a, b = tmp_path / "a", tmp_path / "b"
    for p, text in ((a, "a"), (b, "b")):
        p.mkdir()
        (p / "w.txt").write_text(text)
    store = HFModelFolderDataset(str(tmp_path / "store"), move=False)
    store.save({"base_nf4": a})
    store.save({"base_bf16": b})
    (b / "w.txt").write_text("b2")
    store.save({"base_bf16": b})
    root = store.load()
    assert (root / "base_nf4" / "w.txt").read_text() == "a" and (root / "base_bf16" / "w.txt").read_text() == "b2"
    assert a.exists()  # copied, not moved
    assert sorted(p.name for p in root.iterdir()) == ["base_bf16", "base_nf4"]
    # versioned: each save its own folder, load takes the latest
    from kedro.io.core import Version

    v1 = HFModelFolderDataset(
        str(tmp_path / "ver" / "m"), version=Version(None, "2026-01-01T00.00.00.000Z"), move=False
    )
    v1.save(a)
    v2 = HFModelFolderDataset(
        str(tmp_path / "ver" / "m"), version=Version(None, "2026-01-02T00.00.00.000Z"), move=False
    )
    v2.save(b)
    latest = HFModelFolderDataset(str(tmp_path / "ver" / "m"), version=Version(None, None))
    assert (latest.load() / "w.txt").read_text() == "b2"


def test_dataset_rejects_bad_input(tmp_path):
    from kedro.io.core import DatasetError

    ds = HFModelFolderDataset(str(tmp_path / "x"))
    with pytest.raises(DatasetError, match="not a folder"):
        ds.save(tmp_path / "missing")
    with pytest.raises(DatasetError, match="folder path or a mapping"):
        ds.save(42)
    with pytest.raises(DatasetError, match="one path component"):
        ds.save({"../evil": tmp_path})
    with pytest.raises(DatasetError, match="does not exist"):
        ds.load()


def test_calibrated_options_fail_clearly(tmp_path):
    from qerl_pipeline.pipelines.quantize.nodes import calibration_texts, method_format, quantize_base

    with pytest.raises(ValueError, match="awq or gptq"):
        checkpoint.calibrated_base(None, None, "nvfp4", tmp_path / "o", algorithm="rtn", texts=["x"], ignore=[])
    with pytest.raises(ValueError, match="calibration texts"):
        checkpoint.calibrated_base(None, None, "nvfp4", tmp_path / "o", algorithm="gptq", texts=[], ignore=[])
    with pytest.raises(FileNotFoundError, match="calibration_path"):
        calibration_texts(tmp_path / "none.jsonl", 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q1"}\n{"other": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        calibration_texts(bad, 4)
    assert calibration_texts(bad, 1) == ["q1"]
    with pytest.raises(ValueError, match="method"):
        method_format("dpo")
    from qerl_pipeline.config import ConfigError, ModelConfig, QerlConfig, QuantizeConfig, validate

    with pytest.raises(ConfigError, match="quantize.nvfp4_algorithm"):
        validate({"quantize": {"nvfp4_algorithm": "smoothquant"}}, QerlConfig)
    with pytest.raises(ValueError, match="nf4_double_quant"):
        quantize_base(ModelConfig(source="random"), QuantizeConfig(nf4_double_quant=True), "qlora")
