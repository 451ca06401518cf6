"""What a plan is computed from: the validated config of a ``kedro run`` and the model's shape.

``load_config`` asks Kedro's own ``OmegaConfigLoader`` for the parameters (``load_parameters``: the
tree itself), built with the arguments ``settings.py`` gives it for ``kedro run``
(``config.CONFIG_LOADER_ARGS``), and reads ``--params`` as ``kedro run`` does. The shape comes from
a local ``config.json`` (``model.name`` a folder, or ``--model-config``), the random smoke model's
``model.random_init``, or a built-in preset of the published configs (``--model-preset``, or the
preset whose Hub id is ``model.name``); the Hugging Face Hub is never asked.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from kedro.config import OmegaConfigLoader
from omegaconf import OmegaConf

from qerl_pipeline.config import CONFIG_LOADER_ARGS, QerlConfig, validate
from qerl_pipeline.planner.model_shape import ModelShape


def parse_params(text: str | None) -> dict[str, Any]:
    """``--params a.b=1,c=x`` as ``kedro run`` reads it: comma-separated ``key=value`` items,
    dotted keys nested, values typed by ``OmegaConf.from_dotlist``, as Kedro's ``--params``
    callback does. That callback is private and its module configures logging on import
    (onto stdout, which ``--format json`` must keep clean), so it is not called;
    tests/test_planner.py checks both read the same."""
    dotlist = []
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--params: {item!r} is not key=value")
        dotlist.append(f"{key.strip()}={value}")
    return OmegaConf.to_container(OmegaConf.from_dotlist(dotlist))


def load_config(env: str | None = None, params: str | None = None, conf_dir: str | Path = "conf") -> QerlConfig:
    """The validated config of ``kedro run --env ENV --params PARAMS``: ``conf/base``, then the
    env overlay (``local`` when no env is given), then the ``--params`` values."""
    return validate(load_parameters(env, parse_params(params), conf_dir))


def load_parameters(
    env: str | None = None, runtime_params: dict[str, Any] | None = None, conf_dir: str | Path = "conf"
) -> dict[str, Any]:
    """The parameter tree ``kedro run`` hands its hooks and nodes for ``--env ENV`` and the ``--params``
    values already parsed (``runtime_params``), unvalidated."""
    conf = Path(conf_dir)
    base = conf / "base"
    if not base.is_dir():
        raise FileNotFoundError(f"{base}: no such folder (run from the project root or pass --conf-dir)")
    if env and not (conf / env).is_dir():
        raise FileNotFoundError(f"--env {env}: {conf / env} does not exist")
    with warnings.catch_warnings():
        # Kedro's loader registers resolvers through omegaconf's deprecated call; settings.py
        # drops the same warning for kedro run.
        warnings.filterwarnings(
            "ignore", message=r"register_new_resolver\(\) is deprecated", category=UserWarning, module=r"kedro\."
        )
        loader = OmegaConfigLoader(
            conf_source=str(conf), env=env, runtime_params=runtime_params or {}, **CONFIG_LOADER_ARGS
        )
        return dict(loader["parameters"])


def _qwen2(name: str, h: int, n_l: int, n_h: int, n_kv: int, i: int) -> ModelShape:
    return ModelShape(name, h, n_l, n_h, n_kv, i, 152064, False, None, True, False)


#: The published config.json values of these checkpoints (Hugging Face Hub, Qwen/* and HuggingFaceTB/*).
PRESETS: dict[str, ModelShape] = {
    "qwen2.5-7b": _qwen2("Qwen/Qwen2.5-7B-Instruct", 3584, 28, 28, 4, 18944),
    "qwen2.5-14b": _qwen2("Qwen/Qwen2.5-14B-Instruct", 5120, 48, 40, 8, 13824),
    "qwen2.5-32b": _qwen2("Qwen/Qwen2.5-32B-Instruct", 5120, 64, 40, 8, 27648),
    "smollm2-135m": ModelShape("HuggingFaceTB/SmolLM2-135M-Instruct", 576, 30, 9, 3, 1536, 49152, True),
}
#: Vocabulary of the SmolLM2 tokenizer the random smoke model is built over (models.make_random_model).
RANDOM_VOCAB = 49152


def resolve_shape(cfg: QerlConfig, preset: str | None = None, model_config: str | Path | None = None) -> ModelShape:
    """The model's shape: ``model_config`` (a config.json or its folder), ``preset``, a local
    ``model.name`` folder, the random smoke shape, or the preset whose Hub id is ``model.name``."""
    if model_config is not None:
        path = Path(model_config)
        path = path / "config.json" if path.is_dir() else path
        return ModelShape.from_config(json.loads(path.read_text()), name=str(model_config))
    if preset is not None:
        key = preset.lower()
        if key not in PRESETS:
            raise ValueError(f"--model-preset {preset!r}: known presets are {', '.join(PRESETS)}")
        return PRESETS[key]
    m = cfg.model
    if m.source == "random":
        r = m.random_init
        return ModelShape(
            "random (model.random_init)",
            r.hidden_size,
            r.num_hidden_layers,
            r.num_attention_heads,
            r.num_key_value_heads,
            r.intermediate_size,
            RANDOM_VOCAB,
            True,
        )
    folder = Path(m.name)
    if (folder / "config.json").is_file():
        return ModelShape.from_config(json.loads((folder / "config.json").read_text()), name=m.name)
    for shape in PRESETS.values():
        if shape.name.lower() == m.name.lower():
            return shape
    raise ValueError(
        f"model.name {m.name!r}: no local config.json and no preset of that name (the Hub is not asked); "
        f"pass --model-preset ({', '.join(PRESETS)}) or --model-config PATH"
    )
