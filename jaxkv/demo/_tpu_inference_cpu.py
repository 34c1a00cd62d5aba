"""tpu-inference 0.32 (vLLM's JAX/TPU backend) serving a real model forward on JAX's CPU
devices: the patches it needs, applied by `apply` before a `vllm.LLM` is built.

tpu-inference targets TPUs only. On CPU devices it runs with these changes, each as small as
it can be (pinned to vllm-tpu / tpu-inference 0.32.0; `apply` checks the versions):

* TPU environment variables (``TPU_ACCELERATOR_TYPE=v6e-1``, ``TPU_NAME``,
  ``TPU_WORKER_ID``): tpu-inference skips its cloud metadata queries.
* The mesh: a plain `jax.sharding.Mesh` instead of ``make_optimized_mesh`` (which sorts
  devices by TPU coordinates; CPU devices have none).
* The device name ``"TPU v6e"`` where tpu-inference asks for one (memory limits, tuned
  kernel block sizes).
* Empty TPU compiler options (XLA:CPU refuses the TPU flags): patched before the runner and
  the sampler import them.
* Attention: a jittable `jax.numpy` stand-in for the ragged paged attention kernel (the Pallas
  kernel does not run in interpret mode on CPU with jax 0.11.2), with the kernel's signature
  and semantics: it writes the step's K/V into the packed cache with tpu-inference's own
  ``merge_kv`` (K/V interleaved per head, packed, head dim padded to 128 lanes), at the
  slots the page indices give, and attends causally over each sequence's pages.
* Inputs: each step's host inputs are copied before `jax.device_put` (JAX's CPU client may
  alias a numpy buffer that the runner refills for the next step while a dispatched step
  still reads it: under CPU load a single instance's tokens changed from run to run).
* Weights: tpu-inference's JAX dummy loader fills weights with small uniform values, with
  which a tiny model repeats one token whatever its input; `apply` makes it draw signed normal
  weights scaled by the fan-in from a seed (norm weights near 1), so that the tokens depend
  on the KV.

Example (in a fresh process, before vLLM is imported)::

    from jaxkv.demo import _tpu_inference_cpu
    _tpu_inference_cpu.apply(seed=1)
    llm = vllm.LLM(model=..., load_format="dummy", ...)
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

__all__ = ["apply", "ragged_paged_attention"]

PINNED = {"tpu-inference": "0.32.0", "vllm-tpu": "0.32.0"}
_applied: dict[str, int] = {}


def ragged_paged_attention(
    queries: Any, keys: Any, values: Any, kv_cache: Any, kv_lens: Any, page_indices: Any,
    cu_q_lens: Any, distribution: Any, *, use_causal_mask: bool = True,
    update_kv_cache: bool = True, sm_scale: float = 1.0, sliding_window: int | None = None,
    soft_cap: float | None = None, q_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None, **unused: Any,
) -> tuple[Any, Any]:
    """tpu-inference's ``ragged_paged_attention`` (v3) in `jax.numpy`: one rank's heads.

    Args:
      queries: ``[tokens, q_heads, head_dim]``; keys, values: ``[tokens, kv_heads, head_dim]``.
      kv_cache: ``[pages, page_size, kv_heads * 2 / packing, packing, padded head_dim]``.
      kv_lens: ``[max_seqs]`` each sequence's length after this step.
      page_indices: ``[max_seqs * pages_per_seq]`` page ids.
      cu_q_lens: ``[max_seqs + 1]`` cumulative query lengths.
      distribution: ``[3]``; its last entry is the number of sequences.
      use_causal_mask, update_kv_cache, sm_scale, sliding_window, soft_cap, q_scale, k_scale,
        v_scale: as the kernel's.

    Returns:
      ``(outputs [tokens, q_heads, head_dim], kv_cache)``; tokens past the sequences give
      zeros.
    """
    import jax
    import jax.numpy as jnp
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv

    tokens, q_heads, head_dim = queries.shape
    kv_heads = keys.shape[1]
    num_pages, page_size, _, _, padded = kv_cache.shape
    max_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_seqs
    num_seqs = distribution[-1]
    token = jnp.arange(tokens, dtype=jnp.int32)
    # A token's sequence: how many real sequences end at or before it (cu_q_lens is padded
    # past the real sequences with values that need not be sorted: no searchsorted).
    real = jnp.arange(max_seqs, dtype=jnp.int32) < num_seqs
    ends = cu_q_lens[1:]
    seq = jnp.sum((token[:, None] >= ends[None, :]) & real[None, :], axis=1).astype(jnp.int32)
    valid = token < cu_q_lens[num_seqs]
    seq = jnp.minimum(seq, max_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (token - cu_q_lens[seq])
    table = page_indices.reshape(max_seqs, pages_per_seq)
    if update_kv_cache:
        page = table[seq, jnp.clip(position // page_size, 0, pages_per_seq - 1)]
        page = jnp.where(valid, page, num_pages)  # out of range: dropped
        merged = merge_kv(keys, values).astype(kv_cache.dtype)
        kv_cache = kv_cache.at[page, position % page_size].set(merged, mode="drop")
    # Each query token attends over its sequence's pages.
    pages = kv_cache[table[seq]]  # [tokens, pages_per_seq, page_size, ...]
    span = pages_per_seq * page_size
    kv = pages.reshape(tokens, span, -1, padded)[:, :, : 2 * kv_heads, :head_dim]
    k = kv[:, :, 0::2].astype(jnp.float32)  # merge_kv interleaves K and V per head
    v = kv[:, :, 1::2].astype(jnp.float32)
    group = q_heads // kv_heads
    q = queries.astype(jnp.float32).reshape(tokens, kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,tshd->thgs", q, k) * sm_scale
    if k_scale is not None:
        scores = scores * k_scale
    if q_scale is not None:
        scores = scores * q_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key = jnp.arange(span, dtype=jnp.int32)
    visible = key[None, :] < kv_lens[seq][:, None]
    if use_causal_mask:
        visible &= key[None, :] <= position[:, None]
        if sliding_window is not None:
            visible &= key[None, :] > position[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(visible[:, None, None, :], weights, 0.0)
    out = jnp.einsum("thgs,tshd->thgd", weights, v)
    if v_scale is not None:
        out = out * v_scale
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    out_dtype = jnp.float32 if queries.dtype == jnp.float32 else jnp.bfloat16
    return out.reshape(tokens, q_heads, head_dim).astype(out_dtype), kv_cache


def _check_versions() -> None:
    for package, version in PINNED.items():
        found = importlib.metadata.version(package)
        if found != version:
            raise RuntimeError(
                f"jaxkv's tpu-inference CPU patches are written for {package}=={version}, "
                f"found {found}"
            )


def _seeded_weights(seed: int) -> None:
    """The model tpu-inference builds (for ``load_format="dummy"``) gets signed normal
    weights, scaled by the fan-in, drawn per parameter path from `seed`; norm weights near 1."""
    import zlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tpu_inference.models.common import model_loader

    stock = model_loader._get_nnx_model  # noqa: SLF001 - the one place models are built

    def build(*args: Any, **kwargs: Any) -> Any:
        model = stock(*args, **kwargs)
        state = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        filled = []
        for path, value in leaves:
            name = jax.tree_util.keystr(path)
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            shape = value.shape
            if len(shape) >= 2:
                # [in, out], or [in, heads, head_dim] / [heads, head_dim, out] (einsum weights)
                fan_in = shape[0] if len(shape) == 2 or shape[0] >= shape[-1] else \
                    shape[0] * shape[1]
                host = rng.standard_normal(shape, dtype=np.float32) * float(fan_in) ** -0.5
            else:
                host = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            filled.append(jax.device_put(jnp.asarray(host, value.dtype), value.sharding))
        nnx.update(model, jax.tree_util.tree_unflatten(treedef, filled))
        return model

    model_loader._get_nnx_model = build  # noqa: SLF001


def apply(seed: int = 0) -> None:
    """Applies the patches (module docstring) in this process, once; the dummy weights come
    from `seed`.

    Raises:
      RuntimeError: other tpu-inference / vllm-tpu versions than the pinned ones, or a second
        call with another seed.
    """
    if _applied:
        if _applied["seed"] != seed:
            raise RuntimeError("the patches are applied with another seed in this process")
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-1")
    os.environ.setdefault("TPU_NAME", "jaxkv-cpu")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _check_versions()
    import jax
    import numpy as np
    from tpu_inference.models.common import compiler_options

    compiler_options.get_step_fn_compiler_options = lambda: {}
    compiler_options.get_sampling_compiler_options = lambda: {}
    from tpu_inference import utils

    def plain_mesh(axis_shapes: Any, axis_names: Any, *, devices: Any = None) -> Any:
        devices = list(devices if devices is not None else jax.devices())
        count = int(np.prod(axis_shapes))
        return jax.sharding.Mesh(np.array(devices[:count]).reshape(axis_shapes),
                                 tuple(axis_names))

    utils.make_optimized_mesh = plain_mesh
    utils.get_device_name = lambda num_devices=None: "TPU v6e"
    from tpu_inference.platforms import tpu_platform

    tpu_platform.TpuPlatform.get_device_name = classmethod(lambda cls, device_id=0: "TPU v6e")
    from tpu_inference.runner import tpu_runner

    tpu_runner.make_optimized_mesh = plain_mesh
    # JAX's CPU client may alias a numpy array it is given instead of copying it; the runner
    # refills its numpy input buffers for the next step while a dispatched step can still be
    # reading them (seen: other tokens under CPU load). Copies make each step own its inputs.
    stock_device_array = utils.device_array

    def device_array(mesh: Any, *args: Any, **kwargs: Any) -> Any:
        owned = jax.tree.map(lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray)
                             else x, args)
        return stock_device_array(mesh, *owned, **kwargs)

    utils.device_array = device_array
    tpu_runner.device_array = device_array
    from tpu_inference.layers.common import attention_interface

    attention_interface.ragged_paged_attention = ragged_paged_attention
    _seeded_weights(seed)
    _applied["seed"] = seed
