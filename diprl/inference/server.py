"""PolicyServer: one Ray Serve deployment of vLLM serving the base model and many LoRA versions at once.

Rollout workers call `generate` through a deployment handle with batches of plain-dict requests,
each naming its policy (`base` or `<policy>@v<N>`) and, for constrained decoding, its legal orders.
Requests for different adapters share the engine's batches. People and other tools can query any
version through a small OpenAI-compatible route (`POST /v1/completions`, model = version name).

The deployment is a thin shell: the engine, its adapters and every request's checks are the
`PolicyEngine` (`diprl.inference.policy_engine`); starting, updating and stopping the deployment on
a Ray cluster is `diprl.inference.deploy`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve

from diprl.inference.adapters import BASE
from diprl.inference.adapters.pins import PinKey, use_key
from diprl.inference.config import ServerConfig, is_loopback
from diprl.inference.http_guard import RouteGuard, route_token
from diprl.inference.http_route import OPENAPI_BODY, CompletionsRoute
from diprl.inference.policy_engine import PolicyEngine
from diprl.messages import Generation, GenerationRequest

__all__ = ["PolicyServer"]


def _child_pids() -> list[int]:
    """This process's children (vLLM's engine core runs in one), from /proc; empty where there is none."""
    pids: list[int] = []
    for tasks in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids.extend(int(pid) for pid in tasks.read_text().split())
    return sorted(set(pids))


app = FastAPI(title="diprl PolicyServer", description="Completions from the base model or any adapter version.")


@serve.deployment
@serve.ingress(app)
class PolicyServer:
    """The Ray Serve deployment: `generate` for rollout workers, `/v1/*` for people and tools."""

    def __init__(self, config: dict[str, Any], pin_key: PinKey | None = None) -> None:
        use_key(pin_key)  # a training run's adapter pin key, before the engine opens the store
        self.config = ServerConfig(**config)
        self.guard = RouteGuard(
            loopback_hosts_only=is_loopback(self.config.host), token=route_token(self.config.http_token_file)
        )
        self.engine = PolicyEngine(self.config)
        self.http = CompletionsRoute(
            self.engine.generate_one,
            self.config.max_body_bytes,
            max_ongoing=self.config.http_max_ongoing,
            guard=self.guard,
        )

    async def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        return await self.engine.generate(requests)

    async def limits(self) -> dict[str, Any]:
        """The engine limits requests are checked against (context length, prompt token ids)."""
        return asdict(self.engine.limits)

    async def status(self) -> dict[str, Any]:
        """Loaded adapters, counters, canaries (`ReplicaCanaries.stats`: checks, failures, probe seconds,
        each checked version's error, the refused versions), and this replica's identity (actor, engine-core
        processes)."""
        import ray

        context = ray.get_runtime_context()
        return {
            "loaded": self.engine.adapters.loaded(),
            "loads": self.engine.adapters.loads,
            "unloads": self.engine.adapters.unloads,
            "replica": context.get_actor_name(),
            "actor_id": context.get_actor_id(),
            "failed_requests": self.engine.failed_requests,
            "mean_batch": self.engine.occupancy.mean(),
            "busy_s": self.engine.occupancy.busy_s,
            "dead": self.engine.dead,
            "engine_pids": _child_pids(),
            **self.engine.canaries.stats(),
        }

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def identity(self) -> dict[str, Any]:
        """What this server serves, so another `serve_policy` of the same name can tell whose it is."""
        return {"adapter_root": self.config.adapter_root, "model": self.config.model}

    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        refused = self.guard.check(request)
        if refused is not None:
            return refused
        names = [BASE] + [
            str(ref) for policy in self.engine.store.policies() for ref in self.engine.store.versions(policy)
        ]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "diprl"} for n in names]}

    @app.post("/v1/completions", openapi_extra=OPENAPI_BODY)
    async def completions(self, request: Request) -> Response:
        return await self.http(request)
