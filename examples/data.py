"""Real text without a download: the bytes of the Python standard library's own source.

The corpus is the top-level ``.py`` files of the running interpreter's standard library
(``os.path.dirname(os.__file__)``; no packages, so no test folders), in sorted order.
Every ``HELDOUT_EVERY``-th file is held out for evaluation and the rest are the training
text; each side is capped in bytes (an even share per file) so that loading stays fast. Tokens are bytes (vocab 256).
Everything is a function of the file names, the caps and the seed: every rank of a job
(one interpreter, one standard library) builds the same corpus and draws the same batches.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

VOCAB = 256  # byte-level: one token per byte
HELDOUT_EVERY = 10  # files 0, 10, 20, ... of the sorted list are held out
TRAIN_BYTES = 2 * 2**20  # caps: a few MB load in milliseconds and fit any rank
HELDOUT_BYTES = 256 * 2**10
HELDOUT_SEED = 12345  # held-out windows do not depend on the training seed: runs compare


class Corpus(NamedTuple):
    train: torch.Tensor  # uint8, the training files concatenated
    heldout: torch.Tensor  # uint8, the held-out files concatenated


def source_files(root: str | None = None) -> list[str]:
    """The standard library's top-level ``.py`` files, sorted by name."""
    root = root if root is not None else os.path.dirname(os.__file__)
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py"))


def _concat(paths: list[str], max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes / len(paths)`` bytes of each file, one after the other: an
    even share per file, so that no single large file (``_pydecimal.py``) dominates."""
    share = max_bytes // max(len(paths), 1)
    chunks = []
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read(share))
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def load_corpus(
    train_bytes: int = TRAIN_BYTES, heldout_bytes: int = HELDOUT_BYTES, root: str | None = None
) -> Corpus:
    """Built once per process (cached): the split is by file, so no held-out line is
    ever trained on, and it does not move when the caps change."""
    files = source_files(root)
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != 0]
    return Corpus(_concat(train, train_bytes), _concat(heldout, heldout_bytes))


def _windows(
    tokens: torch.Tensor, g: torch.Generator, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"the corpus has {tokens.numel()} bytes, too few for windows of {seq_len + 1}; "
                         "use a shorter --seq-len or larger caps")
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size, 1), generator=g)
    window = tokens[starts + torch.arange(seq_len + 1)].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class TextData:
    """Batches of ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64 byte ids."""

    def __init__(self, batch_size: int, seq_len: int, seed: int = 0, corpus: Corpus | None = None) -> None:
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.corpus = corpus if corpus is not None else load_corpus()

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training windows for ``step`` on data rank ``rank``: a function of (seed, step, rank)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        return _windows(self.corpus.train, g, self.batch_size, self.seq_len)

    def heldout_batch(self, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out windows number ``index`` of data rank ``rank``: the same in every run."""
        g = torch.Generator().manual_seed(HELDOUT_SEED * 1_000_003 + index * 1009 + rank)
        return _windows(self.corpus.heldout, g, self.batch_size, self.seq_len)
