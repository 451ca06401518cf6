"""The decoder over a GRPO batch with each group's prompt computed once.

A GRPO batch holds G completions of every prompt. The naive scoring forward (and TRL's)
runs the decoder over every row's prompt + completion, so a prompt's P tokens are computed
G times, forward and backward, with identical results. ``shared_prompt_hidden`` runs the
prompt once per distinct prompt and lets the completions attend to it:

1. **Prefix call**: the distinct prompts minus their last token, right-padded to the longest
   (``[U, P]``, an attention mask over the padding, positions ``0..P-1``), ``use_cache``
   on: the per-layer keys and values of the prefix, with their autograd history.
2. The cache rows are gathered to the batch rows (``Cache.batch_select_indices`` with each
   row's prompt index). The gather's backward adds up the G rows' gradients into the one
   prefix, which is exactly the sum the naive forward computes over G copies.
3. **Suffix call**: per row, the prompt's last token and the completion tokens but the last
   (``[n, T]``: position ``p - 1 + t`` predicts completion token ``t``), at positions
   ``p - 1 .. p + T - 2``, attending to the row's prefix (padding masked) and causally to
   itself. Its hidden states are exactly the naive forward's at the positions that predict
   completion tokens. The naive forward also ran the final completion token, which predicts
   nothing; the suffix does not.

The decoder's work per step drops from ``n x (P + T)`` tokens to ``U x P + n x T``. For the
benchmark batch (2 prompts x 8 completions, 64 + 64 tokens) that is 1152 tokens instead
of 2048.

What differs from the naive forward is float rounding only. The matmuls have other shapes,
and the attention runs with an explicit mask over a cache instead of the plain causal path.
``tests/test_prefix.py`` checks log-probs and LoRA/norm gradients against the naive path.

When the shared path is not taken (``None`` is returned, the caller runs the naive path):
- every row's prompt is distinct (nothing to share);
- a prompt has fewer than 2 tokens (its prefix would be empty; a fully masked padding row
  can turn into NaN inside the attention);
- gradient checkpointing is on: Hugging Face's checkpointed layers drop ``past_key_values``
  (``GradientCheckpointingLayer``), so the suffix would not see its prompt;
- the model returns no cache, or the cache did not grow by the suffix (a layer did not use
  it). This is checked after the call, with a one-time warning.

Deviation from TRL: TRL's GRPOTrainer scores full rows. This path computes the same
numbers (``train.share_prompt_forward`` turns it off).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

__all__ = ["prompt_groups", "share_plan", "shared_prompt_hidden"]

_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def prompt_groups(input_ids: torch.Tensor, prompt_lens: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The distinct prompts of a batch: each one's first row, and every row's prompt index ``[n]``.

    Rows with the same prompt length and the same prompt tokens share a prompt, wherever they
    sit in the batch.
    """
    index: dict[tuple, int] = {}
    first: list[int] = []
    of_row: list[int] = []
    ids = input_ids.cpu()
    for i, p in enumerate(prompt_lens.tolist()):
        key = (int(p), *ids[i, : int(p)].tolist())
        j = index.setdefault(key, len(first))
        if j == len(first):
            first.append(i)
        of_row.append(j)
    return first, torch.tensor(of_row, dtype=torch.long)


def _checkpointing(decoder: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in decoder.modules())


def share_plan(
    input_ids: torch.Tensor, prompt_lens: torch.Tensor, t_max: int, checkpointing: bool
) -> tuple[list[int], torch.Tensor] | None:
    """``prompt_groups`` of the batch when the shared path applies to it, else ``None``
    (two rows at least, a completion position, prompts of 2+ tokens, no gradient
    checkpointing, some prompt shared: the module docstring). The benchmark counts its
    FLOPs from the same answer."""
    n = input_ids.shape[0]
    if n < 2 or t_max < 1 or int(prompt_lens.min()) < 2 or checkpointing:
        return None
    first, of_row = prompt_groups(input_ids, prompt_lens)
    return None if len(first) == n else (first, of_row)


def shared_prompt_hidden(
    decoder: torch.nn.Module, input_ids: torch.Tensor, prompt_lens: torch.Tensor, t_max: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Hidden states ``[n, T, H]`` at the positions that predict completion tokens, and the targets ``[n, T]``.

    ``decoder``: the base model's decoder (``model.model`` of a causal LM); ``input_ids``
    ``[n, L]``: right-padded prompt + completion rows; ``prompt_lens`` ``[n]``; ``t_max``:
    the completion positions to score. Position ``t`` of row ``i`` holds the hidden state that
    predicts ``input_ids[i, p_i + t]``. Positions past a row's end hold padding tokens (the
    caller masks them). Returns ``None`` when the shared path does not apply (module docstring).
    """
    n, length = input_ids.shape
    device = input_ids.device
    p_lens = prompt_lens.to(torch.long).cpu()
    plan = share_plan(input_ids, p_lens, t_max, _checkpointing(decoder))
    if plan is None:
        return None
    first, of_row = plan
    u_lens = p_lens[first] - 1  # prefix lengths
    p_max = int(u_lens.max())
    prefix = torch.zeros(len(first), p_max, dtype=input_ids.dtype, device=device)
    prefix_mask = torch.zeros(len(first), p_max, dtype=torch.long, device=device)
    for j, i in enumerate(first):
        k = int(u_lens[j])
        prefix[j, :k] = input_ids[i, :k]
        prefix_mask[j, :k] = 1
    positions = torch.arange(p_max, device=device).unsqueeze(0).expand(len(first), -1)
    out = decoder(input_ids=prefix, attention_mask=prefix_mask, position_ids=positions, use_cache=True)
    cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices") or cache.get_seq_length() != p_max:
        _warn_once("cache", f"{type(decoder).__name__} returned no usable KV cache; scoring full rows")
        return None
    rows = of_row.to(device)
    cache.batch_select_indices(rows)  # [U] -> [n]: the gather's backward sums the group's gradients

    steps = torch.arange(t_max, device=device).unsqueeze(0)
    start = (p_lens.to(device) - 1).unsqueeze(1)
    src = (start + steps).clamp(max=length - 1)  # the suffix's tokens (past the row's end: padding, masked)
    suffix = input_ids.gather(1, src)
    targets = input_ids.gather(1, (start + 1 + steps).clamp(max=length - 1))
    mask = torch.cat([prefix_mask.index_select(0, rows), torch.ones(n, t_max, dtype=torch.long, device=device)], dim=1)
    out = decoder(
        input_ids=suffix, attention_mask=mask, position_ids=start + steps, past_key_values=cache, use_cache=True
    )
    if cache.get_seq_length() != p_max + t_max:
        _warn_once("grow", f"{type(decoder).__name__}'s layers did not extend the KV cache; scoring full rows")
        return None
    return out.last_hidden_state, targets
