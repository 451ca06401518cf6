"""Data-parallel training (rl/distributed.py): the decisions, the collectives on two gloo ranks, and
the update of 2 ranks x half a batch against 1 process x the whole batch.

Fast tier: the ranks are ``torch.multiprocessing`` processes joined by gloo over a local
rendezvous (what torchrun sets up, without the launcher), running the real
``step.policy_update`` on a tiny packed policy. The launched form (``kedro run ... --params
train.nproc=2`` with real engines) is in ``test_trainer.py`` (integration).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qerl_pipeline.config import ConfigError, QerlConfig, validate
from qerl_pipeline.rl import distributed as D
from tests.test_policy_update import base_dir  # noqa: F401 - the tiny packed base fixture

N_SEQ, P_LEN, C_LEN = 8, 5, 6


def test_decisions_by_platform_and_environment():
    assert D.backend_for("cpu") == "gloo" and D.backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert D.rank_device("cuda", 3) == "cuda:3" and D.rank_device("cpu", 3) == "cpu"
    assert D.from_env({}) is D.SINGLE and not D.SINGLE.active
    d = D.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (d.rank, d.world_size, d.local_rank, d.is_main, d.active) == (3, 4, 1, False, True)
    assert [D.shard_bounds(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="split evenly"):
        D.shard_bounds(6, 0, 4)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"}
    assert D.engine_env(env) == {"PATH": "/bin"}  # a rank's engine must not take the trainer's rank


def test_launcher_command_single_and_multi_node(tmp_path):
    one = D.launcher_command(2, tmp_path / "p.json")
    assert one[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"] and "--standalone" in one
    assert one[-3:] == ["-m", "qerl_pipeline.rl.distributed", str(tmp_path / "p.json")]
    multi = D.launcher_command(8, tmp_path / "p.json", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    assert "--standalone" not in multi
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400"} <= set(multi)


def test_config_checks_of_data_parallel_runs():
    assert validate({"train": {"nproc": 2, "prompts_per_step": 4}}).train.nproc == 2
    with pytest.raises(ConfigError, match="split evenly"):
        validate({"train": {"nproc": 3, "prompts_per_step": 4}})
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        validate({"train": {"nproc": 2, "prompts_per_step": 4}, "grpo": {"dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="node_rank"):
        validate({"train": {"nnodes": 2, "node_rank": 2, "prompts_per_step": 4}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, port: int) -> D.Dist:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    return D.init("cpu")


def _collectives(d: D.Dist) -> dict:
    rank = d.rank
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    q.grad = torch.full((2,), 0.5 * (rank + 1), dtype=torch.bfloat16)
    d.all_reduce_grads([p, q])
    return {"p": p.grad.tolist(), "q": q.grad.float().tolist(), "sum": d.sum(rank + 0.5),
            "gather": d.all_gather_object({"r": rank}), "bcast": d.broadcast_object(("x", rank) if d.is_main else None)}


# ------------------------------------------------------- the update: 2 ranks x half == 1 x whole
def _cfg() -> QerlConfig:
    return QerlConfig.model_validate({
        "method": "qerl",
        "lora": {"rank": 4, "alpha": 8, "train_norms": True},
        "optim": {"lr": {"qerl": 1e-2}, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 0.5},
        # token aggregation and batch-scaled advantages need the global counts; entropy selection the global threshold;
        # two updates per rollout: the second starts from the first's (synchronised) parameters
        "grpo": {"num_generations": 2, "kl_beta": 0.05, "log_kl_to_base": True, "is_mode": "token_mask", "is_cap": 1.5,
                 "is_lower": 0.5, "loss_aggregation": "token", "top_entropy_quantile": 0.5, "updates_per_rollout": 2},
        "rollout": {"temperature": 0.7, "max_new_tokens": C_LEN},
        # micro-batches of 4 rows: the same row groups in one process and on each rank, so the forwards are bit-equal
        # and only the cross-rank sums differ (a masked ratio or an entropy at a threshold cannot flip on rounding)
        "train": {"micro_batch_size": 4, "prompts_per_step": 4},
    })


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (N_SEQ, P_LEN + C_LEN), generator=g)
    p_lens = torch.full((N_SEQ,), P_LEN)
    c_lens = torch.tensor([6, 4, 5, 2, 6, 3, 1, 6])
    from qerl_pipeline.rl import grpo

    mask = grpo.completion_mask(c_lens, C_LEN)
    roll = -torch.rand(N_SEQ, C_LEN, generator=g) * 3
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.5, 0.0, 0.2])
    adv = grpo.group_advantages(rewards, 2, "batch")
    return ids, p_lens, roll, mask, adv


def _update(base_dir: Path, d: D.Dist, rows: slice) -> tuple[dict, dict]:
    from qerl_pipeline.quantization.policy import build_policy
    from qerl_pipeline.rl import aqn, step
    from qerl_pipeline.rl.trainer import build_optimizer, lr_factor, trained_norms

    cfg = _cfg()
    torch.manual_seed(0)  # the same LoRA initialisation in every process
    policy = build_policy(base_dir, "nvfp4", cfg.lora, dtype=torch.float32)
    policy.train()
    with torch.no_grad():
        for name, prm in policy.named_parameters():
            if "lora_B" in name:
                prm.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    params = [prm for prm in policy.parameters() if prm.requires_grad]
    start = {n: prm.detach().clone() for n, prm in policy.named_parameters() if prm.requires_grad}
    opt, _ = build_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, warmup=0, total=10, schedule="constant"))
    base = trained_norms(policy)
    norm_params = aqn.norm_parameters(policy, sorted(base))
    ids, p_lens, roll, mask, adv = _batch()
    out = step.policy_update(policy, opt, sched, params, norm_params, {}, ids[rows], p_lens[rows], roll[rows], mask[rows],
                             adv[rows], cfg, 0, ref_norms={n: base[n].clone() for n in norm_params}, dist=d)
    state = {n: prm.detach().clone() for n, prm in policy.named_parameters() if prm.requires_grad}
    return state, {**out, "start": start}


def _rank_update(rank: int, world: int, port: int, base_dir: str, out: str) -> None:
    d = _join(rank, world, port)
    collectives = _collectives(d)
    lo, hi = D.shard_bounds(N_SEQ, rank, world)
    state, metrics = _update(Path(base_dir), d, slice(lo, hi))
    torch.save({"state": state, "metrics": metrics, "collectives": collectives}, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_ranks_with_half_the_batch_each_update_like_one_process_with_all(base_dir, tmp_path):
    single, metrics1 = _update(base_dir, D.SINGLE, slice(0, N_SEQ))
    mp.spawn(_rank_update, args=(2, _free_port(), str(base_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:  # the collectives themselves: sums over ranks (dtype kept), gather in rank order, broadcast
        c = got["collectives"]
        assert c["p"] == [3.0, 6.0, 9.0] and c["q"] == [1.5, 1.5]
        assert c["sum"] == 2.0 and c["gather"] == [{"r": 0}, {"r": 1}] and c["bcast"] == ("x", 0)
    for r, got in enumerate(ranks):
        for name, want in single.items():
            torch.testing.assert_close(got["state"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r}: {name}")
        # the replicas are equal to each other bit for bit (same summed gradient, same step)
        for name in single:
            assert torch.equal(got["state"][name], ranks[0]["state"][name]), name
    start = metrics1.pop("start")
    moved = max(float((single[n] - start[n]).abs().max()) for n in single)
    assert moved > 1e-4, "the update did not move the adapter: the comparison would hold trivially"
    for key in ("loss", "optim/grad_norm", "policy/entropy", "mismatch/kl", "policy/selected_token_fraction",
                "policy/kl_to_base", "mismatch/is_masked_fraction", "mismatch/is_ratio_max", "mismatch/is_ratio_min"):
        assert ranks[0]["metrics"][key] == pytest.approx(metrics1[key], rel=1e-4, abs=1e-7), key
        assert ranks[1]["metrics"][key] == ranks[0]["metrics"][key], key
