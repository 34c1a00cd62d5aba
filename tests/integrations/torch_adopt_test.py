"""Zero-copy adoption of GPU vLLM's torch KV caches (`jaxkv.integrations._torch`, DLPack),
on CPU torch tensors made by vLLM 0.33's own allocator: layouts, dtypes, bad inputs, and where
writes land."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import importlib.util  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
    pytest.skip(
        "vLLM/torch are not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

import torch  # noqa: E402
import torch_harness as th  # noqa: E402

from jaxkv import BufferMovedError  # noqa: E402
from jaxkv.integrations._torch import adopt_torch_kv_caches  # noqa: E402

L, H, D, BS, NB = 3, 4, 8, 16, 8

# vLLM 0.33's KVCacheLayout -> (jaxkv block layout with K and V of a head as one vector,
# the same with a K axis, arrays): per-layer arrays when the layer axis is outermost, one
# array with an L axis when the blocks are (cross-layer layouts).
EXPECTED = {
    "LBNHC": ("THD", "THKD", L),
    "LBHNC": ("HTD", "HTKD", L),
    "BLNHC": ("LTHD", "LTHKD", 1),
    "BLHNC": ("LHTD", "LHTKD", 1),
    "BHLNC": ("HLTD", "HLTKD", 1),
}


def adopt(caches, **kwargs):
    params = dict(num_kv_heads=H, head_size=D, block_size=BS)
    params.update(kwargs)
    return adopt_torch_kv_caches(caches, **params)


def logical_g(caches, names, split=False):
    """``[L, B, H, N, K, D]`` uints of the torch caches, read through torch's own views (K
    of size 1 and D of K then V unless `split`)."""
    out = np.stack([th.as_numpy(caches[n]) for n in names])
    if not split:
        return out[:, :, :, :, None, :]
    return out.reshape(*out.shape[:4], 2, -1)


def cache_as_g(cache):
    """The same ``[L, B, H, N, K, D]`` from the adopted JAX arrays and the spec's layout."""
    spec = cache.spec
    width = f"u{spec.itemsize}"
    target = "LBHTKD"
    out = np.zeros((spec.num_layers, cache.num_blocks, spec.num_kv_heads, spec.block_size,
                    spec.kv_factor, spec.head_dim), width)
    for (layer, kv), array in zip(spec.array_keys(), cache.arrays):
        a = np.asarray(array).view(width)
        letters = "B" + spec.layout
        for c in target:
            if c not in letters:  # an axis the array does not span: size 1
                a, letters = a[..., None], letters + c
        a = a.transpose([letters.index(c) for c in target])
        ls = slice(None) if layer is None else slice(layer, layer + 1)
        ks = slice(None) if kv is None else slice(kv, kv + 1)
        out[ls, :, :, :, ks, :] = a
    return out


@pytest.mark.parametrize("fuse_kv", [True, False])
@pytest.mark.parametrize("layout_name", sorted(EXPECTED))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "fp8"])
def test_vllm_layouts_and_dtypes(layout_name, dtype, fuse_kv):
    spec = th.attention_spec(H, D, BS, dtype)
    caches = th.vllm_caches(layout_name, spec, L, NB)
    th.fill_random(caches, seed=1)
    names = th.layer_names(L)
    element = "float8_e4m3fn" if dtype == "fp8" else None
    cache, adopted = adopt(caches, dtype=element, fuse_kv=fuse_kv)
    fused_layout, split_layout, num_arrays = EXPECTED[layout_name]
    assert adopted == tuple(names)
    assert cache.spec.layout == (fused_layout if fuse_kv else split_layout)
    assert len(cache.arrays) == num_arrays
    assert cache.spec.kv_factor == (1 if fuse_kv else 2)
    assert cache.spec.head_dim == (2 * D if fuse_kv else D)
    assert cache.spec.dtype.name == (element or dtype)
    # zero-copy: every array is the torch memory
    if num_arrays == L:
        want = [caches[n].data_ptr() for n in names]
    else:
        want = [min(caches[n].data_ptr() for n in names)]
    assert [a.unsafe_buffer_pointer() for a in cache.arrays] == want
    # and it holds the values where the layout says (bit for bit)
    np.testing.assert_array_equal(cache_as_g(cache), logical_g(caches, names, not fuse_kv))


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BHLNC"])
def test_vllm_mla(layout_name):
    spec = th.attention_spec(1, 32, BS, "bfloat16", mla=True)
    caches = th.vllm_caches(layout_name, spec, L, NB)
    th.fill_random(caches, seed=2)
    cache, _ = adopt(caches, num_kv_heads=1, head_size=32, mla=True)
    layer_outer = layout_name.startswith("L")
    assert cache.spec.mla and cache.spec.layout == ("TD" if layer_outer else "LTD")
    np.testing.assert_array_equal(cache_as_g(cache), logical_g(caches, th.layer_names(L)))


def test_lhbnc_is_refused_by_name():
    caches = th.vllm_caches("LHBNC", th.attention_spec(H, D, BS, "bfloat16"), L, NB)
    with pytest.raises(ValueError, match=r"layers.0.*\['H'\] are stored outside the blocks"):
        adopt(caches)


def _raw(shape, order, dtype=torch.bfloat16):
    """A tensor of logical `shape` stored in the axis `order` (a permuted view)."""
    stored = torch.zeros([shape[a] for a in order], dtype=dtype)
    inverse = [order.index(a) for a in range(len(shape))]
    return stored.permute(inverse)


@pytest.mark.parametrize(
    "letters,shape,order,layout,num_arrays",
    [
        # FlashAttention (2, num_blocks, block_size, heads, head_size): K/V before the blocks
        # -> separate K and V arrays; NHD and HND stride orders
        ("KBTHD", (2, NB, BS, H, D), (0, 1, 2, 3, 4), "THD", 2 * L),
        ("KBTHD", (2, NB, BS, H, D), (0, 1, 3, 2, 4), "HTD", 2 * L),
        # FlashInfer (num_blocks, 2, block_size, heads, head_size), NHD and HND
        ("BKTHD", (NB, 2, BS, H, D), (0, 1, 2, 3, 4), "KTHD", L),
        ("BKTHD", (NB, 2, BS, H, D), (0, 1, 3, 2, 4), "KHTD", L),
        # MLA (num_blocks, block_size, latent)
        ("BTD", (NB, BS, 32), (0, 1, 2), "TD", L),
    ],
)
def test_backend_shapes(letters, shape, order, layout, num_arrays):
    mla = letters == "BTD"
    caches = {f"layers.{i}": _raw(shape, order) for i in range(L)}
    th.fill_random(caches, seed=3)
    cache, _ = adopt(caches, letters=letters, mla=mla, num_kv_heads=1 if mla else H,
                     head_size=32 if mla else D)
    assert cache.spec.layout == layout and len(cache.arrays) == num_arrays
    ptrs = [a.unsafe_buffer_pointer() for a in cache.arrays]
    if letters.startswith("K"):
        # K of a layer at the tensor's start, V half-way
        want = [caches[f"layers.{i}"][k].data_ptr() for i in range(L) for k in (0, 1)]
    else:
        want = [caches[f"layers.{i}"].data_ptr() for i in range(L)]
    assert ptrs == want
    for (layer, kv), array in zip(cache.spec.array_keys(), cache.arrays):
        t = caches[f"layers.{layer}"]
        if kv is not None and letters.startswith("K"):
            t = t[kv]
            src = letters[1:]
        else:
            src = letters
        perm = [src.index(c) for c in "B" + layout]
        np.testing.assert_array_equal(np.asarray(array).view(f"u{t.element_size()}"),
                                      th.as_numpy(t.permute(perm)))


def test_layers_named_in_natural_order_and_shared_layers_once():
    caches = th.vllm_caches("LBNHC", th.attention_spec(H, D, BS, "bfloat16"), 12, 4)
    names = th.layer_names(12)
    shuffled = {n: caches[n] for n in reversed(names)}
    shuffled["model.layers.12.self_attn.attn"] = caches[names[3]]  # vLLM KV sharing
    cache, adopted = adopt(shuffled)
    assert adopted == tuple(names)
    assert cache.spec.num_layers == 12
    assert [a.unsafe_buffer_pointer() for a in cache.arrays] == [
        caches[n].data_ptr() for n in names]


def test_bad_inputs_raise_clear_errors():
    caches = th.vllm_caches("LBNHC", th.attention_spec(H, D, BS, "bfloat16"), 2, NB)
    a, b = (caches[n] for n in th.layer_names(2))
    with pytest.raises(TypeError, match="not a torch tensor"):
        adopt({"x": np.zeros(3)})
    with pytest.raises(ValueError, match="non-empty"):
        adopt({})
    # non-dense: every other block (a gap between blocks)
    with pytest.raises(ValueError, match=r"'gappy'.*not dense"):
        adopt({"gappy": torch.zeros(2 * NB, H, BS, 2 * D, dtype=torch.bfloat16)[::2]})
    # overlapping: a broadcast (stride 0) head axis
    overlap = torch.zeros(NB, 1, BS, 2 * D, dtype=torch.bfloat16).expand(NB, H, BS, 2 * D)
    with pytest.raises(ValueError, match="not dense"):
        adopt({"overlap": overlap})
    with pytest.raises(ValueError, match="dtype torch.float16.*one dtype"):
        adopt({"a": a, "b": b.view(torch.float16)})
    with pytest.raises(ValueError, match="shape"):
        adopt({"a": a, "b": torch.zeros(NB + 1, H, BS, 2 * D, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"axis 'H' \(KV heads\) should be 2"):
        adopt({"a": a}, num_kv_heads=2)
    with pytest.raises(ValueError, match="kernel blocks"):
        adopt({"a": a}, block_size=2 * BS)
    with pytest.raises(ValueError, match="head sizes differ"):
        adopt({"a": a}, head_size_v=D // 2, fuse_kv=False)
    with pytest.raises(ValueError, match="unsupported KV-cache dtype uint8"):
        adopt({"a": a.view(torch.uint8)[..., :2 * D]})
    # JAX adopts CPU memory only at 64-byte alignment: said, never copied silently
    flat = torch.zeros(NB * H * BS * 2 * D + 8, dtype=torch.bfloat16)
    odd = flat[8:].view(NB, H, BS, 2 * D)
    with pytest.raises(ValueError, match="'odd'.*without a copy"):
        adopt({"odd": odd})


def test_writes_through_torch_and_through_jaxkv_ops():
    """Torch writes are seen through the adopted arrays (one memory). A jaxkv op on the
    adopted cache does not write the torch memory: JAX does not alias a donated foreign
    (DLPack) buffer, so the result lives in a new buffer; a transfer engine that registered
    the memory (NIXL) refuses it rather than lose writes (`BufferMovedError`), and the
    adopted cache, whose arrays the op consumed, adopts the torch memory again."""
    from jaxkv import EngineConfig
    from jaxkv.transfer import TransferEngine, nixl_available

    if not nixl_available():
        pytest.skip("NIXL (nixl-cu13) is not installed")

    caches = th.vllm_caches("LBNHC", th.attention_spec(H, D, BS, "float32"), 2, NB)
    names = th.layer_names(2)
    cache, _ = adopt(caches)
    caches[names[1]][5] = 3.5  # a write by vLLM's kernels
    assert (np.asarray(cache.arrays[1])[5] == 3.5).all()
    engine = TransferEngine("e", EngineConfig(cache.spec, 1), transport="nixl")
    try:
        engine.register_cache(cache)
        assert [b.address for b in cache.shard_buffers()] == [
            caches[n].data_ptr() for n in names]
        updated = cache.copy_blocks([5], [6])
        assert (np.asarray(updated.arrays[1])[6] == 3.5).all()
        assert updated.arrays[1].unsafe_buffer_pointer() != caches[names[1]].data_ptr()
        assert (caches[names[1]][6] == 0).all()  # the torch memory did not change
        with pytest.raises(BufferMovedError):
            engine.update_cache(updated)
        # the donated arrays were deleted; the adopted cache takes the torch memory again
        assert [a.unsafe_buffer_pointer() for a in cache.arrays] == [
            caches[n].data_ptr() for n in names]
        assert (np.asarray(cache.arrays[1])[5] == 3.5).all()
        engine.check_registrations(cache)
    finally:
        engine.close()


def test_post_processing_writes_back_only_the_rewritten_blocks(monkeypatch):
    """The consumer's rewrite of received blocks on an adopted cache: the blocks are gathered
    and the op runs on them alone (not on a copy of the whole array, which JAX would make to
    donate a foreign buffer), after waiting for torch's writes; exactly those blocks are
    written back into the torch memory, bytes as the in-place rewrite of a JAX-owned array."""
    import jax.numpy as jnp

    from jaxkv import ops
    from jaxkv.transfer._plan import PostProcess
    from jaxkv.transfer._post import apply_post_processing

    nb = 64
    caches = th.vllm_caches("LBNHC", th.attention_spec(H, D, BS, "float16"), 2, nb)
    th.fill_random(caches, seed=3)
    names = th.layer_names(2)
    cache, _ = adopt(caches)
    before = [np.asarray(a).view(np.uint16).copy() for a in cache.arrays]
    ids = np.array([40, 9])
    want = np.asarray(ops.permute_blocks(jnp.asarray(before[1]).view(jnp.float16),
                                         ops.pad_block_ids(ids), "HTD", "THD")).view(np.uint16)
    calls = []
    real_permute = ops.permute_blocks
    monkeypatch.setattr(ops, "permute_blocks", lambda c, *a, **k: (
        calls.append(("permute", c.shape[0])), real_permute(c, *a, **k))[1])
    adopted = type(cache)
    real_store, real_wait = adopted.store_blocks, adopted.wait_for_torch
    monkeypatch.setattr(adopted, "store_blocks", lambda self, i, b_ids, blocks: (
        calls.append(("store", i, np.asarray(b_ids).tolist(), blocks.shape[0])),
        real_store(self, i, b_ids, blocks))[1])
    monkeypatch.setattr(adopted, "wait_for_torch", lambda self: (
        calls.append(("wait",)), real_wait(self))[1])
    step = PostProcess(kind="permute", region=0, array_index=1, block_ids=ids, ratio=1,
                       src_layout="HTD", dst_layout="THD", block_shape=(BS, H, 2 * D),
                       itemsize=2)
    updated = apply_post_processing(cache, [step])
    padded = ops.pad_block_ids(ids).tolist()
    assert calls == [("wait",), ("permute", len(padded)), ("store", 1, padded, len(padded))]
    assert [a.unsafe_buffer_pointer() for a in updated.arrays] == [
        caches[n].data_ptr() for n in names]
    after = [np.asarray(a).view(np.uint16) for a in updated.arrays]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], want)
    others = [i for i in range(nb) if i not in ids]
    np.testing.assert_array_equal(after[1][others], before[1][others])
    assert not np.array_equal(after[1][ids], before[1][ids])  # the rewrite moved bytes


def test_store_blocks_writes_the_listed_blocks_only():
    import jax.numpy as jnp

    caches = th.vllm_caches("LBNHC", th.attention_spec(H, D, BS, "float32"), 1, NB)
    (name,) = th.layer_names(1)
    cache, _ = adopt(caches)
    blocks = jnp.full((3, BS, H, 2 * D), 2.5, jnp.float32)
    cache.store_blocks(0, np.array([6, -1, 2]), blocks)
    assert (caches[name][[2, 6]] == 2.5).all()
    assert (caches[name][[0, 1, 3, 4, 5, 7]] == 0).all()
    with pytest.raises(ValueError, match=r"2 blocks of array 0 need shape \(2, 16, 4, 16\)"):
        cache.store_blocks(0, np.array([1, 2]), blocks)
    cache.wait_for_torch()  # CPU tensors: nothing to wait for


def test_connector_registers_torch_caches():
    """`JaxKVConnector.register_kv_caches` with vLLM's torch tensors: the transfer engine's
    registered buffers are the torch memory; the spec comes from vLLM's kv_cache_config."""
    import vllm_harness as vh
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from jaxkv.integrations.vllm import JaxKVConnector

    spec = th.attention_spec(H, D, BS, "bfloat16")
    caches = th.vllm_caches("LBHNC", spec, L, NB)
    config = vh.vllm_config("kv_consumer", BS, {"engine_id": "d"}, NB)
    worker = JaxKVConnector(config, KVConnectorRole.WORKER,
                            th.kv_cache_config("LBHNC", spec, L, NB))
    try:
        worker.register_kv_caches(caches)
        assert worker.cache.spec.layout == "HTD" and worker.cache.spec.num_layers == L
        assert (worker.cache.spec.kv_factor, worker.cache.spec.head_dim) == (1, 2 * D)
        addresses = sorted(b.address for b in worker.cache.shard_buffers())
        assert addresses == sorted(t.data_ptr() for t in caches.values())
    finally:
        worker.shutdown()
    # without vLLM's kv_cache_config: the model config's heads, head size and dtype
    # (facebook/opt-125m: 12 KV heads of 64, float16 in this config)
    opt = th.attention_spec(12, 64, BS, "float16")
    worker = JaxKVConnector(config, KVConnectorRole.WORKER)
    try:
        worker.register_kv_caches(th.vllm_caches("LBNHC", opt, 2, NB))
        got = worker.cache.spec
        assert (got.layout, got.num_kv_heads, got.head_dim, got.dtype.name) == (
            "THD", 12, 128, "float16")
    finally:
        worker.shutdown()
    bhlnc = th.vllm_caches("BHLNC", spec, L, NB)
    worker = JaxKVConnector(config, KVConnectorRole.WORKER,
                            th.kv_cache_config("BHLNC", spec, L, NB))
    with pytest.raises(ValueError, match="layers inside the heads.*'HLTD'"):
        worker.register_kv_caches(bhlnc)
    tp = vh.vllm_config("kv_consumer", BS, {"engine_id": "d", "tp_size": 2}, NB)
    worker = JaxKVConnector(tp, KVConnectorRole.WORKER, th.kv_cache_config("LBHNC", spec, L, NB))
    with pytest.raises(ValueError, match="set tp_rank"):
        worker.register_kv_caches(caches)


def test_cache_params_of_a_group():
    """With several KV cache groups, each group's layers are adopted with that group's spec
    (fp8: the element type vLLM's cache_dtype names)."""
    import vllm_harness as vh
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from jaxkv.integrations._torch import adopt_for_vllm, vllm_cache_params

    full = th.attention_spec(H, D, BS, "fp8")
    mla = th.attention_spec(1, 32, BS, "fp8", mla=True)
    config = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], mla)])
    vllm_config = vh.vllm_config("kv_consumer", BS, {"engine_id": "d"}, NB)
    vllm_config.cache_config.cache_dtype = "fp8_e5m2"
    assert vllm_cache_params(vllm_config, config, 1) == dict(
        num_kv_heads=1, head_size=32, head_size_v=0, block_size=BS, mla=True,
        dtype="float8_e5m2")
    caches = th.vllm_caches("LBNHC", mla, 2, NB)
    cache = adopt_for_vllm(caches, vllm_config, config, 1, None, group=1)
    assert cache.spec.mla and cache.spec.layout == "TD"
    assert cache.spec.dtype.name == "float8_e5m2"
