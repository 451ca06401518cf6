"""Math rewards: math-verify accuracy plus the format bonus, time-limited and thread-safe.

Accuracy (faithful to the paper's reward, with documented extensions)
------------------------------------------------------------------------
* Gold: ``math_verify.parse(gold, extraction_mode="first_match")`` with math-verify's
  default extraction targets, as the paper does. Deviation: a gold given as bare LaTeX
  (``\\frac{14}{3}``, ``p - q``, ``\\text{Evelyn}``) carries no delimiter, and math-verify
  extracts nothing from 51 of the 500 MATH-500 answers that way; so a gold with no
  ``$``/``\\boxed`` is wrapped as ``\\boxed{gold}`` (then every MATH-500 answer parses).
  No string fallback is kept (``fallback_mode="no_fallback"``): a gold that does not
  parse to a math object gives accuracy 0 and is reported, never a string match, so an
  unparseable gold can never yield reward 1.0.
* Prediction: LaTeX extraction with ``boxed_match_priority=0`` (``\\boxed{}`` first) and
  ``try_extract_without_anchor=False`` (no anchorless fallback), the paper's
  normalisation (basic LaTeX, units, ``boxed="all"``; no nits/malformed-operator fixes),
  ``extraction_mode="first_match"``.
* ``RewardConfig.anchored_plain_answers`` (default True) adds math-verify's
  ``ExprExtractionConfig(try_extract_without_anchor=False)``: a plain number after an
  anchor ("The answer is 2.", "Final answer: 1,234") counts; a bare number with no anchor
  still does not. Measured on 16 generator level-1 problems with the paper prompt:
  SmolLM2-135M-Instruct answers in plain text ("... The answer is 2."), never in LaTeX
  or <answer> tags; the paper's extraction scored 0 of 96 completions (greedy and T=1.0),
  with this option 3/16 greedy and 1/64 sampled at T=1.0 are right: a learning signal.
  False = the paper's extraction.
* Where it looks: the content of the last complete ``<answer>...</answer>`` pair when
  the completion has one, else the whole completion. The system prompt (paper App. E)
  asks for the answer inside ``<answer>`` tags, so reasoning numbers inside ``<think>``
  must not be picked up when an answer block exists.
* ``RewardConfig.answer_tag_as_boxed`` (default True): when the answer block holds no
  ``\\boxed``/anchored LaTeX (e.g. ``<answer> 18 </answer>``), its content is scored as
  if it were ``\\boxed{content}``. The tags are an explicit anchor, as strong as
  ``\\boxed``; the paper's prompt never asks for ``\\boxed``, and without this a model
  that follows the prompt exactly would get accuracy 0. False = the paper's extraction only.

Format: ``format_reward`` (0.2 by default) when the completion has the format its
prompt asks for; ``reward.format_style`` says which:

* ``think_answer`` (the paper): a non-empty ``<think>...</think>`` followed (whitespace
  only between) by a non-empty ``<answer>...</answer>`` (the paper's soft format check;
  empty blocks do not count). Found with ``str.find`` scans, linear in the completion
  length, so an adversarial completion cannot make the format check slow.
* ``answer_line`` (deviation, the CPU default's plain prompt "... end with: The answer is
  <number>."): the completion's last non-empty line ends with "the answer is <number>"
  (case-insensitive, optional ``:``/``$``/final ``.``). It is the same kind of signal as
  the paper's: the instruction was followed, whatever the number. Only the last 200
  characters are matched, so it is constant-time in the completion length. Without it
  the 135M default model gets no format reward at all (it never writes the tags).

Time limit and threads
----------------------
math-verify's own timeout uses ``signal.alarm``, which raises off the main thread.
We disable it (``parsing_timeout=None``, ``timeout_seconds=None``) and enforce our own:
``RewardScorer`` keeps ``reward.max_workers`` worker *subprocesses* (plain
``subprocess.Popen`` of this interpreter, so they start from threads, from daemonic
worker processes and inside ``kedro run`` alike, with no fork of the caller), sends
each completion to an idle worker and kills the worker if the answer is not back within
``reward.timeout_s``: that completion scores accuracy 0 with ``timed_out=True`` and a
fresh worker replaces the killed one. A pathological completion costs at most
``timeout_s`` of one worker; the others keep going. Golds are parsed once per worker
(LRU cache).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from qerl_pipeline.config import RewardConfig

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
EXTRACTED_MAX_CHARS = 200
_WORKER_START_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------- format
def has_answer_format(completion: str) -> bool:
    """True when a non-empty <think> block is followed by a non-empty <answer> block."""
    start = completion.find(THINK_OPEN)
    while start >= 0:
        close = completion.find(THINK_CLOSE, start + len(THINK_OPEN))
        if close < 0:
            return False
        if completion[start + len(THINK_OPEN) : close].strip():
            rest = close + len(THINK_CLOSE)
            while rest < len(completion) and completion[rest].isspace():
                rest += 1
            if completion.startswith(ANSWER_OPEN, rest):
                end = completion.find(ANSWER_CLOSE, rest + len(ANSWER_OPEN))
                if end >= 0 and completion[rest + len(ANSWER_OPEN) : end].strip():
                    return True
        start = completion.find(THINK_OPEN, close + len(THINK_CLOSE))
    return False


_ANSWER_LINE = re.compile(r"the (?:final )?answer is\s*:?\s*\$?\s*-?\d[\d,]*(?:\.\d+)?\s*\$?\s*\.?\Z", re.IGNORECASE)
#: The format checks ``reward.format_style`` selects.
FORMAT_STYLES = ("think_answer", "answer_line")


def has_answer_line(completion: str) -> bool:
    """True when the last non-empty line ends with 'the answer is <number>' (see the module docstring)."""
    tail = completion.rstrip()[-200:]
    return bool(_ANSWER_LINE.search(tail.rsplit("\n", 1)[-1]))


def format_reward(completion: str, value: float = 0.2, style: str = "think_answer") -> float:
    """``value`` when ``completion`` has the ``style`` format (``think_answer``: the paper's
    ``<think>...</think><answer>...</answer>``; ``answer_line``: ends with 'The answer is N'), else 0."""
    if style == "think_answer":
        ok = has_answer_format(completion)
    elif style == "answer_line":
        ok = has_answer_line(completion)
    else:
        raise ValueError(f"reward.format_style {style!r} unknown; allowed: {', '.join(FORMAT_STYLES)}")
    return float(value) if ok else 0.0


def answer_region(completion: str) -> tuple[str, bool]:
    """The content of the last complete <answer>...</answer> pair, or the whole text.

    Returns ``(text, tagged)``; ``tagged`` says whether an answer block was found.
    """
    end = completion.rfind(ANSWER_CLOSE)
    if end >= 0:
        start = completion.rfind(ANSWER_OPEN, 0, end)
        if start >= 0:
            return completion[start + len(ANSWER_OPEN) : end], True
    return completion, False


# --------------------------------------------------------------------- math-verify
@lru_cache(maxsize=2)
def _prediction_config(anchored_plain: bool = False) -> tuple:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    return (latex, ExprExtractionConfig(try_extract_without_anchor=False)) if anchored_plain else (latex,)


def _quiet_math_verify() -> None:
    # We disable math-verify's signal timeout on purpose; its warning about that is noise.
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


@lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """Parse a gold answer (first match, math objects only); empty tuple = unparseable."""
    from math_verify import parse

    _quiet_math_verify()
    text = str(gold).strip()
    if not text:
        return ()
    attempts = [text] if ("\\boxed" in text or "$" in text) else []
    attempts.append(f"\\boxed{{{text}}}")
    for attempt in attempts:
        parsed = parse(attempt, extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
        parsed = [p for p in parsed if not isinstance(p, str)]
        if parsed:
            return tuple(parsed)
    return ()


def gold_is_parseable(gold: Any) -> bool:
    """Whether math-verify can parse ``gold`` into a math object (used to validate data rows)."""
    return gold is not None and bool(parse_gold(str(gold)))


def extract_prediction(completion: str, answer_tag_as_boxed: bool = True, anchored_plain: bool = True) -> list:
    """Parse a completion's answer (boxed first, anchored only), per the module docstring."""
    from math_verify import parse

    _quiet_math_verify()
    region, tagged = answer_region(completion)
    cfg = _prediction_config(anchored_plain)
    parsed = parse(region, extraction_config=cfg, extraction_mode="first_match", fallback_mode="no_fallback", parsing_timeout=None)
    if not parsed and tagged and answer_tag_as_boxed:
        inner = region.strip().strip("$").strip().rstrip(".").strip()
        if inner and "\\boxed" not in inner:
            parsed = parse(
                f"\\boxed{{{inner}}}", extraction_config=cfg, extraction_mode="first_match",
                fallback_mode="no_fallback", parsing_timeout=None,
            )
    return [p for p in parsed if not isinstance(p, str)]


def score_accuracy(completion: str, gold: str, answer_tag_as_boxed: bool = True, anchored_plain: bool = True) -> dict:
    """In-process accuracy (no time limit): ``{accuracy, extracted, gold_parsed}``.

    This is what each worker runs; call it directly only on trusted, short inputs.
    """
    from math_verify import verify

    gold_parsed = parse_gold(str(gold))
    pred = extract_prediction(completion, answer_tag_as_boxed, anchored_plain)
    extracted = str(pred[0])[:EXTRACTED_MAX_CHARS] if pred else None
    accuracy = 0.0
    if gold_parsed and pred:
        accuracy = 1.0 if verify(list(gold_parsed), pred, timeout_seconds=None) else 0.0
    return {"accuracy": accuracy, "extracted": extracted, "gold_parsed": bool(gold_parsed)}


# -------------------------------------------------------------------------- worker
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
    _quiet_math_verify()
    score_accuracy("<answer>1</answer>", "1")  # warm imports and regex caches
    proto.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            out = score_accuracy(req["c"], req["g"], req["tag"], req["plain"])
        except Exception as err:  # noqa: BLE001 - a scoring error is accuracy 0, reported
            out = {"accuracy": 0.0, "extracted": None, "gold_parsed": False, "error": repr(err)[:200]}
        proto.write((json.dumps(out) + "\n").encode())


class _Worker:
    """One scoring subprocess and its line buffer."""

    def __init__(self) -> None:
        src = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from qerl_pipeline.rewards.math import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None
        self.deadline = 0.0

    def read_lines(self) -> list[bytes] | None:
        """Lines now available; None when the worker closed its output (died)."""
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
    ``timed_out``, plus ``gold_parsed`` (False flags a gold math-verify cannot parse;
    None when unknown because the item timed out or its worker died).
    Thread-safe (calls are serialised); use as a context manager or call ``close()``.
    """

    def __init__(self, cfg: RewardConfig | dict | None = None) -> None:
        from qerl_pipeline.config import parse as parse_section

        self.cfg: RewardConfig = parse_section(RewardConfig, cfg, "reward")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [_Worker() for _ in range(self.cfg.max_workers)]
        self._closed = False
        self.timeouts = 0  # completions that hit the time limit since creation

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
        except Exception:  # noqa: BLE001
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
        out = []
        for completion, a in zip(completions, acc):
            fmt = format_reward(str(completion), self.cfg.format_reward, self.cfg.format_style)
            out.append({
                "reward": self.cfg.accuracy_weight * a["accuracy"] + self.cfg.format_weight * fmt,
                "accuracy": a["accuracy"],
                "format": fmt,
                "extracted": a["extracted"],
                "timed_out": a["timed_out"],
                "gold_parsed": a["gold_parsed"],
            })
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
                            results[w.item] = {"accuracy": 0.0, "extracted": None, "gold_parsed": None, "timed_out": False}
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
                        log.warning("reward: completion %d exceeded %.1f s; worker restarted", w.item, self.cfg.timeout_s)
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


# ------------------------------------------------------------- convenience function
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
