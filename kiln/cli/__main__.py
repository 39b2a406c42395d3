"""``python -m kiln.cli``: how Kiln starts its own processes (the embedded stack, an agent's
builder), whatever ``kiln`` on the PATH is."""

from kiln.cli import main

main()
