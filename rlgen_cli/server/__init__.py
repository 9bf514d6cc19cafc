"""rlgen's reward server (aiohttp).

:mod:`.app` builds the application (``build_app(rewards, settings)``), :mod:`.batcher` groups concurrent
requests into micro-batches, :mod:`.limits` bounds what a request may make the server build, and
:mod:`.runner` serves it in the foreground, as several worker processes, or in a background thread.
The wire format it speaks is :mod:`rlgen_cli.rewards.remote.wire`, shared with the clients.
"""
