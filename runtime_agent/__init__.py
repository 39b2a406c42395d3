"""The runtime side of Kiln: hardware fingerprinting, the executors that run engines, and the
agent daemon (``agent``: register, heartbeat, reconcile; ``cache``: verified local artifacts;
``download``: resumable pulls; ``server``: the local inference server).

Imports only ``schemas`` (and ``artifact_store``): agents talk to the control plane over HTTP.
"""
