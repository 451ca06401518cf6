"""Sleep the rollout engine between rollout and update on one GPU, and check it on wake.

Why: on one GPU the engine holds its weights and a KV cache sized by
``rollout.gpu_memory_utilization`` while the trainer's update (packed base, LoRA, optimizer,
activations) needs the same GPU. vLLM's sleep mode (``LLM(enable_sleep_mode=True)``, then
``LLM.sleep(level)`` / ``LLM.wake_up(tags)``; CUDA's cumem allocator) frees that memory during
the update. Per step the trainer calls ``EngineSleeper.before_update`` (sleep) right before
``policy_update`` and ``EngineSleeper.after_update(new_adapter_dir)`` right after saving the
new adapter (wake, check, register the adapter the next rollout uses).

The decision (``sleep_plan``; pure, the platform is a parameter)::

    platform  colocated  sleep_between_steps  -> enabled  level               why
    cpu       any        any                     no       -                   vLLM-CPU has no sleep mode
    cuda      no         any                     no       -                   the engine is not on this rank's GPU
    cuda      yes        false                   no       -                   switched off
    cuda      yes        true                    yes      rollout.sleep_level level 1: weights to host RAM, KV freed;
                                                                              level 2: both discarded, weights reloaded

``colocated`` comes from ``layout.engine_plan`` (the engine shares the GPU this rank trains
on). The platform is the engine's (``engine_platform``: the engine process reports
``info["cuda"]``), which a fake engine can set, so the CUDA path runs in CPU tests.

What vLLM-CPU 0.32 does (read in its source): ``ModelConfig`` with ``enable_sleep_mode=True``
raises ``ValueError("Sleep mode is not supported on current platform.")``
(``vllm/config/model.py``, ``Platform.is_sleep_mode_available``: CUDA, ROCm, XPU only);
without it, ``LLM.sleep`` pauses the scheduler and ``CPUWorker.sleep``/``wake_up`` only log
"sleep mode is not supported on CPU, ignore it." So the engine never enables sleep mode on
CPU (rollout/server.py) and this module never sleeps there; tests assert the ValueError.

Guards against known vLLM bugs (why ``after_update`` checks, not trusts, the wake):

* LoRA lost or silently inactive after a wake: vLLM #53888 (level 1, NVFP4 base served by
  Marlin, TP=2: after ``wake_up`` the adapter "silently stops applying" and fixed-seed
  outputs diverge, no error). Check: before the sleep a greedy probe (a few tokens of one
  prompt of the step, reversed so it misses the prefix cache, with the adapter the rollout
  just used) is recorded with its log-probs; after the wake the same probe must agree with it
  (``probe_agrees``, below). Then the next adapter is registered (``register_adapter``: loaded
  now under the id the next rollout uses) and must appear in vLLM's ``list_loras``. Repair:
  drop every adapter (``reset_adapters``; the next request reloads the folder under a new id)
  and probe again; if it still disagrees, ``WakeCheckError`` says what differed and how to
  turn sleep off.

Why agreement, not equal tokens: the same greedy probe can give other tokens with no sleep at
all. vLLM's CUDA LoRA shrink (``vllm/lora/ops/triton_ops/lora_shrink_op.py``, configured by
``get_lora_op_configs`` in ``utils.py``) splits the hidden dimension into 64 partial sums below
128 tokens (8 above) and adds them with fp32 ``tl.atomic_add`` (``kernel_utils.py``), in
whatever order the blocks finish, unless vLLM's batch-invariant mode is on; the sums differ in
their last bits run to run, the bf16 logits by a rounding step, and where two tokens nearly tie
for the top the greedy choice flips. A 500-step run would meet such a flip. ``probe_agrees``
compares position by position: where the tokens are equal their log-probs must agree within
``PROBE_LOGPROB_TOLERANCE``; at the first position where they differ, both chosen tokens must
be a near tie (their log-probs within the tolerance of each other, and neither above
``log(1/2)`` + tolerance: of two tokens that tie, neither can hold more than half the mass);
what follows a flip is another text and is not compared. A model that lost its adapter or its
weights moves the log-probs by whole nats, or changes a confident token, and is caught. The
tolerance (0.2 nats) is a few bf16 rounding steps of logits of typical size (one step of a
logit near 20 is 0.125), chosen, not measured on a GPU; an adapter whose effect on the probe
is smaller than it is not told from a lost one (the check then passes, as it would for a
harmless difference).
* Level 2 needs the weights reloaded: vLLM's own docs (level 2 "discards" the weights, for
  "a different model or update the model"), ms-swift #7017 ("sleep_level 2 causes gibberish
  outputs", fixed by a weight sync after wake), verl #3461 (LoRA + level 2: base weights not
  loaded), vllm-ascend #13012 (the ``wake_up(["weights"])``, ``reload_weights``,
  ``wake_up(["kv_cache"])`` sequence). The engine process runs that sequence and re-applies
  its in-place updates (rollout/server.py). vLLM #39934 (``reload_weights`` with
  ``enable_lora`` raised KeyError on ``base_layer`` names, vLLM 0.17; fix PR #48337): vLLM
  0.32's reload resolves ``base_layer`` names (``model_loader/reload/inplace.py``). Checked on
  vLLM-CPU 0.32 with ``enable_lora`` (the server's level-2 path forced on a tiny model; CPU
  discards nothing, so this checks the calls, not the memory): the sequence runs, vLLM lists
  no adapter after the reload, the adapter reloads under a new id, and the greedy tokens equal
  those before the sleep only because the norm update is re-applied. Not checked: a real
  level-2 discard on CUDA, and the reload of a packed NVFP4 base (its Marlin repacking); the
  probe above would catch a bad reload, so level 2 stays opt-in.

Metrics (the dict ``after_update`` returns, merged into the step's metrics): ``time/sleep_s``
(the sleep call), ``time/wake_s`` (the wake, level-2 reload included), ``time/wake_check_s``
(both probes and the registration), ``sleep/repairs`` (adapter resets needed this step). An
inactive plan returns ``{}`` (no sleep metrics).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

from qerl_pipeline import metric_names
from qerl_pipeline.memory import release_trainer_cache

log = logging.getLogger(__name__)

#: Greedy tokens of the wake probe (and the prompt tokens it keeps): enough to see a changed model.
PROBE_TOKENS = 8
PROBE_PROMPT_TOKENS = 64
#: Nats by which a probe token's log-prob may move across a wake (module docstring, "Why agreement").
PROBE_LOGPROB_TOLERANCE = 0.2
#: The highest log-prob a token can have while another token ties with it: log(1/2).
_TIE_LOGPROB = math.log(0.5)


class Probe(NamedTuple):
    """A greedy probe's answer: the tokens and each one's log-prob."""

    tokens: list[int]
    logprobs: list[float]


def probe_agrees(before: Probe, after: Probe, tolerance: float = PROBE_LOGPROB_TOLERANCE) -> bool:
    """Whether ``after`` is ``before`` up to the nondeterminism of the engine's kernels (module docstring).

    Equal tokens need log-probs within ``tolerance``; at the first differing token both choices
    must be a near tie; the rest is not compared. A missing (NaN) log-prob agrees with nothing.
    """
    # not strict: the two may differ in length past their first differing token (the return below)
    for tok_b, lp_b, tok_a, lp_a in zip(before.tokens, before.logprobs, after.tokens, after.logprobs, strict=False):
        close = abs(lp_b - lp_a) <= tolerance  # False for NaN
        if tok_b == tok_a:
            if not close:
                return False
            continue
        return close and max(lp_b, lp_a) <= _TIE_LOGPROB + tolerance
    return len(before.tokens) == len(after.tokens)


class WakeCheckError(RuntimeError):
    """The engine does not serve after a wake what it served before, even after dropping its adapters."""


class SleepPlan(NamedTuple):
    """``sleep_plan``'s answer; unpacks as ``(enabled, level, why)``."""

    enabled: bool
    level: int | None
    why: str


def sleep_plan(rollout_cfg: Any, platform: str, colocated: bool) -> SleepPlan:
    """Whether the engine sleeps during each update, at which level, and why (the module's table)."""
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"unknown platform {platform!r}; expected cuda or cpu")
    if platform == "cpu":
        return SleepPlan(
            False,
            None,
            "CPU: vLLM-CPU has no sleep mode (enable_sleep_mode raises 'Sleep mode is not "
            "supported on current platform.'); the engine's memory is host RAM",
        )
    if not colocated:
        return SleepPlan(
            False, None, "the engine is not on this rank's GPU: sleeping it frees nothing the update uses"
        )
    if not getattr(rollout_cfg, "sleep_between_steps", False):
        return SleepPlan(False, None, "rollout.sleep_between_steps is false")
    level = int(getattr(rollout_cfg, "sleep_level", 1))
    if level == 1:
        return SleepPlan(True, 1, "level 1: weights offloaded to CPU RAM and KV cache freed during each update")
    if level == 2:
        return SleepPlan(
            True,
            2,
            "level 2: weights and KV cache discarded during each update; on wake the weights "
            "are reloaded from the served folder and the in-place updates re-applied",
        )
    raise ValueError(f"rollout.sleep_level {level}: expected 1 or 2")


def engine_platform(engine: Any, default: str) -> str:
    """``cuda`` or ``cpu``: where the engine runs, as its process reported (``info["cuda"]``), else ``default``."""
    info = getattr(engine, "info", None) or {}
    if "cuda" not in info:
        return default
    return "cuda" if info["cuda"] else "cpu"


class EngineSleeper:
    """Sleeps ``engine`` around each update as ``plan`` says, and checks it when it wakes.

    ``engine``: a ``RolloutEngine`` (or anything with ``generate``, ``sleep(level)``,
    ``wake_up``, ``register_adapter``, ``loaded_adapters``, ``reset_adapters``);
    ``probe_tokens``: greedy tokens of the wake probe (0: no probe, only the registration
    check). Call ``before_update`` then ``after_update`` once per step.
    """

    def __init__(self, engine: Any, plan: SleepPlan, *, probe_tokens: int = PROBE_TOKENS):
        self.engine = engine
        self.plan = plan
        self.probe_tokens = int(probe_tokens)
        self._probe: tuple[list[int], str | None, Probe] | None = None  # (prompt, adapter folder, its answer)
        self._sleep_s = 0.0
        self._check_s = 0.0
        self._asleep = False

    @property
    def enabled(self) -> bool:
        return self.plan.enabled

    def _run_probe(self, prompt: list[int], adapter: str | None) -> Probe:
        res = self.engine.generate(
            [prompt], n=1, temperature=0.0, top_p=1.0, max_new_tokens=self.probe_tokens, seed=0, lora_path=adapter
        )
        sample = res.samples[0][0]
        return Probe(list(sample.completion_ids), [float(x) for x in sample.logprobs])

    def before_update(self, adapter_dir: str | Path | None = None, prompt_ids: list[int] | None = None) -> dict:
        """Record the probe (the rollout's adapter ``adapter_dir``, a prompt of the step) and sleep."""
        if not self.enabled:
            return {}
        if self._asleep:
            raise RuntimeError("EngineSleeper.before_update called twice without after_update")
        t0 = time.perf_counter()
        self._probe = None
        if self.probe_tokens > 0 and prompt_ids:
            # reversed: not a prefix of any rollout prompt, so no cached KV from the batch enters the probe
            prompt = [int(t) for t in list(prompt_ids)[-PROBE_PROMPT_TOKENS:]][::-1]
            adapter = None if adapter_dir is None else str(Path(adapter_dir).resolve())
            self._probe = (prompt, adapter, self._run_probe(prompt, adapter))
        self._check_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        slept = self.engine.sleep(self.plan.level)
        self._sleep_s = time.perf_counter() - t0
        self._asleep = True
        if not slept:
            log.warning("engine did not go to sleep (sleep mode off in the engine, or asleep already)")
        return {metric_names.SLEEP_TIME_S: self._sleep_s}

    def after_update(self, adapter_dir: str | Path | None) -> dict:
        """Wake, check the probe, register ``adapter_dir`` (the next rollout's); the step's sleep metrics."""
        if not self.enabled:
            return {}
        if not self._asleep:
            raise RuntimeError("EngineSleeper.after_update called without before_update")
        release_trainer_cache()  # the update's cached activation memory goes back before the engine takes its own
        t0 = time.perf_counter()
        woke = self.engine.wake_up()
        wake_s = time.perf_counter() - t0
        self._asleep = False
        t0 = time.perf_counter()
        repairs = 0
        if self._probe is not None:
            repairs += self._check_probe(woke)
        if adapter_dir is not None:  # None: an engine without LoRA
            repairs += self._check_registered(Path(adapter_dir))
        check_s = self._check_s + time.perf_counter() - t0
        return {
            metric_names.SLEEP_TIME_S: self._sleep_s,
            metric_names.WAKE_TIME_S: wake_s,
            metric_names.WAKE_CHECK_TIME_S: check_s,
            metric_names.SLEEP_REPAIRS: repairs,
        }

    def _check_probe(self, woke: Any) -> int:
        prompt, adapter, before = self._probe
        after = self._run_probe(prompt, adapter)
        if probe_agrees(before, after):
            return 0
        log.warning(
            "engine output changed across sleep/wake (level %s; %s): before %s after %s; dropping its adapters "
            "(vLLM #53888) and probing again",
            self.plan.level,
            woke,
            _shown(before),
            _shown(after),
        )
        self.engine.reset_adapters()
        again = self._run_probe(prompt, adapter)
        if not probe_agrees(before, again):
            raise WakeCheckError(
                f"after waking from sleep level {self.plan.level} the engine serves another model than before it "
                f"(greedy probe with adapter {adapter}: before {_shown(before)}, after {_shown(after)}, after "
                f"dropping its adapters {_shown(again)}; tokens may differ only at a near tie and log-probs by "
                f"{PROBE_LOGPROB_TOLERANCE} nats): its weights did not come back as they were (vLLM #53888; for level "
                "2 a failed reload). Set rollout.sleep_between_steps: false (or rollout.sleep_level: 1)"
            )
        return 1

    def _check_registered(self, adapter_dir: Path) -> int:
        reg = self.engine.register_adapter(adapter_dir)
        if reg["lora_id"] in reg["loaded"]:
            return 0
        log.warning(
            "adapter %s (LoRA id %s) not listed by the engine after wake (listed: %s); reloading it",
            adapter_dir,
            reg["lora_id"],
            reg["loaded"],
        )
        self.engine.reset_adapters()
        reg = self.engine.register_adapter(adapter_dir)
        if reg["lora_id"] not in reg["loaded"]:
            raise WakeCheckError(
                f"after waking from sleep level {self.plan.level} the engine does not hold adapter {adapter_dir} "
                f"(LoRA id {reg['lora_id']}; it lists {reg['loaded']}) even after reloading it: the next rollout "
                "would run without it. Set rollout.sleep_between_steps: false"
            )
        return 1


def _shown(probe: Probe) -> str:
    """A probe for a message: its tokens, then its log-probs to 3 decimals."""
    return f"{probe.tokens} (log-probs {[round(x, 3) for x in probe.logprobs]})"
