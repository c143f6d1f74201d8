"""The offline corpus ``zerooffload train`` reads: the standard library's sources, in a fixed order."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from zerooffload.data import ByteCorpus


def test_the_corpus_is_the_first_16_mb_of_the_stdlib_sources_in_sorted_order():
    """Against the definition written plainly (every path listed and sorted first): the same bytes, so a
    run's batches, and a resumed run's, do not depend on how the files are found."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" not in path.parts and total < 16 << 20:
            chunks.append(path.read_bytes())
            total += len(chunks[-1])
    expected = torch.frombuffer(bytearray(b"".join(chunks)[:16 << 20]), dtype=torch.uint8)
    corpus = ByteCorpus()
    assert torch.equal(torch.cat([corpus.train, corpus.eval]), expected)
