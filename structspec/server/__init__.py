"""OpenAI-compatible HTTP front end of structspec (``structspec serve``).

Process layout: the front-end process runs FastAPI + uvicorn, tokenizes prompts (chat
template included), detokenizes outputs and serves ``/metrics``; the scheduler and the model
live in a separate *engine process* (``multiprocessing`` spawn) so its loop never shares a GIL
with HTTP handling. The two talk over pipes: token ids + :class:`~structspec.core.SamplingParams`
go in, compact per-step deltas come back (:mod:`structspec.server.ipc`).

Modules (one job each):

- :mod:`~structspec.server.ipc`: the picklable messages exchanged by the two processes.
- :mod:`~structspec.server.engine_process`: the engine process's entry point and loop.
- :mod:`~structspec.server.engine_client`: the front end's handle on that process.
- :mod:`~structspec.server.supervisor`: restarts a dead engine process (bounded, backoff).
- :mod:`~structspec.server.limits`: admission limits (choices, queue, sizes).
- :mod:`~structspec.server.protocol`: pydantic models of the OpenAI requests.
- :mod:`~structspec.server.structured`: request fields -> :data:`~structspec.core.GrammarConstraint`.
- :mod:`~structspec.server.params`: request fields -> :class:`~structspec.core.SamplingParams`.
- :mod:`~structspec.server.codec`: tokenization and incremental detokenization.
- :mod:`~structspec.server.generation`: the n engine requests behind one HTTP request.
- :mod:`~structspec.server.serving_chat` / :mod:`~structspec.server.serving_completion`:
  response bodies and SSE chunks.
- :mod:`~structspec.server.serving_tokenize`: vLLM's ``/tokenize`` and ``/detokenize``.
- :mod:`~structspec.server.metrics`: Prometheus metrics.
- :mod:`~structspec.server.errors`: OpenAI-style error bodies.
- :mod:`~structspec.server.app`: the FastAPI application.
- :mod:`~structspec.server.launch`: ``serve(args)``: port check, engine start, uvicorn, shutdown.

Nothing here is imported by ``import structspec``; fastapi/uvicorn are imported lazily by
:mod:`~structspec.server.app` and :mod:`~structspec.server.launch` only.
"""
