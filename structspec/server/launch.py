"""``structspec serve``: check the port, start the engine process, serve HTTP, shut down.

Order (each step fails fast with a one-line reason and a non-zero exit code):

1. bind ``--host:--port`` (exit 2 if it is taken) — before any model loading;
2. spawn the engine process and wait for it to report ready; its init exception (bad model
   path, bad option) is printed and the command exits 1 before uvicorn starts;
3. load the tokenizer in this process (chat template, detokenization);
4. run uvicorn on the already-bound socket.

SIGINT / SIGTERM: stop accepting connections, abort in-flight requests (they end with an
error event / 503), wait up to :data:`GRACEFUL_TIMEOUT_S` for responses to finish, then stop
and join the engine process (terminated if it does not exit in time); exit code 0.

If the engine process dies while serving (a crash in its loop, killed), in-flight requests
fail with 503 / an error event, ``/health`` answers 503 and the engine process is restarted
with exponential backoff (:mod:`structspec.server.supervisor`, ``--engine-restarts``,
``--engine-restart-backoff``); the server serves again once it is ready. When the restarts
run out the server shuts down with exit code 1, so an outer supervisor can act.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from structspec.engine_args import engine_kwargs, flag_error, unused_speculative_flags

if TYPE_CHECKING:
    from structspec.server.codec import Codec
    from structspec.server.supervisor import EngineSupervisor

GRACEFUL_TIMEOUT_S = 5.0
ENGINE_JOIN_TIMEOUT_S = 10.0

logger = logging.getLogger("structspec.server")


def build_engine_config(model: str | None = None, **kwargs: Any) -> Any:
    """An :class:`~structspec.config.EngineConfig` from ``LLM``-style keyword options (the
    output of :func:`structspec.engine_args.engine_kwargs`), built exactly as ``LLM.__init__``
    does."""
    from structspec.chat_template import load_chat_template
    from structspec.config import (
        CacheConfig,
        EngineConfig,
        GrammarConfig,
        SchedulerConfig,
        SpecConfig,
    )

    chat_template = kwargs.get("chat_template")
    return EngineConfig(
        model=model,
        chat_template=(None if chat_template is None
                       else load_chat_template(chat_template, "chat_template")),
        device=kwargs.get("device", "auto"),
        dtype=kwargs.get("dtype", "auto"),
        max_model_len=kwargs.get("max_model_len"),
        seed=kwargs.get("seed", 0),
        cuda_graph=kwargs.get("cuda_graph", True),
        kernels=kwargs.get("kernels", "auto"),
        batch_invariant=kwargs.get("batch_invariant", False),
        load_format=kwargs.get("load_format", "auto"),
        quantization=kwargs.get("quantization", "auto"),
        cache=CacheConfig(page_size=kwargs.get("page_size", 16),
                          kv_capacity_tokens=kwargs.get("kv_capacity_tokens", 65536),
                          enable_prefix_caching=kwargs.get("enable_prefix_caching", True)),
        spec=SpecConfig(algorithm=kwargs.get("speculative_algorithm", "none"),
                        num_draft_tokens=kwargs.get("num_draft_tokens", 8),
                        depth=kwargs.get("speculative_depth", 4),
                        topk=kwargs.get("speculative_topk", 2),
                        adaptive=kwargs.get("speculative_adaptive", "auto"),
                        draft_vocab=kwargs.get("speculative_draft_vocab", "auto"),
                        draft_model=kwargs.get("draft_model")),
        grammar=GrammarConfig(compile_timeout_s=kwargs.get("grammar_compile_timeout_s", 30.0),
                              mask_build_workers=kwargs.get("grammar_workers"),
                              backend=kwargs.get("grammar_backend", "xgrammar")),
        scheduler=SchedulerConfig(
            max_batch_size=kwargs.get("max_batch_size", 64), overlap=kwargs.get("overlap", True),
            enable_chunked_prefill=kwargs.get("enable_chunked_prefill", True),
            max_num_batched_tokens=kwargs.get("max_num_batched_tokens")),
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it later).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def _stop_flag_on_signals() -> Iterator[Callable[[], bool]]:
    """While loading: SIGINT/SIGTERM set a flag that aborts the engine start cleanly."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    flag = threading.Event()
    old = {s: signal.signal(s, lambda *_: flag.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag.is_set
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit code."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s [server] %(levelname)s %(message)s")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401  (fail before loading anything)
    except ImportError as e:
        print(f"structspec serve: {e.name} is not installed; install the server extra: "
              "pip install 'structspec[server]' (in a checkout: pip install -e '.[server]' "
              "--config-settings editable_mode=compat)", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"structspec serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 2

    from structspec.chat_template import load_chat_template
    from structspec.config import resolve_engine_config
    from structspec.draft_flags import check_model_and_draft_flags
    from structspec.server.engine_client import EngineClient, EngineStartupError
    from structspec.server.limits import limits_from_args
    from structspec.server.log_config import log_config_from_args
    from structspec.server.supervisor import EngineSupervisor, policy_from_args

    try:
        limits_from_args(args)  # server options: refused before anything is spawned
        policy_from_args(args)
        log_config_from_args(args)
        check_model_and_draft_flags(args.model, args.speculative_algorithm, args.draft_model,
                                    args.load_format)
        if args.chat_template is not None:
            load_chat_template(args.chat_template, "--chat-template")
        config = build_engine_config(args.model, **engine_kwargs(args))
        for flag in unused_speculative_flags(args):
            logger.warning("%s has no effect with --speculative-algorithm %s", flag,
                           args.speculative_algorithm)
        # The engine process resolves it again; checking here refuses a bad option with exit
        # 2 naming its flag, before an engine process is spawned (as ``generate`` does).
        resolve_engine_config(config)
    except (TypeError, ValueError) as e:
        sock.close()
        print(f"structspec serve: {flag_error(str(e))}", file=sys.stderr)
        return 2
    client = EngineClient(config)
    logger.info("starting the engine process (model: %s)", args.model or "default")
    with _stop_flag_on_signals() as should_stop:
        try:
            client.spawn()
            _warm_imports()  # overlaps with the model load in the engine process
            info = client.wait_ready(should_stop=should_stop)
        except EngineStartupError as e:
            sock.close()
            print(f"structspec serve: the engine failed to start: {e}", file=sys.stderr)
            return 1
    try:
        from structspec.server.codec import TokenizerCodec

        codec = TokenizerCodec(info.model_path, chat_template=config.chat_template)
    except Exception as e:
        sock.close()
        client.shutdown(ENGINE_JOIN_TIMEOUT_S)
        print(f"structspec serve: cannot load the tokenizer: {e}", file=sys.stderr)
        return 1
    # a dead engine process is replaced by a new client built from the same config
    supervisor = EngineSupervisor(client, lambda: EngineClient(config), policy_from_args(args))
    try:
        return run_http(args, sock, supervisor, codec)
    finally:
        supervisor.shutdown(ENGINE_JOIN_TIMEOUT_S)
        sock.close()


def run_http(args: argparse.Namespace, sock: socket.socket, engine: EngineSupervisor,
             codec: Codec) -> int:
    """Serve HTTP on the bound ``sock`` until SIGINT/SIGTERM or until the engine's restarts
    run out; returns the exit code (0, or 1 when the engine could not be kept running).

    Args:
        args: the parsed ``structspec serve`` flags.
        sock: bound by :func:`bind_socket` (its port is the one logged, also for ``--port 0``).
        engine: an :class:`~structspec.server.supervisor.EngineSupervisor` around the ready
            engine client.
        codec: the front end's tokenizer (:class:`~structspec.server.codec.TokenizerCodec`).
    """
    import uvicorn

    from structspec.server.app import create_app
    from structspec.server.limits import limits_from_args
    from structspec.server.log_config import log_config_from_args
    from structspec.server.metrics import ServerMetrics
    from structspec.server.serving import ServerState

    info = engine.info
    name = args.served_model_name or _default_model_name(args.model, info.model_path)
    state = ServerState(engine=engine, codec=codec, metrics=ServerMetrics(), model_name=name,
                        api_key=args.api_key or None, limits=limits_from_args(args),
                        log_config=log_config_from_args(args),
                        tool_call_parser=args.tool_call_parser)

    async def stop_engine() -> None:
        await engine.aclose(ENGINE_JOIN_TIMEOUT_S)

    app = create_app(state, on_shutdown=stop_engine)
    config = uvicorn.Config(app, log_level="info", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S,
                            timeout_keep_alive=5)
    server = _make_server(config, engine.begin_shutdown)
    exit_code = 0

    def restarts_exhausted(reason: str) -> None:
        nonlocal exit_code
        logger.error("the engine process is gone (%s); shutting the server down", reason)
        exit_code = 1
        server.should_exit = True

    engine.on_exhausted = restarts_exhausted
    host, port = sock.getsockname()[:2]  # the real port, also for --port 0
    logger.info("serving %s on http://%s:%d (engine pid %d, max_model_len %d, spec %s)",
                name, _url_host(host), port, info.pid, info.max_model_len,
                info.speculative_algorithm)
    server.run(sockets=[sock])
    return exit_code


def _url_host(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def _warm_imports() -> None:
    """Import the tokenizer stack (transformers: seconds) while the engine loads."""
    try:
        import structspec.models.tokenizer  # noqa: F401
    except Exception:  # reported properly when the tokenizer is built
        logger.debug("tokenizer import failed", exc_info=True)


def _default_model_name(model_arg: str | None, model_path: str) -> str:
    if model_arg is None:
        return "SmolLM2-135M-Instruct"
    p = Path(model_arg)
    return p.stem if p.suffix.lower() == ".gguf" else p.name


def _make_server(config: Any, on_exit: Callable[[], None]) -> Any:
    """uvicorn's server, plus: the first SIGINT/SIGTERM also calls ``on_exit`` (stop
    accepting requests, abort in-flight ones), and the captured signal is not re-raised after
    the graceful shutdown (the command exits normally)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                logger.info("signal %d: stop accepting, abort in-flight requests", sig)
                on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit)
                   for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server(config)
