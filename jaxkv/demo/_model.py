"""A small decoder-only transformer (grouped-query attention, rotary positions, SwiGLU) whose
attention reads and writes a `PagedKVCache`, tensor-parallel over the KV heads.

The demo checks a disaggregated run against a colocated one bit for bit, so a token's KV and
logits must not depend on anything but the token, its position and the KV before it: not on
the TP size, the chunk a prefix hit cut the prompt into, or the other rows of the batch.
Floating-point sums cannot promise that: XLA:CPU picks its matmul and reduction kernels by
shape (and by CPU), and a row's sum changes in the last bit with the number of rows. So every
reduction here is exact:

* matmuls are int8 x int8 with int32 accumulation (weights quantized per output channel once,
  activations per row at each use, as W8A8 serving does): integer sums do not depend on order;
* the norm scales a row by the power of two that brings its largest magnitude into [0.5, 1)
  (a max is exact), not by its RMS;
* every quantization scale is a power of two, so no scaling rounds (a compiler may order
  or rewrite a division by ``amax / 127`` differently in two programs);
* attention's scores are an integer dot of int8 queries and keys, and its softmax sums
  fixed-point weights in int32 (`jaxkv.demo._attention.attend`);
* everything else is elementwise, and heads are split over ranks, never a reduction.

An engine with TP=2 thus writes the same KV bits as one with TP=4 or a colocated one with any
chunking (verified by the tests). The promise holds within one machine and software stack:
elementwise transcendental functions may differ between CPUs or XLA versions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import ops
from jaxkv._cache import PagedKVCache
from jaxkv._spec import KVCacheSpec
from jaxkv.demo._attention import (
    attend,
    binary_exponent,
    check_spec,
    pow2,
    quantize_rows,
    read_pages,
    write_tokens,
)

__all__ = ["ModelConfig", "ModelRunner", "init_params", "make_mesh"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the demo transformer.

    Attributes:
      vocab_size: tokens.
      d_model: residual width.
      num_layers: decoder layers.
      num_heads: query heads.
      num_kv_heads: KV heads (``num_heads`` a multiple of it: grouped-query attention).
      head_dim: elements per head.
      ffn_dim: SwiGLU hidden width.
      rope_theta: rotary base.
      seed: weights are drawn from ``numpy.random.default_rng(seed)``.

    Example:
      >>> ModelConfig(num_layers=2).kv_spec(block_size=16, layout="THD").num_layers
      2
    """

    vocab_size: int = 512
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    ffn_dim: int = 512
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")

    def kv_spec(self, block_size: int, layout: str = "LKHTD", dtype: Any = "bfloat16"):
        """The `KVCacheSpec` of this model's cache."""
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype,
            layout=layout,
        )


def init_params(config: ModelConfig) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights (numpy, identical in every process). The model
    runs on their int8 quantization (`quantize_params`).

    Returns:
      name -> array; per-layer weights are stacked on a leading layer axis. ``wq``/``wk``/``wv``
      are head-major ``[L, heads, d_model, head_dim]``.

    Example:
      >>> init_params(ModelConfig(num_layers=1))["wk"].shape
      (1, 4, 256, 32)
    """
    rng = np.random.default_rng(config.seed)
    c = config
    lyr = c.num_layers

    # The norms bring a row's largest magnitude into [0.5, 1), about 4x its RMS for a
    # Gaussian row: weights near 4 keep activations at about unit RMS, as an RMS norm does.
    gain = np.float32(4.0)

    def normal(*shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)

    return {
        "embed": normal(c.vocab_size, c.d_model, scale=1.0),
        "attn_norm": gain * (1.0 + normal(lyr, c.d_model, scale=0.1)),
        "wq": normal(lyr, c.num_heads, c.d_model, c.head_dim, scale=c.d_model**-0.5),
        "wk": normal(lyr, c.num_kv_heads, c.d_model, c.head_dim, scale=c.d_model**-0.5),
        "wv": normal(lyr, c.num_kv_heads, c.d_model, c.head_dim, scale=c.d_model**-0.5),
        # A strong output projection makes the tokens depend on the attended KV.
        "wo": normal(lyr, c.num_heads * c.head_dim, c.d_model, scale=2.0 * c.d_model**-0.5),
        "mlp_norm": gain * (1.0 + normal(lyr, c.d_model, scale=0.1)),
        "w_gate": normal(lyr, c.d_model, c.ffn_dim, scale=c.d_model**-0.5),
        "w_up": normal(lyr, c.d_model, c.ffn_dim, scale=c.d_model**-0.5),
        "w_down": normal(lyr, c.ffn_dim, c.d_model, scale=c.ffn_dim**-0.5),
        "final_norm": np.full((c.d_model,), gain, np.float32),
        "unembed": normal(c.d_model, c.vocab_size, scale=c.d_model**-0.5),
    }


_MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "unembed")
_HEAD_SHARDED = ("wq", "wk", "wv", "wq_scale", "wk_scale", "wv_scale")
_INT8_MAX = 127


def quantize_params(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights the model runs on: each matmul weight ``w [..., K, N]`` as int8 ``w`` and a
    float32 ``w_scale [..., N]`` (symmetric, per output channel, ``w ~ w_int8 * w_scale``); the
    other parameters unchanged. Numpy, so every process computes the same bytes.

    Example:
      >>> q = quantize_params(init_params(ModelConfig(num_layers=1)))
      >>> q["wk"].dtype, q["wk_scale"].shape
      (dtype('int8'), (1, 4, 32))
    """
    out = dict(params)
    for name in _MATMUL_WEIGHTS:
        w = params[name]
        amax = np.max(np.abs(w), axis=-2)
        scale = np.where(amax > 0, amax / np.float32(_INT8_MAX), 1).astype(np.float32)
        out[name] = np.clip(np.rint(w / scale[..., None, :]), -_INT8_MAX, _INT8_MAX).astype(np.int8)
        out[name + "_scale"] = scale
    return out


def _param_spec(name: str) -> P:
    if name in _HEAD_SHARDED:
        return P(None, "tp", None, None) if not name.endswith("_scale") else P(None, "tp", None)
    return P()


def make_mesh(devices: Any) -> Mesh:
    """A one-axis ``("tp",)`` mesh over `devices`.

    Example:
      >>> make_mesh(jax.devices()[:1]).axis_names
      ('tp',)
    """
    return Mesh(np.asarray(list(devices)), ("tp",))


def _linear(x: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``[M, K] x int8 [K, N] -> [M, N]`` float32, an exact int32 sum per output."""
    q, scale = quantize_rows(x)
    acc = jnp.dot(q, w, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * scale * w_scale


def _norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    """Scales each row by the power of two that brings its largest magnitude into [0.5, 1)
    (exact; an RMS is a float sum, whose last bit depends on the kernel XLA picks), times
    `weight`."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    return x * pow2(-binary_exponent(amax)) * weight


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of ``[H, M, D]`` at ``[M]`` positions (half-split convention)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None], jnp.sin(angles)[None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _per_head(x: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """``[M, D] x int8 [H, D, E] -> [H, M, E]`` float32 (exact int32 sums, as `_linear`)."""
    q, scale = quantize_rows(x)
    acc = jnp.einsum("md,hde->hme", q, w, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * scale[None] * w_scale[:, None, :]


def _weights(params: dict[str, Any], name: str, layer: int | None = None):
    if layer is None:
        return params[name], params[name + "_scale"]
    return params[name][layer], params[name + "_scale"][layer]


def _forward_local(config, spec, params, arrays, tokens, positions, block_tables, write_blocks,
                   write_index, write_offsets):
    """One rank's forward pass (inside shard_map): writes the tokens' KV, attends, returns the
    updated arrays and the logits ``[B, N, V]``.

    New KV goes through a dense copy of the written blocks and `jaxkv.ops.scatter_blocks`
    (an in-place custom call touching only those blocks). A jnp scatter into a bfloat16 cache
    would be lowered by XLA:CPU as a convert of the whole array to float32 and back, i.e. a
    rewrite of every block, racing with transfers that land in other blocks meanwhile.
    """
    b, n = tokens.shape
    m = b * n
    gather_ids = jnp.maximum(write_blocks, 0)
    dense = [a[gather_ids] for a in arrays]  # [W, *block] per array: the blocks written

    x = params["embed"][tokens.reshape(m)]  # [M, Dm]
    arrays = list(arrays)
    for layer in range(config.num_layers):
        dense, arrays, x = _layer_local(config, spec, layer, params, dense, arrays, x,
                                        positions, block_tables, write_blocks, write_index,
                                        write_offsets)
    logits = _linear(_norm(x, params["final_norm"]), *_weights(params, "unembed"))
    return tuple(arrays), logits.reshape(b, n, config.vocab_size)


def _layer_local(config, spec, layer, params, dense, arrays, x, positions, block_tables,
                 write_blocks, write_index, write_offsets):
    """One layer of one rank's forward pass: writes the layer's KV of the tokens into the
    dense written blocks and the cache arrays holding the layer, attends, returns the updated
    ``(dense, arrays, x)``."""
    b, n = positions.shape
    m = b * n
    rope_pos = jnp.maximum(positions.reshape(m), 0)
    arrays = list(arrays)
    h = _norm(x, params["attn_norm"][layer])
    q = _rope(_per_head(h, *_weights(params, "wq", layer)), rope_pos, config.rope_theta)
    k = _rope(_per_head(h, *_weights(params, "wk", layer)), rope_pos, config.rope_theta)
    v = _per_head(h, *_weights(params, "wv", layer))
    for kv, values in ((0, k), (1, v)):
        dense = write_tokens(
            dense, spec, layer, kv, jnp.transpose(values, (1, 0, 2)), write_index,
            write_offsets,
        )
    for index, (key_layer, _) in enumerate(spec.array_keys()):
        if key_layer in (None, layer):
            arrays[index] = ops.scatter_blocks(arrays[index], dense[index], write_blocks)
    k_pages = read_pages(arrays, spec, layer, 0, block_tables)
    v_pages = read_pages(arrays, spec, layer, 1, block_tables)
    q = jnp.transpose(q, (1, 0, 2)).reshape(b, n, q.shape[0], config.head_dim)
    out = attend(q, k_pages, v_pages, positions)  # [B, N, Hq_local, D]
    out = jax.lax.all_gather(out, "tp", axis=2, tiled=True)  # every head, on every rank
    out = out.reshape(m, config.num_heads * config.head_dim)
    x = x + _linear(out, *_weights(params, "wo", layer))
    h = _norm(x, params["mlp_norm"][layer])
    gate = _linear(h, *_weights(params, "w_gate", layer))
    up = _linear(h, *_weights(params, "w_up", layer))
    x = x + _linear(jax.nn.silu(gate) * up, *_weights(params, "w_down", layer))
    return dense, arrays, x


def write_plan(positions: np.ndarray, tables: np.ndarray, block_size: int):
    """Host-side: the blocks a step writes and where each token goes among them.

    Args:
      positions: ``[B, N]`` token positions (``-1``: padding).
      tables: ``[B, P]`` block tables.
      block_size: tokens per block.

    Returns:
      ``(write_blocks [W], write_index [M], write_offsets [M])``: unique block ids padded
      with -1 to ``W = B * (ceil(N / T) + 1)``, each token's row in them (``W`` for padding:
      dropped) and its offset in the block.
    """
    b, n = positions.shape
    width = b * (-(-n // block_size) + 1)
    flat = positions.reshape(-1)
    rows = np.repeat(np.arange(b), n)
    valid = flat >= 0
    ids = np.where(valid, tables[rows, np.where(valid, flat // block_size, 0)], -1)
    unique = list(dict.fromkeys(int(i) for i in ids[valid]))
    write_blocks = np.full(width, -1, np.int32)
    write_blocks[: len(unique)] = unique
    row_of = {block: i for i, block in enumerate(unique)}
    write_index = np.array([row_of[int(i)] if i >= 0 else width for i in ids], np.int32)
    write_offsets = np.where(valid, flat % block_size, 0).astype(np.int32)
    return write_blocks, write_index, write_offsets


@functools.cache
def _step_fn(config: ModelConfig, spec: KVCacheSpec, mesh: Mesh, cache_pspec: P):
    """The jitted step for one (model, cache spec, mesh); the cache argument is donated."""
    param_specs = {name: _param_spec(name) for name in _NAMES}
    array_specs = (cache_pspec,) * spec.num_arrays

    def local(params, arrays, *operands):
        return _forward_local(config, spec, params, arrays, *operands)

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(param_specs, array_specs, P(), P(), P(), P(), P(), P()),
        out_specs=(array_specs, P()),
        check_vma=False,
    )

    def step(params, cache, tokens, positions, block_tables, *write):
        arrays, logits = mapped(params, cache.arrays, tokens, positions, block_tables, *write)
        new_cache = PagedKVCache(cache.spec, arrays, cache.sharding)
        return new_cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), logits

    return jax.jit(step, donate_argnums=(1,))


@functools.cache
def _layer_fns(config: ModelConfig, spec: KVCacheSpec, mesh: Mesh, cache_pspec: P):
    """The step's pieces, jitted (for the layer-announcing step, which calls them inside one
    program with an announcement after each layer): ``embed(params, tokens) -> x``,
    ``layer(params, arrays, x, positions, tables, *write, layer) -> (arrays, x)`` (the cache
    arrays holding the layer, donated) and ``head(params, x, shape) -> (next tokens,
    logits)``. Every layer computes what the one-program step computes (`_layer_local`)."""
    param_specs = {name: _param_spec(name) for name in _NAMES}

    def embed(params, tokens):
        return params["embed"][tokens.reshape(-1)]

    def layer_step(params, arrays, x, positions, block_tables, write_blocks, write_index,
                   write_offsets, layer):
        # Only the arrays holding the layer go in and out (donated): passing the others
        # through a program costs a copy of each on XLA:CPU.
        held = _held_arrays(spec, layer)

        def local(params, arrays, x, positions, block_tables, write_blocks, write_index,
                  write_offsets):
            full: list[Any] = [None] * spec.num_arrays  # the other layers' arrays: unused
            ids = jnp.maximum(write_blocks, 0)
            for i, a in zip(held, arrays):
                full[i] = a
            dense = [None if a is None else a[ids] for a in full]
            _, full, x = _layer_local(config, spec, layer, params, dense, full, x, positions,
                                      block_tables, write_blocks, write_index, write_offsets)
            return tuple(full[i] for i in held), x

        mapped = jax.shard_map(
            local, mesh=mesh,
            in_specs=(param_specs, (cache_pspec,) * len(held), P(), P(), P(), P(), P(), P()),
            out_specs=((cache_pspec,) * len(held), P()), check_vma=False)
        return mapped(params, tuple(arrays), x, positions, block_tables, write_blocks,
                      write_index, write_offsets)

    def head(params, x, shape):
        logits = _linear(_norm(x, params["final_norm"]), *_weights(params, "unembed"))
        logits = logits.reshape(*shape, config.vocab_size)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits

    return (jax.jit(embed), jax.jit(layer_step, donate_argnums=(1,), static_argnums=(8,)),
            jax.jit(head, static_argnums=(2,)))


def _held_arrays(spec: KVCacheSpec, layer: int) -> list[int]:
    """The indices of the cache arrays holding `layer` (one per K/V of a per-layer layout,
    every array of a layout with an L axis)."""
    return [i for i, (key_layer, _) in enumerate(spec.array_keys()) if key_layer in (None, layer)]


def _announcing_step_fn(config: ModelConfig, spec: KVCacheSpec, mesh: Mesh, cache_pspec: P,
                        engine: Any):
    """The step as one jitted program that announces each layer to `engine` (a producer
    `TransferEngine`) from inside it, once the layer's KV is written
    (`jaxkv.transfer.publish_layer_in_jit`, the next layer's input threaded through the
    announcement): ``step(params, cache, tokens, positions, tables, *write, handle, ids) ->
    (cache, next tokens, logits)``, the cache donated; `handle` is the request's
    `TransferEngine.handle`, `ids` its published block ids padded with -1. The layers are
    those of `_layer_fns` (the same values as the one-program step)."""
    from jaxkv.transfer import publish_layer_in_jit

    embed, layer_step, head = _layer_fns(config, spec, mesh, cache_pspec)

    def step(params, cache, tokens, positions, block_tables, write_blocks, write_index,
             write_offsets, handle, publish_ids):
        x = embed(params, tokens)
        arrays = list(cache.arrays)
        for layer in range(spec.num_layers):
            held = _held_arrays(spec, layer)
            out, x = layer_step(params, [arrays[i] for i in held], x, positions, block_tables,
                                write_blocks, write_index, write_offsets, layer)
            for i, array in zip(held, out):
                arrays[i] = array
            written = PagedKVCache(cache.spec, arrays, cache.sharding)
            x, _ = publish_layer_in_jit(engine, handle, publish_ids, written, layer + 1, x)
        next_tokens, logits = head(params, x, tokens.shape)
        return PagedKVCache(cache.spec, arrays, cache.sharding), next_tokens, logits

    return jax.jit(step, donate_argnums=(1,))


_NAMES = (
    "embed", "attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
    "final_norm", "unembed", *(name + "_scale" for name in _MATMUL_WEIGHTS),
)


class ModelRunner:
    """The model and one `PagedKVCache` on a TP mesh, with the jitted (donating) step.

    Args:
      config: the model.
      spec: the cache spec (``num_kv_heads``/``head_dim``/``num_layers`` from the model).
      mesh: a ``("tp",)`` mesh; heads are split over it (TP must divide the KV heads).
      num_blocks: cache blocks.
      max_len: tokens a sequence may reach; a multiple of ``spec.block_size``. Engines that
        must agree bit for bit use the same value (it fixes the attention length).

    Raises:
      ValueError: inconsistent spec, TP or lengths.

    Example:
      >>> cfg = ModelConfig(num_layers=1)
      >>> runner = ModelRunner(cfg, cfg.kv_spec(4, "THD", "float32"), make_mesh(jax.devices()[:1]),
      ...                      num_blocks=8, max_len=16)
      >>> runner.run([[1, 2, 3]], [[0, 1, 2]], [[1]])[0].shape
      (1, 3)
    """

    def __init__(
        self, config: ModelConfig, spec: KVCacheSpec, mesh: Mesh, num_blocks: int, max_len: int
    ):
        check_spec(spec)
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (
            config.num_layers, config.num_kv_heads, config.head_dim
        ):
            raise ValueError(f"cache spec {spec} does not match the model {config}")
        tp = mesh.shape["tp"]
        if config.num_kv_heads % tp:
            raise ValueError(
                f"TP={tp} must divide the {config.num_kv_heads} KV heads (no head replication in "
                "the demo model)"
            )
        if max_len % spec.block_size:
            raise ValueError(f"max_len={max_len} is not a multiple of the block size")
        self.config, self.spec, self.mesh = config, spec, mesh
        self.max_len = max_len
        self.max_pages = max_len // spec.block_size
        self.cache = PagedKVCache.allocate(spec, num_blocks, mesh=mesh)
        host = quantize_params(init_params(config))
        self.params = {
            name: jax.device_put(host[name], NamedSharding(mesh, _param_spec(name)))
            for name in _NAMES
        }
        self._step = _step_fn(config, spec, mesh, self.cache.partition_spec())
        # the layer-announcing step per producer engine (keyed by the engine itself: it is
        # closed over), and its executables compiled ahead (`compile_announced`) per
        # (engine, tokens shape)
        self._announcing: dict[Any, Any] = {}
        self._announcing_compiled: dict[tuple[Any, tuple[int, ...]], Any] = {}

    def block_table(self, block_ids) -> np.ndarray:
        """One row of a block table: the ids, padded with the null block 0."""
        ids = list(block_ids)
        if len(ids) > self.max_pages:
            raise ValueError(f"{len(ids)} blocks exceed max_len={self.max_len}")
        return np.asarray(ids + [0] * (self.max_pages - len(ids)), np.int32)

    def run(self, tokens, positions, block_tables) -> tuple[np.ndarray, np.ndarray]:
        """One step: writes the KV of `tokens` at `positions` (``-1``: padding) into the
        cache through `block_tables` (rows of block ids, padded) and returns the greedy next
        token and the logits of every position (``[B, N]``, ``[B, N, V]``, numpy)."""
        next_tokens, logits = self.dispatch(tokens, positions, block_tables)
        return np.asarray(next_tokens), np.asarray(logits)

    def dispatch(self, tokens, positions, block_tables) -> tuple[jax.Array, jax.Array]:
        """`run` without waiting: dispatches the step (JAX runs it asynchronously) and
        returns the greedy next tokens and logits as (possibly not yet ready) JAX arrays;
        ``self.cache`` is already the step's output. The caller can make progress elsewhere
        (e.g. poll a transfer engine) until ``is_ready()``."""
        tokens = np.asarray(tokens, np.int32)
        positions = np.asarray(positions, np.int32)
        tables = np.stack([self.block_table(row) for row in block_tables])
        write = write_plan(positions, tables, self.spec.block_size)
        self.cache, next_tokens, logits = self._step(
            self.params, self.cache, tokens, positions, tables, *write
        )
        return next_tokens, logits

    def dispatch_announced(self, tokens, positions, block_tables, engine: Any, handle: int,
                           publish_ids) -> tuple[jax.Array, jax.Array]:
        """`dispatch` as one program that announces each layer of a layer-wise request to
        `engine` (a producer `TransferEngine`) from inside the step, as soon as the layer's
        KV is written (`jaxkv.transfer.publish_layer_in_jit`): consumers read layer k while
        the step computes the later ones. The same values as `dispatch`.

        Args:
          tokens, positions, block_tables: as for `dispatch`.
          engine: the producer engine (its registered cache is ``self.cache``).
          handle: the request's `TransferEngine.handle`.
          publish_ids: the block ids the request was published with (``layerwise=True``).

        Returns:
          The greedy next tokens and logits (JAX arrays, possibly not ready yet).
        """
        args = self._announced_args(tokens, positions, block_tables, handle, publish_ids)
        step = self._announcing_compiled.get((engine, np.shape(tokens)))
        if step is None:
            step = self._announcing_step(engine)
        self.cache, next_tokens, logits = step(*args)
        return next_tokens, logits

    def compile_announced(self, engine: Any, shape: tuple[int, int]) -> None:
        """Compiles `dispatch_announced` for `engine` and ``[B, N]`` tokens ahead of use
        (a warm-up that runs nothing: no announcement reaches the engine)."""
        args = self._announced_args(np.zeros(shape, np.int32), np.full(shape, -1, np.int32),
                                    [[]] * shape[0], 0, [])
        self._announcing_compiled[(engine, tuple(shape))] = (
            self._announcing_step(engine).lower(*args).compile())

    def _announced_args(self, tokens, positions, block_tables, handle: int,
                        publish_ids) -> tuple:
        """The announcing step's arguments (the published ids padded with -1 to one shape
        for every request)."""
        tokens = np.asarray(tokens, np.int32)
        positions = np.asarray(positions, np.int32)
        tables = np.stack([self.block_table(row) for row in block_tables])
        write = write_plan(positions, tables, self.spec.block_size)
        ids = np.full(self.max_pages, -1, np.int32)
        ids[:len(publish_ids)] = publish_ids
        return (self.params, self.cache, tokens, positions, tables, *write, np.int32(handle),
                ids)

    def _announcing_step(self, engine: Any) -> Any:
        step = self._announcing.get(engine)
        if step is None:
            step = _announcing_step_fn(self.config, self.spec, self.mesh,
                                       self.cache.partition_spec(), engine)
            self._announcing[engine] = step
        return step

    def prompt_kv(self, block_ids, num_tokens: int) -> np.ndarray:
        """The cached K/V of a sequence's first `num_tokens` tokens as ``[L, 2, H, T, D]``
        (cache dtype, numpy): for comparing engines bit for bit."""
        table = jnp.asarray(self.block_table(block_ids)[None])
        arrays = [jax.device_put(a, NamedSharding(self.mesh, P())) for a in self.cache.arrays]
        out = []
        for layer in range(self.spec.num_layers):
            out.append(
                [np.asarray(read_pages(arrays, self.spec, layer, kv, table))[0, :, :num_tokens]
                 for kv in (0, 1)]
            )
        return np.asarray(out)
