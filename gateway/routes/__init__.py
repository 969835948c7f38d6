"""The HTTP and WebSocket routes, one module per API family, and what every generation route does.

generation.py checks, submits, collects or streams a request whatever
its format; each family's module only parses its bodies and renders its
tokens (websocket.py carries the others' bodies over one connection).

The routes are the gateway's top: they may use the service and every
package below it (media, structured, bodies, dispatch's in-flight
requests), and nothing but the app imports them.
"""
