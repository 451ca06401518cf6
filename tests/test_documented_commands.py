"""Every ``kedro run`` command of README.md, docs/*.md and the envs' headers validates, as ``kedro run`` would.

Fast tier; no Kedro session starts. The commands are found where a reader copies them from:

* in code blocks (fenced, also inside list items, or indented), every line that runs
  ``kedro run`` (backslash continuations joined, ``# comments`` dropped, quotes as the shell
  reads them); the lines above it in its block that write a file (``printf ... > my.jsonl``)
  run first, with bash, in the folder it validates from;
* in the prose, every inline code span that does (a span may wrap over lines), except a span
  that elides (``kedro run ... train.nproc=2``, naming a command shown elsewhere) or names an
  option without its value (``kedro run --params`` splits on commas);
* in the comment lines that open each ``conf/<env>/parameters.yml`` (``#   kedro run ...``).

Each command's arguments are read by Kedro's own ``run`` command (its click options and
callbacks: ``--params`` through ``_split_params``, ``--pipeline`` and ``--pipelines``, the node
selections), nothing is run. Its pipelines are the project's registry, filtered as
``KedroSession.run`` filters them; its parameters are ``conf/base``, its ``--env`` and its
``--params`` through Kedro's ``OmegaConfigLoader`` as ``kedro run`` builds it
(``planner/inputs.py``). Then what ``hooks.ValidateConfigHook`` runs before the first node:
``config.validate`` (``QerlConfig``), ``hooks.cross_field_errors`` for the run's nodes, and, as
on a CUDA machine, the memory planner's check (``hooks.planner_refusal``) on the GPU the command
is meant for: the ``(N GiB)`` its comment (on its line, or the comment line just above it) names,
else the GPU its env's header names (``tests/helpers/envs.py``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass

import pytest

from qerl_pipeline.config import ConfigError, validate
from qerl_pipeline.hooks import cross_field_errors, node_roles, planner_refusal
from qerl_pipeline.planner import inputs
from tests.helpers.envs import CONF, ENVS, declared_gpu_gib, header
from tests.helpers.project import PROJECT

PAGES = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
INDENTED = re.compile(r"^(?: {4}|\t)[ \t]*(kedro run [^`\n]*)$", re.M)  # an indented code block's command
SPAN = re.compile(r"`([^`]+)`")
WRITES = re.compile(r"^\s*printf .*>\s*[\w./-]+\s*$")
GIB_NOTE = re.compile(r"\(([0-9]+(?:\.[0-9]+)?) GiB\)")


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    args: tuple[str, ...]  # what follows `kedro run`
    gpu_note: float | None  # the GPU its comment names, GiB
    setup: tuple[str, ...] = ()  # the lines above it in its block that write the files it reads

    def __str__(self) -> str:
        return f"{self.where}: kedro run {shlex.join(self.args)}"


def _run_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``kedro run`` in ``tokens``, None when they hold no ``kedro run``."""
    for i in range(len(tokens) - 1):
        if tokens[i : i + 2] == ["kedro", "run"]:
            return tokens[i + 2 :]
    return None


def _run_command():
    from kedro.framework.cli.project import run

    return run


def _takes_a_value(option: str) -> bool:
    return any(option in p.opts and not getattr(p, "is_flag", False) for p in _run_command().params)


def commands_in(page) -> list[Command]:
    text = page.read_text()
    name = page.relative_to(PROJECT)
    found = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            i += 1
            if "kedro run" not in line:  # other code (Python, YAML) need not read as shell words
                continue
            args = _run_args(shlex.split(line, comments=True))
            if args is None:
                continue
            above = lines[start - 1] if start and lines[start - 1].lstrip().startswith("#") else ""
            note = GIB_NOTE.search(line.partition(" #")[2] or above)
            setup = tuple(s for s in lines[:start] if WRITES.match(s))
            found.append(
                Command(f"{name}:{first + start}", tuple(args), float(note.group(1)) if note else None, setup)
            )
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # the blocks blanked, line numbers kept
    for line in INDENTED.finditer(prose):
        args = _run_args(shlex.split(line.group(1), comments=True))
        found.append(Command(f"{name}:{prose.count(chr(10), 0, line.start()) + 1}", tuple(args), None))
    prose = INDENTED.sub("", prose)
    for span in SPAN.finditer(prose):
        words = span.group(1).split()
        args = _run_args(words)
        if args is None or "..." in words or (args and args[-1].startswith("-") and _takes_a_value(args[-1])):
            continue
        found.append(
            Command(f"{name}:{prose.count(chr(10), 0, span.start()) + 1}", tuple(shlex.split(" ".join(args))), None)
        )
    return found


def commands_in_env_header(env: str) -> list[Command]:
    return [
        Command(
            f"conf/{env}/parameters.yml:{i}", tuple(shlex.split(line.split("kedro run", 1)[1], comments=True)), None
        )
        for i, line in enumerate(header(env).splitlines(), 1)
        if re.match(r"#\s+kedro run\b", line)
    ]


COMMANDS = [c for page in PAGES for c in commands_in(page)] + [c for env in ENVS for c in commands_in_env_header(env)]


def problems(command: Command) -> list[str]:
    """What validation says about ``command`` before its first node ([] when it would start)."""
    from kedro.framework.project import configure_project, pipelines

    configure_project("qerl_pipeline")
    ctx = _run_command().make_context("run", list(command.args))
    opts = ctx.params
    names = [opts["pipeline"]] if opts["pipeline"] else (opts["pipelines"] or ["__default__"])
    combined = pipelines[names[0]]
    for n in names[1:]:
        combined += pipelines[n]
    pipeline = combined.filter(
        tags=opts["tags"],
        from_nodes=opts["from_nodes"],
        to_nodes=opts["to_nodes"],
        node_names=opts["node_names"],
        from_inputs=opts["from_inputs"],
        to_outputs=opts["to_outputs"],
        node_namespaces=opts["namespaces"],
    )
    try:
        cfg = validate(inputs.load_parameters(opts["env"], opts["params"], CONF))
    except ConfigError as err:
        return [str(err)]
    errors = cross_field_errors(cfg, node_roles(pipeline))
    gpu = command.gpu_note or declared_gpu_gib(opts["env"])
    refused = planner_refusal(cfg, pipeline, gpu)
    return errors + ([f"on a {gpu:g} GiB GPU: {refused}"] if refused else [])


def test_the_documented_commands_are_found():
    """Code blocks with continuations and quotes, inline spans over two lines; mentions are not commands."""
    text = {str(c) for c in COMMANDS}

    def found(page: str, command: str) -> bool:
        return any(s.startswith(f"{page}:") and s.endswith(f": {command}") for s in text)

    assert len(COMMANDS) >= 30, "\n".join(sorted(text))
    assert found(
        "docs/scale-out.md",
        "kedro run --pipelines=train --env paper_bigmath_7b --params train.nproc=8,"
        "train.nnodes=2,train.node_rank=0,train.master_addr=10.0.0.1,train.master_port=29500",
    ), text
    assert found(
        "docs/gpu.md",
        "kedro run --pipelines=compare --env paper_gsm8k_7b --params "
        "'compare.methods=qerl qerl_noaqn lora lora_aqn,compare.seeds=0 1 2'",
    ), text
    assert found("docs/configuration.md", "kedro run --pipelines=compare --env cpu_compare")  # a span over two lines
    assert found("docs/configuration.md", "kedro run --pipelines=train --env smoke --params grpo.loss_type=cispo")
    assert found("docs/lineage.md", "kedro run --pipelines=compare --env cpu_compare")  # a fence in a list item
    assert found("conf/paper_bigmath_32b/parameters.yml", "kedro run --pipelines=train --env paper_bigmath_32b")
    assert not any("..." in c.args or c.args[-1:] == ("--params",) for c in COMMANDS)
    (h200,) = [
        c
        for c in COMMANDS
        if c.where.startswith("docs/gpu.md") and "paper_bigmath_32b" in c.args and "--pipelines=compare" in c.args
    ]
    assert h200.gpu_note == 139
    (own_data,) = [c for c in COMMANDS if "data.train_source=file" in " ".join(c.args)]
    assert own_data.setup and own_data.setup[0].startswith("printf ") and own_data.setup[0].endswith("> my.jsonl")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_every_documented_command_validates(command, tmp_path, monkeypatch):
    if command.setup:  # the files its block writes, where it runs
        monkeypatch.chdir(tmp_path)
        for line in command.setup:
            subprocess.run(["bash", "-c", line], check=True, timeout=30)
    assert problems(command) == [], str(command)
