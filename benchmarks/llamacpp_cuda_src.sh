#!/usr/bin/env bash
# The llama.cpp source that ../shared/tools/build_llamacpp.sh builds, trimmed to what a CUDA llama-bench needs
# (ggml with its CPU and CUDA backends, src, common, vendor, tools/llama-bench: ~2 MB as .tar.xz), written to
# .xfer/lcpp.tar.xz, for benchmarks/cuda_lease.sh's `llamacpp` step on the lent GPU (nothing there can fetch).
set -euo pipefail
ROOT=${LLAMACPP_ROOT:-$HOME/.cache/jllm-baseline-llamacpp}
WORK=$(mktemp -d)
if [ ! -d "$ROOT/llama_cpp_python-0.3.36" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: -d "$WORK/sdist" llama-cpp-python==0.3.36
  tar xzf "$WORK"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$WORK"
  ROOT=$WORK
fi
cd "$ROOT/llama_cpp_python-0.3.36/vendor"
mkdir -p "$WORK/trim"
skip=(sycl vulkan opencl cann hexagon metal musa hip webgpu openvino zdnn et virtgpu)
tar cf - "${skip[@]/#/--exclude=llama.cpp/ggml/src/ggml-}" llama.cpp/CMakeLists.txt llama.cpp/cmake llama.cpp/ggml \
  llama.cpp/src llama.cpp/include llama.cpp/common llama.cpp/vendor llama.cpp/tools/CMakeLists.txt \
  llama.cpp/tools/llama-bench llama.cpp/licenses | tar xf - -C "$WORK/trim"
# only llama-bench among the tools
sed -i '/^if (EMSCRIPTEN)/,$d' "$WORK/trim/llama.cpp/tools/CMakeLists.txt"
echo "add_subdirectory(llama-bench)" >> "$WORK/trim/llama.cpp/tools/CMakeLists.txt"
cd - > /dev/null
mkdir -p .xfer
tar cJf .xfer/lcpp.tar.xz -C "$WORK/trim" llama.cpp
rm -rf "$WORK"
ls -la .xfer/lcpp.tar.xz
