"""The `pagedserve` command line: flags generated from EngineConfig, the offline demo (the server:
test_serve_cli.py)."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest

from pagedserve import cli, serve_command
from pagedserve.config import BUNDLED_MODEL_ALIAS, EngineConfig


def test_every_engine_knob_is_a_flag():
    args = cli.build_parser().parse_args(["serve", "--block-size", "32", "--no-enable-prefix-caching",
                                          "--max-model-len", "512", "--kv-cache-memory", "1048576"])
    config = cli.config_from_args(args)
    assert (config.block_size, config.enable_prefix_caching, config.max_model_len, config.kv_cache_memory) == \
        (32, False, 512, 1 << 20)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in help_text


def test_the_model_may_be_positional_as_vllm_serve_takes_it(capsys):
    parser = cli.build_parser()
    assert cli.config_from_args(parser.parse_args(["serve", "./my-llama", "--port", "6000"])).model == "./my-llama"
    assert cli.config_from_args(parser.parse_args(["serve", "./a", "--model", "./a"])).model == "./a"
    assert cli.config_from_args(parser.parse_args(["serve"])).model == BUNDLED_MODEL_ALIAS  # the default
    vllm_style = cli.config_from_args(parser.parse_args(["serve", "--trust-remote-code", "--tokenizer", "/tmp"]))
    assert vllm_style.trust_remote_code and vllm_style.tokenizer == "/tmp"
    assert cli.main(["serve", "./a", "--model", "./b"]) == 2  # refused before any Ray starts
    assert "positional MODEL './a' and --model './b' differ" in capsys.readouterr().err


def test_bad_flag_value_exits_with_the_field_named(capsys):
    assert cli.main(["serve", "--block-size", "12"]) == 2  # refused before any Ray starts
    assert "block_size must be one of 8, 16, 32" in capsys.readouterr().err
    assert cli.main(["demo", "--block-size", "12"]) == 2


def test_tls_flags_go_together(capsys, tmp_path):
    assert cli.main(["serve", "--tls-cert", str(tmp_path / "cert.pem")]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert cli.main(["serve", "--tls-cert", str(tmp_path / "a"), "--tls-key", str(tmp_path / "b")]) == 2
    assert "cannot read the TLS files" in capsys.readouterr().err


def test_client_commands_take_auth_and_tls_flags():
    parser = cli.build_parser()
    for command in (["generate", "hi"], ["stats"]):
        args = parser.parse_args(command + ["--api-key", "k", "--tls-ca", "ca.pem", "--target", "h:1"])
        assert (args.api_key, args.tls_ca, args.target) == ("k", "ca.pem", "h:1")


def test_out_of_range_numbers_and_an_unreachable_cluster_are_one_line_errors(capsys, monkeypatch):
    # Refused before any connection is made: nothing listens at the target.
    for flags, message in ((["--seed", "-1"], "seed must be an integer in [0, 18446744073709551615]; got -1"),
                           (["--max-tokens", str(2**40)], "max_tokens must be an integer in [-2147483648, 2147483647]"),
                           (["--priority", str(2**40)], "priority must be an integer in [-2147483648, 2147483647]")):
        assert cli.main(["generate", "hi", "--target", "127.0.0.1:1", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--timeout", "-1"])
    assert "argument --timeout: must be > 0, got -1" in capsys.readouterr().err

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # so that joining leaves this process's environment alone
    started = time.monotonic()
    assert cli.main(["stop", "--address", f"127.0.0.1:{port}"]) == 1
    assert f"nothing accepts connections at 127.0.0.1:{port}" in capsys.readouterr().err
    assert time.monotonic() - started < serve_command.REACH_TIMEOUT_S  # refused at once, not retried for minutes


def test_demo_streams_prompts_and_prints_stats(tiny_llama, capsys):
    assert cli.main(["demo", "--model", tiny_llama, "--kv-cache-memory", str(1 << 22),
                     "--max-tokens", "5", "--prompt", "Hello", "--prompt", "World"]) == 0
    out = capsys.readouterr().out
    assert "### Hello" in out and "### World" in out
    assert "generation_tokens=10" in out and "kv_blocks_used=0" in out


def test_vllms_front_door_flags_cors_and_logging(capsys):
    from pagedserve.serve_command import _server_options

    parser = cli.build_parser()
    for flags, origins in (([], ("*",)), (["--allowed-origins", '["https://a.example", "http://b:3000"]'],
                                          ("https://a.example", "http://b:3000")),
                           (["--allowed-origins", "[]"], ()), (["--allowed-origins", "https://a.example"],
                                                               ("https://a.example",))):
        assert _server_options(parser.parse_args(["serve"] + flags), None).allowed_origins == origins
    assert _server_options(parser.parse_args(["serve"]), None).log_stats
    assert not _server_options(parser.parse_args(["serve", "--disable-log-stats"]), None).log_stats
    logged = _server_options(parser.parse_args(["serve", "--enable-log-requests", "--max-log-len", "40"]), None)
    assert (logged.log_requests, logged.log_requests_max_len) == (True, 40)
    assert not _server_options(parser.parse_args(["serve", "--disable-log-requests"]), None).log_requests
    with pytest.raises(SystemExit) as info:  # argparse's refusal, before anything starts
        cli.main(["serve", "--allowed-origins", '{"a": 1}'])
    assert info.value.code == 2
    assert "--allowed-origins: must be a JSON list of origins" in capsys.readouterr().err


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(tiny_llama, monkeypatch, capsys):
    """`pagedserve ... | head`: the reader closed the pipe; the command stops with exit status 1
    and no traceback (`pagedserve stats | head -2` printed BrokenPipeError's)."""
    import os
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left
    with open(write_end, "w", buffering=1) as pipe:  # line-buffered: the first line meets the closed pipe
        monkeypatch.setattr(sys, "stdout", pipe)
        status = cli.main(["demo", "--model", tiny_llama, "--kv-cache-memory", str(1 << 22), "--max-tokens", "2",
                           "--prompt", "Hello"])
        monkeypatch.undo()
    assert status == 1
    assert "Traceback" not in capsys.readouterr().err
