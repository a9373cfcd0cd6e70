# Shared by every launch example; sourced, not run. Bash 4+.
#
# launch ARG...   starts `python -m sglang.launch_server ARG...` (exec: the server is this
#                 process). With HISPARSE_DRY_RUN=1 it prints the argument vector, one
#                 argument per line after a "sglang.launch_server" line, plus the A/B
#                 environment, and exits 0 without starting anything; the test suite uses
#                 this to check every flag against SGLang 0.5.23's real parser.
#
# Environment read by every script (all optional):
#   PYTHON              interpreter with sglang + sglang-hisparse installed   (python3)
#   MODEL_PATH          HF repo id or local checkpoint directory              (per script)
#   HOST, PORT          where the HTTP server listens                          (0.0.0.0, per script)
#   CONTEXT_LENGTH      --context-length                                       (131072)
#   HISPARSE            on = --enable-hisparse + --hisparse-config; off = full-KV baseline (on)
#   HISPARSE_CONFIG     the --hisparse-config JSON                             (per script)
#   EXTRA_ARGS          extra launch_server flags, word-split                  ()

set -euo pipefail

PYTHON=${PYTHON:-python3}
HOST=${HOST:-0.0.0.0}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-131072}
HISPARSE=${HISPARSE:-on}

# hisparse_args CONFIG_JSON: sets HS_ARGS to the HiSparse flags (HISPARSE=on, HISPARSE_CONFIG
# overrides the JSON) or to nothing for the full-KV baseline (HISPARSE=off). Every script keeps
# --disable-radix-cache in both arms (HiSparse requires it) so the A/B differs only in HiSparse.
HS_ARGS=()
hisparse_args() {
    case "$HISPARSE" in
        on) HS_ARGS=(--enable-hisparse --hisparse-config "${HISPARSE_CONFIG:-$1}") ;;
        off) HS_ARGS=() ;;
        *) echo "HISPARSE=$HISPARSE: use on (HiSparse) or off (full-KV baseline)" >&2; exit 2 ;;
    esac
}

# ib_args: --disaggregation-ib-device "$IB_DEVICE" when IB_DEVICE is set (e.g. mlx5_0,mlx5_1),
# else nothing (the transfer backend picks the devices itself).
IB_ARGS=()
ib_args() {
    if [[ -n "${IB_DEVICE:-}" ]]; then IB_ARGS=(--disaggregation-ib-device "$IB_DEVICE"); fi
}

launch() {
    local -a extra=()
    # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
    [[ -n "${EXTRA_ARGS:-}" ]] && extra=(${EXTRA_ARGS})
    if [[ "${HISPARSE_DRY_RUN:-0}" == 1 ]]; then
        echo "# SGLANG_PLUGINS=${SGLANG_PLUGINS-<unset>}"
        echo "# SGLANG_HISPARSE_DISABLE_PREFETCH=${SGLANG_HISPARSE_DISABLE_PREFETCH-<unset>}"
        echo "sglang.launch_server"
        printf '%s\n' "$@" "${extra[@]}"
        exit 0
    fi
    echo "+ SGLANG_PLUGINS=${SGLANG_PLUGINS-} $PYTHON -m sglang.launch_server $* ${extra[*]}" >&2
    exec "$PYTHON" -m sglang.launch_server "$@" "${extra[@]}"
}
