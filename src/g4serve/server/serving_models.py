"""The served model names (vLLM's ``serving_models``): ``GET /v1/models``, the ``model`` field check every
endpoint shares, and the LoRA adapters served beside the base model, loaded at start (``--lora-modules``)
or at run time (``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``). The first name is the one
reported in metrics and ``/health``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse

from g4serve.lora import LoRAAdapterError
from g4serve.server.errors import APIError, bad_request, read_json_object

if TYPE_CHECKING:
    from g4serve.engine.async_engine import AsyncLLMEngine

MAX_LORA_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path names no file


class OpenAIServingModels:
    def __init__(
        self,
        served_model_names: list[str],
        max_model_len: int,
        lora_names: Callable[[], list[str]] = list,
        lora_root: str | None = None,
    ):
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self.lora_names = lora_names  # the adapters loaded now (the engine's registry)
        # Run-time loads read adapters only under this directory (None: run-time loading is off).
        self.lora_root = Path(lora_root).resolve() if lora_root else None

    @property
    def base_model(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name a response reports: the request's ``model`` (the base model or an adapter), or the base
        model when it names none."""
        if name is None or name in self.served_model_names or name in self.lora_names():
            return name or self.base_model
        raise APIError(
            404,
            f"model: the model '{name}' does not exist; this server serves "
            f"{self.served_model_names + self.lora_names()}",
            param="model",
        )

    def lora_name(self, model_name: str) -> str | None:
        """The adapter a request runs with: its ``model`` when that names an adapter, else None."""
        return None if model_name in self.served_model_names else model_name

    def list_models(self) -> dict:
        created = int(time.time())
        base = [{"id": name, "root": self.base_model, "parent": None} for name in self.served_model_names]
        adapters = [{"id": name, "root": name, "parent": self.base_model} for name in self.lora_names()]
        return {
            "object": "list",
            "data": [
                {
                    **entry,
                    "object": "model",
                    "created": created,
                    "owned_by": "g4serve",
                    "max_model_len": self.max_model_len,
                }
                for entry in base + adapters
            ],
        }

    def check_runtime_loading(self) -> None:
        if self.lora_root is None:
            raise APIError(
                404, "run-time LoRA loading is off: start the server with --lora-root DIR (and --api-key)"
            )

    def adapter_path(self, lora_path: object) -> str:
        """A run-time load's ``lora_path``, resolved (links followed) and required to lie under
        ``--lora-root``; relative paths are taken from the root. The refusal never says whether a path
        outside the root exists."""
        self.check_runtime_loading()
        if not isinstance(lora_path, str) or not lora_path or "\x00" in lora_path:
            raise APIError(400, "lora_path: expected a non-empty path", param="lora_path")
        if len(lora_path) > MAX_LORA_PATH_CHARS:
            raise APIError(400, f"lora_path: longer than {MAX_LORA_PATH_CHARS} characters", param="lora_path")
        try:
            resolved = (self.lora_root / lora_path).resolve()
        except (OSError, RuntimeError):  # Python 3.11 raises RuntimeError on a link loop, its text the path
            raise APIError(
                400, "lora_path: cannot be resolved (a loop of links?)", param="lora_path"
            ) from None
        if not resolved.is_relative_to(self.lora_root):
            raise APIError(
                400, "lora_path: must name a directory under the server's --lora-root", param="lora_path"
            )
        return str(resolved)


class OpenAIServingLoRA:
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
    ``{"lora_name"}`` (vLLM's routes and bodies). The API key guards them like every other route, and the
    server refuses to start them without one: whoever loads an adapter changes what other clients' requests
    naming it compute.

    Loads run one at a time. Each reads and checks its adapter in the preprocessing pool, which tokenizes
    every prompt: loads at once held an adapter each in memory (up to ~1.9 GB for 31B at rank 64) and took a
    pool worker each (four loads left no prompt processed until they finished); loads of one name at once all
    read it before all but one were refused. A load waiting its turn has read only its small body."""

    def __init__(self, engine: AsyncLLMEngine, models: OpenAIServingModels, max_body_bytes: int):
        self.engine = engine
        self.models = models
        self.max_body_bytes = max_body_bytes
        self._loading = asyncio.Lock()

    async def _body(self, request: Request, fields: tuple[str, ...]) -> dict:
        body = await read_json_object(request, self.max_body_bytes)
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name]:
                raise APIError(400, f"{name}: expected a non-empty string", param=name)
        unknown = sorted(set(body) - set(fields) - {"load_inplace"})
        if unknown:
            raise APIError(400, f"{unknown[0]}: unknown field", param=unknown[0])
        if not isinstance(body.get("load_inplace", False), bool):
            raise APIError(400, "load_inplace: expected true or false", param="load_inplace")
        return body

    async def load(self, request: Request) -> JSONResponse:
        self.models.check_runtime_loading()
        body = await self._body(request, ("lora_name", "lora_path"))
        name = body["lora_name"]
        if name in self.models.served_model_names:
            raise APIError(400, f"lora_name: '{name}' is the base model's name", param="lora_name")
        path = self.models.adapter_path(body["lora_path"])
        try:
            async with self._loading:  # the name and a free slot are checked again in turn, before any read
                await self.engine.load_lora(name, path, confine_to=str(self.models.lora_root))
        except LoRAAdapterError as exc:
            # The message names the file at fault relative to the adapter, never the server's directories.
            message = str(exc).replace(path, body["lora_path"]).replace(str(self.models.lora_root), "<root>")
            raise APIError(400, f"lora_path: {message}", param="lora_path") from None
        except ValueError as exc:
            raise bad_request(exc) from None
        return JSONResponse({"status": "loaded", "lora_name": name})

    async def unload(self, request: Request) -> JSONResponse:
        self.models.check_runtime_loading()
        name = (await self._body(request, ("lora_name",)))["lora_name"]
        try:
            await self.engine.unload_lora(name)
        except KeyError:
            message = f"lora_name: no adapter named '{name}' is loaded"
            raise APIError(404, message, param="lora_name") from None
        return JSONResponse({"status": "unloaded", "lora_name": name})
