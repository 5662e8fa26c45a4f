#!/usr/bin/env bash
# The steps of examples/Dockerfile without Docker: build the wheel, install it into a fresh folder, copy in a
# tuned folder, and run `liger-gen verify` from the installed package.
#
#   examples/image_steps.sh [WORK_DIR]      # env: GPU (h200), MODEL (llama3-8b), TUNED (liger_gen/tuned),
#                                           # VERIFY_FLAGS (e.g. --require-compiled, as the Dockerfile passes)
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
# build from a copy of the sources, so that the build leaves nothing (build/, *.egg-info) in the checkout
rm -rf "$WORK/src" && mkdir -p "$WORK/src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z | xargs -0 cp --parents -t "$WORK/src"
else
    cp -r pyproject.toml README.md LICENSE liger_gen "$WORK/src"/
fi
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src"
"$PYTHON" -m pip install -q --no-deps --no-index --target "$WORK/site" "$WORK"/dist/liger_gen-*.whl
rm -rf "$WORK/tuned" && cp -r "$TUNED" "$WORK/tuned" && chmod -R go-w "$WORK/tuned"
SITE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PLAT="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
cd "$WORK"
LIGER_GEN_TUNED_DIR="$WORK/tuned" PYTHONPATH="$WORK/site:$SITE:$PLAT" \
    "$PYTHON" -S -m liger_gen.cli verify --gpu "$GPU" --model "$MODEL" ${VERIFY_FLAGS:-}
