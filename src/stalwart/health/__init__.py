"""Keeping bad nodes out of a job's rounds: the quarantine of nodes that keep failing
(``quarantine`` decides, ``ledger`` keeps the job-wide record in the rendezvous store)."""
