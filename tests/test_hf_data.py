"""Tests for data.py's hf:NAME datasets, offline: a dataset saved with save_to_disk,
a JSONL file read through load_dataset("json"), the --max_tokens budget, a few training updates,
and the one-line errors (no `datasets` extra, no network, bad columns). Needs `pip install datasets`."""
import json
import math
import os
import socket
import sys
import time

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import data  # noqa: E402
from harness import hf_data, text_data  # noqa: E402
import train  # noqa: E402
from common import UsageError  # noqa: E402

datasets = pytest.importorskip("datasets", reason="the optional extra: pip install datasets")
SPLITS = ("train", "dev", "test")


def make_docs(n=160):
    """Documents with ids; a few characters (é, ∑, 字) occur in only one document each."""
    words = ["alpha", "beta", "gamma", "delta", "ring", "waltz", "operator", "token", "sum", "x = 1 + 2"]
    docs = [f"Doc {i}: " + " ".join(words[(i * k) % len(words)] for k in range(3 + i % 7)) + ".\n"
            for i in range(n)]
    docs[5] += "café"
    docs[17] += "∑ i"
    docs[42] += "字"
    return [f"id-{i:04d}" for i in range(n)], docs


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Dataset with id, text and an extra column, saved with save_to_disk."""
    ids, docs = make_docs()
    path = tmp_path_factory.mktemp("hf") / "saved"
    datasets.Dataset.from_dict({"id": ids, "text": docs, "score": list(range(len(docs)))}).save_to_disk(str(path))
    return str(path), ids, docs


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """A JSONL file without an id column (the text decides the split), with one repeated document."""
    _, docs = make_docs(120)
    docs = docs + [docs[3]]
    path = tmp_path_factory.mktemp("hf") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"content": t, "n": i}) + "\n" for i, t in enumerate(docs)))
    return str(path), docs


def decoded_docs(d, split):
    """The split's documents, decoded: the text between end-of-text symbols."""
    parts = d.decode(d.tokens(split)).split("<|endoftext|>")
    assert parts[-1] == ""
    return parts[:-1]


def test_saved_dataset_round_trips_split_by_id(gpt2_bpe, saved, tmp_path):
    path, ids, docs = saved
    d = data.Data(data.prepare("hf:" + path, out_root=str(tmp_path / "out")))
    assert d.tokenizer == "gpt2" and d.vocab_size == 50257 and d.meta["source"] == "hf:" + path
    assert d.meta["split_rule"].startswith("by document: sha256(its id column)")
    seen = []
    for s in SPLITS:
        want = [t for i, t in zip(ids, docs) if data.split_of(i) == s]
        assert want and decoded_docs(d, s) == want  # stream order within each split
        assert d.meta["n_documents"][s] == len(want) and len(d.tokens(s)) == d.meta["splits"][s]
        seen += want
    assert sorted(seen) == sorted(docs)  # every document once: none in two splits, none lost
    enc = data.gpt2_encoder()
    assert d.meta["splits"]["train"] == sum(len(enc.encode_ordinary(t)) + 1
                                            for i, t in zip(ids, docs) if data.split_of(i) == "train")


def test_jsonl_char_tokenizer_in_worker_processes(jsonl, tmp_path, monkeypatch):
    path, docs = jsonl
    spec = dict(out_root=str(tmp_path / "out"), tokenizer="char", hf_text_field="content", hf_data_files=path)
    batches = text_data._batches  # batches of 100 characters: several, so the workers do start
    monkeypatch.setattr(text_data, "_batches", lambda rows, n: batches(rows, 100))
    d = data.Data(data.prepare("hf:json", num_proc=2, **spec))
    assert d.meta["split_rule"].startswith("by document: sha256(its text column)")
    train_chars = sorted(set("".join(t for t in docs if data.split_of(t) == "train")) | {"\n"})
    assert d.itos == train_chars + ["<|endoftext|>", "\ufffd"] and d.meta["unk_id"] == len(train_chars) + 1
    assert d.eot == d.meta["eot_id"] == len(train_chars) and d.meta["dtype"] == "uint16"
    got = {s: decoded_docs(d, s) for s in SPLITS}
    for s in SPLITS:
        want = ["".join(c if c in train_chars else "\ufffd" for c in t) for t in docs if data.split_of(t) == s]
        assert got[s] == want and len(d.tokens(s)) == sum(len(t) + 1 for t in want)
    home = [s for s in SPLITS if docs[3] in got[s]]
    assert len(home) == 1 and got[home[0]].count(docs[3]) == 2  # the repeated document: one split, twice
    one = data.Data(data.prepare("hf:json", num_proc=1, **dict(spec, out_root=str(tmp_path / "one"))))
    for s in SPLITS:  # the worker processes change nothing
        assert np.array_equal(one.tokens(s), d.tokens(s))


def test_max_tokens_stops_at_the_budget(saved, tmp_path):
    path, ids, docs = saved
    full = data.Data(data.prepare("hf:" + path, out_root=str(tmp_path / "out"), tokenizer="char"))
    total = sum(full.meta["splits"].values())
    budget = 1000
    cut = data.Data(data.prepare("hf:" + path, out_root=str(tmp_path / "out"), tokenizer="char",
                                 max_tokens=budget))
    assert cut.folder != full.folder and sum(cut.meta["splits"].values()) == budget
    assert cut.meta["max_tokens"] == budget and cut.meta["truncated"] is True
    # the first `budget` tokens of the document stream, each split a prefix of its full version
    lengths = [len(t) + 1 for t in docs]
    n_docs = int(np.searchsorted(np.cumsum(lengths), budget, side="left")) + 1
    assert sum(cut.meta["n_documents"].values()) == n_docs
    first = [(data.split_of(i), t) for i, t in list(zip(ids, docs))[:n_docs]]
    for s in SPLITS:
        want = "".join(t + "<|endoftext|>" for w, t in first if w == s)
        n_want = sum(n for (w, _), n in zip(first, lengths) if w == s)
        got = cut.decode(cut.tokens(s))
        if first[-1][0] == s:  # the last document is cut at the budget
            n_want -= sum(lengths[:n_docs]) - budget
            assert want.startswith(got) and len(got) < len(want)
        else:
            assert got == want
        assert len(cut.tokens(s)) == n_want
    big = data.Data(data.prepare("hf:" + path, out_root=str(tmp_path / "out"), tokenizer="char",
                                 max_tokens=10 * total))
    assert big.meta["splits"] == full.meta["splits"] and big.meta["truncated"] is False


def test_trains_a_few_updates(gpt2_bpe, one_thread, saved, tmp_path, capsys):
    path, _, _ = saved
    argv = ["--model", "tango", "--depth", "2", "--size", "tiny", "--block_size", "32", "--batch_size", "2",
            "--max_iters", "3", "--eval_interval", "3", "--eval_windows", "4", "--eval_batch_size", "4",
            "--sample_tokens", "4", "--quiet", "--dataset", "hf:" + path, "--num_proc", "1",
            "--data_root", str(tmp_path / "data"), "--out_dir", str(tmp_path / "out")]
    train.main(argv)
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    with open(tmp_path / "out" / "log.jsonl") as f:
        iters = [r["iter"] for r in map(json.loads, f) if r["event"] == "train"]
    assert iters == [1, 2, 3] and summary["dataset"] == "hf:" + path
    assert math.isfinite(summary["dev_nll"]) and math.isfinite(summary["test_nll"])
    (folder,) = [p for p in os.listdir(tmp_path / "data")]
    ck = torch.load(tmp_path / "out" / "ckpt_best.pt", map_location="cpu", weights_only=True)
    assert ck["data"]["splits"] == data.Data(str(tmp_path / "data" / folder)).meta["splits"]
    assert "test NLL" in out


# ----------------------------------------------------------------------------- errors

def main_error(argv, capsys):
    """data.main in this process: (exit code, stderr lines)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_missing_extra_is_one_line(monkeypatch, tmp_path, capsys, saved):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    out = tmp_path / "out"
    code, lines = main_error(["--dataset", "hf:" + saved[0], "--data_root", str(out)], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --dataset hf:")
    assert lines[0].endswith("needs the optional extra: pip install datasets") and not out.exists()


def no_network(monkeypatch, delay=0.0):
    """Every name lookup fails (after `delay` seconds): a machine without network."""
    def fail(*args, **kwargs):
        time.sleep(delay)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", fail)


def test_no_network_is_one_line_within_seconds(monkeypatch, tmp_path, capsys):
    no_network(monkeypatch)
    out = tmp_path / "out"
    t0 = time.time()
    code, lines = main_error(["--dataset", "hf:someone/some-corpus:cfg", "--data_root", str(out)], capsys)
    assert time.time() - t0 < 5
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --dataset hf:someone/some-corpus:cfg: ")
    assert "local copy" in lines[0] or "cannot read" in lines[0]  # the latter under HF_HUB_OFFLINE=1
    assert not out.exists()  # nothing half-written, and the data_root it created is gone again


def test_hanging_network_fails_within_the_timeout(monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_data, "HUB_TIMEOUT", 0.5)
    no_network(monkeypatch, delay=30)
    (tmp_path / "out").mkdir()
    t0 = time.time()
    with pytest.raises(UsageError, match=r"hf:someone/some-corpus: no answer from the Hugging Face Hub in 0.5 s"):
        data.prepare("hf:someone/some-corpus", out_root=str(tmp_path / "out"))
    assert time.time() - t0 < 3 and os.listdir(tmp_path / "out") == []  # an existing data_root stays, empty


def test_local_sources_work_offline(gpt2_bpe, monkeypatch, saved, jsonl, tmp_path):
    no_network(monkeypatch)
    data.Data(data.prepare("hf:" + saved[0], out_root=str(tmp_path / "a")))
    b = data.Data(data.prepare("hf:json", out_root=str(tmp_path / "b"), hf_text_field="content",
                               hf_data_files=jsonl[0]))
    c = data.Data(data.prepare("hf:" + jsonl[0], out_root=str(tmp_path / "c"), hf_text_field="content"))
    assert c.meta["splits"] == b.meta["splits"] and np.array_equal(c.tokens("dev"), b.tokens("dev"))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dataset="hf:SAVED", hf_text_field="body"), "--hf_text_field body: not a column of hf:.* "
                                                     r"\(columns: id, text, score\)"),
    (dict(dataset="hf:SAVED", hf_split_key="url"), "--hf_split_key url: not a column"),
    (dict(dataset="hf:SAVED", hf_text_field="score"), "--hf_text_field score: holds int, not text"),
    (dict(dataset="hf:json"), r"hf:json: needs --hf_data_files"),
    (dict(dataset="hf:json", hf_data_files="TMP/none*.jsonl"), "--hf_data_files .*: no such file"),
    (dict(dataset="hf:DICT", hf_split="validation"), "--hf_split validation: .* has splits train, test"),
    (dict(dataset="stdlib", hf_data_files="x.jsonl"), "--hf_data_files: only used with --dataset hf:NAME"),
    (dict(dataset="stdlib", hf_split_key="url"), "--hf_split_key: only used with --dataset hf:NAME"),
    (dict(dataset="dmmath", hf_split="validation"), "--hf_split: only used with --dataset hf:NAME"),
    (dict(dataset="stdlib", hf_text_field="body"), "--hf_text_field: only used with --dataset hf:NAME"),
    (dict(dataset="hf:"), "give hf:NAME"),
])
def test_bad_input_nothing_written(kwargs, needle, saved, tmp_path):
    dd = tmp_path / "dict"
    datasets.DatasetDict(train=datasets.load_from_disk(saved[0]), test=datasets.load_from_disk(saved[0])) \
        .save_to_disk(str(dd))
    sub = {"SAVED": saved[0], "DICT": str(dd), "TMP": str(tmp_path)}
    for k, v in kwargs.items():
        for a, b in sub.items():
            v = v.replace(a, b)
        kwargs[k] = v
    with pytest.raises(UsageError, match=needle) as e:
        data.prepare(out_root=str(tmp_path / "out"), **kwargs)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_a_file_without_the_text_column_is_one_line_naming_file_and_column(order, tmp_path, capsys):
    """hf:json over a.jsonl (text) and b.jsonl (no text field): one UsageError naming b.jsonl and
    the column, before the tokenizer loads (no vocabulary needed), exit 2 from the command line,
    nothing written (not a KeyError traceback after a.jsonl's rows)."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"body": f"doc {i}", "n": i} for i in range(3)])
    files = ",".join([a, b] if order == "ab" else [b, a])
    out = tmp_path / "out"
    with pytest.raises(UsageError) as e:
        data.prepare("hf:json", out_root=str(out), hf_data_files=files)
    assert str(e.value) == f"--hf_text_field text: not a column of {b} (columns: body, n)"
    assert not out.exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        data.main(["--dataset", "hf:json", "--hf_data_files", files, "--data_root", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: --hf_text_field text: not a column of {b} (columns: body, n)\n"
    assert not out.exists()
    c = write_jsonl(tmp_path / "c.jsonl", [{"body": "a document"}])  # the text column, not the split key
    with pytest.raises(UsageError, match=rf"^--hf_split_key n: not a column of {c} \(columns: body\)$"):
        data.prepare("hf:json", out_root=str(out), hf_data_files=",".join([b, c]), hf_text_field="body",
                     hf_split_key="n")
    with pytest.raises(UsageError, match=rf"^--hf_text_field body: not a column of {a} \(columns: text\)$"):
        data.prepare("hf:json", out_root=str(out), hf_data_files=",".join([b, a]), hf_text_field="body")
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"id": 1, "text": "first"}])  # --hf_split_key auto: id, from the first
    with pytest.raises(UsageError, match=rf"^--hf_split_key id \(auto: the first source has it\): not a column of {a} "):
        data.prepare("hf:json", out_root=str(out), hf_data_files=",".join([ids, a]))
    assert not out.exists()


def test_rows_with_null_or_empty_text_are_counted_printed_and_recorded(tmp_path, capsys):
    """Rows whose text is null or empty were dropped without a word: 23 rows read, 20 kept, 3 dropped
    (null, "", and a row missing the field among rows that have it, which the json reader fills
    with null) are printed and recorded in meta.json; the kept rows are exactly the documents."""
    rows = [{"text": f"document number {i}"} for i in range(20)]
    rows[4:4] = [{"text": None}]
    rows[9:9] = [{"text": ""}]
    rows[15:15] = [{"other": 1}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    d = data.Data(data.prepare("hf:json", out_root=str(tmp_path / "out"), hf_data_files=path, tokenizer="char"))
    assert "hf:json: read 23 rows, kept 20, dropped 3 (--hf_text_field text null or empty)" in capsys.readouterr().out
    assert d.meta["rows"] == {"read": 23, "kept": 20, "dropped": 3}
    with open(os.path.join(d.folder, "meta.json")) as f:
        assert json.load(f)["rows"] == {"read": 23, "kept": 20, "dropped": 3}
    assert sum(d.meta["n_documents"].values()) == 20
    docs = sorted(t for s in SPLITS for t in decoded_docs(d, s))
    assert docs == sorted(f"document number {i}" for i in range(20))


def test_csv_texts_na_null_none_are_text_and_only_empty_cells_are_missing(tmp_path, capsys):
    """A CSV corpus whose text column holds "NA", "null", "None" or "n/a" keeps those rows as
    documents (pandas' default missing-value list dropped them); an empty cell (bare or quoted)
    is the only missing text. Read as csv with --hf_data_files, as hf:FILE.csv and as a folder."""
    words = ["NA", "null", "None", "n/a", "NaN", "#N/A"]
    docs = [f"row {i} text" for i in range(24)] + words
    lines = ["id,text"] + [f"{i},{t}" for i, t in enumerate(docs)] + ["90,", '91,""']
    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "c.csv"
    path.write_text("\n".join(lines) + "\n")
    sources = [dict(dataset="hf:csv", hf_data_files=str(path)), dict(dataset=f"hf:{path}"),
               dict(dataset=f"hf:{tmp_path / 'corpus'}")]
    for n, kw in enumerate(sources):
        capsys.readouterr()
        d = data.Data(data.prepare(out_root=str(tmp_path / f"out{n}"), tokenizer="char", **kw))
        assert d.meta["rows"] == {"read": 32, "kept": 30, "dropped": 2}, kw
        assert "read 32 rows, kept 30, dropped 2" in capsys.readouterr().out
        assert sorted(t for s in SPLITS for t in decoded_docs(d, s)) == sorted(docs), kw
