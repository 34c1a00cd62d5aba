"""Block hashing: chained hashes, canonical serialisation, extra keys, per-request hasher."""

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
from absl.testing import absltest, parameterized

from jaxkv import blocks
from jaxkv.blocks import hash_request_tokens
from jaxkv.blocks._errors import PartialBlockError
from jaxkv.blocks._hashing import (
    NONE_HASH,
    HashFunction,
    MultiModalInput,
    RequestBlockHasher,
    block_extra_keys,
    encode_key,
    hash_block_tokens,
    none_hash,
    random_hash_seed,
    sha256,
    xxhash128,
)

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HASH_FNS = (("sha256", sha256), ("xxhash", xxhash128))


def _reference_hash(parent, tokens, extra, digest):
    """The documented serialisation, written out independently."""
    data = parent + struct.pack(f"<{len(tokens)}q", *tokens)
    if extra:
        encoded = encode_key(tuple(extra))
        data += encoded + bytes(-len(encoded) % 8) + struct.pack("<I", len(encoded))
    return digest(data)


class HashBlockTokensTest(parameterized.TestCase):

    @parameterized.named_parameters(*_HASH_FNS)
    def test_matches_documented_serialisation(self, hash_fn):
        parent = none_hash(hash_fn)
        got = hash_block_tokens(None, [1, 2, 3, 4], hash_fn=hash_fn)
        self.assertEqual(got, _reference_hash(parent, [1, 2, 3, 4], None, hash_fn))
        self.assertLen(got, hash_fn.digest_size)
        chained = hash_block_tokens(got, [5, 6, 7, 8], ("salt",), hash_fn)
        self.assertEqual(chained, _reference_hash(got, [5, 6, 7, 8], ("salt",), hash_fn))

    def test_sha256_is_plain_sha256(self):
        data = none_hash() + struct.pack("<2q", 7, 8)
        self.assertEqual(hash_block_tokens(None, [7, 8]), hashlib.sha256(data).digest())

    def test_deterministic_and_sensitive(self):
        base = hash_block_tokens(None, [1, 2, 3])
        self.assertEqual(base, hash_block_tokens(None, (1, 2, 3)))
        self.assertEqual(base, hash_block_tokens(None, np.array([1, 2, 3], np.int32)))
        self.assertEqual(base, hash_block_tokens(None, range(1, 4)))
        variants = {
            hash_block_tokens(None, [1, 2, 4]),
            hash_block_tokens(None, [1, 2, 3], (0,)),
            hash_block_tokens(base, [1, 2, 3]),
            hash_block_tokens(None, [1, 2, 3], hash_fn="xxh3_128"),
            hash_block_tokens(None, [1, 2]),
        }
        self.assertNotIn(base, variants)
        self.assertLen(variants, 5)

    def test_empty_extra_keys_equal_none(self):
        self.assertEqual(hash_block_tokens(None, [1], ()), hash_block_tokens(None, [1], None))

    def test_token_length_is_not_ambiguous_with_extra_keys(self):
        # Without the length header, tokens [1] + extra keys could alias other tokens.
        self.assertNotEqual(hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [1], (2,)))

    def test_partial_block_raises(self):
        with self.assertRaisesRegex(PartialBlockError, "holds 16 tokens, got 5"):
            hash_block_tokens(None, list(range(5)), block_size=16)
        with self.assertRaises(PartialBlockError):
            hash_block_tokens(None, [])

    def test_bad_inputs_raise(self):
        with self.assertRaisesRegex(ValueError, "32 bytes"):
            hash_block_tokens(b"short", [1])
        with self.assertRaises(TypeError):
            hash_block_tokens(None, [1.5])
        with self.assertRaises(TypeError):
            hash_block_tokens(None, "abc")
        with self.assertRaises(ValueError):
            hash_block_tokens(None, [2**63])
        with self.assertRaises(TypeError):
            hash_block_tokens(None, np.array([1.0]))
        with self.assertRaises(TypeError):
            hash_block_tokens(None, [1], (object(),))
        with self.assertRaises(ValueError):
            hash_block_tokens(None, [1], hash_fn="md17")

    def test_large_uint64_tokens(self):
        self.assertLen(hash_block_tokens(None, np.array([2**63 - 1], np.uint64)), 32)
        with self.assertRaises(ValueError):
            hash_block_tokens(None, np.array([2**63], np.uint64))

    def test_custom_hash_function(self):
        md5 = HashFunction("md5", 16, lambda data: hashlib.md5(data).digest())
        hashes = hash_request_tokens(list(range(8)), 4, md5)
        self.assertLen(hashes, 2)
        self.assertTrue(all(len(h) == 16 for h in hashes))
        with self.assertRaises(ValueError):
            HashFunction("bad", 0, lambda data: data)


class EncodeKeyTest(parameterized.TestCase):

    def test_distinct_values_distinct_bytes(self):
        values = [None, True, False, 0, 1, -1, 255, 256, 2**70, "", "a", "1", b"a", 1.0,
                  (), ("a",), ("a", 1), (("a", 1),), ("a", (1,)), [None]]
        encoded = [encode_key(v) for v in values[:-1]]
        self.assertLen(set(encoded), len(encoded))
        self.assertEqual(encode_key([None]), encode_key((None,)))
        self.assertEqual(encode_key(np.int64(5)), encode_key(5))

    def test_unsupported_type(self):
        with self.assertRaises(TypeError):
            encode_key({"a": 1})


class NoneHashTest(parameterized.TestCase):

    def _child(self, code, env_seed=None):
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if env_seed is not None:
            env["PYTHONHASHSEED"] = env_seed
        env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
        return subprocess.run([sys.executable, "-c", code], env=env, check=True,
                              capture_output=True, text=True).stdout.split()

    _HASHES = (
        "import jaxkv.blocks as b\n"
        "m = b.KVCacheManager(16, 4)\n"
        "m.add_request('r', list(range(10)), cache_salt='s')\n"
        "print(b.NONE_HASH.hex(), b.none_hash('xxhash').hex(), m.hash_identity,\n"
        "      *[h.hex() for h in m.get_block_hashes('r')],\n"
        "      *[h.hex() for h in b.hash_request_tokens(range(9), 3, 'xxh3_128', seed='x')])"
    )

    def test_two_processes_agree_without_environment(self):
        # No PYTHONHASHSEED: the default seed is deterministic.
        first = self._child(self._HASHES)
        second = self._child(self._HASHES)
        self.assertEqual(first, second)
        self.assertLen(first, 3 + 2 + 3)
        self.assertLen(bytes.fromhex(first[0]), 32)
        self.assertLen(bytes.fromhex(first[1]), 16)
        # ... and the same values in this process.
        manager = blocks.KVCacheManager(16, 4)
        manager.add_request("r", list(range(10)), cache_salt="s")
        self.assertEqual(first[3:5], [h.hex() for h in manager.get_block_hashes("r")])
        self.assertEqual(first[0], NONE_HASH.hex())

    def test_environment_plays_no_part(self):
        self.assertEqual(self._child(self._HASHES, env_seed="123"),
                         self._child(self._HASHES, env_seed="124"))

    def test_default_seed_is_documented_value(self):
        expected = hashlib.sha256(b"jaxkv.blocks.NONE_HASH\x00" + b"0").digest()
        self.assertEqual(blocks.DEFAULT_HASH_SEED, "0")
        self.assertEqual(none_hash(), expected)
        self.assertEqual(NONE_HASH, expected)

    def test_seed_changes_every_hash(self):
        self.assertNotEqual(none_hash(seed="a"), none_hash(seed="b"))
        a = hash_request_tokens(range(8), 4, seed="a")
        b = hash_request_tokens(range(8), 4, seed="b")
        self.assertTrue(all(x != y for x, y in zip(a, b)))
        self.assertEqual(a[0], hash_block_tokens(None, range(4), seed="a"))
        hasher = RequestBlockHasher(4, seed="a")
        hasher.extend(range(8))
        self.assertEqual(hasher.block_hashes, a)

    def test_random_only_when_asked(self):
        seeds = {random_hash_seed() for _ in range(4)}
        self.assertLen(seeds, 4)
        one = blocks.KVCacheManager(8, 2, hash_seed="random")
        two = blocks.KVCacheManager(8, 2, hash_seed="random")
        self.assertNotEqual(one.hash_seed, two.hash_seed)
        self.assertNotEqual(one.hash_identity, two.hash_identity)
        # A drawn seed, shared, makes a peer agree.
        peer = blocks.KVCacheManager(8, 2, hash_seed=one.hash_seed)
        self.assertEqual(peer.hash_identity, one.hash_identity)
        for manager in (one, peer):
            manager.add_request("r", [1, 2, 3])
        self.assertEqual(one.get_block_hashes("r"), peer.get_block_hashes("r"))
        self.assertEqual(blocks.KVCacheManager(8, 2).hash_seed, blocks.DEFAULT_HASH_SEED)

    def test_random_is_not_a_concrete_seed(self):
        with self.assertRaisesRegex(ValueError, "random_hash_seed"):
            none_hash(seed="random")
        with self.assertRaisesRegex(ValueError, "random_hash_seed"):
            hash_request_tokens([1, 2], 2, seed="random")
        with self.assertRaises(TypeError):
            none_hash(seed=b"0")
        with self.assertRaises(TypeError):
            blocks.KVCacheManager(8, 2, hash_seed=0)

    def test_identity(self):
        identity = blocks.hash_identity("sha256", "0")
        self.assertRegex(identity, r"^sha256:seed=[0-9a-f]{16}$")
        self.assertEqual(identity, blocks.KVCacheManager(8, 2).hash_identity)
        self.assertNotEqual(identity, blocks.hash_identity("xxh3_128", "0"))
        self.assertNotEqual(identity, blocks.hash_identity("sha256", "1"))
        self.assertNotIn("secret", blocks.hash_identity("sha256", "secret"))
        self.assertEqual(blocks.hash_identity("xxhash", "0"), blocks.hash_identity("xxh3_128", "0"))


class ExtraKeysTest(parameterized.TestCase):
    """Cases modelled on vLLM's test_generate_block_hash_extra_keys."""

    MM = (MultiModalInput("hash1", 0, 5), MultiModalInput("hash2", 10, 5))

    @parameterized.parameters(
        (0, 5, (("hash1", 0),)),
        (3, 8, (("hash1", -3),)),
        (6, 10, None),
        (0, 15, (("hash1", 0), ("hash2", 10))),
        (5, 10, None),  # hash1 ends exactly where the block starts: no overlap.
        (14, 20, (("hash2", -4),)),
    )
    def test_multimodal(self, start, end, expected):
        self.assertEqual(block_extra_keys(start, end, mm_inputs=self.MM), expected)

    def test_order_lora_mm_salt(self):
        self.assertEqual(
            block_extra_keys(0, 4, lora_id=3, mm_inputs=[("img", 2, 9)], cache_salt="s"),
            (3, ("img", 2), "s"),
        )
        self.assertEqual(block_extra_keys(4, 8, lora_id=3, cache_salt="s"), (3,))
        self.assertIsNone(block_extra_keys(0, 4, cache_salt=""))

    def test_invalid(self):
        with self.assertRaises(ValueError):
            block_extra_keys(4, 4)
        with self.assertRaisesRegex(ValueError, "overlap"):
            block_extra_keys(0, 4, mm_inputs=[("a", 0, 5), ("b", 4, 2)])
        with self.assertRaises(ValueError):
            block_extra_keys(0, 4, mm_inputs=[("a", 0, 0)])
        with self.assertRaises(TypeError):
            block_extra_keys(0, 4, lora_id=1.5)
        with self.assertRaises(TypeError):
            block_extra_keys(0, 4, cache_salt=5)


class RequestBlockHasherTest(parameterized.TestCase):

    @parameterized.product(
        hash_fn=("sha256", "xxh3_128"),
        split=(0, 1, 3, 4, 5, 17),
        as_numpy=(False, True),
    )
    def test_incremental_equals_one_shot(self, hash_fn, split, as_numpy):
        tokens = list(range(100, 123))
        expected = []
        parent = None
        for start in range(0, 20, 4):
            parent = hash_block_tokens(parent, tokens[start : start + 4], hash_fn=hash_fn)
            expected.append(parent)
        hasher = RequestBlockHasher(4, hash_fn)
        first, rest = tokens[:split], tokens[split:]
        if as_numpy:
            first, rest = np.array(first, np.int64), np.array(rest, np.int32)
        new = hasher.extend(first)
        for token in rest[:3]:
            new += hasher.extend([int(token)])
        new += hasher.extend(rest[3:])
        self.assertEqual(new, expected)
        self.assertEqual(hasher.block_hashes, expected)
        self.assertEqual(hasher.num_tokens, 23)

    def test_extra_keys_per_block(self):
        mm = [MultiModalInput("img", 3, 6)]
        hasher = RequestBlockHasher(4, lora_id=9, mm_inputs=mm, cache_salt="salt")
        tokens = list(range(12))
        hasher.extend(tokens[:5])
        hasher.extend(tokens[5:])
        expected_keys = [(9, ("img", 3), "salt"), (9, ("img", -1)), (9, ("img", -5))]
        self.assertEqual([hasher.extra_keys(i) for i in range(3)], expected_keys)
        parent = None
        for i, keys in enumerate(expected_keys):
            parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4], keys)
            self.assertEqual(hasher.block_hashes[i], parent)
        with self.assertRaises(IndexError):
            hasher.extra_keys(3)

    def test_salt_changes_every_block(self):
        tokens = list(range(12))
        plain = hash_request_tokens(tokens, 4)
        salted = hash_request_tokens(tokens, 4, cache_salt="a")
        self.assertTrue(all(p != s for p, s in zip(plain, salted)))
        self.assertEqual(salted, hash_request_tokens(tokens, 4, cache_salt="a"))
        self.assertNotEqual(salted[2], hash_request_tokens(tokens, 4, cache_salt="b")[2])

    def test_invalid_tokens_leave_state_unchanged(self):
        hasher = RequestBlockHasher(4)
        hasher.extend([1, 2])
        for bad in ([3, "x"], [3, 4, 5, 2.5], [2**64]):
            with self.assertRaises((TypeError, ValueError)):
                hasher.extend(bad)
            self.assertEqual(hasher.num_tokens, 2)
            self.assertEqual(hasher.block_hashes, [])
        hasher.extend([3, 4])
        self.assertEqual(hasher.block_hashes, [hash_block_tokens(None, [1, 2, 3, 4])])

    def test_invalid_construction(self):
        with self.assertRaises(ValueError):
            RequestBlockHasher(0)
        with self.assertRaises(TypeError):
            RequestBlockHasher(4.0)
        with self.assertRaises(TypeError):
            RequestBlockHasher(4, lora_id=True)

    def test_ignores_partial_tail(self):
        self.assertLen(hash_request_tokens(list(range(15)), 4), 3)
        self.assertEqual(hash_request_tokens([1, 2, 3], 4), [])


if __name__ == "__main__":
    absltest.main()
