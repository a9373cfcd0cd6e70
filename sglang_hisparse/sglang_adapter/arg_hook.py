"""Server-argument validation under ``--enable-hisparse`` (replaces SGLang's ``validate_hisparse``).

SGLang calls :func:`validate_hisparse` from its ``check_server_args`` post-process pass, after
DSA backend defaults are resolved and before any process is spawned or memory pinned. Each
rule raises ``ValueError`` naming the flag, the value, the rule and the fix. The decisions
that pass are logged once, so an operator can see what HiSparse will run with. Which models,
platforms and serving paths are served at all is ``arg_scope``'s.

:func:`parse_hisparse_config` replaces SGLang's ``parse_hisparse_config`` so pool sizing in
SGLang's configurators reads the same validated :class:`HiSparseConfig`.

The configuration is resolved in one place, :func:`resolve_config`: the ``--hisparse-config``
text, the served model's selection width (``arg_scope.check_model`` at validation,
``arg_scope.selection_width`` in a scheduler process) and W (speculative decoding) give one
:class:`HiSparseConfig` (the same object for the same inputs). :func:`server_config` is that
object for the server this process belongs to; every reader in the adapter (SGLang's pool
sizing through :func:`parse_hisparse_config`, the coordinator, the KV budget) takes it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from sglang_hisparse import SUPPORTED_SGLANG
from sglang_hisparse.arg_scope import (
    check_model,
    check_platform,
    check_serving_paths,
    hf_attr,
    m3_sparse_layers,
    model_label,
    selection_width,
)
from sglang_hisparse.config import IN_TREE_HINT, HiSparseConfig
from sglang_hisparse.memory.budget import (
    GIB,
    available_host_bytes,
    check_host_budget,
    ranks_per_host,
)
from sglang_hisparse.memory.host_pool import host_pool_bytes
from sglang_hisparse.presets import kv_row_bytes

logger = logging.getLogger(__name__)

KV_DTYPES = ("bfloat16", "fp8_e4m3", "auto")
#: MiniMax-M3: K/V rows of one plain dtype (SGLang builds M3's main pool unquantized)
M3_KV_DTYPES = ("auto", "bfloat16", "bf16", "fp8_e4m3", "fp8_e5m2")
#: DSA attention backends that read our resolved device rows, by KV cache dtype (CUDA).
BACKENDS_BY_DTYPE = {
    "bfloat16": frozenset({"flashmla_sparse"}),
    "fp8_e4m3": frozenset({"flashmla_kv", "flashinfer_sparse_mla"}),
}
#: With ``auto`` the stored dtype follows the checkpoint, so any of the above may be right.
BACKENDS_AUTO = frozenset().union(*BACKENDS_BY_DTYPE.values())
A_B_HINT = IN_TREE_HINT


def validate_hisparse(server_args: Any) -> None:
    """Reject unsupported ``--enable-hisparse`` combinations; log what was decided."""
    from sglang.srt.arg_groups.model_override_base import (
        model_config_of,
        resolved_view,
        resolving_view,
    )

    cfg = resolving_view(server_args)
    if not cfg.enable_hisparse:
        return
    view = resolved_view(server_args)
    model_config = model_config_of(server_args)
    hf_config = model_config.hf_config
    index_topk = check_model(cfg, model_config)
    check_platform()
    if cfg.enable_mixed_chunk:
        raise ValueError(
            "--enable-hisparse does not support --enable-mixed-chunk: the HiSparse decode batch "
            "is built from requests whose prompt is safe on host and cannot merge a prefill "
            "chunk. Remove --enable-mixed-chunk."
        )
    num_draft_tokens = _check_speculative(cfg, view)
    check_serving_paths(cfg, view, speculative=cfg.speculative_algorithm if num_draft_tokens else None)
    check_radix_cache(cfg, speculative=bool(num_draft_tokens))

    kv_dtype = view.kv_cache_dtype
    from sglang.srt.configs.model_config import is_minimax_sparse

    m3 = is_minimax_sparse(hf_config)
    from sglang.srt.configs.model_config import is_deepseek_v4

    v4 = is_deepseek_v4(hf_config)
    if v4 and kv_dtype not in ("fp8_e4m3", "auto"):
        raise ValueError(
            f"--enable-hisparse with DeepSeek-V4: --kv-cache-dtype {kv_dtype} is not supported; its C4 pool "
            f"stores fp8_e4m3 entries (SGLang asserts uint8 storage). Use --kv-cache-dtype fp8_e4m3."
        )
    if m3 and kv_dtype not in M3_KV_DTYPES:
        raise ValueError(
            f"--enable-hisparse with MiniMax-M3: --kv-cache-dtype {kv_dtype} is not supported; "
            f"HiSparse holds M3's K and V as plain rows of one dtype. Use --kv-cache-dtype "
            f"{', '.join(M3_KV_DTYPES)}."
        )
    if not (m3 or v4) and kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"--enable-hisparse: --kv-cache-dtype {kv_dtype} is not supported; the resolve "
            f"kernel moves bf16 (1152 B) or fp8_e4m3 (656 B) MLA rows. Use "
            f"--kv-cache-dtype fp8_e4m3, bfloat16 or auto."
        )
    allowed = BACKENDS_BY_DTYPE.get(kv_dtype, BACKENDS_AUTO)
    for attr, label in (() if m3 or v4 else (("dsa_prefill_backend", "prefill"), ("dsa_decode_backend", "decode"))):
        backend = getattr(view, attr, None)
        if backend is not None and backend not in allowed:
            raise ValueError(
                f"--enable-hisparse with --kv-cache-dtype {kv_dtype}: --dsa-{label}-backend "
                f"{backend} cannot read HiSparse's resolved rows. Use one of "
                f"{sorted(allowed)}, or omit --dsa-{label}-backend to let SGLang choose."
            )

    config = resolve_config(cfg.hisparse_config, model_top_k=index_topk, num_draft_tokens=num_draft_tokens)
    if not v4:  # V4's host pool is checked where it is built (C4 entries of 592 B per 4 tokens)
        _check_host_memory(view, hf_config, config, kv_dtype, m3=m3, model_config=model_config)
    logger.info(
        "sglang-hisparse: HiSparse on for %s with %s (kv dtype %s, %s).",
        model_label(cfg, hf_config),
        config.to_json(),
        kv_dtype,
        "MiniMax-M3 block top-k over the sparse layers' K/V" if m3 else
        "DeepSeek-V4 C4 layers' compressed entries (one per 4 tokens; windows, C128 and indexer keys on the device)" if v4 else
        f"DSA backends {getattr(view, 'dsa_prefill_backend', None)}/{getattr(view, 'dsa_decode_backend', None)}",
    )


#: speculative algorithms whose target verify is SGLang's EAGLE chain path (NEXTN resolves to EAGLE)
SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


#: flags that make the radix tree move or keep KV itself (flag, attribute, why refused)
_RADIX_CONFLICTS = (
    ("--enable-hierarchical-cache", "enable_hierarchical_cache",
     "HiCache would load and write back the tree's logical ids as device rows"),
    ("--enable-lmcache", "enable_lmcache", "LMCache would store the tree's logical ids as device rows"),
    ("--enable-flexkv", "enable_flexkv", "FlexKV would store the tree's logical ids as device rows"),
    ("--enable-unified-cache-external-linker", "enable_unified_cache_external_linker",
     "an external cache linker would store the tree's logical ids as device rows"),
    ("--enable-streaming-session", "enable_streaming_session",
     "a session keeps its request's KV row past release, outside the coordinator"),
    ("--enable-session-radix-cache", "enable_session_radix_cache",
     "a session keeps its request's KV row past release, outside the coordinator"),
)


def check_radix_cache(cfg: Any, *, speculative: bool) -> None:
    """With the radix cache on (the default), refuse what HiSparse's prefix sharing does not
    cover yet (docs/prefix-cache.md); the radix cache off is always fine."""
    if cfg.disable_radix_cache:
        return
    fix = "or add --disable-radix-cache"
    for flag, attr, why in _RADIX_CONFLICTS:
        if getattr(cfg, attr, False):
            raise ValueError(f"--enable-hisparse with the radix cache does not support {flag}: {why}. "
                             f"Remove {flag}, {fix}.")
    backend = getattr(cfg, "radix_cache_backend", None)
    if backend is not None:
        raise ValueError(f"--enable-hisparse with the radix cache needs SGLang's default tree, not "
                         f"--radix-cache-backend {backend}: our hooks follow its call protocol. Remove "
                         f"--radix-cache-backend, {fix}.")
    if speculative:
        raise ValueError("--enable-hisparse with the radix cache does not support speculative decoding yet "
                         "(the verify path is not covered by prefix sharing). Add --disable-radix-cache, or "
                         "remove --speculative-algorithm.")
    if getattr(cfg, "disaggregation_mode", "null") == "decode":
        return  # SGLang's own radix rule for PD decode applies (its decode radix cache is refused)
    logger.info("sglang-hisparse: radix cache on: matched prefixes are shared through the host "
                "pool (a logical id's host row is the id) and loaded to the device on demand.")


def _check_speculative(cfg: Any, view: Any) -> int:
    """W = speculative_num_draft_tokens as SGLang resolved it (0 without speculation), after
    rejecting what the verify window cannot serve."""
    spec = cfg.speculative_algorithm
    if spec is None or str(spec).upper() == "NONE":
        return 0
    if str(spec).upper() not in SPEC_ALGORITHMS:
        raise ValueError(
            f"--enable-hisparse with --speculative-algorithm {spec} is not supported by "
            f"sglang-hisparse: only the EAGLE chain verify path ({', '.join(SPEC_ALGORITHMS)}) "
            f"drives its verify window. Use one of those, or {A_B_HINT}."
        )
    topk = getattr(view, "speculative_eagle_topk", None) or 1
    if topk != 1:
        raise ValueError(
            f"--enable-hisparse with --speculative-eagle-topk {topk}: tree verify is not "
            f"supported. sglang-hisparse commits the accepted tokens as a chain prefix of the "
            f"verify rows (row j = position s+j), which a tree's accepted path is not. Use "
            f"--speculative-eagle-topk 1."
        )
    if getattr(cfg, "speculative_adaptive", False):
        raise ValueError(
            "--enable-hisparse does not support --speculative-adaptive: the verify window is "
            "sized once at startup (W = --speculative-num-draft-tokens slots per request, the "
            "hot buffer validated against W * top_k, kernels built for W). Remove "
            "--speculative-adaptive and set --speculative-num-draft-tokens."
        )
    return int(getattr(view, "speculative_num_draft_tokens", None) or 0)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _check_host_memory(view: Any, hf_config: Any, config: HiSparseConfig, kv_dtype: str, *,
                       m3: bool = False, model_config: Any = None) -> None:
    """The host pools' budget at validation, when ``--max-total-tokens`` fixes the device KV
    rows: the same row bytes (``presets.kv_row_bytes``), pool bytes (``host_pool_bytes``) and
    policy (``check_host_budget`` over ``ranks_per_host``) the pool applies before pinning."""
    device_rows = getattr(view, "max_total_tokens", None)
    if not device_rows:
        # NOTE: device KV rows are known only after SGLang profiles GPU memory in each
        # scheduler; the host pool repeats this check with the real figure before pinning.
        logger.info(
            "sglang-hisparse: host-memory check deferred to pool construction (device KV rows "
            "are known after GPU memory profiling); pass --max-total-tokens to check it now."
        )
        return
    pp = max(1, int(getattr(view, "pp_size", 1) or 1))
    if m3:
        # the sparse layers' K then V, one head per rank (arg_scope refused more)
        layers = -(-len(m3_sparse_layers(hf_config)) // pp)
        row = 2 * int(model_config.head_dim) * (1 if kv_dtype.startswith("fp8") else 2)
    else:
        # a pipeline stage holds its share of the layers; the largest share is the one to fit
        layers = -(-int(hf_attr(hf_config, "num_hidden_layers", 0)) // pp)
        row = kv_row_bytes(
            int(hf_attr(hf_config, "kv_lora_rank", 512)),
            int(hf_attr(hf_config, "qk_rope_head_dim", 64)),
            "fp8" if kv_dtype == "fp8_e4m3" else "bf16",  # auto: the larger bf16 row
        )
    ratio = config.host_to_device_ratio
    per_rank = host_pool_bytes(
        num_layers=layers, item_bytes=row, capacity_tokens=device_rows * ratio,
        page_size=int(getattr(view, "page_size", None) or 1),
    )
    # After 0.5.23's resolution dp_size counts replicas only: attention DP lives in attn_dp_size,
    # inside tp_size, and the deprecated --dp-size N --enable-dp-attention has become
    # attn_dp_size N, dp_size 1 with the flag cleared (parallel_hook.handle_deprecated_dp_attention).
    replicas = int(view.dp_size)
    ranks = ranks_per_host(
        tp_size=int(getattr(view, "tp_size", 1) or 1), pp_size=pp,
        nnodes=int(getattr(view, "nnodes", 1) or 1), dp_replicas=max(replicas, 1),
    )
    have = available_host_bytes()
    check_host_budget(
        per_rank,
        what=(f"--enable-hisparse: the pinned host KV pool ({device_rows} device rows x "
              f"host_to_device_ratio {ratio} x {layers} layers x {row} B)"),
        ranks_per_host=ranks, available_bytes=have, ratio=ratio,
    )
    logger.info("sglang-hisparse: host KV pools %s (%d rank(s)) of %s available.",
                gib(per_rank * ranks), ranks, gib(have))


def resolve_config(text: str | None, *, model_top_k: int | None = None,
                   num_draft_tokens: int = 0) -> HiSparseConfig:
    """The one place a ``--hisparse-config`` text becomes a :class:`HiSparseConfig`: validated
    for the model's selection width (``model_top_k``; its default buffer sized for it) and W.
    The same inputs give the same object (cached; a rejection raises each time)."""
    return _resolved(text, None if model_top_k is None else int(model_top_k), int(num_draft_tokens or 0))


@functools.lru_cache(maxsize=32)
def _resolved(text: str | None, model_top_k: int | None, num_draft_tokens: int) -> HiSparseConfig:
    return HiSparseConfig.from_json(text, model_top_k=model_top_k, num_draft_tokens=num_draft_tokens)


def server_config() -> HiSparseConfig | None:
    """This process's server configuration: the ``--hisparse-config`` text SGLang published,
    resolved (:func:`resolve_config`) for the model the server loads (its selection width from
    the model's config, as validation found it) and the W SGLang resolved. None when no SGLang
    config is published (tests and benchmarks that build pieces directly: not a server)."""
    try:
        from sglang.srt.runtime_context import get_memory, get_spec

        text = get_memory().hisparse_config
    except ValueError:
        return None
    spec = get_spec()
    algo = getattr(spec, "speculative_algorithm", None)
    on = algo is not None and str(algo).upper() != "NONE"
    W = int(getattr(spec, "speculative_num_draft_tokens", None) or 0) if on else 0
    return resolve_config(text, model_top_k=_served_width(), num_draft_tokens=W)


def _served_width() -> int | None:
    """The served model's selection width (``arg_scope.selection_width``), or None where the
    process has no model config SGLang can build (a record without a model path)."""
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of
        from sglang.srt.runtime_context import get_server_args

        return selection_width(model_config_of(get_server_args()).hf_config)
    except (ValueError, OSError, TypeError, AttributeError) as exc:
        logger.debug("sglang-hisparse: no model config to size the buffer for (%r)", exc)
        return None


def parse_hisparse_config() -> HiSparseConfig:
    """Replacement for SGLang's ``parse_hisparse_config``: :func:`server_config`, the same
    object the coordinator and the KV budget read (its ``device_buffer_size`` the one
    :func:`validate_hisparse` logged). SGLang calls it only inside a server."""
    cfg = server_config()
    if cfg is None:
        raise ValueError("sglang-hisparse: parse_hisparse_config called with no SGLang server "
                         "config published (it is SGLang's call inside a server).")
    return cfg


def published_config() -> HiSparseConfig:
    """:func:`server_config`, or the defaults when no SGLang config is published (tests,
    benchmarks that build a coordinator directly)."""
    return server_config() or HiSparseConfig()


__all__ = ["validate_hisparse", "parse_hisparse_config", "resolve_config", "server_config",
           "published_config", "SUPPORTED_SGLANG"]
