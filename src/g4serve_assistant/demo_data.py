"""The two demo customers' records, which ``SQLiteBank.seed_demo`` writes (``--demo``): accounts, payees
with confusable names, contacts, cards and transactions. For tests and demos, never beside a bank's own
customers."""

from __future__ import annotations

DEMO_CUSTOMER_ID = "cust-001"
DEMO_CUSTOMER_2_ID = "cust-002"

# Confusable names are deliberate: they exercise the phonetic index and the ambiguity path. cust-001 is the
# single demo customer of before, unchanged. cust-002 reuses some of cust-001's ids for other things (payee
# priya_patel is Priya Patil, metro_water is Metro Water Services, card-debit is another card) so that a
# leak between customers shows, and has confusable names of its own (two Priyas, Mohammed Ali / Muhammad
# Aly, Chloé / Claire Martin) and a second water biller beside Thames Water.
DEMO_1 = {
    "accounts": [
        ("chk-001", "checking", "USD", 123_456),
        ("sav-001", "savings", "USD", 825_000),
        ("eur-001", "euro", "EUR", 150_000),
        ("jpy-001", "yen", "JPY", 250_000),
    ],
    "payees": [
        ("john_smith", "John Smith", "friend", "person", ""),
        ("jon_smythe", "Jon Smythe", "colleague", "person", ""),
        ("joan_smith", "Joan Smith", "sister", "person", ""),
        ("katherine_lee", "Katherine Lee", "friend", "person", ""),
        ("catherine_li", "Catherine Li", "colleague", "person", ""),
        ("mary_johnson", "Mary Johnson", "mother", "person", "mom,mum,mommy"),
        ("robert_brown", "Robert Brown", "father", "person", "dad,daddy"),
        ("sean_obrien", "Sean O'Brien", "friend", "person", ""),
        ("stephen_clarke", "Stephen Clarke", "colleague", "person", ""),
        ("steven_clark", "Steven Clark", "neighbor", "person", ""),
        ("priya_patel", "Priya Patel", "friend", "person", ""),
        ("aisha_khan", "Aisha Khan", "friend", "person", ""),
        ("li_wei", "Li Wei", "colleague", "person", ""),
        ("jose_garcia", "José García", "friend", "person", ""),
        ("maria_gonzalez", "Maria Gonzalez", "landlord", "person", "rent"),
        ("ahmed_hassan", "Ahmed Hassan", "friend", "person", ""),
        ("yuki_tanaka", "Yuki Tanaka", "friend", "person", ""),
        ("hans_muller", "Hans Müller", "colleague", "person", ""),
        ("francois_dubois", "François Dubois", "friend", "person", ""),
        ("olga_ivanova", "Olga Ivanova", "babysitter", "person", "nanny"),
        ("tom_wilson", "Tom Wilson", "brother", "person", ""),
        (
            "city_electric",
            "City Electric",
            "utility",
            "biller",
            "electric,electricity,power,electric company",
        ),
        ("metro_water", "Metro Water Utility", "utility", "biller", "water"),
        ("skyline_mobile", "Skyline Mobile", "phone", "biller", "phone,cell phone,mobile,phone company"),
        ("northside_internet", "Northside Internet", "internet", "biller", "internet,broadband,wifi"),
        ("evergreen_gas", "Evergreen Gas", "utility", "biller", "gas"),
        ("microsoft", "Microsoft", "subscription", "biller", ""),
        ("harbor_insurance", "Harbor Insurance", "insurance", "biller", "insurance,car insurance"),
        ("platinum_card", "Platinum Card Services", "credit card", "biller", "credit card"),
        ("streamflix", "StreamFlix", "subscription", "biller", "streaming"),
    ],
    "contacts": [
        ("c-demo-01", "Johnny", "+1 555 0101", None, "john_smith"),
        ("c-demo-02", "Kate", "+1 555 0102", None, "katherine_lee"),
        ("c-demo-03", "Gran", "+1 555 0103", None, None),  # in the phone book, not a payee: cannot be paid
    ],
    "cards": [
        ("card-debit", "chk-001", "debit", "visa", "4201"),
        ("card-credit", "chk-001", "credit", "mastercard", "8812"),
    ],
    "transactions": [
        ("chk-001", "2025-04-18", "Payroll Acme Corp", 310_000, "USD"),
        ("chk-001", "2025-04-19", "Corner Coffee", -450, "USD"),
        ("chk-001", "2025-04-20", "Fresh Market", -8_732, "USD"),
        ("chk-001", "2025-04-21", "City Electric", -9_420, "USD"),
        ("chk-001", "2025-04-22", "Transfer to John Smith", -5_000, "USD"),
        ("chk-001", "2025-04-23", "Metro Transit", -275, "USD"),
        ("chk-001", "2025-04-24", "Skyline Mobile", -6_500, "USD"),
        ("chk-001", "2025-04-25", "Book Nook", -2_399, "USD"),
        ("chk-001", "2025-04-26", "Fresh Market", -6_110, "USD"),
        ("chk-001", "2025-04-27", "Rent Maria Gonzalez", -150_000, "USD"),
        ("chk-001", "2025-04-28", "Corner Coffee", -525, "USD"),
        ("chk-001", "2025-04-29", "StreamFlix", -1_599, "USD"),
        ("chk-001", "2025-04-30", "ATM withdrawal", -10_000, "USD"),
        ("chk-001", "2025-05-01", "Northside Internet", -5_999, "USD"),
        ("chk-001", "2025-05-02", "Pizza Place", -3_240, "USD"),
        ("sav-001", "2025-04-20", "Interest", 1_234, "USD"),
        ("sav-001", "2025-05-01", "Transfer from checking", 50_000, "USD"),
        ("eur-001", "2025-04-22", "Café de Paris", -1_850, "EUR"),
        ("eur-001", "2025-04-29", "Transfer to François Dubois", -4_000, "EUR"),
        ("jpy-001", "2025-04-25", "Tokyo Ramen", -1_200, "JPY"),
    ],
}
DEMO_2 = {
    "accounts": [
        ("chk-002", "checking", "GBP", 245_000),
        ("sav-002", "savings", "GBP", 1_200_000),
        ("usd-002", "dollar", "USD", 40_000),
    ],
    "payees": [
        ("priya_patel", "Priya Patil", "sister", "person", ""),
        ("priya_sharma", "Priya Sharma", "colleague", "person", ""),
        ("jon_smith", "Jon Smith", "friend", "person", ""),
        ("joanne_smyth", "Joanne Smyth", "neighbor", "person", ""),
        ("mohammed_ali", "Mohammed Ali", "friend", "person", ""),
        ("muhammad_aly", "Muhammad Aly", "colleague", "person", ""),
        ("grace_okafor", "Grace Okafor", "mother", "person", "mum,mom"),
        ("daniel_okafor", "Daniel Okafor", "brother", "person", ""),
        ("chloe_martin", "Chloé Martin", "friend", "person", ""),
        ("claire_martin", "Claire Martin", "landlord", "person", "rent"),
        ("thames_water", "Thames Water", "utility", "biller", "water,water bill"),
        ("metro_water", "Metro Water Services", "utility", "biller", ""),
        ("london_power", "London Power", "utility", "biller", "electric,electricity,power"),
        ("orbit_mobile", "Orbit Mobile", "phone", "biller", "phone,mobile"),
        ("camden_council", "Camden Council", "council tax", "biller", "council tax"),
    ],
    "contacts": [
        ("c-demo-11", "Pri", "+44 20 7946 0011", None, "priya_patel"),
        ("c-demo-12", "Mo", "+44 20 7946 0012", None, "mohammed_ali"),
    ],
    "cards": [
        ("card-debit", "chk-002", "debit", "visa", "5532"),
        ("card-travel", "usd-002", "credit", "amex", "1009"),
    ],
    "transactions": [
        ("chk-002", "2025-04-18", "Salary Northwind Ltd", 285_000, "GBP"),
        ("chk-002", "2025-04-19", "Corner Shop", -4_215, "GBP"),
        ("chk-002", "2025-04-21", "Thames Water", -3_850, "GBP"),
        ("chk-002", "2025-04-22", "Transfer to Priya Patil", -2_000, "GBP"),
        ("chk-002", "2025-04-24", "Travelcard top-up", -2_000, "GBP"),
        ("chk-002", "2025-04-25", "Orbit Mobile", -1_800, "GBP"),
        ("chk-002", "2025-04-27", "Rent Claire Martin", -120_000, "GBP"),
        ("chk-002", "2025-04-30", "London Power", -6_420, "GBP"),
        ("sav-002", "2025-04-30", "Interest", 1_510, "GBP"),
        ("usd-002", "2025-04-26", "Blue Bottle Coffee", -650, "USD"),
    ],
}
DEMO_CUSTOMERS = ((DEMO_CUSTOMER_ID, "Alex Morgan", DEMO_1), (DEMO_CUSTOMER_2_ID, "Sam Okafor", DEMO_2))
