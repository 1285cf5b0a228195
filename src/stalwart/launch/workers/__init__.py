"""The worker processes: starting, watching and stopping them (cold or forked from
the warm template), their environment, failure records, strays, cgroup and guardian.
"""
