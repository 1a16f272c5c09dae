"""Serve an auto-batched function on Ray Serve: ``@serve.batch`` gathers, ``autobatch`` runs.

Ray Serve's ``@serve.batch`` collects single requests into a list (up to ``max_batch_size``,
measured by ``batch_size_fn`` when given, or ``batch_wait_timeout_s``); the list is one
:func:`batchcraft.autobatch` call through :func:`run_isolated`, so a failing instance fails only
its own request (``@serve.batch`` alone would fail the whole batch). Replicas, autoscaling and
the HTTP proxy are Ray Serve's; this module adds nothing to them.

Needs the ``serve`` extra: ``pip install 'batchcraft[serve]'`` (Ray Serve from PyPI).

Example::

    from ray import serve
    from batchcraft.serving.ray_serve import deployment
    handle = serve.run(deployment(model, max_batch_size=32, batch_wait_timeout_s=0.005))
    y = handle.remote(sentence).result()            # model(sentence), served in a batch
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from batchcraft.errors import ConfigurationError


def _serve():
    try:
        from ray import serve
    except ImportError as exc:  # optional dependency: fail at use, naming the package
        raise ConfigurationError("batchcraft.serving.ray_serve needs Ray Serve, which is not installed",
                                 hint="pip install 'batchcraft[serve]'  (or: pip install 'ray[serve]')") from exc
    return serve


class AutobatchServer:
    """The replica's class: one auto-batched function behind ``@serve.batch``.

    Args:
        fn (callable): per-instance function, ``fn(instance) -> result`` (an ``nn.Module`` is fine);
            or ``factory`` and ``fn=None``.
        factory (callable | None): ``factory() -> fn``, called in the replica (large models are
            then built there instead of being shipped).
        max_batch_size (int): instances per batch at most. Default: 32.
        max_batch_work (int | None): work units per batch at most, measured by ``work``
            (``@serve.batch``'s ``batch_size_fn``; an instance heavier than this counts as
            this much, so it runs alone). Default: None.
        batch_wait_timeout_s (float): longest wait for a batch to fill, seconds. Default: 0.005.
        work (callable | None): ``work(instance) -> int``. Default: ``len``.
        decode (callable | None): ``decode(json_body) -> instance`` for HTTP requests;
            ``encode(result) -> JSON-able`` for their answers.
    Calls:
        ``handle.remote(instance)`` -> result of ``fn(instance)`` (its own exception if it raised);
        ``handle.stats.remote()`` -> ``{"requests", "batches", "batch_sizes"}``.
    """

    def __init__(self, fn: Callable | None = None, *, factory: Callable | None = None, max_batch_size: int = 32,
                 max_batch_work: int | None = None, batch_wait_timeout_s: float = 0.005,
                 work: Callable | None = None,
                 decode: Callable | None = None, encode: Callable | None = None, autobatch_options=None):
        from batchcraft.autobatching import autobatch

        serve = _serve()
        if (fn is None) == (factory is None):
            raise ValueError("AutobatchServer: give exactly one of fn and factory")
        self.fn = autobatch(fn if fn is not None else factory(), **(autobatch_options or {}))
        self.decode, self.encode = decode, encode
        self.batch_sizes: list[int] = []
        self.max_batch_size = max_batch_size
        size_fn, limit = None, max_batch_size
        if max_batch_work is not None:
            # Ray Serve has one limit: it becomes the work budget, the instance cap is kept by
            # splitting a batch in _run_batch
            work, limit = work or len, int(max_batch_work)
            size_fn = lambda items: sum(min(int(work(x)), limit) for x in items)  # noqa: E731
        self.handle_batch = serve.batch(max_batch_size=limit, batch_wait_timeout_s=batch_wait_timeout_s,
                                        batch_size_fn=size_fn)(self._run_batch)

    async def _run_batch(self, instances: list) -> list:
        from batchcraft.serving.isolate import run_isolated

        out = []
        for k in range(0, len(instances), self.max_batch_size):
            chunk = instances[k:k + self.max_batch_size]
            self.batch_sizes.append(len(chunk))
            # in a thread: the replica's event loop keeps taking requests for the next batch
            out += await asyncio.to_thread(run_isolated, self.fn, chunk)
        return out

    async def __call__(self, request: Any):
        http = type(request).__name__ == "Request" and hasattr(request, "json")
        instance = self.decode(await request.json()) if http and self.decode else request
        result = (await self.handle_batch(instance)).unwrap()
        return self.encode(result) if http and self.encode else result

    def stats(self) -> dict:
        return {"requests": sum(self.batch_sizes), "batches": len(self.batch_sizes),
                "batch_sizes": list(self.batch_sizes)}


def deployment(fn: Callable | None = None, *, name: str = "batchcraft", num_replicas: int = 1,
               ray_actor_options: dict | None = None, max_ongoing_requests: int = 256, **server_options):
    """A Ray Serve application serving ``fn`` with dynamic batching; pass it to ``serve.run``.

    Args:
        fn (callable | None): per-instance function (or pass ``factory=``).
        name (str): deployment name. Default: "batchcraft".
        num_replicas (int): replicas (Ray Serve places them on the cluster). Default: 1.
        ray_actor_options (dict | None): e.g. ``{"num_cpus": 1}``. Default: ``{"num_cpus": 1}``.
        max_ongoing_requests (int): requests a replica accepts at once; must exceed the batch
            size, or batches never fill. Default: 256.
        **server_options: :class:`AutobatchServer` options (``max_batch_size``, ``max_batch_work``,
            ``batch_wait_timeout_s``, ``work``, ``factory``, ``decode``, ``encode``).
    Returns:
        ray.serve.Application
    Raises:
        ConfigurationError: Ray Serve is not installed.
    """
    serve = _serve()
    cls = serve.deployment(name=name, num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                           ray_actor_options=ray_actor_options or {"num_cpus": 1})(AutobatchServer)
    return cls.bind(fn, **server_options)
