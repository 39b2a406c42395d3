"""``python -m services``: the control plane's command line (``services.cli``)."""

from services.cli import main

main()
