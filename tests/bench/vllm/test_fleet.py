"""The real-engine harness without engines: what each `vllm serve` is started with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.vllm.engine import EngineSpec, serve_args, serve_env
from bench.vllm.fleet import FleetSpec, engine_specs, kv_bytes_per_token


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # the tiny model: 2 layers x 2 KV heads x 64 x (K, V) x bf16
        ({"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "dtype": "bfloat16"}, 1024),
        # Llama-3.1-8B's published shape, head size from the hidden size
        ({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8, "torch_dtype": "bfloat16"}, 131072),
        ({"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
          "dtype": "float32"}, 2 * 2 * 4 * 64 * 4),
    ],
)  # fmt: skip
def test_kv_bytes_per_token_from_the_model_config(
    tmp_path: Path, config: dict[str, object], expected: int
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(tmp_path) == expected


def test_every_engine_gets_its_port_side_channel_and_a_core_in_turn() -> None:
    spec = FleetSpec(model="/m", roles=("prefill", "decode", "decode"), base_port=9000,
                     side_channel_base=9100, num_gpu_blocks=64)  # fmt: skip
    engines = engine_specs(spec, [0, 1])
    assert [(e.port, e.side_channel_port, e.cpus) for e in engines] == [
        (9000, 9100, "0"), (9001, 9101, "1"), (9002, 9102, "0")
    ]  # fmt: skip
    args = serve_args(engines[0])
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                      "kv_buffer_device": "cpu"}  # fmt: skip
    assert args[args.index("--num-gpu-blocks-override") + 1] == "64"
    env = serve_env(engines[1], Path("/w"), {})
    assert (env["VLLM_NIXL_SIDE_CHANNEL_PORT"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("9101", "1")
    assert env["HF_HUB_OFFLINE"] == "1" and env["TMPDIR"] == "/w/tmp"
    # the reniced progress thread's lock: a mutex, never UCX's default spinlock
    assert (env["UCX_TLS"], env["UCX_USE_MT_MUTEX"]) == ("tcp,self,sm", "y")


def test_an_engine_without_a_connector_has_no_side_channel() -> None:
    spec = EngineSpec(model="/m", port=9000)
    assert "--kv-transfer-config" not in serve_args(spec)
    env = serve_env(spec, Path("/w"), {})
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env and "UCX_USE_MT_MUTEX" not in env
    with pytest.raises(ValueError, match="side_channel_port"):
        EngineSpec(model="/m", port=9000, kv_role="kv_both")
