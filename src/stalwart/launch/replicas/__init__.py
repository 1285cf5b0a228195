"""RAM snapshots and their copies on peer nodes: the segments, the ring, the
authenticated wire, the server, pushes and fetches.
"""
