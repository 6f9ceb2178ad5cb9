"""Payee index: misspelled and phonetically confusable names, aliases and relationships, names inside
sentences, and the rebuild when the database's payees change."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from g4serve_assistant.bank import Payee
from g4serve_assistant.db import demo_db
from g4serve_assistant.intents import AMBIGUOUS_PAYEE, resolve_payee
from g4serve_assistant.payees import PayeeIndex, simplify_name, sound_key

DATA = Path(__file__).parent / "data"


class PayeeList:
    """One customer's payees as the index reads them (``payees()``, ``version``), without a database."""

    def __init__(self, payees: list[Payee]):
        self._payees = {p.payee_id: p for p in payees}
        self.version = 1

    def payees(self) -> list[Payee]:
        return list(self._payees.values())

    def upsert(self, payee: Payee) -> None:
        self._payees[payee.payee_id] = payee
        self.version += 1


def csv_payees(path: Path) -> list[Payee]:
    with path.open(newline="") as f:
        return [
            Payee(
                r["payee_id"],
                r["display_name"],
                r["relationship"],
                r["kind"] or "person",
                tuple(a for a in (r.get("aliases") or "").split(";") if a),
            )
            for r in csv.DictReader(f)
        ]


@pytest.fixture(scope="module")
def index() -> PayeeIndex:
    return PayeeIndex(demo_db())


@pytest.fixture
def small_index() -> PayeeIndex:
    """Payees from the CSV fixture: John Smith without the demo's Jon Smythe and Joan Smith."""
    return PayeeIndex(PayeeList(csv_payees(DATA / "payees.csv")))


@pytest.mark.parametrize(
    ("query", "payee_id"),
    [
        ("prya patel", "priya_patel"),  # typo
        ("mike rosoft", "microsoft"),  # recogniser split a word
        ("aysha kahn", "aisha_khan"),
        ("hans muller", "hans_muller"),  # accent dropped
        ("hans mueller", "hans_muller"),
        ("sean obrien", "sean_obrien"),
        ("shaun o'brien", "sean_obrien"),
        ("stream flicks", "streamflix"),
        ("harbour insurance", "harbor_insurance"),
        ("north side internet", "northside_internet"),
        ("frank dubois", "francois_dubois"),
        ("jose garcia", "jose_garcia"),
        ("José García", "jose_garcia"),
        ("olga ivanova", "olga_ivanova"),
        ("yuki tanaka", "yuki_tanaka"),
        ("ahmad hasan", "ahmed_hassan"),
        ("katie", "katherine_lee"),  # contact name "Kate"
        ("mom", "mary_johnson"),  # alias
        ("johnny", "john_smith"),  # contact name
        ("electricity", "city_electric"),
        ("phone company", "skyline_mobile"),
    ],
)
def test_top1_for_misspellings_and_aliases(index, query, payee_id):
    found = index.search(query)
    assert found[0].payee_id == payee_id, [(c.payee_id, c.score) for c in found]
    payee, reason = resolve_payee(found)
    assert payee is not None and payee.payee_id == payee_id, reason


def test_phonetic_flag_marks_matches_carried_by_sound(index):
    assert index.search("mike rosoft")[0].phonetic
    assert index.search("kathryn lee")[0].phonetic
    assert not index.search("john smith")[0].phonetic


@pytest.mark.parametrize(
    ("query", "close"),
    [
        ("jon smyth", {"john_smith", "jon_smythe", "joan_smith"}),
        ("catherine", {"catherine_li", "katherine_lee"}),
        ("steven clarke", {"steven_clark", "stephen_clarke"}),
        ("smith", {"john_smith", "joan_smith"}),
        ("kathryn lee", {"katherine_lee", "catherine_li"}),  # Kathryn ~ Katherine, Lee ~ Li: heard alike
        ("steve", {"steven_clark", "stephen_clarke"}),  # both are Steve
    ],
)
def test_confusable_names_are_ambiguous(index, query, close):
    found = index.search(query)
    assert close <= {c.payee_id for c in found[: len(close)]}
    payee, reason = resolve_payee(found)
    assert payee is None and reason.startswith(AMBIGUOUS_PAYEE)


def test_misspelling_resolves_when_no_confusable_payee_exists(small_index):
    found = small_index.search("jon smyth")
    assert found[0].payee_id == "john_smith" and found[0].phonetic
    assert resolve_payee(found)[0].payee_id == "john_smith"
    assert small_index.search("catherine")[0].payee_id == "katherine_lee"


def test_results_are_sorted_bounded_and_scored(index):
    found = index.search("john", k=3)
    assert len(found) == 3
    assert [c.score for c in found] == sorted((c.score for c in found), reverse=True)
    assert all(0 <= c.score <= 100 for c in found)
    assert index.search("zzzz qqqq") == []
    assert index.search("") == []


@pytest.mark.parametrize(
    ("sentence", "payee_id"),
    [
        ("send 50.00 usd to katherine lee tomorrow", "katherine_lee"),
        ("pay city electric 84.20 usd", "city_electric"),
        ("send 20.00 usd to my friend john", "john_smith"),  # relationship breaks the tie with Jon and Joan
        ("send money to my sister", "joan_smith"),  # relationship alone
        ("transfer 100.00 usd to my mom", "mary_johnson"),
        ("pay my phone bill", "skyline_mobile"),
        ("pay the water bill", "metro_water"),
        ("pay my rent", "maria_gonzalez"),
        ("pay 12.50 usd to mike rosoft", "microsoft"),
        ("zelle shawn o brian 40.00 usd", "sean_obrien"),  # "o brian": a split name rejoined
        ("send lee wei 60.00 usd", "li_wei"),  # both words explained beats "lee" alone
        ("send 30.00 eur to hans mueller please", "hans_muller"),
        ("send 20.00 usd to john smith quickly", "john_smith"),
    ],
)
def test_find_in_utterance(index, sentence, payee_id):
    found = index.find_in_utterance(sentence)
    assert found, sentence
    payee, reason = resolve_payee(found)
    assert payee is not None and payee.payee_id == payee_id, (reason, [(c.payee_id, c.score) for c in found])


def test_find_in_utterance_reports_the_span(index):
    best = index.find_in_utterance("send 50.00 usd to jon smyth tomorrow")[0]
    assert best.span == "jon smyth"
    assert index.find_in_utterance("what is my balance") == []
    assert index.find_in_utterance("send 20.00 usd to zeb quarterman") == []


def test_name_spans(index):
    assert index.name_spans("send 50.00 usd to zeb quarterman tomorrow") == ["zeb quarterman"]
    assert index.name_spans("what is my balance") == []


def test_a_name_word_is_not_a_stopword(index):
    payees = PayeeList([Payee("june_park", "June Park", "friend", "person")])
    found = PayeeIndex(payees).find_in_utterance("send 5.00 usd to june park")
    assert found and found[0].payee_id == "june_park"


def test_rebuilds_when_payees_change():
    payees = PayeeList(csv_payees(DATA / "payees.csv"))
    index = PayeeIndex(payees)
    version = index.version
    assert all(c.payee_id != "zeb" for c in index.search("zeb quarterman"))
    payees.upsert(Payee("zeb", "Zeb Quarterman", "friend", "person"))
    assert index.search("zeb quarterman")[0].payee_id == "zeb"
    assert index.version == payees.version > version
    payees.upsert(Payee("zeb", "Zebulon Quarterman", "friend", "person"))
    assert index.search("zebulon")[0].display_name == "Zebulon Quarterman"


def test_contact_linked_to_a_payee_is_a_name_for_it():
    db = demo_db()
    index = PayeeIndex(db)
    assert not any(c.payee_id == "olga_ivanova" for c in index.search("babs"))
    db.add_contact("Babs", payee_id="olga_ivanova", phone="+1 555 0199")
    assert index.search("babs")[0].payee_id == "olga_ivanova"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("sarah", "sara"),
        ("chris", "kris"),
        ("lee", "li"),
        ("way", "wei"),
        ("smyth", "smith"),
        ("smythe", "smith"),
        ("taylor", "tailor"),
        ("stephen", "steven"),
        ("brown", "braun"),
        ("connor", "conner"),
        ("clarke", "clark"),
        ("katherine", "catherine"),
        ("patel", "patil"),
    ],
)
def test_homophones_share_a_sound_key(a, b):
    assert sound_key(a) == sound_key(b)


@pytest.mark.parametrize(("a", "b"), [("tom", "tim"), ("dan", "don"), ("jon", "jan"), ("mike", "michael")])
def test_different_names_keep_different_sound_keys(a, b):
    assert sound_key(a) != sound_key(b)  # mike/michael are one person by the nickname table, not by sound


def two_waters(*extra: Payee) -> PayeeIndex:
    return PayeeIndex(
        PayeeList(
            [
                Payee("thames_water", "Thames Water", "utility", "biller"),
                Payee("metro_water", "Metro Water", "utility", "biller", ("water",)),
                *extra,
            ]
        )
    )


def test_a_word_of_several_payees_names_none_of_them():
    index = two_waters()
    found = index.find_in_utterance("pay the water bill")
    assert {c.payee_id for c in found[:2]} == {"thames_water", "metro_water"}
    assert found[0].score == found[1].score and resolve_payee(found)[0] is None
    # The same alias with no other water company is the customer's name for it.
    alone = PayeeIndex(PayeeList([Payee("metro_water", "Metro Water", "utility", "biller", ("water",))]))
    assert alone.find_in_utterance("pay the water bill")[0].score == 100.0
    # Said in full, the name wins over the alias that matches a part of it.
    payee, reason = resolve_payee(index.find_in_utterance("pay my thames water bill"))
    assert payee is not None and payee.payee_id == "thames_water", reason


def test_a_run_after_for_is_the_purpose_unless_nothing_else_names_a_payee():
    index = two_waters(
        Payee("kris_tailor", "Kris Tailor", "roommate", "person"),
        Payee("harbourfront", "Harbourfront Property Management", "landlord", "biller", ("rent",)),
    )
    payee, reason = resolve_payee(index.find_in_utterance("send kris tailor 60.00 cad for the rent"))
    assert payee is not None and payee.payee_id == "kris_tailor", reason
    payee, reason = resolve_payee(index.find_in_utterance("send 60.00 cad for the rent"))
    assert payee is not None and payee.payee_id == "harbourfront", reason


def test_words_in_another_order_are_a_part_of_the_name():
    both = PayeeIndex(
        PayeeList(
            [Payee("li_wei", "Li Wei", "friend", "person"), Payee("wei_li", "Wei Li", "colleague", "person")]
        )
    )
    for said, payee_id in (("li wei", "li_wei"), ("wei li", "wei_li"), ("lee way", "li_wei")):
        payee, reason = resolve_payee(both.find_in_utterance(f"send {said} 30.00 usd"))
        assert payee is not None and payee.payee_id == payee_id, (said, reason)
    one = PayeeIndex(PayeeList([Payee("li_wei", "Li Wei", "friend", "person")]))
    assert resolve_payee(one.find_in_utterance("send wei li 30.00 usd"))[0].payee_id == "li_wei"


def test_a_nickname_reaches_the_long_name_and_asks_when_another_fits():
    index = PayeeIndex(
        PayeeList(
            [
                Payee("mike_brown", "Mike Brown", "brother", "person"),
                Payee("michael_braun", "Michael Braun", "colleague", "person"),
                Payee("samantha_patil", "Samantha Patil", "colleague", "person"),
            ]
        )
    )
    assert resolve_payee(index.search("sam patil"))[0].payee_id == "samantha_patil"
    assert resolve_payee(index.search("michael braun"))[0].payee_id == "michael_braun"  # spelled: no doubt
    payee, reason = resolve_payee(index.search("michael brown"))  # Mike Brown by nickname, Braun by sound
    assert payee is None and reason.startswith(AMBIGUOUS_PAYEE)
    payee, _ = resolve_payee(index.find_in_utterance("send my brother mike 20.00 usd"))
    assert payee is not None and payee.payee_id == "mike_brown"


def test_simplify_name():
    assert simplify_name("Sean O'Brien") == "sean obrien"
    assert simplify_name("  José  GARCÍA ") == "jose garcia"
    assert simplify_name("Hans Müller-Lüdenscheidt") == "hans muller ludenscheidt"
