import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import adahop.data.dataset as dataset_mod
import adahop.data.tokenizer as tokenizer_mod
from adahop.data import (
    BatchLoader,
    DataSourceError,
    HFSource,
    parse_data_spec,
    prepare_data,
    resolve_source,
    stdlib_source,
    validation_batches,
)
from adahop.data.corpus import EXCLUDED_DIRS, stdlib_files
from adahop.data.dataset import load_tokens, split_point, token_dtype
from adahop.data.tokenizer import load_tokenizer

SUBSET_BYTES = 300_000
VOCAB = 512


@pytest.fixture(scope="module")
def subset():
    return stdlib_source(max_bytes=SUBSET_BYTES)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def data(subset, cache):
    return prepare_data(subset, vocab_size=VOCAB, val_fraction=0.1, cache=cache, progress=False)


def split_documents(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """Token runs between end-of-document tokens (the trailing run, if unterminated, too)."""
    ends = np.flatnonzero(tokens == eos_id)
    pieces = np.split(np.asarray(tokens), ends + 1)
    return [p[p != eos_id] for p in pieces if len(p)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


DOCS = [
    "first document\nwith two lines",
    "second: ünïcödé — 日本語",
    "def third():\n    return 3\n",
]


# --- embedded corpus ---------------------------------------------------------------------------


def test_stdlib_corpus_selection():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert files == stdlib_files()  # deterministic
    assert len(files) > 300
    for path in files:
        rel = path.relative_to(root)
        assert path.suffix == ".py" and not EXCLUDED_DIRS.intersection(rel.parts[:-1])
    assert {"os.py", "functools.py", "dataclasses.py"} <= {p.name for p in files}


def test_stdlib_corpus_cap_keeps_the_order_and_the_limit():
    full, capped = stdlib_files(), stdlib_files(max_bytes=SUBSET_BYTES)
    assert capped == [p for p in full if p in set(capped)]
    total = sum(p.stat().st_size for p in capped)
    assert 0.9 * SUBSET_BYTES < total <= SUBSET_BYTES


def test_default_data_is_the_embedded_corpus():
    for spec in (None, "stdlib"):
        source = resolve_source(spec)
        assert source.paths == stdlib_files()
        assert source.name.startswith(f"stdlib (Python {sys.version_info.major}.")


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trip(data):
    tok = data.tokenizer
    assert tok.vocab_size == VOCAB and tok.eos_id == 0
    for text in [*DOCS, "", "  \t\n\n    indented\r\n", "emoji 🤖 and \x00 control"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(DOCS) == [tok.encode(d) for d in DOCS]
    # Even 256 merges compress code well below one token per byte.
    code = Path(sysconfig.get_paths()["stdlib"], "functools.py").read_text()
    assert len(tok.encode(code)) < 0.7 * len(code.encode())


def test_tokenizer_is_cached(subset, tmp_path, monkeypatch):
    calls = []
    train = tokenizer_mod.train_tokenizer
    monkeypatch.setattr(tokenizer_mod, "train_tokenizer", lambda *a, **k: calls.append(1) or train(*a, **k))
    monkeypatch.setenv("ADAHOP_CACHE", str(tmp_path))  # the default cache location
    first = load_tokenizer(subset, vocab_size=300)
    second = load_tokenizer(subset, vocab_size=300)
    assert len(calls) == 1
    assert second.to_json() == first.to_json()
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1
    load_tokenizer(subset, vocab_size=400)  # another vocabulary is another entry
    assert len(calls) == 2


def test_tokenizer_retrains_when_the_source_changes(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("aaaa bbbb " * 200)
    first = load_tokenizer(parse_data_spec(str(path)), vocab_size=280, cache=tmp_path / "c")
    path.write_text("cccc dddd eeee " * 200)
    second = load_tokenizer(parse_data_spec(str(path)), vocab_size=280, cache=tmp_path / "c")
    assert second.to_json() != first.to_json()
    assert len(list((tmp_path / "c" / "tokenizers").glob("*.json"))) == 2


# --- token cache and split ---------------------------------------------------------------------


def test_tokens_match_independent_encoding(data, subset):
    tokens = np.concatenate([data.train, data.val])
    assert tokens.dtype == np.uint16
    docs = list(subset.documents())
    assert len(docs) == sum(p.stat().st_size > 0 for p in subset.paths)  # empty files are skipped
    expected = np.concatenate([[*data.tokenizer.encode(d), data.tokenizer.eos_id] for d in docs])
    np.testing.assert_array_equal(tokens, expected)


def test_token_cache_is_reused(data, subset, cache, monkeypatch):
    monkeypatch.setattr(dataset_mod, "_write_tokens", lambda *a: pytest.fail("re-tokenized"))
    again = load_tokens(subset, data.tokenizer, cache)
    assert isinstance(again, np.memmap) and again.mode == "r"
    np.testing.assert_array_equal(again, np.concatenate([data.train, data.val]))
    index = json.loads(next((Path(cache) / "tokens").glob("*.json")).read_text())
    assert index["num_tokens"] == len(again)
    assert index["num_documents"] == len(split_documents(again, data.tokenizer.eos_id))
    assert not list(Path(cache).rglob("*.tmp*"))  # atomic writes leave no temporaries


def test_token_dtype_widens_for_large_vocabularies():
    assert token_dtype(65536) == np.uint16 and token_dtype(128256) == np.uint32


def test_split_is_deterministic_and_holds_out_whole_documents(data, subset, cache):
    again = prepare_data(subset, vocab_size=VOCAB, val_fraction=0.1, cache=cache, progress=False)
    np.testing.assert_array_equal(again.train, data.train)
    np.testing.assert_array_equal(again.val, data.val)
    total = len(data.train) + len(data.val)
    assert round(0.1 * total) <= len(data.val) <= 2 * round(0.1 * total)
    assert data.train[-1] == data.tokenizer.eos_id  # the split falls between documents
    docs = [data.tokenizer.decode(d) for d in split_documents(data.val, data.tokenizer.eos_id)]
    all_docs = list(subset.documents())
    assert docs == all_docs[len(all_docs) - len(docs) :]  # the tail documents, whole
    train_docs = split_documents(data.train, data.tokenizer.eos_id)
    assert len(train_docs) + len(docs) == len(all_docs)  # disjoint and complete


def test_split_point_cuts_a_single_document_at_the_fraction():
    tokens = np.arange(1, 1001, dtype=np.uint16)  # no end-of-document token: one document
    assert split_point(tokens, eos_id=0, val_fraction=0.25) == 750
    tokens[600] = 0  # a document boundary within one validation length before the cut
    assert split_point(tokens, eos_id=0, val_fraction=0.25) == 601
    with pytest.raises(ValueError, match="val_fraction"):
        split_point(tokens, eos_id=0, val_fraction=1.0)


# --- batches -----------------------------------------------------------------------------------


def ramp(n: int) -> np.ndarray:
    """Token i has value i, so a window's first input is its start offset."""
    return np.arange(n, dtype=np.uint32)


def test_batches_are_shifted_windows_covering_each_epoch_once():
    seq, batch = 8, 4
    tokens = ramp(8 * 21 + 1)  # 21 windows: five batches per epoch, one window dropped
    loader = BatchLoader(tokens, batch, seq, seed=3)
    epoch = [next(loader) for _ in range(5)]
    for inputs, targets in epoch:
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (batch, seq)
        np.testing.assert_array_equal(inputs.numpy(), inputs[:, :1].numpy() + np.arange(seq))
        np.testing.assert_array_equal(targets.numpy(), inputs.numpy() + 1)
    starts = np.concatenate([inputs[:, 0].numpy() for inputs, _ in epoch])
    assert len(set(starts)) == 20 and all(s % seq == 0 for s in starts)
    assert loader.epoch == 0
    next(loader)
    assert loader.epoch == 1 and loader.position == batch


def test_loader_is_deterministic_for_a_seed():
    a, b, c = (BatchLoader(ramp(4000), 4, 16, seed=s) for s in (0, 0, 1))
    for _ in range(3):
        xa, xb, xc = next(a)[0], next(b)[0], next(c)[0]
        assert xa.equal(xb)
    assert not xa.equal(xc)


def test_loader_resume_gives_identical_batches():
    tokens = ramp(16 * 10 + 1)  # 10 windows, 3 batches per epoch: resume crosses epochs
    straight = BatchLoader(tokens, 3, 16, seed=7)
    expected = [next(straight) for _ in range(8)]
    first = BatchLoader(tokens, 3, 16, seed=7)
    for _ in range(4):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialization
    resumed = BatchLoader(tokens, 3, 16, seed=7)
    resumed.load_state_dict(state)
    for inputs, targets in expected[4:]:
        got = next(resumed)
        assert got[0].equal(inputs) and got[1].equal(targets)


def test_ranks_read_disjoint_shares_of_the_global_batch_and_share_a_position():
    tokens = ramp(16 * 10 + 1)  # 10 windows, 2 batches of 4 per epoch: crosses epochs
    single = BatchLoader(tokens, 4, 16, seed=7)
    ranks = [BatchLoader(tokens, 4, 16, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        whole, halves = next(single), [next(r) for r in ranks]
        assert all(h[0].shape == (2, 16) for h in halves)
        assert torch.cat([h[0] for h in halves]).equal(whole[0]) and torch.cat([h[1] for h in halves]).equal(whole[1])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()  # global batches
    moved = BatchLoader(tokens, 4, 16, seed=7, rank=1, world_size=2)
    moved.load_state_dict(single.state_dict())  # a 1-process position, read by rank 1 of 2
    assert next(moved)[0].equal(next(single)[0][2:])
    with pytest.raises(ValueError, match=r"data.batch_size=4 \(the global batch\) does not split evenly over 3 ranks"):
        BatchLoader(tokens, 4, 16, rank=0, world_size=3)


def test_loader_rejects_a_mismatched_state():
    loader = BatchLoader(ramp(1000), 2, 16)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        BatchLoader(ramp(1000), 2, 32).load_state_dict(state)
    with pytest.raises(ValueError, match="data or its settings changed"):
        BatchLoader(ramp(999), 2, 16).load_state_dict(state)


def test_loader_needs_one_batch_of_data():
    with pytest.raises(ValueError, match="fewer than one batch"):
        BatchLoader(ramp(100), 8, 16)


def test_validation_batches_are_fixed_consecutive_windows(data):
    first = list(validation_batches(data.val, 4, 32, max_batches=3))
    second = list(validation_batches(data.val, 4, 32, max_batches=3))
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert x1.equal(x2) and y1.equal(y2)
    flat = np.concatenate([x.numpy() for x, _ in first]).ravel()
    np.testing.assert_array_equal(flat, data.val[: 12 * 32])
    all_batches = list(validation_batches(ramp(50), 2, 8))  # 6 windows; last batch full
    assert [len(x) for x, _ in all_batches] == [2, 2, 2]
    assert [len(x) for x, _ in validation_batches(ramp(42), 2, 8)] == [2, 2, 1]
    with pytest.raises(ValueError, match="val_fraction"):
        validation_batches(ramp(8), 2, 8)  # raised at once, not at the first batch


# --- --data sources ----------------------------------------------------------------------------


def test_txt_jsonl_parquet_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")  # optional (the ``data`` extra), like ``datasets``
    pq = pytest.importorskip("pyarrow.parquet")

    (tmp_path / "a.txt").write_text(DOCS[0])
    write_jsonl(tmp_path / "b.jsonl", DOCS[1:] + [""])  # empty documents are skipped
    pq.write_table(pa.table({"id": [1, 2], "text": DOCS[:2]}), tmp_path / "c.parquet")
    assert list(parse_data_spec(str(tmp_path / "a.txt")).documents()) == DOCS[:1]
    assert list(parse_data_spec(str(tmp_path / "b.jsonl")).documents()) == DOCS[1:]
    assert list(parse_data_spec(str(tmp_path / "c.parquet")).documents()) == DOCS[:2]
    everything = DOCS[:1] + DOCS[1:] + DOCS[:2]  # sorted: a.txt, b.jsonl, c.parquet
    assert list(parse_data_spec(str(tmp_path)).documents()) == everything
    assert list(parse_data_spec(str(tmp_path / "*.*")).documents()) == everything
    assert list(parse_data_spec(str(tmp_path / "[bc].*")).documents()) == DOCS[1:] + DOCS[:2]


def test_gzipped_txt_py_jsonl_sources_read_as_their_plain_files(tmp_path):
    import gzip

    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(DOCS[0].encode()))
    (tmp_path / "b.py.gz").write_bytes(gzip.compress(DOCS[2].encode()))
    plain = write_jsonl(tmp_path / "c.jsonl", DOCS[1:] + [""])
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert list(parse_data_spec(str(tmp_path / "a.txt.gz")).documents()) == DOCS[:1]
    assert list(parse_data_spec(str(tmp_path / "b.py.gz")).documents()) == DOCS[2:]
    assert list(parse_data_spec(str(tmp_path / "d.jsonl.gz")).documents()) == DOCS[1:]
    # a directory and a glob pick the gzipped files up too, in sorted order
    everything = DOCS[:1] + DOCS[2:] + DOCS[1:] + DOCS[1:]
    assert list(parse_data_spec(str(tmp_path)).documents()) == everything
    assert list(parse_data_spec(str(tmp_path / "*.jsonl*")).documents()) == DOCS[1:] * 2
    # the same tokens as the plain file (the fingerprint differs: another file)
    gz, js = (
        prepare_data(str(p), vocab_size=300, val_fraction=0.3, cache=tmp_path / "cache", progress=False)
        for p in (tmp_path / "d.jsonl.gz", plain)
    )
    assert np.array_equal(np.concatenate([gz.train, gz.val]), np.concatenate([js.train, js.val]))


def test_gzipped_files_that_cannot_be_read_give_clear_errors(tmp_path):
    import gzip

    (tmp_path / "fake.jsonl.gz").write_text('{"text": "not compressed"}\n')
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-30])
    (tmp_path / "latin1.jsonl.gz").write_bytes(
        gzip.compress('{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    )
    (tmp_path / "data.parquet.gz").write_bytes(gzip.compress(b"x"))
    (tmp_path / "data.gz").write_bytes(gzip.compress(b"x"))
    for name in ("fake.jsonl.gz", "cut.jsonl.gz"):
        with pytest.raises(DataSourceError, match=rf"{name}: not a readable gzip file"):
            list(parse_data_spec(str(tmp_path / name)).documents())
    with pytest.raises(DataSourceError, match=r"latin1.jsonl.gz:2: not UTF-8 text \(byte 0xe9\)"):
        list(parse_data_spec(str(tmp_path / "latin1.jsonl.gz")).documents())
    for name in ("data.parquet.gz", "data.gz"):
        with pytest.raises(DataSourceError, match=r"unsupported file type.*gzipped \.txt\.gz, \.py\.gz, \.jsonl\.gz"):
            parse_data_spec(str(tmp_path / name))


def test_prepare_data_on_a_local_file(tmp_path):
    texts = [f"document number {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(60)]
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    data = prepare_data(str(path), vocab_size=300, val_fraction=0.1, cache=tmp_path, progress=False)
    assert data.source == str(path)
    tokens = np.concatenate([data.train, data.val])
    decoded = [data.tokenizer.decode(d) for d in split_documents(tokens, data.tokenizer.eos_id)]
    assert decoded == texts


@pytest.fixture
def jsonl_file(tmp_path):
    return write_jsonl(tmp_path / "hf.jsonl", [f"row {i} " * 10 for i in range(20)])


def test_hf_source_streams_a_local_file(jsonl_file):
    pytest.importorskip("datasets")
    expected = [f"row {i} " * 10 for i in range(20)]
    source = HFSource("json", data_files=str(jsonl_file))
    assert list(source.documents()) == expected
    capped = HFSource("json", data_files=str(jsonl_file), max_bytes=100)  # 60 bytes a row
    assert list(capped.documents()) == expected[:2]
    assert capped.fingerprint() != source.fingerprint()


def test_hf_source_without_datasets_installed(jsonl_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataSourceError, match="pip install datasets"):
        next(HFSource("json", data_files=str(jsonl_file)).documents())


def test_hf_spec_parsing():
    c4 = parse_data_spec("hf:allenai/c4:en")
    assert isinstance(c4, HFSource) and (c4.path, c4.config, c4.split) == (
        "allenai/c4",
        "en",
        "train",
    )
    fineweb = parse_data_spec("hf:HuggingFaceFW/fineweb")
    assert (fineweb.path, fineweb.config, fineweb.name) == (
        "HuggingFaceFW/fineweb",
        None,
        "hf:HuggingFaceFW/fineweb",
    )


def test_bad_data_values_give_clear_errors(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "missing.txt"): "no such file or directory; --data takes",
        str(tmp_path / "*.nothing"): "the glob matches no files",
        str(tmp_path / "data.csv"): r"unsupported file type.*supported suffixes: \.txt, \.py, \.jsonl, \.parquet",
        str(tmp_path / "empty"): "no .txt, .py, .jsonl, .parquet files",
        "hf:": "missing dataset name",
    }
    for spec, message in cases.items():
        with pytest.raises(DataSourceError, match=message):
            parse_data_spec(spec)


def test_bad_file_contents_give_clear_errors(tmp_path):
    (tmp_path / "no_text.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataSourceError, match=r"no_text.jsonl:2: no 'text' field \(found \['body'\]\)"):
        list(parse_data_spec(str(tmp_path / "no_text.jsonl")).documents())
    with pytest.raises(DataSourceError, match="broken.jsonl:2: not valid JSON"):
        list(parse_data_spec(str(tmp_path / "broken.jsonl")).documents())
    pa = pytest.importorskip("pyarrow")  # optional (the ``data`` extra), like ``datasets``
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_text.parquet")
    with pytest.raises(DataSourceError, match=r"no 'text' column \(columns: body\)"):
        list(parse_data_spec(str(tmp_path / "no_text.parquet")).documents())


def test_empty_source_is_rejected(tmp_path):
    write_jsonl(tmp_path / "empty.jsonl", [""])
    source = parse_data_spec(str(tmp_path / "empty.jsonl"))
    tokenizer = load_tokenizer(stdlib_source(max_bytes=10_000), vocab_size=300, cache=tmp_path)
    with pytest.raises(ValueError, match="contains no text"):
        load_tokens(source, tokenizer, tmp_path, progress=False)
    assert not list((tmp_path / "tokens").iterdir())


# ---- bad encodings, non-string text, no network, damaged caches ----------------------------
def test_text_that_is_not_utf8_is_an_error_naming_file_and_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("line one\nline two\ncaf\u00e9\n".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "ok"}\n{"text": "caf\u00e9"}\n'.encode("latin-1"))
    (tmp_path / "binary.txt").write_bytes(b"header\n\x00\x01\x02\x03")
    cases = {
        "latin1.txt": r"latin1.txt:3: not UTF-8 text \(byte 0xe9\); convert the file to UTF-8",
        "latin1.jsonl": r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9\)",
        "binary.txt": r"binary.txt:2: a NUL byte: this looks like a binary file",
    }
    for name, message in cases.items():
        with pytest.raises(DataSourceError, match=message):
            list(parse_data_spec(str(tmp_path / name)).documents())


def test_text_fields_must_be_strings_and_null_is_empty(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "number.jsonl").write_text('{"text": "ok"}\n{"text": null}\n{"text": 12345}\n')
    with pytest.raises(DataSourceError, match=r"number.jsonl:3: 'text' holds a int \(12345\), not a string"):
        list(parse_data_spec(str(tmp_path / "number.jsonl")).documents())
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "nulls.parquet")
    assert list(parse_data_spec(str(tmp_path / "nulls.parquet")).documents()) == ["a", "b"]
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataSourceError, match=r"ints.parquet: row 0: 'text' holds a int"):
        list(parse_data_spec(str(tmp_path / "ints.parquet")).documents())


def test_hf_source_without_network_is_one_line(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (ConnectionError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        DataSourceError,
        match=r"^--data hf:allenai/c4:en: cannot stream it from Hugging Face "
        r"\(Couldn't reach 'allenai/c4' on the Hub \(ConnectionError\)\); check the name and the network",
    ):
        next(parse_data_spec("hf:allenai/c4:en").documents())


def test_damaged_caches_are_reported_and_rebuilt(tmp_path, caplog):
    source = parse_data_spec(str(write_jsonl(tmp_path / "docs.jsonl", [f"document {i} " * 20 for i in range(30)])))
    cache = tmp_path / "cache"
    tokenizer = load_tokenizer(source, vocab_size=300, cache=cache)
    tokens = np.array(load_tokens(source, tokenizer, cache, progress=False))
    (bin_path,) = (cache / "tokens").glob("*.bin")
    (tokenizer_path,) = (cache / "tokenizers").glob("*.json")

    bin_path.write_bytes(bin_path.read_bytes()[:100])  # cut short outside adahop
    with caplog.at_level("WARNING", logger="adahop"):
        assert np.array_equal(load_tokens(source, tokenizer, cache, progress=False), tokens)
    assert f"token cache entry {bin_path.with_suffix('')} is damaged ({bin_path.name} has 100 bytes" in caplog.text

    bin_path.with_suffix(".json").write_text("{not json")
    caplog.clear()
    with caplog.at_level("WARNING", logger="adahop"):
        assert np.array_equal(load_tokens(source, tokenizer, cache, progress=False), tokens)
    assert "is damaged (unreadable (JSONDecodeError" in caplog.text

    tokenizer_path.write_text("garbage")
    caplog.clear()
    with caplog.at_level("WARNING", logger="adahop"):
        again = load_tokenizer(source, vocab_size=300, cache=cache)
    assert f"cached tokenizer {tokenizer_path} is damaged" in caplog.text
    assert again.to_json() == tokenizer.to_json() == tokenizer_mod.Tokenizer.from_file(tokenizer_path).to_json()
