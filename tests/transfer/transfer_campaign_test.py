"""A short seed budget of the randomized lifecycle campaign (`campaign_testing`, issue 35):
real producer processes (TP 2, a block manager freeing what the engine reports freeable) and a
consumer engine here (TP 1, its own block manager), over NIXL and ``transport="jax"``, through
random lifecycles: reads, double reads of one request, consumer aborts before/during/after the
read, producer aborts before/during it, lease expiry, pool pressure (allocation until the pool
is full, evicting cached blocks), a producer SIGKILLed mid-transfer and restarted, and a
producer SIGSTOPped past a read's deadline (then resumed). Each seed's run draws every event
at least once.

Every read must end finished with bit-exact blocks or failed with exactly its blocks invalid;
after quiescence nothing may stay pinned and both pools must be whole. The long mode is
``python benchmarks/campaign.py``; a failing seed reproduces with ``--seed``.

Not generated yet (issue 35 items left): duplicate/late messages, re-registration mid-flight,
heartbeat loss alone, layer-wise requests, consumer process kills.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "tcp,sm,self")

from support import platforms

platforms.force_cpu_devices()

import pytest  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from support import campaign as ct  # noqa: E402

from jaxkv.transfer import nixl_available  # noqa: E402
from jaxkv.transfer._jax_transport import jax_transfer_available  # noqa: E402

SEEDS = (0, 1)
LIFECYCLES = 30
WALL_BOUND_S = 240.0  # every wait has a deadline: a hang shows as a violation, not a stall


class CampaignTest(parameterized.TestCase):
    @parameterized.named_parameters(("nixl", "nixl"), ("jax", "jax"))
    def test_short_campaign_keeps_every_invariant(self, transport):
        if transport == "nixl" and not nixl_available():
            pytest.skip("NIXL (nixl-cu13) is not installed")
        if transport == "jax" and not jax_transfer_available():
            pytest.skip("no jax.experimental.transfer")
        campaign = ct.Campaign(transport, read_timeout_s=5.0 if transport == "nixl" else 10.0,
                               max_kills=1, sample_every=5)
        self.addCleanup(campaign.close)
        for seed in SEEDS:
            before = len(campaign.violations)
            campaign.run(seed, LIFECYCLES)
            self.assertEqual(campaign.violations[before:], [],
                             f"seed {seed} ({transport}): invariants violated")
        report = campaign.report()
        counters = campaign.counters
        self.assertEqual(report["lifecycles"], len(SEEDS) * LIFECYCLES)
        self.assertGreater(counters.finished, LIFECYCLES)  # the campaign read something
        self.assertEqual((counters.kills, counters.stops), (2, 2))  # each seed: every event
        self.assertLess(report["wall_s"], WALL_BOUND_S)
        # flat resources, generously: no thread or descriptor per lifecycle
        first, last = campaign.consumer_samples[0][1], campaign.consumer_samples[-1][1]
        self.assertLessEqual(last[1] - first[1], 4, "consumer threads grew")
        self.assertLessEqual(last[2] - first[2], 16, "consumer file descriptors grew")
        producer = [s[2] for s in campaign.producer_samples if s[1] == campaign.incarnation]
        self.assertLessEqual(producer[-1][1] - producer[0][1], 4, "producer threads grew")
        self.assertLessEqual(producer[-1][2] - producer[0][2], 16, "producer fds grew")

    @parameterized.named_parameters(("nixl", "nixl"), ("jax", "jax"))
    def test_campaign_with_digests_catches_every_corruption(self, transport):
        # full digests on both engines; the "corrupt" event flips a byte of a request's first
        # block in the producer's registered memory after publication: every such read must
        # fail naming the digest with exactly that block invalid, every other invariant holds
        if transport == "nixl" and not nixl_available():
            pytest.skip("NIXL (nixl-cu13) is not installed")
        if transport == "jax" and not jax_transfer_available():
            pytest.skip("no jax.experimental.transfer")
        campaign = ct.Campaign(transport, read_timeout_s=5.0 if transport == "nixl" else 10.0,
                               max_kills=1, sample_every=5, digests="full")
        self.addCleanup(campaign.close)
        campaign.run(2, LIFECYCLES)
        self.assertEqual(campaign.violations, [])
        counters = campaign.counters
        self.assertGreaterEqual(counters.events.get("corrupt", 0), 1)  # every event once
        self.assertEqual(counters.corruptions_caught, counters.events["corrupt"])
        self.assertGreater(counters.finished, LIFECYCLES // 3)




@pytest.mark.skipif(not jax_transfer_available(), reason="no jax.experimental.transfer")
class JaxAbortedBeforeReleaseTest(absltest.TestCase):
    """Found by the campaign (``transport="jax"``, e.g. ``--seed=5`` with 30 lifecycles: reads
    of requests aborted on the producer before the read failed only at ``read_timeout_s``).
    A producer abort only marks the request; its next poll releases it. A subscription that
    arrived in between was taken as a normal one and then dropped by the release, unanswered,
    so the consumer's pulls waited for their timeout."""

    def test_read_of_a_request_aborted_but_not_yet_released_fails_at_once(self):
        # no background progress: the subscription and the release meet in one poll
        campaign = ct.Campaign("jax", read_timeout_s=120.0,  # far beyond the wait below
                               producer_kwargs=dict(progress_interval_s=None))
        self.addCleanup(campaign.close)
        number, params = campaign.publish(2, ct.LONG_LEASE_S)
        self.assertTrue(campaign.producer.call("abort_stall", f"p{number}", 1.0))
        campaign.start_read(number, params, 2, "fail")
        campaign.pump(0, timeout_s=30.0)
        self.assertEqual(campaign.violations, [])
        self.assertEqual(campaign.counters.failed, {"freed_before_read": 1})


if __name__ == "__main__":
    absltest.main()
