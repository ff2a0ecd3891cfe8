"""The `minivllm` command: generate, demo, serve, lab, bench."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import Field, fields
from typing import Any

from minivllm.config import SPECULATION_OFF, EngineConfig, cli_flag
from minivllm.startup import show_progress

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in one sentence what a KV cache is.",
    "Write a haiku about the sea.",
]


_TYPES = {"bool": bool, "int": int, "float": float}


def add_engine_options(parser: argparse.ArgumentParser, repeatable: tuple[str, ...] = ()) -> None:
    """The EngineConfig options, one `--flag` per field (help and choices from the field), for
    every subcommand that builds an engine; the `repeatable` ones collect a list."""
    g = parser.add_argument_group("engine")
    for f in engine_fields():
        flag = cli_flag(f.name)
        kind = next((t for name, t in _TYPES.items() if name in str(f.type)), str)
        if kind is bool and f.default:  # the options that default to on: a --no-... switch
            flag = cli_flag(f.name, negated=True)
            g.add_argument(
                flag,
                dest=f.name,
                action="store_false",
                default=None,
                help=f"do not {f.metadata['help']}",
            )
            continue
        if kind is bool:  # off by default: a plain switch
            g.add_argument(
                flag, dest=f.name, action="store_true", default=None, help=f.metadata["help"]
            )
            continue
        # --no-speculation is --speculative-config's off switch; giving both is an error.
        group = g.add_mutually_exclusive_group() if f.name == "speculative_config" else g
        if f.name == "speculative_config":
            group.add_argument(
                "--no-speculation",
                dest=f.name,
                action="store_const",
                const=SPECULATION_OFF,
                help='no speculative decoding (--speculative-config \'{"method": "none"}\')',
            )
        group.add_argument(
            flag,
            type=kind,
            default=None,
            choices=f.metadata["choices"],
            help=f.metadata["help"] + (" (repeat it for several)" if f.name in repeatable else ""),
            action="append" if f.name in repeatable else "store",
            nargs="+" if "tuple" in str(f.type) else None,  # several values: name=path ...
        )


def engine_fields() -> list[Field]:
    return [f for f in fields(EngineConfig) if f.metadata.get("cli", False)]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user set (unset ones keep EngineConfig's defaults)."""
    values = {f.name: getattr(args, f.name, None) for f in engine_fields()}
    return {name: value for name, value in values.items() if value is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    llm = LLM(**engine_options(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed_sampling,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A few chat questions on the default model, their answers, and the throughput."""
    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**engine_options(args))
    load_s = time.perf_counter() - start
    print(
        f"model loaded in {load_s:.1f} s ({llm.llm_engine.model_runner.num_kv_blocks} KV blocks)\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for question, out in zip(DEMO_QUESTIONS, outputs):
        print(f"Q: {question}\nA: {out.outputs[0].text.strip()}\n")
    print(
        f"{len(outputs)} requests, {tokens} generated tokens in {seconds:.2f} s: "
        f"{tokens / seconds:.1f} tok/s"
    )
    return 0


def is_multi_model(args: argparse.Namespace) -> bool:
    """Whether the command line names several models (else `minivllm serve` is as ever)."""
    return len(args.model or []) > 1 or getattr(args, "models_dir", None) is not None


def cmd_serve(args: argparse.Namespace) -> int:
    if is_multi_model(args):  # --model A --model B ... or --models-dir DIR
        from minivllm.server.multi_serve import serve_models

        args.model = [args.model_tag] * (args.model_tag is not None) + (args.model or [])
        return serve_models(args, engine_options(args))
    args.model = args.model[0] if args.model else None
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.ray:
        try:
            from minivllm.scale.ray_serve import serve_on_ray
        except ImportError as exc:
            raise SystemExit(f"minivllm serve --ray: {exc}") from None
        return serve_on_ray(args, engine_options(args))
    from minivllm.engine.runtime.engine_process import start_engine_process

    options = engine_options(args)
    # Started before the HTTP side imports its stack (FastAPI, uvicorn, the routes: ~0.5 s),
    # which then runs on the other core while the engine process loads the model.
    starting = None if args.lab else start_engine_process(options)  # --lab: in this process
    try:
        from minivllm.server.serve import serve

        return serve(args, options, starting) or 0
    finally:
        if starting is not None:  # the server never took it over: no engine left behind
            starting.close()


def cmd_lab(args: argparse.Namespace) -> int:
    from minivllm.lab.app import serve_lab

    serve_lab(host=args.host, port=args.port, model=args.model, block_size=args.block_size)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from minivllm.bench import run_bench

    return run_bench(args, engine_options(args))


def add_serve_parser(sub: Any) -> None:
    """`minivllm serve [MODEL]`: the server's flags, then the engine's."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` (same as --model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY')"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model path's name)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 503 when this many requests are already waiting",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="answer 413 to a request body larger than this",
    )
    _add_serving_options(p)
    _add_multi_model_options(p)
    _add_ray_options(p)
    add_engine_options(p, repeatable=("model",))
    p.set_defaults(func=cmd_serve)


def _add_multi_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models (docs/multi-model.md)")
    g.add_argument(
        "--models-dir",
        default=None,
        help="serve each .gguf file and HF directory in DIR (or those its models.json/yaml "
        "names), loaded on demand",
    )
    g.add_argument("--max-loaded-models", type=int, default=None, help="most models loaded")
    g.add_argument(
        "--models-memory-gb", type=float, default=None, help="memory the loaded models may take"
    )
    g.add_argument(
        "--idle-unload-seconds", type=float, default=None, help="unload a model idle this long"
    )
    g.add_argument(
        "--model-load-timeout",
        type=float,
        default=None,
        help="seconds a request waits for its model to load (default 600)",
    )


def _add_serving_options(p: argparse.ArgumentParser) -> None:
    """The server's behaviour: shutdown, the lab, its process layout, chat, CORS; then the
    Responses API's store."""
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C",
    )
    p.add_argument(
        "--lab",
        action="store_true",
        help="record the engine between steps and show it live at /lab",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="step the engine in a process of its own (default; --lab steps it "
        "on a thread of the HTTP process)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) for the model's",
    )
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="default chat-template variables, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3", "deepseek_r1"],
        help="split <think>...</think> into message.reasoning_content",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins CORS lets in ('*' for any); none by default",
    )
    _add_response_store_options(p)


def _add_response_store_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--response-store-max-responses",
        type=int,
        default=None,
        help="responses kept for GET and previous_response_id (default 1024)",
    )
    p.add_argument(
        "--response-store-max-bytes",
        type=int,
        default=None,
        help="bytes the response store may hold (default 64 MiB)",
    )
    p.add_argument(
        "--no-response-store",
        action="store_true",
        help="keep no responses (store: true is ignored)",
    )


def _add_ray_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on Ray Serve (pip install 'minivllm[ray]')")
    g.add_argument(
        "--ray",
        action="store_true",
        help="serve N engine replicas on the Ray cluster at RAY_ADDRESS (else a "
        "local one) behind Ray Serve's proxy on --host:--port",
    )
    g.add_argument("--num-replicas", type=int, default=1, help="with --ray: replicas")
    g.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="with --ray: CPUs each replica reserves (and its torch threads)",
    )
    g.add_argument(
        "--replica-memory-gb",
        type=float,
        default=None,
        help="with --ray: memory each replica reserves",
    )
    g.add_argument(
        "--autoscaling-config",
        default=None,
        metavar="JSON",
        help="with --ray: Ray Serve's autoscaling_config, e.g. '{\"min_replicas\": 1, "
        '"max_replicas": 4, "target_ongoing_requests": 8}\'',
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="print the completion of one prompt")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument(
        "--sampling-seed",
        dest="seed_sampling",
        type=int,
        default=None,
        help="seed of this request's sampling",
    )
    add_engine_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="chat questions on the default model, with throughput")
    p.add_argument("--max-tokens", type=int, default=48)
    add_engine_options(p)
    p.set_defaults(func=cmd_demo)

    add_serve_parser(sub)

    p = sub.add_parser("lab", help="the Engine Lab: step the real engine in your browser")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--model", default=None)
    p.add_argument("--block-size", type=int, default=4)
    p.set_defaults(func=cmd_lab)

    p = sub.add_parser("bench", help="benchmarks: throughput, prefix caching, serving")
    from minivllm.bench import add_bench_arguments

    add_bench_arguments(p)
    add_engine_options(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    show_progress()  # a start's phases, each as it begins (minivllm/startup.py)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"minivllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
