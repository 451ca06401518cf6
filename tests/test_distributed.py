"""Data-parallel training (rl/distributed.py): the decisions, the collectives on two gloo ranks, and
the update of 2 ranks x half a batch against 1 process x the whole batch.

Fast tier: the ranks are ``torch.multiprocessing`` processes joined by gloo over a local
rendezvous (what torchrun sets up, without the launcher), running the real
``step.policy_update`` on a tiny packed policy. The launched form (``kedro run ... --params
train.nproc=2`` with real engines) is in ``test_trainer.py`` (integration).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qerl_pipeline.config import ConfigError, validate
from qerl_pipeline.rl import dist as D
from qerl_pipeline.rl.distributed import launcher_command
from qerl_pipeline.rollout.engine import without_launcher_env
from tests.helpers.policy_update import N_SEQ, free_port, update_rows


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
    assert without_launcher_env(env) == {"PATH": "/bin"}  # a rank's engine must not take the trainer's rank


def test_launcher_command_single_and_multi_node(tmp_path):
    one = launcher_command(2, tmp_path / "p.json")
    assert one[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"] and "--standalone" in one
    assert one[-3:] == ["-m", "qerl_pipeline.rl.distributed", str(tmp_path / "p.json")]
    multi = launcher_command(8, tmp_path / "p.json", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
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
def _rank_update(rank: int, world: int, port: int, base_dir: str, out: str) -> None:
    d = _join(rank, world, port)
    collectives = _collectives(d)
    lo, hi = D.shard_bounds(N_SEQ, rank, world)
    state, metrics = update_rows(Path(base_dir), d, slice(lo, hi))
    torch.save({"state": state, "metrics": metrics, "collectives": collectives}, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_ranks_with_half_the_batch_each_update_like_one_process_with_all(base_dir, tmp_path):
    single, metrics1 = update_rows(base_dir, D.SINGLE, slice(0, N_SEQ))
    mp.spawn(_rank_update, args=(2, free_port(), str(base_dir), str(tmp_path)), nprocs=2, join=True)
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
