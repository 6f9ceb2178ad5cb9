"""Payee lookup outside the model: RapidFuzz text scores blended with phonetic keys (metaphone, NYSIIS,
match rating codex), homophones and nicknames, over the customer's payee names, aliases and contact names.
The index rebuilds itself when the customer's payee version moves."""

from __future__ import annotations

import dataclasses
import re
import threading
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

import jellyfish
from rapidfuzz import fuzz, process

from g4serve_assistant.bank import CustomerBank, Payee

MIN_SCORE = 60.0  # below this a name is noise, not a candidate
ACCEPT_SCORE = 80.0  # from here a candidate can be the payee meant (intents.resolve_payee)
RELATIONSHIP_SCORE = 90.0  # "my sister": sure of the relationship, not of the person if several share it
RELATIONSHIP_BONUS = 5.0  # "my friend john": the relationship breaks ties between similar names
PARTIAL_FACTOR = 0.9  # part of a name ("john" for John Smith) scores at most 90, as in RapidFuzz's WRatio
UNEXPLAINED_PENALTY = 10.0  # per word of the name-like run a span leaves out: "lee wei" is Li Wei, not a Lee
# Per word said as a homophone ("sara" for Sarah, "lee" for Li) or a nickname ("mike" for Michael) of the
# name's word. Small, so that "sara" heard is as close to Sara Conner as "sarah" is to Sarah Connor: what
# is heard does not tell them apart, and the assistant asks. Only the exact spelling of a whole name wins.
EQUIVALENT_DISCOUNT = 5.0
# One word said that sounds like a word of several payees' names ("smith", "water") names none of them: it
# scores at most 85 against each, so they are all asked about and none is taken.
SHARED_WORD_FACTOR = 0.85
_PREFILTER = 8  # entries scored in full per span, from each of the text and phonetic prefilters
_PREFILTER_WORDS = 4  # name words most like each word of the span
_SPAN_CACHE_SIZE = 4096
_ARTICLES = frozenset({"the", "my", "our", "a", "an", "this", "that", "his", "her", "their"})
_MAX_SPAN_TOKENS = 4

# What customers call a relationship -> the relationship stored on the payee.
RELATIONSHIP_WORDS = {
    "mom": "mother",
    "mum": "mother",
    "mother": "mother",
    "mommy": "mother",
    "dad": "father",
    "father": "father",
    "daddy": "father",
    "sister": "sister",
    "sis": "sister",
    "brother": "brother",
    "bro": "brother",
    "wife": "wife",
    "husband": "husband",
    "son": "son",
    "daughter": "daughter",
    "friend": "friend",
    "buddy": "friend",
    "pal": "friend",
    "colleague": "colleague",
    "coworker": "colleague",
    "workmate": "colleague",
    "neighbor": "neighbor",
    "neighbour": "neighbor",
    "landlord": "landlord",
    "landlady": "landlord",
    "babysitter": "babysitter",
    "nanny": "babysitter",
    "boss": "boss",
    "roommate": "roommate",
    "flatmate": "roommate",
    "housemate": "roommate",
    "mate": "friend",
    "aunt": "aunt",
    "auntie": "aunt",
    "aunty": "aunt",
    "uncle": "uncle",
    "cousin": "cousin",
    "niece": "niece",
    "nephew": "nephew",
    "partner": "partner",
    "girlfriend": "girlfriend",
    "boyfriend": "boyfriend",
    "fiance": "fiance",
    "fiancee": "fiance",
}

# Names that are one person's, said short or long: a customer says "mike" for the payee Michael Braun.
# Groups, since a short name can stand for several ("sam": Samantha or Samuel).
NICKNAMES = (
    "michael mike mikey mick mickey",
    "christopher kristopher christine christina kristina kristin kristen christian chris kris",
    "katherine catherine katharine kathryn kathleen kate katie kathy cathy kat cate",
    "elizabeth elisabeth eliza liz lizzie beth betty libby",
    "margaret maggie meg peggy marge margie",
    "robert rob robbie bob bobby",
    "william will bill billy willy liam",
    "richard rick ricky rich dick",
    "james jim jimmy jamie",
    "jonathan jonathon john jon johnny jonny",
    "thomas tom tommy",
    "stephen steven stefan steve stevie",
    "daniel dan danny",
    "david dave davey",
    "joseph joe joey",
    "samantha samuel sam sammy",
    "alexander alexandra alexis alex",
    "anthony antony tony",
    "benjamin ben benny",
    "matthew matt",
    "nicholas nicolas nick nicky",
    "andrew andy drew",
    "edward ed eddie ted ned",
    "jennifer jen jenny",
    "patrick patricia pat patty",
    "susan suzanne sue susie",
    "rebecca becky becca",
    "deborah debra deb debbie",
    "gregory greg",
    "timothy tim timmy",
    "kenneth ken kenny",
    "ronald ron ronnie",
    "donald don donnie",
    "charles charlie chuck",
    "joshua josh",
    "jessica jess jessie",
    "victoria vicky tori",
    "frederick fred freddie",
    "lawrence laurence larry",
    "abigail abby",
    "francis frances francois frank fran",
    "gerald geraldine gerry jerry",
    "jacqueline jackie",
)

# Words of banking requests that are never (part of) a payee name in an utterance. Words of a payee's
# display name are taken out of this set when the index is built (a payee "June Park" makes "june" a name).
STOPWORDS = frozenset(
    """
a an the to for from of on in at by with and or but my me i im id ive you your our us we it its this that
these those is are was were be been am do does did can could would will shall should may might must please
pls thanks thank hey hi hello ok okay um uh er hmm so just now then also again want wanna like need
actually instead quickly asap right away via using through as
send sending sent transfer transferring wire pay paying paid give move moving make put zelle venmo reimburse
owe deposit money cash funds amount some bill bills invoice payment payments account accounts checking
savings balance card cards transaction transactions recent last lock unlock freeze block
who whom whose what which where when how much many is there any have has got find look up lookup search
payee payees recipient recipients contact contacts saved list show tell check know called named
today tomorrow tonight yesterday morning afternoon evening night noon next this coming day days week weeks
monday tuesday wednesday thursday friday saturday sunday january february march april june july
august september october november december st nd rd th
dollars dollar bucks buck euros euro pounds pound quid yen rupees rupee won yuan francs franc pesos peso
cents cent pence usd eur gbp jpy inr krw cny chf cad aud mxn kwd bhd
zero oh one two three four five six seven eight nine ten hundred thousand
""".split()
)


@dataclass
class Candidate:
    payee_id: str
    display_name: str
    relationship: str
    kind: str
    score: float  # 0..100
    phonetic: bool  # the phonetic keys, not the spelling, carried the match
    matched: str = ""  # the name or alias that matched
    span: str = ""  # the words of the query that matched it


def simplify_name(text: str) -> str:
    """Lowercase ASCII-ish words: "Sean O'Brien" -> "sean obrien", "José García" -> "jose garcia"."""
    decomposed = unicodedata.normalize("NFKD", text.lower())
    text = "".join(ch for ch in decomposed if not (unicodedata.combining(ch) and ord(ch) < 0x370))
    text = re.sub(r"(?<=\w)['’](?=\w)", "", text)
    return " ".join(re.sub(r"[^\w]+|_", " ", text).split())


@lru_cache(maxsize=65536)
def _keys(word: str) -> tuple[str, str, str]:
    """Phonetic keys of one word; three coders because each confuses different pairs. The coders sound out
    letters (match_rating_codex raises on anything else: a payee named "7-Eleven" made every lookup of its
    customer fail), so a word is keyed on its letters, and one without any ("54") on itself."""
    letters = "".join(ch for ch in word if ch.isalpha())
    if not letters:
        return word, word, word
    return jellyfish.metaphone(letters), jellyfish.nysiis(letters), jellyfish.match_rating_codex(letters)


@lru_cache(maxsize=65536)
def _sounds_alike(a: str, b: str) -> float:
    """0..100: how alike two words sound, averaged over the three phonetic keys."""
    return sum(fuzz.ratio(x, y) for x, y in zip(_keys(a), _keys(b), strict=True)) / 3


# The first vowel sound of a name, spelled one way: "lee"/"li", "way"/"wei", "taylor"/"tailor", "joan"/"jon".
_FIRST_VOWEL = {"ee": "i", "ea": "i", "ie": "i", "y": "i", "ey": "ai", "ay": "ai", "ei": "ai", "oa": "o"}
_CONSONANT_RULES = (
    (re.compile(r"^[kg]n"), "n"),
    (re.compile(r"^wr"), "r"),
    (re.compile(r"^ch(?=[rl])"), "k"),  # chris, chloe
    (re.compile(r"ph"), "f"),
    (re.compile(r"ck|q"), "k"),
    (re.compile(r"x"), "ks"),
    (re.compile(r"dg"), "j"),
    (re.compile(r"c(?=[eiy])"), "s"),
    (re.compile(r"c"), "k"),
    (re.compile(r"th"), "t"),  # thames, katherine, smythe
    (re.compile(r"gh"), ""),
    (re.compile(r"v"), "f"),  # steven, stephen
    (re.compile(r"z"), "s"),
    (re.compile(r"[ao]w(?=[^aeiouy]|$)"), "au"),  # brown, braun; shawn, shaun
    (re.compile(r"(?<=.)h"), ""),  # silent after the first letter: john, sarah
    (re.compile(r"([^aeiouy])\1+"), r"\1"),  # connor, conner
    (re.compile(r"(?<=.[^aeiouy])e$"), ""),  # a silent final e: clarke, anne
)
_VOWEL_GROUP = re.compile(r"[aeiouy]+")


@lru_cache(maxsize=65536)
def sound_key(word: str) -> str:
    """How an English name sounds, spelled one way, so homophones share it: "sara"/"sarah", "kris"/"chris",
    "lee"/"li", "smyth"/"smith", "taylor"/"tailor", "stephen"/"steven", "brown"/"braun", "patel"/"patil".

    Coarser than a spelling, finer than metaphone: only the first vowel keeps its sound ("tom" is not
    "tim"); later vowels, which speakers reduce, all become "e"."""
    w = word
    for pattern, replacement in _CONSONANT_RULES:
        w = pattern.sub(replacement, w)
    out, last = [], 0
    for i, m in enumerate(_VOWEL_GROUP.finditer(w)):
        group = m[0]
        if m.start() == 0 and group[0] == "y" and len(group) > 1:  # "yuki": a consonant y
            out.append(w[last : m.start()] + "y")
            group = group[1:]
        else:
            out.append(w[last : m.start()])
        out.append(_FIRST_VOWEL.get(group, group) if i == 0 else "e")
        last = m.end()
    out.append(w[last:])
    return "".join(out)


def _nickname_groups() -> dict[str, frozenset[str]]:
    """Sound key of each name in NICKNAMES -> the groups it belongs to ("#" + the group's first name)."""
    groups: dict[str, frozenset[str]] = {}
    for group in NICKNAMES:
        names = group.split()
        for name in names:
            groups[sound_key(name)] = groups.get(sound_key(name), frozenset()) | {"#" + names[0]}
    return groups


_NICKNAME_GROUPS = _nickname_groups()


@lru_cache(maxsize=65536)
def _word_keys(word: str) -> frozenset[str]:
    """Keys two words share when they name the same: the sound key and any nickname group."""
    key = sound_key(word)
    return frozenset({key}) | _NICKNAME_GROUPS.get(key, frozenset())


@dataclass(frozen=True)
class _Entry:
    """One way of naming a payee: its display name, an alias or a contact name."""

    payee: Payee
    name: str
    tokens: tuple[str, ...]
    joined: str  # metaphone of each word, concatenated: "mike rosoft" and "microsoft" agree
    keys: tuple[frozenset[str], ...]  # each word's sound key and nickname groups


def _entry(payee: Payee, name: str) -> _Entry | None:
    name = simplify_name(name)
    if not name:
        return None
    tokens = tuple(name.split())
    return _Entry(payee, name, tokens, _joined_metaphone(tokens), tuple(_word_keys(t) for t in tokens))


def _joined_metaphone(tokens: tuple[str, ...] | list[str]) -> str:
    return "".join(_keys(t)[0] for t in tokens)


class _Built:
    """The immutable index of one payee version; swapped whole, so readers never see a half-built one."""

    def __init__(self, payees: list[Payee], version: int):
        self.version = version
        self.payees = {p.payee_id: p for p in payees}
        self.entries = [e for p in payees for n in (p.display_name, *p.aliases) if (e := _entry(p, n))]
        self.names = [e.name for e in self.entries]
        self.joined = [e.joined for e in self.entries]
        self.by_relationship: dict[str, list[Payee]] = {}
        for p in payees:
            self.by_relationship.setdefault(p.relationship.lower(), []).append(p)
        name_words = {t for p in payees for t in simplify_name(p.display_name).split()}
        owners: dict[str, set[str]] = {}  # sound key -> payees with a word that sounds so
        self.word_entries: dict[str, list[int]] = {}
        self.key_entries: dict[str, set[int]] = {}  # sound key or nickname group -> entries with such a word
        for i, e in enumerate(self.entries):
            for t, keys in zip(e.tokens, e.keys, strict=True):
                owners.setdefault(sound_key(t), set()).add(e.payee.payee_id)
                self.word_entries.setdefault(t, []).append(i)
                for key in keys:
                    self.key_entries.setdefault(key, set()).add(i)
        self.words = list(self.word_entries)
        # Sounds of words in several payees' names ("smith" of John Smith, Joan Smith and Jon Smythe; "water"
        # of Metro Water and Thames Water): alone, such a word names no one.
        self.shared_sounds = frozenset(key for key, ids in owners.items() if len(ids) > 1)
        self.shared_words = frozenset(t for t in self.words if sound_key(t) in self.shared_sounds)
        self.stopwords = STOPWORDS - name_words
        # Scores of spans already seen: customers say the same few names again and again. Bounded; it
        # dies with this version of the index. Plain dict operations are atomic under the GIL.
        self.span_cache: dict[str, tuple[Candidate, ...]] = {}


class PayeeIndex:
    """Top-k payee candidates for a name as heard; rebuilt lazily when ``db.version`` changes."""

    def __init__(self, db: CustomerBank):
        self.db = db
        self._lock = threading.Lock()
        self._built = _Built(db.payees(), db.version)

    @property
    def version(self) -> int:
        return self._fresh().version

    def _fresh(self) -> _Built:
        built = self._built
        version = self.db.version
        if version != built.version:
            with self._lock:
                if self._built.version != version:
                    self._built = _Built(self.db.payees(), version)
                built = self._built
        return built

    def search(self, query: str, k: int = 5) -> list[Candidate]:
        """Best first: payees whose name, alias or relationship sounds or reads like ``query``."""
        built = self._fresh()
        q = simplify_name(query)
        best = self._score_span(built, q)
        relationship = RELATIONSHIP_WORDS.get(q)
        if relationship:
            for p in built.by_relationship.get(relationship, []):
                _keep(best, _candidate(p, RELATIONSHIP_SCORE, False, p.relationship, q))
        return _top(best, k)

    def find_in_utterance(self, text: str, k: int = 5) -> list[Candidate]:
        """Candidates for the name said inside a sentence ("send 50 usd to jon smyth tomorrow").

        The sentence is cut into runs of words that are not request words, numbers or dates; every span
        of up to four words of a run is scored, less a penalty for each word of the run it leaves out, and
        each payee keeps its best span. A run after "for" is the purpose ("send kris 60 for the rent"): it
        names the payee only when no other run does. A relationship word ("my sister") adds its payees,
        or a small bonus to a payee also named ("my friend john").
        """
        built = self._fresh()
        tokens = simplify_name(text).split()
        relationships = {RELATIONSHIP_WORDS[t] for t in tokens if t in RELATIONSHIP_WORDS}
        segments = _segments(tokens, built.stopwords)
        best = self._best_spans(built, [s for s, purpose in segments if not purpose])
        if not any(c.score >= ACCEPT_SCORE for c in best.values()):
            for c in self._best_spans(built, [s for s, purpose in segments if purpose]).values():
                _keep(best, c)
        for c in best.values():
            if c.relationship.lower() in relationships:
                c.score = min(100.0, c.score + RELATIONSHIP_BONUS)
        if relationships and not any(c.score >= 80 for c in best.values()):
            for relationship in relationships:
                for p in built.by_relationship.get(relationship, []):
                    _keep(best, _candidate(p, RELATIONSHIP_SCORE, False, p.relationship, relationship))
        return _top(best, k)

    def _best_spans(self, built: _Built, segments: list[list[str]]) -> dict[str, Candidate]:
        """Each payee's best span over every span of up to four words of ``segments``."""
        best: dict[str, Candidate] = {}
        for segment in segments:
            for n in range(min(len(segment), _MAX_SPAN_TOKENS), 0, -1):
                penalty = UNEXPLAINED_PENALTY * (len(segment) - n)
                for i in range(len(segment) - n + 1):
                    for c in self._score_span(built, " ".join(segment[i : i + n])).values():
                        if c.score < 100.0:  # an exact name stays exact ("john smith jr")
                            c.score = round(c.score - penalty, 2)
                        if c.score >= MIN_SCORE:
                            _keep(best, c)
        return best

    def name_spans(self, text: str) -> list[str]:
        """The runs of words in a sentence that could be a name: what is left of "send 50 usd to zeb
        quarterman tomorrow" without request words, numbers and dates ("zeb quarterman")."""
        built = self._fresh()
        return [" ".join(s) for s, _ in _segments(simplify_name(text).split(), built.stopwords)]

    def _score_span(self, built: _Built, span: str) -> dict[str, Candidate]:
        """Best candidate per payee for one span (fresh objects: callers may adjust their scores)."""
        cached = built.span_cache.get(span)
        if cached is None:
            cached = tuple(self._score_span_uncached(built, span).values())
            if len(built.span_cache) >= _SPAN_CACHE_SIZE:
                built.span_cache.clear()
            built.span_cache[span] = cached
        return {c.payee_id: dataclasses.replace(c) for c in cached}

    def _score_span_uncached(self, built: _Built, span: str) -> dict[str, Candidate]:
        """Scores only the entries the C prefilters and the homophone/nickname keys pick."""
        if not span or not built.entries:
            return {}
        said = span
        # Recognisers split names at apostrophes and prefixes ("o brien", "mc donald"): rejoin single letters.
        span = re.sub(r"\b(\w) (?=\w)", r"\1", span)
        tokens = span.split()
        joined = _joined_metaphone(tokens)
        keys = [_word_keys(t) for t in tokens]
        # Prefilters in C with the plain ratio (WRatio's partial matching costs 20x more): whole names,
        # single name words, and names by sound.
        picked = {i for _, _, i in process.extract(span, built.names, scorer=fuzz.ratio, limit=_PREFILTER)}
        picked |= {
            i for _, _, i in process.extract(joined, built.joined, scorer=fuzz.ratio, limit=_PREFILTER)
        }
        for token in tokens:
            for word, _, _ in process.extract(token, built.words, scorer=fuzz.ratio, limit=_PREFILTER_WORDS):
                picked.update(built.word_entries[word])
        for word_keys in keys:
            for key in word_keys:
                picked |= built.key_entries.get(key, set())
        best: dict[str, Candidate] = {}
        lone_shared = len(tokens) == 1 and sound_key(tokens[0]) in built.shared_sounds
        for i in picked:
            entry = built.entries[i]
            if lone_shared:
                score = _shared_word_score(tokens[0], keys[0], entry)
                phonetic = tokens[0] not in entry.tokens
            else:
                text_score = _text_score(span, tokens, entry, built.shared_words)
                phon = _phonetic_score(tokens, joined, entry, built.shared_words)
                score = max(text_score, 0.5 * text_score + 0.5 * phon, _equivalent_score(tokens, keys, entry))
                phonetic = score > text_score
            if score >= MIN_SCORE:
                _keep(best, _candidate(entry.payee, score, phonetic, entry.name, said))
        return best


def _text_score(span: str, tokens: list[str], entry: _Entry, shared_words: frozenset[str]) -> float:
    """Spelling similarity; a span shorter than the name is compared with the best run of whole name words.

    Whole words, not substrings as in WRatio's partial ratio: "john" matches John Smith, not Mary Johnson.
    Words in another order ("wei li" for Li Wei) count as a part, so the name said in its order wins.
    """
    if span == entry.name:
        return 100.0
    score = max(fuzz.ratio(span, entry.name), PARTIAL_FACTOR * fuzz.token_sort_ratio(span, entry.name))
    n = len(tokens)
    for i in range(len(entry.tokens) - n + 1 if n < len(entry.tokens) else 0):
        window = entry.tokens[i : i + n]
        factor = PARTIAL_FACTOR - (0.1 if n == 1 and window[0] in shared_words else 0.0)
        score = max(score, factor * fuzz.ratio(span, " ".join(window)))
    return score


def _equivalent_score(tokens: list[str], keys: list[frozenset[str]], entry: _Entry) -> float:
    """The span read word by word, in order, as the name's words or their homophones and nicknames:
    100 less EQUIVALENT_DISCOUNT per word that is not spelled as in the name ("sara conner" for Sarah
    Connor: 90), scaled as a part when it covers only some of the name's words; 0 when a word differs."""
    n, best = len(tokens), 0.0
    for i in range(len(entry.tokens) - n + 1):
        score = 100.0
        for token, token_keys, name_word, name_keys in zip(
            tokens, keys, entry.tokens[i : i + n], entry.keys[i : i + n], strict=True
        ):
            if token != name_word:
                if not token_keys & name_keys:
                    break
                score -= EQUIVALENT_DISCOUNT
        else:
            best = max(best, score * (PARTIAL_FACTOR if n < len(entry.tokens) else 1.0))
    return best


def _shared_word_score(token: str, keys: frozenset[str], entry: _Entry) -> float:
    """One word said that sounds like a word of several payees' names: how like the entry's closest word
    it is, at most SHARED_WORD_FACTOR * 100 whether that word is a whole alias ("water" for Metro Water)
    or part of a name (Thames Water), so every payee it fits is asked about and none is taken."""
    best = 0.0
    for word, word_keys in zip(entry.tokens, entry.keys, strict=True):
        if token == word:
            return 100.0 * SHARED_WORD_FACTOR
        text = fuzz.ratio(token, word)
        similarity = 100.0 - EQUIVALENT_DISCOUNT if keys & word_keys else text
        best = max(best, similarity, 0.5 * text + 0.5 * _sounds_alike(token, word))
    return best * SHARED_WORD_FACTOR


def _phonetic_score(tokens: list[str], joined: str, entry: _Entry, shared_words: frozenset[str]) -> float:
    """How alike the span and the entry sound: word by word, or as one string of sounds."""
    per_word, covered = [], set()
    for token in tokens:
        if len(token) < 2:
            per_word.append(0.0)
            continue
        sims = [_sounds_alike(token, e) for e in entry.tokens]
        j = max(range(len(sims)), key=sims.__getitem__)
        per_word.append(sims[j])
        if sims[j] >= 80:
            covered.add(j)
    word_score = sum(per_word) / len(per_word)
    if len(covered) < len(entry.tokens):
        shared = len(covered) == 1 and entry.tokens[next(iter(covered))] in shared_words
        word_score *= PARTIAL_FACTOR - (0.1 if shared else 0.0)
    return max(word_score, fuzz.ratio(joined, entry.joined) if joined and entry.joined else 0.0)


def _segments(tokens: list[str], stopwords: frozenset[str]) -> list[tuple[list[str], bool]]:
    """Runs of name-like words, each with whether it follows "for" (a purpose, not a recipient)."""
    segments: list[tuple[list[str], bool]] = []
    current: list[str] = []
    before = ""
    for t in tokens:
        if t in stopwords or t in RELATIONSHIP_WORDS or any(ch.isdigit() for ch in t):
            if current:
                segments.append((current, before == "for"))
                current = []
            before = t if t not in _ARTICLES else before  # "for the rent", "for my phone"
        else:
            current.append(t)
    if current:
        segments.append((current, before == "for"))
    return segments


def _candidate(p: Payee, score: float, phonetic: bool, matched: str, span: str) -> Candidate:
    return Candidate(
        p.payee_id, p.display_name, p.relationship, p.kind, round(score, 2), phonetic, matched, span
    )


def _keep(best: dict[str, Candidate], c: Candidate) -> None:
    # Per payee the best score wins; on a tie the longer span (more of the sentence explained).
    old = best.get(c.payee_id)
    if old is None or (c.score, len(c.span)) > (old.score, len(old.span)):
        best[c.payee_id] = c


def _top(best: dict[str, Candidate], k: int) -> list[Candidate]:
    return sorted(best.values(), key=lambda c: (-c.score, c.display_name))[:k]
