"""Deterministic data with no download: a character-level addition task and a regression set.

The global batch of every step is a pure function of (seed, step), so any layout sees the same data;
data-parallel ranks take fixed contiguous slices of it (`local_slice`). The addition task is small
enough for a tiny GPT to learn visibly within a minute on a laptop CPU: "123+456=975\n" with the sum's
digits written least-significant first, which is the order in which a left-to-right model can carry.
Accuracy (`answer_positions`, the log's `accuracy`) is counted on the answer digits only: the operands
are random, so no model can predict them, while the sum's digits follow from what came before.
Lesson: lessons/00_overview.md (what the model learns), lessons/03_data_parallel.md.
"""

from __future__ import annotations

import numpy as np

from minipar.core.shards import shard_bounds

ALPHABET = "0123456789+=\n"


def encode(text: str) -> np.ndarray:
    return np.array([ALPHABET.index(c) for c in text], dtype=np.int64)


def decode(ids) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


def addition_problem(rng: np.random.Generator, digits: int) -> str:
    a, b = (int(rng.integers(0, 10**digits)) for _ in range(2))
    return f"{a:0{digits}d}+{b:0{digits}d}={str(a + b).zfill(digits + 1)[::-1]}\n"


class AdditionTask:
    """Token windows over a stream of addition problems: inputs (B, T) and next-token targets (B, T)."""

    vocab_size = len(ALPHABET)

    def __init__(self, seq_len: int, seed: int, digits: int = 3):
        self.seq_len, self.seed, self.digits = seq_len, seed, digits

    def global_batch(self, step: int, batch_size: int):
        rng = np.random.default_rng([self.seed, step, 1])
        problem_len = 3 * self.digits + 4
        n_problems = (self.seq_len + 1) // problem_len + 2
        rows = []
        for _ in range(batch_size):
            text = "".join(addition_problem(rng, self.digits) for _ in range(n_problems))
            start = int(rng.integers(0, problem_len))
            rows.append(encode(text[start : start + self.seq_len + 1]))
        tokens = np.stack(rows)
        return tokens[:, :-1], tokens[:, 1:]

    @staticmethod
    def answer_positions(inputs, targets) -> np.ndarray:
        """Where the target is a digit of a sum whose whole problem the window shows: the last
        non-digit input up to that position is "=", and a newline comes before that "=" (so a
        problem cut off at the window's start, whose operands the model cannot see, is not scored).
        A pure function of the window's tokens: every layout scores the same positions."""
        digit_in, digit_out = inputs < 10, targets < 10
        position = np.arange(inputs.shape[1])
        last_sign = np.maximum.accumulate(np.where(digit_in, -1, position), axis=1)  # -1: none yet
        sign = np.take_along_axis(inputs, np.maximum(last_sign, 0), axis=1)
        newline = inputs == ALPHABET.index("\n")
        first_newline = np.where(newline.any(axis=1), newline.argmax(axis=1), inputs.shape[1])
        return digit_out & (last_sign >= 0) & (sign == ALPHABET.index("=")) & \
            (first_newline[:, None] < last_sign)

    def decoded_problems(self, inputs, targets, predicted) -> list[str]:
        """"123+456=579, predicted 579" for each problem whose answer the window shows whole, from the
        predicted token at each answer position (given the true tokens before it). The sums are
        shown in the usual order; the data writes them reversed."""
        lines, width = [], self.digits + 1
        scored = self.answer_positions(inputs, targets)
        for row in range(len(inputs)):
            starts = [t for t in range(inputs.shape[1]) if scored[row, t] and not (t and scored[row, t - 1])]
            for t in starts:
                if t + width <= inputs.shape[1] and scored[row, t:t + width].all():
                    problem = decode(inputs[row, t - 2 * self.digits - 1:t])
                    answer, guess = (decode(ids[row, t:t + width])[::-1].replace("\n", "⏎")
                                     for ids in (targets, predicted))
                    lines.append(f"{problem}={answer}, predicted {guess}")
        return lines


class RegressionTask:
    """Inputs x ~ N(0, 1) and targets tanh(x W) with a fixed random W: a smooth target an MLP fits."""

    def __init__(self, d_in: int, d_out: int, seed: int, dtype: str = "float64"):
        self.seed, self.dtype = seed, dtype
        self.weight = np.random.default_rng([seed, 2]).standard_normal((d_in, d_out)) / np.sqrt(d_in)

    def global_batch(self, step: int, batch_size: int):
        """Drawn in float64 whatever the dtype, then cast: fp32 and fp64 runs see the same numbers."""
        rng = np.random.default_rng([self.seed, step, 3])
        x = rng.standard_normal((batch_size, self.weight.shape[0]))
        return x.astype(self.dtype), np.tanh(2.0 * x @ self.weight).astype(self.dtype)

    @staticmethod
    def answer_positions(inputs, targets) -> None:
        """Every output is scored (None: no mask)."""
        return None


def local_slice(batch_size: int, parts: int, index: int) -> slice:
    """The fixed contiguous slice of the global batch that data-parallel rank `index` trains on
    (validation makes the batch divisible by the ranks, so every slice is the same size)."""
    return slice(*shard_bounds(batch_size, parts, index))
