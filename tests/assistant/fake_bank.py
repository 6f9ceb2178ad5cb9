"""A bank's REST API as docs/assistant.md ("Bank backends") specifies it, served over a ``SQLiteBank``: what
``HTTPBank`` is tested against. ``FakeBankServer`` runs it with uvicorn on a loopback port, with faults to
inject (a status for every request, a delay)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated

from fastapi import Body, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from served import UvicornThread

from g4serve_assistant.bank import UnknownCustomerError, check_idempotency_key
from g4serve_assistant.db import SQLiteBank, SQLiteCustomerBank


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class TransferIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: StrictStr
    payee_id: StrictStr
    amount_minor: StrictInt
    currency: StrictStr
    kind: StrictStr
    from_account_id: StrictStr | None = None
    scheduled_for: dt.date | None = None


class ExecuteIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    today: dt.date | None = None


class CardPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    locked: StrictBool


class FakeBank:
    """The app and its knobs: ``bank`` (swappable between tests); ``fault``, a status every request gets;
    ``delay_s``, after the request was carried out and before the answer leaves; ``api_key``, required as a
    bearer token when set; ``requests``, (method, path, headers) of each request seen."""

    def __init__(self, bank: SQLiteBank | None = None, api_key: str | None = None):
        self.bank = bank or SQLiteBank()
        self.api_key = api_key
        self.fault: int | None = None
        self.delay_s = 0.0
        self.requests: list[tuple[str, str, dict]] = []
        self.app = self._build()

    def view(self, customer_id: str) -> SQLiteCustomerBank:
        try:
            return self.bank.customer(customer_id)
        except UnknownCustomerError:
            raise ApiError(404, "unknown_customer", f"no customer {customer_id!r}") from None

    def _build(self) -> FastAPI:  # noqa: C901 - one small handler per route of the API
        app = FastAPI()

        @app.middleware("http")
        async def gate(request: Request, call_next):
            self.requests.append((request.method, request.url.path, dict(request.headers)))
            if self.fault is not None:
                return _error(self.fault, "fault", "injected fault")
            if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return _error(401, "unauthorized", "missing or wrong API key")
            response = await call_next(request)
            if self.delay_s:  # the bank acted; its answer is late (or lost, to a client that gave up)
                await asyncio.sleep(self.delay_s)
            return response

        @app.exception_handler(ApiError)
        async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
            return _error(exc.status, exc.code, exc.message)

        @app.exception_handler(RequestValidationError)
        async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
            return _error(422, "invalid", str(exc.errors()[0]["msg"]))

        base = "/v1/customers/{customer_id}"

        @app.get(base)
        def customer(customer_id: str) -> dict:
            view = self.view(customer_id)
            return {
                "customer_id": customer_id,
                "name": self.bank.customer_name(customer_id),
                "payee_version": view.version,
            }

        @app.get(base + "/payees")
        def payees(customer_id: str) -> dict:
            return {"payees": [_payee(p) for p in self.view(customer_id).payees()]}

        @app.get(base + "/payees/{payee_id}")
        def payee(customer_id: str, payee_id: str) -> dict:
            p = self.view(customer_id).payee(payee_id)
            if p is None:
                raise ApiError(404, "not_found", f"no payee {payee_id!r}")
            return _payee(p)

        @app.get(base + "/accounts")
        def accounts(customer_id: str, currency: str | None = None) -> dict:
            found = self.view(customer_id).accounts()
            return {"accounts": [a for a in found if currency is None or a["currency"] == currency]}

        @app.get(base + "/accounts/{account_id}")
        def account(customer_id: str, account_id: str) -> dict:
            try:
                return self.view(customer_id).balance(account_id)
            except KeyError:
                raise ApiError(404, "not_found", f"no account {account_id!r}") from None

        @app.get(base + "/transactions")
        def transactions(
            customer_id: str,
            limit: Annotated[int, Query(ge=0, le=1000)] = 5,
            account_id: str | None = None,
        ) -> dict:
            return {"transactions": self.view(customer_id).recent_transactions(limit, account_id)}

        @app.get(base + "/cards")
        def cards(customer_id: str) -> dict:
            return {"cards": self.view(customer_id).cards()}

        @app.patch(base + "/cards/{card_id}")
        def card(customer_id: str, card_id: str, patch: CardPatch) -> dict:
            view = self.view(customer_id)
            try:
                view.set_card_locked(card_id, patch.locked)
            except KeyError:
                raise ApiError(404, "not_found", f"no card {card_id!r}") from None
            return next(c for c in view.cards() if c["card_id"] == card_id)

        @app.post(base + "/transfers", status_code=201)
        def create(customer_id: str, t: TransferIn) -> dict:
            view = self.view(customer_id)
            try:
                transfer_id = view.create_transfer(
                    t.session_id,
                    t.payee_id,
                    t.amount_minor,
                    t.currency,
                    t.kind,
                    t.from_account_id,
                    t.scheduled_for,
                )
            except ValueError as exc:
                raise ApiError(422, "invalid", str(exc)) from None
            return view.transfer(transfer_id)

        @app.get(base + "/transfers")
        def transfers(customer_id: str, status: str | None = None) -> dict:
            return {"transfers": self.view(customer_id).transfers(status)}

        @app.get(base + "/transfers/{transfer_id}")
        def transfer(customer_id: str, transfer_id: str) -> dict:
            return self._transfer(self.view(customer_id), transfer_id)

        @app.post(base + "/transfers/{transfer_id}/execute")
        def execute(
            customer_id: str,
            transfer_id: str,
            idempotency_key: Annotated[str, Header()],
            body: Annotated[ExecuteIn | None, Body()] = None,
        ) -> dict:
            view = self.view(customer_id)
            self._transfer(view, transfer_id)  # 404 first
            try:
                check_idempotency_key(idempotency_key)
            except ValueError as exc:
                raise ApiError(422, "invalid", str(exc)) from None
            try:
                return view.execute_transfer(transfer_id, idempotency_key, body.today if body else None)
            except ValueError as exc:  # not pending, or the key used on another transfer
                raise ApiError(409, "conflict", str(exc)) from None

        @app.post(base + "/transfers/{transfer_id}/cancel")
        def cancel(customer_id: str, transfer_id: str) -> dict:
            view = self.view(customer_id)
            self._transfer(view, transfer_id)
            view.cancel_transfer(transfer_id)
            return view.transfer(transfer_id)

        return app

    @staticmethod
    def _transfer(view: SQLiteCustomerBank, transfer_id: str) -> dict:
        t = view.transfer(transfer_id)
        if t is None:
            raise ApiError(404, "not_found", f"no transfer {transfer_id!r}")
        return t


def _payee(p) -> dict:
    return {
        "payee_id": p.payee_id,
        "display_name": p.display_name,
        "relationship": p.relationship,
        "kind": p.kind,
        "aliases": list(p.aliases),
    }


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


class FakeBankServer(UvicornThread):
    """``FakeBank`` under uvicorn on 127.0.0.1 in a daemon thread; ``url`` once started."""

    def __init__(self, fake: FakeBank):
        super().__init__(fake.app, lifespan="off", start_timeout_s=10)
        self.fake = fake
