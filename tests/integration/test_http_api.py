"""The OpenAI-compatible HTTP door, driven by the official `openai` client, curl and plain HTTP,
against a real mesh on the demo model (whose answers show which picture it saw)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time

import grpc
import httpx
import numpy as np
import openai
import pytest

from services.launcher import Mesh
from services.model import shapes
from tests.helpers import ROOT, mesh_options, sample, scrape, settle
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

DEMO = ROOT / "models" / "demo"
KEY = "sk-ops"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    tenants = [
        {"id": "ops", "api_keys": [KEY], "max_qos": "realtime", "requests_per_second": 1000, "burst": 1000},
        {"id": "once", "api_keys": ["sk-once"], "max_qos": "standard", "requests_per_second": 0.01, "burst": 1},
    ]
    path.write_text(json.dumps({"tenants": tenants}))
    opts = mesh_options(DEMO, http_port=0, warmup_requests=1, tenants=str(path), max_llm_batch=4)
    with Mesh(opts) as running:
        running.start(progress=lambda m: None)
        yield running


@pytest.fixture(scope="module")
def client(mesh):
    # No retries: a 429 or 503 must reach the test as it is.
    with openai.OpenAI(base_url=mesh.http_url(), api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def picture(seed: int) -> tuple[shapes.Picture, str]:
    pic = shapes.render(np.random.default_rng([77, seed]))
    return pic, "data:image/png;base64," + base64.b64encode(shapes.encode(pic.image, "PNG")).decode()


def ask(url: str, prompt: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}],
        }
    ]


def test_a_chat_with_an_image_is_answered_for_that_picture(client):
    for seed, prompt in enumerate(shapes.PROMPTS):
        pic, url = picture(seed)
        raw = client.chat.completions.with_raw_response.create(model="demo", messages=ask(url, prompt), max_tokens=8)
        r = raw.parse()
        assert r.choices[0].message.content == pic.answer(prompt), (seed, prompt)
        assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion" and r.model == "demo"
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > r.usage.completion_tokens
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.prompt_tokens_details.cached_tokens >= 0
        assert raw.headers["x-model-variant"] == "full" and r.id == f"chatcmpl-{raw.headers['x-request-id']}"


def test_a_streamed_chat_gives_the_same_answer_then_usage(client):
    pic, url = picture(10)
    prompt = "What is in the image?"
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=ask(url, prompt), max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == pic.answer(prompt)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1


def test_a_conversation_with_a_system_message_and_earlier_turns(client):
    _, url = picture(11)
    messages = [
        {"role": "system", "content": "You answer about pictures."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What shape is it?"},
    ]
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_max_tokens_ends_with_length(client):
    _, url = picture(12)
    r = client.chat.completions.create(
        model="demo",
        messages=ask(url, "What is in the image?"),
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_stop_strings_and_seeded_sampling(client):
    pic, url = picture(21)
    prompt = "What is in the image?"  # "a <color> <shape>"
    r = client.chat.completions.create(model="demo", messages=ask(url, prompt), stop=[" "], max_tokens=8)
    assert r.choices[0].message.content == pic.answer(prompt).split(" ")[0] and r.choices[0].finish_reason == "stop"
    sampled = [
        client.chat.completions.create(
            model="demo", messages=ask(url, prompt), temperature=1.5, top_p=0.9, seed=seed, max_tokens=6
        )
        .choices[0]
        .message.content
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1]  # the same seed, the same tokens


def test_a_class_above_the_tenants_is_a_permission_error(mesh):
    _, url = picture(22)
    with openai.OpenAI(base_url=mesh.http_url(), api_key="sk-once", max_retries=0) as c:
        with pytest.raises(openai.PermissionDeniedError) as err:
            c.chat.completions.create(
                model="demo", messages=ask(url, "What shape is it?"), extra_headers={"qos-level": "realtime"}
            )
    assert "may use qos-level standard or lower" in err.value.message


def test_a_wrong_key_is_an_authentication_error(mesh):
    _, url = picture(13)
    with openai.OpenAI(base_url=mesh.http_url(), api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as err:
            c.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"))
    assert err.value.status_code == 401 and "unknown API key" in err.value.message
    assert err.value.body["type"] == "authentication_error"


def test_over_the_quota_is_a_rate_limit_error_with_retry_after(mesh):
    _, url = picture(14)
    with openai.OpenAI(base_url=mesh.http_url(), api_key="sk-once", max_retries=0) as c:
        c.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"))  # the burst of 1
        with pytest.raises(openai.RateLimitError) as err:
            c.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"))
    assert "request rate" in err.value.message and int(err.value.response.headers["retry-after"]) >= 1


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:image/png;base64,AAAA", "messages[0].content[0].image_url.url: (3 bytes) is not a readable image"),
        ("data:image/png;base64,@@@", "messages[0].content[0].image_url.url: the data: URL is not valid base64"),
        ("data:text/plain;base64,aGk=", "is not an image"),
        ("http://127.0.0.1:1/cat.png", "this server does not fetch image URLs"),
        ("file:///etc/passwd", "give a data: URL (base64) or an http(s) URL"),
    ],
)
def test_a_bad_image_is_a_bad_request_naming_the_problem(client, url, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"))
    assert needle in err.value.message and err.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_this_server_cannot_honour_is_refused_by_name(client, extra, param):
    _, url = picture(15)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"), **extra)
    assert err.value.body["param"] == param


def test_errors_speak_of_the_http_request_not_the_grpc_one(mesh, client):
    """Issue 40: OpenAI's field names in message and `param`, headers not metadata, one path style,
    and a refusal that names a field without echoing its value."""
    _, url = picture(18)
    base = mesh.http_url()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"), max_tokens=100000)
    assert err.value.body["message"].startswith("max_tokens=100000 is out of range")
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ask(url, "What?"), temperature=-1)
    assert err.value.body["message"].startswith("temperature=-1") and err.value.body["param"] == "temperature"
    r = httpx.post(f"{base}/chat/completions", json={"model": "demo", "messages": ask(url, "hi")})
    assert r.status_code == 401 and r.json()["error"]["message"] == "missing 'Authorization: Bearer <API key>' header"
    headers = {"authorization": f"Bearer {KEY}"}
    bad_part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "txt"}]}]
    r = httpx.post(f"{base}/chat/completions", json={"messages": bad_part}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content[1]"), r.json()
    # The gateway's own checks (services/common/validation.py) name their field too.
    r = httpx.post(f"{base}/chat/completions", json={"messages": ask(url, "")}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()
    system_image = [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    r = httpx.post(
        f"{base}/chat/completions",
        json={"messages": [*system_image, {"role": "user", "content": "Hi"}]},
        headers=headers,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]", r.json()
    tools = [{"type": "function", "function": {"name": "secret_tool_name", "parameters": {"x": "y" * 100}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ask(url, "What?"), tools=tools)
    assert err.value.body["message"] == "tools is not supported by this server"


def test_an_unknown_model_is_openais_model_not_found(client):
    _, url = picture(19)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=ask(url, "What shape is it?"))
    body = err.value.body
    assert (body["code"], body["type"], body["param"]) == ("model_not_found", "invalid_request_error", "model")
    assert "'gpt-17' does not exist; this mesh serves 'demo'" in body["message"]


def test_other_refusals_keep_the_openai_shape(mesh):
    base = mesh.http_url()
    headers = {"authorization": f"Bearer {KEY}"}
    _, url = picture(16)
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{base}/chat/completions", json={"messages": ask(url, "hi")}, headers={**headers, "qos-level": "x"})
    assert r.status_code == 400 and "qos-level" in r.json()["error"]["message"]
    r = httpx.post(
        f"{base}/chat/completions", json={"messages": ask(url, "hi")}, headers={**headers, "x-model-variant": "int4"}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(
        f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "no picture"}]}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "messages: one image is required (image_url parts)"


def test_models_health_and_metrics(mesh, client):
    base = mesh.http_url()
    models = httpx.get(f"{base}/models").json()
    assert models["object"] == "list" and [(m["id"], m["variant"]) for m in models["data"]] == [("demo", "full")]
    assert httpx.get(base.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    # The door's requests are counted on the gateway's one /metrics (its --metrics-port), not served again here.
    client.chat.completions.create(model="demo", messages=ask(picture(13)[1], "What is in the image?"), max_tokens=2)
    assert httpx.get(base.removesuffix("/v1") + "/metrics").status_code == 404
    page = scrape(mesh.metrics_ports["gateway"])
    assert 'vlmesh_requests_total{code="OK",method="ChatCompletions",service="gateway"}' in page


def test_a_client_that_disconnects_mid_stream_frees_its_kv_slot(mesh):
    """The llm sees a cancel, and the slot and pages come back. The longest answer the demo model
    has room for (70 tokens past EOS) lasts a fraction of a second: on a busy host it may end before
    the disconnect reaches the llm, which then counts it OK. Such a try shows nothing, and is made
    again; the test waits on the llm's count of the request, not on a clock."""
    gateway, llm = mesh.metrics_ports["gateway"], mesh.metrics_ports["llm"]
    by_gateway = 'vlmesh_requests_total{code="CANCELLED",method="ChatCompletions",service="gateway"}'
    cancelled = 'vlmesh_requests_total{code="CANCELLED",method="Generate",service="llm"}'
    finished = 'vlmesh_requests_total{code="OK",method="Generate",service="llm"}'
    _, url = picture(17)
    body = {"model": "demo", "messages": ask(url, "What is in the image?"), "max_tokens": 70, "ignore_eos": True}
    headers = {"authorization": f"Bearer {KEY}"}
    for _ in range(10):
        page = scrape(llm)
        before = (sample(scrape(gateway), by_gateway) or 0, sample(page, cancelled) or 0, sample(page, finished) or 0)
        with httpx.Client(timeout=30) as c:
            with c.stream(
                "POST", f"{mesh.http_url()}/chat/completions", json={**body, "stream": True}, headers=headers
            ) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:") and json.loads(line[5:])["choices"][0]["delta"].get("content"):
                        break
        deadline = time.monotonic() + 30
        while (now := scrape(llm)) and (sample(now, cancelled) or 0) + (sample(now, finished) or 0) == sum(before[1:]):
            assert time.monotonic() < deadline, "the llm never ended the request"
            time.sleep(0.05)
        if (sample(now, cancelled) or 0) == before[1] + 1:
            break
    else:
        pytest.fail("in 10 tries every answer ended before its client's disconnect reached the llm")
    assert settle(gateway, by_gateway, before[0] + 1) == before[0] + 1
    assert settle(llm, 'vlmesh_kv_slots{state="used"}', 0, absent_is_zero=True) in (0, None)


def test_curl_streams_server_sent_events_that_parse(mesh):
    curl = shutil.which("curl")
    assert curl, "curl is needed (apt-get install curl)"
    pic, url = picture(18)
    body = json.dumps({"model": "demo", "messages": ask(url, "What color is the shape?"), "stream": True})
    out = subprocess.run(
        [
            curl,
            "-sN",
            f"{mesh.http_url()}/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-d",
            "@-",  # the body on stdin: in base64 a picture outgrows one argument (128 KiB)
        ],
        input=body,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(line == "" or line.startswith("data: ") for line in out.splitlines())
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == pic.answer(
        "What color is the shape?"
    )


def test_fifty_pictures_get_the_same_answers_through_both_doors(mesh):
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(mesh.target("gateway")))
    md = (("authorization", f"Bearer {KEY}"),)
    with openai.OpenAI(base_url=mesh.http_url(), api_key=KEY, max_retries=0) as c:
        for i in range(50):
            _, url = picture(100 + i)
            prompt = list(shapes.PROMPTS)[i % len(shapes.PROMPTS)]
            data = base64.b64decode(url.split(",", 1)[1])
            by_grpc = stub.GenerateUnary(
                gateway_pb2.GenerateRequest(
                    images=[pb.Image(data=data)], prompt=prompt, sampling=pb.SamplingParams(max_tokens=8)
                ),
                metadata=md,
                timeout=60,
            )
            by_http = c.chat.completions.create(
                model="demo", messages=ask(url, prompt), max_tokens=8, extra_body={"return_token_ids": True}
            )
            assert by_http.choices[0].model_extra["token_ids"] == list(by_grpc.token_ids), i
            assert by_http.choices[0].message.content == by_grpc.text, i
            assert by_http.usage.completion_tokens == by_grpc.usage.output_tokens, i
            assert by_http.usage.prompt_tokens == by_grpc.usage.prompt_tokens + by_grpc.usage.image_tokens, i


def doc_block(path: str, marker: str) -> str:
    """The code block that opens with `marker` in the file at `path` (from the repository's root)."""
    text = (ROOT / path).read_text()
    start = text.index(marker)
    body = text[text.index("\n", start) + 1 :]
    return body[: body.index("```")]


def test_the_readme_and_api_examples_run_as_written(mesh, tmp_path):
    port = mesh.http_url().split(":")[2].split("/")[0]
    pic, _ = picture(19)
    (tmp_path / "cat.png").write_bytes(shapes.encode(pic.image, "PNG"))
    env = {"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": KEY, "HOME": str(tmp_path)}
    curl = doc_block("README.md", "```bash openai-curl").replace("localhost:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", curl], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == pic.answer("What is in the image?")
    code = doc_block("docs/API.md", "```python openai-client").replace("localhost:8000", f"127.0.0.1:{port}")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert pic.answer("What shape is it?") in out.stdout


def test_the_bench_measures_both_doors_of_one_mesh(mesh, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "services.cli", "bench", "--model", str(DEMO), "--gateway", mesh.target("gateway")]
    cmd += ["--gateway-http", mesh.http_url(), "--target", "mesh,mesh-http", "--api-key", KEY]
    cmd += ["--rates", "3", "--duration", "3", "--warmup", "0.5", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {r["target"]: r["summary"] for r in json.loads((out / "results.json").read_text())["runs"]}
    assert sorted(runs) == ["mesh", "mesh-http"]
    for s in runs.values():
        assert s["statuses"].get("OK") == s["sent"] > 0 and s["lost"] == 0


def test_the_mesh_still_serves_after_all_that(client):
    pic, url = picture(20)
    start = time.monotonic()
    r = client.chat.completions.create(model="demo", messages=ask(url, "What shape is it?"))
    assert r.choices[0].message.content == pic.answer("What shape is it?") and time.monotonic() - start < 30
