import json

from trainer.badbatches import FILENAME, BadBatchList


def clock():
    return 1234.5


def test_missing_file_is_an_empty_list(tmp_path):
    assert BadBatchList.load(tmp_path).windows == []
    assert BadBatchList.load(None).windows == []


def test_add_writes_only_when_asked_and_load_reads_it_back(tmp_path):
    rank0 = BadBatchList.load(tmp_path, clock=clock)
    other = BadBatchList.load(tmp_path, clock=clock)
    for bl, write in ((rank0, True), (other, False)):  # the same agreed command on two ranks
        assert bl.add((0, 16, 24), step=3, incident_id="inc-1", verdict="data", write=write)
        assert bl.add((1, 0, 8), step=40, incident_id=7, verdict="data", write=write)
    assert rank0.windows == other.windows == [(0, 16, 24), (1, 0, 8)]
    rows = [json.loads(line) for line in (tmp_path / FILENAME).read_text().splitlines()]
    assert rows == [
        {"epoch": 0, "sample_from": 16, "sample_to": 24, "step": 3, "incident_id": "inc-1", "verdict": "data",
         "ts": 1234.5},
        {"epoch": 1, "sample_from": 0, "sample_to": 8, "step": 40, "incident_id": 7, "verdict": "data", "ts": 1234.5}]
    again = BadBatchList.load(tmp_path)
    assert again.windows == [(0, 16, 24), (1, 0, 8)] and again.entries[1].incident_id == 7


def test_identical_windows_are_kept_once(tmp_path):
    bl = BadBatchList.load(tmp_path)
    assert bl.add((0, 16, 24), step=3, incident_id="a", verdict="data", write=True)
    assert not bl.add([0, 16, 24], step=9, incident_id="b", verdict="data", write=True)
    assert bl.add((0, 16, 25), step=9, incident_id="b", verdict="data", write=True)  # another window
    assert len((tmp_path / FILENAME).read_text().splitlines()) == 2
    (tmp_path / FILENAME).write_text((tmp_path / FILENAME).read_text() * 2)  # duplicated lines on disk
    assert BadBatchList.load(tmp_path).windows == [(0, 16, 24), (0, 16, 25)]


def test_a_torn_last_line_is_ignored_and_the_next_append_survives(tmp_path):
    bl = BadBatchList.load(tmp_path)
    bl.add((0, 16, 24), step=3, incident_id="a", verdict="data", write=True)
    path = tmp_path / FILENAME
    path.write_text(path.read_text() + '{"epoch": 2, "sample_fr')  # a crash mid-write
    loaded = BadBatchList.load(tmp_path)
    assert loaded.windows == [(0, 16, 24)]
    loaded.add((3, 0, 8), step=50, incident_id="b", verdict="data", write=True)
    assert BadBatchList.load(tmp_path).windows == [(0, 16, 24), (3, 0, 8)]
