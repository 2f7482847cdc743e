"""The CPU allocator setting of setup_runtime: freed tensors' memory is reused, not faulted in again."""

import platform
import resource

import pytest
import torch

from enlace.runtime import keep_freed_memory


def _faults_of_a_fresh_buffer() -> int:
    """Minor page faults taken while allocating and filling a 64 MiB tensor (after one was freed)."""
    for _ in range(3):  # allocate, touch, free: the heap grows to its size once
        torch.ones(1 << 24).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(1 << 24).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")
def test_freed_tensor_memory_is_reused_without_page_faults():
    # 64 MiB is 16384 pages of 4 KiB: a buffer mapped afresh faults on most of them.
    assert keep_freed_memory()
    assert _faults_of_a_fresh_buffer() < 1000
