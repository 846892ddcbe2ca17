#!/usr/bin/env bash
# Regenerate the hash-pinned lock files the images install from (Dockerfile: pip --require-hashes).
#
#   requirements/serve-cpu.txt   the serving image, RUNTIME=cpu (onnxruntime)
#   requirements/serve-gpu.txt   the serving image, RUNTIME=gpu (onnxruntime-gpu)
#   requirements/build.txt       the build backend (setuptools), for installing the project without build isolation
#   requirements/trainer.txt     the trainer image: everything but torch itself, which comes from
#                                its own index (--index-url, CPU or CUDA build) pinned by version;
#                                torch's CUDA runtime packages are that index's business, not ours
#
# Needs uv (pip install uv). Linux x86_64, CPython 3.11: the images' platform.
set -euo pipefail
cd "$(dirname "$0")/.."
common=(--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet
        --custom-compile-command "scripts/lock.sh")
uv pip compile pyproject.toml --extra cpu "${common[@]}" -o requirements/serve-cpu.txt
uv pip compile pyproject.toml --extra gpu "${common[@]}" -o requirements/serve-gpu.txt
uv pip compile requirements/build.in "${common[@]}" -o requirements/build.txt   # the build backend (no build isolation)
torch_own=(torch triton)
for p in $(uv pip compile pyproject.toml --extra cpu --extra train --python-version 3.11 \
             --python-platform x86_64-manylinux_2_28 --quiet --no-annotate --no-header 2>/dev/null \
           | grep -oE '^(nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)'); do
  torch_own+=("$p")
done
no_emit=()
for p in "${torch_own[@]}"; do no_emit+=(--no-emit-package "$p"); done
uv pip compile pyproject.toml --extra cpu --extra train "${common[@]}" "${no_emit[@]}" -o requirements/trainer.txt
