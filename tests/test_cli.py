"""Flags, and the TOKENRELAY_<FLAG> environment variables behind them."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.processes import TOKENRELAY, free_port
from tokenrelay.cli import build_parser


def _parse(monkeypatch, argv: list[str], env: dict[str, str] | None = None):
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv)


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
    monkeypatch.delenv("TOKENRELAY_KAFKA_BOOTSTRAP", raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway"])
    assert "--kafka-bootstrap" in capsys.readouterr().err


def test_help_names_the_environment_variable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "TOKENRELAY_SERVED_MODEL_NAME" in capsys.readouterr().out


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
