"""The message bus shared by gateways and workers: Kafka, or in-process."""
