"""What a run writes on its node: the run folder, worker logs, the event log."""
