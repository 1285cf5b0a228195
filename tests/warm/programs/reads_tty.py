"""Reads one line from its standard input (the terminal) and echoes it back."""

print("READY", flush=True)
line = input()
print(f"got {line!r}", flush=True)
