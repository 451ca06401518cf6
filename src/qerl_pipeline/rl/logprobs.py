"""Per-token log-probs and entropy through the lm_head, without a [rows, V] tensor.

The naive way to score completion tokens is ``logits = lm_head(h).float() / temperature``
(``[n, T, V]``), ``log_softmax`` over the vocabulary, a gather, and
``-(exp(logp) * logp).sum(-1)`` for the entropy. That keeps several ``[n, T, V]`` fp32
tensors alive at once, and autograd saves the log-softmax output for backward: for a 7B
model (V = 152k) at micro-batch 4 x T 2048 each one is ~5 GB.

``token_logprobs`` computes the same two numbers with a custom ``autograd.Function`` that
walks the flattened positions in chunks of ``chunk_tokens`` rows:

- forward, per chunk: ``z = linear(h_c, W, b)`` in the inputs' dtype (exactly what
  ``lm_head`` does), cast to fp32 and divided by the temperature; the log-softmax
  ``ls = (z - max) - log(sum(exp(z - max)))`` in place (log_softmax's own order of
  operations); ``logp = ls[target]``; ``entropy = -(exp(ls) * ls).sum()``. Only ``hidden``,
  ``weight`` (and ``bias``), ``targets`` and the per-row max and log-sum (the logsumexp,
  ``[rows]`` each) are saved, never the logits.
- backward, per chunk: the logits are recomputed and
  ``dz = g * (onehot(target) - softmax(z)) / temperature`` is formed in fp32, then cast
  to the matmul dtype; ``grad_hidden = dz @ W``, and if ``weight``/``bias`` require grad,
  ``grad_W += dz.T @ h_c`` / ``grad_b += dz.sum(0)`` (accumulated in fp32, returned in
  the parameter's dtype). Rows whose upstream gradient is exactly zero (masked
  positions, padding) are skipped: they contribute nothing.

Kept probabilities (``keep_bytes``, default ``DEFAULT_KEEP_BYTES`` = 256 MiB): the forward
computes each chunk's softmax anyway (for the entropy). While the kept chunks fit in
``keep_bytes``, a chunk's fp32 probabilities are saved for backward, and that chunk's
backward skips the recompute (one lm_head matmul and an exp over ``[c, V]``). The rest is
recomputed as below. A CPU-sized batch (135M model, V = 49k, 1024 completion positions:
201 MB) keeps everything; a 7B batch (V = 152k: 311 MB per 512-row chunk) keeps nothing,
so the memory bound below holds there unchanged. ``keep_bytes=0`` always recomputes. The
kept and recomputed gradients are the same up to float rounding: the kept softmax comes from
the forward's log-softmax, the recomputed one from the saved max and log-sum.

Memory bound (``keep_bytes=0``; otherwise plus at most ``keep_bytes``). Besides the inputs
and the outputs (``[rows]`` each), the extra memory is O(chunk_tokens x V): about two fp32
``[chunk_tokens, V]`` tensors at a time (plus one ``[chunk_tokens, V]`` in the matmul dtype
when it is not fp32), in forward and in backward; with a weight that requires grad, one
fp32 ``[V, H]`` accumulator too. Nothing proportional to ``rows x V`` is saved for
backward. The price is one extra lm_head matmul (the recompute in backward).

What differs from the naive computation: float rounding only. The matmul runs in the
inputs' dtype, as ``lm_head`` does (so bf16 logits are rounded to bf16 exactly as in
``lm_head(h).float()``), everything after it in fp32 (fp64 for fp64 inputs, which
``torch.autograd.gradcheck`` uses). Chunked matmuls and a different order of the
reductions can change the last bits. Mixed input dtypes are computed in their promoted
dtype (``torch.promote_types``). Double backward is not supported.

The entropy is detached unless ``entropy_grad`` (an entropy bonus in the loss): then its
gradient joins the log-prob's in the same backward pass, per chunk
``dH/dz = -p * (log p + H) / temperature`` (``H`` the row's entropy, saved from the
forward; ``p log p`` as ``xlogy`` on kept chunks, so a probability that underflowed to 0
adds 0), at the cost of one more fp32 ``[chunk_tokens, V]`` buffer.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["DEFAULT_CHUNK_TOKENS", "DEFAULT_KEEP_BYTES", "token_logprobs"]

DEFAULT_CHUNK_TOKENS = 512  # V = 152k: ~0.3 GB per fp32 [chunk, V] buffer
DEFAULT_KEEP_BYTES = 256 * 2**20  # softmax chunks saved for backward instead of recomputed (module docstring)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h_c, weight, bias, temperature: float, acc: torch.dtype) -> torch.Tensor:
    """fp32 (``acc``) logits ``[c, V]`` of one chunk, divided by the temperature (a fresh tensor)."""
    z = torch.nn.functional.linear(h_c, weight, bias)
    z = z.to(acc) if z.dtype != acc else z
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, keep_bytes, entropy_grad):
        # hidden [N, H], weight [V, H], bias [V] | None, targets [N] (long)
        cdt = weight.dtype
        acc = _acc_dtype(cdt)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty(n, dtype=acc, device=hidden.device)
        # log_softmax's own order, (z - max) - log(sum(exp(z - max))): the same rounding as the naive path
        zmax = torch.empty(n, dtype=acc, device=hidden.device)
        logsum = torch.empty(n, dtype=acc, device=hidden.device)
        kept: dict[int, torch.Tensor] = {}  # chunk start -> its softmax [c, V], while it fits in keep_bytes
        budget = keep_bytes if any(ctx.needs_input_grad[:3]) else 0  # no backward to come: keep nothing
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _chunk_logits(hidden[s:e].to(cdt), weight, bias, temperature, acc)  # [c, V]
            m = z.amax(dim=-1, keepdim=True)
            z.sub_(m)
            p = torch.exp(z)
            ls = p.sum(-1, keepdim=True).log_()
            z.sub_(ls)  # z is now log-softmax
            logp[s:e] = z.gather(1, targets[s:e].unsqueeze(1)).squeeze(1)
            torch.exp(z, out=p)
            entropy[s:e] = z.mul_(p).sum(-1).neg_()  # z is free after the gather; p stays the softmax
            if p.numel() * p.element_size() <= budget:
                kept[s] = p
                budget -= p.numel() * p.element_size()
            zmax[s:e], logsum[s:e] = m.squeeze(1), ls.squeeze(1)
            del z, p
        # the planner counts it only then
        ctx.save_for_backward(hidden, weight, bias, targets, zmax, logsum, entropy if entropy_grad else None)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.kept = kept
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, zmax, logsum, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh_all = grad_entropy.to(zmax.dtype) if ctx.entropy_grad and grad_entropy is not None else None
        if (grad_logp is None and gh_all is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None
        if grad_logp is None:
            grad_logp = torch.zeros_like(zmax)
        t, chunk = ctx.temperature, ctx.chunk
        acc = zmax.dtype
        cdt = weight.dtype

        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None

        g_all = grad_logp.to(acc)
        kept = ctx.kept  # freed with the graph (a retained graph's next backward reuses them: same result)
        live = g_all != 0  # masked / padded positions contribute nothing
        if gh_all is not None:
            live |= gh_all != 0
        # the forward's chunks whose softmax was kept (their live rows), then the other live rows, recomputed
        work: list[tuple[torch.Tensor, int | None]] = []  # (rows, start of their kept chunk or None)
        todo = live.clone()
        for s, p in kept.items():
            work.append((torch.nonzero(live[s : s + p.shape[0]]).squeeze(1) + s, s))
            todo[s : s + p.shape[0]] = False
        rows = torch.nonzero(todo).squeeze(1)
        work += [(rows[s : s + chunk], None) for s in range(0, rows.numel(), chunk)]
        for r, s in work:
            if r.numel() == 0:
                continue
            h_c = hidden.index_select(0, r).to(cdt)
            g = g_all.index_select(0, r).unsqueeze(1)  # [c, 1]
            if gh_all is not None:  # -g p - gh p (log p + H) = -p (g + gh H) - gh p log p
                gh = gh_all.index_select(0, r).unsqueeze(1)
                if s is not None:
                    p = kept[s].index_select(0, r - s)
                    plogp = torch.xlogy(p, p)
                else:
                    z = _chunk_logits(h_c, weight, bias, t, acc)
                    z.sub_(zmax.index_select(0, r).unsqueeze(1)).sub_(logsum.index_select(0, r).unsqueeze(1))  # log p
                    p = torch.exp(z)
                    plogp = z.mul_(p)
                dz = p.mul_((g + gh * entropy.index_select(0, r).unsqueeze(1)).neg_()).sub_(plogp.mul_(gh))
                del p, plogp
            elif s is not None:  # the kept softmax's live rows (a fresh copy: the kept one stays as saved)
                dz = kept[s].index_select(0, r - s).mul_(g.neg())  # -g * p
            else:
                z = _chunk_logits(h_c, weight, bias, t, acc)
                z.sub_(zmax.index_select(0, r).unsqueeze(1)).sub_(
                    logsum.index_select(0, r).unsqueeze(1)
                ).exp_()  # softmax
                dz = z.mul_(g.neg())  # -g * p
            dz.scatter_add_(1, targets.index_select(0, r).unsqueeze(1), g)  # + g * onehot
            if t != 1.0:
                dz.div_(t)
            dz_c = dz.to(cdt) if cdt != acc else dz
            if need_h:
                grad_h.index_copy_(0, r, (dz_c @ weight).to(hidden.dtype))
            if need_w:
                grad_w.add_(dz_c.t() @ h_c)
            if need_b:
                grad_b.add_(dz.sum(0))
            del dz, dz_c
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy, under ``softmax((hidden @ weight.T + bias) / temperature)``.

    ``hidden`` ``[..., H]``: the hidden states at the positions that predict ``targets``
    ``[...]`` (integer token ids, the same leading shape); ``weight`` ``[V, H]`` (and
    ``bias`` ``[V]``): the lm_head. Returns ``(logp, entropy)``, both shaped like
    ``targets``, in fp32 (fp64 for fp64 inputs). ``logp`` is differentiable w.r.t.
    ``hidden``, and w.r.t. ``weight``/``bias`` when they require grad; ``entropy`` is
    detached unless ``entropy_grad`` (then differentiable the same way). Positions are
    processed ``chunk_tokens`` rows at a time, so the extra memory is
    O(chunk_tokens x V), plus up to ``keep_bytes`` of softmax chunks kept for backward
    instead of recomputed (see the module docstring).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: leading shapes differ")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not [V, H] with H = {hidden.shape[-1]}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} is not [V] with V = {weight.shape[0]}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    v = weight.shape[0]
    flat_t = targets.reshape(-1).long()
    if flat_t.numel() and (int(flat_t.min()) < 0 or int(flat_t.max()) >= v):
        raise IndexError(f"targets must lie in [0, {v}); got min {int(flat_t.min())}, max {int(flat_t.max())}")

    cdt = torch.promote_types(hidden.dtype, weight.dtype)
    if bias is not None:
        cdt = torch.promote_types(cdt, bias.dtype)
    weight = weight.to(cdt)  # a no-op (same tensor) in the usual same-dtype case
    bias = bias.to(cdt) if bias is not None else None
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    if int(keep_bytes) < 0:
        raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
    logp, entropy = _TokenLogprobs.apply(
        flat_h, weight, bias, flat_t, float(temperature), int(chunk_tokens), int(keep_bytes), bool(entropy_grad)
    )
    return logp.view(targets.shape), entropy.view(targets.shape)
