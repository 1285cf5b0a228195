"""What a run's records say: ``stalwart report`` (console, JSON, HTML, PNG), the goodput
accounting, the closing block and the Prometheus metrics.

Everything here reads ``events.jsonl`` and nothing else of the launcher: the package
imports neither ``launch`` nor ``rendezvous`` (an import-linter contract keeps it so),
so a report can be made wherever the run folder is, with or without a job.
"""
