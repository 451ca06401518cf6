"""One ``update.policy_update`` on a tiny packed policy over some rows of a fixed batch.

The data-parallel tests run it once in one process over the whole batch and once on each
rank over that rank's half, and compare the two: so the configuration uses every option
whose result depends on sums over the ranks (token aggregation, batch-scaled advantages,
entropy selection, two updates per rollout).
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from qerl_pipeline.adapter import trained_norms
from qerl_pipeline.config import QerlConfig
from qerl_pipeline.quantization import aqn
from qerl_pipeline.quantization.policy import build_policy
from qerl_pipeline.rl import grpo, update
from qerl_pipeline.rl.optim import build_optimizer, lr_factor
from qerl_pipeline.rl.ranks import Dist
from qerl_pipeline.rl.records import Batch

#: the batch: sequences, prompt and completion lengths
N_SEQ, P_LEN, C_LEN = 8, 5, 6


def free_port() -> int:
    """A free local TCP port for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def update_cfg() -> QerlConfig:
    return QerlConfig.model_validate(
        {
            "method": "qerl",
            "lora": {"rank": 4, "alpha": 8, "train_norms": True},
            "optim": {"lr": {"qerl": 1e-2}, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 0.5},
            # token aggregation and batch-scaled advantages need the global counts; entropy selection the
            # global threshold; two updates per rollout: the second starts from the first's (synchronised) parameters
            "grpo": {
                "num_generations": 2,
                "kl_beta": 0.05,
                "log_kl_to_base": True,
                "is_mode": "token_mask",
                "is_cap": 1.5,
                "is_lower": 0.5,
                "loss_type": "dapo",
                "top_entropy_quantile": 0.5,
                "updates_per_rollout": 2,
            },
            "rollout": {"temperature": 0.7, "max_new_tokens": C_LEN},
            # micro-batches of 4 rows: the same row groups in one process and on each rank, so the forwards
            # are bit-equal and only the cross-rank sums differ (a masked ratio or an entropy at a threshold
            # cannot flip on rounding)
            "train": {"micro_batch_size": 4, "prompts_per_step": 4},
        }
    )


def update_batch():
    """Token ids, prompt lengths, rollout log-probs, completion mask and advantages of ``N_SEQ`` rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (N_SEQ, P_LEN + C_LEN), generator=g)
    p_lens = torch.full((N_SEQ,), P_LEN)
    c_lens = torch.tensor([6, 4, 5, 2, 6, 3, 1, 6])
    mask = grpo.completion_mask(c_lens, C_LEN)
    roll = -torch.rand(N_SEQ, C_LEN, generator=g) * 3
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.5, 0.0, 0.2])
    adv = grpo.group_advantages(rewards, 2, "batch")
    return ids, p_lens, roll, mask, adv


def update_policy(base_dir: Path, cfg: QerlConfig) -> tuple[torch.nn.Module, update.Optim, dict]:
    """The tiny packed policy with an adapter that has trained (the same in every process), its optimiser, and the
    clean norms (the KL reference)."""
    torch.manual_seed(0)  # the same LoRA initialisation in every process
    policy = build_policy(base_dir, "nvfp4", cfg.lora, dtype=torch.float32)
    policy.train()
    with torch.no_grad():
        for name, prm in policy.named_parameters():
            if "lora_B" in name:
                prm.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    params = [prm for prm in policy.parameters() if prm.requires_grad]
    opt, _ = build_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, warmup=0, total=10, schedule="constant"))
    base = trained_norms(policy)
    norm_params = aqn.norm_parameters(policy, sorted(base))
    return policy, update.Optim(opt, sched, params, norm_params), {n: base[n].clone() for n in norm_params}


def update_rows(base_dir: Path, d: Dist, rows: slice) -> tuple[dict, dict]:
    """The trained parameters after one ``policy_update`` over ``rows`` of the batch, and its
    metrics with the parameters it started from (``"start"``)."""
    cfg = update_cfg()
    policy, opt, ref_norms = update_policy(base_dir, cfg)
    start = {n: prm.detach().clone() for n, prm in policy.named_parameters() if prm.requires_grad}
    ids, p_lens, roll, mask, adv = update_batch()
    out = update.policy_update(
        policy,
        opt,
        Batch(ids[rows], p_lens[rows], roll[rows], mask[rows], adv[rows]),
        cfg,
        0,
        ref_norms=ref_norms,
        dist=d,
    )
    state = {n: prm.detach().clone() for n, prm in policy.named_parameters() if prm.requires_grad}
    return state, {**out, "start": start}
