"""The scan's head (core.forward.run_for_stats) multiplies its position chunks as matrices, and as few chunks as keep
the logits within a budget. A chunk sliced from the whole sequence keeps the sequence's batch stride; a head read a
slice at a time (engine.wide) once ran such a [1, n, d] input through torch.matmul as a batch (bmm), copying each
[d, rows] slice on every call: on a 1.2B model, with 8 chunks a sample, a third of the scan's time."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import halfsafe.core.forward as forward
import halfsafe.engine.wide as wide
from halfsafe.core.forward import head_chunk, run_for_stats
from halfsafe.engine.streamed import streamed_of
from halfsafe.io.loading import load_model
from tests.tiny import make_tiny, save_tiny, tiny_ids

aten = torch.ops.aten


class Products(TorchDispatchMode):
    """Every matrix product run: its op and the shapes of its operands."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[tuple]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
            self.seen.append((func.__name__, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def _weight_batches(seen: Products, width: int) -> list:
    """Products whose operand is a weight expanded to a batch ([1, width, n]): what an unfolded matmul runs."""
    return [(op, shapes) for op, shapes in seen.seen if any(len(s) == 3 and s[:2] == (1, width) for s in shapes)]


def test_the_heads_chunks_are_matrix_products_not_batches(monkeypatch):
    monkeypatch.setattr(forward, "HEAD_CHUNK_BYTES", 1)  # chunks of HEAD_CHUNK positions
    model = make_tiny("llama")
    vocab, width = model.get_output_embeddings().weight.shape
    with torch.no_grad(), Products() as seen:
        run_for_stats(model, tiny_ids(model, 3 * forward.HEAD_CHUNK + 5))
    head = [shapes for op, shapes in seen.seen if (width, vocab) in shapes]
    assert len(head) == 4 and all(len(s[0]) == 2 for s in head), seen.seen  # 4 chunks, each one [n, width] product
    assert not _weight_batches(seen, width)


def test_a_wide_head_multiplies_a_sliced_input_as_a_matrix(tmp_path, monkeypatch):
    monkeypatch.setattr(wide, "MIN_CHUNK_ROWS", 32)
    monkeypatch.setattr(wide, "CHUNK_BYTES", 1)
    monkeypatch.setattr(forward, "HEAD_CHUNK_BYTES", 1)
    save_tiny("llama", tmp_path / "m")
    model = load_model(str(tmp_path / "m"), stream=True, device="cpu").model
    streamed_of(model).wide_bytes = 0
    vocab, width = model.config.vocab_size, model.config.hidden_size
    with torch.no_grad(), Products() as seen:
        run_for_stats(model, tiny_ids(model, 2 * forward.HEAD_CHUNK + 3))
    assert seen.seen and not _weight_batches(seen, width)
    chunk = torch.randn(1, 3 * forward.HEAD_CHUNK, width)[:, forward.HEAD_CHUNK:2 * forward.HEAD_CHUNK]
    streamed = streamed_of(model)
    weight = streamed.tensor("lm_head.weight" if "lm_head.weight" in streamed.key_of else "model.embed_tokens.weight")
    assert isinstance(weight, wide.WideWeight)
    with torch.no_grad(), Products() as seen:
        out = torch.nn.functional.linear(chunk, weight)
        whole = torch.nn.functional.linear(chunk.clone(memory_format=torch.contiguous_format), weight.whole())
    assert out.shape == (1, forward.HEAD_CHUNK, vocab)
    assert not _weight_batches(seen, width)
    torch.testing.assert_close(out, whole, rtol=0, atol=0)


def test_positions_per_head_call_keep_the_logits_within_a_budget():
    assert head_chunk(262144) == forward.HEAD_CHUNK  # Gemma 3: 64 positions, 64 MiB
    assert head_chunk(32000) == (64 << 20) // (4 * 32000)  # 524 positions: a 512-token sample in one call
    assert head_chunk(0) == forward.HEAD_CHUNK  # a head that does not say its width: the old chunk
