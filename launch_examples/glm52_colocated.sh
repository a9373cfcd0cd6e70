#!/usr/bin/env bash
# GLM-5.2-FP8 on one 8xH200 node, co-located, HiSparse by sglang-hisparse: the prefetch A/B.
#
# GLM-5.2 shares index top-k: 21 anchor layers (0, 1, 5, ..., 77) run the indexer, the other
# 57 reuse the previous anchor's selection. With prefetch on, an anchor resolves its misses
# synchronously and records a miss plan; each shared layer's copies are replayed from that
# plan on a side stream while the anchor's attention runs, so only ~21/78 of the link time
# sits on the critical path (`python -m sglang_hisparse plan --model GLM-5.2` prints both).
# Runs:  the glm51_colocated.sh command with this model.
# Expect in the log: the "sglang-hisparse: ..." lines of glm51_colocated.sh.
# A/B:   ./glm52_colocated.sh                      prefetch on (default)
#        ./ab_prefetch_off.sh ./glm52_colocated.sh every layer resolves synchronously:
#                                                  same outputs, higher time per output token
#        ./ab_plugin_off.sh ./glm52_colocated.sh   SGLang's in-tree HiSparse
#        HISPARSE=off ./glm52_colocated.sh         full KV on the GPU
# Env:   MODEL_PATH PORT(30000) CONTEXT_LENGTH HISPARSE PLAN HISPARSE_CONFIG MAX_RUNNING_REQUESTS
#        EXTRA_ARGS PYTHON, see _common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

MODEL_PATH=${MODEL_PATH:-zai-org/GLM-5.2-FP8}
PORT=${PORT:-30000}
hisparse_args GLM-5.2 '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 32}' 152

args=(
    --model-path "$MODEL_PATH" --trust-remote-code
    --host "$HOST" --port "$PORT"
    --tp-size 8 --attn-dp-size 8
    --context-length "$CONTEXT_LENGTH"
    --mem-fraction-static 0.85 --chunked-prefill-size 65536
    --kv-cache-dtype bfloat16 --dsa-decode-backend flashmla_sparse
    "${RADIX_ARGS[@]}" "${MRR_ARGS[@]}"
    --watchdog-timeout 3600
    "${HS_ARGS[@]}"
)
launch "${args[@]}"
