#!/usr/bin/env bash
# DeepSeek-V4-Flash on one 8xH200 node, prefill and decode co-located, HiSparse by sglang-hisparse.
#
# Runs:  python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4-Flash --tp-size 8
#        --attn-dp-size 8 --kv-cache-dtype fp8_e4m3 --dsv4-attn-backend flashmla
#        --disable-radix-cache --max-running-requests 5392 --enable-hisparse
#        --hisparse-config '{"top_k": 512, ...}' ...
# Sizing: `python -m sglang_hisparse plan --model DeepSeek-V4-Flash` (128K): the 21 C4 layers'
#        compressed entries (one per 4 tokens) go through HiSparse, B = 1024 entries; about 5392
#        concurrent requests instead of 1448 with full KV, host DRAM (2 TiB assumed) capping it.
#        The radix cache stays off (RADIX is ignored): sglang-hisparse serves V4 without it, as
#        SGLang's in-tree HiSparse does.
# Expect in the log: "sglang-hisparse: HiSparse on for ... DeepSeek-V4 C4 layers' compressed
#        entries (...)" and the host KV pool line; the periodic "HiSparse: hit rate" line once
#        requests pass 4096 tokens (1024 entries).
# A/B:   HISPARSE=off ./dsv4_flash_colocated.sh        full KV on the GPU
#        ./ab_plugin_off.sh ./dsv4_flash_colocated.sh  SGLang's in-tree HiSparse
#        (every C4 layer runs its own indexer: no prefetch groups, ab_prefetch_off.sh is a no-op.)
#        PD: dsv4_flash_pd_prefill.sh + dsv4_flash_pd_decode.sh.
# Env:   MODEL_PATH PORT(30000) CONTEXT_LENGTH HISPARSE PLAN HISPARSE_CONFIG MAX_RUNNING_REQUESTS
#        EXTRA_ARGS PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
RADIX_ARGS=(--disable-radix-cache)  # whatever RADIX says: V4 is served with the radix cache off

MODEL_PATH=${MODEL_PATH:-deepseek-ai/DeepSeek-V4-Flash}
PORT=${PORT:-30000}
hisparse_args DeepSeek-V4-Flash '{"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 32}' 5392

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.85 --chunked-prefill-size 65536
    --kv-cache-dtype fp8_e4m3 --dsv4-attn-backend flashmla
    "${RADIX_ARGS[@]}" "${MRR_ARGS[@]}"
    --watchdog-timeout 3600
    "${HS_ARGS[@]}"
)
launch "${args[@]}"
