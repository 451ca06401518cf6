"""A fake rollout engine for tests that drive the trainer or the engine sleeper without vLLM.

It records its calls and answers what ``rl/trainer.py`` and ``rollout/sleep.py`` ask of a
``RolloutEngine``: deterministic completions (a hash of the prompt, its request's seed, the
adapter's bytes and its state: a prompt's samples do not depend on the other prompts of the
call, as vLLM's seeded requests) with the log-probs of confident tokens, norm weights to update
and read back, adapters to register, sleep and wake (with optional faults on wake), and
optionally the nondeterminism of CUDA kernels (``near_tie``).
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import torch

from qerl_pipeline.rollout.engine import GenerateResult, Sample, adapter_version


class FakeEngine:
    """Records every call in ``calls``. Outputs are a hash of (prompt, seed, adapter files, state).

    ``fault``: what a wake does: None (nothing), "drop" (vLLM forgets its adapters: none listed
    until re-registered after a reset), "drop_forever" (never lists one again), "corrupt"
    (outputs change until its adapters are dropped), "broken" (outputs change for good),
    "unsure" (the same tokens, every log-prob 2 nats lower, for good: a model that lost what
    made it confident).

    ``near_tie=(probability, seed)``: every greedy completion ends on a near tie (two tokens at
    about log(1/2) each) that the engine resolves the other way with that probability per call,
    and every log-prob moves by up to 1e-3 per call: what split-K fp32 atomics do on CUDA
    (rollout/sleep.py), with no sleep involved.
    """

    def __init__(
        self,
        fault: str | None = None,
        cuda: bool = True,
        norms: dict[str, torch.Tensor] | None = None,
        near_tie: tuple[float, int] | None = None,
    ):
        self.fault = fault
        self.flip = near_tie[0] if near_tie else 0.0
        self.noise = random.Random(near_tie[1]) if near_tie else None
        self.unsure = False
        self.flips = 0  # greedy completions whose near tie went the other way
        self.info = {"cuda": cuda, "dtype": "float32", "startup_s": 0.0, "pid": 0}
        self.calls: list[tuple] = []
        self.asleep = False
        self.salt = 0  # != 0: the served model changed
        self.stale = False  # adapters give other outputs until reset_adapters
        self.ids: dict[str, tuple[tuple, int]] = {}
        self.next_id = 1
        self.loaded: set[int] = set()
        self.dropping = False  # a wake made vLLM forget its adapters; registering does not bring them back
        self.lost_for_good = False
        self.served = dict(norms or {})
        self.closed = False

    def _id(self, path: str) -> int:
        version = adapter_version(Path(path))
        known = self.ids.get(path)
        if known is None or known[0] != version:
            self.ids[path] = (version, self.next_id)
            self.next_id += 1
        return self.ids[path][1]

    def merge_adapter(self, lora_path):
        self.calls.append(("merge", None if lora_path is None else str(lora_path)))
        return 0.0

    def unmerge(self):
        return self.merge_adapter(None)

    def generate(self, prompts, *, n, temperature, top_p, max_new_tokens, seed=None, lora_path=None, ignore_eos=False):
        self.calls.append(
            (
                "generate",
                [list(p) for p in prompts],
                n,
                temperature,
                None if lora_path is None else str(lora_path),
                self.asleep,
            )
        )
        self.asleep = False  # the real server wakes first; so does this one
        content = b""
        if lora_path is not None:
            lid = self._id(str(Path(lora_path).resolve()))
            if not (self.dropping or self.lost_for_good):
                self.loaded.add(lid)
            content = (Path(lora_path) / "adapter_model.safetensors").read_bytes()
        groups = []
        for p_i, prompt in enumerate(prompts):
            group = []
            for i in range(n):
                own = seed[p_i] if isinstance(seed, (list, tuple)) else seed  # vLLM seeds each request on its own
                key = repr((list(prompt), i if temperature > 0 else 0, own, self.salt, self.stale)).encode() + content
                digest = hashlib.sha256(key).digest()
                ids = [1 + b % 200 for b in digest[:max_new_tokens]]
                lps = [-(b % 8) / 100 - (2.0 if self.unsure else 0.0) for b in digest[:max_new_tokens]]
                if self.noise is not None and temperature == 0 and ids:
                    lps[-1] = math.log(0.5) - 0.001  # the last token nearly ties with another one
                    if self.noise.random() < self.flip:
                        ids[-1] = 1 + ids[-1] % 200  # the other one
                        self.flips += 1
                    lps = [min(0.0, x + self.noise.uniform(-1e-3, 1e-3)) for x in lps]
                group.append(Sample(list(prompt), ids, "ab" * (1 + digest[0] % 4) + "1", lps, "length"))
            groups.append(group)
        tokens = sum(len(s.completion_ids) for g in groups for s in g)
        return GenerateResult(groups, 0.01, tokens, tokens / 0.01)

    def sleep(self, level=None):
        self.calls.append(("sleep", level))
        self.asleep = True
        return True

    def wake_up(self):
        self.calls.append(("wake",))
        was, self.asleep = self.asleep, False
        if was and self.fault in ("drop", "drop_forever"):
            self.loaded.clear()
            self.dropping = True
            self.lost_for_good = self.fault == "drop_forever"
        if was and self.fault == "corrupt":
            self.stale = True
        if was and self.fault == "broken":
            self.salt += 1
        if was and self.fault == "unsure":
            self.unsure = True
        return {"was_asleep": was, "level": None, "reloaded": False, "reapplied": []}

    def register_adapter(self, path):
        path = str(Path(path).resolve())
        self.calls.append(("register", path))
        lid = self._id(path)
        if not (self.dropping or self.lost_for_good):
            self.loaded.add(lid)
        return {"lora_id": lid, "added": True, "loaded": sorted(self.loaded)}

    def loaded_adapters(self):
        return sorted(self.loaded)

    def reset_adapters(self):
        self.calls.append(("reset",))
        removed = sorted(self.loaded)
        self.loaded.clear()
        self.ids.clear()
        self.stale = False
        self.dropping = False
        return removed

    # what the trainer needs besides
    def norm_weight_names(self):
        return sorted(self.served)

    def update_weights(self, tensors):
        self.calls.append(("update_weights", sorted(tensors)))
        self.served.update({k: v.detach().clone() for k, v in tensors.items()})
        return 0.0

    def read_weights(self, names):
        return {n: self.served[n].clone() for n in names}

    def close(self):
        self.closed = True
