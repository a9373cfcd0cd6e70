"""Offline recorder on a tiny random-weight Llama: the oracle top-k equals the top-k of the
eager attention mass (summed over heads) of a full-sequence forward."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed (optional extra)"
)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    try:
        from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401
    except ImportError as e:
        pytest.skip(f"transformers {transformers.__version__} lacks the attention-interface API: {e}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_oracle_topk_matches_eager_attention(tmp_path):
    from sglang_hisparse.traces.format import TraceWriter, load_trace, make_header
    from sglang_hisparse.traces.hf_record import record_streams

    model = _tiny_llama()
    ids = torch.randint(0, 64, (26,)).tolist()
    path = str(tmp_path / "tiny.npz")
    with TraceWriter(path, make_header(top_k=5, sorted_by_score=True)) as w:
        record_streams(model, [ids], w, prefill=20, steps=6, top_k=5, layers=[0, 1], chunk=8)
    trace = load_trace(path)
    assert trace.num_rows == 12 and trace.layers == [0, 1]

    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for st in trace.streams():
        for t in range(len(st)):
            n = int(st.seq_lens[t])
            mass = att[st.layer][0, :, n - 1, :n].sum(0).numpy()
            want = np.argsort(-mass, kind="stable")[:5]
            got = st.selection(t)
            assert sorted(got.tolist()) == sorted(want.tolist())
            assert np.all(np.diff(mass[got]) <= 1e-6)  # recorded in descending mass


def test_next_best_ranks_are_the_following_masses(tmp_path):
    from sglang_hisparse.traces.format import TraceWriter, load_trace, make_header
    from sglang_hisparse.traces.hf_record import record_streams

    model = _tiny_llama()
    ids = torch.randint(0, 64, (24,)).tolist()
    with TraceWriter(str(tmp_path / "r.npz"), make_header(top_k=4, sorted_by_score=True, next_best=3)) as w:
        record_streams(model, [ids], w, prefill=20, steps=4, top_k=4, layers=[1], chunk=8, next_best=3)
    trace = load_trace(str(tmp_path / "r.npz"))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for st in trace.streams():
        for t in range(len(st)):
            n = int(st.seq_lens[t])
            mass = att[1][0, :, n - 1, :n].sum(0).numpy()
            want = np.argsort(-mass, kind="stable")[:7]
            assert sorted(st.next_best(t).tolist()) == sorted(want[4:].tolist())
            assert mass[st.next_best(t)].max() <= mass[st.selection(t)].min() + 1e-6


def test_bad_arguments(tmp_path):
    from sglang_hisparse.traces.format import TraceWriter, make_header
    from sglang_hisparse.traces.hf_record import record_streams, text_windows

    model = _tiny_llama()
    with TraceWriter(str(tmp_path / "x.npz"), make_header(top_k=2, sorted_by_score=True)) as w:
        with pytest.raises(ValueError, match="layers \\[7\\]"):
            record_streams(model, [list(range(30))], w, prefill=10, steps=2, top_k=2, layers=[7])
        with pytest.raises(ValueError, match="needs prefill\\+steps=40"):
            record_streams(model, [list(range(30))], w, prefill=30, steps=10, top_k=2)
    assert [len(x) for x in text_windows(list(range(100)), 3, 40)] == [40, 40, 40]
    with pytest.raises(ValueError, match="fewer than one window"):
        text_windows(list(range(10)), 1, 40)
