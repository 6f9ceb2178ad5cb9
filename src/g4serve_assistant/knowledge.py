"""The assistant's built-in knowledge base for QnA: short documents on branches, ATMs, cards, fees and rates.

Demo content for a fictional bank; a deployment replaces ``DOCUMENTS`` with its own policy texts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


DOCUMENTS: tuple[Document, ...] = (
    Document(
        "branch-hours",
        "Branch opening hours",
        "Branches are open Monday to Friday from 9 am to 5 pm and on Saturday from 9 am to 1 pm. "
        "Branches are closed on Sundays and public holidays.",
    ),
    Document(
        "phone-support",
        "Phone support hours",
        "Phone support is available 24 hours a day, 7 days a week, at 1-800-555-0100. "
        "Say 'agent' at any time to talk to a person.",
    ),
    Document(
        "atm-fees",
        "ATM fees",
        "Withdrawals at our own ATMs are free. Other banks' ATMs cost $2.50 per withdrawal in the US "
        "and $5.00 abroad, plus any fee the ATM owner charges.",
    ),
    Document(
        "atm-limits",
        "ATM withdrawal limits",
        "You can withdraw up to $1,000 a day from ATMs with a debit card. The limit can be raised "
        "for one day by calling phone support.",
    ),
    Document(
        "atm-locations",
        "Finding an ATM",
        "We have more than 2,000 ATMs. The mobile app's map shows the nearest ATMs and branches, "
        "including which ones accept cash and cheque deposits.",
    ),
    Document(
        "overdraft",
        "Overdraft fees and protection",
        "An overdraft costs $25, at most three times a day. Overdraft protection links your savings "
        "account to your checking account and moves money automatically for a $5 transfer fee.",
    ),
    Document(
        "card-lost",
        "Lost or stolen card",
        "If your card is lost or stolen, lock it at once in the app or by saying 'lock my card', then "
        "call phone support. You are not liable for fraudulent charges reported within 60 days.",
    ),
    Document(
        "card-replacement",
        "Card replacement",
        "A replacement debit card is free and arrives in 5 to 7 business days. Express delivery in "
        "2 business days costs $15. The new card has a new number; your PIN stays the same.",
    ),
    Document(
        "card-lock",
        "Locking and unlocking a card",
        "Locking a card blocks new purchases and withdrawals but keeps automatic payments running. "
        "You can unlock it at any time in the app or with the assistant.",
    ),
    Document(
        "wire-cutoff",
        "Wire transfer cut-off times",
        "Domestic wires sent before 4 pm Eastern time on a business day arrive the same day. "
        "International wires must be sent before 2 pm Eastern time and take 1 to 3 business days.",
    ),
    Document(
        "wire-fees",
        "Wire transfer fees",
        "Outgoing domestic wires cost $25 and international wires $45. Incoming wires are free. "
        "Transfers to payees inside our bank are always free.",
    ),
    Document(
        "transfer-limits",
        "Transfer limits",
        "Transfers from the app or the assistant are limited to $5,000 per transfer and $10,000 per "
        "day. Larger transfers must be made in a branch.",
    ),
    Document(
        "savings-rates",
        "Savings account interest rates",
        "The standard savings account pays 3.5% APY on all balances. The high-yield savings account "
        "pays 4.1% APY on balances of $10,000 or more. Interest is paid monthly.",
    ),
    Document(
        "cd-rates",
        "Certificate of deposit rates",
        "Certificates of deposit pay 4.3% APY for 12 months and 3.9% APY for 24 months, with a "
        "$1,000 minimum deposit. Early withdrawal costs 90 days of interest.",
    ),
    Document(
        "checking-fees",
        "Checking account fees",
        "The checking account has a $10 monthly fee, waived with a $1,500 minimum balance or a "
        "monthly direct deposit of $500 or more.",
    ),
    Document(
        "mortgage-rates",
        "Mortgage rates",
        "Fixed-rate mortgages start at 6.4% APR for 30 years and 5.8% APR for 15 years. Rates depend "
        "on credit score and down payment; a loan officer can give you a personal quote.",
    ),
    Document(
        "personal-loans",
        "Personal loans",
        "Personal loans from $2,000 to $40,000 are available for 12 to 60 months at 7.9% to 18.9% APR. "
        "There is no fee for paying a loan off early.",
    ),
    Document(
        "direct-deposit",
        "Direct deposit and routing number",
        "Our routing number is 021000999. Direct deposits are available on the day they arrive, and "
        "up to two days early when the payer sends them early.",
    ),
    Document(
        "cheque-deposit",
        "Depositing cheques",
        "Deposit cheques in the app by photographing both sides, at any ATM that accepts deposits, or "
        "in a branch. The first $225 is available the next business day.",
    ),
    Document(
        "foreign-fees",
        "Foreign transaction fees",
        "Debit card purchases in a foreign currency cost 3% of the amount. The travel credit card has "
        "no foreign transaction fees.",
    ),
    Document(
        "account-opening",
        "Opening an account",
        "You can open a checking or savings account in the app in about 10 minutes with a government "
        "ID and your Social Security number. There is no minimum opening deposit.",
    ),
    Document(
        "security",
        "Security and fraud",
        "The bank will never ask for your PIN, password or one-time code by phone, email or text. "
        "Report suspicious messages to phone support.",
    ),
)
