"""The paper's claims, stated with the measured seed-paired difference and its 95% interval.

* (a) the policy entropy of each quantized method (qerl, qerl_noaqn, qlora, and the format
  sweep's mxfp4, mxfp4_noaqn, fp8: every registered method whose format quantizes, so each
  format is put to it) is above BF16 LoRA's in the first AQN stage (``first_aqn_stage_steps``:
  the steps of the first stage with sigma > 0, read from the runs' ``aqn/stage`` and
  ``aqn/sigma`` curves);
* (b) reward growth, the area under the reward curve (``stats.curve_auc``), is ordered
  qerl >= qerl_noaqn >= lora; and, for AQN on MXFP4, mxfp4 >= mxfp4_noaqn;
* (c) the same for AQN without quantization: lora_aqn >= lora.

Where the interval contains 0, or there is one seed, the claim reads "cannot tell" with the
numbers (``stats.verdict``), and says how many seeds would tell its measured difference from 0
at the spread it measured: the smallest n with ``t(0.975, n-1) * s_d / sqrt(n) < |d|`` (``d``,
``s_d``: mean and sd of the seed-paired differences), assuming the differences are independent
and normal across seeds and the measured ``d`` and ``s_d`` are the true ones (``stats.seeds_needed``;
a plug-in estimate, not a power calculation); with one seed there is no spread: "needs ≥2 seeds
to estimate". They are shown as ``claims.csv`` (columns ``seeds_needed``, the number, and
``seeds_needed_note``, what the page prints), ``claims.json``, on the report page, and as the
compare run's ``claims/<id>/...`` metrics and ``claims.<id>`` tags (``claim_metrics``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from qerl_pipeline.config import METHOD_SPECS
from qerl_pipeline.evaluation import stats
from qerl_pipeline.evaluation.report_runs import RunData, by_method
from qerl_pipeline.quantization import formats
from qerl_pipeline.quantization.aqn import stage_of

#: Claims (b) and (c): (id, higher, lower) of "reward growth of higher >= lower".
REWARD_ORDER = (
    ("b_qerl_ge_qerl_noaqn", "qerl", "qerl_noaqn"),
    ("b_qerl_noaqn_ge_lora", "qerl_noaqn", "lora"),
    ("c_lora_aqn_ge_lora", "lora_aqn", "lora"),
    ("b_mxfp4_ge_mxfp4_noaqn", "mxfp4", "mxfp4_noaqn"),
)


def quantized_methods() -> tuple[str, ...]:
    """Claim (a)'s methods: every registered method on a format that quantizes, in the registry's order."""
    return tuple(m for m, spec in METHOD_SPECS.items() if spec.quantized)


def first_aqn_stage_steps(runs: Sequence[RunData]) -> list[int]:
    """The logged steps of the first AQN stage with sigma > 0.

    Read from the runs that logged ``aqn/sigma > 0`` (qerl, lora_aqn) with their ``aqn/stage``:
    the steps whose stage is the smallest stage seen with sigma > 0 (the same for every run of
    one compare: one config). No such run: computed from a run's ``train.steps`` and
    ``aqn.num_stages`` params with ``quantization.aqn.stage_of`` (stage 1 is the first noisy stage).
    """
    steps: set[int] = set()
    for run in runs:
        sigma, stage = dict(run.curve("sigma")), dict(run.curve("stage"))
        noisy = {s: int(stage[s]) for s, v in sigma.items() if v > 0 and s in stage}
        if noisy:
            first = min(noisy.values())
            steps |= {s for s, k in noisy.items() if k == first}
    if steps:
        return sorted(steps)
    for run in runs:
        try:
            total, stages = int(run.params["train.steps"]), int(run.params["aqn.num_stages"])
        except (KeyError, ValueError):
            continue
        return [s + 1 for s in range(total) if stage_of(s, total, stages) == 1]  # logged steps are 1-based
    return []


def _per_seed(runs: Sequence[RunData], fn) -> dict[int, float]:
    """``{seed: fn(run)}`` of one method's runs (runs without a seed count as seed 0)."""
    return {(r.seed if r.seed is not None else 0): fn(r) for r in runs}


def claims(runs: Sequence[RunData], methods: Sequence[str] | None = None) -> list[stats.Claim]:
    """The paper's claims (a), (b), (c) measured on ``runs`` (see the module docstring).

    ``methods``: the methods the comparison chose (``compare.methods``); a claim about a method outside it is
    left out, as that method was never meant to run. None: the methods of ``runs``. A claim kept whose
    methods have no runs (a chosen method that did not finish) reads "cannot tell: no data for ...".
    """
    groups = by_method(runs)
    methods = list(groups) if methods is None else methods

    def chosen(*names: str) -> bool:
        return all(n in methods for n in names)

    window = first_aqn_stage_steps(runs)
    out = []
    lora = groups.get("lora", [])
    for m in quantized_methods():
        if not chosen(m, "lora"):
            continue
        stat = (
            f"mean policy entropy over steps {window[0]}-{window[-1]} (first AQN stage)"
            if window
            else "mean policy entropy in the first AQN stage (no step found)"
        )
        fmt = formats.get(METHOD_SPECS[m].format).label
        out.append(
            stats.claim(
                f"a_{m}_entropy_gt_lora",
                f"policy entropy of {m} ({fmt}) above lora (BF16) in the first AQN stage",
                m,
                "lora",
                stat,
                _per_seed(groups.get(m, []), lambda r: stats.window_mean(r.curve("entropy"), window)),
                _per_seed(lora, lambda r: stats.window_mean(r.curve("entropy"), window)),
            )
        )
    for cid, hi, lo in REWARD_ORDER:
        if not chosen(hi, lo):
            continue
        a_runs = {(r.seed if r.seed is not None else 0): r for r in groups.get(hi, [])}
        b_runs = {(r.seed if r.seed is not None else 0): r for r in groups.get(lo, [])}
        a_auc, b_auc = {}, {}
        for seed in a_runs:
            if seed in b_runs:  # the same steps for both: the area over their common steps
                common = sorted(
                    {s for s, _ in a_runs[seed].curve("reward")} & {s for s, _ in b_runs[seed].curve("reward")}
                )
                a_auc[seed] = stats.curve_auc(a_runs[seed].curve("reward"), common)
                b_auc[seed] = stats.curve_auc(b_runs[seed].curve("reward"), common)
            else:
                a_auc[seed] = stats.curve_auc(a_runs[seed].curve("reward"))
        for seed in b_runs:
            b_auc.setdefault(seed, stats.curve_auc(b_runs[seed].curve("reward")))
        out.append(
            stats.claim(
                cid,
                f"reward growth of {hi} >= {lo}",
                hi,
                lo,
                "area under the reward curve / step span (mean reward over training)",
                a_auc,
                b_auc,
            )
        )
    return out


def claims_frame(found: Sequence[stats.Claim]) -> pd.DataFrame:
    """One row per claim: id, statement, verdict, difference with its interval, seeds, the sentence, and for a
    "cannot tell" claim the seeds it would need (``seeds_needed``: a number or empty; ``seeds_needed_note``:
    the words)."""
    rows = [
        {
            "claim": c.id,
            "statement": c.statement,
            "verdict": c.verdict,
            "difference": c.difference.mean,
            "ci_low": c.difference.low,
            "ci_high": c.difference.high,
            "n_seeds": c.difference.n,
            "seeds": " ".join(map(str, c.seeds)),
            "statistic": c.statistic,
            "text": c.text,
            "seeds_needed": c.seeds_needed,
            "seeds_needed_note": c.seeds_note,
        }
        for c in found
    ]
    return pd.DataFrame(
        rows,
        columns=[
            "claim",
            "statement",
            "verdict",
            "difference",
            "ci_low",
            "ci_high",
            "n_seeds",
            "seeds",
            "statistic",
            "text",
            "seeds_needed",
            "seeds_needed_note",
        ],
    ).astype({"seeds_needed": "Int64"})


def claim_metrics(found: Sequence[stats.Claim]) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, tags)`` of the claims for the compare run: ``claims/<id>/{difference,ci_low,ci_high,n_seeds}``
    and, for a "cannot tell" claim with an estimate, ``claims/<id>/seeds_needed`` (NaN left out); ``claims.<id>`` =
    the sentence."""
    metrics, tags = {}, {}
    for c in found:
        needed = math.nan if c.seeds_needed is None else float(c.seeds_needed)
        for name, value in (
            ("difference", c.difference.mean),
            ("ci_low", c.difference.low),
            ("ci_high", c.difference.high),
            ("n_seeds", float(c.difference.n)),
            ("seeds_needed", needed),
        ):
            if not math.isnan(value):
                metrics[f"claims/{c.id}/{name}"] = float(value)
        tags[f"claims.{c.id}"] = c.text
    return metrics, tags
