"""Which implementation of the block ops runs: XLA FFI custom calls, Pallas TPU kernels or the
pure-jnp reference.

By default ("auto") the choice is made per platform, for the backend a program is traced on
(``jax.default_backend()``): the custom calls on "cpu" and on NVIDIA GPUs where the CUDA
module is registered (`custom_calls_run_on`), the Pallas kernels on "tpu", and the jnp
reference on any other platform (a ROCm GPU, a build without nvcc), so every op lowers
everywhere. A forced
implementation (`implementation` or the environment variable ``JAXKV_OPS_IMPL``) is used on
every platform; "pallas" off TPU runs the kernels in Pallas's TPU interpret mode. To lower for
another platform than the default one (``lowering_platforms=...``), force the implementation
that platform needs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental import io_callback

from jaxkv.ops import _pallas, reference

__all__ = ["IMPLEMENTATIONS", "current_implementation", "dispatch", "implementation"]

IMPLEMENTATIONS = ("auto", "ffi", "pallas", "reference")
"""Names accepted by `implementation` and ``JAXKV_OPS_IMPL``."""

_ENV = "JAXKV_OPS_IMPL"
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxkv_ops_impl",
                                                                    default=None)


def _checked(name: Any, source: str) -> str:
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"{source} must be one of {', '.join(repr(n) for n in IMPLEMENTATIONS)}; got {name!r}"
        )
    return name


def current_implementation() -> str:
    """The implementation ops traced now use: the innermost `implementation` context, else
    ``JAXKV_OPS_IMPL``, else "auto".

    Raises:
      ValueError: ``JAXKV_OPS_IMPL`` names no implementation.

    Example:
      >>> with implementation("reference"):
      ...     current_implementation()
      'reference'
    """
    forced = _forced.get()
    if forced is not None:
        return forced
    env = os.environ.get(_ENV, "").strip()
    return _checked(env, _ENV) if env else "auto"


def program_key() -> tuple[str, str]:
    """What a cached jaxkv program depends on besides its operands: the implementation in
    force and the default backend (which "auto" picks by). jaxkv keys its eager programs and
    sharding rules with it, so `implementation` invalidates nothing: programs of every
    implementation stay cached side by side.

    Example:
      >>> with implementation("reference"):
      ...     program_key()[0]
      'reference'
    """
    return current_implementation(), jax.default_backend()


@contextlib.contextmanager
def implementation(name: str) -> Iterator[None]:
    """Forces the implementation of every `jaxkv.ops` op (and `PagedKVCache` method) traced
    inside the block.

    Args:
      name: "ffi" (XLA FFI custom calls: cpu and cuda only), "pallas" (Pallas TPU kernels;
        interpret mode off TPU), "reference" (pure jnp, any platform) or "auto" (per platform
        at lowering time: ffi on cpu/cuda, pallas on tpu, reference elsewhere).

    The choice is made when an op is traced. jaxkv caches its own programs per implementation
    (`program_key`), so nothing is cleared; a function of yours that ``jax.jit`` already traced
    keeps the implementation it was traced with, as it keeps any Python state read while
    tracing (jit it again, or call ``jax.clear_caches()``, to trace it anew).

    Raises:
      ValueError: an unknown name.

    Example:
      >>> with implementation("reference"):
      ...     jaxkv.ops.copy_blocks(jnp.arange(4.0).reshape(2, 2), [0], [1]).tolist()
      [[0.0, 1.0], [0.0, 1.0]]
    """
    _checked(name, "implementation")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _reference_concat(cache, ids, *buffers, box_starts):
    return _reference_boxes(cache, ids, buffers, box_starts)


def _reference_boxes(cache, ids, buffers, box_starts):
    import jax.numpy as jnp

    ndim = cache.ndim - 1
    targets = jnp.where((ids < 0) | (ids >= cache.shape[0]), cache.shape[0], ids)
    for k, buffer in enumerate(buffers):
        starts = box_starts[k * ndim:(k + 1) * ndim]
        index = tuple(slice(s, s + size) for s, size in zip(starts, buffer.shape[1:]))
        cache = cache.at[(targets, *index)].set(buffer, mode="drop")
    return cache


def _reference_split(cache, ids, *into, box_starts, shapes):
    ndim = cache.ndim - 1
    blocks = _reference_gather(cache, ids)
    out = []
    for k, shape in enumerate(shapes):
        starts = box_starts[k * ndim:(k + 1) * ndim]
        out.append(blocks[(slice(None), *(slice(s, s + n) for s, n in zip(starts, shape)))])
    return tuple(out)


def _reference_gather(cache, ids):
    # Out-of-range ids come out as zeros, like padding (the kernels skip them as well).
    return reference.gather_blocks(cache, _in_range(ids, cache.shape[0]))


def _reference_rearrange(cache, ids, *, src_layout, dst_layout, ratio, payload=None):
    import jax.numpy as jnp

    ids = _in_range(ids, cache.shape[0])
    out = reference.merge_blocks(cache, ids, ratio, src_layout, dst_layout)
    if payload is None:
        return out
    # Padding of the rewritten blocks comes out zero. The mask is built from iotas: a
    # constant array would be a closed-over constant, which custom_partitioning refuses.
    axis, entries, lanes = payload
    block = tuple(cache.shape[1:])
    mask = ((jax.lax.broadcasted_iota(jnp.int32, block, len(block) - 1) < lanes)
            & (jax.lax.broadcasted_iota(jnp.int32, block, dst_layout.index(axis)) < entries))
    targets = jnp.where(ids < 0, cache.shape[0], ids)
    blocks = jnp.where(mask, out[jnp.clip(ids, 0, cache.shape[0] - 1)],
                       jnp.zeros((), cache.dtype))
    return out.at[targets].set(blocks, mode="drop")


def _in_range(ids, num_blocks):
    """Ids at or past `num_blocks` as padding (-1): the reference skips them like the kernels."""
    import jax.numpy as jnp

    return jnp.where(ids >= num_blocks, -1, ids)


def _bitwise(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a reference op on same-width unsigned views of floating operands: XLA's gather
    and scatter may canonicalise NaN payloads of floats, and a KV move must copy every bit."""
    import jax.numpy as jnp

    def unsigned(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))

    @functools.wraps(fn)
    def run(*operands, **params):
        dtype = operands[0].dtype
        out = fn(*(unsigned(x) for x in operands), **params)
        back = (lambda x: jax.lax.bitcast_convert_type(x, dtype)) if jnp.issubdtype(
            dtype, jnp.floating) else (lambda x: x)
        return tuple(back(x) for x in out) if isinstance(out, tuple) else back(out)

    return run


_REFERENCE: dict[str, Callable[..., Any]] = {
    "copy": lambda cache, src, dst: reference.copy_blocks(
        cache, _in_range(src, cache.shape[0]), _in_range(dst, cache.shape[0])),
    "gather": _reference_gather,
    "gather_into": lambda cache, ids, out: _reference_gather(cache, ids),
    "scatter": lambda cache, blocks, ids: reference.scatter_blocks(
        cache, blocks, _in_range(ids, cache.shape[0])),
    "rearrange": _reference_rearrange,
    "prefix": lambda src_cache, dst_cache, src, dst, count, *, layout: (
        reference.copy_block_prefix(src_cache, dst_cache, _in_range(src, src_cache.shape[0]),
                                    _in_range(dst, dst_cache.shape[0]), count, layout)),
    "prefix_in_place": lambda cache, src, dst, count, *, layout: reference.copy_block_prefix(
        cache, cache, _in_range(src, cache.shape[0]), _in_range(dst, cache.shape[0]), count,
        layout),
    "split": _reference_split,
    "concat": _reference_concat,
}
"""Per-shard jnp implementations with the custom calls' signatures."""


# Which id operands each op checks, as the custom calls' handlers do: (operand index of the
# ids, their name, operand index of the array they index, unique, operand index of ids they
# must be disjoint from or None).
_ID_CHECKS: dict[str, tuple[tuple[int, str, int, bool, int | None], ...]] = {
    "copy": ((1, "src_ids", 0, False, None), (2, "dst_ids", 0, True, 1)),
    "gather": ((1, "ids", 0, False, None),),
    "gather_into": ((1, "ids", 0, False, None),),
    "scatter": ((2, "ids", 0, True, None),),
    "rearrange": ((1, "ids", 0, True, None),),
    "prefix": ((2, "src_ids", 0, False, None), (3, "dst_ids", 1, True, None)),
    "prefix_in_place": ((1, "src_ids", 0, False, None), (2, "dst_ids", 0, True, 1)),
    "split": ((1, "block_ids", 0, False, None),),
    "concat": ((1, "block_ids", 0, True, None),),
}


def _validated(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` preceded by a host check of its traced ids (one device-to-host copy; the checks
    of the CPU custom calls' handlers): bad ids raise ``jax.errors.JaxRuntimeError`` naming
    the problem before the kernel runs (the kernel takes the checked ids, so it waits for the
    check)."""
    import numpy as np

    from jaxkv.ops._ids import check_ids

    checks = _ID_CHECKS[op]
    positions = tuple(sorted({c[0] for c in checks}))

    def run(*operands):
        sizes = {c[2]: operands[c[2]].shape[0] for c in checks}

        def host_check(*ids):
            values = {p: np.asarray(v) for p, v in zip(positions, ids)}
            for position, name, array, unique, disjoint in checks:
                other = None if disjoint is None else (values[disjoint], _name(disjoint))
                check_ids(values[position], name, sizes[array], unique=unique,
                          disjoint_from=other)
            return ids

        def _name(position):
            return next(c[1] for c in checks if c[0] == position)

        shapes = tuple(jax.ShapeDtypeStruct(operands[p].shape, operands[p].dtype)
                       for p in positions)
        checked = io_callback(host_check, shapes, *(operands[p] for p in positions))
        operands = list(operands)
        for p, value in zip(positions, checked):
            operands[p] = value
        return fn(*operands)

    return run


def _sequential_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a Pallas op) under `jax.vmap` runs once per batch element, in a loop, like the
    custom calls' ``vmap_method="sequential"`` (a pallas_call with HBM operands and scalar
    prefetch has no batching rule of its own)."""
    import jax.numpy as jnp

    @jax.custom_batching.custom_vmap
    def run(*operands):
        return fn(*operands)

    @run.def_vmap
    def _rule(axis_size, in_batched, *operands):
        stacked = [x if batched else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
                   for x, batched in zip(operands, in_batched)]
        # The loop slices floats through XLA, which may canonicalise NaN payloads: loop over
        # same-width unsigned views (the kernels move bytes of any dtype).
        out = _bitwise(lambda *xs: jax.lax.map(lambda args: fn(*args), xs))(*stacked)
        return out, jax.tree.map(lambda _: True, out)

    return run


def dispatch(op: str, ffi: Callable[..., Any] | None, *operands: Any,
             validate_ids: bool = False, **params: Any) -> Any:
    """Runs one per-shard op with the current implementation.

    Args:
      op: the op's name (a key of `_pallas.OPS`).
      ffi: the custom-call implementation, called as ``ffi(*operands)``; None where the
        custom calls cannot do the op (padded packed layouts): "auto" then takes the jnp
        reference on cpu and cuda, and a forced "ffi" raises.
      operands: the op's array operands.
      validate_ids: check the ids on the host before the Pallas or reference op runs (the
        custom calls check them themselves).
      params: static parameters of the Pallas and reference implementations.

    Returns:
      What the op returns (an array or a tuple of arrays).

    Raises:
      ValueError: an unknown implementation name in ``JAXKV_OPS_IMPL``.
      NotImplementedError: "ffi" forced for an op the custom calls cannot do.
    """
    impl = current_implementation()
    if ffi is None:
        if impl == "ffi":
            raise NotImplementedError(
                f"jaxkv.ops: the custom calls cannot do this {op} (padding of a packed "
                "layout); use implementation('pallas'), 'reference' or 'auto'")
        ffi = functools.partial(_bitwise(_REFERENCE[op]), **params)
        if validate_ids:
            ffi = _validated(op, ffi)
    reference_fn: Callable[..., Any] = functools.partial(_bitwise(_REFERENCE[op]), **params)
    if validate_ids:
        reference_fn = _validated(op, reference_fn)
    if impl == "ffi":
        return ffi(*operands)
    if impl == "reference":
        return reference_fn(*operands)
    unsupported = pallas_unsupported(operands)
    compiled: Callable[..., Any] = functools.partial(_pallas.OPS[op], interpret=False, **params)
    interpreted: Callable[..., Any] = functools.partial(_pallas.OPS[op], interpret=True, **params)
    if validate_ids:
        compiled, interpreted = _validated(op, compiled), _validated(op, interpreted)
    compiled, interpreted = _sequential_vmap(compiled), _sequential_vmap(interpreted)
    if impl == "pallas":
        if unsupported:
            raise NotImplementedError(f"jaxkv.ops: the Pallas kernels {unsupported}; use "
                                      "implementation('reference') or 'auto'")
        # Interpret mode runs through ordered host callbacks, which cannot sit in a
        # platform_dependent branch lowered for a TPU: pick by the default backend.
        return (compiled if jax.default_backend() == "tpu" else interpreted)(*operands)
    # "auto" picks by the backend the program is traced for: the custom calls where they are
    # registered (cpu, cuda), the Pallas kernels on TPU (the jnp reference for element types
    # they do not move: bool, complex, 64-bit, packed sub-byte), the reference elsewhere.
    # Branching with platform_dependent instead would trace every branch in the caller's
    # context, and neither a pallas_call nor the jnp reference traces under a caller's sharded
    # mesh; to lower for another platform than the default, force an implementation.
    backend = jax.default_backend()
    if custom_calls_run_on(backend):
        return ffi(*operands)
    if backend == "tpu" and not unsupported:
        return compiled(*operands)
    return reference_fn(*operands)


@functools.cache
def custom_calls_run_on(backend: str) -> bool:
    """Whether "auto" runs the custom calls on `backend`: on CPU always (the CPU module is
    built with the package), on a GPU only if the CUDA module was built and registered and the
    GPU is an NVIDIA one (a wheel built without nvcc, or a ROCm GPU, also reports "gpu"). Where
    a GPU gets no custom calls, the jnp reference runs instead, and the log says so once.

    Example:
      >>> custom_calls_run_on("cpu"), custom_calls_run_on("tpu")
      (True, False)
    """
    from jaxkv._ffi import registered_platforms

    if backend == "cpu":
        return True
    if backend not in ("gpu", "cuda"):
        return False
    why = ""
    if "CUDA" not in registered_platforms():
        why = "jaxkv was built without its CUDA module (no nvcc at build time)"
    else:
        version = str(getattr(jax.devices(backend)[0].client, "platform_version", "")).lower()
        if "rocm" in version:
            why = f"the GPU runs ROCm ({version}); jaxkv's custom calls are CUDA only"
    if why:
        import logging

        logging.getLogger("jaxkv.ops").warning(
            "jaxkv.ops: %s: the block ops run the jnp reference implementation on this GPU "
            "(implementation('auto'))", why)
        return False
    return True


def pallas_unsupported(operands: Any) -> str:
    """Why the Pallas kernels cannot run on `operands` ("" when they can).

    The kernels move 8-, 16- and 32-bit elements (bit patterns kept through same-width integer
    views); bool, complex, 64-bit and packed sub-byte element types are not handled.

    Example:
      >>> import numpy as np
      >>> pallas_unsupported([np.zeros(2, np.float32)])
      ''
      >>> pallas_unsupported([np.zeros(2, np.complex64)])
      'do not handle complex64 elements'
    """
    import numpy as np

    for x in operands:
        dtype = np.dtype(x.dtype)
        bits = getattr(jax.numpy.finfo(dtype) if jax.numpy.issubdtype(dtype, jax.numpy.floating)
                       else None, "bits", None)
        if jax.numpy.issubdtype(dtype, jax.numpy.integer):
            bits = jax.numpy.iinfo(dtype).bits
        if (dtype == np.bool_ or jax.numpy.issubdtype(dtype, jax.numpy.complexfloating)
                or dtype.itemsize not in (1, 2, 4) or (bits is not None and bits < 8)):
            return f"do not handle {dtype.name} elements"
    return ""
