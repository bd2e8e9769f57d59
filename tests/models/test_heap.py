"""Process memory helpers: huge-page buffers."""

from __future__ import annotations

import pytest
import torch

from quickdraft.models.heap import HUGE_PAGE_BYTES, huge_page_buffer, transparent_huge_pages


@pytest.mark.parametrize("nbytes", [0, 1, 4096, HUGE_PAGE_BYTES, HUGE_PAGE_BYTES + 3])
def test_huge_page_buffer_is_aligned_and_writable(nbytes):
    buffer = huge_page_buffer(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (nbytes,)
    if nbytes:
        assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
        values = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        buffer.copy_(values)
        assert torch.equal(buffer, values)


def test_huge_page_buffer_outlives_its_names():
    view = huge_page_buffer(3 * HUGE_PAGE_BYTES)[HUGE_PAGE_BYTES:]  # the mapping lives in the tensor
    view.fill_(7)
    assert int(view.sum()) == 7 * 2 * HUGE_PAGE_BYTES


def test_huge_page_buffer_refuses_a_negative_size():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        huge_page_buffer(-1)


def test_transparent_huge_pages_reads_the_kernel_mode(tmp_path, monkeypatch):
    from quickdraft.models import heap

    mode = tmp_path / "enabled"
    for text, expected in (
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
    ):
        mode.write_text(text)
        monkeypatch.setattr(heap, "THP_ENABLED_FILE", mode)
        assert transparent_huge_pages() is expected
    monkeypatch.setattr(heap, "THP_ENABLED_FILE", tmp_path / "missing")
    assert transparent_huge_pages() is False
