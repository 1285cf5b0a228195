"""Other tools' APIs, spelled their way, over stalwart's machinery."""
