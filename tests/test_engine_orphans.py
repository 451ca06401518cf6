"""No orphans: whatever kills the process that owns an engine, every engine process ends with it.

The design is in rollout/server.py's docstring: each engine process (the server, and each
process vLLM forks or spawns below it) arms a guard that kills it when the process that
created it dies (the kernel's parent-death signal where that is safe, a polling watchdog
where it is not).

* Fast tier (no vLLM): a stand-in server that arms the same guard in the same places (at
  import as ``__main__``/``__mp_main__``, and the fork hook) and builds a tree of sleeping
  processes with ``multiprocessing`` fork and spawn, one of them forked from a thread that
  then ends. It is started by the same client code as the real engine
  (``engine.start_engine_process``) from a small owner process, from the owner's main thread
  or from a thread that ends at once. Then the owner alone, or the owner and the server
  together, are SIGKILLed, and every process of the tree must end.
* ``vllm`` tier: the same with a real ``RolloutEngine`` (server, vLLM's EngineCore and
  Worker) on a tiny random model.
* ``kedro_run`` tier (the issue's acceptance test): a real ``kedro run --pipeline=train
  --env=smoke`` in a throw-away project copy, SIGKILLed mid-training together with its
  engine server: kedro's whole process group (``kill -9 -PGID``: kedro and whatever it
  started without a new session) and the server, in one go. vLLM's EngineCore and Worker
  are deliberately not signalled by the test: before the guard they were the orphans (the
  server had no one left to shut them down), so they must end by themselves. Run on the
  code before the guard (2026-12-01), it fails: EngineCore, Worker and multiprocessing's
  resource tracker were alive 20 s after the kill.

"Ended" counts zombies as ended: the killed processes' new parent here (PID 1 of the
container) need not reap them, and a zombie holds no memory.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.project import project_copy, start_kedro, stop_kedro

DEADLINE_S = 20.0

# Stand-in for rollout/server.py: the same guard, then a tree of sleeping processes that
# report who they are and how their guard was armed.
DUMMY_SERVER = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, threading, time
    from qerl_pipeline.rollout import server

    if __name__ in ("__main__", "__mp_main__"):  # exactly as at the bottom of server.py
        server.arm_from_environment()


    def report(role):
        path = os.path.join(os.environ["ORPHAN_REPORTS"], f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"role": role, "means": server.guard_means, "ppid": os.getppid()}, f)
        os.replace(path + ".tmp", path)


    def leaf(role):
        report(role)
        time.sleep(600)


    def branch(role, methods):
        report(role)
        for m in methods:
            mp.get_context(m).Process(target=leaf, args=(f"{role}/{m}",)).start()
        time.sleep(600)


    if __name__ == "__main__":
        report("server")
        both = ["fork", "spawn"]
        mp.get_context("fork").Process(target=branch, args=("fork", both)).start()
        mp.get_context("spawn").Process(target=branch, args=("spawn", both)).start()
        # A child forked from a thread that then ends: no parent-death signal (it would fire
        # when that thread ends), the watchdog instead; it must outlive the thread.
        t = threading.Thread(target=lambda: mp.get_context("fork").Process(target=leaf, args=("thread-fork",)).start())
        t.start()
        t.join()
        time.sleep(600)
    """
)

# The owner: starts the stand-in through the client's code path, prints its pid, sleeps.
OWNER = textwrap.dedent(
    """
    import os, sys, threading, time
    from qerl_pipeline.rollout.engine import start_engine_process

    dummy, log, mode = sys.argv[1:4]

    def start():
        with open(log, "ab") as f:
            proc = start_engine_process([sys.executable, dummy], dict(os.environ), f)
        print(proc.pid, flush=True)

    if mode == "thread":  # started from a worker thread that ends right away
        t = threading.Thread(target=start)
        t.start()
        t.join()
    else:
        start()
    time.sleep(600)
    """
)

# The owner of a real engine.
ENGINE_OWNER = textwrap.dedent(
    """
    import sys, time
    from qerl_pipeline.rollout.engine import RolloutEngine

    engine = RolloutEngine(sys.argv[1], max_model_len=128, max_lora_rank=None, log_file=sys.argv[2])
    print(engine.pid, flush=True)
    time.sleep(3600)
    """
)

TREE_ROLES = {"server", "fork", "fork/fork", "fork/spawn", "spawn", "spawn/fork", "spawn/spawn", "thread-fork"}


# ----------------------------------------------------------------------------- helpers
def _ended(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_ended(procs: list[psutil.Process], timeout: float = DEADLINE_S) -> tuple[list[psutil.Process], float]:
    """(the processes still running after ``timeout``, seconds until the last one ended)."""
    t0 = time.monotonic()
    while True:
        alive = [p for p in procs if not _ended(p)]
        if not alive or time.monotonic() - t0 > timeout:
            return alive, time.monotonic() - t0
        time.sleep(0.05)


def _read_pid(owner: subprocess.Popen, timeout: float, log: Path) -> int:
    ready, _, _ = select.select([owner.stdout], [], [], timeout)
    line = owner.stdout.readline() if ready else b""
    if not line.strip():
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        raise AssertionError(f"owner printed no engine pid within {timeout} s (exit code {owner.poll()})\n{tail}")
    return int(line)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # ended meanwhile (or a zombie)
        return ""


def _in_groups(pgids: set[int]) -> list[psutil.Process]:
    """Every process whose process group is one of ``pgids`` (re-parented ones included)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return found


GUARD_LINE = re.compile(r"^\[qerl engine guard\] pid (\d+) parent \d+: (pdeathsig|watchdog)$", re.M)


def _unguarded(procs: list[psutil.Process], engine_log: str) -> list[tuple[int, str]]:
    """The engine processes that wrote no guard line into the engine log (the resource tracker never does)."""
    guarded = {int(pid) for pid, _ in GUARD_LINE.findall(engine_log)}
    return [(p.pid, _cmd(p)[:80]) for p in procs if p.pid not in guarded and "resource_tracker" not in _cmd(p)]


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:  # psutil checks the create time, so a reused pid is never hit
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _kill_and_check(owner, server, who: str, procs) -> float:
    """Kill ``who`` (owner, server or both) and assert every process of ``procs`` ends in time."""
    _kill(owner, server, who)
    alive, seconds = _wait_ended(procs)
    assert not alive, f"orphans after {DEADLINE_S} s: {[(p.pid, p.cmdline()) for p in alive]}"
    return seconds


def _cleanup(owner, procs) -> None:
    if owner.poll() is None:
        owner.kill()
        owner.wait()
    _kill_all(procs)


def _kill(owner: subprocess.Popen, server: psutil.Process, who: str) -> None:
    os.kill(owner.pid, signal.SIGKILL)
    if who == "together":
        server.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)


# ----------------------------------------------------------------------------- fast tier
@pytest.mark.parametrize("who", ["owner", "together"])
@pytest.mark.parametrize("mode", ["main", "thread"])
def test_every_process_of_a_stand_in_engine_ends_with_its_owner(tmp_path, mode, who):
    dummy = tmp_path / "dummy_server.py"
    dummy.write_text(DUMMY_SERVER)
    reports = tmp_path / "reports"
    reports.mkdir()
    log = tmp_path / "engine.log"
    env = dict(os.environ, ORPHAN_REPORTS=str(reports))
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(dummy), str(log), mode], stdout=subprocess.PIPE, env=env
    )
    procs: list[psutil.Process] = []
    try:
        server = psutil.Process(_read_pid(owner, 120, log))
        deadline = time.monotonic() + 60
        while len(list(reports.glob("*.json"))) < len(TREE_ROLES) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the threads that started the server / "thread-fork" have ended by now
        found = {int(p.stem): json.loads(p.read_text()) for p in reports.glob("*.json")}
        roles = {r["role"]: (pid, r) for pid, r in found.items()}
        assert set(roles) == TREE_ROLES, f"{sorted(roles)}\n{log.read_text(errors='replace')}"
        procs = _tree(server.pid)
        assert {p.pid for p in procs} >= set(found)  # (plus multiprocessing's resource tracker)
        assert not [p for p in procs if _ended(p)], "a process died before its owner (thread-bound death signal?)"
        # The parent-death signal only where the creating thread is its process's main thread.
        expected = {role: "pdeathsig" for role in TREE_ROLES}
        expected["thread-fork"] = "watchdog"
        expected["server"] = "pdeathsig" if mode == "main" else "watchdog"
        assert {role: r["means"] for role, (_, r) in roles.items()} == expected

        seconds = _kill_and_check(owner, server, who, procs)
        print(f"mode={mode} kill={who}: {len(procs)} processes ended {seconds:.2f} s after the kill")
    finally:
        _cleanup(owner, procs)


def test_a_guard_armed_after_its_parent_died_ends_the_process(tmp_path):
    """The race: the parent dies before the death signal is set; the check right after it sees that."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = (
        "import sys, time\n"
        "from qerl_pipeline.rollout import server\n"
        f"server.guard({gone.pid}, True)\n"
        "print('survived', flush=True)\n"
        "time.sleep(30)\n"
    )
    t0 = time.monotonic()
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child
    assert b"survived" not in child.stdout
    assert b"was gone before the guard was armed" in child.stderr
    assert time.monotonic() - t0 < 20


# ----------------------------------------------------------------------------- vllm tier
@pytest.mark.vllm
def test_killing_the_owner_and_the_server_together_leaves_no_vllm_process(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm")
    log = tmp_path / "engine.log"
    # vLLM's process chain (EngineCore, Worker), as on CUDA: on CPU the engine runs it in the server otherwise
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    owner = subprocess.Popen(
        [sys.executable, "-c", ENGINE_OWNER, str(tiny_model_dir), str(log)], stdout=subprocess.PIPE, env=env
    )
    procs: list[psutil.Process] = []
    try:
        server = psutil.Process(_read_pid(owner, 600, log))
        procs = _tree(server.pid)
        text = log.read_text(errors="replace")
        names = [" ".join(p.cmdline())[:80] for p in procs]
        assert len(procs) >= 2, f"expected vLLM's EngineCore below the server: {names}"
        # Every Python process of the engine armed its guard (vLLM's EngineCore and Worker too).
        unguarded = _unguarded(procs, text)
        assert not unguarded, f"engine processes without a guard: {unguarded}\n{names}"

        seconds = _kill_and_check(owner, server, "together", procs)
        print(
            f"{len(procs)} engine processes ({', '.join(p.name() for p in procs)}) ended {seconds:.2f} s after "
            "the kill"
        )
    finally:
        _cleanup(owner, procs)


# ----------------------------------------------------------------------------- kedro_run tier
SERVER_MODULE = "qerl_pipeline.rollout.server"


@pytest.mark.vllm
@pytest.mark.kedro_run
def test_sigkill_of_a_training_run_and_its_engine_server_leaves_no_engine_process(tmp_path, request):
    """The issue's acceptance test: ``kill -9`` of a ``kedro run``'s process group and of its
    engine server mid-training; a few seconds later no process of the run is left."""
    pytest.importorskip("vllm")
    root = project_copy(tmp_path / "project")
    out = tmp_path / "out"
    # TMPDIR: the engine's temp dir (its log) stays here after the kill. A short folder of its own under /tmp, not
    # in tmp_path: vLLM puts its ZMQ ipc sockets in TMPDIR, and a socket path is at most 107 characters, which an
    # xdist worker's tmp_path (.../pytest-of-root/pytest-0/popen-gw0/test_sigkill_of_.../t/<uuid>) exceeds.
    scratch = Path(tempfile.mkdtemp(prefix="qerl-orphans-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    log = tmp_path / "kedro.log"  # kept for a look after a failure
    step_1_done = out / "qerl" / "adapters" / "step-000001"
    run: subprocess.Popen | None = None
    procs: list[psutil.Process] = []
    try:
        # Its own process group (start_kedro): the group is kedro's process tree minus the engine,
        # which leads a session of its own. 10 steps: killed in step 2, far from the end.
        run = start_kedro(
            root,
            "run",
            "--pipeline=train",
            "--env=smoke",
            "--params",
            f"train.steps=10,train.checkpoint_every=10,train.output_dir={out}",
            log=log,
            env={"TMPDIR": str(scratch), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        )

        # Training is underway: step 1's adapter is saved (step 2's rollout has begun) and the
        # engine server runs below kedro with vLLM's processes below it.
        deadline = time.monotonic() + 900
        while not step_1_done.is_dir():
            assert run.poll() is None, (
                f"kedro run exited ({run.returncode}) before step 1 ended\n" + log.read_text(errors="replace")[-6000:]
            )
            assert time.monotonic() < deadline, (
                "step 1 did not end within 900 s\n" + log.read_text(errors="replace")[-6000:]
            )
            time.sleep(0.05)
        procs = _tree(run.pid)
        servers = [p for p in procs if f"-m {SERVER_MODULE}" in _cmd(p)]
        assert len(servers) == 1, f"expected one engine server below kedro: {[_cmd(p) for p in procs]}"
        server = servers[0]
        engine = _tree(server.pid)
        assert len(engine) >= 2, f"expected vLLM's EngineCore below the server: {[_cmd(p) for p in engine]}"
        # Every Python process of the engine armed its guard (the log: the server's stdout).
        engine_log = Path(os.readlink(f"/proc/{server.pid}/fd/1")).read_text(errors="replace")
        unguarded = _unguarded(engine, engine_log)
        assert not unguarded, f"engine processes without a guard: {unguarded}"
        means = dict(GUARD_LINE.findall(engine_log))
        described = [f"{p.pid} {_cmd(p)[:60]} ({means.get(str(p.pid), '-')})" for p in procs]
        groups = {run.pid, server.pid}

        t0 = time.monotonic()
        server.send_signal(signal.SIGKILL)  # psutil: never a reused pid
        stop_kedro(run)  # right after: SIGKILL of kedro's whole group (kedro and all it started outside new sessions)
        assert not (out / "qerl" / "final_adapter").exists(), "the run had finished: not killed mid-training"

        # Everything of the run: the snapshot, plus any process still in kedro's or the engine's
        # process group (a process started after the snapshot; vLLM's stay in the server's group).
        procs += _in_groups(groups)
        alive, _ = _wait_ended(procs, timeout=DEADLINE_S)
        seconds = time.monotonic() - t0
        procs += _in_groups(groups)
        left = sorted({(p.pid, _cmd(p)[:120]) for p in procs if not _ended(p)})
        assert not left, f"processes of the killed run alive {DEADLINE_S} s after the kill: {left}"
        print(f"kedro run killed in step 2: {len(set(procs))} processes ended within {seconds:.2f} s of the kill:")
        print("\n".join(described))
    finally:  # also after a failure: every process of the run, by psutil handle (never a reused pid)
        if run is not None and run.poll() is None:
            try:
                procs += _tree(run.pid)
            except psutil.Error:
                pass
            stop_kedro(run)
        _kill_all(procs)
