"""--mindie-config: MindIE Service's config.json, used as it is, means the settings its keys say.

The example is MindIE's own (tests/data/mindie_config.json, from its
documentation; tests/data/README.md names the source). The mapping is read
back from the settings a command line makes (pure: no process), and once from
a `tokenrelay serve` started with the example, over its own mutual TLS.
"""

from __future__ import annotations

import copy
import json
import re
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
import structlog
import trustme

from tests.processes import TOKENRELAY, serving_https
from tests.test_readme import DOCS
from tokenrelay.flags.commands import parse_args
from tokenrelay.lifecycle import CannotStart
from tokenrelay.mindie_keys import KEYS
from tokenrelay.settings import settings_from
from workers.bundled import BUNDLED_MODEL

EXAMPLE = Path(__file__).parent / "data" / "mindie_config.json"
SCHEDULE, MODEL = "BackendConfig.ScheduleConfig", "BackendConfig.ModelDeployConfig.ModelConfig[0]"
# The example's keys that set a flag, or are read with those that do; each other key is ignored.
READ = {
    "ServerConfig.ipAddress", "ServerConfig.allowAllZeroIpListening", "ServerConfig.port", "ServerConfig.maxLinkNum",
    "ServerConfig.httpsEnabled", "ServerConfig.fullTextEnabled", "ServerConfig.tlsCaPath", "ServerConfig.tlsCaFile",
    "ServerConfig.tlsCert", "ServerConfig.tlsPk", "ServerConfig.e2eTimeout", "BackendConfig.modelInstanceNumber",
    "BackendConfig.npuDeviceIds", "BackendConfig.multiNodesInferEnabled", "BackendConfig.ModelDeployConfig.maxSeqLen",
    "BackendConfig.ModelDeployConfig.maxInputTokenLen", f"{MODEL}.modelName", f"{MODEL}.modelWeightPath",
    f"{MODEL}.worldSize", f"{MODEL}.npuMemSize", f"{SCHEDULE}.cacheBlockSize", f"{SCHEDULE}.maxPrefillTokens",
    f"{SCHEDULE}.maxBatchSize", f"{SCHEDULE}.maxIterTimes",
}  # fmt: skip


def example() -> dict:
    return json.loads(EXAMPLE.read_text())


def paths(node: dict, at: str = "") -> list[str]:
    """The keys of a config.json, sections walked into (ModelConfig's entries numbered), as the log names them."""
    found = []
    for name, value in node.items():
        path = f"{at}.{name}" if at else name
        if name in ("ServerConfig", "BackendConfig", "ModelDeployConfig", "ScheduleConfig", "LogConfig"):
            found += paths(value, path)
        elif name == "ModelConfig":
            found += [p for index, entry in enumerate(value) for p in paths(entry, f"{path}[{index}]")]
        else:
            found.append(path)
    return found


def changed(config: dict, path: str, value) -> dict:
    """A copy of `config` with the key at `path` ("ServerConfig.port", "...ModelConfig[0].x") set, or removed
    where `value` is ..."""
    config = copy.deepcopy(config)
    *sections, last = path.split(".")
    node = config
    for section in sections:
        name, _, index = section.partition("[")
        node = node[name] if not index else node[name][int(index[:-1])]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return config


def written(tmp_path: Path, config: dict | str) -> str:
    """`config` as MindIE keeps it, <install>/conf/config.json; its path."""
    path = tmp_path / "conf" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def test_the_documented_example_means_the_settings_its_keys_say():
    serve = settings_from(["serve", "--mindie-config", str(EXAMPLE)], {})
    install = EXAMPLE.parent.parent  # the directory above the file's
    assert (serve.server.host, serve.server.port, serve.server.max_request_bytes) == ("127.0.0.1", 1025, 40 * 2**20)
    assert serve.server.tls_cert == str(install / "security/certs/server.pem")
    assert serve.server.tls_key == str(install / "security/keys/server.key.pem")
    assert serve.server.tls_ca == str(install / "security/ca/ca.pem")  # tlsCaPath + tlsCaFile: mutual TLS
    gateway = serve.gateway
    assert (gateway.max_in_flight, gateway.full_text, gateway.default_timeout_s) == (3000, False, 600)
    model = serve.model
    assert model.served_names == ("llama_65b",) and model.path == "/data/atb_testdata/weights/llama1-65b-safetensors"
    assert (model.tensor_parallel_size, model.device) == (4, "auto")  # worldSize 4 on devices 0..3
    engine = serve.engine
    assert (engine.max_batch_size, engine.max_tokens_per_step, engine.block_size) == (200, 8192, 128)
    assert (engine.max_seq_len, engine.max_input_len, engine.max_iter_times, engine.kv_cache_bytes) == (
        2560,
        2048,
        512,
        None,
    )
    kafka = ["--kafka-bootstrap", "broker:9092", "--mindie-config", str(EXAMPLE)]
    assert settings_from(["gateway", *kafka], {}).server == serve.server  # each command takes its part
    assert settings_from(["gateway", *kafka], {}).gateway.max_in_flight == 3000
    worker = settings_from(["worker", *kafka], {})
    assert (worker.model, worker.engine) == (serve.model, serve.engine)


def test_every_key_of_the_example_is_set_read_or_ignored_once_with_its_reason():
    with structlog.testing.capture_logs() as events:
        settings_from(["serve", "--mindie-config", str(EXAMPLE)], {})
    ignored = [event["key"] for event in events if event["event"] == "mindie_config_key_ignored"]
    assert sorted(ignored) == sorted(set(paths(example())) - READ)  # each once, and only those
    assert all(event["reason"] for event in events if event["event"] == "mindie_config_key_ignored")
    assert not [event for event in events if event["event"] == "mindie_config_key_unknown"]
    read = next(event for event in events if event["event"] == "mindie_config_read")
    assert read["settings"][f"{SCHEDULE}.maxBatchSize"] == "--max-batch-size 200"
    assert read["settings"]["ServerConfig.maxLinkNum"] == "--max-in-flight 3000"
    assert read["settings"][f"{MODEL}.modelName"] == "--served-model-name llama_65b"
    assert read["flags_given_win"] == []


def test_a_key_the_command_has_no_flag_for_is_ignored_naming_the_flag():
    with structlog.testing.capture_logs() as events:
        settings_from(["worker", "--kafka-bootstrap", "b:9092", "--mindie-config", str(EXAMPLE)], {})
    reasons = {event["key"]: event["reason"] for event in events if event["event"] == "mindie_config_key_ignored"}
    assert reasons["ServerConfig.port"] == "`tokenrelay worker` has no --port"
    assert reasons["ServerConfig.tlsCert"] == "`tokenrelay worker` has no --tls-cert"


def test_flags_given_beside_the_file_or_in_the_environment_win():
    given = ["serve", "--mindie-config", str(EXAMPLE), "--max-batch-size", "7", "--served-model-name", "a", "b"]
    with structlog.testing.capture_logs() as events:
        settings = settings_from(given, {"TOKENRELAY_BLOCK_SIZE": "16"})
    assert (settings.engine.max_batch_size, settings.engine.block_size, settings.engine.max_iter_times) == (7, 16, 512)
    assert settings.model.served_names == ("a", "b")
    read = next(event for event in events if event["event"] == "mindie_config_read")
    assert read["flags_given_win"] == [f"{MODEL}.modelName", f"{SCHEDULE}.cacheBlockSize", f"{SCHEDULE}.maxBatchSize"]


@pytest.mark.parametrize(
    ("path", "value", "check"),
    [
        (
            "BackendConfig.npuDeviceIds",
            [[4, 5]],
            lambda s: (s.model.device, s.model.tensor_parallel_size) == ("cuda:4", 2),
        ),
        (f"{MODEL}.npuMemSize", 8, lambda s: s.engine.kv_cache_bytes == 8 * 2**30),
        ("ServerConfig.fullTextEnabled", True, lambda s: s.gateway.full_text),
        ("ServerConfig.e2eTimeout", 30, lambda s: s.gateway.default_timeout_s == 30),
        ("ServerConfig.maxRequestLength", 8, lambda s: s.server.max_request_bytes == 8 * 2**20),
        ("ServerConfig.tlsCert", "/etc/tls/cert.pem", lambda s: s.server.tls_cert == "/etc/tls/cert.pem"),
        ("ServerConfig.httpsEnabled", False, lambda s: s.server.tls_cert == s.server.tls_key == s.server.tls_ca == ""),
        ("ServerConfig.ipAddress", "0.0.0.0", lambda s: s.server.host == "0.0.0.0"),
    ],
)
def test_a_value_becomes_its_setting(tmp_path, path, value, check):
    config = changed(example(), path, value)
    if path.endswith("npuDeviceIds"):
        config = changed(config, f"{MODEL}.worldSize", 2)
    if value == "0.0.0.0":
        config = changed(config, "ServerConfig.allowAllZeroIpListening", True)
    with structlog.testing.capture_logs() as events:
        assert check(settings_from(["serve", "--mindie-config", written(tmp_path, config)], {}))
    if path == "ServerConfig.httpsEnabled":  # MindIE reads no TLS key then: each said unread
        reasons = {event["key"]: event["reason"] for event in events if event["event"] == "mindie_config_key_ignored"}
        assert (
            reasons["ServerConfig.tlsCaFile"]
            == reasons["ServerConfig.tlsPk"]
            == "ServerConfig.httpsEnabled is not true: http"
        )


# A key's value out of its flag's range, with the words both refusals say.
OUT_OF_RANGE = [
    (f"{SCHEDULE}.maxBatchSize", -1, "--max-batch-size", "-1 is below 0"),
    (f"{SCHEDULE}.maxIterTimes", 0, "--max-iter-times", "0 is below 1"),
    (f"{SCHEDULE}.maxPrefillTokens", -5, "--max-tokens-per-step", "-5 is below 0"),
    (f"{SCHEDULE}.cacheBlockSize", 0, "--block-size", "0 is below 1"),
    ("BackendConfig.ModelDeployConfig.maxSeqLen", 0, "--max-seq-len", "0 is below 1"),
    ("BackendConfig.ModelDeployConfig.maxInputTokenLen", -2, "--max-input-len", "-2 is below 1"),
    ("ServerConfig.port", 70000, "--port", "70000 is not in [0, 65535]"),
    ("ServerConfig.e2eTimeout", 0, "--request-timeout", "0 is below 1"),
    ("ServerConfig.maxRequestLength", 0, "--max-request-length", "0 is below 1"),
    (f"{MODEL}.worldSize", 65, "--tensor-parallel-size", "65 is not in [1, 64]"),
]


@pytest.mark.parametrize(("path", "value", "flag", "words"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_its_flag_s_refusal_naming_the_key(tmp_path, capsys, path, value, flag, words):
    config = changed(example(), path, value)
    if path.endswith("worldSize"):
        config = changed(config, "BackendConfig.npuDeviceIds", ...)
    with pytest.raises(CannotStart) as refused:
        settings_from(["serve", "--mindie-config", written(tmp_path, config)], {})
    assert str(refused.value) == f"{path}: {words} ({flag})"
    with pytest.raises(SystemExit):
        parse_args(["serve", flag, str(value)], {})
    assert f"argument {flag}: {words}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (f"{SCHEDULE}.maxBatchSize", "200", f"{SCHEDULE}.maxBatchSize: '200' is not an integer"),
        ("ServerConfig.fullTextEnabled", "yes", "ServerConfig.fullTextEnabled: 'yes' is not true or false"),
        ("ServerConfig.maxLinkNum", 0, "ServerConfig.maxLinkNum: 0 is below 1"),
        (f"{MODEL}.npuMemSize", -2, f"{MODEL}.npuMemSize: -2: -1 (as the memory allows) or GB per device, at least 0"),
        ("BackendConfig.npuDeviceIds", [[0, 1, 2]], f"BackendConfig.npuDeviceIds: 3 devices for {MODEL}.worldSize 4"),
        (
            "BackendConfig.npuDeviceIds",
            [[0, 2, 3, 4]],
            "BackendConfig.npuDeviceIds: [0, 2, 3, 4]: a worker's ranks take",
        ),
        ("BackendConfig.npuDeviceIds", [[0, 1], [2, 3]], "BackendConfig.npuDeviceIds: [[0, 1], [2, 3]]: one list"),
        ("BackendConfig.modelInstanceNumber", 2, "BackendConfig.modelInstanceNumber: 2 instances: a worker is one"),
        ("BackendConfig.multiNodesInferEnabled", True, "BackendConfig.multiNodesInferEnabled: true: a model split"),
        ("ServerConfig.ipAddress", "0.0.0.0", "ServerConfig.ipAddress: 0.0.0.0 (every address) needs ServerConfig."),
        (
            "ServerConfig.tlsCaFile",
            ["a.pem", "b.pem"],
            "ServerConfig.tlsCaFile: ['a.pem', 'b.pem']: --tls-ca takes one",
        ),
        ("ServerConfig", 5, "ServerConfig: an object of keys, not 5"),
        ("BackendConfig.ModelDeployConfig.ModelConfig", {}, "BackendConfig.ModelDeployConfig.ModelConfig: a list of"),
    ],
)
def test_a_value_that_cannot_be_served_is_refused_naming_the_key(tmp_path, path, value, reason):
    with pytest.raises(CannotStart) as refused:
        settings_from(["serve", "--mindie-config", written(tmp_path, changed(example(), path, value))], {})
    assert str(refused.value).startswith(reason), str(refused.value)


def test_several_models_are_refused_by_a_worker_and_served_by_a_gateway(tmp_path):
    config = example()
    models = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    models.append({**models[0], "modelName": "other"})
    path = written(tmp_path, config)
    for command in (["serve"], ["worker", "--kafka-bootstrap", "b:9092"]):
        with pytest.raises(CannotStart, match=r"ModelConfig: 2 models; a worker serves one"):
            settings_from([*command, "--mindie-config", path], {})
    with structlog.testing.capture_logs() as events:
        settings_from(["gateway", "--kafka-bootstrap", "b:9092", "--mindie-config", path], {})
    ignored = {event["key"] for event in events if event["event"] == "mindie_config_key_ignored"}
    assert {f"BackendConfig.ModelDeployConfig.ModelConfig[{i}].modelName" for i in (0, 1)} <= ignored


def test_an_unknown_key_is_named_once(tmp_path):
    config = changed(changed(example(), "ServerConfig.fooBar", 1), f"{SCHEDULE}.maxBatchSzie", 8)
    with structlog.testing.capture_logs() as events:
        settings_from(["serve", "--mindie-config", written(tmp_path, config)], {})
    unknown = [event["key"] for event in events if event["event"] == "mindie_config_key_unknown"]
    assert unknown == ["ServerConfig.fooBar", f"{SCHEDULE}.maxBatchSzie"]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"ServerConfig": {"port": 1025,}}', r"not JSON: Expecting property name enclosed in double quotes: line 1"),
        ("[1, 2]", r"not a JSON object of MindIE's sections"),
        (None, r"No such file or directory"),
    ],
)
def test_a_file_that_is_no_config_is_refused_in_one_line(tmp_path, content, reason):
    path = written(tmp_path, content) if content is not None else str(tmp_path / "missing.json")
    with pytest.raises(CannotStart, match=rf"^--mindie-config {re.escape(path)}: {reason}"):
        settings_from(["serve", "--mindie-config", path], {})


MINDIE_PAGE = DOCS / "coming-from-mindie.md"


def table_rows(text: str) -> dict[str, tuple[str, str]]:
    """The page's config.json table: each key, with its setting and its note."""
    table = text[text.index("| MindIE key | setting |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        keys, setting, note = (cell.strip() for cell in line.strip("|").split(" | "))
        rows.update({key: (setting, note) for key in re.findall(r"`([^`]+)`", keys)})
    return rows


EXPECTED_ROWS = {key.path: (", ".join(f"`{f}`" for f in key.flags) or "ignored", key.note) for key in KEYS}


def test_the_pages_table_is_the_mapping():
    """Every key of tokenrelay/mindie_keys.py in docs/coming-from-mindie.md's table, with its flags (or ignored)
    and its note."""
    assert table_rows(MINDIE_PAGE.read_text(encoding="utf-8")) == EXPECTED_ROWS


@pytest.mark.parametrize(
    ("planted", "replacement"),
    [
        ("| `ServerConfig.port` | `--port` |", "| `ServerConfig.port` | ignored |"),  # a setting
        ("| tokens per KV cache block |", "| tokens per block |"),  # a note
        ("| `BackendConfig.kvPoolConfig` | ignored |", "| `BackendConfig.kvPool` | ignored |"),  # a key
    ],
)
def test_a_wrong_table_row_fails(planted, replacement):
    text = MINDIE_PAGE.read_text(encoding="utf-8")
    assert text.count(planted) == 1, f"the page changed: plant {planted!r} elsewhere"
    assert table_rows(text.replace(planted, replacement)) != EXPECTED_ROWS


def test_a_bad_value_stops_the_command_in_one_line_naming_its_key_exit_1(tmp_path):
    path = written(tmp_path, changed(example(), f"{SCHEDULE}.maxBatchSize", -1))
    ended = subprocess.run([TOKENRELAY, "serve", "--mindie-config", path], capture_output=True, text=True, timeout=60)
    lines = (ended.stdout + ended.stderr).splitlines()
    assert ended.returncode == 1 and len(lines) == 1, lines
    said = json.loads(lines[0])
    assert said["event"] == "cannot_start"
    assert said["error"] == f"{SCHEDULE}.maxBatchSize: -1 is below 0 (--max-batch-size)"


def test_the_documented_example_starts_serve_with_the_settings_it_means(tmp_path):
    """MindIE's example as MindIE keeps it, <install>/conf/config.json, its TLS files where it says (written by a
    throwaway CA). Three keys changed: modelWeightPath, to the bundled model's directory (the example's is a path
    this machine has not), and worldSize 1 on npuDeviceIds [[0]] (the example's 4 ranks on 4 devices start in the
    settings test above: as 4 processes here, they take most of a minute on 2 shared cores). Beside it, --port
    (a free one: the example's 1025 may be taken), which wins over the file, as the log says."""
    ca, install = trustme.CA(), tmp_path
    for relative in ("security/ca", "security/certs", "security/keys"):
        (install / relative).mkdir(parents=True)
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(install / "security/certs/server.pem")
    server.private_key_pem.write_to_path(install / "security/keys/server.key.pem")
    ca.cert_pem.write_to_path(install / "security/ca/ca.pem")
    client = ssl.create_default_context(cafile=str(install / "security/ca/ca.pem"))
    ca.issue_cert("client@example").configure_cert(client)
    config = changed(changed(example(), f"{MODEL}.modelWeightPath", str(BUNDLED_MODEL)), f"{MODEL}.worldSize", 1)
    config = written(install, changed(config, "BackendConfig.npuDeviceIds", [[0]]))
    with serving_https(tmp_path, ["--mindie-config", config], client, {}, model="llama_65b") as served:
        base, process = served.base_url, served.process
        assert httpx.get(f"{base}/v2/models/llama_65b", verify=client).json()["name"] == "llama_65b"
        tokenized = httpx.post(f"{base}/tokenize", json={"model": "llama_65b", "prompt": "hi"}, verify=client)
        assert tokenized.json()["max_model_len"] == 2560
        answer = httpx.post(f"{base}/infer", json={"inputs": "My name is", "stream": False}, verify=client, timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"], answer.text
        with pytest.raises(httpx.TransportError):  # tlsCaFile: a client without a certificate of its CA is refused
            httpx.get(f"{base}/health", verify=ssl.create_default_context(cafile=str(install / "security/ca/ca.pem")))
        read = process.events_named("mindie_config_read")[0]
        assert read["flags_given_win"] == ["ServerConfig.port"]
        assert read["settings"][f"{SCHEDULE}.maxBatchSize"] == "--max-batch-size 200"
        ignored = [event["key"] for event in process.events_named("mindie_config_key_ignored")]
        assert sorted(ignored) == sorted(set(paths(example())) - READ)
        assert process.events_named("loading_model")[0]["model"] == str(BUNDLED_MODEL)
        assert process.events_named("kv_cache_allocated")[0]["block_size"] == 128  # cacheBlockSize
