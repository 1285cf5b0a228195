"""The round: one node's supervisor and its parts, the pure decisions (next move,
crash-loop verdict), membership, hang and signal handling.
"""
