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


@pytest.mark.skipif(platform.system() != "Linux", reason="resident memory is read from /proc")
def test_a_kv_cache_takes_memory_only_where_it_is_written():
    # The server sizes its slot cache for the longest request; a slot that holds a short one (or none)
    # must not count its whole row in the process's memory.
    from enlace.config.model import ModelConfig
    from enlace.model import KVCache

    cfg = ModelConfig(name="t", vocab_size=300, n_layer=4, n_head=4, n_kv_head=2, d_model=256, seq_len=64)
    before = _resident_mib()
    cache = KVCache.empty(cfg, 4, 16384, torch.device("cpu"), torch.float32)  # 256 MiB of keys and values
    assert _resident_mib() - before < 16
    assert all(t.abs().sum() == 0 for t in cache.k + cache.v)  # zeros, as torch.zeros would be
    row = cache.row(1)
    for t in row.k + row.v:
        t[:, :, :128] = 1.0  # one slot's first 128 positions
    assert _resident_mib() - before < 16
    assert sum(t.sum().item() for t in cache.k) == 4 * 2 * 128 * 64


@pytest.mark.skipif(platform.system() != "Linux", reason="libgomp's teams, found through /proc")
def test_the_openmp_team_is_handed_back_and_started_again():
    from enlace.runtime import release_openmp_team

    x = torch.randn(4096, 512)
    before = (x @ x.T).sum()  # a parallel region: this thread has a team
    assert release_openmp_team()
    assert torch.equal((x @ x.T).sum(), before)  # a new team serves the next region, same result
