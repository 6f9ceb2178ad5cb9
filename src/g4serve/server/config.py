"""``ServerConfig``: the HTTP server's own options (the engine's are ``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from g4serve.server.body_budget import BodyLimits


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    # The cap per request body, the bytes of bodies held at once (from their headers until their requests are
    # in the engine) and the seconds a whole body may take after its headers: ``guard.GuardMiddleware``.
    body_limits: BodyLimits = field(default_factory=BodyLimits)
    allowed_local_media_path: str | None = None  # local media files allowed only under this directory
    drain_timeout_s: float = 30.0
    # Requests being prepared or queued for the engine past which new ones get 429 (None: no limit).
    max_waiting_requests: int | None = 1024
    metrics_public: bool = False  # /metrics readable without the API key (for scrapers)
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    # accept chat_template_kwargs.chat_template (rendered sandboxed, under ChatTemplateLimits)
    trust_request_chat_template: bool = False
    # read added tokens' spellings in messages and tools as those tokens (transformers' and vLLM's reading);
    # default: as words (Tokenizer.as_text), so a client's text cannot write turns of its own
    trust_message_control_tokens: bool = False
    # /v1/responses kept for previous_response_id and GET: least recently used out past either bound
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 256 << 20
    # POST /v1/load_lora_adapter reads adapters under this directory only (None: run-time loading is off);
    # it needs api_key too.
    lora_root: str | None = None

    @property
    def max_request_body_bytes(self) -> int:
        return self.body_limits.max_request_body_bytes

    def is_public(self, path: str) -> bool:
        """Paths open without the API key: liveness, and the metrics when asked for."""
        return path == "/health" or (self.metrics_public and path == "/metrics")
