"""The engine's KV pool on CUDA (`hf_paged.engine.pool_sizing`): `gpu_memory_utilization` of the whole device, as in
vLLM, and a clear `ValueError` when less than that is free (another process on the GPU) instead of a CUDA
out-of-memory error while building the engine or in its first large step."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hf_paged
from hf_paged.engine import pool_sizing
from hf_paged.engine.pool_sizing import pool_blocks, profile_pool_blocks
from hf_paged.testing import tiny_model

GIB = 2**30


def test_the_pool_gets_the_fraction_less_the_peak():
    # 80 GiB device, 0.9 of it: 72 GiB less a 6 GiB peak (4 of it activations), plenty free
    blocks = pool_blocks(1 << 20, 0.9, total=80 * GIB, peak=6 * GIB, allocated=2 * GIB, free=77 * GIB)
    assert blocks == (int(80 * GIB * 0.9) - 6 * GIB) // (1 << 20)


def test_pool_and_activations_that_just_fit_what_is_free():
    budget = int(80 * GIB * 0.9) - 6 * GIB
    free = budget + 4 * GIB  # the pool and the activations, to the byte
    assert pool_blocks(4096, 0.9, total=80 * GIB, peak=6 * GIB, allocated=2 * GIB, free=free) == budget // 4096
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9 gives the KV cache"):
        pool_blocks(4096, 0.9, total=80 * GIB, peak=6 * GIB, allocated=2 * GIB, free=free - 1)


def test_memory_held_elsewhere_is_a_value_error_naming_what_to_change():
    # another process holds 40 GiB: 0.9 of the device cannot be had
    with pytest.raises(ValueError) as error:
        pool_blocks(1 << 20, 0.9, total=80 * GIB, peak=6 * GIB, allocated=2 * GIB, free=38 * GIB)
    message = str(error.value)
    for part in ("gpu_memory_utilization=0.9", "66.00 GiB", "38.00 GiB are free", "4.00 GiB of activations",
                 "take 40.00 GiB", "kv_cache_memory"):
        assert part in message
    # a smaller fraction fits beside it
    assert pool_blocks(1 << 20, 0.4, total=80 * GIB, peak=6 * GIB, allocated=2 * GIB, free=38 * GIB) == 26 * 1024


def test_a_fraction_that_leaves_nothing_for_the_cache():
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        pool_blocks(1 << 20, 0.1, total=80 * GIB, peak=9 * GIB, allocated=2 * GIB, free=70 * GIB)


@pytest.mark.parametrize("bad,error", [(0.0, ValueError), (1.5, ValueError), (-0.2, ValueError), (True, TypeError),
                                       ("0.9", TypeError), (None, TypeError)])
def test_fractions_outside_zero_to_one_are_refused(bad, error):
    with pytest.raises(error, match="gpu_memory_utilization"):
        pool_blocks(4096, bad, total=80 * GIB, peak=GIB, allocated=GIB, free=79 * GIB)


def test_numpy_fractions_are_numbers():
    expected = (int(80 * GIB * 0.5) - GIB) // 4096
    assert pool_blocks(4096, np.float32(0.5), total=80 * GIB, peak=GIB, allocated=GIB, free=79 * GIB) == expected


def test_profiling_feeds_the_measured_figures_to_the_check(monkeypatch):
    """`profile_pool_blocks` runs one forward at the full token budget and hands torch's peak, what torch holds
    after it and what the device has free to `pool_blocks` (CUDA queries stubbed: this runs on the CPU)."""
    seen = {}

    def forward(input_ids, use_cache, logits_to_keep):
        seen["shape"], seen["use_cache"], seen["keep"] = tuple(input_ids.shape), use_cache, logits_to_keep

    class Properties:
        total_memory = 80 * GIB

    calls = []
    monkeypatch.setattr(pool_sizing.recording, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(pool_sizing.recording, "device_synchronize", lambda device: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    free = {"bytes": 77 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80 * GIB))
    blocks = profile_pool_blocks(forward, torch.device("cpu"), 512, 1 << 20, 0.9)
    assert blocks == (int(80 * GIB * 0.9) - 6 * GIB) // (1 << 20)
    assert seen == {"shape": (1, 512), "use_cache": False, "keep": 256}
    assert calls == ["empty", "reset", "sync", "empty"]  # the peak is measured from a clean slate
    free["bytes"] = 30 * GIB
    with pytest.raises(ValueError, match="30.00 GiB are free"):
        profile_pool_blocks(forward, torch.device("cpu"), 512, 1 << 20, 0.9)


_HOLDER = textwrap.dedent("""
    import sys, time, torch
    held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_another_process_on_the_gpu_is_seen_on_cuda():
    """With half the device held by another process, 0.9 of it is a ValueError before any pool is allocated; 0.3 of it
    fits beside that process and serves."""
    total = torch.cuda.get_device_properties(0).total_memory
    # earlier tests' freed blocks stay reserved by this process's caching allocator: give them back first, or the
    # holder below cannot take half the device
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(0)
    if free < 0.55 * total:
        pytest.skip(f"only {free / GIB:.1f} of {total / GIB:.1f} GiB free: something else holds the GPU")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(total // 2)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":  # it exited: say why
            holder.wait(timeout=60)
            pytest.fail(f"the process meant to hold half the GPU failed: {holder.stderr.read()}")
        model = tiny_model("llama").cuda()
        hf_paged.enable(model)
        with pytest.raises(ValueError, match="are free for it"):
            hf_paged.Engine(model, max_num_batched_tokens=256, gpu_memory_utilization=0.9)
        engine = hf_paged.Engine(model, max_num_batched_tokens=256, gpu_memory_utilization=0.3)
        try:
            out = engine.generate([[5, 6, 7, 8]], max_new_tokens=4, ignore_eos=True)
            assert len(out[0].outputs[0].token_ids) == 4
            pool = engine.cache.num_blocks * engine.cache.bytes_per_block(model.dtype)
            assert pool <= 0.3 * total
        finally:
            engine.close()
    finally:
        holder.kill()
        holder.wait()


class _Probe:
    """`PagedCache`'s own sizing, as `engine_pool_blocks` uses it."""

    def _auto_num_blocks(self, device, dtype):
        return 700


class _Ranks:
    """A tensor-parallel group of this rank and one other, whose count (0: its sizing failed) is `other`."""

    def __init__(self, other):
        self.other, self.offered = other, []

    def agree_min(self, value, device):
        self.offered.append(value)
        return min(value, self.other)


def _size(tp, device="cuda", num_blocks=None, kv_bytes=None):
    return pool_sizing.engine_pool_blocks(None, _Probe(), tp, torch.device(device), torch.float16, 1 << 20,
                                          num_blocks, kv_bytes, 256, 0.9)


def test_an_engine_on_cuda_profiles_its_pool(monkeypatch):
    monkeypatch.setattr(pool_sizing, "profile_pool_blocks", lambda *args: 123)
    assert _size(None) == 123
    assert _size(None, num_blocks=50) == 50  # given: no profiling
    assert _size(None, kv_bytes=GIB) is None  # PagedCache sizes it from the bytes
    assert _size(None, device="cpu") is None  # PagedCache's CPU default


def test_ranks_agree_on_the_smallest_pool(monkeypatch):
    monkeypatch.setattr(pool_sizing, "profile_pool_blocks", lambda *args: 123)
    ranks = _Ranks(other=100)
    assert _size(ranks) == 100 and ranks.offered == [123]
    ranks = _Ranks(other=1000)
    assert _size(ranks, device="cpu") == 700 and ranks.offered == [700]  # PagedCache's own sizing, agreed
    ranks = _Ranks(other=1000)
    assert _size(ranks, device="cpu", kv_bytes=8 << 20) == 8 and ranks.offered == [8]


def test_a_rank_that_cannot_fit_its_pool_still_meets_the_others(monkeypatch):
    """A rank whose sizing fails offers zero blocks to the agreement before it raises (the others are not left waiting
    in the collective), and a rank whose own sizing worked raises too when another's did not."""
    def refuse(*args):
        raise ValueError("gpu_memory_utilization=0.9 gives the KV cache 66.00 GiB ...")

    monkeypatch.setattr(pool_sizing, "profile_pool_blocks", refuse)
    ranks = _Ranks(other=100)
    with pytest.raises(ValueError, match="gives the KV cache"):
        _size(ranks)
    assert ranks.offered == [0]
    with pytest.raises(ValueError, match="gives the KV cache"):
        _size(None)  # no ranks: raised at once
    monkeypatch.setattr(pool_sizing, "profile_pool_blocks", lambda *args: 123)
    ranks = _Ranks(other=0)
    with pytest.raises(ValueError, match="another tensor-parallel rank cannot fit its KV pool"):
        _size(ranks)
    assert ranks.offered == [123]
