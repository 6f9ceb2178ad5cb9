"""The served model names (vLLM's ``serving_models``): ``GET /v1/models`` and the ``model`` field check
every endpoint shares. The first name is the one reported in metrics and ``/health``."""

from __future__ import annotations

import time

from g4serve.server.errors import APIError


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], max_model_len: int):
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len

    @property
    def base_model(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name a response reports: the request's ``model``, or the base model when it names none."""
        if name is None or name in self.served_model_names:
            return name or self.base_model
        raise APIError(
            404,
            f"model: the model '{name}' does not exist; this server serves {self.served_model_names}",
            param="model",
        )

    def list_models(self) -> dict:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "g4serve",
                    "root": self.base_model,
                    "max_model_len": self.max_model_len,
                }
                for name in self.served_model_names
            ],
        }
