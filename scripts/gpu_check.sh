#!/usr/bin/env bash
# Checks GPU workers (docs/operations.md, "GPU workers") on a machine with a
# GPU and a PyTorch whose libtorch has CUDA, but none of Shoal's Debian
# packages: builds the TorchScript runtime and its tests (tests/gpu) against
# that libtorch and runs them, the GPU cases first (the one that trips a
# real device-side assert in a process of its own).
#
#   scripts/gpu_check.sh prepare   # on a machine set up by scripts/setup.sh:
#                                  # copies what the GPU machine lacks (demo
#                                  # models, nlohmann/json and GoogleTest)
#                                  # into .gpu/ (git-ignored, about 27 MB)
#   scripts/gpu_check.sh run       # on the GPU machine, from the repository
#                                  # root, with .gpu/ copied alongside
#
# `prepare` takes the x86_64 Debian paths of those libraries. `run` needs
# CMake 3.25 or later, Ninja, a C++20 compiler, the libtorch of `python3`
# (TORCH_PREFIX overrides its CMake prefix) and a CUDA toolkit libtorch's
# CMake package can find. Exit 0: every selected test passed, the GPU cases
# included; 3: the others passed but a GPU case was skipped (no GPU or no
# CUDA libtorch there); anything else: a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  prepare)
    for m in tiny-bert tiny-reranker tiny-classifier; do
      [[ -f models/$m/model.pt ]] || { echo "models/$m/model.pt missing: run scripts/setup.sh first" >&2; exit 1; }
    done
    rm -rf .gpu
    mkdir -p .gpu/deps/include .gpu/deps/lib .gpu/models
    cp -r /usr/include/nlohmann /usr/include/gtest .gpu/deps/include/
    cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a .gpu/deps/lib/
    for m in tiny-bert tiny-reranker tiny-classifier; do cp -r "models/$m" .gpu/models/; done
    du -sh .gpu
    ;;
  run)
    [[ -d .gpu/deps && -d .gpu/models ]] || { echo ".gpu/ missing: run '$0 prepare' where Shoal is set up" >&2; exit 1; }
    python3 - <<'PY'
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}, "
      f"C++11 ABI {torch._C._GLIBCXX_USE_CXX11_ABI}")
if not torch._C._GLIBCXX_USE_CXX11_ABI:
    sys.exit("this libtorch uses the pre-C++11 ABI; the prepared GoogleTest and Shoal need the C++11 one")
PY
    prefix=${TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}
    build=${GPU_BUILD_DIR:-/tmp/shoal-gpu-build}
    cmake -S tests/gpu -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DSHOAL_DEPS="$PWD/.gpu/deps"
    cmake --build "$build" -j"$(nproc)"
    export SHOAL_MODELS_DIR="$PWD/.gpu/models"
    out=${OUT:-$build}
    # The GPU case and the device checks on their own, since their result
    # is the point; then the rest of the runtime's tests under this libtorch
    # (minilm-l6 is not copied: its huge-page test is left out).
    "$build/torchscript_runtime_test" --gtest_filter='*OnAGpu*:*Device*-*GpuFault*' --gtest_output="xml:$out/gpu_case.xml" \
      | tee "$out/gpu_case.log"
    # Breaks its process's CUDA context on purpose: a process of its own.
    SHOAL_GPU_FAULT_TEST=1 "$build/torchscript_runtime_test" --gtest_filter='*GpuFault*' \
      --gtest_output="xml:$out/gpu_fault.xml" | tee -a "$out/gpu_case.log"
    "$build/torchscript_runtime_test" --gtest_filter='-*OnAGpu*:*Device*:*GpuFault*:*HugePages*' --gtest_output="xml:$out/rest.xml"
    if grep -q '\[  SKIPPED \]' "$out/gpu_case.log"; then
      echo "the GPU case was skipped: no CUDA libtorch or no GPU here" >&2
      exit 3
    fi
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
