"""Zero-copy adoption of torch CUDA KV caches (`jaxkv.integrations._torch`, DLPack) on a real
GPU: the adopted arrays are the torch memory, reads and `store_blocks` are exact both ways,
JAX's reads follow torch's queued writes, and memory XLA cannot run on is refused by name.

Needs torch with CUDA and a JAX that sees the same GPU (not vLLM); skipped otherwise.
`scripts/test.sh` runs it in its GPU process (JAX_PLATFORMS=cuda,cpu).
"""

from __future__ import annotations

import numpy as np
import pytest
from support import platforms

torch = pytest.importorskip("torch")
if not platforms.gpus() or not torch.cuda.is_available():
    pytest.skip("needs a GPU that both torch and JAX see", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from jaxkv.integrations._torch import adopt_torch_kv_caches  # noqa: E402

L, H, D, BS, NB = 2, 4, 64, 16, 8


def _layers(raw):
    """vLLM's LBNHC layout: per layer ``[B, N, H, 2D]`` memory, handed over as ``[B, H, N, 2D]``
    views."""
    return {f"model.layers.{i}.attn": raw[i].permute(0, 2, 1, 3) for i in range(raw.shape[0])}


def _adopt(caches):
    return adopt_torch_kv_caches(caches, num_kv_heads=H, head_size=D, block_size=BS)


def _bits(tensor):
    return tensor.detach().cpu().view(torch.int16).numpy()


def test_adopted_arrays_are_the_torch_memory_and_exact_both_ways():
    generator = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randn(L, NB, BS, H, 2 * D, generator=generator, device="cuda",
                      dtype=torch.bfloat16)
    cache, names = _adopt(_layers(raw))
    assert len(names) == L
    assert [a.unsafe_buffer_pointer() for a in cache.arrays] == [raw[i].data_ptr()
                                                                 for i in range(L)]
    # jaxkv reads torch's bytes ...
    gathered = cache.gather_blocks([5, 2])
    for layer, array in enumerate(gathered):
        want = _bits(raw[layer][[5, 2]])  # [2, N, H, 2D]; the adopted layout is THD
        np.testing.assert_array_equal(np.asarray(array).view(np.int16).reshape(want.shape), want)
    # ... and torch sees what jaxkv stores, in the listed blocks only
    before = _bits(raw)
    blocks = jnp.full((2, BS, H, 2 * D), 2.5, jnp.bfloat16)
    cache.store_blocks(1, np.array([6, 3]), blocks)
    cache.wait_for_torch()
    torch.cuda.synchronize()
    after = _bits(raw)
    assert (raw[1][[3, 6]] == 2.5).all().item()
    untouched = np.ones(NB, bool)
    untouched[[3, 6]] = False
    np.testing.assert_array_equal(after[1][untouched], before[1][untouched])
    np.testing.assert_array_equal(after[0], before[0])


def test_jax_reads_follow_torch_writes_queued_on_its_stream():
    """JAX reads an adopted cache after the writes queued on torch's current stream
    (`wait_for_torch`): a block written at the end of a long queue of torch kernels is read
    by the post-processing with its new bytes."""
    from jaxkv.transfer._plan import PostProcess
    from jaxkv.transfer._post import apply_post_processing

    raw = torch.zeros(1, NB, BS, H, 2 * D, dtype=torch.float16, device="cuda")
    cache, _ = _adopt(_layers(raw))
    for _ in range(200):  # keep torch's stream busy, so that the write is still queued
        raw.mul_(1)
    raw[0, 5].fill_(1.5)
    step = PostProcess(kind="permute", region=0, array_index=0, block_ids=np.array([5]),
                       ratio=1, src_layout="HTD", dst_layout="THD",
                       block_shape=(BS, H, 2 * D), itemsize=2)
    apply_post_processing(cache, [step])
    torch.cuda.synchronize()
    assert (raw[0, 5] == 1.5).all().item()  # a permute of a constant block: the same bytes


def test_memory_not_16_byte_aligned_is_refused_by_name():
    flat = torch.zeros(NB * BS * H * 2 * D + 8, dtype=torch.float16, device="cuda")
    shifted = flat[1:1 + NB * BS * H * 2 * D].view(1, NB, BS, H, 2 * D)  # 2 bytes in
    with pytest.raises(ValueError, match=r"model.layers.0.attn.*multiple of 16 bytes"):
        _adopt(_layers(shifted))
