"""Structured output: answers held to a JSON schema, a regex or a tool call, checked at the gateway.

grammars.py makes a request's response_format or grammar into an
llguidance grammar, and refuses what cannot be served before any worker
sees it; strict_schemas.py reads a JSON schema strictly, as xgrammar does;
tool_calls.py forces a chat answer's tool calls and reads them back out of
the text.

It may use the gateway's top level (errors) and schemas; never the routes,
which call it, nor the service or the bus.
"""
