"""`JaxKVTPUConnector`: a KV connector for tpu-inference (vLLM's JAX/TPU backend) on jaxkv.

tpu-inference's own `TPUConnector` moves a request's KV with JAX's transfer server: the
producer copies the request's blocks out of the cache (optionally into a pool of host buffers)
and registers the copy for a pull; the consumer pulls the whole prefill into fresh arrays, copies
them into its cache at the next step, and tells the producer over a ZMQ socket that it may free
the copy, with expiry times for consumers that never come. This connector replaces all of that
with `jaxkv.transfer.TransferEngine`:

* no copies on the producer: the engine pins the request's blocks in the cache itself (a lease
  bounds the wait; host staging, where NIXL cannot register device memory, copies only pinned
  blocks to a host mirror);
* the consumer reads only what its local prefix hit lacks, straight into its own blocks, in its
  own TP size (jaxkv plans which producer rank holds which combined K/V head);
* the confirmation travels with the transfer (no side socket) and the producer frees the blocks
  once every consumer rank confirmed, or at lease expiry; failed reads are reported through
  `get_block_ids_with_load_errors` so vLLM recomputes them.

The scheduler side and the flow are those of `jaxkv.integrations.vllm.JaxKVConnector`: the
producer's workers pin a request's blocks in the step its prefill completes (``wait_for_save``)
and its scheduler hands the consumer `kv_transfer_params` built from the configured worker
addresses. The connector is that facade with its own worker side, `JaxKVTPUWorker`: the vLLM
connector's `JaxKVWorker` bound to tpu-inference's model runner (below).

tpu-inference's runner does not call ``register_kv_caches``: it calls ``register_runner(runner)``
and reassigns ``runner.kv_caches`` (one array per layer, donated to each forward) every step.
The connector therefore adopts ``runner.kv_caches`` zero-copy as a `jaxkv.PagedKVCache`
(`KVCacheSpec.for_tpu_inference`: ``[pages, page_size, align(2 * heads, packing) / packing,
packing, align(head_dim, 128)]`` per TP rank, K of head ``h`` at combined head ``2h``, V at
``2h + 1``) and, at each hook of a step with transfer work, hands the runner's current arrays to
the engine (`TransferEngine.update_cache`; over NIXL, re-registration when the buffers moved);
after each poll it writes the engine's arrays back to ``runner.kv_caches`` when the engine's
writes replaced them (every read over the JAX transport, reads post-processed over NIXL), with
the runner's own shardings, in the step that reports the read finished.

Transports (``ConnectorSettings.transport``): ``"nixl"`` reads the producer's pinned blocks
in place (one-sided READs); ``"jax"`` is the transport of tpu-inference's own connector,
JAX's transfer server (`jax.experimental.transfer`): the producer formats the pinned blocks
for each consumer rank into arrays it offers until the consumer confirmed the pull (or the
lease expired), the consumer pulls them and writes them into its pages with JAX ops, which
produce the new ``runner.kv_caches``. Nothing registers memory then, so a runner whose
buffers move costs nothing. The engine is given the exact packed spec, whose values only are
moved (no phantom heads, no padding lanes; the consumer's padding is left as it was). Over
NIXL, ``packed_transfer="words"`` gives it the word-column view instead (`transfer_view`:
whole 32-bit word columns, padding lanes included, in fewer and larger descriptors: faster
when the head dim is not a multiple of 128).

Loading it: tpu-inference's platform accepts only its own connector names, so the class is also
exported as ``TPUConnector``; vLLM loads the class of that name from
``kv_connector_module_path`` before its registry:

  >>> from vllm.config import KVTransferConfig  # doctest: +SKIP
  >>> KVTransferConfig(  # doctest: +SKIP
  ...     kv_connector="TPUConnector",
  ...     kv_connector_module_path="jaxkv.integrations.tpu_inference",
  ...     kv_role="kv_producer",
  ...     kv_connector_extra_config={"engine_id": "prefill", "side_channel": [["10.0.0.1", 5600]]},
  ... )

Validated on CPU (``JAX_PLATFORMS=cpu``) with tpu-inference 0.32.0's cache allocation and K/V
merge; on TPU the engine stages through host memory (unvalidated: no TPU here).

Settings: `jaxkv.integrations.ConnectorSettings` (``kv_connector_extra_config``); ``tp_size``
comes from the cache's mesh, ``num_kv_heads`` / ``head_dim`` from the model config unless set;
``transport`` is passed to the transfer engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxkv.integrations._vllm_meta import CacheGroups, JaxKVConnectorMetadata
from jaxkv.integrations._vllm_worker import JaxKVWorker
from jaxkv.integrations.vllm import JaxKVConnectorBase
from jaxkv.transfer import nixl_available

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        KVConnectorTransferResults,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from jaxkv import KVCacheSpec
    from jaxkv.integrations._params import ConnectorSettings
    from jaxkv.transfer import PollResult

__all__ = [
    "JaxKVTPUConnector",
    "RunnerCacheLayout",
    "TPUConnector",
    "describe_runner_caches",
    "transfer_view",
]

log = logging.getLogger("jaxkv.integrations.tpu_inference")


@dataclasses.dataclass(frozen=True)
class RunnerCacheLayout:
    """How tpu-inference's per-layer cache arrays map onto a jaxkv cache.

    Attributes:
      spec: the model's cache exactly (`KVCacheSpec.for_tpu_inference`, all KV heads): what
        the transfer engine is given by default.
      view: the spec a transfer engine over NIXL is given with ``packed_transfer="words"``
        (`transfer_view`): the same bytes, one "head" per 32-bit word column; None where
        word columns cannot describe the cache (`view_error` says why).
      mesh: the mesh the arrays are sharded over (None: one device).
      tp_axis: the mesh axis (or axes) the combined head axis is split over.
      data_axis: the mesh axis the page axis is split over, if any.
      tp_size: the number of TP ranks (head shards).
    """

    spec: KVCacheSpec
    view: KVCacheSpec | None
    mesh: Mesh | None
    tp_axis: str | tuple[str, ...]
    data_axis: str | None
    tp_size: int
    view_error: str = ""

    def wrap(self, arrays: Sequence[jax.Array]) -> Any:
        """The arrays adopted zero-copy (`PagedKVCache.wrap` checks them against `spec`), as
        the `PagedKVCache` of `view` over the same arrays that the transfer engine registers."""
        from jaxkv import PagedKVCache

        if self.view is None:
            raise ValueError(self.view_error)
        exact = self.wrap_exact(arrays)
        return PagedKVCache(self.view, exact.arrays, self._view_sharding())

    def wrap_exact(self, arrays: Sequence[jax.Array]) -> Any:
        """The arrays adopted zero-copy as the `PagedKVCache` of `spec` itself (what the JAX
        transport, which moves values only, is given)."""
        from jaxkv import PagedKVCache

        return PagedKVCache.wrap(
            list(arrays), self.spec, self.mesh, tp_axis=self.tp_axis, data_axis=self.data_axis
        )

    def _view_sharding(self) -> Any:
        from jaxkv._sharding import head_sharding

        cached = self.__dict__.get("_sharding")
        if cached is None:
            assert self.view is not None  # wrap() checked it
            cached = head_sharding(self.view, self.mesh, self.tp_axis, self.data_axis)
            object.__setattr__(self, "_sharding", cached)
        return cached


def transfer_view(spec: KVCacheSpec, tp_size: int) -> KVCacheSpec:
    """The transfer engine's description of a `KVCacheSpec.for_tpu_inference` cache: layout
    ``THD`` with one "head" per word column ``[packing, align(head_dim, 128)]``, i.e. the
    same bytes at the same offsets, so that reads between engines of other TP sizes place
    every rank's word columns where they belong in each token row.

    Exact while each TP rank's combined K/V heads fill whole words (``2 * heads_per_rank`` a
    multiple of the packing: always for 16- and 32-bit caches, with an even number of heads
    per rank for 8-bit ones). The padding lanes of the head dim travel with the values.

    Raises:
      ValueError: the ranks' heads do not fill whole words (phantom heads inside a rank).

    Example:
      >>> from jaxkv import KVCacheSpec
      >>> spec = KVCacheSpec.for_tpu_inference(2, num_kv_heads=4, head_dim=96, page_size=16)
      >>> view = transfer_view(spec, tp_size=2)
      >>> spec.global_block_shape(2), view.global_block_shape(2)
      ((16, 4, 2, 128), (16, 4, 256))
    """
    from jaxkv import KVCacheSpec

    packing = spec.packing or 1
    combined = 2 * spec.heads_per_rank(tp_size)
    if not spec.kv_interleaved or spec.packed_axis != "H" or combined % packing:
        raise ValueError(
            f"each TP rank's {combined} combined K/V heads do not fill whole {packing}-value "
            "words (or the cache is not tpu-inference's interleaved one): its phantom heads "
            "cannot be described by word columns"
        )
    view = KVCacheSpec(
        num_layers=spec.num_layers,
        num_kv_heads=2 * spec.num_kv_heads // packing,
        head_dim=packing * spec.block_shape()[-1],
        block_size=spec.block_size,
        dtype=spec.dtype,
        layout="THD",
        kv_factor=1,
    )
    if view.block_nbytes(tp_size) != spec.block_nbytes(tp_size) or (
        view.global_block_shape(tp_size)[1] != spec.global_block_shape(tp_size)[1]
    ):
        raise ValueError(
            f"TP {tp_size} splits the word columns of {spec.num_kv_heads} heads unlike "
            "tpu-inference (replicated heads of a 32-bit cache)"
        )
    return view


def _with_sharding(array: jax.Array, sharding: Any) -> jax.Array:
    """`array` with `sharding` over the same device buffers (no copy), or `array` itself when
    it has that sharding already.

    Raises:
      ValueError: `sharding` places other shard shapes or devices than `array` has.
    """
    import jax

    if array.sharding == sharding:
        return array
    by_device = {shard.device: shard.data for shard in array.addressable_shards}
    try:
        shards = [by_device[d] for d in sharding.addressable_devices_indices_map(array.shape)]
    except KeyError as error:
        raise ValueError(
            f"the array lives on {sorted(d.id for d in by_device)}, the runner's sharding on "
            f"other devices ({error})"
        ) from error
    return jax.make_array_from_single_device_arrays(array.shape, sharding, shards)


def _axis_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def describe_runner_caches(
    arrays: Sequence[jax.Array], num_kv_heads: int, head_dim: int
) -> RunnerCacheLayout:
    """Describes tpu-inference's per-layer KV cache arrays (``runner.kv_caches``) exactly.

    tpu-inference allocates each layer as ``[pages, page_size, combined heads / packing,
    packing, align(head_dim, 128)]`` sharded ``P(batch axes, context axes, KV-head axes)``,
    every TP rank holding its heads' K/V interleaved and padded to whole 32-bit words.

    Args:
      arrays: ``runner.kv_caches`` (one array per attention layer).
      num_kv_heads: the model's KV heads (all ranks).
      head_dim: the model's head dim (before the 128-lane padding).

    Returns:
      The `RunnerCacheLayout`.

    Raises:
      ValueError: no arrays, arrays that differ from one another, context-parallel sharding
        of the page-size axis, a shape that is not the one tpu-inference allocates for
        these heads, head dim and TP size, or head dim 64 (tpu-inference's kernel for it
        stores K and V side by side on the lanes, a layout jaxkv does not describe yet).

    Example:
      >>> import jax.numpy as jnp
      >>> layer = jnp.zeros((8, 16, 2, 2, 128), jnp.bfloat16)  # 2 heads, bf16: packing 2
      >>> describe_runner_caches([layer, layer], num_kv_heads=2, head_dim=128).spec.num_layers
      2
    """
    from jax.sharding import Mesh, NamedSharding

    from jaxkv import KVCacheSpec

    arrays = list(arrays)
    if not arrays:
        raise ValueError("runner.kv_caches is empty")
    first = arrays[0]
    for index, array in enumerate(arrays):
        if array.shape != first.shape or array.dtype != first.dtype:
            raise ValueError(
                f"runner.kv_caches[{index}] is {array.dtype}{list(array.shape)}, layer 0 "
                f"{first.dtype}{list(first.shape)}: one cache group of equal layers is supported"
            )
    if first.ndim != 5:
        raise ValueError(
            f"runner.kv_caches arrays are {first.ndim}-D {list(first.shape)}; tpu-inference's "
            "cache is [pages, page_size, heads / packing, packing, head_dim] (MLA caches are "
            "not supported by this connector)"
        )
    mesh = None
    tp_axis: str | tuple[str, ...] = "model"
    data_axis = None
    tp_size = 1
    sharding = first.sharding
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        if not isinstance(sharding.mesh, Mesh):
            raise ValueError("runner.kv_caches must be sharded over a concrete Mesh")
        mesh = sharding.mesh
        spec_entries = list(sharding.spec) + [None] * (5 - len(sharding.spec))
        sizes = dict(mesh.shape)
        context = [a for a in _axis_names(spec_entries[1]) if sizes[a] > 1]
        if context or any(_axis_names(e) for e in spec_entries[3:]):
            raise ValueError(
                f"runner.kv_caches are sharded {sharding.spec}: only the page axis (data) and "
                "the head axis (TP) may be split"
            )
        data = [a for a in _axis_names(spec_entries[0]) if sizes[a] > 1]
        if len(data) > 1:
            raise ValueError(f"the page axis is split over several mesh axes {data}")
        data_axis = data[0] if data else None
        heads = _axis_names(spec_entries[2])
        if heads:
            tp_axis = heads if len(heads) > 1 else heads[0]
            tp_size = math.prod(sizes[a] for a in heads)
        else:
            unsplit = [a for a in mesh.axis_names if sizes[a] == 1]
            if not unsplit:
                raise ValueError(
                    f"runner.kv_caches are replicated over every axis of mesh {sizes}; "
                    "no TP axis to describe them with"
                )
            tp_axis = unsplit[0]
    if head_dim == 64:
        # tpu-inference 0.32 runs head dim 64 with another kernel (ragged_paged_attention v3
        # kernel_hd64) whose cache puts one head's K and V side by side on the 128 lanes
        # ([pages, page, heads / packing, packing, K 64 | V 64]): not this layout.
        raise ValueError(
            "tpu-inference stores head_dim 64 caches with K and V side by side on the 128 "
            "lanes (its kernel_hd64 layout), which jaxkv's tpu_inference spec does not describe"
        )
    spec = KVCacheSpec.for_tpu_inference(
        len(arrays), num_kv_heads, head_dim, int(first.shape[1]), first.dtype
    )
    expected = spec.global_block_shape(tp_size)
    if tuple(first.shape[1:]) != expected:
        raise ValueError(
            f"runner.kv_caches blocks are {list(first.shape[1:])}; tpu-inference's cache of "
            f"{num_kv_heads} KV heads of dim {head_dim} over TP {tp_size} in "
            f"{spec.dtype.name} is {list(expected)} (set num_kv_heads / head_dim in the "
            "connector settings if the model config differs from the cache)"
        )
    try:
        view, view_error = transfer_view(spec, tp_size), ""
    except ValueError as error:  # only NIXL needs the view (register_runner says so)
        view, view_error = None, str(error)
    return RunnerCacheLayout(spec, view, mesh, tp_axis, data_axis, tp_size, view_error)


class JaxKVTPUWorker(JaxKVWorker):
    """The worker side of `JaxKVTPUConnector`: `JaxKVWorker` bound to tpu-inference's model
    runner, whose ``kv_caches`` it adopts zero-copy, hands to the transfer engine before each
    hook of a step with transfer work (`sync_runner`) and writes back after each poll when the
    engine's writes replaced them.

    Args:
      vllm_config: the engine's config (the model's heads and head dim).
      kv_cache_config: vLLM's cache config (one KV cache group).
      settings: the connector's settings.
      groups: the engine's KV cache groups (one).

    Example:
      >>> worker = JaxKVTPUWorker(vllm_config, None, settings, groups)  # doctest: +SKIP
      >>> worker.register_runner(runner)  # doctest: +SKIP
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        settings: ConnectorSettings,
        groups: CacheGroups,
    ):
        super().__init__(vllm_config, kv_cache_config, settings, groups)
        self.runner: Any = None
        self.layout: RunnerCacheLayout | None = None
        self._synced: tuple[Any, ...] = ()  # runner arrays the engine holds
        self._shardings: tuple[Any, ...] = ()  # the runner's shardings of its arrays
        self._exact = False  # the engine holds the exact (packed) spec, not the view
        self._stash: PollResult | None = None  # polled while re-registering
        self.reregistrations = 0  # times the runner's buffers moved under the engine

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Nothing: tpu-inference's runner calls `register_runner` (its ``kv_caches`` are
        reassigned every forward, so the worker reads them from the runner)."""

    def register_runner(self, runner: Any) -> None:
        """Adopts ``runner.kv_caches`` (zero-copy) and registers them with a new transfer
        engine (see `JaxKVTPUConnector.register_runner`).

        Raises:
          ValueError: the arrays are not tpu-inference's cache for the model, the settings'
            ``tp_size`` is not the mesh's, or ``packed_transfer="words"`` over NIXL with a
            cache whose TP ranks' heads do not fill whole words.
        """
        from jaxkv import EngineConfig

        s = self.settings
        model = self.vllm_config.model_config
        heads = s.num_kv_heads or model.get_total_num_kv_heads()
        head_dim = s.head_dim or model.get_head_size()
        arrays = tuple(runner.kv_caches)
        layout = describe_runner_caches(arrays, heads, head_dim)
        if layout.spec.block_size != self.groups.block_size:
            raise ValueError(
                f"the cache's page size {layout.spec.block_size} is not vLLM's block size "
                f"{self.groups.block_size}"
            )
        if s.tp_size not in (1, layout.tp_size):
            raise ValueError(
                f"settings tp_size {s.tp_size} but the cache is split over {layout.tp_size} "
                "TP ranks"
            )
        # The exact description moves values only (real heads and head-dim lanes); the
        # word-column view, on request over NIXL, moves whole word columns (padding lanes
        # included) in fewer, larger descriptors.
        over_jax = s.transport == "jax" or (s.transport == "auto" and not nixl_available())
        self._exact = over_jax or s.packed_transfer == "values"
        if not self._exact and layout.view is None:
            raise ValueError(f"{layout.view_error} (packed_transfer 'words' over NIXL; "
                             "'values' moves it)")
        self.layout = layout
        cache = self._wrap(arrays)
        engine_spec = layout.spec if self._exact else layout.view
        assert engine_spec is not None
        engine = self.new_engine([EngineConfig(engine_spec, layout.tp_size, 1)])
        engine.register_cache(cache)
        self.runner, self._synced = runner, arrays
        self._shardings = tuple(a.sharding for a in arrays)

    @property
    def address(self) -> tuple[str, int]:
        """This worker's side-channel address (after `register_runner`)."""
        return self.require_engine().address

    @property
    def cache(self) -> Any:
        """The registered cache as the engine holds it (after `sync_runner`)."""
        return self.require_engine().caches[0]

    def _busy(self, meta: JaxKVConnectorMetadata | None) -> bool:
        engine = self.engine
        if engine is None or self.runner is None:
            return False
        work = meta is not None and meta.has_work()
        return work or engine.num_pinned > 0 or engine.num_reading > 0

    def sync_runner(self) -> None:
        """Hands ``runner.kv_caches`` to the transfer engine when the runner reassigned them
        (see `JaxKVTPUConnector.sync_runner`).

        Raises:
          RuntimeError: `register_runner` was not called.
        """
        from jaxkv import BufferMovedError

        if self.runner is None or self.layout is None:
            raise RuntimeError("register_runner first")
        arrays = tuple(self.runner.kv_caches)
        if len(arrays) == len(self._synced) and all(
            a is b for a, b in zip(arrays, self._synced)
        ):
            return
        engine = self.require_engine()
        cache = self._wrap(arrays)
        try:
            engine.update_cache(cache)
        except BufferMovedError as error:
            log.warning("runner.kv_caches moved (%s): re-registering", error)
            for read_id in list(self._reading):
                engine.abort_request(read_id)
            if self._reading:
                stash = engine.poll()  # fails them and releases their NIXL handles
                if self._stash is not None:
                    self._stash.extend(stash)
                    stash = self._stash
                self._stash = stash
            engine.register_cache(cache)
            self.reregistrations += 1
        self._synced = arrays
        self._shardings = tuple(a.sharding for a in arrays)

    def _wrap(self, arrays: Sequence[Any]) -> Any:
        assert self.layout is not None
        return self.layout.wrap_exact(arrays) if self._exact else self.layout.wrap(arrays)

    def _write_back(self) -> None:
        """Puts the engine's current arrays into ``runner.kv_caches`` when the engine's own
        writes replaced them (reads over the JAX transport, post-processed reads), with the
        runner's shardings, and makes them the engine's current cache.

        The engine's ops return the arrays with the transfer view's sharding (an equivalent
        one, on its own mesh for a one-device cache): they are handed back as arrays of the
        runner's exact shardings over the same buffers (no copy), so that the runner's
        jitted forward takes (and donates) them as it took its own."""
        if self.runner is None or self.engine is None or self.layout is None:
            return
        arrays = tuple(self.engine.caches[0].arrays)
        if len(arrays) == len(self._synced) and all(
            a is b for a, b in zip(arrays, self._synced)
        ):
            return
        restored = tuple(
            _with_sharding(a, sharding) for a, sharding in zip(arrays, self._shardings)
        )
        if any(r is not a for r, a in zip(restored, arrays)):
            self.engine.update_cache(self._wrap(restored))
        self.runner.kv_caches = list(restored)
        self._synced = restored

    def start_load_kv(self, meta: JaxKVConnectorMetadata) -> None:
        """Syncs the runner's arrays, then starts this step's reads and releases aborted
        requests."""
        if self._busy(meta):
            self.sync_runner()
        super().start_load_kv(meta)

    def wait_for_save(self, meta: JaxKVConnectorMetadata) -> None:
        """Syncs the runner's arrays (the forward wrote them), then pins the blocks of the
        requests whose prefill completed this step."""
        if self._busy(meta):
            self.sync_runner()
        super().wait_for_save(meta)

    def get_transfer_results(
        self, meta: JaxKVConnectorMetadata | None = None
    ) -> KVConnectorTransferResults:
        """Polls the transfer engine on the runner's current arrays and writes the engine's
        arrays back to the runner."""
        if self._busy(meta):
            self.sync_runner()
        results = super().get_transfer_results(meta)
        self._write_back()
        return results

    def poll(self) -> PollResult:
        """One `TransferEngine.poll`, after what `sync_runner` polled while re-registering."""
        polled = self.require_engine().poll()
        if self._stash is not None:
            stash, self._stash = self._stash, None
            stash.extend(polled)
            polled = stash
        return polled


class JaxKVTPUConnector(JaxKVConnectorBase):
    """tpu-inference KV connector moving KV blocks with jaxkv (see the module docstring): the
    vLLM connector's facade with a `JaxKVTPUWorker` as its worker side
    (``connector_worker``).

    Args:
      vllm_config: the engine's config; ``kv_transfer_config.kv_connector_extra_config`` holds
        the `jaxkv.integrations.ConnectorSettings`.
      role: `KVConnectorRole.SCHEDULER` or `KVConnectorRole.WORKER`.
      kv_cache_config: vLLM's cache config (one KV cache group is supported).

    Raises:
      ValueError: bad settings, several KV cache groups, or pipeline parallelism.
    """

    connector_worker: JaxKVTPUWorker | None

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        if self.settings.pp_size != 1:
            raise ValueError("the tpu-inference connector supports pp_size 1")

    def _make_worker(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
    ) -> JaxKVTPUWorker:
        return JaxKVTPUWorker(vllm_config, kv_cache_config, self.settings, self.groups)

    def _tpu_worker(self) -> JaxKVTPUWorker:
        if self.connector_worker is None:
            raise RuntimeError("a worker-side call on the connector's scheduler side")
        return self.connector_worker

    # -- worker side ----------------------------------------------------------------------

    @property
    def runner(self) -> Any:
        """The registered model runner (None before `register_runner`)."""
        return None if self.connector_worker is None else self.connector_worker.runner

    @property
    def layout(self) -> RunnerCacheLayout | None:
        """How the runner's arrays map onto a jaxkv cache (after `register_runner`)."""
        return None if self.connector_worker is None else self.connector_worker.layout

    @property
    def reregistrations(self) -> int:
        """Times the runner's buffers moved under the engine."""
        return 0 if self.connector_worker is None else self.connector_worker.reregistrations

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Nothing: tpu-inference's runner calls `register_runner` (its ``kv_caches`` are
        reassigned every forward, so the connector reads them from the runner)."""

    def register_runner(self, runner: Any) -> None:
        """Adopts ``runner.kv_caches`` (zero-copy) and registers them with a new transfer
        engine.

        Args:
          runner: tpu-inference's model runner (``kv_caches``: one array per layer); any object
            with such a ``kv_caches`` list works.

        Raises:
          ValueError: the arrays are not tpu-inference's cache for the model (see
            `describe_runner_caches`), the settings' ``tp_size`` is not the mesh's, or, with
            ``packed_transfer="words"`` over NIXL, a cache whose TP ranks' heads do not fill
            whole words (`transfer_view`).
        """
        self._tpu_worker().register_runner(runner)

    def sync_runner(self) -> None:
        """Hands ``runner.kv_caches`` to the transfer engine when the runner reassigned them:
        `TransferEngine.update_cache` when they are the registered buffers (the forward
        donated them) or when the transport does not register memory (the JAX transport
        formats from and writes into whichever arrays are current: moved buffers are simply
        adopted), else a re-registration (below).

        When the buffers registered with NIXL moved (a forward that did not update them in
        place), reads in flight were writing into the old buffers: they are stopped and
        reported failed (vLLM recomputes their blocks) before the new buffers are
        registered; the producer's peers re-fetch its metadata (their reads planned against
        the old buffers fail the same way).

        Raises:
          RuntimeError: `register_runner` was not called.
        """
        self._tpu_worker().sync_runner()

    @property
    def address(self) -> tuple[str, int]:
        """This worker's side-channel address (after `register_runner`)."""
        return self._tpu_worker().address

    @property
    def cache(self) -> Any:
        """The registered cache as the engine holds it (after `sync_runner`)."""
        return self._tpu_worker().cache


TPUConnector = JaxKVTPUConnector
"""The name tpu-inference's platform accepts (``kv_connector="TPUConnector"`` with
``kv_connector_module_path="jaxkv.integrations.tpu_inference"``)."""
