"""Data-parallel training (rl/ranks.py, rl/launch.py): the decisions, the collectives on two gloo ranks, the
update of 2 ranks x half a batch (or all of it and none) against 1 process x the whole batch, and
DAPO's dynamic sampling trained on 2 ranks against 1 process.

Fast tier: the ranks are ``torch.multiprocessing`` processes joined by gloo over a local
rendezvous (what torchrun sets up, without the launcher), running the real
``update.policy_update`` on a tiny packed policy, or the real ``trainer.train`` on the fake engine
of ``tests/helpers/engines.py`` (seeded per request, as vLLM). The launched form (``kedro run ...
--params train.nproc=2`` with real engines, also with dynamic sampling) is in ``test_trainer.py``
(integration).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from qerl_pipeline.config import ConfigError, validate
from qerl_pipeline.rl.launch import launcher_command
from qerl_pipeline.rl.ranks import SINGLE, Dist, backend_for, from_env, init, rank_device, shard_bounds
from qerl_pipeline.rollout.engine import without_launcher_env
from tests.helpers.policy_update import N_SEQ, free_port, update_rows
from tests.helpers.project import PROJECT


def test_decisions_by_platform_and_environment():
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert rank_device("cuda", 3) == "cuda:3" and rank_device("cpu", 3) == "cpu"
    assert from_env({}) is SINGLE and not SINGLE.active
    d = from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (d.rank, d.world_size, d.local_rank, d.is_main, d.active) == (3, 4, 1, False, True)
    assert [shard_bounds(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="split evenly"):
        shard_bounds(6, 0, 4)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"}
    assert without_launcher_env(env) == {"PATH": "/bin"}  # a rank's engine must not take the trainer's rank


def test_launcher_command_single_and_multi_node(tmp_path):
    one = launcher_command(2, tmp_path / "p.json")
    assert one[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"] and "--standalone" in one
    assert one[-3:] == ["-m", "qerl_pipeline.rl.launch", str(tmp_path / "p.json")]
    multi = launcher_command(8, tmp_path / "p.json", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    assert "--standalone" not in multi
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400"} <= set(multi)


def test_config_checks_of_data_parallel_runs():
    assert validate({"train": {"nproc": 2, "prompts_per_step": 4}}).train.nproc == 2
    # DAPO's dynamic sampling on several ranks (its refill rounds are decided for all ranks at once)
    cfg = validate({"train": {"nproc": 2, "prompts_per_step": 4}, "grpo": {"dynamic_sampling": True}})
    assert cfg.train.nproc == 2 and cfg.grpo.dynamic_sampling
    # what stays refused: uneven shares of the first round, a shared engine, a node_rank past nnodes, compare branches
    with pytest.raises(ConfigError, match="split evenly"):
        validate({"train": {"nproc": 3, "prompts_per_step": 4}, "grpo": {"dynamic_sampling": True}})
    with pytest.raises(ConfigError, match="rollout.engines: 'shared'"):
        validate({"train": {"nproc": 2, "prompts_per_step": 4}, "rollout": {"engines": "shared"}})
    with pytest.raises(ConfigError, match="node_rank"):
        validate({"train": {"nnodes": 2, "node_rank": 2, "prompts_per_step": 4}})
    assert "not supported in compare branches" in cfg.train.compare_ranks_error()


@pytest.mark.parametrize(
    "env, params",
    [
        # docs/scale-out.md's two-node command: the paper's recipe (DAPO with dynamic sampling) on 16 ranks
        (
            "paper_bigmath_7b",
            "train.nproc=8,train.nnodes=2,train.node_rank=0,train.master_addr=10.0.0.1,train.master_port=29500",
        ),
        ("smoke", "train.nproc=2,grpo.dynamic_sampling=true"),
    ],
)
def test_dynamic_sampling_on_several_ranks_validates_as_kedro_loads_it(env, params):
    from qerl_pipeline.planner.inputs import load_config

    cfg = load_config(env, params, PROJECT / "conf")
    assert cfg.grpo.dynamic_sampling and cfg.train.nproc * cfg.train.nnodes > 1


def _join(rank: int, world: int, port: int) -> Dist:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    return init("cpu")


def _collectives(d: Dist) -> dict:
    rank = d.rank
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    q.grad = torch.full((2,), 0.5 * (rank + 1), dtype=torch.bfloat16)
    h = torch.nn.Parameter(torch.zeros(2))  # a gradient on rank 0 only: both get the sum
    h.grad = torch.ones(2) if rank == 0 else None
    none = torch.nn.Parameter(torch.zeros(2))  # no gradient anywhere: stays None (the optimiser skips it)
    d.all_reduce_grads([p, none, q, h])
    return {
        "p": p.grad.tolist(),
        "q": q.grad.float().tolist(),
        "h": h.grad.tolist(),
        "none": none.grad,
        "sum": d.sum(rank + 0.5),
        "gather": d.all_gather_object({"r": rank}),
        "bcast": d.broadcast_object(("x", rank) if d.is_main else None),
    }


# ------------------------------------------------------- the update: 2 ranks x half == 1 x whole
def _rank_update(rank: int, world: int, port: int, base_dir: str, out: str) -> None:
    d = _join(rank, world, port)
    collectives = _collectives(d)
    lo, hi = shard_bounds(N_SEQ, rank, world)
    state, metrics = update_rows(Path(base_dir), d, slice(lo, hi))
    # a rank whose share is empty (DAPO kept fewer rows than there are ranks): rank 0 takes every row, rank 1 none
    empty = update_rows(Path(base_dir), d, slice(0, N_SEQ) if rank == 0 else slice(N_SEQ, N_SEQ))
    torch.save(
        {"state": state, "metrics": metrics, "collectives": collectives, "empty": empty}, Path(out) / f"rank{rank}.pt"
    )
    torch.distributed.destroy_process_group()


def test_two_ranks_with_half_the_batch_each_update_like_one_process_with_all(base_dir, tmp_path):
    """Also with the batch split as DAPO may split it: every row on rank 0, none on rank 1."""
    single, metrics1 = update_rows(base_dir, SINGLE, slice(0, N_SEQ))
    mp.spawn(_rank_update, args=(2, free_port(), str(base_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:  # the collectives themselves: sums over ranks (dtype kept), gather in rank order, broadcast
        c = got["collectives"]
        assert c["p"] == [3.0, 6.0, 9.0] and c["q"] == [1.5, 1.5] and c["h"] == [1.0, 1.0] and c["none"] is None
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
    for key in (
        "loss",
        "optim/grad_norm",
        "policy/entropy",
        "mismatch/kl",
        "policy/selected_token_fraction",
        "policy/kl_to_base",
        "mismatch/is_masked_fraction",
        "mismatch/is_ratio_max",
        "mismatch/is_ratio_min",
    ):
        assert ranks[0]["metrics"][key] == pytest.approx(metrics1[key], rel=1e-4, abs=1e-7), key
        assert ranks[1]["metrics"][key] == ranks[0]["metrics"][key], key
    # the rank without rows joined every collective (its missing gradients counted as zeros) and stepped with rank 0
    for r, got in enumerate(ranks):
        state, metrics = got["empty"]
        for name, want in single.items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=f"empty share, rank {r}: {name}")
            assert torch.equal(state[name], ranks[0]["empty"][0][name]), name
        for key in ("loss", "optim/grad_norm", "policy/entropy", "policy/selected_token_fraction"):
            assert metrics[key] == pytest.approx(metrics1[key], rel=1e-5, abs=1e-7), (r, key)


def test_an_empty_share_collates_to_no_rows():
    from qerl_pipeline.rl.records import collate

    ids, p_lens, c_lens, roll = collate([], pad_id=0)
    assert ids.shape == (0, 1) and p_lens.shape == c_lens.shape == (0,) and roll.shape == (0, 1)


# ------------------------------- DAPO's dynamic sampling: 2 ranks x half of every round == 1 x all
DAPO_STEPS, DAPO_PROMPTS = 3, 4


def _dapo_cfg(out: Path, nproc: int):
    from qerl_pipeline.config import QerlConfig

    return QerlConfig.model_validate(
        {
            "method": "qerl",
            "model": {"dtype": "float32", "max_seq_len": 256},
            "lora": {"rank": 4, "alpha": 8},
            "optim": {"lr": {"qerl": 1e-2}, "warmup_steps": 0},
            # one refill round at most: some steps end short of prompts_per_step, so a kept group straddles the ranks
            "grpo": {
                "num_generations": 2,
                "dynamic_sampling": True,
                "max_refill_rounds": 1,
                "advantage_scale": "batch",
                "loss_type": "dapo",
            },
            "rollout": {"max_new_tokens": 4, "temperature": 1.0},
            # micro-batches of 4 rows: a full step's rows split 4 + 4 as one process's micro-batches do; a short step's
            # (an odd number of groups) batch other rows together on the ranks: float rounding (the tolerances below)
            "train": {
                "steps": DAPO_STEPS,
                "prompts_per_step": DAPO_PROMPTS,
                "micro_batch_size": 4,
                "checkpoint_every": DAPO_STEPS,
                "output_dir": str(out),
                "nproc": nproc,
            },
        }
    )


def _dapo_records() -> list[dict]:
    return [
        {"id": str(i), "messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "gold": str(2 * i)}
        for i in range(1, 9)
    ]


def _dapo_train(d: Dist, base: Path, out: Path) -> dict:
    """``trainer.train`` with dynamic sampling on the fake engine (per-request seeded samples), the coin-flip
    reward; what ``collect`` handed the update each step (prompt per row, completions, rewards, rounds)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from qerl_pipeline.rl import trainer
    from qerl_pipeline.rl.run_setup import Reporting
    from tests.helpers.engines import FakeEngine
    from tests.helpers.rewards import odd_first_token

    with safe_open(str(base / "model.safetensors"), "pt") as fh:
        norms = {k: fh.get_tensor(k).float() for k in fh.keys() if k.endswith("norm.weight")}
    steps: list[dict] = []
    real = trainer.collect

    def recording(*args, **kwargs):
        rollout = real(*args, **kwargs)
        steps.append(
            {
                "prompts": [p for p, grp in zip(rollout.prompts, rollout.groups, strict=True) for _ in grp],
                "rounds": rollout.rounds,
                "completions": [s.completion_ids for grp in rollout.groups for s in grp],
                "rewards": [x["reward"] for x in rollout.rewards],
                "group_sizes": [len(grp) for grp in rollout.groups],
            }
        )
        return rollout

    trainer.collect = recording
    try:
        result = trainer.train(
            _dapo_cfg(out, d.world_size),
            base,
            _dapo_records(),
            engine=FakeEngine(cuda=False, norms=norms),
            reporting=Reporting(progress=False),
            reward_fn=odd_first_token,
            dist=d,
        )
    finally:
        trainer.collect = real
    return {
        "steps": steps,
        "history": result.history,
        "adapter": load_file(str(result.adapter_dir / "adapter_model.safetensors")),
    }


def _rank_dapo(rank: int, world: int, port: int, base: str, out: str) -> None:
    d = _join(rank, world, port)
    got = _dapo_train(d, Path(base), Path(out) / "run")
    torch.save(got, Path(out) / f"dapo{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dapo_base(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny random Llama (SmolLM2 tokenizer) as an NVFP4 base."""
    from tests.helpers.models import tokenized_base

    return tokenized_base(tiny_model_dir, "nvfp4", tmp_path_factory.mktemp("dapo_base") / "nvfp4")


def test_dynamic_sampling_on_two_ranks_keeps_trains_and_logs_what_one_process_does(dapo_base, tmp_path):
    """DAPO with dynamic sampling, 3 steps of 4 prompts x 2 samples, a coin-flip reward (groups with equal
    rewards are dropped and refilled): 2 gloo ranks, each rolling out half of every round, hand the update the
    rows one process does (same prompts, completions and rewards, in the same order when rank 0's rows are
    followed by rank 1's), log the same global metrics and train the same adapter."""
    one = _dapo_train(SINGLE, dapo_base, tmp_path / "one")
    mp.spawn(_rank_dapo, args=(2, free_port(), str(dapo_base), str(tmp_path / "two")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / "two" / f"dapo{r}.pt") for r in range(2)]
    # the run exercises what it claims to: refills, a short step (max_refill_rounds spent), a group over both ranks
    assert any(s["rounds"] == 2 for s in one["steps"]), [s["rounds"] for s in one["steps"]]
    assert any(len(s["rewards"]) < DAPO_PROMPTS * 2 for s in one["steps"])
    assert any(1 in s["group_sizes"] for s in ranks[0]["steps"])
    for step, want in enumerate(one["steps"]):
        parts = [r["steps"][step] for r in ranks]
        assert parts[0]["rounds"] == parts[1]["rounds"] == want["rounds"], step
        for key in ("prompts", "completions", "rewards"):
            assert parts[0][key] + parts[1][key] == want[key], (step, key)
        assert abs(len(parts[0]["rewards"]) - len(parts[1]["rewards"])) <= 1  # balanced shares of rows
    for key in (
        "reward/mean",
        "reward/kept_mean",
        "reward/std",
        "groups/sampled",
        "groups/kept",
        "groups/refill_rounds",
        "groups/zero_std_fraction",
        "completion/length",
        "reward/overlong",
    ):
        assert [h.get(key) for h in ranks[0]["history"]] == [h.get(key) for h in one["history"]], key
    for key in ("loss", "optim/grad_norm", "policy/entropy"):
        assert [h[key] for h in ranks[0]["history"]] == pytest.approx(
            [h[key] for h in one["history"]], rel=1e-4, abs=1e-7
        )
    moved = max(float(t.abs().max()) for n, t in one["adapter"].items() if "lora_B" in n)
    assert moved > 1e-4, "the adapter did not move: the comparison would hold trivially"
    for name, want in one["adapter"].items():  # rank 0 writes the final adapter
        torch.testing.assert_close(ranks[0]["adapter"][name], want, rtol=1e-4, atol=1e-6, msg=name)
