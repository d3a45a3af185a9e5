"""An OpenAI-compatible HTTP server over one servelab engine (``python serve.py``).

The engine is synchronous and single-threaded: one thread owns the :class:`engine.LLM` and loops
``step()``. HTTP handlers run on an asyncio event loop and never touch the engine; they talk to
its thread through a thread-safe command queue (add, abort) and get tokens back through one
asyncio queue per request, filled with ``loop.call_soon_threadsafe``. So a forward pass never
blocks the event loop, and the event loop never races the scheduler.

Modules, one concern each:

* :mod:`server.protocol` -- request and response schemas (pydantic), OpenAI's error object;
* :mod:`server.requests` -- a parsed request turned into prompt token ids + ``SamplingParams``,
  checked against the model's limits (400 naming the field and the limit);
* :mod:`server.engine_thread` -- the thread that owns the engine, the queues, backpressure;
* :mod:`server.streams` -- engine outputs turned into OpenAI response bodies and SSE chunks;
* :mod:`server.sse` -- server-sent-event framing;
* :mod:`server.metrics` -- Prometheus metrics with vLLM's names, one registry per app;
* :mod:`server.routes` -- the endpoints; :mod:`server.app` -- the FastAPI app, auth, errors;
* :mod:`server.launch` -- uvicorn with SIGTERM handling (abort in-flight requests, exit 0).
"""
