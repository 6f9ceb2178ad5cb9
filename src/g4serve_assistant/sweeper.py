"""``ProposalSweeper``: cancels in the bank the proposals no confirmation can reach any more, so that a
session ending without a logout leaves no transfer pending (docs/assistant.md, "When a session ends"). The
conversation store hands them over (``ConversationStore.stale``): a proposal past its confirmation window (its
session expired, or the customer walked away), an evicted dialogue state's, and when a server that keeps its
sessions in memory stops, every one left."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Callable

from g4serve_assistant.audit import AuditRow
from g4serve_assistant.bank import BankBackend, BankUnavailableError, UnknownCustomerError
from g4serve_assistant.policy import CONFIRM_TTL_S, StaleAction
from g4serve_assistant.state import AuditTrail, ConversationStore

log = logging.getLogger("g4serve_assistant")


class ProposalSweeper:
    """Takes up to ``batch`` proposals due at each pass (``sweep``, every ``interval_s`` under ``run``) and
    cancels each in the bank, recording it in the audit trail once. It runs beside the server, the bank
    called from a worker thread, so a slow or down bank stalls neither the event loop nor anyone's turn; what
    the bank did not answer comes back ``retry_s`` later, until it does. ``ttl_s`` and ``clock``: the
    policies' confirmation window and the clock they propose on."""

    def __init__(
        self,
        store: ConversationStore,
        bank: BankBackend,
        audit: AuditTrail,
        *,
        ttl_s: float = CONFIRM_TTL_S,
        interval_s: float = 5.0,
        retry_s: float = 30.0,
        batch: int = 100,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.bank = bank
        self.audit = audit
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.batch = batch
        self.clock = clock

    async def run(self) -> None:
        """Sweeps until cancelled (the app's lifespan); a full batch is followed by the next at once."""
        while True:
            try:
                taken = await asyncio.to_thread(self.sweep)
            except Exception:  # noqa: BLE001 - the store or the audit trail failed: this pass is retried
                log.exception("sweeping stale proposals failed; trying again in %g s", self.interval_s)
                taken = 0
            if taken < self.batch:
                await asyncio.sleep(self.interval_s)

    def sweep(self) -> int:
        """One pass (a worker thread); returns how many proposals it took."""
        taken = self.store.stale(self.clock(), self.ttl_s, self.retry_s, self.batch)
        self._cancel_all(taken)
        return len(taken)

    def drain(self) -> None:
        """The sessions end now, with the process that keeps them in memory: every proposal left is cancelled,
        one try each; those the bank did not cancel stay pending, and are logged for an operator."""
        # At the end of time every proposal is past its window, and every retry is due.
        left = self._cancel_all(self.store.stale(math.inf, 0.0, 0.0, sys.maxsize), "stopped")
        if left:
            log.error(
                "stopping: the bank did not cancel %d pending transfers: %s",
                len(left),
                ", ".join(f"{a.transfer_id} (customer {a.customer_id})" for a in left),
            )

    def _cancel_all(self, actions: list[StaleAction], reason: str | None = None) -> list[StaleAction]:
        """Cancels each and records it; returns those not cancelled. A bank that does not answer ends the pass
        (it would not answer the rest either, and each try may wait out a timeout)."""
        left = []
        for i, action in enumerate(actions):
            try:
                status = self._cancel(action)
            except BankUnavailableError as exc:
                log.warning(
                    "bank unavailable: %d cancellations wait for the next try (%s)", len(actions) - i, exc
                )
                return left + actions[i:]
            except Exception:  # noqa: BLE001 - one transfer the bank refuses must not hold up the others
                log.exception("cancelling transfer %s failed; it is tried again later", action.transfer_id)
                left.append(action)
                continue
            if self.store.cancelled(action):  # else settled meanwhile, and recorded, by whoever did
                detail = {
                    "kind": action.kind,
                    "action_id": action.action_id,
                    "transfer_id": action.transfer_id,
                    "status": status,
                }
                self.audit.append(
                    [AuditRow("sweeper", f"pending_{reason or action.reason}", detail)],
                    customer_id=action.customer_id,
                    session_id=action.session_id,
                    client=None,
                )
        return left

    def _cancel(self, action: StaleAction) -> str | None:
        """The transfer's status after the cancel: 'cancelled', or what it became first (a yes won the bank's
        race); None when its customer is gone from the bank, and the transfer with them."""
        try:
            view = self.bank.customer(action.customer_id)
            view.cancel_transfer(action.transfer_id)
            transfer = view.transfer(action.transfer_id)
        except UnknownCustomerError:
            return None
        return transfer["status"] if transfer is not None else None
