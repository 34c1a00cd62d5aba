"""The producer role against a fake transport and control channel: which transport hooks it
calls, in which order, and the request states it moves through (no NIXL, no processes)."""

from absl.testing import absltest

from jaxkv import EngineConfig, KVCacheSpec
from jaxkv.transfer._messages import Ack, Done, Hello, Want, decode_message, encode_message
from jaxkv.transfer._params import PollResult
from jaxkv.transfer._producer import Producer
from jaxkv.transfer._protocol import RequestState
from jaxkv.transfer._registry import CacheRegistry
from jaxkv.transfer._stats import TransferStats


class _Transport:
    name, endpoint = "fake", "prefill/1/1"
    attaches_notifications, announces_reads = False, True
    takes_layer_rows, layer_group_bytes, format_server = False, 0, None

    def __init__(self):
        self.calls = []

    def offer(self, offer):
        self.calls.append(("offer", offer.request_id, offer.layer_stop, offer.consumer,
                           offer.want))

    def withdraw(self, request_id, confirmed=False):
        self.calls.append(("withdraw", request_id))


class _Channel:
    name = "fake"

    def __init__(self):
        self.sent = []

    def accept(self, agent, sender, payload):
        return f"to:{sender}"

    def send(self, target, payload):
        self.sent.append((target, decode_message(payload)))
        return True

    def forget(self, target):
        pass


class ProducerRoleTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)
        self.transport, self.channel = _Transport(), _Channel()
        registry = CacheRegistry("prefill", EngineConfig(spec, 1), self.transport, None,
                                 None, None, generation=7)
        registry.ranks = {0: None}  # one local producer rank (no cache needed here)
        self.producer = Producer("prefill", registry, self.transport,
                                 {"fake": self.channel}, TransferStats(), 30.0, 0.0)

    def test_offer_want_done_ack_withdraw(self):
        p = self.producer
        params = p.publish("r1", [3, 4], None, False, 1, ("127.0.0.1", 5))
        self.assertEqual((params.block_ids, params.generation), ([3, 4], 7))
        self.assertEqual(self.transport.calls, [("offer", "r1", 2, None, None)])
        self.assertIs(p.pinned["r1"].state, RequestState.PINNED)
        p.on_hello(Hello("decode", 1, "decode/9/1", b""), "fake", "conn-1")
        want = Want("r1", "decode/9/1", "read-a", 2, ["127.0.0.1", 6])
        want = decode_message(encode_message(want))  # as it arrives
        p.on_want(want, 0.0)
        self.assertEqual(self.transport.calls[-1], ("offer", "r1", 2, "decode/9/1", want))
        # Ready goes to the subscriber (layers already written)
        self.assertEqual(self.channel.sent[-1][0], "to:conn-1")
        p.on_done(Done("r1", "decode", "decode/9/1", 0, 0, 1, True, 5, 7, "read-a"))
        target, ack = self.channel.sent[-1]
        self.assertEqual(target, "to:conn-1")
        self.assertEqual(ack, Ack("r1", 0, 0, True, 5, False, False))
        self.assertIs(p.pinned["r1"].state, RequestState.READING)
        result = PollResult()
        p.poll(0.0, result)
        self.assertEqual(result.freeable, ["r1"])
        self.assertEqual(self.transport.calls[-1], ("withdraw", "r1"))
        self.assertTrue(p.released["r1"])

    def test_stale_done_is_refused_and_abort_withdraws(self):
        p = self.producer
        p.publish("r2", [1], None, False, 1, ("127.0.0.1", 5))
        p.on_hello(Hello("decode", 1, "decode/9/1", b""), "fake", "conn-1")
        p.on_done(Done("r2", "decode", "decode/9/1", 0, 0, 1, True, 5, 6))  # generation 6
        self.assertEqual(self.channel.sent[-1][1].stale, True)
        self.assertEqual(self.channel.sent[-1][1].pinned, False)
        self.assertIs(p.pinned["r2"].state, RequestState.PINNED)
        p.abort("r2")
        result = PollResult()
        p.poll(0.0, result)
        self.assertEqual((result.freeable, p.released["r2"]), (["r2"], False))
        self.assertEqual(self.transport.calls[-1], ("withdraw", "r2"))


class WantMessageTest(absltest.TestCase):
    def test_defaults_and_bounds(self):
        plain = decode_message(encode_message(Want("r", "a")))
        self.assertEqual((plain.read_id, plain.num_blocks, plain.address), ("", -1, []))
        with self.assertRaises(ValueError):
            decode_message(encode_message(Want("r", "a", "x", 1, ["h", 1, 2])))
        with self.assertRaises(ValueError):
            decode_message(encode_message(Want("r", "a", "x", -2)))


if __name__ == "__main__":
    absltest.main()
