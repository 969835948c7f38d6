"""The flags of every `tokenrelay` command, from the command line and from the environment.

commands.py holds the table of each command's groups of flags and parses a
command line; the groups are by what they configure: gateway.py (a
gateway's HTTP server, limits, keys, media), worker.py (the model, the
engine, a worker's place in a fleet), bus.py (the bus and Kafka), common.py
(logs, topics, drain, a MindIE config); parser.py is the parser that reads
each flag from the environment too, and the checked types of values.

It may use workers.bundled and workers.simulated.profile (light modules,
for defaults and choices) and nothing that imports torch, so `--help`
answers at once.
"""
