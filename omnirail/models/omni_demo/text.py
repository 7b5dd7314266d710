"""The demo's word-level tokenizer: a fixed vocabulary of common English words.

The toy thinker samples from this vocabulary, so its (random) output reads as words
rather than bytes. Words outside the vocabulary are hashed into the vocabulary's ids, as
an unknown-word fallback that keeps tokenization total and deterministic.
"""

from __future__ import annotations

import re
import zlib

PAD, BOS, EOS, IMAGE, AUDIO = 0, 1, 2, 3, 4
SPECIAL = ["<pad>", "<bos>", "<eos>", "<image>", "<audio>"]

_WORDS = """
the a an and or but so of to in on at by for with from about into over under after
before between through during without again still never always often sometimes today
tomorrow yesterday now then here there where when why how what which who whose this that
these those it its we our you your they their he she his her i my me us them is are was
were be been being have has had do does did can could will would shall should may might
must say said make made go went see saw know knew think thought take took come came give
gave find found tell told ask asked work worked seem feel try leave call good new first
last long great little own other old right big high different small large next early
young important few public bad same able time year people way day man woman child world
life hand part place case week company system program question government number night
point home water room mother area money story fact month lot study book eye job word
business issue side kind head house service friend father power hour game line end member
law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning
reason research girl guy moment air teacher force education music sound voice river
mountain sea sky light song rain wind stone fire tree flower bird road bridge garden
window paper letter signal model train token stream image audio speech text
""".split()

VOCAB: list[str] = SPECIAL + sorted(set(_WORDS), key=_WORDS.index)
_IDS = {w: i for i, w in enumerate(VOCAB)}
_WORD_RE = re.compile(r"[a-z0-9']+")


def tokenize(text: str) -> list[int]:
    """Lower-cased words to ids; unknown words hash into the ordinary words' ids."""
    ids = []
    for word in _WORD_RE.findall(text.lower()):
        known = _IDS.get(word)
        if known is None:
            known = len(SPECIAL) + zlib.crc32(word.encode()) % (len(VOCAB) - len(SPECIAL))
        ids.append(known)
    return ids


def detokenize_piece(token: int, first: bool) -> str:
    """The text one generated token adds to the output ("" for special tokens)."""
    if not 0 <= token < len(VOCAB) or token < len(SPECIAL):
        return ""
    word = VOCAB[token]
    return word.capitalize() if first else " " + word
