"""The runtime's memory and thread settings: freed memory reused, caches resident only where written, and OpenMP teams handed back."""

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


def _resident_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _resident_mib_of(tensors: list[torch.Tensor]) -> float:
    """Resident memory of the mappings that hold these tensors (from /proc/self/smaps), so that what the
    allocator keeps for other tensors does not count."""
    pointers = [t.data_ptr() for t in tensors]
    regions: dict[tuple[int, int], int] = {}
    span = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            span = (start, end) if any(start <= p < end for p in pointers) else None
        elif span is not None and head == "Rss:":
            regions[span] = int(line.split()[1])
    assert len(regions) >= 1
    return sum(regions.values()) / 1024


@pytest.mark.skipif(platform.system() != "Linux", reason="resident memory is read from /proc")
def test_a_kv_cache_takes_memory_only_where_it_is_written():
    # The server sizes its slot cache for the longest request; a slot that holds a short one (or none)
    # must not count its whole row in the process's memory, whatever the kernel's huge-page setting.
    from enlace.config.model import ModelConfig
    from enlace.model import KVCache

    cfg = ModelConfig(name="t", vocab_size=300, n_layer=4, n_head=4, n_kv_head=2, d_model=256, seq_len=64)
    cache = KVCache.empty(cfg, 4, 16384, torch.device("cpu"), torch.float32)  # 256 MiB of keys and values
    tensors = cache.k + cache.v
    assert _resident_mib_of(tensors) < 1
    for t in cache.row(1).k + cache.row(1).v:
        t[:, :, :128] = 1.0  # one slot's first 128 positions: 16 runs of 32 KiB
    assert _resident_mib_of(tensors) < 4
    assert all(torch.count_nonzero(t) == 2 * 128 * 64 for t in tensors)  # zeros elsewhere, as torch.zeros


@pytest.mark.skipif(platform.system() != "Linux", reason="libgomp's teams, found through /proc")
def test_the_openmp_team_is_handed_back_and_started_again():
    from enlace.runtime import release_openmp_team

    x = torch.randn(4096, 512)
    before = (x @ x.T).sum()  # a parallel region: this thread has a team
    assert release_openmp_team()
    assert torch.equal((x @ x.T).sum(), before)  # a new team serves the next region, same result
