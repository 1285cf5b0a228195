"""stalwart: keeps distributed PyTorch jobs making progress through crashes, hangs and lost nodes."""

__version__ = "0.1.0"
