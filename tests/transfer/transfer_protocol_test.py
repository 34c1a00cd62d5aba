"""The transfer state machines: one table of legal transitions, everything else refused."""

import dataclasses
import itertools

from absl.testing import absltest

from jaxkv.transfer._protocol import (
    TERMINAL,
    TRANSITIONS,
    ProtocolError,
    ReadState,
    RequestState,
    is_legal,
    transition,
)

_EXPECTED = {
    (RequestState.PINNED, RequestState.READING),
    (RequestState.PINNED, RequestState.DONE),
    (RequestState.PINNED, RequestState.ABORTED),
    (RequestState.PINNED, RequestState.EXPIRED),
    (RequestState.READING, RequestState.DONE),
    (RequestState.READING, RequestState.ABORTED),
    (RequestState.READING, RequestState.EXPIRED),
    (ReadState.PLANNING, ReadState.WAITING_READY),
    (ReadState.PLANNING, ReadState.TRANSFERRING),
    (ReadState.PLANNING, ReadState.FAILED),
    (ReadState.WAITING_READY, ReadState.TRANSFERRING),
    (ReadState.WAITING_READY, ReadState.LANDED),
    (ReadState.WAITING_READY, ReadState.FAILED),
    (ReadState.TRANSFERRING, ReadState.LANDED),
    (ReadState.TRANSFERRING, ReadState.FAILED),
    (ReadState.LANDED, ReadState.CONFIRMED),
    (ReadState.LANDED, ReadState.FAILED),
}
_ALL = list(RequestState) + list(ReadState)


@dataclasses.dataclass
class _Record:
    state: object
    key: str = "req-1"


class ProtocolTest(absltest.TestCase):
    def test_table_is_exactly_the_documented_one(self):
        listed = {(a, b) for a, nxt in TRANSITIONS.items() for b in nxt}
        self.assertEqual(listed, _EXPECTED)
        self.assertEqual(set(TRANSITIONS), set(_ALL))  # every state has a row
        self.assertEqual(
            TERMINAL,
            {RequestState.DONE, RequestState.ABORTED, RequestState.EXPIRED,
             ReadState.CONFIRMED, ReadState.FAILED},
        )

    def test_every_pair_is_accepted_or_refused_per_the_table(self):
        for old, new in itertools.product(_ALL, _ALL):
            record = _Record(old)
            if (old, new) in _EXPECTED:
                self.assertIs(transition(record, new), record)
                self.assertIs(record.state, new)
                self.assertTrue(is_legal(old, new))
            else:
                self.assertFalse(is_legal(old, new), (old, new))
                with self.assertRaises(ProtocolError) as caught:
                    transition(record, new)
                self.assertIs(record.state, old)  # unchanged
                message = str(caught.exception)
                self.assertIn("'req-1'", message)
                self.assertIn(f"{old.value} -> {new.value}", message)

    def test_every_state_reaches_a_terminal_one(self):
        for start in _ALL:
            seen, frontier = {start}, [start]
            while frontier:
                for nxt in TRANSITIONS[frontier.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        frontier.append(nxt)
            self.assertTrue(seen & TERMINAL, start)

    def test_failure_is_reachable_from_every_live_read_state(self):
        for state in ReadState:
            if state not in TERMINAL:
                self.assertTrue(is_legal(state, ReadState.FAILED), state)


if __name__ == "__main__":
    absltest.main()
