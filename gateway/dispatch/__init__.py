"""Dispatch: a request's way to a worker and its events' way back.

Which workers are live and what they serve (directory.py), which of them
a request goes to (router.py), sending it there or holding it until one
has room (dispatcher.py), the requests waiting for their events and the
reply topic's demultiplexing (inflight.py), and failover, which sends a
request whose worker died on elsewhere from its last token (failover.py).

It may use the gateway's top level (errors, settings), schemas and the
bus; never tenancy, the routes or the service, which drives it.
"""
