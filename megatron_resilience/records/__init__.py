"""What a run and its job leave on disk: every file's name and format, and the one way to read them (stdlib only).

Every room reads the run's files (the trainer writes ``metrics.jsonl`` and ``stop_reason.json``, the batch script
and the watcher the ledger, chaos its own ledger, the checkpoint manager the tracker and ``iter_*`` folders; the
plugins, the job-level decision, the report and the trainer's restart all read them). Their names and formats are
said here once, and :func:`~megatron_resilience.records.jsonl.read_jsonl` is the one tolerant reader of a
JSON-lines file (a torn last line, written by a process killed mid-write, is skipped, never an error).

- :mod:`.names` file names and the checkpoint folder's layout;
- :mod:`.jsonl` reading a JSON-lines file and a JSON file; :mod:`.ledger` the run's ledger of Slurm attempts (appended
  atomically, write-ahead records around every Slurm command);
- the logs a job leaves, read as records: :mod:`.launcher_log` ft_launcher's restart cycles; :mod:`.megatron_log_lines`
  and :mod:`.megatron_log` a foreign trainer's own log (Megatron-LM, Megatron-Bridge: no ``metrics.jsonl``) as the
  records this package's trainer writes, so the report and the ledger read one format.
"""
