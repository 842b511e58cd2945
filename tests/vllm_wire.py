"""Plain HTTP to a vLLM-speaking server (a real engine or our simulated worker), as the
conformance tests compare them: one request, a NIXL handoff's two legs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def request(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """(status, answer): a JSON answer decoded, a stream as its list of JSON chunks, anything
    else as text. GET without a body."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": "conformance"}
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            raw, status = response.read(), response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    text = raw.decode()
    if text.startswith("data: "):
        return status, [json.loads(line[6:]) for line in text.splitlines()
                        if line.startswith("data: {")]  # fmt: skip
    return status, json.loads(text) if text.startswith("{") else text


def handoff(
    prefill: str, decode: str, model: str, prompt: str, max_tokens: int = 8
) -> tuple[Any, Any]:
    """A prefill leg, then a decode leg of `max_tokens` with the params it returned."""
    status, first = request(prefill + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 1, "stream": False,
        "kv_transfer_params": PREFILL_LEG,
    })  # fmt: skip
    assert status == 200, first
    status, second = request(decode + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "kv_transfer_params": first["kv_transfer_params"],
    })  # fmt: skip
    assert status == 200, second
    return first, second
