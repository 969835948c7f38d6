"""Flags, and the TOKENRELAY_<FLAG> environment variables behind them."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from tests.processes import TOKENRELAY, free_port
from tokenrelay.flags.commands import parse_args


def _parse(monkeypatch, argv: list[str], env: dict[str, str] | None = None):
    for name in list(os.environ):
        if name.startswith("TOKENRELAY_"):
            monkeypatch.delenv(name)
    return parse_args(argv, env or {})


def test_defaults_are_mindie_s(monkeypatch):
    args = _parse(monkeypatch, ["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 1025)
    assert (args.max_iter_times, args.max_seq_len, args.max_input_len) == (512, 2560, 2048)


def test_every_flag_can_come_from_the_environment(monkeypatch):
    args = _parse(
        monkeypatch,
        ["worker"],
        {
            "TOKENRELAY_KAFKA_BOOTSTRAP": "broker:9092",
            "TOKENRELAY_SERVED_MODEL_NAME": "llama_65b,tiny",
            "TOKENRELAY_MAX_BATCH_SIZE": "7",
            "TOKENRELAY_HEARTBEAT_INTERVAL": "0.5",
        },
    )
    assert args.kafka_bootstrap == "broker:9092"
    assert args.served_model_name == ["llama_65b", "tiny"]
    assert args.max_batch_size == 7 and args.heartbeat_interval == 0.5


def test_engine_sizes_default_per_device_and_the_gpu_memory_fraction_is_checked(monkeypatch, capsys):
    args = _parse(monkeypatch, ["serve"])
    assert (args.max_batch_size, args.max_tokens_per_step) == (0, 0)  # EngineConfig.for_device decides
    assert args.gpu_memory_fraction == 0.9 and args.no_cuda_graphs is False
    args = _parse(monkeypatch, ["serve", "--gpu-memory-fraction", "0.5", "--no-cuda-graphs"])
    assert args.gpu_memory_fraction == 0.5 and args.no_cuda_graphs is True
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["serve", "--gpu-memory-fraction", "1.5"])
    assert "--gpu-memory-fraction: 1.5 is not in (0, 1]" in capsys.readouterr().err


def test_the_command_line_wins_over_the_environment(monkeypatch):
    args = _parse(monkeypatch, ["gateway", "--port", "9000", "--kafka-bootstrap", "a:1"], {"TOKENRELAY_PORT": "8000"})
    assert args.port == 9000


def test_kafka_commands_need_a_broker(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["gateway"])
    assert "--kafka-bootstrap" in capsys.readouterr().err
    assert _parse(monkeypatch, ["gateway"], {"TOKENRELAY_KAFKA_BOOTSTRAP": "a:1"}).kafka_bootstrap == "a:1"


def test_help_names_the_environment_variable(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"], {})
    assert "TOKENRELAY_SERVED_MODEL_NAME" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("TOKENRELAY_DTYPE", "bf16", "argument --dtype: invalid choice: 'bf16'"),
        ("TOKENRELAY_MAX_BATCH_SIZE", "many", "argument --max-batch-size: invalid int value: 'many'"),
        ("TOKENRELAY_GPU_MEMORY_FRACTION", "1.5", "argument --gpu-memory-fraction: 1.5 is not in (0, 1]"),
        ("TOKENRELAY_MAX_WAITING_REQUESTS", "-1", "argument --max-waiting-requests: -1 is below 0"),
        ("TOKENRELAY_LOG_LEVEL", "loud", "argument --log-level: invalid choice: 'loud'"),
    ],
)
def test_an_environment_value_is_checked_as_its_flag_is_and_the_error_names_the_variable(
    monkeypatch, capsys, variable, value, error
):
    flag = "--" + variable.removeprefix("TOKENRELAY_").lower().replace("_", "-")
    with pytest.raises(SystemExit) as on_the_line:
        _parse(monkeypatch, ["serve", flag, value])
    assert on_the_line.value.code == 2 and error in capsys.readouterr().err
    with pytest.raises(SystemExit) as from_the_environment:
        _parse(monkeypatch, ["serve"], {variable: value})
    assert from_the_environment.value.code == 2
    assert f"{error}" in (err := capsys.readouterr().err) and f"(from the environment: {variable})" in err


def test_switches_from_the_environment_take_the_usual_words_and_refuse_others(monkeypatch, capsys):
    for word, expected in [("1", True), ("Yes", True), ("on", True), ("0", False), ("false", False), ("", False)]:
        assert _parse(monkeypatch, ["serve"], {"TOKENRELAY_NO_CUDA_GRAPHS": word}).no_cuda_graphs is expected
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["serve"], {"TOKENRELAY_NO_CUDA_GRAPHS": "maybe"})
    assert "TOKENRELAY_NO_CUDA_GRAPHS='maybe' is not a switch's value" in capsys.readouterr().err


def test_environment_values_that_begin_with_a_dash_or_list_nothing(monkeypatch):
    args = _parse(monkeypatch, ["serve"], {"TOKENRELAY_DEFAULT_MODEL": "-odd-name", "TOKENRELAY_API_KEYS": ""})
    assert args.default_model == "-odd-name" and args.api_keys == []


def test_help_answers_even_when_a_variable_is_wrong(capsys):
    with pytest.raises(SystemExit) as ended:
        parse_args(["worker", "--help"], {"TOKENRELAY_DTYPE": "bf16"})
    assert ended.value.code == 0 and "--dtype" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["worker", "gateway"])
def test_an_unreachable_broker_is_one_line_naming_its_address_and_cause_then_exit_1(command):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    ended = subprocess.run(
        [TOKENRELAY, command, "--kafka-bootstrap", address], capture_output=True, text=True, timeout=10
    )
    assert ended.returncode == 1
    lines = [json.loads(line) for line in ended.stderr.splitlines()]  # JSON only: no traceback
    assert [line["event"] for line in lines] == ["connecting_to_kafka", "kafka_unreachable"]
    assert lines[-1]["error"] == f"cannot reach Kafka at {address}: Connection refused"


@pytest.mark.parametrize("command", [["serve"], ["worker", "--kafka-bootstrap", "127.0.0.1:9"]])
def test_a_device_tokenrelay_does_not_run_on_is_one_line_naming_what_runs_then_exit_1(command):
    """Refused from the flags, before a broker is looked for or a model loads: an Ascend NPU is no CUDA device."""
    ended = subprocess.run([TOKENRELAY, *command, "--device", "npu"], capture_output=True, text=True, timeout=30)
    assert ended.returncode == 1
    [line] = [json.loads(line) for line in ended.stderr.splitlines()]  # JSON only: no traceback
    assert line["event"] == "cannot_start" and line["level"] == "error"
    assert line["error"] == (
        "--device npu: tokenrelay runs on NVIDIA GPUs with CUDA (cuda, cuda:N) and on any CPU (cpu), auto taking "
        "CUDA where there is one; not on Ascend NPUs or other devices"
    )


@pytest.mark.parametrize("command", [["serve"], ["gateway", "--kafka-bootstrap", "127.0.0.1:9"]])
def test_a_port_in_use_is_one_line_naming_it_before_anything_loads_then_exit_1(command):
    """Said before a model loads or a broker is looked for: the one line is all the process writes."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ended = subprocess.run([TOKENRELAY, *command, "--port", str(port)], capture_output=True, text=True, timeout=30)
    assert ended.returncode == 1
    [line] = [json.loads(line) for line in ended.stderr.splitlines()]  # JSON only: no traceback
    assert line["event"] == "cannot_start" and line["level"] == "error"
    assert line["error"] == f"127.0.0.1:{port} is in use: another process listens there (--host, --port)"
