"""Data-parallel training with torch.distributed: the launch of the ranks, and what each computes.

``train.nproc`` ranks, launched by PyTorch's elastic launcher (``python -m
torch.distributed.run``, i.e. torchrun), gloo on CPU; on CUDA one process group with two
backends, ``cpu:gloo,cuda:nccl`` (``rl/ranks.py``'s ``backend_for``). The rank's view and the
collectives are ``rl/ranks.py``; this module starts torchrun from the node and runs
``trainer.train`` in each rank.

* Why two backends on CUDA: NCCL serves CUDA tensors only (torch maps the ``nccl`` backend
  to the ``cuda`` device alone; a CPU tensor in a plain ``nccl`` group fails with "No backend
  type associated with device type cpu"), while the update's scalar bookkeeping (sequence and
  token counts, loss sums, clip statistics) lives on the host. Moving each scalar to the GPU
  would add a host-device round trip per collective for a few bytes, and every future CPU
  collective would be a crash waiting on a GPU run. With the device map, CUDA tensors (the
  gradients) go over NCCL and CPU tensors over gloo, and torch picks gloo for object
  collectives and barriers (``_get_object_coll_device``: "cpu" when it is in the map), so no
  object is pickled into GPU memory. The cost: gloo's TCP connections beside NCCL's (on
  multi-node jobs gloo needs a routable interface, ``GLOO_SOCKET_IFNAME``).

* Every rank holds the whole packed base and the LoRA (no sharding of weights: the point
  is more rollouts per step, the adapter is small) and owns its own rollout engine (one
  vLLM engine per rank, on its GPU; ``rollout/serving.py``).
* The step's prompt groups are global: ``train.prompts_per_step`` is the whole step's,
  drawn identically on every rank (same seeded sampler) and split in contiguous shares
  (``shard_bounds``); each prompt keeps the sampling seed of its global position
  (``collect.sampling_seeds``). So ``nproc`` changes where the work runs, never what is
  computed: N ranks with P prompts per step train what 1 rank with P prompts does, up to
  floating-point summation order (``tests/test_distributed.py`` compares the adapters).
* DAPO's dynamic sampling (``grpo.dynamic_sampling``) decides each refill round for all ranks
  at once: the round's prompts are drawn on every rank and rolled out in shares as above, every
  group's rewards are gathered, and each rank takes the decision one process would take over
  the whole round (the groups kept, the prompts the next round draws, when to stop). The kept
  groups, in one process's order, are then split over the ranks in balanced contiguous shares
  of rows, each group's samples sent by the rank that rolled it out (``collect.collect``). A rank
  whose share is empty (fewer kept rows than ranks) still joins every collective of the update.
* Rewards are gathered (``all_gather_object``) so advantages, reward metrics and the
  batch-level normalisers (``advantage_scale: batch``, token counts of the ``token``
  aggregation, the number of sequences) are the global batch's; each rank's loss is its
  share of the global loss, the gradients of the trainable parameters are summed over the
  ranks (``all_reduce_grads``: an all-reduce, what DDP does, without DDP's wrapper around a
  PEFT model whose forward we do not call), so every rank clips and steps on the same
  gradient and the replicas stay equal without a broadcast.
* Rank 0 writes: the run folder, checkpoints, step adapters (the other ranks' engines load
  the folder rank 0 wrote, after a barrier), the final adapter and the MLflow run (metrics
  are the global ones; ``dist/world_size`` logged). The other ranks log nowhere.
* Resume at the same world size continues; a checkpoint written at another world size is
  refused with a message naming both (per-rank random streams, e.g. dropout, would differ).

Not supported with ``nproc > 1`` (refused at config validation): compare branches (their
engines are shared across nodes in one process, ``rollout/pool.py``).

Multi-node: the same ``kedro run`` on every node with ``train.nnodes``, ``train.node_rank``,
``train.master_addr``/``master_port``; only node 0's rank 0 writes MLflow and files (a shared
filesystem is assumed for the run folder).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from qerl_pipeline.atomic import write_atomic
from qerl_pipeline.config import QerlConfig
from qerl_pipeline.platform import current_platform
from qerl_pipeline.rl import trainer
from qerl_pipeline.rl.ranks import init
from qerl_pipeline.rl.run_setup import Reporting
from qerl_pipeline.rollout.server import set_parent_death_signal
from qerl_pipeline.tracking import TrainingRun

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ launching
def launcher_command(
    nproc: int,
    payload: Path,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
) -> list[str]:
    """The torchrun command line that runs ``_worker(payload)`` on ``nproc`` ranks (per node)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
        ]
    return cmd + ["-m", "qerl_pipeline.rl.launch", str(payload)]


def launch(
    cfg,
    base_dir: Path,
    records: list[dict],
    *,
    output_dir: str | Path | None = None,
    tracking: dict | None = None,
    dataset_name: str | None = None,
    data_report: dict | None = None,
    reward_fn: str | None = None,
    on_line: Callable[[str], None] | None = None,
):
    """Run ``trainer.train`` on ``cfg.train.nproc`` ranks under torchrun, follow it, return rank 0's ``TrainResult``.

    ``tracking``: ``{"uri", "active_run_id", "name", "params"}`` for rank 0's MLflow logger
    (``tracking.TrainingRun`` with the launching process's active run), None = in memory.
    The launcher gets the parent-death signal: if this process dies, torchrun is terminated,
    which ends its workers, whose engines end with them (rollout/server.py's guard).
    """
    if reward_fn is not None and not isinstance(reward_fn, str):
        raise TypeError(
            "train.nproc > 1: the reward function must be an import path ('package.module:function'), "
            "a callable cannot be sent to the ranks"
        )
    tc = cfg.train
    work = Path(tempfile.mkdtemp(prefix="qerl-dist-"))
    (work / "records.json").write_text(json.dumps(records))
    payload = work / "payload.json"
    payload.write_text(
        json.dumps(
            {
                "config": cfg.model_dump(mode="json"),
                "base_dir": str(base_dir),
                "records": str(work / "records.json"),
                "output_dir": None if output_dir is None else str(output_dir),
                "tracking": tracking,
                "dataset_name": dataset_name,
                "data_report": data_report,
                "reward_fn": reward_fn,
                "result": str(work / "result.json"),
            },
            default=str,
        )
    )
    cmd = launcher_command(
        tc.nproc,
        payload,
        nnodes=tc.nnodes,
        node_rank=tc.node_rank,
        master_addr=tc.master_addr,
        master_port=tc.master_port,
    )
    log.info("train.nproc=%d: %s", tc.nproc, " ".join(cmd))
    tail: list[str] = []
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        preexec_fn=_die_with_parent,
    )
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-60:]
            (on_line or log.info)(line)
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait(timeout=60)
        raise
    result_path = work / "result.json"
    if rc != 0 or not result_path.exists():
        raise RuntimeError(
            f"distributed training ({tc.nproc} ranks) failed with exit code {rc}; its last lines:\n" + "\n".join(tail)
        )
    raw = json.loads(result_path.read_text())
    return trainer.TrainResult(
        Path(raw["run_dir"]),
        Path(raw["adapter_dir"]),
        raw["steps"],
        raw["resumed_from"],
        raw["run_id"],
        raw["history"],
        raw["seconds"],
        Path(raw["moved_aside"]) if raw["moved_aside"] else None,
        raw["reused"],
    )


def _die_with_parent() -> None:
    set_parent_death_signal(signal.SIGTERM)


def _worker(payload_path: str) -> int:
    """One rank: join the group, train, rank 0 writes the result file."""
    p = json.loads(Path(payload_path).read_text())
    cfg = QerlConfig.model_validate(p["config"])
    d = init(current_platform())
    # no brackets: rich markup
    logging.basicConfig(level=logging.INFO, format=f"rank {d.rank}: %(levelname)s %(name)s: %(message)s", force=True)
    tr = p.get("tracking")
    reporting = Reporting(dataset_name=p.get("dataset_name"), data_report=p.get("data_report"), progress=False)
    if d.is_main and tr:  # rank 0 logs into the launching process's run; the other ranks in memory
        import mlflow

        mlflow.set_tracking_uri(tr["uri"])
        reporting.make_logger = TrainingRun(
            tr["name"], cfg.method, tr.get("params") or {}, active_run_id=tr["active_run_id"]
        ).logger
    try:
        result = trainer.train(
            cfg,
            Path(p["base_dir"]),
            json.loads(Path(p["records"]).read_text()),
            output_dir=p["output_dir"],
            reporting=reporting,
            reward_fn=p.get("reward_fn"),
            dist=d,
        )
        if d.is_main:
            write_atomic(
                Path(p["result"]),
                json.dumps(
                    {
                        "run_dir": str(result.run_dir),
                        "adapter_dir": str(result.adapter_dir),
                        "steps": result.steps,
                        "resumed_from": result.resumed_from,
                        "run_id": result.run_id,
                        "history": result.history,
                        "seconds": result.seconds,
                        "moved_aside": str(result.moved_aside) if result.moved_aside else None,
                        "reused": result.reused,
                    },
                    default=float,
                ).encode(),
            )
    finally:
        if d.active and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1]))
