"""The reward of a training step as configured by ``train.reward_fn`` (TRL's ``reward_funcs``/``reward_weights``).

* ``None`` (or ``'math'``): ``RewardScorer`` (math-verify accuracy + format, ``reward.*``), the default.
* one import path, or a callable given to ``train(reward_fn=...)``: ``FunctionScorer``, that
  function instead of the math reward; missing ``accuracy``/``format`` are 0.
* a list: ``WeightedScorer``, the weighted sum of its entries (``train.reward_weights``, 1.0
  each by default), ``'math'`` naming the built-in one; each entry's reward is kept per
  completion under ``rewards`` and logged per step as ``rewards/<name>/mean`` and ``/std``
  (``reward_component_metrics``; TRL logs the same names), the sum as ``reward/mean``.

A function is ``f(completions, golds, samples)``; its import path, callability and signature
are checked when the config is validated (``config.load_reward_fn``), before any model loads.
Deviation from TRL: TRL calls ``f(prompts=..., completions=..., **dataset_columns)``; ours gets
the golds and the rollout samples (token ids, log-probs) positionally.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from qerl_pipeline.config import MATH_REWARD, QerlConfig, load_reward_fn
from qerl_pipeline.metric_names import reward_component
from qerl_pipeline.rewards.scorer import RewardScorer

RewardFn = Callable[[list[str], list[str], list], list[dict]]


class FunctionScorer:
    """A custom reward function behind ``RewardScorer``'s ``score``/``close`` interface."""

    def __init__(self, fn: RewardFn, name: str | None = None):
        self.fn = fn
        self.name = name or str(getattr(fn, "__name__", "reward_fn"))

    def rows(self, completions: list[str], golds: list[str], samples: list | None = None) -> list[dict]:
        """The function's results as dicts with a float ``reward``, other keys as it returned them."""
        out = self.fn(list(completions), list(golds), list(samples or []))
        if len(out) != len(completions):
            raise ValueError(
                f"reward function {self.name!r} returned {len(out)} rewards for {len(completions)} completions"
            )
        rows = []
        for i, x in enumerate(out):
            x = {"reward": float(x)} if isinstance(x, (int, float)) else dict(x)
            if "reward" not in x:
                raise KeyError(f"reward function {self.name!r}: result {i} has no 'reward' key: {x!r}")
            x["reward"] = float(x["reward"])
            rows.append(x)
        return rows

    def score(self, completions: list[str], golds: list[str], samples: list | None = None) -> list[dict]:
        rows = self.rows(completions, golds, samples)
        for x in rows:
            x.setdefault("accuracy", 0.0)
            x.setdefault("format", 0.0)
        return rows

    def close(self) -> None:
        pass


class WeightedScorer:
    """The weighted sum of named reward entries (``train.reward_fn`` as a list; TRL's ``reward_funcs`` with
    ``reward_weights``).

    ``parts``: ``(name, weight, scorer)``, the math entry a ``RewardScorer``, the others
    ``FunctionScorer``. Each completion's row: ``reward`` = sum of weight x entry reward (in list
    order), ``rewards`` = ``{name: entry reward}`` (unweighted, logged as ``rewards/<name>/mean``),
    ``accuracy``/``format`` and the math entry's other keys (``extracted``, ``gold_parsed``) from
    the math entry when there is one, else from the first entry that returns them (else 0).
    Deviation from TRL: an entry must score every completion (TRL lets a function return None
    for the ones it does not apply to and sums with ``nansum``).
    """

    def __init__(self, parts: list[tuple[str, float, Any]]):
        self.parts = parts

    def score(self, completions: list[str], golds: list[str], samples: list | None = None) -> list[dict]:
        per = [
            sc.score(completions, golds) if isinstance(sc, RewardScorer) else sc.rows(completions, golds, samples)
            for _, _, sc in self.parts
        ]
        first = sorted(range(len(self.parts)), key=lambda j: not isinstance(self.parts[j][2], RewardScorer))
        out = []
        for i in range(len(completions)):
            parts = {name: per[j][i]["reward"] for j, (name, _, _) in enumerate(self.parts)}
            row = {"reward": sum(w * parts[name] for name, w, _ in self.parts)}
            for j in first:
                row.update({k: v for k, v in per[j][i].items() if k not in row})
            row.setdefault("accuracy", 0.0)
            row.setdefault("format", 0.0)
            row["rewards"] = parts
            out.append(row)
        return out

    def close(self) -> None:
        for _, _, sc in self.parts:
            sc.close()


def make_scorer(cfg: QerlConfig, reward_fn: RewardFn | str | None = None):
    """The step's reward: ``reward_fn`` (a callable or import path) when given, else ``train.reward_fn``:
    None (or 'math') the math ``RewardScorer``, one path its ``FunctionScorer``, a list a ``WeightedScorer``."""
    if reward_fn is not None:
        return FunctionScorer(load_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn)
    setting = cfg.train.reward_fn
    if setting is None or setting == MATH_REWARD:
        return RewardScorer(cfg.reward)
    if isinstance(setting, str):
        return FunctionScorer(load_reward_fn(setting))
    parts = []
    try:
        for name, path, weight in cfg.train.reward_components():
            scorer = RewardScorer(cfg.reward) if path == MATH_REWARD else FunctionScorer(load_reward_fn(path), name)
            parts.append((name, weight, scorer))
    except BaseException:
        for _, _, sc in parts:
            sc.close()
        raise
    return WeightedScorer(parts)


def reward_component_metrics(rows: list[dict]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each entry of a weighted reward over ``rows`` (none for one reward)."""
    names = dict.fromkeys(name for x in rows for name in x.get("rewards", {}))
    out = {}
    for name in names:
        values = [float(x["rewards"][name]) for x in rows if name in x.get("rewards", {})]
        out[reward_component(name, "mean")] = statistics.fmean(values)
        out[reward_component(name, "std")] = statistics.pstdev(values)
    return out
