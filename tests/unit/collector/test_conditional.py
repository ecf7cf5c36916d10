"""Conditional GETs of the polled answers (a run's nodes, incidents and actions): the writer's
table generations, the routes' ETag and 304, and agent/api.py asking with
If-None-Match against a real collector process."""

from __future__ import annotations

import asyncio

import httpx

from agent import wire
from agent.api import ApiClient
from analysis import Finding
from collector.http.server import create_app
from collector.ingest.decode import decode
from collector.read import queries
from tests.unit.collector.collector_batches import make_batch, steps_section
from tests.unit.collector.collector_server import TOKEN, CollectorProcess

RUN = {"run_id": "run1", "world_size": 4, "node_map": {"0": "node0", "1": "node0", "2": "node1", "3": "node1"}}
AUTH = {"Authorization": "Bearer tok"}


def steps(storage, seq: int) -> None:
    """A rank's batch of one step: rows of the ingest tables, nothing about nodes or incidents."""
    storage.ingest_blocking(decode(make_batch("run1", 1, seq, sections={wire.STEP: steps_section([seq])})))


async def _get(app, path: str, etag: str | None = None, auth: bool = True) -> httpx.Response:
    headers = {**(AUTH if auth else {}), **({"If-None-Match": etag} if etag else {})}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://collector") as client:
        return await client.get(path, headers=headers)


def get(app, path: str, etag: str | None = None, auth: bool = True) -> httpx.Response:
    return asyncio.run(_get(app, path, etag, auth))


def test_a_table_generation_moves_only_with_a_commit_that_changed_the_table(storage):
    w = storage._writer
    storage.ingest_blocking(decode(make_batch("run1", 0, 0, run=RUN, sections={wire.STEP: steps_section([0])})))
    nodes, incidents, step_rows = w.generation("nodes"), w.generation("incidents"), w.generation("steps")
    assert nodes > 0 and step_rows == nodes  # the run's node map came with its first steps
    steps(storage, 1)
    assert (w.generation("nodes"), w.generation("incidents")) == (nodes, incidents)
    assert w.generation("steps") > step_rows
    storage.set_node_status("run1", "node1", "isolated", "slow").result(10)
    assert w.generation("nodes") > nodes  # the actions projection does not name its tables: any may have changed
    before = w.generation("incidents", "nodes")
    storage.write(lambda ctx: None).result(10)  # a call may write anything
    assert w.generation("incidents") > before and w.generation("nodes") > before
    # a tag over several tables moves when any one of them changes
    both, nodes = w.generation("nodes", "steps"), w.generation("nodes")
    steps(storage, 2)
    assert w.generation("nodes", "steps") > both and w.generation("nodes") == nodes


def test_nodes_are_answered_304_until_a_node_changes(storage):
    storage.ingest_blocking(decode(make_batch("run1", 0, 0, run=RUN, sections={wire.STEP: steps_section([0])})))
    app = create_app(storage, close_storage=False)
    first = get(app, "/v1/runs/run1/nodes")
    etag = first.headers["ETag"]
    assert first.status_code == 200 and [n["node"] for n in first.json()] == ["node0", "node1"]
    for seq in (1, 2):
        steps(storage, seq)
        same = get(app, "/v1/runs/run1/nodes", etag)
        assert (same.status_code, same.content, same.headers["ETag"]) == (304, b"", etag)
    storage.set_node_status("run1", "node1", "isolated", "slow").result(10)
    changed = get(app, "/v1/runs/run1/nodes", etag)
    assert changed.status_code == 200 and changed.headers["ETag"] != etag
    assert {n["node"]: n["status"] for n in changed.json()} == {"node0": "healthy", "node1": "isolated"}
    assert changed.json() == storage.read(queries.nodes, "run1")
    # another tag, or a list that names the current one
    assert get(app, "/v1/runs/run1/nodes", '"other-1"').status_code == 200
    assert get(app, "/v1/runs/run1/nodes", f'"other-1", {changed.headers["ETag"]}').status_code == 304
    # the gate comes first: a 304 tells nothing to a client without the read token
    assert get(app, "/v1/runs/run1/nodes", changed.headers["ETag"], auth=False).status_code == 401


def test_incidents_are_answered_304_until_an_incident_is_recorded(storage):
    steps(storage, 0)
    app = create_app(storage, close_storage=False)
    first = get(app, "/v1/runs/run1/incidents")
    assert (first.status_code, first.json()) == (200, [])
    etag = first.headers["ETag"]
    steps(storage, 1)
    assert get(app, "/v1/runs/run1/incidents", etag).status_code == 304
    finding = Finding(kind="straggler", key="straggler:node1", run_id="run1", step_from=1, step_to=1, rank=2,
                      node="node1", root_cause="rank 2 is slow", confidence=0.9)
    storage.record_findings("run1", [finding]).result(10)
    changed = get(app, "/v1/runs/run1/incidents", etag)
    assert changed.status_code == 200 and [i["kind"] for i in changed.json()] == ["straggler"]
    assert get(app, "/v1/runs/run1/incidents", changed.headers["ETag"]).status_code == 304
    # waiting for detection (settle_s) reads every time, and says whether it settled
    settled = get(app, "/v1/runs/run1/incidents?settle_s=1", changed.headers["ETag"])
    assert settled.status_code == 200 and settled.headers["X-Llmwatch-Settled"] == "true"


def test_the_api_client_asks_again_with_the_tag_and_answers_a_304_from_what_it_holds(tmp_path):
    coll = CollectorProcess(tmp_path / "c.duckdb").start()
    try:
        api = ApiClient(coll.url, TOKEN)
        answers = []
        send = api._send

        def spy(*args, **kwargs):
            got = send(*args, **kwargs)
            answers.append((kwargs.get("etag"), got[0] is None, got[1]))  # (tag sent, a 304, tag got)
            return got

        api._send = spy
        path = api.run_path("run1", "nodes")
        assert api.get_json(path) == []
        assert api.get_json(path) == []  # a 304
        assert answers[0][1] is False and answers[0][2]  # a 200 with the rows, tagged
        assert answers[1][:2] == (answers[0][2], True)  # the tag it got sent back, and a 304
        body = make_batch("run1", 0, 0, run=RUN, sections={wire.STEP: steps_section([0])})
        r = httpx.post(f"{coll.url}/v1/ingest", content=body,
                       headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": wire.CONTENT_TYPE})
        assert r.status_code == 200, r.text
        assert [n["node"] for n in api.get_json(path)] == ["node0", "node1"]  # changed: a 200 with the rows
        assert answers[2][1] is False
        assert [n["node"] for n in api.get_json(path)] == ["node0", "node1"] and answers[3][1]
    finally:
        coll.stop()


def test_actions_are_answered_304_until_an_action_is_recorded(storage):
    steps(storage, 0)
    app = create_app(storage, close_storage=False)
    first = get(app, "/v1/runs/run1/actions")
    assert (first.status_code, first.json()) == (200, [])
    steps(storage, 1)
    assert get(app, "/v1/runs/run1/actions", first.headers["ETag"]).status_code == 304
    storage.record_action("run1", "rollback", "issued", incident_id=1).result(10)
    changed = get(app, "/v1/runs/run1/actions", first.headers["ETag"])
    assert changed.status_code == 200 and [a["kind"] for a in changed.json()] == ["rollback"]
