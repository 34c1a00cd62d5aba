"""vLLM compatibility of jaxkv.blocks: sha256_cbor block hashes, per-block removal events and
the msgspec wire shape of KV-cache events.

Expected values are computed here from vLLM's documented behaviour, independently of jaxkv:
``NONE_HASH = sha256(cbor(seed))`` for a ``PYTHONHASHSEED`` string ``seed``; a block hash is
``sha256(cbor((parent or NONE_HASH, tuple(tokens), extra_keys or None)))`` with canonical CBOR;
events are msgspec structs (tagged, defaults omitted) batched in a ``KVEventBatch``.
"""

import hashlib
from typing import Any

import cbor2
import msgspec
import numpy as np
from absl.testing import absltest, parameterized

from jaxkv import blocks
from jaxkv.blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager
from jaxkv.blocks._hashing import MultiModalInput, RequestBlockHasher, hash_block_tokens, none_hash
from jaxkv.blocks._pool import BlockPool

# ----------------------------------------------------------------------------- the spec


def _vllm_none_hash(seed: str) -> bytes:
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def _vllm_block_hash(parent, tokens, extra_keys, seed="0"):
    if not parent:
        parent = _vllm_none_hash(seed)
    message = (parent, tuple(int(t) for t in tokens), extra_keys)
    return hashlib.sha256(cbor2.dumps(message, canonical=True)).digest()


def _vllm_chain(tokens, block_size, extra_keys_per_block=None, seed="0"):
    parent = None
    out = []
    for index in range(len(tokens) // block_size):
        extra = extra_keys_per_block[index] if extra_keys_per_block else None
        parent = _vllm_block_hash(parent, tokens[index * block_size : (index + 1) * block_size],
                                  extra, seed)
        out.append(parent)
    return out


# vLLM's event definitions (vllm/distributed/kv_events.py), written out for the test.
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredWire(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemovedWire(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedWire(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    events: list[BlockStoredWire | BlockRemovedWire | AllBlocksClearedWire]


class Sha256CborTest(parameterized.TestCase):

    @parameterized.parameters("0", "123", "", "a seed")
    def test_none_hash_is_vllms(self, seed):
        self.assertEqual(none_hash("sha256_cbor", seed), _vllm_none_hash(seed))

    def test_default_seed_is_vllm_pythonhashseed_zero(self):
        self.assertEqual(none_hash("sha256_cbor"), _vllm_none_hash("0"))

    def test_canonical_cbor_bytes_by_hand(self):
        # (parent, (0, 1, 24, 1000, -3), None): array(3), bytes(32), array(5) of shortest ints.
        parent = bytes(range(32))
        message = (b"\x83\x58\x20" + parent + b"\x85\x00\x01\x18\x18\x19\x03\xe8\x22" + b"\xf6")
        self.assertEqual(hash_block_tokens(parent, [0, 1, 24, 1000, -3], None,
                                                  "sha256_cbor"),
                         hashlib.sha256(message).digest())
        seed_cbor = b"\x63abc"  # text(3) "abc"
        self.assertEqual(none_hash("sha256_cbor", "abc"),
                         hashlib.sha256(seed_cbor).digest())

    @parameterized.parameters("0", "42")
    def test_chain_with_extra_keys(self, seed):
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 150_000, 70).tolist()
        mm = [MultiModalInput("img-a", 3, 20), MultiModalInput("img-b", 40, 5)]
        hashes = blocks.hash_request_tokens(tokens, 16, "sha256_cbor", lora_id="my-lora",
                                            mm_inputs=mm, cache_salt="salt", seed=seed)
        extra = [
            ("my-lora", ("img-a", 3), "salt"),
            ("my-lora", ("img-a", -13)),
            ("my-lora", ("img-b", 8)),
            ("my-lora",),
        ]
        self.assertEqual(hashes, _vllm_chain(tokens, 16, extra, seed))
        plain = blocks.hash_request_tokens(np.asarray(tokens), 16, "sha256_cbor", seed=seed)
        self.assertEqual(plain, _vllm_chain(tokens, 16, None, seed))
        self.assertNotEqual(plain, blocks.hash_request_tokens(tokens, 16, "sha256", seed=seed))

    def test_incremental_hasher_matches(self):
        tokens = list(range(1000, 1050))
        hasher = RequestBlockHasher(8, "sha256_cbor", seed="7")
        for token in tokens:
            hasher.extend([token])
        self.assertEqual(hasher.block_hashes, _vllm_chain(tokens, 8, None, "7"))

    def test_manager_hashes_and_events(self):
        manager = KVCacheManager(16, 4, hash_fn="sha256_cbor", hash_seed="9", enable_events=True)
        tokens = list(range(11))
        manager.add_request("r", tokens, cache_salt="s")
        manager.allocate_slots("r", 11, manager.get_computed_blocks("r"))
        expected = _vllm_chain(tokens, 4, [("s",), None], "9")
        self.assertEqual(list(manager.get_block_hashes("r")), expected)
        (stored,) = manager.take_events()
        self.assertEqual(stored.block_hashes, tuple(expected))
        self.assertEqual(manager.hash_identity.split(":")[0], "sha256_cbor")

    def test_unencodable_extra_key(self):
        with self.assertRaises(TypeError):
            hash_block_tokens(None, [1], (object(),), "sha256_cbor")


class RemovalEventsTest(parameterized.TestCase):

    @parameterized.parameters(1, 3, 8)
    def test_n_cached_blocks_freed_and_reallocated_give_n_plus_1_events(self, n):
        manager = KVCacheManager(n + 1, 4, enable_events=True)
        manager.add_request("a", list(range(4 * n)))
        manager.allocate_slots("a", 4 * n)
        hashes = manager.get_block_hashes("a")
        manager.free("a")
        pool = manager.pool
        pool.allocate(n)  # Every free block caches a hash: each allocation evicts one.
        events = manager.take_events()
        self.assertLen(events, n + 1)
        self.assertEqual(events[0].block_hashes, hashes)
        # The request freed its blocks tail first, so its last block is evicted first.
        self.assertEqual(events[1:], [BlockRemoved((h,), 0) for h in reversed(hashes)])

    def test_bulk_allocation_and_explicit_evict_emit_per_block(self):
        pool = BlockPool(40, enable_events=True)
        ids = pool.allocate(30)
        hashes = [bytes([i]) * 4 for i in range(30)]
        pool.cache_blocks(ids, hashes)
        pool.free(ids)  # Given order: first block evicted first.
        pool.take_events()
        pool.allocate(39)  # Array path: 9 fresh blocks, then the 30 cached ones.
        self.assertEqual(pool.take_events(), [BlockRemoved((h,), 0) for h in hashes])
        pool.free(list(range(1, 40)))
        ids = pool.allocate(3)
        pool.cache_blocks(ids, [b"x", b"y", b"z"], group=2)
        pool.take_events()
        self.assertEqual(pool.evict(ids[::-1]), 3)
        self.assertEqual(pool.take_events(), [BlockRemoved((b"z",), 2), BlockRemoved((b"y",), 2),
                                              BlockRemoved((b"x",), 2)])


class WireShapeTest(parameterized.TestCase):

    def _events(self):
        stored = BlockStored((b"h1", b"h2"), b"h0", (1, 2, 3, 4), 2, (("s",), None), 7, 0)
        named = BlockStored((b"h3",), None, (5, 6), 2, None, "lora-x", 1)
        return [stored, named, BlockRemoved((b"h1",), 0), AllBlocksCleared()]

    def test_decodes_with_vllms_schema(self):
        data = blocks.encode_vllm_event_batch(self._events(), ts=12.5, data_parallel_rank=3)
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(data)
        self.assertEqual(batch.ts, 12.5)
        self.assertEqual(batch.data_parallel_rank, 3)
        stored, named, removed, cleared = batch.events
        self.assertEqual(stored, BlockStoredWire([b"h1", b"h2"], b"h0", [1, 2, 3, 4], 2, 7, "GPU",
                                                 None, [("s",), None], 0))
        self.assertEqual(named, BlockStoredWire([b"h3"], None, [5, 6], 2, None, "GPU", "lora-x",
                                                None, 1))
        self.assertEqual(removed, BlockRemovedWire([b"h1"], "GPU", 0))
        self.assertIsInstance(cleared, AllBlocksClearedWire)

    def test_same_bytes_as_vllms_structs(self):
        """Field names, order, tags and omitted defaults match: the encodings are identical."""
        vllm = KVEventBatch(12.5, [
            BlockStoredWire([b"h1", b"h2"], b"h0", [1, 2, 3, 4], 2, 7, "GPU", None,
                            [("s",), None], 0),
            BlockStoredWire([b"h3"], None, [5, 6], 2, None, "GPU", "lora-x", None, 1),
            BlockRemovedWire([b"h1"], "GPU", 0),
            AllBlocksClearedWire(),
        ])
        self.assertEqual(blocks.encode_vllm_event_batch(self._events(), ts=12.5),
                         msgspec.msgpack.encode(vllm))

    def test_int_hashes_and_medium(self):
        digest = hashlib.sha256(b"x").digest()
        data = blocks.encode_vllm_event_batch([BlockRemoved((digest,), 0)], ts=0.0, medium="CPU",
                                              int_block_hashes=True)
        (removed,) = msgspec.msgpack.Decoder(KVEventBatch).decode(data).events
        self.assertEqual(removed.block_hashes, [int.from_bytes(digest, "big") & (2**64 - 1)])
        self.assertEqual(removed.medium, "CPU")

    def test_round_trip_and_live_manager(self):
        manager = KVCacheManager(3, 4, hash_fn="sha256_cbor", enable_events=True)
        manager.add_request("a", list(range(8)))
        manager.allocate_slots("a", 8)
        manager.free("a")
        manager.add_request("b", [9] * 8)
        manager.allocate_slots("b", 8)
        data = blocks.encode_vllm_event_batch(manager.take_events())
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(data)
        self.assertEqual([type(e).__name__ for e in batch.events],
                         ["BlockStoredWire", "BlockRemovedWire", "BlockRemovedWire",
                          "BlockStoredWire"])
        self.assertEqual(batch.events[0].block_hashes, _vllm_chain(list(range(8)), 4))
        self.assertEqual(blocks.decode_vllm_event_batch(data).events[3].token_ids, [9] * 8)

    def test_bad_input(self):
        with self.assertRaises(TypeError):
            blocks.encode_vllm_event_batch(["not an event"])
        with self.assertRaises(msgspec.DecodeError):
            blocks.decode_vllm_event_batch(b"\xc1")


if __name__ == "__main__":
    absltest.main()
