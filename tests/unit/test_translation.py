"""ForwardTranslation: a forward's KV-write locations translated once, never reused stale."""

import torch

from sglang_hisparse.memory.translation import ForwardTranslation, translate_locations


def _mapping() -> torch.Tensor:
    m = torch.zeros(11, dtype=torch.int64)  # logical ids 0..9 + trailing sentinel
    m[[3, 4, 7]] = torch.tensor([30, 40, 70])
    m[-1] = -1
    return m


def test_translation_passes_padding_through():
    m = _mapping()
    assert translate_locations(m, torch.tensor([3, -1, 5, 7], dtype=torch.int32)).tolist() == [30, -1, 0, 70]


def test_one_translation_serves_the_later_layers_of_a_forward():
    m, loc, tr = _mapping(), torch.tensor([3, 4]), ForwardTranslation()
    outs = [tr(m, loc, layer) for layer in range(61)]
    assert tr.computed == 1 and tr.reused == 60
    assert all(o is outs[0] for o in outs) and outs[0].tolist() == [30, 40]


def test_a_new_forward_with_the_same_tensor_recomputes():
    """SGLang's graph runner runs one ForwardBatch for warm-up and again under capture: the
    second run's first layer is not after the first run's last, so it translates again."""
    m, loc, tr = _mapping(), torch.tensor([3, 4]), ForwardTranslation()
    first = [tr(m, loc, layer) for layer in range(4)]
    second = [tr(m, loc, layer) for layer in range(4)]
    assert tr.computed == 2 and second[0] is not first[0]
    tr(m, loc, 2)  # a repeated layer id (two accesses in one layer) recomputes too
    assert tr.computed == 3


def test_writes_to_the_mapping_or_the_locations_invalidate():
    m, loc, tr = _mapping(), torch.tensor([3, 4]), ForwardTranslation()
    assert tr(m, loc, 0).tolist() == [30, 40]
    m[4] = 44  # e.g. a rebind between two accesses
    assert tr(m, loc, 1).tolist() == [30, 44]
    loc[1] = 7
    assert tr(m, loc, 2).tolist() == [30, 70] and tr.computed == 3
    other = torch.tensor([3, 4])  # equal values, another tensor: its own entry
    assert tr(m, other, 3).tolist() == [30, 44] and tr.computed == 4


def test_inference_tensors_rely_on_the_layer_rule():
    m = _mapping()
    tr = ForwardTranslation()
    with torch.inference_mode():
        loc = torch.tensor([7, 3])
        assert [tr(m, loc, layer).tolist() for layer in range(3)] == [[70, 30]] * 3
        assert tr.computed == 1
        loc[0] = 4  # no version counter: the next forward (layer 0 again) sees the new value
        assert tr(m, loc, 0).tolist() == [40, 30]


def test_interleaved_micro_batches_keep_their_own_entries():
    m, tr = _mapping(), ForwardTranslation()
    a, b = torch.tensor([3]), torch.tensor([4])
    for layer in range(5):
        assert tr(m, a, layer).tolist() == [30] and tr(m, b, layer).tolist() == [40]
    assert tr.computed == 2 and tr.reused == 8
