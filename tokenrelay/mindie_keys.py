"""What each key of MindIE Service's config.json means here: the flag it sets, or why it is ignored.

A MindIE deployment keeps its settings in that file (MindIE's "Configuration
Parameters (Service-Specific)" page describes every key). Most of them name a
flag of ours: maxBatchSize is --max-batch-size, port is --port. Those of NPUs,
of MindIE's own processes and of features not built here are ignored, each for
the reason its row says. This table is the one place that says so: the
reading (tokenrelay/mindie_config.py) follows it, and the table of
docs/coming-from-mindie.md is checked against it (tests/test_mindie_config.py).

A row that sets a flag names the converter of its value
(tokenrelay/mindie_values.py); the flag then checks the arguments as it checks
its own. A row without one is ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenrelay.mindie_values import (
    MODELS,
    Convert,
    as_integer,
    as_switch,
    as_text,
    devices,
    host,
    kv_cache,
    links,
    one_instance,
    one_node,
    read_only,
    tls_ca,
    tls_directory,
    tls_file,
    truth,
)


@dataclass(frozen=True)
class Key:
    path: str  # in the file; a ModelConfig entry's keys as ModelConfig[].name
    note: str  # how its value becomes the flag's, or why it is ignored
    flags: tuple[str, ...] = ()  # what it sets or is read with; none: ignored
    convert: Convert | None = None


def _keys(section: str, names: str, note: str, flags: tuple[str, ...] = (), convert: Convert | None = None):
    return [Key(f"{section}{name}", note, flags, convert) for name in names.split()]


# Each section's prefix: _C a ModelConfig entry's, _Q ScheduleConfig's.
_S, _B, _L = "ServerConfig.", "BackendConfig.", "LogConfig."
_M, _C, _Q = "BackendConfig.ModelDeployConfig.", f"{MODELS}[].", "BackendConfig.ScheduleConfig."
_TLS = ("--tls-cert", "--tls-key", "--tls-ca")
_UNSPLIT = "one plane: management and metrics routes are served on --port, beside inference, with its certificate"
_DMI = "dmi's links between prefill and decode instances: workers do both, and reach gateways through Kafka"
_MULTI_NODE = "multi-node inference's links: not served (multiNodesInferEnabled)"
_NO_PD_STEPS = (
    "no choice of a prefill or a decode step: each step does both, the queue in priority and fair-share order"
)
_LOGS = (
    "logs go to stderr, a line per event, at --log-level (--log-format); rotate and keep them where they are collected"
)

KEYS: tuple[Key, ...] = (
    Key("Version", "the file's format: 1.0.0, the one read"),
    Key("EnableDynamicAdjustTimeoutConfig", "timeouts are --request-timeout's, or a request's own timeout"),
    *_keys(
        _S,
        "ipAddress",
        "where the gateway listens; 0.0.0.0 or :: only with allowAllZeroIpListening true",
        ("--host",),
        host,
    ),
    *_keys(_S, "allowAllZeroIpListening", "read with ipAddress", ("--host",), read_only(truth)),
    *_keys(_S, "port", "the port of every route", ("--port",), as_integer),
    *_keys(_S, "managementIpAddress managementPort", _UNSPLIT),
    *_keys(_S, "metricsPort", "GET /metrics is served on --port (a worker's on --metrics-address)"),
    *_keys(
        _S,
        "maxLinkNum",
        "3 × maxLinkNum: MindIE runs maxLinkNum, queues 2 × as many and refuses the next; "
        "the gateway answers that one 429",
        ("--max-in-flight",),
        links,
    ),
    *_keys(
        _S,
        "httpsEnabled",
        "true: https with tlsCert and tlsPk, clients showing a certificate of tlsCaFile's CA "
        "(MindIE's two-way authentication); false: http, its TLS keys unread",
        _TLS,
        read_only(truth),
    ),
    *_keys(_S, "fullTextEnabled", "stream events carry the text so far", ("--full-text-enabled",), as_switch),
    *_keys(
        _S, "tlsCert", "relative to MindIE's install directory, the one above the file's", ("--tls-cert",), tls_file
    ),
    *_keys(_S, "tlsPk", "an unencrypted PEM key, relative as tlsCert", ("--tls-key",), tls_file),
    *_keys(_S, "tlsCaPath", "the directory of tlsCaFile, relative as tlsCert", ("--tls-ca",), tls_directory),
    *_keys(_S, "tlsCaFile", "one file: its CAs sign the client certificates accepted", ("--tls-ca",), tls_ca),
    *_keys(_S, "tlsPkPwd kmcKsfMaster kmcKsfStandby", "no KMC-encrypted key passwords: tlsPk is read unencrypted"),
    *_keys(
        _S, "tlsCrl tlsCrlPath tlsCrlFiles", "no revocation lists: a client certificate is good until the CA changes"
    ),
    *_keys(
        _S,
        "managementTlsCaFile managementTlsCert managementTlsPk managementTlsPkPwd managementTlsCrl "
        "managementTlsCrlPath managementTlsCrlFiles metricsTlsCaFile metricsTlsCert metricsTlsPk metricsTlsPkPwd "
        "metricsTlsCrlPath metricsTlsCrlFiles",
        _UNSPLIT,
    ),
    *_keys(_S, "inferMode", "every worker prefills and decodes (standard); dmi's split roles are not served"),
    *_keys(
        _S,
        "interCommTLSEnabled interCommPort interCommTlsCaPath interCommTlsCaFiles interCommTlsCaFile "
        "interCommTlsCert interCommPk interCommPkPwd interCommTlsCrlPath interCommTlsCrlFiles interCommTlsCrl",
        _DMI,
    ),
    *_keys(_S, "openAiSupport", "one /v1/chat/completions: OpenAI's fields and vLLM's sampling extras"),
    *_keys(
        _S,
        "tokenTimeout",
        "no deadline per token: e2eTimeout's covers the request; a stuck step is --engine-stuck-timeout's",
    ),
    *_keys(_S, "e2eTimeout", "for requests that set no timeout of their own", ("--request-timeout",), as_integer),
    *_keys(_S, "maxRequestLength", "MB", ("--max-request-length",), as_integer),
    *_keys(_S, "distDPServerEnabled", "MoE expert-parallel serving is not built"),
    *_keys(
        _S,
        "layerwiseDisaggregated layerwiseDisaggregatedRoleType layerwiseDisaggregatedMasterIpAddress "
        "layerwiseDisaggregatedSlaveIpAddress layerwiseDisaggregatedDataPort layerwiseDisaggregatedCrtlPort",
        "layer-wise disaggregation is not built",
    ),
    *_keys(_S, "HealthCheckConfig", "no NPU-usage probe: /v2/health/ready says whether a live worker serves"),
    *_keys(_B, "backendName", "one backend: the engine of workers/engine/"),
    *_keys(
        _B,
        "modelInstanceNumber",
        "1: a worker is one instance; more are refused (one worker each)",
        ("--device",),
        read_only(one_instance),
    ),
    *_keys(
        _B,
        "npuDeviceIds",
        "[[N, N+1, ...]] (one list, worldSize long): cuda:N; from 0: auto (cuda:0 on a GPU host, else the CPU)",
        ("--device",),
        devices,
    ),
    *_keys(_B, "tokenizerProcessNumber", "each gateway tokenizes in its own process: more gateways, more tokenizers"),
    *_keys(
        _B,
        "multiNodesInferEnabled",
        "false: a worker's ranks share its host; true is refused",
        ("--tensor-parallel-size",),
        read_only(one_node),
    ),
    *_keys(
        _B,
        "multiNodesInferPort interNodeTLSEnabled interNodeTlsCaPath interNodeTlsCaFiles interNodeTlsCert "
        "interNodeTlsPk interNodeTlsPkPwd interNodeTlsCrlPath interNodeTlsCrlFiles interNodeKmcKsfMaster "
        "interNodeKmcKsfStandby",
        _MULTI_NODE,
    ),
    *_keys(_B, "kvPoolConfig", "no KV cache pool beyond each worker's own blocks"),
    *_keys(_M, "maxSeqLen", "prompt and generated tokens", ("--max-seq-len",), as_integer),
    *_keys(_M, "maxInputTokenLen", "prompt tokens", ("--max-input-len",), as_integer),
    *_keys(
        _M,
        "truncation",
        "a longer prompt is refused (truncation false); a request keeps its last N tokens with TGI's truncate",
    ),
    *_keys(_C, "modelInstanceType", "StandardMock's stand-in is `tokenrelay worker --simulate`"),
    *_keys(_C, "modelName", "the name clients call the model by", ("--served-model-name",), as_text),
    *_keys(_C, "modelWeightPath", "the model's directory", ("--model",), as_text),
    *_keys(_C, "worldSize", "a native model split across this many devices", ("--tensor-parallel-size",), as_integer),
    *_keys(
        _C, "npuMemSize", "GiB of KV cache per device; -1: 0, as the memory allows", ("--kv-cache-memory",), kv_cache
    ),
    *_keys(_C, "cpuMemSize", "no KV cache swapped to host memory: a preempted sequence is computed again"),
    *_keys(_C, "backendType", "the model code is --model-impl's: native or transformers"),
    *_keys(_C, "trustRemoteCode", "a model directory's own code is never run"),
    *_keys(
        _C,
        "async_scheduler_wait_time kv_trans_timeout kv_link_timeout models",
        "NPU scheduling and prefill-decode transfer knobs: not built",
    ),
    *_keys(_Q, "templateType", "each step mixes decode tokens and prompt chunks (Mix, SplitFuse)"),
    *_keys(_Q, "templateName", "one scheduling workflow"),
    *_keys(_Q, "cacheBlockSize", "tokens per KV cache block", ("--block-size",), as_integer),
    *_keys(_Q, "maxPrefillBatchSize", "no count of prompts per step: maxPrefillTokens bounds their tokens"),
    *_keys(
        _Q,
        "maxPrefillTokens",
        "tokens a step computes, decode and prompt chunks together: a longer prompt takes several steps",
        ("--max-tokens-per-step",),
        as_integer,
    ),
    *_keys(
        _Q, "prefillTimeMsPerReq prefillPolicyType decodeTimeMsPerReq decodePolicyType supportSelectBatch", _NO_PD_STEPS
    ),
    *_keys(_Q, "maxBatchSize", "sequences that run at once", ("--max-batch-size",), as_integer),
    *_keys(_Q, "maxIterTimes", "generated tokens per request", ("--max-iter-times",), as_integer),
    *_keys(_Q, "maxPreemptCount", "a more urgent request preempts as many as it needs; they are computed again"),
    *_keys(_Q, "maxQueueDelayMicroseconds", "a step starts as the last ends: nothing waits to fill a batch"),
    *_keys(_Q, "maxFirstTokenWaitTime", "a waiting request gains urgency with --priority-aging instead"),
    *_keys(_Q, "maxN", "a request's n is bounded by the API (docs/api.md)"),
    *_keys(
        _L,
        "logLevel logFileSize logFileNum logPath dynamicLogLevel dynamicLogLevelValidHours dynamicLogLevelValidTime",
        _LOGS,
    ),
)
BY_PATH = {key.path: key for key in KEYS}


def key_of(path: str) -> Key | None:
    """The row of a key at `path` (a ModelConfig entry's index left out), or None for a key MindIE has not."""
    return BY_PATH.get(re.sub(r"\[\d+\]", "[]", path))
