"""`jaxkv.blocks.plan_kv_cache` for hybrid attention + Mamba models against vLLM 0.33's own
functions: the page alignment (``Platform._align_hybrid_block_size`` with state shapes from
vLLM's ``MambaStateShapeCalculator`` for Mamba1, Mamba2 and Gated DeltaNet layers, at TP 1 and
2), the groups, block count and concurrency (``get_kv_cache_configs``,
``get_max_concurrency_for_kv_cache_config``) and the longest length that fits when memory runs
short (the estimate in vLLM's error). Attention is facebook/opt-125m's (the model config the
integration environment holds offline): 12 KV heads of 64, float16."""

from __future__ import annotations

import importlib.util
import os
import re
from unittest import mock

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed: run scripts/test.sh --integrations (sets up .venv-vllm)",
        allow_module_level=True,
    )

from jaxkv import KVCacheSpec  # noqa: E402
from jaxkv.blocks import AttentionLayers, InsufficientMemoryError, plan_kv_cache  # noqa: E402
from jaxkv.blocks._sizing import MambaLayers  # noqa: E402

HEADS, HEAD_DIM = 12, 64  # opt-125m's attention
MAX_LEN = 2048  # opt-125m's max_model_len


def vllm_config(block_size: int = 16, tp: int = 1):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="float16", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                                         max_model_len=MAX_LEN, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto",
                                 enable_prefix_caching=False),
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.tensor_parallel_size = tp
    assert config.cache_config.mamba_cache_mode == "none"
    return config


def state(kind: str, tp: int):
    """(shapes, dtypes, mamba type) of one Mamba layer on one TP rank, by vLLM's calculators."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator as D,
    )
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator as C,
    )

    if kind == "nemotron_h":  # Mamba2: 128 heads of 64, state 128, 8 groups, conv kernel 4
        return (C.mamba2_state_shape(tp, 8192, 8, 128, 64, 128, 4),
                D.mamba2_state_dtype(torch.float16, "auto", "auto"), "MAMBA2")
    if kind == "mamba2_one_group":  # n_groups 1 < TP: vLLM replicates the group per rank
        return (C.mamba2_state_shape(tp, 5120, 1, 80, 64, 128, 4),
                D.mamba2_state_dtype(torch.float16, "auto", "auto"), "MAMBA2")
    if kind == "jamba":  # Mamba1: d_inner 8192, state 16, conv kernel 4
        return (C.mamba1_state_shape(tp, 8192, 16, 4),
                D.mamba1_state_dtype(torch.float16, "auto", "auto"), "MAMBA1")
    if kind == "jamba_fp32_ssm":
        return (C.mamba1_state_shape(tp, 8192, 16, 4),
                D.mamba1_state_dtype(torch.float16, "auto", "float32"), "MAMBA1")
    if kind == "qwen3_next":  # GDN: 16 key heads, 32 value heads of 128, conv kernel 4
        return (C.gated_delta_net_state_shape(tp, 16, 32, 128, 128, 4),
                D.gated_delta_net_state_dtype(torch.float16, "auto", "auto"), "GDN_ATTN")
    raise AssertionError(kind)


def vllm_alignment(config, shapes, dtypes) -> tuple[int, int | None]:
    """vLLM's block size and padded Mamba page for the model (its alignment, run as the
    platform runs it, with the model class and attention backend stubbed to give these
    states and the Triton backend's kernel sizes)."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    class Model:
        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            return shapes

        @classmethod
        def get_mamba_state_dtype_from_config(cls, vllm_config):
            return dtypes

    with mock.patch("vllm.model_executor.models.ModelRegistry.resolve_model_cls",
                    return_value=(Model, "Model")), \
            mock.patch.object(Platform, "_find_non_ssm_backends",
                              return_value=[TritonAttentionBackend]):
        Platform._align_hybrid_block_size(config, TritonAttentionBackend)
    return config.cache_config.block_size, config.cache_config.mamba_page_size_padded


def attention_spec(num_layers: int, block_size: int = 16) -> KVCacheSpec:
    return KVCacheSpec(num_layers=num_layers, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                       block_size=block_size, dtype="float16")


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2_one_group", "jamba", "jamba_fp32_ssm",
                                  "qwen3_next"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("block_size", [16, 64])
def test_alignment_matches_vllm(kind, tp, block_size):
    config = vllm_config(block_size, tp)
    shapes, dtypes, _ = state(kind, tp)
    block, padded = vllm_alignment(config, shapes, dtypes)
    assert block > block_size  # every state here is larger than a 16- or 64-token page
    plan = plan_kv_cache(
        [AttentionLayers(attention_spec(1, block_size), (0,)),
         MambaLayers.from_shapes(shapes, [str(d) for d in dtypes], (1,))],
        1 << 30, max_model_len=MAX_LEN, tp_size=tp)
    assert plan.block_size == block
    assert plan.page_nbytes == (padded if padded is not None else block * 2 * HEADS // tp
                                * HEAD_DIM * 2)
    mamba = [g for g in plan.groups if g.is_mamba]
    from vllm.v1.kv_cache_interface import MambaSpec

    assert mamba[0].state_nbytes == MambaSpec(shapes=shapes, dtypes=dtypes,
                                              block_size=MAX_LEN).page_size_bytes


def vllm_plan(config, attention_layers, mamba_layers, shapes, dtypes, mamba_type, block, page,
              memory, spec_blocks=0):
    """vLLM's KV cache config of the layers (names in layer order, as a model registers them)
    and its max concurrency."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                  dtype=torch.float16)
    mamba = MambaSpec(block_size=MAX_LEN, shapes=shapes, dtypes=dtypes, page_size_padded=page,
                      mamba_type=MambaAttentionBackendEnum[mamba_type],
                      num_speculative_blocks=spec_blocks)
    specs = {}
    for i in sorted(attention_layers + mamba_layers):
        if i in attention_layers:
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{i}.mixer"] = mamba
    config.cache_config.num_gpu_blocks_override = None
    resolve_kv_cache_layout(config, [["NHD"]], [attention])
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_config,) = get_kv_cache_configs(config, [specs], [memory], groups)
    layers = [tuple(int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in g.layer_names)
              for g in kv_config.kv_cache_groups]
    return kv_config.num_blocks, layers, get_max_concurrency_for_kv_cache_config(config,
                                                                                 kv_config)


LAYOUTS = {
    # Jamba-like: attention at 4, 12, 20, 28 of 32 layers (group size 4, 7 Mamba groups)
    "jamba": ((4, 12, 20, 28), tuple(i for i in range(32) if i not in (4, 12, 20, 28))),
    # 8 attention + 11 Mamba: under vLLM 0.33's 1.5x, groups of 11 (3 padding slots)
    "near_balanced": (tuple(range(0, 16, 2)), tuple(range(1, 16, 2)) + (16, 17, 18)),
    # Qwen3-Next-like: attention every 4th of 48 (group size 12, 3 Mamba groups)
    "qwen3_next": (tuple(range(3, 48, 4)), tuple(i for i in range(48) if i % 4 != 3)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind,spec_blocks", [("nemotron_h", 0), ("jamba", 2),
                                              ("qwen3_next", 1)])
def test_plan_matches_vllm(layout, kind, spec_blocks):
    attention_layers, mamba_layers = LAYOUTS[layout]
    config = vllm_config()
    shapes, dtypes, mamba_type = state(kind, 1)
    block, page = vllm_alignment(config, shapes, dtypes)
    memory = 3 << 30
    num_blocks, groups, concurrency = vllm_plan(config, attention_layers, mamba_layers, shapes,
                                                dtypes, mamba_type, block, page, memory,
                                                spec_blocks)
    plan = plan_kv_cache(
        [AttentionLayers(attention_spec(len(attention_layers)), attention_layers),
         MambaLayers.from_shapes(shapes, [str(d) for d in dtypes], mamba_layers,
                                 num_speculative_blocks=spec_blocks)],
        memory, max_model_len=MAX_LEN)
    assert plan.num_blocks == num_blocks
    assert sorted(g.layers for g in plan.groups) == sorted(groups)
    # vLLM counts the null block in the concurrency, jaxkv does not: same blocks per request.
    assert plan.blocks_per_request == pytest.approx(num_blocks / concurrency)
    assert plan.max_concurrency == pytest.approx((num_blocks - 1) / plan.blocks_per_request)


@pytest.mark.parametrize("kind", ["nemotron_h", "qwen3_next"])
@pytest.mark.parametrize("blocks", [4, 8, 9, 10, 57])
def test_longest_length_matches_vllm(kind, blocks):
    attention_layers, mamba_layers = LAYOUTS["jamba"]
    config = vllm_config()
    shapes, dtypes, mamba_type = state(kind, 1)
    block, page = vllm_alignment(config, shapes, dtypes)
    memory = blocks * 4 * page + page  # ``blocks`` blocks of 4 pages and a spare page
    layers = [AttentionLayers(attention_spec(4), attention_layers),
              MambaLayers.from_shapes(shapes, [str(d) for d in dtypes], mamba_layers)]
    try:
        vllm_plan(config, attention_layers, mamba_layers, shapes, dtypes, mamba_type, block,
                  page, memory)
        vllm_fits = None
    except ValueError as error:
        found = re.search(r"estimated maximum model length is (\d+)", str(error))
        vllm_fits = int(found.group(1)) if found else 0
    try:
        plan_kv_cache(layers, memory, max_model_len=MAX_LEN)
        jaxkv_fits = None
    except InsufficientMemoryError as error:
        found = re.search(r"longest max_model_len that fits is (\d+)", str(error))
        jaxkv_fits = int(found.group(1)) if found else 0
    assert jaxkv_fits == vllm_fits
    # By hand: ``blocks - 1`` usable (the null block), 7 of them the Mamba groups' states.
    attention_blocks = blocks - 1 - 7
    if attention_blocks * block >= MAX_LEN:
        assert jaxkv_fits is None
    else:
        assert jaxkv_fits == max(0, attention_blocks * block)
