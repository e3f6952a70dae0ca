"""`edgespec serve`: one engine behind an OpenAI-compatible HTTP API.

Loads the engine the way `run` and `chat` do, binds its socket first (so a
taken port or a refused address fails before the model loads), then runs the
Starlette app of edgespec.server under uvicorn.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from pathlib import Path

from ..errors import EdgespecError, UsageError, flag_worded
from ..limits import MAX_PARALLEL
from ..monitor import DEFAULT_THRESHOLD, DEFAULT_WINDOW, AcceptanceMonitor
from .options import (add_engine_options, add_prompt_cache_ram_option, add_sampling_options, engine_from_args,
                      sampling_params, setting)

API_KEY_ENV = "EDGESPEC_API_KEY"


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve one engine over an OpenAI-compatible HTTP API")
    group = parser.add_argument_group("server")
    group.add_argument("--host", type=_host_address, default="127.0.0.1",
                       help="address to listen on (default: %(default)s; any other needs --api-key)")
    group.add_argument("--port", type=int, default=8080,
                       help="port to listen on, 0 for any free one (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer KEY' on /v1 and /metrics (default: ${API_KEY_ENV})")
    group.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="let web pages from ORIGIN use the server (CORS), e.g. http://localhost:3000, "
                            "http://localhost:* or *; repeatable, and added to the comma-separated $EDGESPEC_ORIGINS "
                            "(default: none: a request from a web page gets 403)")
    group.add_argument("--queue-size", type=int, default=8,
                       help="requests that may wait for the engine; more get 429 (default: %(default)s)")
    group.add_argument("--parallel", type=setting("parallel"), default=1, metavar="N",
                       help=f"requests decoded together, 1..{MAX_PARALLEL}: more throughput for concurrent clients, "
                            "but each request then drafts with n-grams, never the draft model; cached prompts are "
                            "reused either way (default: %(default)s)")
    group.add_argument("--request-timeout", type=float, default=300.0,
                       help="seconds a request may take, waiting included (default: %(default)s)")
    group.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                       help="largest request body accepted (default: %(default)s)")
    group.add_argument("--alert-acceptance", type=float, default=DEFAULT_THRESHOLD,
                       help="warn when the rolling draft acceptance falls below this (default: %(default)s)")
    group.add_argument("--alert-window", type=int, default=DEFAULT_WINDOW,
                       help="requests the rolling acceptance covers (default: %(default)s)")
    add_prompt_cache_ram_option(group, "512MiB", "RAM for the prompt snapshots of recent requests, so clients "
                                "taking turns do not prefill each other's history again; the memory plan gives it "
                                "at most half the RAM the models leave, and 0 keeps none (default: %(default)s)")
    add_engine_options(parser)
    # A request without max_tokens runs until the reply ends, as OpenAI's API and llama-server do: aider and
    # others send none, and a whole-file edit cut at a fixed default reads as the model's failure.
    add_sampling_options(parser, max_tokens=None)
    parser.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from ..prefix_cache import MemoryPrefixCache
    from ..server.app import ServerConfig, create_app
    from ..server.http_server import run_app
    from ..server.guard import allowed_host_names, origin_regex, origins_from_env, url_host

    _check_options(args)
    if args.max_tokens is None:
        args.max_tokens = args.n_ctx  # the context ends every reply first
    origins = origin_regex(args.allow_origin + origins_from_env(os.environ))
    defaults = sampling_params(args)
    monitor = AcceptanceMonitor(args.alert_acceptance, args.alert_window)
    logging.basicConfig(format="edgespec: %(message)s", level=logging.INFO, stream=sys.stderr)
    with _listen(args.host, args.port) as sock:
        config = ServerConfig(_model_name(args.model), defaults, args.api_key, args.queue_size, args.request_timeout,
                              args.max_body_bytes, args.parallel, port=sock.getsockname()[1],
                              host_names=allowed_host_names(args.host), origins=origins)
        ram = args.prompt_cache_ram if args.prompt_cache else 0
        engine = engine_from_args(args, notice=_log_for_operator, parallel=args.parallel, prompt_cache_ram=ram)
        if engine.plan.prompt_cache_ram:
            # one KV cache serves every client: recent conversations' states in RAM keep two clients taking
            # turns from re-prefilling each other's history (the disk store keeps what came twice)
            engine.prefix_caches.insert(0, MemoryPrefixCache(engine.plan.prompt_cache_ram))
        try:
            app = create_app(engine, config, monitor)
            host, port = sock.getsockname()[:2]
            print(f"edgespec: serving {config.model_name} ({engine.mode}) on http://{url_host(host)}:{port}/v1",
                  file=sys.stderr, flush=True)
            run_app(app, sock, config.request_timeout)
        finally:
            engine.close()
    return 0


def _log_for_operator(notice: str) -> None:
    """A notice (loading, the prompt cache) in the server's log, naming the flags its operator started it with."""
    logging.getLogger("edgespec.serve").info(flag_worded(notice))


def _host_address(text: str) -> str:
    """--host as given, an IPv6 address written as a URL writes it ([::1]) taken out of its brackets."""
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def _check_options(args: argparse.Namespace) -> None:
    from ..server.guard import is_loopback

    _check_api_key(args.api_key)
    if not is_loopback(args.host) and not args.api_key:
        raise UsageError(f"refusing to listen on {args.host} without an API key: anyone who reaches it could use "
                         f"the model; pass --api-key KEY (or set {API_KEY_ENV}), or keep --host 127.0.0.1")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port number (use 0-65535)")
    if args.queue_size < 0:
        raise UsageError("--queue-size must be 0 or more")
    if args.parallel > 1 and args.bit_exact:
        raise UsageError("--parallel above 1 and --bit-exact do not go together: rows in a shared pass are not "
                         "bit-identical to plain decoding; drop one of them")
    if not args.request_timeout > 0:  # NaN too: no deadline would ever pass
        raise UsageError("--request-timeout must be a positive number of seconds")
    if args.max_body_bytes < 1024:
        raise UsageError("--max-body-bytes must be at least 1024")
    if not 0.0 <= args.alert_acceptance <= 1.0:
        raise UsageError("--alert-acceptance must be between 0 and 1")
    if args.alert_window < 1:
        raise UsageError("--alert-window must be at least 1 request")


def _check_api_key(key: str | None) -> None:
    if key is None:
        return
    if not key.strip():
        raise UsageError(f"the API key (--api-key or ${API_KEY_ENV}) is blank, which protects nothing; give a real "
                         f"key, or leave both out on 127.0.0.1")
    if not re.fullmatch(r"[\x21-\x7e]+", key):
        raise UsageError(f"the API key (--api-key or ${API_KEY_ENV}) holds spaces or characters other than "
                         "printable ASCII, which an HTTP header cannot carry as they are; use letters, digits "
                         "and punctuation only")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise EdgespecError(f"cannot listen on {host}:{port}: {error.strerror or error}; pick another --host or --port") from None
    return sock


def _model_name(model: str) -> str:
    """The name clients see: a catalog name as given, a file by its name without .gguf."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else model
