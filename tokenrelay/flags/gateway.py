"""A gateway's flags: its HTTP server, its limits, its API keys and tenants, the media it may load.

What they become is GatewaySettings (gateway/settings.py), through
tokenrelay/settings.py; `serve` and `gateway` take them.
"""

from __future__ import annotations

from tokenrelay.flags.parser import Parser, at_least_one, at_least_zero, number, option


def gateway_options(parser: Parser) -> None:
    option(parser, "--host", default="127.0.0.1", help="address to listen on")
    option(parser, "--port", type=number(int, 0, 65535), default=1025, help="port to listen on (MindIE's is 1025)")
    option(parser, "--gateway-id", default="", help="this gateway's id, which names its reply topic; empty: random")
    option(parser, "--default-model", default="", help="the model of /infer_token and /infer; empty: the only one")
    option(
        parser,
        "--full-text-enabled",
        action="store_true",
        default=False,
        help="stream events carry the text so far instead of the new piece (fullTextEnabled)",
    )
    option(
        parser,
        "--max-request-length",
        type=at_least_one,
        default=40,
        help="largest request body in MB; larger ones get 413 (maxRequestLength)",
    )
    option(
        parser,
        "--request-timeout",
        type=at_least_one,
        default=600,
        help="seconds from a request's arrival to its last token, for a request that sets no timeout of its own; "
        "then it ends (e2eTimeout)",
    )
    option(
        parser,
        "--max-in-flight",
        type=at_least_one,
        default=4096,
        help="requests this gateway waits for at once; beyond that, 429 with Retry-After",
    )
    option(
        parser,
        "--max-waiting-requests",
        type=at_least_zero,
        default=0,
        help="requests of a model waiting for a worker (held here, or sent to a worker and not started), "
        "past which a new one that no worker has room for gets 429 with Retry-After at once; 0: no bound",
    )
    option(
        parser,
        "--media-dir",
        default="/data/multimodal_inputs",
        help="the only directory multimodal input may read local files from",
    )
    option(
        parser,
        "--no-router",
        action="store_true",
        default=False,
        help="publish every request to the request topics that workers share, instead of routing it to the "
        "worker with room and its prompt cached (the placement before routing; for comparisons)",
    )
    option(
        parser,
        "--reject-unknown-fields",
        action="store_true",
        default=False,
        help="refuse (422) a body's field that no document lists, instead of ignoring it and naming it in the "
        "answer's X-Ignored-Fields header and the log",
    )
    option(parser, "--api-keys", nargs="+", default=[], help="API keys clients must send (Bearer); none: open")
    option(parser, "--api-keys-file", default="", help="a file of API keys, one per line (with --api-keys, all count)")
    option(
        parser,
        "--tenants-file",
        default="",
        help="a TOML or YAML file of tenants: their API keys, fair-share weights, limits per minute and at once, "
        "allowed priorities, models and max_tokens; read again when it changes and on SIGHUP",
    )
    option(
        parser,
        "--admin-api-keys",
        nargs="+",
        default=[],
        help="keys (Bearer) allowed to load and unload LoRA adapters at run time (/v1/load_lora_adapter); none: "
        "run-time loading is refused",
    )
    option(
        parser,
        "--lora-root",
        default="",
        help="the directory under which LoRA adapters loaded at run time must lie; empty: run-time loading is refused",
    )
    option(parser, "--tls-cert", default="", help="PEM certificate chain: serve https (with --tls-key)")
    option(parser, "--tls-key", default="", help="PEM private key of --tls-cert")
    option(parser, "--tls-ca", default="", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    option(
        parser,
        "--allowed-media-domains",
        default="",
        env="ALLOWED_MEDIA_DOMAINS_ENV",
        help="comma-separated hosts multimodal input may fetch http(s) URLs from",
    )
