"""What sglang-hisparse serves: the model family, platform and serving paths ``--enable-hisparse``
may be combined with, checked by ``arg_hook.validate_hisparse`` before any process starts.

Every refusal here is a combination that SGLang 0.5.23 would otherwise accept, load the weights
for, and then fail on (or leak host memory on) at the coordinator's first use: SGLang builds
other pools and allocators for it, or calls the coordinator in a way no correct bookkeeping
can follow. Each ``ValueError`` names the flag or model, the reason (with the SGLang file that
makes it so), and what to do. SGLang's in-tree HiSparse serves some of these (DeepSeek-V4,
MiniMax-M3, ROCm), so the messages say how to run it (``config.IN_TREE_HINT``).
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse import SUPPORTED_SGLANG
from sglang_hisparse.config import IN_TREE_HINT

#: what the refusals say sglang-hisparse does serve
SUPPORTED = ("DSA models (DeepSeek-V3.2, GLM-5.x), MiniMax-M3 (bf16 / fp8 KV) and DeepSeek-V4 (fp8_e4m3 KV) "
             "on CUDA")

#: why ``SGLANG_PLUGINS`` does not serve a dense-attention model either (tests/unit/test_in_tree_scope.py)
DENSE_IN_TREE = (f"SGLang {SUPPORTED_SGLANG}'s in-tree HiSparse refuses it as well (hisparse_hook.validate_hisparse "
                 f"asserts a DSA, DeepSeek-V4 or MiniMax-M3 model), and its mem_cache/sparsity framework "
                 f"(\"algorithm\": \"quest\") is built on no server path (create_sparse_coordinator has no "
                 f"caller), so SGLANG_PLUGINS would not serve it either")

#: (platform fact of SGLang's ``get_platform()``, name in the message); CUDA is the default
NON_CUDA = (("is_hip", "ROCm"), ("is_npu", "NPU"), ("is_xpu", "XPU"), ("is_musa", "MUSA"))


def hf_attr(hf_config: Any, name: str, default: Any = None) -> Any:
    """``hf_config.name``, else ``hf_config.text_config.name``, else ``default``."""
    value = getattr(hf_config, name, None)
    if value is None:
        value = getattr(getattr(hf_config, "text_config", None), name, None)
    return default if value is None else value


def model_label(view: Any, hf_config: Any) -> str:
    archs = hf_attr(hf_config, "architectures") or ["<no architectures>"]
    return f"{view.model_path} ({', '.join(archs)})"


def check_model(cfg: Any, model_config: Any) -> int:
    """The positions the model selects per layer and step (a DSA model's ``index_topk``; for
    MiniMax-M3 :func:`m3_selection`'s blocks x block size), after refusing models whose pools
    SGLang does not build from our classes. ``model_config`` is SGLang's ``ModelConfig``
    (``model_config_of``).

    NOTE: the positive test is SGLang's own ``is_deepseek_dsa`` (configs/model_config.py:191),
    the predicate ``kv_cache_configurator`` uses to choose the DSA pool, rather than the mere
    presence of ``index_topk``: DeepSeek-V4 also has ``index_topk`` and gets other pools.
    """
    from sglang.srt.configs.model_config import is_deepseek_dsa, is_deepseek_v4, is_minimax_sparse

    hf_config = model_config.hf_config
    label = model_label(cfg, hf_config)
    if is_deepseek_v4(hf_config):
        return _check_v4(cfg, label, model_config)
    if is_minimax_sparse(hf_config):
        return _check_m3(cfg, label, model_config)
    index_topk = hf_attr(hf_config, "index_topk")
    if index_topk is None:
        raise ValueError(
            f"--enable-hisparse: model {label} is not a DSA model (its config has no "
            f"'index_topk'). sglang-hisparse resolves the top-k selections of a DSA indexer: it "
            f"serves {SUPPORTED}. Drop --enable-hisparse for this model: {DENSE_IN_TREE}."
        )
    if not is_deepseek_dsa(hf_config):
        raise ValueError(
            f"--enable-hisparse: model {label} has 'index_topk' but its architecture is not one "
            f"SGLang builds the DSA KV pool for (is_deepseek_dsa, configs/model_config.py:191), "
            f"so sglang-hisparse's pool and allocator would not be used. sglang-hisparse serves "
            f"{SUPPORTED}. Drop --enable-hisparse, or {IN_TREE_HINT}."
        )
    _check_pool_kind(label, model_config)
    return int(index_topk)


def selection_width(hf_config: Any) -> int:
    """The positions the served model selects per layer and step, from its config alone (no
    refusals: :func:`check_model` applied them at validation and returns the same figure): a
    DSA model's and DeepSeek-V4's ``index_topk`` (V4: C4 entries), MiniMax-M3's
    :func:`m3_selection` blocks x block size. The top_k of the server's resolved config."""
    from sglang.srt.configs.model_config import is_minimax_sparse

    if is_minimax_sparse(hf_config):
        block, blocks = m3_selection(hf_config)
        return block * blocks
    return int(hf_attr(hf_config, "index_topk"))


def m3_selection(hf_config: Any) -> tuple[int, int]:
    """(block size, most blocks one decode step passes to ``swap_in_selected_blocks``) of a
    MiniMax-M3 config: its ``sparse_topk_blocks`` plus the forced init and local blocks, counted
    as SGLang's M3 backend counts them (``minimax_sparse_backend.py``: ``sparse_init_block`` or
    ceil(``sparse_init_tokens`` / block); ``sparse_local_block`` or ceil(``sparse_local_tokens``
    / block) + 1), whose ``_merge_sparse_blocks`` returns that many columns."""
    from sglang.srt.configs.model_config import get_minimax_sparse_attention_config

    sc = get_minimax_sparse_attention_config(hf_config)
    block = int(sc["sparse_block_size"])
    init = int(sc["sparse_init_block"]) if "sparse_init_block" in sc else -(-int(sc.get("sparse_init_tokens", 0)) // block)
    local = (int(sc["sparse_local_block"]) if "sparse_local_block" in sc
             else -(-int(sc.get("sparse_local_tokens", 0)) // block) + 1)
    topk = int(sc["sparse_topk_blocks"])
    return block, topk + max(init, 0) + max(local, 0)


def m3_sparse_layers(hf_config: Any) -> list[int]:
    """The layer ids of a MiniMax-M3 config whose K/V go through HiSparse (its sparse layers)."""
    from sglang.srt.configs.model_config import (
        get_minimax_sparse_attention_config,
        get_minimax_sparse_layer_ids,
    )

    return get_minimax_sparse_layer_ids(get_minimax_sparse_attention_config(hf_config))[1]


def _check_m3(cfg: Any, label: str, model_config: Any) -> int:
    """MiniMax-M3: refuse what it does not serve (docs/v4-m3.md D5, D7); the
    positions a decode step selects (:func:`m3_selection`)."""
    hf_config = model_config.hf_config
    if getattr(model_config, "quantization", None) == "minimax_m3_nvfp4":
        raise ValueError(
            f"--enable-hisparse: model {label} is an NVFP4 MiniMax-M3 checkpoint, whose KV pool "
            f"(MiniMaxM3Nvfp4KVPool) and attention backend never call the HiSparse coordinator. "
            f"Serve a bf16 or fp8 checkpoint with sglang-hisparse, or drop --enable-hisparse."
        )
    sparse = m3_sparse_layers(hf_config)
    if not sparse or sparse != list(range(sparse[0], sparse[-1] + 1)):
        raise ValueError(
            f"--enable-hisparse: model {label} has sparse layers {sparse}; SGLang's M3 HiSparse pool "
            f"addresses its layers as layer_id - first sparse layer, so they must be one contiguous "
            f"run. Drop --enable-hisparse for this model."
        )
    _refuse_paths(cfg, f"MiniMax-M3 ({label})", pd=None, spec="swap_in_selected_blocks has no target-verify form")
    if _pd_decode(cfg):
        from sglang.srt.configs.model_config import (
            get_minimax_sparse_attention_config,
            get_minimax_sparse_disable_value_layer_ids,
        )

        keep_value = sorted(set(sparse) - set(get_minimax_sparse_disable_value_layer_ids(
            get_minimax_sparse_attention_config(hf_config))))
        if keep_value:
            raise ValueError(
                f"--enable-hisparse with MiniMax-M3 ({label}) as a PD decode server: sparse layers "
                f"{keep_value} keep an index value (sparse_disable_index_value unset for them), whose "
                f"transfer SGLang 0.5.23 does not implement (disaggregation/utils.py:1528, with or without "
                f"HiSparse). Serve this checkpoint co-located (drop --disaggregation-mode).")
        _require_mooncake(cfg, f"MiniMax-M3 ({label})", "the dense layers' K/V and the index keys go device to "
                          "device as MiniMax state, which SGLang 0.5.23 sends only over Mooncake")
    _check_m3_heads(cfg, label, model_config)
    block, blocks = m3_selection(hf_config)
    return block * blocks


def _check_m3_heads(cfg: Any, label: str, model_config: Any) -> None:
    """One KV head per attention rank, counted as SGLang sizes M3's main pool
    (kv_cache_configurator.py ``_build_minimax_sparse_kv_pool``: ``get_num_kv_heads(attn_tp_size,
    attn_dcp_size)``), whose ``head_num`` the in-tree coordinator asserts is 1 and whose K/V the
    M3 backend reads as one head (minimax_sparse_backend.py ``_hisparse_swap_in_blocks``).

    NOTE: the widths come from SGLang's ``parallel_widths_of`` over the resolved arguments
    (attention TP = tp / attn_dp / attn_cp) rather than from ``enable_dp_attention`` and
    ``dp_size``: 0.5.23 resolves the deprecated ``--dp-size N --enable-dp-attention`` into
    ``attn_dp_size N, dp_size 1`` and clears the flag (parallel_hook.py
    ``handle_deprecated_dp_attention``), so the flag is False whenever attention DP runs.
    """
    from sglang.srt.runtime_context import parallel_widths_of

    widths = parallel_widths_of(cfg)
    attn_tp, dcp = int(widths["attn_tp_size"]), int(widths["attn_dcp_size"])
    heads = int(model_config.get_num_kv_heads(attn_tp, dcp))
    if heads == 1:
        return
    tp, dp, cp = int(cfg.tp_size), int(widths["attn_dp_size"]), int(cfg.attn_cp_size)
    split = "".join(f" / {flag} {n}" for flag, n in (("--attn-dp-size", dp), ("--attn-cp-size", cp)) if n > 1)
    need = attn_tp * heads  # the attention TP size that leaves one head per rank
    fix = f"Raise --tp-size to {need * dp * cp}"
    if dp > 1 and tp // (need * cp) >= 1:
        fix += f", or lower --attn-dp-size to {tp // (need * cp)}"
    raise ValueError(
        f"--enable-hisparse with MiniMax-M3 ({label}): {heads} KV heads per attention rank at "
        f"attention TP {attn_tp} (--tp-size {tp}{split}); HiSparse's M3 pool holds one KV head per "
        f"rank (as SGLang's own coordinator asserts at startup and its M3 backend at the first "
        f"decode). {fix}."
    )


def _refuse_paths(cfg: Any, model: str, *, pd: str | None, spec: str) -> None:
    """Refuse PD (``--disaggregation-mode``; ``pd`` None: served) and speculative decoding for
    a family that does not serve them, each with the family's reason."""
    for flag, attr, why in (("--disaggregation-mode", "disaggregation_mode", pd),
                            ("--speculative-algorithm", "speculative_algorithm", spec)):
        value = getattr(cfg, attr, None)
        if why is not None and value not in (None, "null", "NONE"):
            raise ValueError(f"--enable-hisparse with {model} and {flag} {value} is not supported by "
                             f"sglang-hisparse: {why}. Remove {flag}, or {IN_TREE_HINT}.")


def _pd_decode(cfg: Any) -> bool:
    return getattr(cfg, "disaggregation_mode", "null") == "decode"


def _require_mooncake(cfg: Any, model: str, why: str) -> None:
    """A PD decode server of ``model`` whose transfer needs SGLang's Mooncake backend (``fake``,
    SGLang's test stand-in, moves nothing and passes)."""
    backend = getattr(cfg, "disaggregation_transfer_backend", None)
    if backend not in ("mooncake", "mooncake_tcp", "fake"):
        raise ValueError(
            f"--enable-hisparse with {model} as a PD decode server and --disaggregation-transfer-backend "
            f"{backend}: {why} (NotImplementedError at the first request otherwise). Use "
            f"--disaggregation-transfer-backend mooncake (or mooncake_tcp).")


def _check_v4(cfg: Any, label: str, model_config: Any) -> int:
    """DeepSeek-V4 (docs/v4-m3.md D5, D7): co-located or PD decode, no speculative decoding and
    the radix cache off, as SGLang's in-tree HiSparse serves it; the C4 top-k is the model's
    ``index_topk`` (the KV dtype is checked with the others, ``arg_hook``)."""
    _refuse_paths(cfg, f"DeepSeek-V4 ({label})", pd=None,
                  spec="the verify kernel has no C4 row layout (and SGLang refuses it at coordinator construction)")
    if _pd_decode(cfg):
        _require_mooncake(cfg, f"DeepSeek-V4 ({label})", "the C4 indexer keys and C128 entries go device to "
                          "device, which SGLang 0.5.23 sends only over Mooncake (decode.py:1808)")
    if not getattr(cfg, "disable_radix_cache", False):
        raise ValueError(f"--enable-hisparse with DeepSeek-V4 ({label}) needs --disable-radix-cache: SGLang's "
                         f"V4 radix tree (its SWA component) is not wired to sglang-hisparse's C4 ids yet.")
    return int(hf_attr(model_config.hf_config, "index_topk"))


def _check_pool_kind(label: str, model_config: Any) -> None:
    """DSA models with sliding-window or linear-attention layers get SGLang's hybrid pools
    (``_build_hybrid_mla_swa_kv_pool`` / ``_build_hybrid_linear_kv_pool``) and allocators,
    never ``HiSparseDSATokenToKVPool`` (kv_cache_configurator.py ``_build_token_to_kv_pool``)."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    kind = None
    if getattr(model_config, "is_hybrid_swa", False):
        kind = "sliding-window (hybrid SWA)"
    elif mambaish_config(model_config) is not None:
        kind = "linear-attention (hybrid)"
    if kind is not None:
        raise ValueError(
            f"--enable-hisparse: model {label} has {kind} layers, for which SGLang builds its "
            f"hybrid KV pool and allocator instead of the HiSparse DSA pool. sglang-hisparse "
            f"serves {SUPPORTED} with full-attention DSA layers only. Drop --enable-hisparse, "
            f"or {IN_TREE_HINT}."
        )


def check_platform() -> None:
    """Refuse every non-CUDA accelerator: our kernels are CUDA, and SGLang's NPU/XPU/ROCm
    branches of ``kv_cache_configurator`` build other pools and allocators."""
    from sglang.srt.runtime_context import get_platform

    platform = get_platform()
    for fact, name in NON_CUDA:
        if getattr(platform, fact):
            raise ValueError(
                f"--enable-hisparse on {name}: sglang-hisparse's kernels are CUDA-only, and SGLang "
                f"takes {name}-specific pool and allocator paths that do not build ours. "
                f"sglang-hisparse serves {SUPPORTED}. On {name}, drop --enable-hisparse, or "
                f"{IN_TREE_HINT} where it supports {name}."
            )


def check_serving_paths(cfg: Any, view: Any, *, speculative: str | None) -> None:
    """Refuse the serving paths whose coordinator calls SGLang 0.5.23 does not make (or makes
    out of order). ``speculative``: the algorithm name, None when off."""
    pp = int(getattr(view, "pp_size", 1) or 1)
    if pp > 1 and speculative:
        # NOTE: refused rather than supported. Non-last stages would have to commit from the
        # accept indices the last stage relays (pp_outputs "spec_accept_index", consumed in
        # _pp_spec_commit_relayed_accept), which arrive a round late and for a possibly
        # recomposed micro-batch; that needs a hook on SGLang's PP relay, not just ours.
        raise ValueError(
            f"--enable-hisparse with --pp-size {pp} and --speculative-algorithm {speculative} is "
            f"not supported by sglang-hisparse: SGLang's non-last pipeline stages run "
            f"prepare_spec_verify every verify round (eagle_prepare_for_verify, "
            f"scheduler.py:4794) but never call commit_spec_accept_tokens (the relayed accept "
            f"goes to _pp_spec_commit_relayed_accept, scheduler_pp_mixin.py:1151), so their "
            f"verify windows are never closed and the second round fails. Use --pp-size 1 with "
            f"speculative decoding (scale with --tp-size), or drop --speculative-algorithm."
        )
    if speculative and getattr(view, "disable_overlap_schedule", False):
        # NOTE: found by the real-scheduler rig (docs/real-scheduler-rig.md). Only the overlap
        # loop resolves the relayed draft input (resolve_forward_inputs ->
        # FutureMap._resolve_spec_extras runs only with enable_overlap).
        raise ValueError(
            f"--enable-hisparse with --speculative-algorithm {speculative} needs SGLang's overlap "
            f"scheduler, which is off (--disable-overlap-schedule, or turned off by another "
            f"option): a request leaving HiSparse staging joins decode with a relayed draft "
            f"input (_build_hisparse_decode_batch -> FutureMap.make_staged_spec_input) that only "
            f"the overlap loop fills in, so without it the first verify round reads no bonus "
            f"tokens and the scheduler crashes. Remove --disable-overlap-schedule (and whatever "
            f"option turned it off), or drop --speculative-algorithm."
        )
    if getattr(cfg, "disaggregation_decode_enable_offload_kvcache", False):
        raise ValueError(
            "--enable-hisparse does not support --disaggregation-decode-enable-offload-kvcache: "
            "with it SGLang hands a finished request to DecodeKVCacheOffloadManager "
            "(batch_result_processor.py:1453-1456) and never calls request_finished, so the request's "
            "hot buffer and host rows stay held and the next request on its slot cannot be "
            "admitted. HiSparse already keeps every request's full KV in pinned host memory. "
            "Remove --disaggregation-decode-enable-offload-kvcache."
        )
    if getattr(cfg, "disaggregation_mode", "null") == "decode":
        backup = getattr(cfg, "disaggregation_decode_retraction_backup", None)
        if backup != "none":
            got = backup or "unset (SGLang then picks cpu_tensor for the DSA pool)"
            raise ValueError(
                f"--enable-hisparse on a PD decode server with "
                f"--disaggregation-decode-retraction-backup {got}: SGLang 0.5.23 calls "
                f"retract_req before backup_kv_cache (schedule_batch.py:2371-2381), so HiSparse's "
                f"host KV is released before any backup could read it, and a resumed request "
                f"re-enters the waiting queue without admit_request_direct (decode.py:3470), so "
                f"it could not decode. With 'none' SGLang aborts a retracted request with 503 "
                f"for the client to retry. Add --disaggregation-decode-retraction-backup none."
            )
