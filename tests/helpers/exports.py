"""What the export tests do to an exported folder with the outside libraries: greedy tokens of a transformers
model, and the same PEFT adapter without its trained norms (the policy the norms must change)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def greedy_tokens(model, prompts: list[list[int]], new_tokens: int, pad: int) -> list[list[int]]:
    """Greedy continuations (``new_tokens`` each) of ``prompts`` (token ids), one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        seq = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad
        )
    return seq[:, width:].tolist()


def adapter_without_norms(adapter: Path, dest: Path) -> Path:
    """A copy of the PEFT folder ``adapter`` at ``dest`` holding its LoRA tensors alone, ``modules_to_save`` emptied:
    the trained adapter as a LoRA-only loader would take it."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    shutil.copytree(adapter, dest)
    save_file({k: v for k, v in tensors.items() if "lora_" in k}, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": None}))
    return dest
