"""`kedro run --pipelines=evaluate` in the smoke env with a real vLLM engine (one run for the module).

The adapter under test has random, large LoRA B matrices, so the trained policy must
generate differently from the base: this is the check that the adapter really reaches
vLLM (the paper's GSM8K script loaded it and never applied it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.project import project_copy, run_kedro, tracking_uri

pytestmark = [pytest.mark.kedro_run, pytest.mark.vllm]


def _random_adapter(model_dir: Path, out: Path) -> Path:
    """A PEFT adapter over the smoke model's shape with B ~ N(0, 0.5): far from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def evaluated(tiny_model_dir, tmp_path_factory):
    """quantize + evaluate in a project copy; the adapter is put where the ``trained_adapters`` dataset
    (conf/smoke/catalog_train.yml) holds the train pipeline's: ``<copy>/data/06_models/smoke/adapters/qerl``."""
    root = project_copy(tmp_path_factory.mktemp("evaluate") / "project", shared=["gsm8k/test.jsonl"])
    _random_adapter(tiny_model_dir, root / "data" / "06_models" / "smoke" / "adapters" / "qerl")
    run_kedro(root, "run", "--pipelines=quantize,evaluate", "--env=smoke", "--params=method=qerl", timeout=900)
    return {"tmp": root, "uri": tracking_uri(root)}


def _run(evaluated):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=evaluated["uri"])
    exp = client.get_experiment_by_name("qerl_pipeline")
    (run,) = client.search_runs([exp.experiment_id])
    # the random adapter has no qerl_adapter.json (seed)
    assert run.data.tags["mlflow.runName"] == "evaluate qerl · random"
    assert run.data.tags["qerl.role"] == "evaluate" and run.data.tags["method"] == "qerl"
    return client, run


def test_accuracy_table_and_metrics_per_benchmark(evaluated):
    client, run = _run(evaluated)
    m = run.data.metrics
    for policy in ("trained", "base"):
        for bench in ("generator", "gsm8k"):  # smoke evaluate.benchmarks
            key = f"eval_metrics.eval/{policy}/{bench}"
            # kedro-mlflow prefixes the dataset name
            names = {k for k in m if k.startswith(key + "/") or k.startswith(f"eval/{policy}/{bench}/")}
            assert names, f"no metrics for {policy}/{bench}: {sorted(m)[:20]}"
            n = next(v for k, v in m.items() if k.endswith(f"eval/{policy}/{bench}/n_problems"))
            assert n == 4  # smoke evaluate.limit
            lo = next(v for k, v in m.items() if k.endswith(f"eval/{policy}/{bench}/pass1_ci_low"))
            p1 = next(v for k, v in m.items() if k.endswith(f"eval/{policy}/{bench}/pass1"))
            hi = next(v for k, v in m.items() if k.endswith(f"eval/{policy}/{bench}/pass1_ci_high"))
            assert 0.0 <= lo <= p1 <= hi <= 1.0 and hi > 0.0
    assert next(v for k, v in m.items() if k.endswith("base/weight_mib")) > 0
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    assert {"eval/eval_records.json", "eval/eval_accuracy.csv"} <= arts


def test_per_problem_records_and_adapter_applied(evaluated):
    client, run = _run(evaluated)
    local = client.download_artifacts(run.info.run_id, "eval/eval_records.json", str(evaluated["tmp"] / "dl"))
    records = json.loads(Path(local).read_text())
    assert {r["policy"] for r in records} == {"trained", "base"}
    by = {(r["policy"], r["source"], r["id"]): r for r in records}
    assert len(by) == len(records) == 2 * 2 * 4  # policies x benchmarks x limit
    for r in records:
        assert r["prompt"].rstrip().endswith("assistant") and r["question"] in r["prompt"]
        assert len(r["completions"]) == len(r["extracted"]) == len(r["correct"]) == 1  # smoke samples_k
        assert isinstance(r["greedy_correct"], bool) and isinstance(r["greedy_completion"], str)
    # the adapter is applied: the trained policy's greedy text differs from the base's
    differ = sum(
        by[("trained", s, i)]["greedy_completion"] != by[("base", s, i)]["greedy_completion"]
        for (p, s, i) in by
        if p == "base"
    )
    assert differ >= 6, f"trained and base greedy completions differ on only {differ} of 8 problems"
    # the accuracy table agrees with the records
    acc = Path(client.download_artifacts(run.info.run_id, "eval/eval_accuracy.csv", str(evaluated["tmp"] / "dl")))
    import pandas as pd

    table = pd.read_csv(acc)
    assert set(zip(table["policy"], table["benchmark"], strict=True)) == {
        (p, b) for p in ("trained", "base") for b in ("generator", "gsm8k")
    }
    for row in table.itertuples():
        mine = [r for r in records if r["policy"] == row.policy and r["source"] == row.benchmark]
        assert row.pass1 == pytest.approx(sum(r["correct"][0] for r in mine) / len(mine))
