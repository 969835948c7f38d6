"""Media: what a prompt carries besides text, loaded safely and checked before it goes on the bus.

The loader (loader.py) fetches an image from a data URI, the media
directory or an allowed URL, and nothing an attacker points it at;
images.py checks one and scales it to what its model can use; prompts.py
makes a route's prompt (text, messages or MindIE's multimodal lists) into
the prompt fields a worker takes, with its images in place.

It may use the gateway's top level (errors, settings) and schemas; never
the routes, which call it, nor the service or the bus.
"""
