"""Bodies: a request's bytes before and around its parsing, whatever its route.

request_body.py limits a body's size and reads it as JSON whatever its
label; ignored_fields.py names the fields a body carried that no document
lists (a header, a log line, a WebSocket's notice); kserve_binary.py reads
and writes KServe v2's binary tensors, as Triton's clients send them.

It may use the gateway's top level (errors) and schemas;
never the routes, the service or the bus.
"""
