"""Commands: delivered once per target rank, acked, expired; and through storage + ingest."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from agent import wire
from collector.ingest.decode import CommandAck, decode
from collector.read import queries
from collector.store.commands import Command, CommandBook, validate_request
from tests.unit.collector.collector_batches import make_batch, steps_section


def book_with(*cmds: Command, ttl_s: float = 100.0) -> CommandBook:
    book = CommandBook(ttl_s)
    for c in cmds:
        book.add(c)
    return book


def test_delivered_once_per_target_rank():
    book = book_with(Command(id=1, run_id="r", kind="skip", args={"n": 2}, ranks=[0, 1], issued_ts=0.0))
    plan = book.plan([("r", 0), ("r", 0), ("r", 2), ("other", 1)], [], now=1.0)
    assert plan.deliveries == [[{"id": 1, "kind": "skip", "args": {"n": 2}, "issued_ts": 0.0}], [], [], []]
    assert plan.changed[1].status == "pending"  # rank 1 still to go
    book.apply(plan, 1.0)
    plan = book.plan([("r", 0), ("r", 1)], [], now=2.0)
    assert [len(d) for d in plan.deliveries] == [0, 1]
    assert plan.changed[1].status == "delivered"


def test_unapplied_plan_changes_nothing():
    book = book_with(Command(id=1, run_id="r", kind="stop", args={}, ranks=None, issued_ts=0.0))
    book.plan([("r", 0)], [], now=1.0)  # e.g. the transaction rolled back
    assert len(book.plan([("r", 0)], [], now=1.0).deliveries[0]) == 1
    assert book.get("r", 1).delivered == []


def test_acks_settle_the_status():
    book = book_with(Command(id=1, run_id="r", kind="rollback", args={}, ranks=[0, 1], issued_ts=0.0))
    book.apply(book.plan([("r", 0), ("r", 1)], [], now=1.0), 1.0)
    plan = book.plan([], [("r", 0, 2.0, CommandAck(command_id=1, status="ok"))], now=2.0)
    assert plan.changed[1].status == "delivered"
    book.apply(plan, 2.0)
    plan = book.plan([], [("r", 1, 3.0, CommandAck(command_id=1, status="ok", detail={"step": 7}))], now=3.0)
    assert plan.changed[1].status == "acked"
    assert plan.changed[1].acks[1] == {"status": "ok", "detail": {"step": 7}, "ts": 3.0}
    failed = book_with(Command(id=2, run_id="r", kind="rerun", args={}, ranks=[0], issued_ts=0.0))
    failed.apply(failed.plan([("r", 0)], [], now=1.0), 1.0)
    plan = failed.plan([], [("r", 0, 2.0, CommandAck(command_id=2, status="failed", detail="oom"))], now=2.0)
    assert plan.changed[2].status == "failed"
    assert book.plan([], [("r", 0, 2.0, CommandAck(command_id=99, status="ok"))], now=2.0).changed == {}


def test_a_ranks_first_ack_stands():
    """A rank that carried a command out and then refused it again (its agent heard of it
    only after the agreement, as the run ended) did it: the second answer changes nothing."""
    book = book_with(Command(id=1, run_id="r", kind="stop", args={}, ranks=[0, 1], issued_ts=0.0))
    book.apply(book.plan([("r", 0), ("r", 1)], [], now=1.0), 1.0)
    done = [("r", r, 2.0, CommandAck(command_id=1, status="done", detail="at step 9")) for r in (0, 1)]
    book.apply(book.plan([], done, now=2.0), 2.0)
    late = CommandAck(command_id=1, status="rejected", detail="the run ended before it could act")
    plan = book.plan([], [("r", 1, 3.0, late)], now=3.0)
    assert plan.changed == {}
    assert book.get("r", 1).status == "acked"
    plan = book.plan([], [*done, ("r", 1, 2.5, late)], now=2.0)  # in one group too
    assert plan.changed == {}


def test_a_restart_round_gets_again_what_the_old_round_left_undone():
    """Seen on the demo: a rollback delivered to the old round as an isolation restarted it;
    its ranks left without acting, and the new round (ranks 0 and 1 again) never got it."""
    book = book_with(Command(id=1, run_id="r", kind="rollback", args={"step": 70}, ranks=[0, 1, 2, 3],
                             issued_ts=0.0),
                     Command(id=2, run_id="r", kind="isolate", args={}, ranks=[0, 1, 2, 3], issued_ts=0.0))
    book.apply(book.plan([("r", k) for k in range(4)], [("r", k, 1.0, CommandAck(command_id=2, status="done"))
                                                        for k in range(4)], now=1.0), 1.0)
    assert book.plan([("r", 0)], [], now=2.0).deliveries == [[]]  # delivered once, as before
    plan = book.plan([("r", 0), ("r", 1)], [], now=2.0, restarted=["r"])
    assert [[m["id"] for m in d] for d in plan.deliveries] == [[1], [1]]  # the rollback, not the acked isolate
    assert plan.changed[1].delivered == [0, 1] and plan.changed[1].status == "pending"
    book.apply(plan, 2.0)
    acked = book.plan([], [("r", 0, 3.0, CommandAck(command_id=1, status="done"))], now=3.0)
    book.apply(acked, 3.0)
    assert book.plan([("r", 0)], [], now=4.0, restarted=["r"]).deliveries == [[]]  # acked: never again
    assert book.plan([("other", 0)], [], now=4.0, restarted=["other"]).deliveries == [[]]


def test_an_isolate_no_rank_acked_is_not_given_to_the_restart_round():
    """Seen in the suite: the hung rank's node was isolated by the restart itself; the isolate,
    delivered to the old round and never acked, went to the new round, whose rank 0 (without
    that node) rejected it, and the action failed though the node was out."""
    book = book_with(Command(id=2, run_id="r", kind="isolate", args={"node": "node1"}, ranks=[0, 1],
                             issued_ts=0.0))
    book.apply(book.plan([("r", 0), ("r", 1)], [], now=1.0), 1.0)  # delivered, never acked
    plan = book.plan([("r", 0)], [], now=2.0, restarted=["r"])
    assert plan.deliveries == [[]] and 2 not in plan.changed


def test_every_rank_of_unknown_size_and_expiry():
    book = book_with(Command(id=1, run_id="r", kind="stop", args={}, ranks=None, issued_ts=0.0),
                     Command(id=2, run_id="r", kind="skip", args={}, ranks=[5], issued_ts=0.0), ttl_s=10.0)
    plan = book.plan([("r", 3)], [], now=1.0)
    assert [c["id"] for c in plan.deliveries[0]] == [1]
    assert plan.changed[1].status == "delivered"
    book.apply(plan, 1.0)
    plan = book.plan([("r", 4)], [], now=11.0)
    assert plan.deliveries == [[]]
    assert plan.changed[2].status == "expired"
    book.apply(plan, 11.0)
    assert book.get("r", 1) is None and book.get("r", 2) is None  # forgotten after the ttl


def test_the_launchers_exit_reports_are_never_a_commands_target():
    # rank -1 sends the launcher's rank_exited events; a run-wide command of a run whose
    # size is unknown must not wait for an ack from it
    book = book_with(Command(id=1, run_id="r", kind="stop", args={}, ranks=None, issued_ts=0.0))
    plan = book.plan([("r", -1), ("r", 0)], [], now=1.0)
    assert [len(d) for d in plan.deliveries] == [0, 1]
    assert plan.changed[1].delivered == [0]


@pytest.mark.parametrize("kind, args, ranks", [
    ("Rollback", {}, None), ("", {}, None), ("skip", [], None), ("skip", {}, []), ("skip", {}, [-1]),
    ("skip", {}, [True]), ("skip", {}, "0"),
])
def test_bad_requests(kind, args, ranks):
    with pytest.raises(ValueError):
        validate_request(kind, args, ranks)


def test_issue_deliver_ack_through_storage(storage):
    run = {"world_size": 2}
    assert storage.ingest_blocking(decode(make_batch(rank=0, run=run))).commands == []
    with pytest.raises(KeyError):
        storage.issue_command("no-such-run", "stop", {}, None).result(10)
    cmd = storage.issue_command("run1", "rollback", {"to_step": 40}, None).result(10)
    assert (cmd["ranks"], cmd["status"]) == ([0, 1], "pending")  # every rank = range(world_size)
    got = storage.ingest_blocking(decode(make_batch(rank=1, batch_seq=1)))
    assert got.commands == [{"id": cmd["id"], "kind": "rollback", "args": {"to_step": 40}, "issued_ts": cmd["issued_ts"]}]
    assert storage.ingest_blocking(decode(make_batch(rank=1, batch_seq=2))).commands == []
    # a duplicate batch still gets the commands its rank has not had
    assert len(storage.ingest_blocking(decode(make_batch(rank=0, run=run))).commands) == 1
    ack = {"ts": 5.0, "kind": "command_ack", "data": {"command_id": cmd["id"], "status": "ok", "detail": "done"}}
    for rank, seq in ((0, 3), (1, 3)):
        storage.ingest_blocking(decode(make_batch(rank=rank, batch_seq=seq, events=[ack],
                                                  sections={wire.STEP: steps_section([seq])})))
    (row,) = storage.read(queries.commands, "run1")
    assert (row["status"], row["delivered"], sorted(row["acks"])) == ("acked", [1, 0], ["0", "1"])


def test_a_restart_rounds_first_batch_gets_the_unacked_command_again(storage):
    run = {"world_size": 2}
    storage.ingest_blocking(decode(make_batch(rank=0, run=run)))
    cmd = storage.issue_command("run1", "rollback", {"step": 7}, None).result(10)
    for rank in (0, 1):  # the old round received it, and left without acting
        assert len(storage.ingest_blocking(decode(make_batch(rank=rank, batch_seq=1))).commands) == 1
    restart = {"ts": 9.0, "kind": "run_started", "data": {"restart": 1, "attempt_floor": 1}}
    got = storage.ingest_blocking(decode(make_batch(rank=0, batch_seq=0, incarnation="round1", events=[restart])))
    assert [c["id"] for c in got.commands] == [cmd["id"]]
    assert [c["id"] for c in storage.ingest_blocking(decode(make_batch(rank=1, batch_seq=0,
                                                                       incarnation="round1"))).commands] == [cmd["id"]]


def started_run(storage) -> None:
    storage.ingest_blocking(decode(make_batch(rank=0, run={"world_size": 2})))


def test_issuing_on_the_writer_thread_does_not_block_it(storage):
    """Detection and the policy may issue from code the writer runs (a projection, a
    write callback): the call returns at once and `done` reports the commit."""
    started_run(storage)
    done, got = threading.Event(), []

    def on_writer(ctx):
        assert storage.on_writer_thread()
        storage.issue_command("run1", "stop", {}, [0], done=lambda row, err: (got.append((row, err)), done.set()))
        return done.is_set()  # its commit cannot have happened yet: we are still inside this one

    assert storage.write(on_writer).result(10) is False  # returned without waiting for its own commit
    assert done.wait(10)
    (row, err), = got
    assert err is None and (row["kind"], row["ranks"], row["status"]) == ("stop", [0], "pending")
    assert storage.ingest_blocking(decode(make_batch(rank=0, batch_seq=1))).commands[0]["id"] == row["id"]


def test_issuing_from_a_subscriber_thread_does_not_block_the_writer(storage):
    started_run(storage)
    sub = storage.subscribe("policy")
    issued, stop = [], threading.Event()

    def policy() -> None:  # what the policy will do: react to committed rows with a command
        while not stop.is_set():
            d = sub.get(0.1)
            if d is not None and d.commit is not None:
                issued.append(storage.issue_command("run1", "checkpoint", {}, None).result(10))
                return

    thread = threading.Thread(target=policy)
    thread.start()
    try:
        got = storage.ingest_blocking(decode(make_batch(rank=1, batch_seq=0, sections={
            wire.STEP: steps_section([1])})))
        assert got.accepted == 1
        thread.join(10)
        assert not thread.is_alive() and issued[0]["kind"] == "checkpoint"
        # the next ingest of a rank carries it: the writer kept serving throughout
        assert storage.ingest_blocking(decode(make_batch(rank=1, batch_seq=1))).commands[0]["id"] == issued[0]["id"]
    finally:
        stop.set()
        thread.join(10)


def test_a_command_issued_in_the_group_of_a_ranks_batch_reaches_it_at_once(storage):
    started_run(storage)
    release = threading.Event()
    storage.write(lambda ctx: release.wait(10))  # hold the writer: what follows is one group
    cmd = storage.issue_command("run1", "rollback", {"to_step": 3}, [1])
    batch = Future()
    storage._writer.submit_batch(decode(make_batch(rank=1, batch_seq=5)), batch)
    release.set()
    row = cmd.result(10)
    assert batch.result(10).commands == [{"id": row["id"], "kind": "rollback", "args": {"to_step": 3},
                                          "issued_ts": row["issued_ts"]}]
    assert row["delivered"] == [1] and row["status"] == "delivered"
    (stored,) = storage.read(queries.commands, "run1")
    assert (stored["status"], stored["delivered"]) == ("delivered", [1])


def test_an_unknown_run_is_told_through_done(storage):
    done, got = threading.Event(), []
    assert storage.issue_command("nope", "stop", {}, None, done=lambda r, e: (got.append(e), done.set())) is None
    assert done.wait(10) and isinstance(got[0], KeyError)
