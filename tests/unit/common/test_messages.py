"""What the mesh tells a user: max_tokens' own limits, retry delays people can read (and that read
back), and the command-line checks that run before a client sends anything."""

from __future__ import annotations

import argparse
import re

import grpc
import pytest

from services.common.errors import InvalidArgument, ResourceExhausted, format_delay, from_rpc_error
from services.common.validation import api_key, api_key_metadata, check_sampling, float_in, int_in, prompt_text
from vlmesh.v1 import common_pb2 as pb


@pytest.mark.parametrize("value", [0, 512, 9999])
def test_max_tokens_out_of_range_names_only_its_own_limits(value):
    with pytest.raises(InvalidArgument) as info:
        check_sampling(pb.SamplingParams(max_tokens=value), 512)
    msg = info.value.message
    assert msg.startswith(f"sampling.max_tokens={value} is out of range:")
    assert "at least 1" in msg and "below the model's context of 512 tokens" in msg
    # No upper bound the prompt would contradict later (the old "use 1..511").
    assert "511" not in msg and ".." not in msg


@pytest.mark.parametrize("value", [1, 200, 511])
def test_max_tokens_within_the_context_passes_the_gateway(value):
    assert check_sampling(pb.SamplingParams(max_tokens=value), 512).max_tokens == value


DELAYS = [(0.0, "1 ms"), (0.0004, "1 ms"), (0.04, "40 ms"), (0.0401, "41 ms"), (0.5, "500 ms")]
DELAYS += [(0.9999, "1.0 s"), (1.0, "1.0 s"), (1.04, "1.1 s"), (2.5, "2.5 s"), (30, "30.0 s")]


@pytest.mark.parametrize("seconds,text", DELAYS)
def test_format_delay(seconds, text):
    assert format_delay(seconds) == text


def test_a_refusal_never_says_zero_seconds():
    err = ResourceExhausted("tenant 'acme' is over its request rate", retry_after_s=0.004)
    assert err.message == "tenant 'acme' is over its request rate (retry after 4 ms)"
    assert not re.search(r"\b0\.0 ?s\b", err.message)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return ()  # no RetryInfo: the delay comes back from the message


@pytest.mark.parametrize("seconds", [0.0004, 0.04, 0.25, 1.0, 2.5, 12.0])
def test_the_delay_reads_back_from_the_message(seconds):
    """from_rpc_error's fallback parses what ResourceExhausted writes: same delay, same message."""
    sent = ResourceExhausted("arena full", retry_after_s=seconds)
    back = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, sent.message), "vision")
    assert isinstance(back, ResourceExhausted)
    assert back.message == sent.message  # the suffix is not doubled
    assert back.retry_after_s == pytest.approx(seconds, abs=0.001 if seconds < 1 else 0.1)
    assert back.retry_after_s >= seconds  # rounded up: waiting as told is never early


@pytest.mark.parametrize(
    "details,seconds", [("x (retry after 0.5s)", 0.5), ("x (retry after 40 ms)", 0.04), ("x", 1.0)]
)
def test_older_and_missing_delays_still_read(details, seconds):
    back = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, details), "vision")
    assert back.retry_after_s == pytest.approx(seconds)
    assert back.message.startswith("x (retry after ")


@pytest.mark.parametrize(
    "parse,text,needle",
    [
        (int_in(1, 4294967295), "-1", "-1 is out of range: use a whole number from 1 to 4294967295"),
        (int_in(1, 4294967295), "99999999999", "99999999999 is out of range"),
        (int_in(0, 2**64 - 1), "-1", "from 0 to 18446744073709551615"),
        (int_in(1), "x", "'x' is not a whole number: use a whole number >= 1"),
        (float_in(0.0, 100.0), "nan", "nan is out of range: use 0 to 100"),
        (float_in(0.0, 100.0), "101", "101 is out of range"),
        (float_in(0.0, lo_open=True), "0", "0 is out of range: use a number > 0"),
        (prompt_text, "   ", "prompt is empty"),
    ],
)
def test_command_line_values_name_the_range(parse, text, needle):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    assert needle in str(info.value)


def test_command_line_values_in_range():
    assert int_in(1, 10)("10") == 10 and float_in(0.0, 1.0)("0") == 0.0 and prompt_text("hi") == "hi"


def test_an_api_key_is_checked_without_being_echoed():
    assert api_key(" sk-1 ") == "sk-1" and api_key("") is None
    with pytest.raises(argparse.ArgumentTypeError) as info:
        api_key("sk secret")
    assert "secret" not in str(info.value) and "VLMESH_API_KEY" in str(info.value)
    assert api_key_metadata("sk-1") == (("authorization", "Bearer sk-1"),)
    assert api_key_metadata(None) == ()
