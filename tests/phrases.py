"""Sentences the tests speak, and the recall measure their recognition checks use.

pocketsphinx (the wheel's en-us model) recognises espeak-ng speech poorly, and how
poorly depends on the sentence far more than on anything the service does: with
the fixture's voice (``en-us+klatt``, 130 wpm) one sentence comes back at recall
0.1 and another at 1.0. These were picked out of about 60 by measuring the
realtime path (a ``RealtimeSession`` over a slot decoder, driven as the worker
drives it) with client frames of 20, 100 and 320 ms and the whole clip in one
frame, decoder chunks of 100 and 200 ms, input at 16, 22.05, 44.1 and 48 kHz,
with and without trailing silence, after 0-2 other clips on the same decoder,
plus ``transcribe_batch`` of the clip and of its VAD segments (the batch
worker's way). "Lowest measured" below is the lowest recall over those runs; an
assertion's threshold stays at least 0.15 below the lowest recall of what it
checks.

Change the fixture's voice or pace (``conftest.VOICE``/``WPM``) and these numbers
no longer hold: measure again.
"""

from __future__ import annotations

import re

#: lowest recall measured 0.91
TRAFFIC = "there is a lot of traffic on the road this morning"
#: lowest recall measured 0.88
TALKING = "i don't know what you are talking about"
#: lowest recall measured 1.0
RAIN = "it will rain again tomorrow afternoon"
#: lowest recall measured 0.75
MEETING = "the meeting will start at ten in the morning"
#: lowest recall measured 0.71
FRIENDLY = "the people in the city are very friendly"
#: lowest recall measured 0.70
WORK = "we have a lot of work to do this week"

#: TRAFFIC and TALKING share no word: tests tell two sessions' texts apart with them
RELIABLE = (TRAFFIC, TALKING, RAIN, MEETING, FRIENDLY, WORK)


def spoken(*sentences: str) -> str:
    """Sentences one after the other, each its own paragraph: espeak-ng pauses about
    1.3 s between paragraphs, so the VAD ends a segment after each and every sentence
    is decoded as an utterance of its own. Joined by ". " (a 0.3 s pause) they run into
    one utterance and recognition suffers at the seams: TRAFFIC and TALKING that way
    measured down to 0.47 together, 0.79 as paragraphs."""
    return ".\n\n".join(sentences)


#: about 7 s: a short upload (lowest measured 0.79 realtime, 0.74 batch)
SHORT = spoken(TRAFFIC, TALKING)
#: about 10.5 s (lowest measured 0.72 realtime, 0.80 batch)
THREE = spoken(TRAFFIC, TALKING, RAIN)
#: every RELIABLE sentence twice: about 42 s, a long upload (0.78-0.83 batch)
LONG = spoken(*RELIABLE, *RELIABLE)
#: every RELIABLE sentence in one run-on paragraph, about 16 s (0.70-0.80 batch)
PARAGRAPH = ". ".join(RELIABLE)

#: "the finals contain most of the spoken words"
MOST = 0.5
#: the threshold for TRAFFIC, TALKING, RAIN or MEETING on its own (lowest measured 0.75)
SENTENCE_RECALL = 0.6


def words(text: str) -> set[str]:
    """Lower-case words of ``text``; punctuation, numbers and timestamps fall away."""
    return set(re.findall(r"[a-z']+", text.lower()))


def recall(expected: str, got: str) -> float:
    """Share of the distinct expected words that ``got`` contains."""
    want = words(expected)
    return len(want & words(got)) / len(want)
