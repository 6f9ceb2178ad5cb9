"""``ServerConfig``: the HTTP server's own options (the engine's are ``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_request_body_bytes: int = 64 << 20
    allowed_local_media_path: str | None = None  # local media files allowed only under this directory
    drain_timeout_s: float = 30.0
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
