"""``RewardScorer``: the reward of each completion, accuracy scored in worker subprocesses
under a per-item time limit, safe to call from any thread.

math-verify's own timeout uses ``signal.alarm``, which raises off the main thread.
We disable it (``parsing_timeout=None``, ``timeout_seconds=None``) and enforce our own:
``RewardScorer`` keeps ``reward.max_workers`` worker *subprocesses* (plain
``subprocess.Popen`` of this interpreter, so they start from threads, from daemonic
worker processes and inside ``kedro run`` alike, with no fork of the caller), sends
each completion to an idle worker and kills the worker if the answer is not back within
``reward.timeout_s``: that completion scores accuracy 0 with ``timed_out=True`` and a
fresh worker replaces the killed one. A pathological completion costs at most
``timeout_s`` of one worker; the others keep going. Golds are parsed once per worker
(LRU cache). Each worker runs ``rewards.extraction.score_accuracy``; the format reward
(``rewards.format``) is computed in the caller's process.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from qerl_pipeline.config import RewardConfig
from qerl_pipeline.config import parse as parse_section
from qerl_pipeline.rewards.extraction import score_accuracy
from qerl_pipeline.rewards.format import format_reward

log = logging.getLogger(__name__)

_WORKER_START_TIMEOUT_S = 120.0


def _worker_main() -> None:
    """Subprocess loop: one JSON request per stdin line, one JSON answer per line.

    Ends when stdin closes or the parent stops reading (parent gone: an orphaned worker
    exits by itself instead of lingering).
    """
    try:
        _worker_loop()
    except (BrokenPipeError, KeyboardInterrupt):
        pass


def _worker_loop() -> None:
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    sys.stdout = sys.stderr
    score_accuracy("<answer>1</answer>", "1")  # warm imports and regex caches
    proto.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            out = score_accuracy(req["c"], req["g"], req["tag"], req["plain"])
        except Exception as err:  # a scoring error is accuracy 0, reported
            out = {
                "accuracy": 0.0,
                "extracted": None,
                "gold_parsed": False,
                "rejected": None,
                "error": repr(err)[:200],
            }
        proto.write((json.dumps(out) + "\n").encode())


class _Worker:
    """One scoring subprocess and its line buffer."""

    def __init__(self) -> None:
        src = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from qerl_pipeline.rewards.scorer import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None
        self.deadline = 0.0

    def read_lines(self) -> list[bytes] | None:
        """Lines available to read; None when the worker closed its output (died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return lines

    def send(self, item: int, completion: str, gold: str, cfg: RewardConfig) -> None:
        self.item = item
        self.deadline = time.monotonic() + cfg.timeout_s
        req = {"c": completion, "g": gold, "tag": cfg.answer_tag_as_boxed, "plain": cfg.anchored_plain_answers}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class RewardScorer:
    """Scores completions against golds in worker subprocesses with a per-item time limit.

    ``score(completions, golds)`` returns one dict per completion with keys ``reward``,
    ``accuracy``, ``format``, ``extracted`` (parsed answer as str, or None),
    ``timed_out``, ``gold_parsed`` (False flags a gold math-verify cannot parse;
    None when unknown because the item timed out or its worker died) and ``rejected``
    (the name of the cheap check that rejected the answer before math-verify, else None;
    ``self.rejections`` counts them by name, ``self.timeouts`` the timeouts).
    Thread-safe (calls are serialised); use as a context manager or call ``close()``.
    """

    def __init__(self, cfg: RewardConfig | dict | None = None) -> None:
        self.cfg: RewardConfig = parse_section(RewardConfig, cfg, "reward")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [_Worker() for _ in range(self.cfg.max_workers)]
        self._closed = False
        self.timeouts = 0  # completions that hit the time limit since creation
        self.rejections: Counter[str] = Counter()  # completions a cheap check rejected, by check name

    # -- lifecycle
    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            for w in self._workers:
                w.kill()
            self._workers = []
            self._closed = True

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    # -- scoring
    def score(self, completions: list[str], golds: list[str]) -> list[dict]:
        """Rewards for ``completions[i]`` against ``golds[i]`` (same length)."""
        if len(completions) != len(golds):
            raise ValueError(f"score: {len(completions)} completions but {len(golds)} golds")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer is closed")
            acc = self._run([str(c) for c in completions], [str(g) for g in golds])
            self.rejections.update(a["rejected"] for a in acc if a.get("rejected"))
        out = []
        for completion, a in zip(completions, acc, strict=True):
            fmt = format_reward(str(completion), self.cfg.format_reward, self.cfg.format_style)
            out.append(
                {
                    "reward": self.cfg.accuracy_weight * a["accuracy"] + self.cfg.format_weight * fmt,
                    "accuracy": a["accuracy"],
                    "format": fmt,
                    "extracted": a["extracted"],
                    "timed_out": a["timed_out"],
                    "gold_parsed": a["gold_parsed"],
                    "rejected": a.get("rejected"),
                }
            )
        return out

    def _run(self, completions: list[str], golds: list[str]) -> list[dict]:
        n = len(completions)
        results: list[dict | None] = [None] * n
        pending = list(range(n - 1, -1, -1))  # pop() takes the lowest index first
        sel = selectors.DefaultSelector()
        for w in self._workers:
            sel.register(w.fd, selectors.EVENT_READ, w)
        try:
            while pending or any(w.item is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.item is None and pending:
                        i = pending.pop()
                        try:
                            w.send(i, completions[i], golds[i], self.cfg)
                        except (BrokenPipeError, OSError):
                            pending.append(i)
                            w.item = None
                            self._replace(w, sel, "its input pipe broke")
                now = time.monotonic()
                waits = [w.deadline - now for w in self._workers if w.item is not None]
                waits += [w.started + _WORKER_START_TIMEOUT_S - now for w in self._workers if not w.ready]
                events = sel.select(timeout=max(0.0, min(waits)) if waits else None)
                for key, _ in events:
                    w: _Worker = key.data
                    lines = w.read_lines()
                    if lines is None:
                        if w.item is not None:  # died while scoring: accuracy 0, not a timeout
                            results[w.item] = {
                                "accuracy": 0.0,
                                "extracted": None,
                                "gold_parsed": None,
                                "timed_out": False,
                            }
                            log.warning("reward worker died while scoring completion %d", w.item)
                        elif not w.ready:
                            raise RuntimeError("reward worker exited during start-up (see its stderr above)")
                        self._replace(w, sel, "it exited")
                        continue
                    for line in lines:
                        msg = json.loads(line)
                        if msg.get("ready"):
                            w.ready = True
                        elif w.item is not None:
                            if "error" in msg:
                                log.warning("reward scoring error on completion %d: %s", w.item, msg["error"])
                            msg["timed_out"] = False
                            results[w.item] = msg
                            w.item = None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.deadline:
                        results[w.item] = {"accuracy": 0.0, "extracted": None, "gold_parsed": None, "timed_out": True}
                        self.timeouts += 1
                        log.warning(
                            "reward: completion %d exceeded %.1f s; worker restarted", w.item, self.cfg.timeout_s
                        )
                        w.item = None
                        self._replace(w, sel, "timeout")
                    elif not w.ready and now - w.started > _WORKER_START_TIMEOUT_S:
                        raise RuntimeError(f"reward worker not ready after {_WORKER_START_TIMEOUT_S:.0f} s")
        finally:
            sel.close()
        return results  # type: ignore[return-value]

    def _replace(self, worker: _Worker, sel: selectors.BaseSelector, why: str) -> None:
        try:
            sel.unregister(worker.fd)
        except (KeyError, ValueError):
            pass
        worker.kill()
        fresh = _Worker()
        self._workers[self._workers.index(worker)] = fresh
        sel.register(fresh.fd, selectors.EVENT_READ, fresh)
        log.debug("reward worker replaced (%s)", why)


_default: RewardScorer | None = None
_default_lock = threading.Lock()


def _default_scorer() -> RewardScorer:
    global _default
    with _default_lock:
        if _default is None:
            _default = RewardScorer(RewardConfig())
            atexit.register(_default.close)
        return _default


def accuracy_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's answer matches ``gold`` per math-verify, else 0.0.

    Runs in a shared default ``RewardScorer`` (started on first use), so the time limit
    (RewardConfig().timeout_s) holds and it is safe from any thread.
    """
    return _default_scorer().score([completion], [gold])[0]["accuracy"]
