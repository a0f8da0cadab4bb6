"""Make the quality study's data folder from the shared English corpus (run once, on any machine).

    python benchmarks/quality/prepare_data.py [../shared/data/english-docs.jsonl.gz] [--out .data]
    python benchmarks/quality/prepare_data.py ../shared/data/english-more/english-more-train-1.jsonl.gz \
        --out .data-more --max-text-bytes 100000000      # the longer run of issue 31 (PLAN-issue31.md)

Reads the shared ``english-docs.jsonl.gz`` (one ``{"text": ...}`` per line: the Python 3.11 docs,
then the Linux 6.1 docs, in path order), drops exact duplicate documents, shuffles the rest with a
fixed seed and writes two gzipped JSON-lines files into ``--out`` (git-ignored ``.data/``):

- ``english-train.jsonl.gz``: what ``adahop train`` reads; its last ``data.val_fraction`` of tokens
  (whole documents) is the trainer's validation split, never trained on;
- ``english-heldout.jsonl.gz``: the last documents of the shuffle, about ``--heldout-fraction`` of
  the text, in no training run at all: ``adahop eval`` reports on every token of it.

Why shuffle: the trainer holds out the *tail* of its source, and the shared file's tail is the last
kernel-documentation folders in alphabetical order; the byte-level BPE is trained on the source's
first 4 MiB, which unshuffled would be Python documentation only. After the shuffle the tokenizer
sample, the validation split and the held-out file are each a sample of the whole corpus.

The output is a pure function of the input (seeded shuffle, gzip with mtime 0): the printed
sha256 sums are the same on every machine, and ``manifest.json`` records them. ``--max-text-bytes``
keeps only the first documents of the shuffle (train and held-out together), so a larger corpus fits
what one GPU call can carry.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "english-docs.jsonl.gz"
SEED = 12  # issue 12
HELDOUT_FRACTION = 0.03
TRAIN_NAME, HELDOUT_NAME = "english-train.jsonl.gz", "english-heldout.jsonl.gz"


def read_documents(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def write_jsonl_gz(path: Path, texts: list[str]) -> str:
    """Write ``texts`` as gzipped JSON lines (mtime 0: the bytes depend on the texts only); sha256."""
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    blob = gzip.compress(data, compresslevel=9, mtime=0)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)
    return hashlib.sha256(blob).hexdigest()


def split(
    texts: list[str], heldout_fraction: float, seed: int, max_bytes: int | None = None
) -> tuple[list[str], list[str]]:
    """(train, held-out): distinct documents in a seeded order (its first ``max_bytes`` of text, if
    given), the held-out ones taken from the end until they hold ``heldout_fraction`` of the bytes."""
    unique = list(dict.fromkeys(texts))  # exact duplicates would leak held-out text into training
    random.Random(seed).shuffle(unique)
    if max_bytes is not None:
        kept = 0
        for n, text in enumerate(unique):
            kept += len(text.encode())
            if kept > max_bytes:
                unique = unique[:n]
                break
    total, held, cut = sum(len(t.encode()) for t in unique), 0, len(unique)
    while cut > 1 and held < heldout_fraction * total:
        cut -= 1
        held += len(unique[cut].encode())
    return unique[:cut], unique[cut:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--out", type=Path, default=Path(".data"))
    parser.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--max-text-bytes", type=int, help="keep the shuffle's first documents up to this much text")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        print(f"prepare_data: no such file {args.source}", file=sys.stderr)
        return 2
    texts = read_documents(args.source)
    train, heldout = split(texts, args.heldout_fraction, args.seed, args.max_text_bytes)
    assert not set(train) & set(heldout)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "source": str(args.source.resolve()),
        "source_sha256": hashlib.sha256(args.source.read_bytes()).hexdigest(),
        "seed": args.seed,
        "heldout_fraction": args.heldout_fraction,
        "documents": len(texts),
        "duplicates_dropped": len(texts) - len(set(texts)),
        "max_text_bytes": args.max_text_bytes,
        "documents_left_out": len(set(texts)) - len(train) - len(heldout),
    }
    for name, part in ((TRAIN_NAME, train), (HELDOUT_NAME, heldout)):
        digest = write_jsonl_gz(args.out / name, part)
        manifest[name] = {"documents": len(part), "text_bytes": sum(len(t.encode()) for t in part), "sha256": digest}
        print(
            f"{args.out / name}: {len(part)} documents, {manifest[name]['text_bytes'] / 1e6:.1f} MB of text, "
            f"{(args.out / name).stat().st_size / 1e6:.1f} MB gzipped, sha256 {digest}"
        )
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"{manifest['documents']} documents read, {manifest['duplicates_dropped']} exact duplicates dropped; "
        f"wrote {args.out / 'manifest.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
