"""Every flag of every command does something, from the command line and from the environment alike.

The walk: for each flag a command takes, a value other than its default must
change the command's settings (tokenrelay/settings.py), the same value from
its environment variable must give the very same settings, and a value of the
wrong type must be refused from either place. A flag that a command accepted
and ignored (serve's --partitions, the gateway's consumer-group timeouts)
fails the first assertion.
"""

from __future__ import annotations

import argparse
import functools
import pickle
from pathlib import Path

import pytest

from bus.settings import InProcessSettings, KafkaSettings
from tokenrelay.flags.commands import build_parser
from tokenrelay.lifecycle import CannotStart
from tokenrelay.settings import settings_from
from workers.bundled import BUNDLED_ADAPTERS, BUNDLED_DRAFT_MODEL, BUNDLED_VISION_MODEL, BUNDLED_VISION_MODEL_NAME

COMMANDS = ("serve", "gateway", "worker", "simulate")
KAFKA = ["--kafka-bootstrap", "broker-a:9092"]
# Values for the flags whose type says too little (a string) or whose default is not a good start (a list).
SAMPLES = {
    "--model": ["/models/llama"],
    "--device": ["cpu"],
    "--served-model-name": ["llama", "alias"],
    "--api-keys": ["key-1", "key-2"],
    "--metrics-address": ["127.0.0.1:9100"],
    "--kafka-bootstrap": ["broker-b:9092"],
    "--allowed-media-domains": ["example.com,images.example.org"],
    "--tensor-parallel-size": ["2"],
    "--distributed-init": ["tcp://127.0.0.1:29500"],
    "--lora-root": [str(BUNDLED_VISION_MODEL)],  # a directory that exists
    "--lora": [f"shout={BUNDLED_ADAPTERS['shout']}", f"code={BUNDLED_ADAPTERS['code']}"],
    "--tenants-file": [str(Path(__file__).parents[1] / "deploy" / "tenants.example.toml")],
    "--speculative-model": [str(BUNDLED_DRAFT_MODEL)],
    "--mindie-config": [str(Path(__file__).parent / "data" / "mindie_config.json")],  # MindIE's example
}
SIMULATE = {"worker": "bundled-cpu", "simulate": "llama-1.1b-h200"}  # a profile other than the default
TLS = {"--tls-cert": "cert.pem", "--tls-key": "key.pem", "--tls-ca": "ca.pem"}  # they go together
FIRST = {**TLS, "--kafka-bootstrap": "broker-a:9092"}  # flags that need a value: one before the sample


@functools.cache
def _subparser(command: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return commands[command]


def _flags(command: str) -> list[argparse.Action]:
    return [a for a in _subparser(command)._actions if a.option_strings and a.dest != "help"]


def _variable(command: str, action: argparse.Action) -> str:
    return next(name for name, a in _subparser(command).environment.items() if a is action)


def _sample(command: str, action: argparse.Action) -> list[str]:
    """Arguments that give `action` a valid value other than its default."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return []
    if flag in SAMPLES:
        return SAMPLES[flag]
    if flag == "--simulate":
        return [SIMULATE[command]]
    if flag in TLS:
        return [f"other-{TLS[flag]}"]
    if action.choices:
        return [next(c for c in action.choices if c and c != action.default)]
    if type(action.default) is int:  # int, or a type of ours that returns one (a bounded count)
        return [str(action.default + 1)]
    if action.type is not None:  # a float, or a fraction of (0, 1]
        return [str(action.default / 2 if action.default else 0.5)]
    return [f"{action.default}-other" if action.default else "other"]


def _base(command: str, flag: str) -> list[str]:
    """The command line without the flag: the required flags, and the ones that must go with the flag."""
    base = [command, *(KAFKA if command != "serve" and flag != "--kafka-bootstrap" else [])]
    if flag in TLS:
        base += [argument for other, value in TLS.items() if other != flag for argument in (other, value)]
    return base


def _before(command: str, flag: str) -> list[str]:
    """The command line the sample changes: the flag's default, or a first value where it needs one."""
    return [*_base(command, flag), *([flag, FIRST[flag]] if flag in FIRST else [])]


def _environment_value(arguments: list[str]) -> str:
    return ",".join(arguments) if arguments else "true"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_changes_the_settings_and_its_variable_changes_them_the_same_way(command):
    walked = []
    for action in _flags(command):
        flag = action.option_strings[0]
        base = _base(command, flag)
        before = settings_from(_before(command, flag), {})
        sample = _sample(command, action)
        on_the_line = settings_from([*base, flag, *sample], {})
        assert on_the_line != before, f"`tokenrelay {command} {flag} {' '.join(sample)}` changes no setting"
        from_the_environment = settings_from(base, {_variable(command, action): _environment_value(sample)})
        assert from_the_environment == on_the_line, f"{command} {flag}: the variable and the flag differ"
        walked.append(flag)
    assert len(walked) == len(set(walked)) >= 20


@pytest.mark.parametrize("command", COMMANDS)
def test_every_typed_flag_refuses_a_wrong_value_on_the_line_and_in_the_environment(command, capsys):
    typed = [a for a in _flags(command) if a.type is not None or a.choices]
    assert typed
    for action in typed:
        flag, variable = action.option_strings[0], _variable(command, action)
        base = _base(command, flag)
        for given in ([*base, flag, "not-a-value"], base):
            with pytest.raises(SystemExit) as refused:
                settings_from(given, {variable: "not-a-value"} if given is base else {})
            assert refused.value.code == 2, (command, flag)
            error = capsys.readouterr().err
            assert f"argument {flag}:" in error and "not-a-value" in error, error
        assert f"(from the environment: {variable})" in error


def test_each_command_s_settings_hold_its_parts_only():
    serve = settings_from(["serve"], {})
    assert isinstance(serve.bus, InProcessSettings) and serve.server and serve.gateway and serve.worker
    assert serve.engine_process().server is None and serve.engine_process().gateway is None  # no keys travel
    assert pickle.loads(pickle.dumps(serve.engine_process())) == serve.engine_process()  # to the engine process
    gateway = settings_from(["gateway", *KAFKA], {})
    assert isinstance(gateway.bus, KafkaSettings) and gateway.worker is gateway.model is gateway.engine is None
    assert gateway.bus.session_timeout_ms == KafkaSettings.session_timeout_ms  # gateways join no group
    worker = settings_from(["worker", *KAFKA, "--kafka-session-timeout-ms", "9000"], {})
    assert worker.server is worker.gateway is None and worker.bus.session_timeout_ms == 9000
    simulate = settings_from(["simulate", *KAFKA, "--workers", "3"], {})
    assert simulate.workers == 3 and simulate.model.simulate.name == "bundled-cpu"
    assert simulate.model.served_names == ("bundled-cpu",) and simulate.engine.kv_cache_bytes is None


def test_the_bundled_models_are_named_as_their_flags_say():
    text = settings_from(["serve"], {}).model
    assert text.served_names == ("tokenrelay-tiny",) and text.device == "auto" and text.dtype is None
    vision = settings_from(["serve", "--vision"], {}).model
    assert vision.path == str(BUNDLED_VISION_MODEL) and vision.served_names == (BUNDLED_VISION_MODEL_NAME,)
    other = settings_from(["worker", *KAFKA, "--model", "Qwen/Qwen2.5-0.5B", "--dtype", "bfloat16"], {}).model
    assert other.path == "Qwen/Qwen2.5-0.5B" and other.served_names == ("Qwen/Qwen2.5-0.5B",)
    assert other.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["serve", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["serve", "--tls-ca", "ca.pem"], "--tls-ca (mutual TLS) needs --tls-cert and --tls-key"),
        (["worker", *KAFKA, "--simulate", "no-such-profile"], "--simulate: no simulation profile 'no-such-profile'"),
        (["worker", *KAFKA, "--metrics-address", "9100"], "--metrics-address '9100' is not HOST:PORT"),
        (["simulate", *KAFKA, "--metrics-address", "host:http"], "--metrics-address 'host:http' is not HOST:PORT"),
        (["simulate", *KAFKA, "--workers", "0"], "--workers 0: at least 1"),
        (["worker", *KAFKA, "--model", "/models/x", "--vision"], "--vision serves the bundled vision-language model"),
        (["gateway", *KAFKA, "--lora-root", "/no/such/dir"], "--lora-root /no/such/dir: no such directory"),
        (["serve", "--num-speculative-tokens", "0"], "--num-speculative-tokens 0: from 1 to 16"),
        (["serve", "--device", "npu"], "--device npu: tokenrelay runs on NVIDIA GPUs with CUDA"),
        (["worker", *KAFKA, "--device", "cuda:x"], "--device cuda:x: tokenrelay runs on NVIDIA GPUs with CUDA"),
        (["serve", "--device", "npu:0"], "--device npu:0: tokenrelay runs on NVIDIA GPUs with CUDA"),
        (["serve", "--ngram-min", "5"], "--ngram-min 5, --ngram-max 4: 1 <= --ngram-min <= --ngram-max <= 16"),
        (["serve", "--speculative-model", "/no/such/dir"], "--speculative-model /no/such/dir: no such directory"),
        (
            ["worker", *KAFKA, "--simulate", "bundled-cpu", "--speculative", "ngram"],
            "--speculative, --speculative-model",
        ),
        (
            ["serve", "--speculative", "ngram", "--speculative-model", str(BUNDLED_DRAFT_MODEL)],
            "--speculative ngram and --speculative-model: one way of proposing, not two",
        ),
    ],
)
def test_settings_that_cannot_be_had_are_refused_before_anything_starts(argv, reason):
    with pytest.raises(CannotStart) as refused:
        settings_from(argv, {})
    assert str(refused.value).startswith(reason), str(refused.value)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_the_devices_that_run_are_taken_as_given(device):
    assert settings_from(["serve", "--device", device], {}).model.device == device


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["serve", "--port", "70000"], "--port: 70000 is not in [0, 65535]"),
        (["gateway", *KAFKA, "--max-in-flight", "0"], "--max-in-flight: 0 is below 1"),
        (["serve", "--max-request-length", "0"], "--max-request-length: 0 is below 1"),
        (["serve", "--kv-cache-memory", "-1"], "--kv-cache-memory: -1.0 is below 0"),
        (["worker", *KAFKA, "--max-batch-size", "-1"], "--max-batch-size: -1 is below 0"),
        (["serve", "--max-seq-len", "0"], "--max-seq-len: 0 is below 1"),
        (["serve", "--max-input-len", "0"], "--max-input-len: 0 is below 1"),
        (["simulate", *KAFKA, "--max-iter-times", "0"], "--max-iter-times: 0 is below 1"),
        (["serve", "--max-tokens-per-step", "-1"], "--max-tokens-per-step: -1 is below 0"),
        (["serve", "--block-size", "0"], "--block-size: 0 is below 1"),
        (["serve", "--tensor-parallel-size", "65"], "--tensor-parallel-size: 65 is not in [1, 64]"),
    ],
)
def test_a_size_or_count_out_of_its_range_is_refused_naming_the_range(argv, refusal, capsys):
    with pytest.raises(SystemExit) as refused:
        settings_from(argv, {})
    assert refused.value.code == 2 and f"argument {refusal}" in capsys.readouterr().err
