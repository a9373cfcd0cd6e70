#!/usr/bin/env bash
# GLM-5.1-FP8 on one 8xH200 node, prefill and decode co-located, HiSparse by sglang-hisparse.
#
# Runs:  python -m sglang.launch_server --model-path zai-org/GLM-5.1-FP8 --tp-size 8 --attn-dp-size 8
#        --kv-cache-dtype bfloat16 --dsa-decode-backend flashmla_sparse
#        --max-running-requests 152 --enable-hisparse
#        --hisparse-config '{...B = 4096...}' ...
# Sizing: `python -m sglang_hisparse plan` (GLM-5.1, 8xH200, 128K) gives the config below and
#        expects about 152 concurrent 128K requests instead of 16 with full KV on the GPU; it
#        needs ~1.7 TB of host DRAM for pinned KV at that batch (host_to_device_ratio 32).
#        For shorter contexts let the script ask the planner: PLAN="--context 32K" takes the
#        config (32K: ratio 8) and --max-running-requests from `plan --context 32K --emit-config`.
# Expect in the log (once per process: launcher and every TP rank):
#        "sglang-hisparse: registered N hooks for SGLang 0.5.23 (in-tree HiSparse replaced; ...)"
#        "sglang-hisparse: HiSparse on for ... with {...} (kv dtype bfloat16, DSA backends ...)"
#        "sglang-hisparse: host KV pool X GiB of Y GiB available."
#        and, every SGLANG_HISPARSE_LOG_INTERVAL seconds while decoding past B tokens:
#        "HiSparse: hit rate ..%, .. misses/step, .. GB host->device (.. GB/s) over .. steps; ..."
# A/B:   HISPARSE=off ./glm51_colocated.sh       full KV on the GPU (same flags minus HiSparse)
#        ./ab_plugin_off.sh ./glm51_colocated.sh SGLang's in-tree HiSparse, same command
#        (GLM-5.1 has no index sharing: every layer is an anchor, so ab_prefetch_off.sh changes
#        nothing here; use glm52_colocated.sh for the prefetch A/B.)
# Env:   MODEL_PATH PORT(30000) CONTEXT_LENGTH HISPARSE PLAN HISPARSE_CONFIG MAX_RUNNING_REQUESTS
#        EXTRA_ARGS PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

MODEL_PATH=${MODEL_PATH:-zai-org/GLM-5.1-FP8}
PORT=${PORT:-30000}
hisparse_args GLM-5.1 '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 32}' 152

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.85 --chunked-prefill-size 65536
    # H200 (sm_90): DSA KV in bf16 (1152 B rows) read by flashmla_sparse; fp8 needs sm_100.
    --kv-cache-dtype bfloat16 --dsa-decode-backend flashmla_sparse
    "${RADIX_ARGS[@]}" "${MRR_ARGS[@]}"
    --watchdog-timeout 3600
    "${HS_ARGS[@]}"
)
launch "${args[@]}"
