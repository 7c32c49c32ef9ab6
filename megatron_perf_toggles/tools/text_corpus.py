"""A real-text training corpus with no downloads: Python's own standard-library sources as bytes.

Writes Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, the MMIDIDX format that
``megatron.core.datasets.indexed_dataset.IndexedDataset`` reads): one document per source file,
token ids = byte values 0..255, each document ended by the end-of-document id 256, which is
NullTokenizer's EOD for ``--vocab-size 257``. Train with
``--tokenizer-type NullTokenizer --vocab-size 257 --data-path PREFIX --split 100,0,0``.

    python -m megatron_perf_toggles.tools.text_corpus --out /data/stdlib_bytes [--max-mb 64]
"""

from __future__ import annotations

import argparse
import struct
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_UINT16 = 8  # Megatron's DType code for numpy.uint16
EOD = 256
VOCAB_SIZE = 257


def documents(root: Path, max_bytes: int) -> Iterable[bytes]:
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        if total + len(data) > max_bytes:
            continue  # too big for what is left: a smaller file may still fit
        total += len(data)
        yield data


def write_indexed(prefix: Path, docs: Iterable[bytes]) -> dict:
    """One sequence per document; sequence lengths int32, pointers int64 (bytes), doc indices int64."""
    lengths: list[int] = []
    with open(f"{prefix}.bin", "wb") as bin_file:
        for doc in docs:
            tokens = [*list(doc), EOD]
            bin_file.write(struct.pack(f"<{len(tokens)}H", *tokens))
            lengths.append(len(tokens))
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * 2
    with open(f"{prefix}.idx", "wb") as idx:
        idx.write(INDEX_HEADER)
        idx.write(struct.pack("<Q", INDEX_VERSION))
        idx.write(struct.pack("<B", DTYPE_UINT16))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(lengths) + 1))
        idx.write(struct.pack(f"<{len(lengths)}i", *lengths))
        idx.write(struct.pack(f"<{len(pointers)}q", *pointers))
        idx.write(struct.pack(f"<{len(lengths) + 1}q", *range(len(lengths) + 1)))
    return {"documents": len(lengths), "tokens": sum(lengths), "vocab_size": VOCAB_SIZE, "eod": EOD}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    ap.add_argument("--source", default=sysconfig.get_paths()["stdlib"], help="directory of text (default: stdlib)")
    ap.add_argument("--max-mb", type=float, default=64.0)
    ns = ap.parse_args(argv)
    prefix = Path(ns.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    stats = write_indexed(prefix, documents(Path(ns.source), int(ns.max_mb * 2**20)))
    print(f"{prefix}: {stats['documents']} documents, {stats['tokens']:,} tokens "
          f"(bytes + EOD {EOD}; use --vocab-size {VOCAB_SIZE})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
