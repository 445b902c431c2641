"""`hf_paged.cache.host_ints`: a step's int lists as tensors through `array` buffers, equal to `torch.tensor`'s."""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged.cache.host_ints import int_table, int_tensor


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int_tensor_equals_torch_tensor(dtype: torch.dtype) -> None:
    rng = random.Random(0)
    big = 2**31 - 1 if dtype == torch.int32 else 2**63 - 1
    for n in (0, 1, 7, 16384):
        values = [rng.randint(-big - 1, big) for _ in range(n)]
        out = int_tensor(values, dtype)
        assert out.dtype == dtype and out.shape == (n,) and not out.is_pinned()
        assert torch.equal(out, torch.tensor(values, dtype=dtype))
    assert torch.equal(int_tensor(range(3, 9)), torch.arange(3, 9, dtype=torch.int32))


def test_int_tensor_keeps_its_buffer_and_rejects_what_does_not_fit() -> None:
    out = int_tensor([5, 6, 7])
    churn = [int_tensor(list(range(1000))) for _ in range(50)]  # would reuse the memory were the buffer freed
    assert out.tolist() == [5, 6, 7] and len(churn) == 50
    with pytest.raises(OverflowError):
        int_tensor([2**31])
    with pytest.raises(OverflowError):
        int_tensor([2**63], torch.int64)
    with pytest.raises(TypeError):
        int_tensor([1.5])


def test_int_table_pads_rows_with_zeros() -> None:
    rows = [[3, 1, 4], [], [1, 5, 9, 2, 6]]
    out = int_table(rows, 6)
    assert out.shape == (3, 6) and out.dtype == torch.int32
    assert out.tolist() == [[3, 1, 4, 0, 0, 0], [0] * 6, [1, 5, 9, 2, 6, 0]]
    assert int_table([], 4).shape == (0, 4)
    assert int_table([[7, 8]], 2, torch.int64).tolist() == [[7, 8]]
    with pytest.raises(ValueError, match="width 2"):
        int_table([[1, 2, 3]], 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_int_tensor_pinned_uploads_the_same_values() -> None:
    values = list(range(-5, 20000))
    host = int_tensor(values, torch.int64, pin=True)
    assert host.is_pinned()
    assert host.to("cuda", non_blocking=True).cpu().tolist() == values
    table = int_table([[1, 2], [3]], 3, pin=True)
    assert table.is_pinned() and table.cuda().tolist() == [[1, 2, 0], [3, 0, 0]]
