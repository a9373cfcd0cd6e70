#!/usr/bin/env bash
# GLM-5.1-FP8, PD-disaggregated: the DECODE instance (one 8xH200 node) with HiSparse by sglang-hisparse.
#
# Runs:  python -m sglang.launch_server --model-path zai-org/GLM-5.1-FP8 --tp-size 8 --attn-dp-size 8
#        --disaggregation-mode decode --kv-cache-dtype bfloat16
#        --dsa-decode-backend flashmla_sparse --enable-hisparse
#        --hisparse-config '{...}' --max-running-requests N
#        --disaggregation-decode-retraction-backup none --disaggregation-transfer-backend mooncake ...
# What changes with HiSparse: the prefill instance's KV transfer is received into the pinned
#        host pool (direct admission), not into GPU rows; a request then gets only its B+1 hot
#        slots per layer on the GPU (preloaded when it is short, empty when long), so the decode
#        node admits many more long requests (`python -m sglang_hisparse plan --model GLM-5.1`).
# Expect in the log: the "sglang-hisparse: registered N hooks", "HiSparse on for ..." and
#        "host KV pool ..." lines of the co-located script, and the periodic "HiSparse: hit rate
#        .., .. misses/step, .. GB host->device ..; staged .. reqs, .. | totals: .. direct" line,
#        whose "direct" count grows with every request received from prefill.
# A/B:   HISPARSE=off ./glm51_pd_decode.sh         full KV on the decode GPUs
#        ./ab_plugin_off.sh ./glm51_pd_decode.sh   SGLang's in-tree HiSparse, same command
# Needs: a KV transfer backend both nodes can import, picked by TRANSFER_BACKEND (same on both):
#        mooncake (default, RDMA; not installed by sglang or sglang-hisparse:
#        pip install mooncake-transfer-engine, or mooncake-transfer-engine-cuda13 for torch on
#        CUDA 13), mooncake_tcp (the same package over TCP, no RDMA) or nixl (pip install nixl).
#        The script checks the import before launching; _common.sh lists SGLang's other choices.
# Env:   MODEL_PATH PORT(30001) TRANSFER_BACKEND IB_DEVICE CONTEXT_LENGTH HISPARSE PLAN HISPARSE_CONFIG
#        MAX_RUNNING_REQUESTS EXTRA_ARGS PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

MODEL_PATH=${MODEL_PATH:-zai-org/GLM-5.1-FP8}
PORT=${PORT:-30001}
hisparse_args GLM-5.1 '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 32}' 152
transfer_args
# sglang-hisparse refuses a PD decode server that would back KV up across retraction:
# SGLang 0.5.23 releases a request's HiSparse state before the backup and resumes it without
# direct admission (docs/patches.md, "Upstream issues"); 'none' aborts it with 503 instead.
if [[ "$HISPARSE" == on ]]; then HS_ARGS+=(--disaggregation-decode-retraction-backup none); fi

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.85 --chunked-prefill-size 65536
    --kv-cache-dtype bfloat16 --dsa-decode-backend flashmla_sparse
    "${RADIX_ARGS[@]}" "${MRR_ARGS[@]}"
    --disaggregation-mode decode "${XFER_ARGS[@]}"
    --watchdog-timeout 3600
    "${HS_ARGS[@]}"
)
launch "${args[@]}"
