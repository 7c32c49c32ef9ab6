"""The real-text corpus writer produces what Megatron's own IndexedDataset reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, megatron_trees

from megatron_perf_toggles.tools import text_corpus

DOCS = [b"def f():\n    return 1\n", "caf\u00e9 = 'ok'\n".encode(), b"x" * 300]


def test_index_layout(tmp_path):
    import struct

    stats = text_corpus.write_indexed(tmp_path / "c", DOCS)
    assert stats == {"documents": 3, "tokens": sum(len(d) + 1 for d in DOCS), "vocab_size": 257, "eod": 256}
    idx = (tmp_path / "c.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,), (dtype,), (n_seq,), (n_doc,) = (struct.unpack_from("<Q", idx, 9), struct.unpack_from("<B", idx, 17),
                                                struct.unpack_from("<Q", idx, 18), struct.unpack_from("<Q", idx, 26))
    assert (version, dtype, n_seq, n_doc) == (1, 8, 3, 4)
    tokens = struct.unpack(f"<{stats['tokens']}H", (tmp_path / "c.bin").read_bytes())
    assert list(tokens[: len(DOCS[0]) + 1]) == [*DOCS[0], 256]


def test_stdlib_corpus_is_real_text(tmp_path):
    stats = text_corpus.write_indexed(tmp_path / "s", text_corpus.documents(
        __import__("pathlib").Path(text_corpus.sysconfig.get_paths()["stdlib"]), 200_000))
    assert stats["documents"] > 5 and 100_000 < stats["tokens"] <= 200_000 + stats["documents"]


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_megatron_reads_it(tmp_path):
    text_corpus.write_indexed(tmp_path / "c", DOCS)
    tree = megatron_trees()[-1]
    code = (
        "import json, sys\n"
        "from megatron_perf_toggles.launcher.import_shims import megatron_importable\n"
        f"with megatron_importable({str(tree)!r}):\n"
        "    from megatron.core.datasets.indexed_dataset import IndexedDataset\n"
        f"ds = IndexedDataset({str(tmp_path / 'c')!r})\n"
        "print(json.dumps([ds[i].tolist() for i in range(len(ds))]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [[*d, 256] for d in DOCS]
