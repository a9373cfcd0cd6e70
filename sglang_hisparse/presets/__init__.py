"""Model attention shapes for the planner: byte formulas, index sharing, and the shipped presets.

The JSON files next to this module describe GLM-5.1, GLM-5.2, DeepSeek-V3.2 and
DeepSeek-V4-Flash with their sources; each states its byte counts, and loading checks them against the formulas here (so
the documented numbers cannot drift from the arithmetic). Pure Python: no torch, no sglang.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

FP8_SCALE_BLOCK = 128  # one fp32 scale per 128 fp8 values (KV latent and index key alike)
KV_DTYPES = ("bf16", "fp8")
#: DeepSeek-V4's compressed entries (SGLang 0.5.23's FlashMLA pages, ``kernels/row_layout.py``):
#: a page of 64 entries is 37,440 B on the device (585 B an entry, padding included); our host
#: pool stores each C4 entry flat in 592 B (data, scales, 8 zero bytes: whole 16-byte pieces)
V4_PAGE_ENTRIES = 64
V4_PAGE_BYTES = 37440
V4_ENTRY_DEVICE_BYTES = V4_PAGE_BYTES // V4_PAGE_ENTRIES
V4_HOST_ROW_BYTES = 592
_PRESET_PACKAGE = "sglang_hisparse.presets"


def kv_row_bytes(kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: str) -> int:
    """Bytes of one token's KV row in one layer (``I`` in docs/architecture.md)."""
    if kv_dtype == "bf16":
        return 2 * (kv_lora_rank + qk_rope_head_dim)
    if kv_dtype == "fp8":
        if kv_lora_rank % FP8_SCALE_BLOCK:
            raise ValueError(
                f"kv_lora_rank = {kv_lora_rank} is not a multiple of {FP8_SCALE_BLOCK}: the fp8 DSA "
                f"row stores one fp32 scale per {FP8_SCALE_BLOCK} latent values. Use --kv-dtype bf16."
            )
        return kv_lora_rank + kv_lora_rank // FP8_SCALE_BLOCK * 4 + 2 * qk_rope_head_dim
    raise ValueError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")


def index_row_bytes(index_head_dim: int) -> int:
    """Bytes of one token's index-K entry in one layer: fp8 key plus fp32 scale(s)."""
    return index_head_dim + math.ceil(index_head_dim / FP8_SCALE_BLOCK) * 4


def _is_int(value: Any) -> bool:
    # NOTE: bool is an int subclass; `true` for a layer count or a period is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sharing_keys(config: Mapping[str, Any], where: str) -> None:
    """The index-sharing keys' JSON types (SGLang 0.5.23's): each wrong one names itself."""
    kinds = config.get("indexer_types")
    if kinds is not None and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
        raise ValueError(f"{where}: indexer_types = {_short(kinds)} must be a list of strings "
                         f"(\"shared\" marks a layer that reuses an anchor's selection), e.g. [\"full\", \"shared\"].")
    pattern = config.get("index_topk_pattern")
    if pattern is not None and not (isinstance(pattern, str) or (
            isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))):
        raise ValueError(f"{where}: index_topk_pattern = {_short(pattern)} must be a string (or list of "
                         f"strings) with one letter per layer, \"S\" for shared, e.g. \"FSSF\".")
    for key, least in (("cli_factor", 0), ("index_topk_freq", 0), ("index_skip_topk_offset", None)):
        value = config.get(key)
        if value is None:
            continue
        if not _is_int(value) or (least is not None and value < least):
            rule = "an integer" if least is None else f"an integer >= {max(least, 1)} (or 0 / null: every layer)"
            raise ValueError(f"{where}: {key} = {_short(value)} must be {rule}.")


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def anchor_layers(config: Mapping[str, Any], layers: int, *, where: str = "--model-config") -> tuple[int, ...]:
    """Layers that run their own indexer, read from HF ``config.json`` keys.

    Precedence (as SGLang 0.5.23 reads them): ``indexer_types`` (``"shared"`` marks a shared
    layer) > ``cli_factor`` (fresh every k-th layer) > ``index_topk_pattern`` (``"S"`` =
    shared) > ``index_topk_freq`` with optional ``index_skip_topk_offset``. A key of the wrong
    JSON type is a ``ValueError`` naming it (``where`` is the flag the config came from).
    """
    _check_sharing_keys(config, where)
    kinds = config.get("indexer_types")
    if kinds is not None:
        return tuple(i for i in range(layers) if i >= len(kinds) or kinds[i] != "shared")
    factor = config.get("cli_factor") or 1
    if factor > 1:
        return tuple(i for i in range(layers) if i % factor == 0)
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return tuple(i for i in range(layers) if i >= len(pattern) or pattern[i] != "S")
    freq = config.get("index_topk_freq") or 1
    offset = config.get("index_skip_topk_offset")
    # Without an explicit offset layer 0 and 1 both run the indexer, then every freq-th layer.
    shift = 1 if offset is None else offset - 1
    return tuple(i for i in range(layers) if max(i - shift, 0) % freq == 0)


@dataclass(frozen=True)
class ModelSpec:
    """The attention shape the planner needs; ``anchors`` are the layers with their own indexer.

    ``family`` "dsa" (DeepSeek-V3.2, GLM-5.x: every layer's MLA row through HiSparse) or
    "minimax-m3": ``layers`` are then M3's sparse layers (their K and V of one ``head_dim`` head
    per rank through HiSparse, :func:`m3_row_bytes`), ``index_topk`` the positions a step selects
    (top-k blocks plus the forced ones, x block size), ``index_head_dim`` the index cache's width
    (per token and sparse layer on the device in both modes: a key, and a value on the
    ``index_value_layers`` that keep one; in the KV dtype, as SGLang stores it on sm_90), and
    ``dense_layers`` keep their whole K/V on the device in both modes. For M3 the index cache is
    counted in :meth:`device_bytes_per_token` (its layers differ in size), ``index_bytes`` is 0.

    "deepseek-v4": ``layers`` are the C4 layers (their compressed entries, one per
    ``compress_ratio`` tokens, through HiSparse; ``index_topk`` entries a step), each with its own
    indexer (index keys per entry, ``index_bytes``, on the device); the ``c128_layers``' entries
    (one per 128 tokens) and every layer's sliding window of ``window`` tokens
    (``window_layers``) stay on the device in both modes (:meth:`device_bytes`). fp8 only."""

    name: str
    layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_topk: int
    anchors: tuple[int, ...]
    weights_gib: float | None = None
    family: str = "dsa"
    head_dim: int = 0
    dense_layers: int = 0
    index_value_layers: int = 0
    compress_ratio: int = 1
    c128_layers: int = 0
    window: int = 0
    window_layers: int = 0

    def kv_bytes(self, kv_dtype: str) -> int:
        """Device bytes of one HiSparse row (a token's, or a V4 C4 entry's page share)."""
        if self.family == "minimax-m3":
            return m3_row_bytes(self.head_dim, kv_dtype)
        if self.family == "deepseek-v4":
            _v4_dtype(kv_dtype)
            return V4_ENTRY_DEVICE_BYTES
        return kv_row_bytes(self.kv_lora_rank, self.qk_rope_head_dim, kv_dtype)

    @property
    def default_kv_dtype(self) -> str:
        """The planner's ``--kv-dtype`` when none is given: fp8 for V4 (its only one), else bf16."""
        return "fp8" if self.family == "deepseek-v4" else "bf16"

    def host_row_bytes(self, kv_dtype: str) -> int:
        """Host bytes of one row (what a miss moves over the link): the device row, except V4's
        flat 592-byte C4 rows."""
        return V4_HOST_ROW_BYTES if self.family == "deepseek-v4" else self.kv_bytes(kv_dtype)

    def entries(self, n: int) -> int:
        """HiSparse rows of a request of ``n`` tokens per layer: ``n``, or V4's completed C4 groups."""
        return n // self.compress_ratio

    def device_bytes(self, n: int, kv_dtype: str) -> int:
        """Bytes per request of ``n`` tokens that stay on the device in both modes outside the
        index keys: M3's :meth:`device_bytes_per_token` x n; V4's C128 entries and windows."""
        if self.family == "deepseek-v4":
            return V4_ENTRY_DEVICE_BYTES * (self.c128_layers * (n // 128) + self.window_layers * min(n, self.window))
        return self.device_bytes_per_token(kv_dtype) * n

    @property
    def index_bytes(self) -> int:
        if self.family == "minimax-m3":  # counted in device_bytes_per_token
            return 0
        return index_row_bytes(self.index_head_dim)

    def device_bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes per token that stay on the device in both modes outside the DSA index cache:
        M3's dense layers' K and V, and its index keys (every sparse layer) and values (the
        ``index_value_layers``); 0 for DSA."""
        if self.family != "minimax-m3":
            return 0
        itemsize = 2 if kv_dtype == "bf16" else 1
        index = self.index_head_dim * itemsize * (self.layers + self.index_value_layers)
        return self.dense_layers * self.kv_bytes(kv_dtype) + index


def _v4_dtype(kv_dtype: str) -> None:
    if kv_dtype != "fp8":
        raise ValueError(f"--kv-dtype {kv_dtype}: DeepSeek-V4's C4 pool stores fp8_e4m3 entries only "
                         f"(SGLang's V4 pool asserts it). Use --kv-dtype fp8.")


def _v4_from_config(config: Mapping[str, Any], *, name: str, weights_gib: float | None) -> ModelSpec:
    """A DeepSeek-V4 ``config.json`` (``compress_ratios``: 0 window only, 4 C4, 128 C128 per
    layer; ``sliding_window``; the C4 indexer's ``index_topk`` and ``index_head_dim``)."""
    where = f"--model-config {name}"
    layers = config.get("num_hidden_layers")
    if not _is_int(layers) or not 1 <= layers <= _LARGEST["num_hidden_layers"]:
        raise ValueError(f"{where}: num_hidden_layers = {_short(layers)} must be an integer in [1, 4096].")
    ratios = config["compress_ratios"]
    if not isinstance(ratios, list) or len(ratios) < layers or not all(r in (0, 4, 128) for r in ratios[:layers]):
        raise ValueError(f"{where}: compress_ratios = {_short(ratios)} must list 0, 4 or 128 for each of the "
                         f"{layers} layers (0 = sliding window only, 4 = C4, 128 = C128).")
    ratios = ratios[:layers]  # entries past num_hidden_layers are MTP layers (not served by HiSparse)
    ints = {}
    for key in ("index_topk", "index_head_dim", "sliding_window"):
        value = config.get(key)
        if not _is_int(value) or not 1 <= value <= _LARGEST.get(key, 2**20):
            raise ValueError(f"{where}: {key} = {_short(value)} must be a positive integer.")
        ints[key] = value
    c4 = sum(1 for r in ratios if r == 4)
    if c4 == 0:
        raise ValueError(f"{where}: compress_ratios has no C4 layer (ratio 4); HiSparse has nothing to serve.")
    return ModelSpec(
        name=name, layers=c4, kv_lora_rank=0, qk_rope_head_dim=0, index_head_dim=ints["index_head_dim"],
        index_topk=ints["index_topk"], anchors=tuple(range(c4)), weights_gib=weights_gib, family="deepseek-v4",
        compress_ratio=4, c128_layers=sum(1 for r in ratios if r == 128), window=ints["sliding_window"],
        window_layers=layers)


def m3_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one token's K then V in one MiniMax-M3 sparse layer, one KV head per rank (the
    row ``sglang_adapter.memory_m3.HiSparseMHAPool`` stores)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")
    return 2 * head_dim * (2 if kv_dtype == "bf16" else 1)


def _m3_from_config(config: Mapping[str, Any], *, name: str, weights_gib: float | None) -> ModelSpec:
    """A MiniMax-M3 ``config.json`` (``sparse_attention_config``): its sparse layers, head_dim
    and the positions a decode step selects, as ``arg_scope.m3_selection`` counts them."""
    sc = config["sparse_attention_config"]
    where = f"--model-config {name}: sparse_attention_config"
    freq = sc.get("sparse_attention_freq") if isinstance(sc, Mapping) else None
    if not isinstance(freq, list) or not freq or not all(_is_int(f) for f in freq):
        raise ValueError(f"{where}.sparse_attention_freq must be a list of integers, one per layer (0 = dense).")
    ints = {}
    for key in ("sparse_block_size", "sparse_topk_blocks", "sparse_index_dim"):
        value = sc.get(key)
        if not _is_int(value) or not 1 <= value <= 2**16:
            raise ValueError(f"{where}.{key} = {_short(value)} must be an integer in [1, 65536].")
        ints[key] = value
    head_dim = config.get("head_dim")
    if not _is_int(head_dim) or not 1 <= head_dim <= 2**16:
        raise ValueError(f"--model-config {name}: head_dim = {_short(head_dim)} must be an integer in [1, 65536].")
    block = ints["sparse_block_size"]
    init = sc["sparse_init_block"] if _is_int(sc.get("sparse_init_block")) else -(-int(sc.get("sparse_init_tokens", 0)) // block)
    local = (sc["sparse_local_block"] if _is_int(sc.get("sparse_local_block"))
             else -(-int(sc.get("sparse_local_tokens", 0)) // block) + 1)
    sparse = sum(1 for f in freq if f != 0)
    no_value = sc.get("sparse_disable_index_value") or []
    if not isinstance(no_value, list) or not all(_is_int(f) for f in no_value):
        raise ValueError(f"{where}.sparse_disable_index_value must be a list of integers, one per layer.")
    values = sum(1 for i, f in enumerate(freq) if f != 0 and not (i < len(no_value) and no_value[i]))
    if sparse == 0:
        raise ValueError(f"{where}.sparse_attention_freq has no sparse layer; HiSparse has nothing to serve.")
    return ModelSpec(
        name=name, layers=sparse, kv_lora_rank=0, qk_rope_head_dim=0, index_head_dim=ints["sparse_index_dim"],
        index_topk=(ints["sparse_topk_blocks"] + max(init, 0) + max(local, 0)) * block,
        anchors=tuple(range(sparse)), weights_gib=weights_gib, family="minimax-m3", head_dim=head_dim,
        dense_layers=len(freq) - sparse, index_value_layers=values,
    )


_REQUIRED = ("num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "index_topk")
#: largest value of each shape key: far past any model, small enough that every byte count the
#: planner forms stays exact and every loop over layers short
_LARGEST = {"num_hidden_layers": 4096, "kv_lora_rank": 2**16, "qk_rope_head_dim": 2**16,
            "index_head_dim": 2**16, "index_topk": 2**20}


def model_from_config(config: Mapping[str, Any], *, name: str, weights_gib: float | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from an HF ``config.json`` dict (``text_config`` is looked into).

    Every key of the wrong JSON type or out of range is a ``ValueError`` naming it."""
    if not isinstance(config, Mapping):
        raise ValueError(f"--model-config {name}: expected a JSON object (a model's config.json), "
                         f"got {type(config).__name__}")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    if config.get("sparse_attention_config") is not None:  # MiniMax-M3
        return _m3_from_config(config, name=name, weights_gib=weights_gib)
    if config.get("compress_ratios") is not None:  # DeepSeek-V4
        return _v4_from_config(config, name=name, weights_gib=weights_gib)
    missing = [key for key in _REQUIRED if config.get(key) is None]
    if missing:
        raise ValueError(
            f"--model-config {name}: missing {', '.join(missing)}. HiSparse needs a DSA model "
            f"(DeepSeek-V3.2, GLM-5.x): its config.json has all of {', '.join(_REQUIRED)}; or a "
            f"MiniMax-M3 config (with sparse_attention_config) or a DeepSeek-V4 one (with compress_ratios). "
            f"Check the file, or use --model with one of: {', '.join(preset_names())}."
        )
    for key in _REQUIRED:
        value = config[key]
        if not _is_int(value) or not 1 <= value <= _LARGEST[key]:
            raise ValueError(f"--model-config {name}: {key} = {_short(value)} must be an integer in "
                             f"[1, {_LARGEST[key]}]; check the file (a DSA model's config.json).")
    layers = config["num_hidden_layers"]
    return ModelSpec(
        name=name,
        layers=layers,
        kv_lora_rank=config["kv_lora_rank"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        index_head_dim=config["index_head_dim"],
        index_topk=config["index_topk"],
        anchors=anchor_layers(config, layers, where=f"--model-config {name}"),
        weights_gib=weights_gib,
    )


def _preset_files() -> dict[str, Any]:
    root = resources.files(_PRESET_PACKAGE)
    return {p.name[: -len(".json")]: p for p in root.iterdir() if p.name.endswith(".json")}


def preset_names() -> list[str]:
    """Display names of the shipped presets (``GLM-5.1``, ...)."""
    return sorted(load_preset_raw(key)["name"] for key in _preset_files())


def load_preset_raw(name: str) -> dict[str, Any]:
    """The preset JSON (case-insensitive name), checked against the formulas above."""
    files = _preset_files()
    key = name.strip().lower()
    if key not in files:
        valid = sorted(json.loads(p.read_text())["name"] for p in files.values())
        raise ValueError(f"--model {name!r} is not a preset. Valid presets: {', '.join(valid)}; "
                         f"or pass --model-config path/to/config.json.")
    raw = json.loads(files[key].read_text())
    model = model_from_config(
        {**raw, "num_hidden_layers": raw["layers"]}, name=raw["name"], weights_gib=raw.get("weights_gib")
    )
    # The stated byte counts document the preset; they must agree with the formulas.
    stated = {f"kv_bytes_per_token_per_layer.{d}": (b, model.kv_bytes(d))
              for d, b in raw["kv_bytes_per_token_per_layer"].items()}
    if "host_row_bytes" in raw:
        stated["host_row_bytes"] = (raw["host_row_bytes"], model.host_row_bytes("fp8"))
    stated["index_bytes_per_token_per_layer"] = (raw["index_bytes_per_token_per_layer"], model.index_bytes)
    stated["anchor_layer_count"] = (raw["anchor_layer_count"], len(model.anchors))
    for field, (given, derived) in stated.items():
        if given != derived:
            raise RuntimeError(f"preset {files[key].name}: {field} = {given} but the shape gives {derived}; "
                               f"fix the preset file.")
    return raw


def load_preset(name: str) -> ModelSpec:
    raw = load_preset_raw(name)
    return model_from_config({**raw, "num_hidden_layers": raw["layers"]}, name=raw["name"],
                             weights_gib=raw.get("weights_gib"))
