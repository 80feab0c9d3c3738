"""The round-closing rule (coordinator/field/closing.py) as a pure function: every branch with hand-made
states and times, no broker, no clock. Then the per-client bookkeeping the round loop feeds it
(collection.py `RoundState.note`, O(1) a message) and when it wakes the loop."""

import math
from dataclasses import replace

import pytest

from coordinator.field.closing import Decision, RoundView, Upload, close, extends, final_reasons, keeps_open
from coordinator.field.collection import RoundState
from edge_client.trainer import TrainTask

D, E, T = 100.0, 60.0, 10.0   # deadline, --upload-extension, --heartbeat-timeout


def view(**kw) -> RoundView:
    return RoundView(**({"open": 3, "deadline": D, "hard_end": D + E, "timeout_s": T} | kw))


def up(c=0, chunks=10, got=5, first_at=90.0, last_at=94.0, **kw) -> Upload:
    return Upload(c, chunks, got, first_at, last_at, **kw)   # 5 of 10 chunks, one a second


# --- 1, 2: suspended ---

def test_an_outage_suspends_the_round_whatever_else_holds():
    for v in (view(outage=True), view(outage=True, open=0), view(outage=True, empty=True)):
        for now in (0.0, D + 1, D + E + 1):          # even past the deadline and its extension
            d = close(v, now)
            assert d == Decision(False, "outage") and d.suspended and d.wake_at == math.inf


def test_nobody_there_suspends_the_round_but_an_outage_comes_first():
    assert close(view(empty=True), 5.0) == Decision(False, "empty")
    assert close(view(empty=True, open=0), D + 1).suspended
    assert close(view(empty=True, outage=True), 5.0).why == "outage"


# --- 3: collected ---

def test_a_round_closes_once_every_selected_client_is_resolved_or_gone():
    assert close(view(open=0), 5.0) == Decision(True, "collected")
    assert close(view(open=0), D + 30.0) == Decision(True, "collected")   # past the deadline too
    assert close(view(open=1), 5.0).closed is False


def test_a_loss_just_before_the_end_holds_the_round_for_the_settling_time_before_the_deadline_only():
    d = close(view(open=0, settle_until=5.5), 5.2)
    assert d == Decision(False, "settling", 5.5)             # a broker going down may send last wills first
    assert close(view(open=0, settle_until=5.5), 5.5) == Decision(True, "collected")
    assert close(view(open=0, settle_until=D + 0.4), D - 0.1) == Decision(False, "settling", D)
    assert close(view(open=0, settle_until=D + 0.4), D).why == "deadline"   # past D settling holds nothing


# --- 4: the deadline and its extension ---

def test_at_the_deadline_without_an_upload_in_progress_the_round_closes():
    assert close(view(), D) == Decision(True, "deadline")
    assert close(view(uploads=()), D + 50.0).why == "deadline"


def test_an_upload_that_keeps_arriving_fast_enough_extends_the_round_until_it_would_stall():
    p = up(last_at=D - 0.5)       # 5 of 10 in 4 s of chunks, 1 chunk/s: the rest by D + 4.5 <= D + E
    d = close(view(uploads=(p,)), D)
    assert d.why == "extended" and not d.closed and d.extended_for == (0,)
    assert d.wake_at == pytest.approx(D - 0.5 + T)          # stalled after max(T, 3 intervals) of silence
    assert close(view(uploads=(p,)), D - 0.5 + T + 0.01) == Decision(True, "deadline")


def test_an_upload_that_cannot_finish_by_the_extension_or_has_stalled_does_not_extend():
    slow = up(chunks=1000, last_at=D - 0.5)                 # 995 chunks at 1/s: past D + E
    assert not keeps_open(slow, D, T, D + E) and close(view(uploads=(slow,)), D).why == "deadline"
    stalled = up(last_at=D - T - 1)                         # nothing for longer than T
    assert close(view(uploads=(stalled,)), D).why == "deadline"
    done = up(got=10, done=True, last_at=D - 1)             # all chunks in but not accepted (rejected)
    assert not extends(done, D, T, D + E)


def test_a_single_chunk_extends_within_the_timeout_and_the_slack_follows_a_slow_rate():
    one = up(got=1, first_at=D - 1, last_at=D - 1)          # rate unknown: the timeout alone bounds it
    assert one.chunk_rate() is None and extends(one, D, T, D + E) and not extends(one, D - 1 + T + 0.1, T, D + E)
    slow = up(chunks=10, got=3, first_at=D - 40, last_at=D - 20)   # 1 chunk / 10 s: stalled after 30 s, not T
    assert slow.stalled_after(T) == pytest.approx(30.0)
    d = close(view(uploads=(slow,)), D + 5)
    assert d.extended_for == (0,) and d.wake_at == pytest.approx(D + 10)  # (last + 30 s)


def test_an_upload_whose_first_chunks_came_in_a_burst_is_not_taken_for_stalled():
    """Seen with --deadline 4, --heartbeat-timeout 3 and a 6 kB/s uplink: the task out at 0, chunks 1 and 2 of 4
    in at 3.0 and 3.5 (from the device's buffers), then one every 5 s across the link. Their rate (2 chunks/s)
    made the upload stalled after max(T, 1.5 s) = 3 s of silence, so the round closed at 6.5 with 2 of 4 chunks
    in. Counted since the task went out (3 × 3.5 s / 2 chunks), the upload keeps the round open to its end."""
    d, e, t = 4.0, 60.0, 3.0
    v = view(open=1, deadline=d, hard_end=d + e, timeout_s=t)
    burst = dict(c=0, chunks=4, first_at=3.0)
    old = up(got=2, last_at=3.5, **burst)                                  # no task time: the rate alone
    assert old.stalled_after(t) == t and close(replace(v, uploads=(old,)), 6.6).closed   # the bug
    arrivals = [3.0, 3.5, 8.5, 13.5]
    for got in (2, 3):
        p = up(got=got, last_at=arrivals[got - 1], sent_at=0.0, **burst)
        assert p.mean_interval() == pytest.approx(arrivals[got - 1] / got)
        assert p.stalled_after(t) >= arrivals[got] - arrivals[got - 1]        # the next chunk is not late
        just_before = arrivals[got] - 0.01
        dec = close(replace(v, uploads=(p,)), just_before)
        assert not dec.closed and dec.extended_for == (0,) and dec.wake_at > just_before
    dead = up(got=2, last_at=3.5, sent_at=0.0, **burst)                    # nothing after chunk 2
    assert close(replace(v, uploads=(dead,)), 3.5 + 5.25 + 0.01).why == "deadline"
    assert up(got=1, first_at=90.0, last_at=90.0, sent_at=80.0).stalled_after(T) == pytest.approx(30.0)
    assert up(sent_at=None).mean_interval() is None


def test_a_complete_update_waits_for_its_stats_within_the_timeout_of_its_last_chunk():
    p = up(got=10, done=True, updated=True, last_at=D - 2)
    d = close(view(open=1, uploads=(p,)), D)
    assert d.extended_for == (0,) and d.wake_at == pytest.approx(D - 2 + T)
    assert close(view(open=1, uploads=(p,)), D - 2 + T + 0.01).why == "deadline"


def test_never_past_the_deadline_plus_the_extension():
    p = up(got=10, done=True, updated=True, last_at=D + E - 1)
    q = up(c=1, chunks=7, last_at=D + E - 0.5, first_at=D + E - 1.3)   # 5 chunks/s: done by D + E - 0.1
    assert close(view(uploads=(p, q)), D + E - 0.1).extended_for == (0, 1)
    assert close(view(uploads=(p, q)), D + E - 0.1).wake_at == pytest.approx(D + E)
    assert close(view(uploads=(p, q)), D + E) == Decision(True, "deadline")


def test_past_the_deadline_a_liveness_check_still_comes_first():
    p = up(last_at=D - 0.5)
    assert close(view(uploads=(p,), check_at=D + 1), D).wake_at == D + 1


# --- 5: open: when to look again ---

def test_an_open_round_wakes_at_the_earliest_of_the_deadline_a_liveness_check_and_settling():
    assert close(view(), 5.0) == Decision(False, "open", D)
    assert close(view(check_at=42.0), 5.0) == Decision(False, "open", 42.0)
    assert close(view(check_at=42.0, settle_until=5.3), 5.0) == Decision(False, "open", 5.3)
    assert close(view(settle_until=4.0), 5.0).wake_at == D       # settling over: not a time to wake for


def test_uploads_before_the_deadline_change_nothing():
    p = up(last_at=4.0)
    assert close(view(uploads=(p,)), 5.0) == close(view(), 5.0)


def test_final_reasons_keep_each_drop_and_name_the_rest_deadline():
    assert final_reasons([0, 1, 2, 3], updates=[0], dropped={1: "offline", 2: "battery"}) == \
        {1: "offline", 2: "battery", 3: "deadline"}
    assert final_reasons([0], updates=[0], dropped={}) == {}


# --- the bookkeeping the loop feeds it ---

def round_state(k: int = 4) -> RoundState:
    return RoundState(0, {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(k)}, 0.0)


def test_the_round_files_each_client_as_its_state_changes_and_says_when_the_decision_may_change():
    r = round_state(3)
    assert r.open == {0, 1, 2} and not r.offline
    r.updates[0] = object()
    assert r.note(0) is False and r.open == {0, 1, 2}        # stats still due: nothing to decide
    r.stats[0] = {}
    assert r.note(0) is False and r.open == {1, 2}           # resolved, others open: the decision stands
    r.dropped[1] = "battery"
    assert r.note(1) is False and r.open == {2}
    r.dropped[2] = "offline"
    assert r.note(2, now=7.0) is True and r.open == set()    # the last open client: the round may close
    assert r.offline == {2} and r.lost_at == 7.0


def test_a_loss_while_no_update_is_in_wakes_the_loop_and_a_rejoin_files_the_client_open_again():
    r = round_state(3)
    r.dropped[0] = "offline"
    assert r.note(0, now=3.0) is True and r.offline == {0} and r.lost_at == 3.0   # nobody there? look
    del r.dropped[0]
    assert r.note(0) is False and r.open == {0, 1, 2} and not r.offline


def test_a_gone_client_with_an_update_is_not_waited_for_and_past_the_deadline_every_change_wakes():
    r = round_state(2)
    r.updates[0] = object()
    r.gone.add(0)
    assert r.note(0, now=1.0) is False and r.open == {1} and not r.offline and r.lost_at == -math.inf
    r.past_deadline = True
    r.updates[1] = object()
    assert r.note(1) is True and r.open == {1}


def test_recount_refiles_every_client_after_a_wholesale_change():
    r = round_state(3)
    r.dropped.update({0: "offline", 1: "offline"})
    r.recount()
    assert r.open == {2} and r.offline == {0, 1}
    r.dropped.clear()
    r.recount()
    assert r.open == {0, 1, 2} and not r.offline
    assert r.note(9) is False   # not selected: ignored
