"""A generated corpus for the language-model task: nothing downloaded, the same bytes on every
machine, and a known floor for the test perplexity (``Corpus.floor_perplexity``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

VOCAB = 256   # byte-level: every byte value is a token
_CONSONANTS = "bcdfghklmnprstvz"
_VOWELS = "aeiou"


class Corpus:
    """The language of ``seed``: ``words`` made-up words, each with ``successors`` next words.

    A seeded word-level Markov chain: words of 2 to 4 syllables (and a few punctuation
    words), each followed by one of its successors with Zipf-like probabilities, so a
    byte-level model must learn spelling and which words follow which. 100 words, so the
    default LM gets past the letter-frequency plateau early in a short run
    (experiments/README.md, "The LM corpus")."""

    def __init__(self, seed: int = 1234, words: int = 100, successors: int = 5):
        rng = np.random.default_rng(seed)
        spelled: dict = {}
        while len(spelled) < words - 3:
            syllables = rng.integers(2, 5)
            word = "".join(_CONSONANTS[rng.integers(len(_CONSONANTS))] +
                           _VOWELS[rng.integers(len(_VOWELS))] for _ in range(syllables))
            spelled.setdefault(word, None)
        self.words = [*spelled, ".", ",", "?"]
        n = len(self.words)
        self.next_words = np.empty((n, successors), dtype=np.int64)
        for i in range(n):
            others = rng.choice(np.delete(np.arange(n), (i + 1) % n), successors - 1,
                                replace=False)
            # (i + 1) among every word's successors: the chain reaches every word
            self.next_words[i] = [(i + 1) % n, *others]
        zipf = 1.0 / np.arange(1, successors + 1)
        self.probs = np.stack([rng.permutation(zipf / zipf.sum()) for _ in range(n)])
        self._seed = seed
        self.description = (f"a seeded word-level Markov chain over {words} made-up words, "
                            "spelled in bytes")
        self._bytes = [np.frombuffer((w + " ").encode(), dtype=np.uint8) for w in self.words]

    def _stationary(self) -> np.ndarray:
        n = len(self.words)
        step = np.zeros((n, n))
        for i in range(n):
            step[i, self.next_words[i]] = self.probs[i]
        pi = np.full(n, 1.0 / n)
        for _ in range(2000):
            pi = pi @ step
        return pi / pi.sum()

    @property
    def floor_perplexity(self) -> float:
        """exp(entropy rate per byte): no model's long-context perplexity is lower.

        A word's bytes are fixed by the word and words are separated by spaces, so
        H = sum_i pi_i H(next word | word i) / sum_i pi_i (len(word i) + 1) nats a byte
        (pi: the stationary distribution); windows that begin mid-word sit a little above."""
        pi = self._stationary()
        per_word = -(self.probs * np.log(self.probs)).sum(1)
        lengths = np.array([len(w) + 1 for w in self.words])
        return math.exp(float(pi @ per_word) / float(pi @ lengths))

    @property
    def target_perplexity(self) -> float:
        """What compare times: about 1.6 x the floor, reached by the default LM in ~14,000
        sequences (about a minute of one busy core)."""
        return round(1.6 * self.floor_perplexity, 1)

    def text(self, n_bytes: int, stream: int) -> np.ndarray:
        """``n_bytes`` of the language as uint8, from a walk seeded by (seed, stream)."""
        rng = np.random.default_rng([self._seed, stream])
        out = np.empty(n_bytes + 16, dtype=np.uint8)
        pos, word = 0, int(rng.integers(len(self.words)))
        cumulative = np.cumsum(self.probs, axis=1)
        draws = iter(())
        while pos < n_bytes:
            piece = self._bytes[word][: len(out) - pos]
            out[pos:pos + len(piece)] = piece
            pos += len(piece)
            u = next(draws, None)
            if u is None:   # draw uniforms in blocks: one numpy call per 4096 words
                draws = iter(rng.random(4096).tolist())
                u = next(draws)
            word = int(self.next_words[word][np.searchsorted(cumulative[word], u)
                                             .clip(max=cumulative.shape[1] - 1)])
        return out[:n_bytes]

    def sequences(self, count: int, context: int, stream: int) -> tuple:
        """``count`` windows of ``context`` bytes (inputs) and the same shifted by one byte
        (targets), as int64 tensors (count, context)."""
        flat = torch.from_numpy(self.text(count * (context + 1), stream).astype(np.int64))
        windows = flat.view(count, context + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
