"""The HTTP routes, one ``APIRouter`` per API family; each handler hands the request to the serving object
``build_app`` put on ``app.state`` (``serving_chat``, ``serving_completion``, ``serving_models``).

- ``openai``: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/audio/transcriptions``,
  ``POST /v1/audio/translations`` (``serving_speech``), ``POST``/``GET``/``DELETE /v1/responses``, its
  ``cancel`` and ``input_items`` (``serving_responses``), ``GET /v1/models``, ``POST /v1/load_lora_adapter``
  and ``/v1/unload_lora_adapter`` (``serving_lora``);
- ``system``: ``GET /health``, ``GET /metrics``, and with ``G4SERVE_TORCH_PROFILER_DIR`` set ``POST
  /start_profile`` and ``POST /stop_profile`` (``engine/torch_profile.py``; 404 without it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from g4serve.engine.torch_profile import ProfileError
from g4serve.server.errors import error_response, health_response

openai = APIRouter()
system = APIRouter()


@openai.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await request.app.state.serving_chat.create(request)


@openai.post("/v1/completions")
async def completions(request: Request):
    return await request.app.state.serving_completion.create(request)


@openai.post("/v1/audio/transcriptions")
async def transcriptions(request: Request):
    return await request.app.state.serving_speech.create(request, "transcribe")


@openai.post("/v1/audio/translations")
async def translations(request: Request):
    return await request.app.state.serving_speech.create(request, "translate")


@openai.post("/v1/responses")
async def responses(request: Request):
    return await request.app.state.serving_responses.create(request)


@openai.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    return request.app.state.serving_responses.retrieve(request, response_id)


@openai.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict:
    return await request.app.state.serving_responses.delete(request, response_id)


@openai.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    return await request.app.state.serving_responses.cancel(request, response_id)


@openai.get("/v1/responses/{response_id}/input_items")
async def response_input_items(request: Request, response_id: str) -> Response:
    return request.app.state.serving_responses.input_items(request, response_id)


@openai.get("/v1/models")
async def models(request: Request) -> dict:
    return request.app.state.serving_models.list_models()


@openai.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> JSONResponse:
    return await request.app.state.serving_lora.load(request)


@openai.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> JSONResponse:
    return await request.app.state.serving_lora.unload(request)


@system.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    return health_response(state.engine, model=state.serving_models.base_model)


@system.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@system.post("/start_profile")
async def start_profile(request: Request) -> JSONResponse:
    return await _profile(request, start=True)


@system.post("/stop_profile")
async def stop_profile(request: Request) -> JSONResponse:
    return await _profile(request, start=False)


async def _profile(request: Request, start: bool) -> JSONResponse:
    engine = request.app.state.engine
    try:
        if start:
            await engine.start_profile()
            return JSONResponse({"status": "profiling"})
        return JSONResponse({"status": "stopped", **await engine.stop_profile()})
    except LookupError as exc:
        return error_response(404, str(exc))
    except ProfileError as exc:
        return error_response(400, str(exc))
