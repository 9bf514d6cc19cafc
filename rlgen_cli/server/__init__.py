"""rlgen's reward server (aiohttp).

:mod:`.app` builds the application (``build_app(rewards, settings)``: routes, middlewares, lifetime) from
:mod:`.settings`; :mod:`.pipeline` takes a score request from admission to reply: its body is read under
the limits by :mod:`.body`, its fields and images checked before decoding by :mod:`.payload`, and it is
refused with :mod:`.refusal`'s errors. :mod:`.admission` bounds what all requests in flight hold together,
:mod:`.batcher` groups concurrent requests into micro-batches, :mod:`.limits` bounds what a request may
make the server build, and :mod:`.runner` serves it in the foreground, as several worker processes, or in
a background thread. The wire format it speaks is :mod:`rlgen_cli.rewards.remote.wire`, shared with the
clients.
"""
