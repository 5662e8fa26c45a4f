#!/usr/bin/env bash
# The steps of examples/Dockerfile without Docker: build the wheel, install it into a fresh folder, copy in a
# tuned folder, and run `liger-gen verify` from the installed package.
#
#   examples/image_steps.sh [WORK_DIR]      # env: GPU (h200), MODEL (llama3-8b), TUNED (liger_gen/tuned)
#
# torch, Triton, Jinja2, click and rich come from the running Python (the image installs them with pip); the
# installed wheel is imported ahead of any other copy of liger-gen (python -S: no .pth files are processed).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-$(mktemp -d)}"
GPU="${GPU:-h200}"
MODEL="${MODEL:-llama3-8b}"
TUNED="${TUNED:-liger_gen/tuned}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$WORK"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" .
"$PYTHON" -m pip install -q --no-deps --no-index --target "$WORK/site" "$WORK"/dist/liger_gen-*.whl
rm -rf "$WORK/tuned" && cp -r "$TUNED" "$WORK/tuned" && chmod -R go-w "$WORK/tuned"
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PLAT="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
cd "$WORK"
LIGER_GEN_TUNED_DIR="$WORK/tuned" PYTHONPATH="$WORK/site:$SITE:$PLAT" \
    "$PYTHON" -S -m liger_gen.cli verify --gpu "$GPU" --model "$MODEL"
