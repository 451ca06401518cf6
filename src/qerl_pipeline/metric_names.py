"""The name of every metric a training writes, one constant each, in one place.

``rl/records.py`` names a step's fields with these; the trainer logs them (``tracking.MlflowLogger``), and the
console, the curves, the compare report and the GPU acceptance check read them under the same names.
"""

from __future__ import annotations

#: every sampled group's completions (before DAPO's filter): the curves that compare across methods
REWARD_MEAN = "reward/mean"
REWARD_ACCURACY = "reward/accuracy"
TRAIN_ACCURACY = "accuracy"  # the same value as REWARD_ACCURACY, as the console shows it
REWARD_FORMAT = "reward/format"
#: the kept groups the update trains on (equal to the above without dynamic sampling)
REWARD_KEPT_MEAN = "reward/kept_mean"
REWARD_STD = "reward/std"
REWARD_KEPT_ACCURACY = "reward/kept_accuracy"
REWARD_KEPT_FORMAT = "reward/kept_format"
REWARD_OVERLONG = "reward/overlong"
GROUPS_SAMPLED = "groups/sampled"
GROUPS_KEPT = "groups/kept"
GROUPS_ZERO_STD_FRACTION = "groups/zero_std_fraction"
GROUPS_REFILL_ROUNDS = "groups/refill_rounds"
COMPLETION_LENGTH = "completion/length"
TRUNCATED_FRACTION = "completion/truncated_fraction"
AQN_SIGMA = "aqn/sigma"
AQN_SIGMA_EFFECTIVE = "aqn/sigma_effective"
AQN_STAGE = "aqn/stage"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
ROLLOUT_TIME_S = "time/rollout_s"
REWARD_TIME_S = "time/reward_s"
STEP_TIME_S = "time/step_s"
SYNC_TIME_S = "time/sync_s"
UPDATE_TIME_S = "time/update_s"
ENGINE_CPU_DURING_UPDATE_S = "time/engine_cpu_during_update_s"  # ~0: the engine leaves the cores to the update
#: the update's loss (summed over its micro-batches, mean over its updates) and gradient norm before clipping
LOSS = "loss"
GRAD_NORM = "optim/grad_norm"
LEARNING_RATE = "optim/lr"
POLICY_ENTROPY = "policy/entropy"
CLIP_FRACTION = "policy/clip_fraction"
CLIP_LOW_FRACTION = "policy/clip_low_fraction"
CLIP_HIGH_FRACTION = "policy/clip_high_fraction"
SELECTED_TOKEN_FRACTION = "policy/selected_token_fraction"
ENTROPY_THRESHOLD = "policy/entropy_threshold"
KL_TO_BASE = "policy/kl_to_base"
#: vLLM's log-probs against the trainer's: the KL, the importance weights and raw ratios (``grpo.ISStats``)
MISMATCH_KL = "mismatch/kl"
IS_WEIGHT_MEAN = "mismatch/is_weight_mean"
IS_RATIO_MIN = "mismatch/is_ratio_min"
IS_RATIO_MEAN = "mismatch/is_ratio_mean"
IS_RATIO_MAX = "mismatch/is_ratio_max"
IS_MASKED_FRACTION = "mismatch/is_masked_fraction"
IS_CLIPPED_FRACTION = "mismatch/is_clipped_fraction"
#: the engine's sleep during the update (``rollout/sleep.py``)
SLEEP_TIME_S = "time/sleep_s"
WAKE_TIME_S = "time/wake_s"
WAKE_CHECK_TIME_S = "time/wake_check_s"
SLEEP_REPAIRS = "sleep/repairs"
PEAK_MEMORY_GB = "memory/peak_gb"
#: logged once per training: the prompts it draws from and those dropped as too long, the ranks, the wall time
DATA_PROMPTS = "data/prompts"
DATA_DROPPED_PROMPTS = "data/dropped_prompts"
WORLD_SIZE = "dist/world_size"
TOTAL_TIME_S = "time/total_s"
#: logged once when a training ends, to sort its runs by in MLflow's runs list: the mean reward over the steps
#: (the area under the reward curve per step, the report's claim (b)), the last step's, the mean step time
REWARD_AREA = "summary/reward_area"
FINAL_REWARD = "summary/final_reward"
MEAN_STEP_S = "summary/step_s"
BASE_WEIGHT_MIB = "base/weight_mib"
LINEAR_BYTES_RATIO = "quantize/linear_bytes_ratio"
#: the per-step curves a training returns and plots
CURVE_METRICS = (REWARD_MEAN, REWARD_ACCURACY, REWARD_FORMAT, POLICY_ENTROPY, COMPLETION_LENGTH, AQN_SIGMA)
#: Each entry of a ``train.reward_fn`` list, per step: ``rewards/<name>/mean`` and ``rewards/<name>/std`` (TRL's names;
#: ``<name>`` is 'math' or the function's ``__name__``); their weighted sum is ``reward/mean``.
REWARD_COMPONENT = "rewards/{name}/{stat}"


def reward_component(name: str, stat: str = "mean") -> str:
    """The metric name of one reward entry's ``stat`` (mean, std): ``REWARD_COMPONENT``."""
    return REWARD_COMPONENT.format(name=name, stat=stat)
