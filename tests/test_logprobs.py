"""Chunked log-probs (``rl/logprobs.py``): values, gradients and memory against the naive reference."""

from __future__ import annotations

import pytest
import torch

from qerl_pipeline.rl.logprobs import DEFAULT_KEEP_BYTES, token_logprobs

N, T, H, V = 3, 7, 32, 1000
TEMP = 0.7

# Tolerances. fp32 has a spacing of 1e-6..2e-6 at |logp| = 8..16 (these logits reach
# |logp| = 17), and the naive fp32 reference is itself ~1e-6 from the fp64 truth, so an
# absolute 1e-6 bar alone would demand bit-equality with one particular reduction order.
# Values: |ours - naive| <= 1e-6 + 1e-6 |naive| elementwise. Gradients (1000-term sums):
# relative (Frobenius) error <= 1e-6 against the naive fp32 gradient and against fp64.
ATOL = RTOL = 1e-6
GRAD_REL = 1e-6


def naive(hidden, weight, targets, bias=None, temperature=TEMP):
    """What ``completion_logprobs`` does today: full [..., V] logits, log_softmax, gather."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make(seed=0, dtype=torch.float32, n=N, t=T, h=H, v=V, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if bias else None
    targets = torch.randint(0, v, (n, t), generator=g)
    return hidden, weight, b, targets


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("chunk", [1, 4, 5, 21, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_match_naive(chunk, with_bias):
    hidden, weight, bias, targets = make(bias=with_bias)
    ref_lp, ref_ent = naive(hidden, weight, targets, bias)
    lp, ent = token_logprobs(hidden, weight, targets, bias=bias, temperature=TEMP, chunk_tokens=chunk)
    assert lp.shape == targets.shape and ent.shape == targets.shape
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=RTOL)


def test_temperature_one_and_any_leading_shape():
    hidden, weight, _, targets = make()
    ref_lp, ref_ent = naive(hidden, weight, targets, temperature=1.0)
    lp, ent = token_logprobs(hidden.reshape(N * T, H), weight, targets.reshape(-1), chunk_tokens=8)
    torch.testing.assert_close(lp, ref_lp.reshape(-1), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ent, ref_ent.reshape(-1), atol=ATOL, rtol=RTOL)
    lp4, _ = token_logprobs(hidden.reshape(1, N, T, H), weight, targets.reshape(1, N, T), chunk_tokens=8)
    assert lp4.shape == (1, N, T)
    torch.testing.assert_close(lp4.reshape(N, T), ref_lp, atol=ATOL, rtol=RTOL)


def test_entropy_is_detached_and_logp_differentiable():
    hidden, weight, _, targets = make()
    hidden.requires_grad_(True)
    lp, ent = token_logprobs(hidden, weight, targets, temperature=TEMP)
    assert lp.requires_grad and not ent.requires_grad
    with torch.no_grad():
        lp2, _ = token_logprobs(hidden, weight, targets, temperature=TEMP)
    assert not lp2.requires_grad
    torch.testing.assert_close(lp2, lp.detach(), atol=0, rtol=0)


def test_bad_inputs_raise():
    hidden, weight, _, targets = make()
    with pytest.raises(IndexError, match="targets must lie"):
        token_logprobs(hidden, weight, targets + V)
    with pytest.raises(ValueError, match="leading shapes"):
        token_logprobs(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(hidden, weight, targets.float())


# --------------------------------------------------------------- gradients
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b`` (computed in fp64)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def _upstream(kind: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "ones":
        return torch.ones(shape)
    up = torch.randn(shape, generator=g)
    if kind == "masked":  # padding positions: zero upstream grad (incl. one whole row)
        mask = torch.rand(shape, generator=g) > 0.4
        mask[1] = False
        up = up * mask
    return up


def _keep(keep: str, chunk: int, vocab: int) -> int:
    """keep_bytes: none (always recompute), one chunk's softmax (the rest recomputed), all of them."""
    return {"none": 0, "one": chunk * vocab * 4, "all": DEFAULT_KEEP_BYTES}[keep]


@pytest.mark.parametrize("keep", ["none", "one", "all"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("kind", ["ones", "random", "masked"])
def test_grad_hidden_matches_naive(chunk, kind, keep):
    hidden, weight, _, targets = make(seed=1)
    up = _upstream(kind, targets.shape)
    h_ref = hidden.clone().requires_grad_(True)
    (naive(h_ref, weight, targets)[0] * up).sum().backward()
    h = hidden.clone().requires_grad_(True)
    (
        token_logprobs(
            h, weight, targets, temperature=TEMP, chunk_tokens=chunk, keep_bytes=_keep(keep, chunk, weight.shape[0])
        )[0]
        * up
    ).sum().backward()
    assert h.grad.dtype == torch.float32
    h64 = hidden.double().requires_grad_(True)
    (naive(h64, weight.double(), targets)[0] * up.double()).sum().backward()
    assert _rel(h.grad, h_ref.grad) <= GRAD_REL
    assert _rel(h.grad, h64.grad) <= GRAD_REL
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)
    if kind == "masked":
        assert torch.all(h.grad[1] == 0)


@pytest.mark.parametrize("keep", ["none", "one", "all"])
@pytest.mark.parametrize("kind", ["random", "masked"])
def test_grad_weight_and_bias_match_naive(kind, keep):
    hidden, weight, bias, targets = make(seed=2, bias=True)
    up = _upstream(kind, targets.shape)
    ref = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    (naive(ref[0], ref[1], targets, ref[2])[0] * up).sum().backward()
    ours = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    (
        token_logprobs(
            ours[0],
            ours[1],
            targets,
            bias=ours[2],
            temperature=TEMP,
            chunk_tokens=4,
            keep_bytes=_keep(keep, 4, weight.shape[0]),
        )[0]
        * up
    ).sum().backward()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=ATOL, rtol=RTOL)


def test_kept_softmax_skips_the_recompute_and_a_second_backward_agrees(monkeypatch):
    from qerl_pipeline.rl import logprobs

    hidden, weight, _, targets = make(seed=6)
    calls = []
    real = logprobs._chunk_logits
    monkeypatch.setattr(logprobs, "_chunk_logits", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    up = _upstream("random", targets.shape)
    h = hidden.clone().requires_grad_(True)
    lp = token_logprobs(h, weight, targets, temperature=TEMP, chunk_tokens=4, keep_bytes=2 * 4 * weight.shape[0] * 4)[
        0
    ]
    n_fwd = len(calls)
    (lp * up).sum().backward(retain_graph=True)
    # two chunks kept: the backward recomputes the others only
    assert len(calls) - n_fwd == n_fwd - 2
    first = h.grad.clone()
    h.grad = None
    (lp * up).sum().backward()  # a retained graph's second backward: the same kept chunks, the same result
    assert len(calls) - n_fwd == 2 * (n_fwd - 2)
    assert torch.equal(h.grad, first)
    with pytest.raises(ValueError, match="keep_bytes"):
        token_logprobs(h, weight, targets, keep_bytes=-1)


def test_no_grad_keeps_nothing():
    hidden, weight, _, targets = make(seed=7)
    with torch.no_grad():
        got = _peak_live_bytes(lambda: token_logprobs(hidden, weight, targets, chunk_tokens=4))
    # without a backward to come nothing is kept: the peak is two chunks' buffers, not the rows' softmax
    assert got < hidden.shape[0] * hidden.shape[1] * weight.shape[0] * 4


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3), generator=g)

    def fn(h, w, b):
        return token_logprobs(h, w, targets, bias=b, temperature=TEMP, chunk_tokens=4)[0]

    assert fn(hidden, weight, bias).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("keep", ["none", "one", "all"])
def test_entropy_grad_matches_naive(keep):
    """entropy_grad: the entropy's gradient (an entropy bonus) joins the log-prob's,
    as autograd through the naive path."""
    hidden, weight, bias, targets = make(seed=8, bias=True)
    up, up_h = _upstream("masked", targets.shape), _upstream("random", targets.shape)
    ref = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    logits = torch.nn.functional.linear(ref[0], ref[1], ref[2]).float() / TEMP
    ls = torch.log_softmax(logits, dim=-1)
    ent_ref = -(ls.exp() * ls).sum(-1)
    (ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * up + ent_ref * up_h).sum().backward()
    ours = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    lp, ent = token_logprobs(
        ours[0],
        ours[1],
        targets,
        bias=ours[2],
        temperature=TEMP,
        chunk_tokens=4,
        keep_bytes=_keep(keep, 4, weight.shape[0]),
        entropy_grad=True,
    )
    assert ent.requires_grad
    torch.testing.assert_close(ent, ent_ref.detach(), atol=ATOL, rtol=RTOL)
    (lp * up + ent * up_h).sum().backward()
    for a, b in zip(ours, ref, strict=True):
        assert _rel(a.grad, b.grad) <= 10 * GRAD_REL
    # without entropy_grad the entropy stays detached (and the default path is unchanged)
    assert not token_logprobs(ours[0], ours[1], targets, bias=ours[2])[1].requires_grad


def test_entropy_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3), generator=g)

    def fn(h, w):
        lp, ent = token_logprobs(h, w, targets, temperature=TEMP, chunk_tokens=4, entropy_grad=True)
        return lp + 0.7 * ent

    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-6, atol=1e-8)


# -------------------------------------------------------------------- bf16
def test_bf16_inputs_agree_with_fp32_reference():
    hidden, weight, _, targets = make(seed=4, dtype=torch.bfloat16)
    up = _upstream("masked", targets.shape)
    h = hidden.clone().requires_grad_(True)
    lp, ent = token_logprobs(h, weight, targets, temperature=TEMP, chunk_tokens=5)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    (lp * up).sum().backward()
    assert h.grad.dtype == torch.bfloat16

    # the same bf16 values in fp32: only the bf16 rounding of logits / grads differs
    h32 = hidden.float().requires_grad_(True)
    ref_lp, ref_ent = naive(h32, weight.float(), targets)
    (ref_lp * up).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(ent, ref_ent, atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(h.grad.float(), h32.grad, atol=2e-2, rtol=2e-2)

    # and the naive bf16 path (lm_head in bf16, then .float()) nearly bit for bit
    hb = hidden.clone().requires_grad_(True)
    nb_lp, nb_ent = naive(hb, weight, targets)
    torch.testing.assert_close(lp, nb_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, nb_ent, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ memory
ROWS, MV, MH, CHUNK = 4096, 32000, 64, 256
ONE_ROWS_BY_V = ROWS * MV * 4  # bytes of one fp32 [rows, V] tensor


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (each storage once)."""
    seen: dict = {}

    def pack(t):
        key = (t.device.type, t.untyped_storage().data_ptr()) if t.device.type != "meta" else id(t)
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _memory_case(device="cpu"):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(ROWS, MH, generator=g).to(device).requires_grad_(True)
    weight = (torch.randn(MV, MH, generator=g) * 0.1).to(device)
    targets = torch.randint(0, MV, (ROWS,), generator=g).to(device)
    return hidden, weight, targets


def test_saved_for_backward_is_not_rows_by_vocab():
    hidden, weight, targets = _memory_case()
    ours = _saved_bytes(
        lambda: (
            token_logprobs(hidden, weight, targets, temperature=TEMP, chunk_tokens=CHUNK, keep_bytes=0)[0]
            .sum()
            .backward()
        )
    )
    # the naive graph on the meta device: the same saved shapes, no memory or compute
    mh, mw, mt = _memory_case("meta")
    ref = _saved_bytes(lambda: naive(mh, mw, mt)[0].sum())
    assert ours < ONE_ROWS_BY_V / 4 < ref, (ours, ref, ONE_ROWS_BY_V)


def _peak_live_bytes(fn) -> int:
    """Peak of (CPU allocations - frees) while ``fn`` runs, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        deltas = [e.nbytes() for e in events]
    except AttributeError as exc:  # profiler internals moved
        pytest.skip(f"profiler memory events unavailable: {exc}")
    cur = peak = 0
    for d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak


def test_peak_live_memory_forward_backward():
    hidden, weight, targets = _memory_case()

    def ours(keep=0):
        token_logprobs(hidden, weight, targets, temperature=TEMP, chunk_tokens=CHUNK, keep_bytes=keep)[
            0
        ].sum().backward()

    def ref():
        naive(hidden, weight, targets)[0].sum().backward()

    peak_ours = _peak_live_bytes(ours)
    hidden.grad = None
    peak_ref = _peak_live_bytes(ref)
    # ours: ~2 fp32 [chunk, V] buffers (62.5 MiB); naive: several [rows, V] (>= 500 MiB each)
    assert 0 < peak_ours < ONE_ROWS_BY_V / 4 < ONE_ROWS_BY_V < peak_ref, (peak_ours, peak_ref, ONE_ROWS_BY_V)
    # kept softmax chunks add at most keep_bytes (here two chunks' worth)
    keep = 2 * CHUNK * MV * 4
    hidden.grad = None
    peak_keep = _peak_live_bytes(lambda: ours(keep))
    assert peak_ours < peak_keep <= peak_ours + keep + CHUNK * MV * 4, (peak_ours, peak_keep, keep)


# ------------------------------------------------- drop-in for completion_logprobs
def test_drop_in_for_completion_logprobs():
    transformers = pytest.importorskip("transformers")
    from qerl_pipeline.rl.update import completion_logprobs

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 300, (3, 20))
    prompt_lens, t_max = torch.tensor([5, 8, 3]), 10
    lp, ent = completion_logprobs(model, input_ids, prompt_lens, t_max, TEMP)  # chunked since rl/logprobs.py

    # the naive reference: the full model's logits, log-softmax over the vocabulary, gather
    pos = (prompt_lens.unsqueeze(1) - 1 + torch.arange(t_max).unsqueeze(0)).clamp(max=input_ids.shape[1] - 2)
    rows = torch.arange(input_ids.shape[0]).unsqueeze(1)
    with torch.no_grad():
        logp_all = torch.log_softmax(model(input_ids=input_ids).logits[rows, pos].float() / TEMP, dim=-1)
    ref_lp = logp_all.gather(-1, input_ids[rows, pos + 1].unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    torch.testing.assert_close(lp.detach(), ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    lp.sum().backward()  # the lm_head weight requires grad here: its gradient is supported
    assert model.lm_head.weight.grad is not None
