"""``HiSparseConfig``: the ``--hisparse-config`` JSON, validated once, frozen afterwards.

Accepted keys are the four that existing SGLang launch commands use, with the same meaning::

    {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2, "swap_in_block_size": 512}

and one of ours: ``"policy"``, the hot buffer's replacement policy (``"slru"``, the default,
``"lru"`` or ``"fra"``; ``sglang_hisparse.kernel_policy``).

Our rules are stricter than SGLang's own parser (``sparsity/factory.py``
``_parse_sparse_config``), which also takes ``algorithm``, ``backend``,
``min_sparse_prompt_len``, ``page_size`` and passes any other key through, and takes any
``swap_in_block_size`` in [1, 1024]. We read none of those keys (a silently ignored key hides a
typo), and our resolve kernel needs whole warps; the errors say the rule is ours and how to run
SGLang's parser instead. Every rejection is a ``ValueError`` naming the key, the value, the rule
and the fix. The four named keys configure SGLang's ``mem_cache/sparsity`` framework (e.g.
``"algorithm": "quest"`` for dense attention), which SGLang 0.5.23 builds on no server path, so
its in-tree HiSparse ignores them too (:data:`SPARSITY_FRAMEWORK_KEYS`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from sglang_hisparse import SUPPORTED_SGLANG
from sglang_hisparse.kernel_limits import (
    SM90_MAX_SMEM_PER_BLOCK,
    largest_buffer,
    resolve_smem_bytes,
    slots_needed,
    verify_smem_bytes,
)
from sglang_hisparse.kernel_policy import DEFAULT_POLICY, POLICIES, SERVING_POLICY, VERIFY_POLICIES

FLAG = "--hisparse-config"
#: how to run SGLang's own HiSparse (its parser, coordinator and pools) instead of ours
IN_TREE_HINT = "set SGLANG_PLUGINS to a list without 'hisparse' to run SGLang's in-tree HiSparse"
#: keys SGLang's parser takes for its sparsity framework (``sparsity/factory.py``); in 0.5.23 only
#: ``create_sparse_coordinator`` reads them, and nothing calls it (tests/unit/test_in_tree_scope.py)
SPARSITY_FRAMEWORK_KEYS = ("algorithm", "backend", "min_sparse_prompt_len", "page_size")

#: LRU order is stored as int16 slot ids (``lru [L, R, B]``), so B slots need ids 0..B-1 < 2**15.
MAX_DEVICE_BUFFER_SIZE = 2**15 - 1
#: CUDA's per-block thread limit; the resolve kernel launches ``swap_in_block_size`` threads.
MAX_BLOCK_SIZE = 1024
WARP = 32

DEFAULT_TOP_K = 2048
DEFAULT_HOST_TO_DEVICE_RATIO = 2
#: None = auto: the resolve op picks 1024 threads when the batch fits one CTA per SM, else 512
#: (``kernels.ops.auto_block_size``; measured in benchmarks/RESOLVE.md).
DEFAULT_SWAP_IN_BLOCK_SIZE = None
#: requests stay fully resident while HBM has room (coordinator/residency.py)
DEFAULT_RESIDENCY = "pressure"
RESIDENCY_MODES = ("pressure", "always_hot")
DEFAULT_RESIDENCY_WATERMARK = 0.05


@dataclass(frozen=True)
class HiSparseConfig:
    """Effective HiSparse settings for one server.

    top_k:                positions the indexer selects per layer per step (the model's ``index_topk``)
    device_buffer_size:   B, hot slots per request per layer on the GPU (B >= top_k; default 2*top_k;
                          with speculative decoding B >= W*top_k, default max(2, W+1)*top_k)
    host_to_device_ratio: logical KV capacity (what the scheduler admits against) / device KV rows
    swap_in_block_size:   CUDA threads per block of the resolve kernel (multiple of 32, <= 1024);
                          None (the default): chosen per batch by the resolve op
    policy:               replacement policy of the hot buffers: "slru" (default), "lru" or
                          "fra" (frequency, recency and token age; one int32 per slot and layer
                          more; not with speculative decoding)
    residency:            "pressure" (default): a request keeps all its device rows until HBM is
                          short, then the longest shrink to hot buffers; "always_hot": every request
                          in its hot buffer once it decodes (docs/coordinator.md, "Residency")
    residency_watermark:  share of device rows kept free under "pressure" (0 <= w < 0.5): a step
                          that finds fewer free shrinks resident requests first
    """

    top_k: int = DEFAULT_TOP_K
    device_buffer_size: int = 2 * DEFAULT_TOP_K
    host_to_device_ratio: int = DEFAULT_HOST_TO_DEVICE_RATIO
    swap_in_block_size: int | None = DEFAULT_SWAP_IN_BLOCK_SIZE
    policy: str = SERVING_POLICY
    residency: str = DEFAULT_RESIDENCY
    residency_watermark: float = DEFAULT_RESIDENCY_WATERMARK

    def watermark_rows(self, device_rows: int) -> int:
        """Free device rows kept in reserve under ``"pressure"`` (0 for ``"always_hot"``)."""
        return int(self.residency_watermark * device_rows) if self.residency == "pressure" else 0

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)

    @classmethod
    def from_json(
        cls, text: str | None, *, model_top_k: int | None = None, num_draft_tokens: int = 0
    ) -> HiSparseConfig:
        """Parse and validate ``--hisparse-config``.

        ``model_top_k`` is the model's ``index_topk`` when known; it is the top-k used, and a
        JSON ``top_k`` that disagrees with it is rejected (the buffer would be sized for the
        wrong k). ``num_draft_tokens`` W (speculative decoding; 0 = off) is the number of
        verify rows per request: their union must fit, so ``device_buffer_size >= W * top_k``,
        and the default becomes ``max(2, W + 1) * top_k``.
        Every rejection, of the text or of the two arguments, is a ``ValueError``.
        """
        raw = _parse_json(text)
        return cls.from_dict(raw, model_top_k=model_top_k, num_draft_tokens=num_draft_tokens)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], *, model_top_k: int | None = None, num_draft_tokens: int | None = 0
    ) -> HiSparseConfig:
        """Validate a parsed ``--hisparse-config`` (see :meth:`from_json`; ``None`` W = 0)."""
        if not isinstance(raw, dict):
            raise ValueError(
                f"{FLAG}: expected a JSON object, got {type(raw).__name__}. "
                f"Example: {FLAG} '{{\"device_buffer_size\": 4096}}'."
            )
        model_top_k = _check_model_top_k(model_top_k)
        W = _check_num_draft_tokens(num_draft_tokens)
        unknown = sorted((k for k in raw if k not in cls.keys()), key=repr)
        if unknown:
            raise ValueError(
                f"{FLAG}: unknown key(s) {', '.join(repr(k) for k in unknown)}. "
                f"Valid keys: {', '.join(cls.keys())}. This is sglang-hisparse's rule: it reads "
                f"no other key, and an ignored key would hide a typo (SGLang's in-tree parser "
                f"accepts 'algorithm', 'backend', 'min_sparse_prompt_len', 'page_size' and passes "
                f"any other key through). Remove or rename them, or {IN_TREE_HINT}."
                + _framework_note(unknown)
            )
        residency, watermark = _check_residency(raw)
        for key, value in raw.items():
            if key == "policy":
                continue  # a string, checked below
            if key in ("residency", "residency_watermark"):
                continue
            if not (key == "swap_in_block_size" and value is None):  # null = auto, as omitted
                _require_int(key, value)
        policy = _check_policy(raw.get("policy", SERVING_POLICY), W)

        top_k = raw.get("top_k")
        if model_top_k is not None:
            if top_k is not None and top_k != model_top_k:
                raise ValueError(
                    f"{FLAG}: 'top_k' = {top_k} disagrees with the model's index_topk = "
                    f"{model_top_k}. HiSparse resolves exactly what the indexer selects; "
                    f"remove 'top_k' or set it to {model_top_k}."
                )
            top_k = model_top_k
        if top_k is None:
            top_k = DEFAULT_TOP_K
        if top_k < 1:
            raise ValueError(f"{FLAG}: 'top_k' = {top_k} must be >= 1; use the model's index_topk (e.g. 2048).")

        if W * top_k > MAX_DEVICE_BUFFER_SIZE:
            raise ValueError(
                f"speculative_num_draft_tokens * top_k = {W} * {top_k} = {W * top_k} exceeds "
                f"{MAX_DEVICE_BUFFER_SIZE}, the largest {FLAG} 'device_buffer_size' (int16 slot "
                f"ids), but a verify step's union of selections must fit the hot buffer. Use "
                f"--speculative-num-draft-tokens {MAX_DEVICE_BUFFER_SIZE // top_k} or fewer."
            )
        default = min(max(2, W + 1) * top_k, MAX_DEVICE_BUFFER_SIZE) if W else 2 * top_k
        buffer = raw.get("device_buffer_size", default)
        check_buffer_holds_selection(buffer, top_k, W)
        if buffer > MAX_DEVICE_BUFFER_SIZE:
            raise ValueError(
                f"{FLAG}: 'device_buffer_size' = {buffer} exceeds {MAX_DEVICE_BUFFER_SIZE}: the "
                f"kernels store slot ids as int16. Use at most {MAX_DEVICE_BUFFER_SIZE} "
                f"(2-4x top_k is typical)."
            )

        _check_kernel_fits(top_k, buffer, W, policy)

        ratio = raw.get("host_to_device_ratio", DEFAULT_HOST_TO_DEVICE_RATIO)
        if ratio < 1:
            raise ValueError(
                f"{FLAG}: 'host_to_device_ratio' = {ratio} must be >= 1: it is the logical KV "
                f"capacity (host) divided by the device KV rows. Use 1 (no oversubscription) or more."
            )

        block = raw.get("swap_in_block_size", DEFAULT_SWAP_IN_BLOCK_SIZE)
        if block is not None and (block < WARP or block % WARP or block > MAX_BLOCK_SIZE):
            fixed = min(max(WARP, (block // WARP) * WARP), MAX_BLOCK_SIZE)
            raise ValueError(
                f"{FLAG}: 'swap_in_block_size' = {block} must be a positive multiple of {WARP} "
                f"no larger than {MAX_BLOCK_SIZE} (it is the CUDA block size of the resolve "
                f"kernel). This is sglang-hisparse's rule: the resolve kernel's block-wide scans "
                f"work in whole warps of {WARP} threads (SGLang's in-tree parser accepts "
                f"1..{MAX_BLOCK_SIZE} for its own kernel; {IN_TREE_HINT}). Try {fixed}."
            )
        return cls(top_k=top_k, device_buffer_size=buffer, host_to_device_ratio=ratio,
                   swap_in_block_size=block, policy=policy, residency=residency,
                   residency_watermark=watermark)

    def to_dict(self) -> dict[str, int | float | str | None]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _framework_note(unknown: list[Any]) -> str:
    """For unknown keys of SGLang's sparsity framework: that the in-tree HiSparse ignores them
    too, so the in-tree hint would not make them mean anything; empty for any other key."""
    named = [k for k in SPARSITY_FRAMEWORK_KEYS if k in unknown]
    if not named:
        return ""
    what, them = ("is a key", "it") if len(named) == 1 else ("are keys", "them")
    return (f" {', '.join(repr(k) for k in named)} {what} of SGLang's mem_cache/sparsity framework "
            f"(e.g. \"algorithm\": \"quest\" for dense attention), which SGLang {SUPPORTED_SGLANG} "
            f"builds on no server path (create_sparse_coordinator has no caller): its in-tree HiSparse "
            f"ignores {them} too and runs its DSA / DeepSeek-V4 / MiniMax-M3 HiSparse. Remove {them}.")


def check_buffer_holds_selection(buffer: int, top_k: int, num_draft_tokens: int = 0) -> None:
    """The hot-buffer rule, wherever a buffer size B meets a top-k (this config, the coordinator,
    the verify window): every position one step selects needs a hot slot in that step, so
    B >= top_k, and a verify step resolves its W rows' selections at once, so B >= W * top_k
    (``kernel_limits.slots_needed``, the rule's one copy). Raises ValueError naming the flag
    and the fix."""
    W = int(num_draft_tokens or 0)
    if buffer >= slots_needed(top_k, W):
        return
    if W:
        raise ValueError(
            f"{FLAG}: 'device_buffer_size' = {buffer} must be >= speculative_num_draft_tokens "
            f"* top_k = {W} * {top_k} = {W * top_k}: a verify step resolves the union of its "
            f"{W} rows' selections at once. Set it to at least {W * top_k} "
            f"({max(2, W + 1) * top_k}, i.e. (W+1)*top_k, is the default), or lower "
            f"--speculative-num-draft-tokens."
        )
    raise ValueError(
        f"{FLAG}: 'device_buffer_size' = {buffer} must be >= top_k = {top_k}: every "
        f"selected position needs a hot slot in the same step. Set it to at least "
        f"{top_k} ({2 * top_k}, i.e. 2*top_k, is the usual choice)."
    )


def _check_policy(value: Any, num_draft_tokens: int) -> str:
    """The ``policy`` key: one of ``kernel_policy.POLICIES``; with speculative decoding one of
    ``VERIFY_POLICIES`` (the verify kernel has no fra)."""
    if not isinstance(value, str) or value not in POLICIES:
        raise ValueError(
            f"{FLAG}: 'policy' = {_shown(value)} is not a replacement policy; use one of "
            f"{', '.join(repr(p) for p in POLICIES)} (a JSON string; default {SERVING_POLICY!r}), "
            f"e.g. {FLAG} '{{\"policy\": \"lru\"}}'."
        )
    if value not in VERIFY_POLICIES and num_draft_tokens:
        raise ValueError(
            f"{FLAG}: 'policy' = {value!r} with speculative decoding (speculative_num_draft_tokens "
            f"= {num_draft_tokens}): the verify-step kernel implements "
            f"{' and '.join(repr(p) for p in VERIFY_POLICIES)} only. Remove 'policy' (the default "
            f"{SERVING_POLICY!r}) or set one of those, or turn speculative decoding off."
        )
    return value


def _check_kernel_fits(top_k: int, buffer: int, rows: int, policy: str = DEFAULT_POLICY) -> None:
    """Reject a (top_k, B, W) whose resolve kernel needs more shared memory than sm_90 has.

    NOTE: checked here, at startup, rather than left to the kernel's own launch check, which
    would fire on the first decode step of a server that already loaded its weights.
    """
    limit = SM90_MAX_SMEM_PER_BLOCK
    need = resolve_smem_bytes(top_k, buffer, policy=policy)
    if need > limit:
        most = largest_buffer(lambda b: resolve_smem_bytes(top_k, b, policy=policy))
        raise ValueError(
            f"{FLAG}: 'device_buffer_size' = {buffer} with top_k = {top_k} needs {need} B of "
            f"shared memory per CTA in the resolve kernel, above the {limit} B an H100/H200 "
            f"allows. Use 'device_buffer_size' <= {most}."
        )
    if rows:
        need = verify_smem_bytes(top_k, buffer, rows)
        if need > limit:
            most = largest_buffer(lambda b: verify_smem_bytes(top_k, b, rows))
            if most >= rows * top_k:
                fix = f"use 'device_buffer_size' between {rows * top_k} and {most}"
            else:
                w_max = max((w for w in range(1, rows) if verify_smem_bytes(top_k, w * top_k, w) <= limit), default=0)
                fix = f"use --speculative-num-draft-tokens {w_max} or fewer at top_k {top_k}"
            raise ValueError(
                f"{FLAG}: speculative_num_draft_tokens = {rows} with top_k = {top_k} and "
                f"'device_buffer_size' = {buffer} needs {need} B of shared memory per CTA in the "
                f"verify kernel (a hash over the {rows * top_k}-position union), above the {limit} B "
                f"an H100/H200 allows: {fix}."
            )


_JSON_WORDS = {"True": "true", "False": "false", "None": "null"}


#: the json module's message prefixes, in the order they are tried, and what to tell the user
_JSON_MESSAGE_HINTS = (
    ("Expecting property name", "quote keys with double quotes"),
    ("Expecting ',' delimiter", "a comma is missing between two entries (or a string or bracket is not closed)"),
    ("Expecting ':' delimiter", "put a ':' between each key and its value"),
    ("Extra data", "give one JSON object; remove what follows its closing '}'"),
    ("Unterminated string", "close the string with a double quote"),
    ("Expecting value", "a value is missing here (empty input, a stray comma, or an unquoted word)"),
)


def json_error_hint(e: json.JSONDecodeError) -> str:
    """The fix for a JSON syntax error, from the character where the parser stopped.

    ``json`` reports a trailing comma as "Expecting property name enclosed in double quotes"
    (or "Expecting value" in a list); the hint names the comma, not the quoting.
    """
    doc, pos = e.doc, e.pos
    here = doc[pos : pos + 1]
    before = doc[:pos].rstrip()[-1:]
    if before == "," and here in ("}", "]"):
        return f"remove the trailing comma before '{here}' (JSON allows none)"
    if here == "'":
        return "use double quotes: JSON strings and keys take \", not '"
    word = doc[pos:].split(None, 1)[0].strip(",}]") if doc[pos:].strip() else ""
    if word in ("True", "False", "None"):
        return f"JSON spells {word} as {_JSON_WORDS[word]}"
    for prefix, hint in _JSON_MESSAGE_HINTS:
        if e.msg.startswith(prefix):
            return hint
    return "check the JSON syntax at that position"


def _parse_json(text: str | None) -> dict[str, Any]:
    if text is None or not text.strip():
        return {}
    if not isinstance(text, str):
        raise ValueError(f"{FLAG}: expected JSON text, got {type(text).__name__}; pass the config as a string.")
    try:
        raw = json.loads(text)
    except RecursionError:
        raise ValueError(
            f"{FLAG}: the JSON is nested too deeply to parse; give one flat object, e.g. "
            f"{FLAG} '{{\"device_buffer_size\": 4096}}'."
        ) from None
    except json.JSONDecodeError as e:
        lo = max(0, e.pos - 20)
        snippet = text[lo : e.pos + 20]
        caret = " " * (e.pos - lo) + "^"
        raise ValueError(
            f"{FLAG}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos}):\n"
            f"    {snippet}\n    {caret}\n"
            f"Fix: {json_error_hint(e)}, e.g. {FLAG} '{{\"device_buffer_size\": 4096}}'."
        ) from None
    except ValueError:  # json's only other refusal: an integer of more than 4300 digits
        raise ValueError(
            f"{FLAG}: a number has more digits than Python converts (4300); give sizes as "
            f"ordinary integers, e.g. {FLAG} '{{\"device_buffer_size\": 4096}}'."
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{FLAG}: expected a JSON object, got {type(raw).__name__} ({text.strip()[:40]!r}). "
            f"Example: {FLAG} '{{\"device_buffer_size\": 4096}}'."
        )
    return raw


def _is_int(value: Any) -> bool:
    # NOTE: bool is an int subclass in Python; `true` for a size is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """``value`` as the user wrote it: JSON where it is JSON, else a short repr."""
    if _is_int(value) and abs(value) > 10**18:  # str() refuses ints past 4300 digits
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except RecursionError:  # a deeply nested container
            text = f"<nested {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


#: every integer is below this: sizes are int32 on the device, and larger products would not be
MAX_INT = 2**31


def _require_int(key: str, value: Any) -> None:
    if not _is_int(value):
        hint = f" Use {int(value)}." if isinstance(value, float) and value.is_integer() else ""
        raise ValueError(f"{FLAG}: {key!r} = {_shown(value)} must be an integer.{hint}")
    if abs(value) >= MAX_INT:
        raise ValueError(f"{FLAG}: {key!r} = {_shown(value)} is out of range: every value must be below "
                         f"2**31 (sizes are int32 on the device); e.g. 'device_buffer_size': 4096.")


def _check_residency(raw: dict[str, Any]) -> tuple[str, float]:
    """The residency keys: a mode name and a share of device rows."""
    mode = raw.get("residency", DEFAULT_RESIDENCY)
    if mode not in RESIDENCY_MODES:
        raise ValueError(
            f"{FLAG}: 'residency' = {_shown(mode)} must be one of {', '.join(map(repr, RESIDENCY_MODES))}: "
            f"'pressure' keeps requests fully on the GPU until HBM is short (no host IO while there "
            f"is room), 'always_hot' cuts every request to its hot buffer (the in-tree behaviour, "
            f"for A/B). e.g. {FLAG} '{{\"residency\": \"pressure\"}}'."
        )
    w = raw.get("residency_watermark", DEFAULT_RESIDENCY_WATERMARK)
    if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < 0.5:
        raise ValueError(
            f"{FLAG}: 'residency_watermark' = {_shown(w)} must be a number in [0, 0.5): the share of "
            f"device KV rows kept free before resident requests shrink to hot buffers. "
            f"e.g. {FLAG} '{{\"residency_watermark\": {DEFAULT_RESIDENCY_WATERMARK}}}'."
        )
    if "residency_watermark" in raw and mode != "pressure":
        raise ValueError(
            f"{FLAG}: 'residency_watermark' applies only to 'residency': 'pressure' (got "
            f"'residency': {mode!r}); remove it or use 'pressure'."
        )
    return mode, float(w)


def _check_model_top_k(value: Any) -> int | None:
    """The model's ``index_topk`` as the argument hook passes it: None (unknown) or an int >= 1."""
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value < MAX_INT:
        raise ValueError(
            f"the model's index_topk = {_shown(value)} must be a positive integer (HiSparse sizes the hot "
            f"buffer from it); fix index_topk in the model's config.json."
        )
    return value


def _check_num_draft_tokens(value: Any) -> int:
    """W, the verify rows per request: an int >= 0 (None, SGLang's "not speculative", is 0)."""
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value < MAX_INT:
        raise ValueError(
            f"--speculative-num-draft-tokens {_shown(value)} must be an integer in [0, 2**31) (0 = no speculative "
            f"decoding); pass a whole number of draft tokens, e.g. --speculative-num-draft-tokens 4."
        )
    return value
