# Shared by every launch example; sourced, not run. Bash 4+.
#
# launch ARG...   starts `python -m sglang.launch_server ARG...` (exec: the server is this
#                 process). With HISPARSE_DRY_RUN=1 it prints the argument vector, one
#                 argument per line after a "sglang.launch_server" line, plus the A/B
#                 environment, and exits 0 without starting anything; the test suite uses
#                 this to check every flag against SGLang 0.5.23's real parser.
#
# Every path is taken from the scripts' own folder, so they run from any working directory
# (`launch_examples/glm51_colocated.sh`, `/abs/path/glm51_colocated.sh`, `./glm51_colocated.sh`).
#
# Environment read by every script (all optional):
#   PYTHON              interpreter with sglang + sglang-hisparse installed   (python3)
#   MODEL_PATH          HF repo id or local checkpoint directory              (per script)
#   HOST, PORT          where the HTTP server listens                          (0.0.0.0, per script)
#   CONTEXT_LENGTH      --context-length                                       (131072)
#   HISPARSE            on = --enable-hisparse + --hisparse-config; off = full-KV baseline (on)
#   PLAN                planner arguments, e.g. "--context 32K": the config and --max-running-requests
#                       come from `plan --model <script's preset> $PLAN --emit-config`  ()
#   HISPARSE_CONFIG     the --hisparse-config JSON                             (the planner's, 128K)
#   MAX_RUNNING_REQUESTS  --max-running-requests                               (the planner's, 128K)
#   TRANSFER_BACKEND    PD only: mooncake, mooncake_tcp or nixl, the same on both nodes (mooncake)
#   EXTRA_ARGS          extra launch_server flags, word-split                  ()

set -euo pipefail

EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
HOST=${HOST:-0.0.0.0}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-131072}
HISPARSE=${HISPARSE:-on}
TRANSFER_BACKEND=${TRANSFER_BACKEND:-mooncake}

# hisparse_args PRESET CONFIG_JSON MAX_RUNNING: sets HS_ARGS to the HiSparse flags (HISPARSE=on)
# or to nothing for the full-KV baseline (HISPARSE=off), and MRR_ARGS to --max-running-requests.
# CONFIG_JSON and MAX_RUNNING are what `plan --model PRESET --emit-config` prints for 128K (a
# test keeps them equal); PLAN re-runs the planner with its arguments, and HISPARSE_CONFIG /
# MAX_RUNNING_REQUESTS override either. The batch limit and the radix cache (RADIX) are the
# same in both arms, so the A/B differs only in HiSparse. When the planner's verdict is "off"
# (short contexts) the script runs the baseline.
HS_ARGS=()
MRR_ARGS=()
# RADIX=on (default): SGLang's radix cache stays on (sglang-hisparse shares matched prefixes
# through its host pool, docs/prefix-cache.md); RADIX=off adds --disable-radix-cache, which
# SGLang's in-tree HiSparse requires (ab_plugin_off.sh sets it).
RADIX=${RADIX:-on}
case "$RADIX" in
    on) RADIX_ARGS=() ;;
    off) RADIX_ARGS=(--disable-radix-cache) ;;
    *) echo "RADIX=$RADIX: use on or off" >&2; exit 2 ;;
esac
hisparse_args() {
    local config=$2 max_running=$3
    if [[ -n "${PLAN:-}" ]]; then
        local plan_text
        local -a plan_out=() plan_words=()
        # shellcheck disable=SC2206  # PLAN is meant to be word-split
        plan_words=(${PLAN})
        plan_text=$("$PYTHON" -m sglang_hisparse plan --model "$1" "${plan_words[@]}" --emit-config) ||
            { echo "PLAN=$PLAN: the planner refused it (message above)" >&2; exit 2; }
        mapfile -t plan_out <<<"$plan_text"
        config=${plan_out[0]}
        max_running=$(sed -n 's/.*--max-running-requests \([0-9]*\).*/\1/p' <<<"${plan_out[1]}")
        if [[ -z "$config" && "$HISPARSE" == on ]]; then
            echo "PLAN=$PLAN: the planner's verdict is HiSparse off here (its flags: ${plan_out[1]}); running the full-KV baseline" >&2
            HISPARSE=off
        fi
    fi
    MRR_ARGS=(--max-running-requests "${MAX_RUNNING_REQUESTS:-$max_running}")
    case "$HISPARSE" in
        on) HS_ARGS=(--enable-hisparse --hisparse-config "${HISPARSE_CONFIG:-$config}") ;;
        off) HS_ARGS=() ;;
        *) echo "HISPARSE=$HISPARSE: use on (HiSparse) or off (full-KV baseline)" >&2; exit 2 ;;
    esac
}

# transfer_args: sets XFER_ARGS to --disaggregation-transfer-backend "$TRANSFER_BACKEND" plus
# --disaggregation-ib-device "$IB_DEVICE" when IB_DEVICE is set (e.g. mlx5_0,mlx5_1; else the
# backend picks the devices), after checking that the backend moves KV between two H200 nodes
# and that $PYTHON can import it (not in a dry run). Prefill and decode must use the same one.
# Of SGLang 0.5.23's --disaggregation-transfer-backend choices:
#   mooncake      RDMA (the default). Neither sglang nor sglang-hisparse installs it:
#                 pip install mooncake-transfer-engine (torch on CUDA 12) or
#                 pip install mooncake-transfer-engine-cuda13 (torch on CUDA 13)
#   mooncake_tcp  the same package over TCP (SGLang sets MC_FORCE_TCP=1 and ignores IB_DEVICE):
#                 no RDMA NICs needed, much slower transfers; for trying PD out
#   nixl          NVIDIA's NIXL (UCX by default, SGLANG_DISAGGREGATION_NIXL_BACKEND):
#                 pip install nixl (nixl-cu12 / nixl-cu13 are the CUDA-specific builds)
#   mori, ascend  AMD (ROCm) and Huawei Ascend NPU transports: not for H200
#   fake          moves no KV: SGLang's stand-in for warm-up requests and tests
# With HiSparse the decode side registers its pinned host pool as the transfer target: mooncake
# registers buffers by address whatever memory they are in, and nixl takes them as its DRAM
# memory kind (read from SGLang 0.5.23's code; neither was run across two nodes here).
XFER_ARGS=()
transfer_args() {
    local module install
    case "$TRANSFER_BACKEND" in
        mooncake | mooncake_tcp)
            module=mooncake.engine
            install="pip install mooncake-transfer-engine (torch on CUDA 12) or mooncake-transfer-engine-cuda13 (CUDA 13)" ;;
        nixl)
            module=nixl._api
            install="pip install nixl" ;;
        mori | ascend | fake)
            echo "TRANSFER_BACKEND=$TRANSFER_BACKEND: not for H200 PD serving (mori: AMD GPUs, ascend: Ascend NPUs," \
                "fake: moves no KV); use mooncake, mooncake_tcp or nixl" >&2
            exit 2 ;;
        *)
            echo "TRANSFER_BACKEND=$TRANSFER_BACKEND: not a SGLang 0.5.23 transfer backend; use mooncake, mooncake_tcp or nixl" >&2
            exit 2 ;;
    esac
    XFER_ARGS=(--disaggregation-transfer-backend "$TRANSFER_BACKEND")
    if [[ -n "${IB_DEVICE:-}" && "$TRANSFER_BACKEND" != mooncake_tcp ]]; then
        XFER_ARGS+=(--disaggregation-ib-device "$IB_DEVICE")
    fi
    if [[ "${HISPARSE_DRY_RUN:-0}" != 1 ]] && ! "$PYTHON" -c "import $module" 2>/dev/null; then
        echo "TRANSFER_BACKEND=$TRANSFER_BACKEND needs the Python module $module, which $PYTHON cannot import." >&2
        echo "  Install it on both nodes: $install" >&2
        echo "  Alternatives: TRANSFER_BACKEND=mooncake_tcp (mooncake over TCP, no RDMA) or nixl (pip install nixl)." >&2
        exit 2
    fi
}

launch() {
    local -a extra=()
    # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
    [[ -n "${EXTRA_ARGS:-}" ]] && extra=(${EXTRA_ARGS})
    if [[ "${HISPARSE_DRY_RUN:-0}" == 1 ]]; then
        echo "# SGLANG_PLUGINS=${SGLANG_PLUGINS-<unset>}"
        echo "# SGLANG_HISPARSE_DISABLE_PREFETCH=${SGLANG_HISPARSE_DISABLE_PREFETCH-<unset>}"
        echo "# HISPARSE=$HISPARSE"
        echo "# RADIX=$RADIX"
        echo "sglang.launch_server"
        printf '%s\n' "$@" "${extra[@]}"
        exit 0
    fi
    echo "+ SGLANG_PLUGINS=${SGLANG_PLUGINS-} $PYTHON -m sglang.launch_server $* ${extra[*]}" >&2
    exec "$PYTHON" -m sglang.launch_server "$@" "${extra[@]}"
}
