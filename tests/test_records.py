"""What a run leaves on disk, read one way (megatron_resilience/records/): a torn line never breaks a reader."""

from __future__ import annotations

from megatron_resilience.records.jsonl import read_json, read_jsonl
from megatron_resilience.records.names import METRICS_FILE, iter_dir_name, step_of_iter_dir


def test_a_torn_or_foreign_line_is_skipped_and_a_missing_file_reads_empty(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"kind": "attempt", "n": 1}\n[1, 2]\nnot json\n{"kind": "final"}\n{"kind": "attem')
    assert read_jsonl(str(path)) == [{"kind": "attempt", "n": 1}, {"kind": "final"}]
    assert read_jsonl(str(path), "attempt") == [{"kind": "attempt", "n": 1}]
    assert read_jsonl(str(tmp_path / "none.jsonl")) == [] and read_jsonl(None) == []
    (tmp_path / "stop.json").write_text('{"reason": "finished"')
    assert read_json(str(tmp_path / "stop.json")) is None and read_json(str(tmp_path / "none.json")) is None


def test_the_trainers_metrics_reader_survives_rank_0_killed_mid_write(tmp_path):
    """Before records/, ``runtime.metrics.read_metrics`` raised on a torn last line (json.loads of every line)."""
    from megatron_resilience.runtime.metrics import read_metrics

    (tmp_path / METRICS_FILE).write_text('{"kind": "train", "step": 2, "loss": 1.5}\n'
                                         '{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "tra')
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]


def test_checkpoint_folders_are_named_by_step_with_at_least_seven_digits():
    assert (iter_dir_name(500), iter_dir_name(12_345_678)) == ("iter_0000500", "iter_12345678")
    assert [step_of_iter_dir(n) for n in ("iter_0000500", "/c/iter_12345678/", "iter_500", "iter_0000500.tmp")] == \
        [500, 12_345_678, None, None]
