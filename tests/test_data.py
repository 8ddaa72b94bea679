"""Tests for data.py and text_data.py: tokenizer, prepare (stdlib, dmmath, local paths), Data loading and batching."""
import json
import math
import os
import re
import sysconfig
import time

import numpy as np
import pytest

import data
from harness import dmmath
from harness import text_data
from common import UsageError



def write_files(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


# ----------------------------------------------------------------------------- tokenizer

def test_gpt2_encoder_from_file(gpt2_bpe):
    enc = data.gpt2_encoder()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256


def test_gpt2_encoder_missing_file(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2_BPE_FILE", str(tmp_path / "nope.tiktoken"))
    with pytest.raises(UsageError, match="GPT2_BPE_FILE"):
        data.gpt2_encoder()


def test_gpt2_download_hang_fails_fast(monkeypatch):
    import tiktoken
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: time.sleep(3))
    t0 = time.time()
    with pytest.raises(UsageError, match="GPT2_BPE_FILE=.*download"):
        data._download_gpt2(timeout=0.3)
    assert time.time() - t0 < 2


# ----------------------------------------------------------------------------- bins

def test_bin_uint32_round_trip(tmp_path):
    ids = np.array([0, 65535, 65536, 70000, 99999], dtype=np.int64)
    assert data.write_bin(tmp_path / "a.bin", ids, 100000) == "uint32"
    back = data.read_bin(tmp_path / "a.bin", "uint32")
    assert back.dtype == np.uint32 and back.tolist() == ids.tolist()
    assert os.path.getsize(tmp_path / "a.bin") == 4 * len(ids)
    assert data.write_bin(tmp_path / "b.bin", [1, 2, 65535], 65536) == "uint16"
    assert data.read_bin(tmp_path / "b.bin", "uint16").tolist() == [1, 2, 65535]
    with pytest.raises(ValueError):
        data.write_bin(tmp_path / "c.bin", [65536], 65536)


def test_split_of_is_stable():
    assert data.split_of("asyncio/base_events.py") == data.split_of("asyncio/base_events.py")
    counts = {s: 0 for s in ("train", "dev", "test")}
    for i in range(2000):
        counts[data.split_of(f"f{i}.py")] += 1
    assert 1700 < counts["train"] < 1900 and 60 < counts["dev"] < 140 and 60 < counts["test"] < 140


# ----------------------------------------------------------------------------- local paths

def test_local_folder_split_by_file(gpt2_bpe, tmp_path):
    files = {f"doc{i:03d}.txt": f"marker{i:03d} some text number {i}\nline two {i * 7}\n" for i in range(100)}
    files["sub/extra.md"] = "marker_sub nested file\n"
    write_files(tmp_path / "corpus", files)
    (tmp_path / "corpus" / ".hidden").write_text("hidden marker")
    (tmp_path / "corpus" / "blob.bin").write_bytes(b"\x00\x01binary")
    folder = data.prepare(str(tmp_path / "corpus"), out_root=str(tmp_path / "out"))
    assert os.path.basename(folder).startswith("corpus-")
    d = data.Data(folder)
    assert d.tokenizer == "gpt2" and d.vocab_size == 50257 and d.meta["dtype"] == "uint16"
    assert d.meta["split_rule"].startswith("by file") and d.eot == 50256
    seen = {}
    for s in ("train", "dev", "test"):
        toks = d.tokens(s)
        assert len(toks) == d.meta["splits"][s] > 0 and not toks.flags.writeable
        docs = d.decode(toks).split("<|endoftext|>")
        assert docs[-1] == ""
        expect = sorted(rel for rel in files if data.split_of(rel) == s)
        assert docs[:-1] == [files[rel] for rel in expect]  # round trip, sorted path order
        for rel in expect:
            assert rel not in seen
            seen[rel] = s
        assert d.meta["n_files"][s] == len(expect)
    assert set(seen) == set(files)  # every file exactly once; hidden and binary ones skipped


def test_local_single_file_split_by_position(gpt2_bpe, tmp_path):
    text = "".join(f"The quick brown fox {i} jumps over the lazy dog.\n" for i in range(400))
    (tmp_path / "book.txt").write_text(text)
    d = data.Data(data.prepare(str(tmp_path / "book.txt"), out_root=str(tmp_path / "out")))
    assert "by position" in d.meta["split_rule"]
    n = {s: len(d.tokens(s)) for s in ("train", "dev", "test")}
    total = sum(n.values())
    assert n["train"] == int(total * 0.9) and n["dev"] == int(total * 0.95) - int(total * 0.9)
    all_ids = np.concatenate([d.tokens(s) for s in ("train", "dev", "test")])
    assert d.decode(all_ids) == text + "<|endoftext|>"


def test_prepare_errors(gpt2_bpe, tmp_path):
    with pytest.raises(UsageError, match="unknown dataset 'nope'; use stdlib, dmmath, a path to a text file or folder, or hf:NAME"):
        data.prepare("nope", out_root=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="empty"):
        data.prepare(str(tmp_path / "empty"), out_root=str(tmp_path / "out"))
    (tmp_path / "zero.txt").write_text("")
    with pytest.raises(UsageError, match="no readable text"):
        data.prepare(str(tmp_path / "zero.txt"), out_root=str(tmp_path / "out"))
    with pytest.raises(UsageError, match="--data_dir"):
        data.prepare("stdlib", data_dir=str(tmp_path), out_root=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")  # the out_root it created is removed again


def test_reuse_and_reprepare(gpt2_bpe, tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("hello there, " * 200)
    out = str(tmp_path / "out")
    folder = data.prepare(str(tmp_path / "a.txt"), out_root=out)
    stamp = os.stat(os.path.join(folder, "meta.json")).st_mtime_ns
    assert data.prepare(str(tmp_path / "a.txt"), out_root=out) == folder
    assert os.stat(os.path.join(folder, "meta.json")).st_mtime_ns == stamp  # reused, not rewritten
    # a truncated bin is rejected at load and re-prepared
    with open(os.path.join(folder, "train.bin"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(UsageError, match="train.bin"):
        data.Data(folder)
    assert data.prepare(str(tmp_path / "a.txt"), out_root=out) == folder
    data.Data(folder)
    # a failing prepare leaves the old folder and no temp folder behind
    (tmp_path / "a.txt").write_text("changed " * 300)

    def boom(*a, **k):
        raise RuntimeError("interrupted")
    monkeypatch.setattr(text_data, "_build_text", boom)
    with pytest.raises(RuntimeError):
        data.prepare(str(tmp_path / "a.txt"), out_root=out)
    assert os.listdir(out) == [os.path.basename(folder)]
    monkeypatch.undo()
    monkeypatch.setenv("GPT2_BPE_FILE", gpt2_bpe)
    d = data.Data(data.prepare(str(tmp_path / "a.txt"), out_root=out))
    assert d.decode(np.concatenate([d.tokens(s) for s in ("train", "dev", "test")])).startswith("changed changed")


def test_is_path_names_the_file_and_folder_datasets():
    # config.resolve_args records these absolute; checkpoint merging asks whether they are here
    assert [data.is_path(d) for d in ("stdlib", "dmmath", "hf:wikitext:wikitext-2-raw-v1", "nope", "a/b.txt",
                                      "stdlib/")] == [False, False, False, True, True, True]


def test_bad_meta(tmp_path):
    with pytest.raises(UsageError, match="meta.json"):
        data.Data(str(tmp_path))
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(UsageError, match="meta.json"):
        data.Data(str(tmp_path))
    (tmp_path / "meta.json").write_text(json.dumps(dict(tokenizer="gpt2", vocab_size=50257, dtype="uint8",
                                                        splits={"train": 3})))
    with pytest.raises(UsageError, match="dtype"):
        data.Data(str(tmp_path))


# ----------------------------------------------------------------------------- Data API

@pytest.fixture
def small(gpt2_bpe, tmp_path):
    text = "".join(f"Line {i}: the value is {i * i}.\n" for i in range(300))
    (tmp_path / "s.txt").write_text(text)
    return data.Data(data.prepare(str(tmp_path / "s.txt"), out_root=str(tmp_path / "out")))


def test_check_block_size(small):
    n_dev = len(small.tokens("dev"))
    small.check_block_size(n_dev - 1)
    with pytest.raises(UsageError, match=rf"--block_size {n_dev} is too large: split 'dev' .* has only {n_dev} tokens"):
        small.check_block_size(n_dev)
    with pytest.raises(UsageError, match="split 'valid' not in"):
        small.tokens("valid")


def test_batches_and_windows(small):
    T = 16
    x, y = small.train_batch(np.random.default_rng(1), 5, T)
    x2, y2 = small.train_batch(np.random.default_rng(1), 5, T)
    assert x.shape == y.shape == (5, T) and str(x.dtype) == "torch.int64"
    assert (x == x2).all() and (y == y2).all() and (x[:, 1:] == y[:, :-1]).all()
    n = len(small.tokens("dev"))
    w = small.eval_windows("dev", T, 1000)
    assert w.tolist() == [k * T for k in range((n - 1) // T)]
    w3 = small.eval_windows("dev", T, 3)
    assert len(w3) == 3 and w3[0] == 0 and set(w3.tolist()) <= set(w.tolist())
    other = data.Data(small.folder)
    other.train_batch(np.random.default_rng(7), 3, 8)
    assert other.eval_windows("dev", T, 3).tolist() == w3.tolist()
    xb, yb = small.window_batch("dev", w3, T)
    toks = np.asarray(small.tokens("dev"), dtype=np.int64)
    assert xb[1].tolist() == toks[w3[1]:w3[1] + T].tolist() and yb[1].tolist() == toks[w3[1] + 1:w3[1] + T + 1].tolist()
    assert small.mask("dev") is None and small.problems("dev") is None
    assert small.decode(small.encode("Hello world")) == "Hello world" and small.encode("Hello world") == [15496, 995]


def test_unigram_entropy(small):
    toks = np.asarray(small.tokens("dev"))[1:]
    p = np.bincount(toks) / len(toks)
    p = p[p > 0]
    assert data.unigram_entropy(small) == pytest.approx(-(p * np.log(p)).sum())
    assert 0 < data.unigram_entropy(small) < np.log(50257)


# ----------------------------------------------------------------------------- dmmath

MODULES = ("algebra__linear_1d", "arithmetic__add_or_sub")


def fake_dmmath(root, n=150, dev=True):
    """Official layout: question/answer line pairs per module file. Returns {folder: [(q, a)]}."""
    made = {}
    folders = list(dmmath.REQUIRED) + (["dev"] if dev else [])
    for d in folders:
        made[d] = []
        for m in MODULES:
            k = 3 if d in ("interpolate", "extrapolate", "dev") else n
            probs = [(f"Solve {i}*x + {len(d)} = {i * 3 + len(d)} for x.", str(3 + i % 5)) for i in range(k)]
            if m.startswith("arith"):
                probs = [(f"What is {i} - {d[:5]}?", f"{i - 7}") for i in range(k)]
            if d == "extrapolate":
                probs[0] = ("What is Z + 1?", "Z1")  # Z never occurs in training data -> unk
            made[d] += probs
            write_files(root, {f"{d}/{m}.txt": "".join(q + "\n" + a + "\n" for q, a in probs)})
    return made


def check_split(d, split, expected, ordered):
    toks, mask, probs = d.tokens(split), d.mask(split), d.problems(split)
    assert probs.dtype == np.int64 and probs.shape == (len(expected), 3)
    got = []
    for q0, a0, a1 in probs:
        assert toks[a0 - 1] == toks[a1] == d.eot
        assert mask[q0:a0].sum() == 0 and mask[a0:a1 + 1].all()
        got.append((d.decode(toks[q0:a0 - 1]), d.decode(toks[a0:a1])))
    assert probs[0, 0] == 0 and (probs[1:, 0] == probs[:-1, 2] + 1).all() and probs[-1, 2] + 1 == len(toks)
    assert int(mask.sum()) == sum(len(a) + 1 for _, a in expected)
    def seen(text):  # chars unseen in training decode as the unknown symbol
        return "".join(c if c in d.stoi else d.itos[d.meta["unk_id"]] for c in text)
    expected = [(seen(q), seen(a)) for q, a in expected]
    assert got == expected if ordered else sorted(got) == sorted(expected)


def test_dmmath_with_dev(tmp_path):
    made = fake_dmmath(tmp_path / "dm")
    d = data.Data(data.prepare("dmmath", data_dir=str(tmp_path / "dm"), out_root=str(tmp_path / "out")))
    train = [p for f in ("train-easy", "train-medium", "train-hard") for p in made[f]]
    chars = sorted(set("".join(q + a for q, a in train)) | {"\n"})
    assert d.tokenizer == "char" and d.masked and d.itos[:-1] == chars and d.vocab_size == len(chars) + 1
    assert d.meta["unk_id"] == len(chars) and "Z" not in d.itos
    assert d.meta["test_split"] == "interpolate" and d.meta["em_splits"] == ["interpolate", "extrapolate"]
    assert set(d.meta["splits"]) == {"train", "dev", "interpolate", "extrapolate"}
    check_split(d, "train", train, ordered=False)
    check_split(d, "dev", made["dev"], ordered=True)
    check_split(d, "interpolate", made["interpolate"], ordered=True)
    check_split(d, "extrapolate", made["extrapolate"], ordered=True)
    assert d.tokens("extrapolate")[len("What is ")] == d.meta["unk_id"]
    probs = d.problems("train")  # shuffled: modules mix in the first problems
    first = {d.decode(d.tokens("train")[q0:q0 + 5]) for q0 in probs[:20, 0]}
    assert first == {"Solve", "What "}
    # targets: -1 on question chars and separator, answer chars + final newline kept
    q0, a0, a1 = d.problems("interpolate")[1]
    x, y = d.window_batch("interpolate", [q0], a1 - q0 + 1)  # last target: next question's first char
    toks = np.asarray(d.tokens("interpolate"), dtype=np.int64)
    want = np.where(np.arange(q0 + 1, a1 + 2) >= a0, toks[q0 + 1:a1 + 2], -1)
    want[-1] = -1
    assert y[0].tolist() == want.tolist() and (y[0] >= 0).sum() == a1 - a0 + 1
    assert x[0].tolist() == toks[q0:a1 + 1].tolist()
    assert d.encode("x\n") == [d.stoi["x"], d.eot] and d.encode("Z") == [d.meta["unk_id"]]
    targets = np.asarray(d.tokens("dev"))[np.asarray(d.mask("dev")) == 1]
    p = np.bincount(targets) / len(targets)
    assert data.unigram_entropy(d) == pytest.approx(-(p[p > 0] * np.log(p[p > 0])).sum())


def plain_unigram_nll(d, split, starts, T):
    """The train-fitted, add-one smoothed unigram's mean NLL on the scored targets of split's windows,
    in plain Python (counted target: a token after the first, mask 1 where the data is masked)."""
    import collections
    mask_of = lambda s, i: 1 if not d.masked else int(d.mask(s)[i])
    train = d.tokens("train")
    counts = collections.Counter(int(train[i]) for i in range(1, len(train)) if mask_of("train", i) == 1)
    total = sum(counts.values())
    toks = d.tokens(split)
    nll = [-math.log((counts[int(toks[i])] + 1) / (total + d.vocab_size))
           for s in starts for i in range(s + 1, s + T + 1) if mask_of(split, i) == 1]
    return sum(nll) / len(nll)


def test_unigram_baseline_is_scored_on_the_evaluated_targets(tmp_path):
    """unigram_nll: the baseline printed beside the dev NLL is scored on the same targets (the
    windows' scored ones: answers only on dmmath), with the unigram fitted on train, not on dev."""
    fake_dmmath(tmp_path / "dm")
    d = data.Data(data.prepare("dmmath", data_dir=str(tmp_path / "dm"), out_root=str(tmp_path / "out")))
    for T, n in ((16, 5), (40, 3)):
        starts = d.eval_windows("dev", T, n)
        want = plain_unigram_nll(d, "dev", starts, T)
        assert data.unigram_nll(d, "dev", starts, T) == pytest.approx(want, rel=1e-12)
        assert data.unigram_nll(d, "dev", starts, T, chunk=7) == pytest.approx(want, rel=1e-12)  # train read in parts
    assert math.isnan(data.unigram_nll(d, "dev", [], 16))  # no window, no targets


def test_unigram_baseline_on_an_unmasked_dataset(small):
    starts = small.eval_windows("dev", 8, 4)
    assert data.unigram_nll(small, "dev", starts, 8) == pytest.approx(plain_unigram_nll(small, "dev", starts, 8), rel=1e-12)


def test_one_folder_is_prepared_once_however_its_path_is_spelled(tmp_path):
    """dmmath's --data_dir and a text --dataset reached through a symlink or by their real path are
    one source: the second prepare reuses the first's folder (same name, bins not rewritten)."""
    fake_dmmath(tmp_path / "dm")
    (tmp_path / "link").symlink_to(tmp_path / "dm")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("some text here\n" * 300)
    (tmp_path / "tlink").symlink_to(tmp_path / "texts")
    out = str(tmp_path / "out")
    for first, second in ((dict(dataset="dmmath", data_dir=str(tmp_path / "link")),
                           dict(dataset="dmmath", data_dir=str(tmp_path / "dm"))),
                          (dict(dataset=str(tmp_path / "tlink"), tokenizer="char"),
                           dict(dataset=str(tmp_path / "texts"), tokenizer="char"))):
        a = data.prepare(out_root=out, **first)
        stamp = os.stat(os.path.join(a, "train.bin")).st_mtime_ns
        assert data.prepare(out_root=out, **second) == a
        assert os.stat(os.path.join(a, "train.bin")).st_mtime_ns == stamp


def test_dmmath_without_dev(tmp_path):
    made = fake_dmmath(tmp_path / "dm", n=300, dev=False)
    d = data.Data(data.prepare("dmmath", data_dir=str(tmp_path / "dm"), out_root=str(tmp_path / "out")))
    train = [p for f in ("train-easy", "train-medium", "train-hard") for p in made[f]]
    got = {}
    for s in ("train", "dev"):
        t = d.tokens(s)
        got[s] = [(d.decode(t[q0:a0 - 1]), d.decode(t[a0:a1])) for q0, a0, a1 in d.problems(s)]
    assert 0 < len(got["dev"]) < 0.05 * len(train) and sorted(got["train"] + got["dev"]) == sorted(train)
    assert not set(got["train"]) & set(got["dev"])
    assert "2%" in d.meta["split_rule"]


def test_dmmath_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="empty.*train-easy, train-medium, train-hard, interpolate, extrapolate"):
        data.prepare("dmmath", data_dir=str(tmp_path / "empty"), out_root=str(tmp_path / "out"))
    fake_dmmath(tmp_path / "dm", n=5)
    bad = tmp_path / "dm" / "train-hard" / "algebra__linear_1d.txt"
    bad.write_text("What is 1 + 1?\n2\nWhat is 2 + 2?\n")
    with pytest.raises(UsageError, match="algebra__linear_1d.txt: malformed"):
        data.prepare("dmmath", data_dir=str(tmp_path / "dm"), out_root=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")  # the out_root it created is removed again
    bad.write_bytes(b"What is 1 + 1?\n2\nWhat is caf\xe9?\n3\n")  # Latin-1: a U+FFFD would change the question
    with pytest.raises(UsageError, match=r"^" + re.escape(f"{bad}: not UTF-8 (byte 0xe9 at offset 28); the DeepMind "
                                                           "Mathematics files are UTF-8 text") + "$"):
        data.prepare("dmmath", data_dir=str(tmp_path / "dm"), out_root=str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


# ----------------------------------------------------------------------------- stdlib (real, ~5 s)

def test_stdlib_split_by_file(gpt2_bpe, tmp_path):
    d = data.Data(data.prepare("stdlib", out_root=str(tmp_path)))
    root = sysconfig.get_paths()["stdlib"]
    rels = data._walk(root, keep=lambda r: r.endswith(".py"), skip_dir=lambda n: n == "site-packages")
    assert rels and not any("site-packages" in r for r in rels)
    texts = {r: text_data._read_text(os.path.join(root, r))[0] for r in rels}
    enc = data.gpt2_encoder()
    for s in ("train", "dev", "test"):
        mine = [r for r in rels if data.split_of(r) == s and texts[r]]
        assert d.meta["n_files"][s] == len(mine)
        lens = [len(x) + 1 for x in enc.encode_ordinary_batch([texts[r] for r in mine], num_threads=2)]
        assert d.meta["splits"][s] == len(d.tokens(s)) == sum(lens)
        toks = d.tokens(s)
        assert d.decode(toks[:lens[0]]) == texts[mine[0]] + "<|endoftext|>"  # first file of the split
        ends = np.cumsum(lens) - 1
        assert (toks[ends] == 50256).all() and (np.asarray(toks) == 50256).sum() >= len(mine)
    assert sum(d.meta["n_files"].values()) > 1000


# ----------------------------------------------------------------------------- --tokenizer char

def test_char_tokenizer_round_trip(tmp_path):
    files = {f"doc{i:03d}.txt": f"line {i}: value {i * i}\n\tend {i % 7}\n" for i in range(80)}
    files["doc003.txt"] += "naïve ∑"  # characters that may be unseen in train
    write_files(tmp_path / "corpus", files)
    d = data.Data(data.prepare(str(tmp_path / "corpus"), out_root=str(tmp_path / "out"), tokenizer="char"))
    assert os.path.basename(d.folder).startswith("corpus-") and d.folder.endswith("-char")
    train_chars = sorted(set("".join(t for rel, t in files.items() if data.split_of(rel) == "train")) | {"\n"})
    assert d.tokenizer == "char" and d.itos == train_chars + ["<|endoftext|>", "\ufffd"]
    assert d.vocab_size == len(train_chars) + 2 and d.eot == len(train_chars) and d.meta["unk_id"] == len(train_chars) + 1
    assert d.meta["split_rule"] == data.BY_FILE and d.meta["dtype"] == "uint16"
    seen = []
    for s in ("train", "dev", "test"):
        want = [files[rel] for rel in sorted(files) if data.split_of(rel) == s]
        want = ["".join(c if c in train_chars else "\ufffd" for c in t) for t in want]
        toks = d.tokens(s)
        assert d.decode(toks).split("<|endoftext|>") == want + [""] and len(toks) == sum(len(t) + 1 for t in want)
        assert d.meta["n_files"][s] == len(want)
        seen += [rel for rel in files if data.split_of(rel) == s]
    assert sorted(seen) == sorted(files)
    assert d.encode("line 1\n") == [d.stoi[c] for c in "line 1\n"] and d.encode("€") == [d.meta["unk_id"]]


def test_char_vocabulary_has_the_newline_when_no_text_holds_one(tmp_path):
    """The character vocabulary always holds the newline (sample.py's prompts and dmmath's end of
    text use it), also when no file of the train split holds one."""
    write_files(tmp_path / "corpus", {f"doc{i:03d}.txt": f"value {i} is {i * i}" for i in range(40)})
    d = data.Data(data.prepare(str(tmp_path / "corpus"), out_root=str(tmp_path / "out"), tokenizer="char"))
    chars = sorted(set("".join(f"value {i} is {i * i}" for i in range(40)
                               if data.split_of(f"doc{i:03d}.txt") == "train")))
    assert d.itos == ["\n"] + chars + ["<|endoftext|>", "\ufffd"]
    assert d.encode("1\n") == [d.stoi["1"], 0]


def test_train_passes_tokenizer_char_through(one_thread, tmp_path, capsys):
    """train.py --tokenizer char trains on character-level text, here 3 updates in-process."""
    import torch
    import train
    write_files(tmp_path / "corpus", {f"m{i:02d}.py": f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(60)})
    argv = ["--model", "tango", "--depth", "2", "--size", "tiny", "--block_size", "32", "--batch_size", "2",
            "--max_iters", "3", "--eval_interval", "3", "--eval_windows", "4", "--sample_tokens", "4", "--quiet",
            "--dataset", str(tmp_path / "corpus"), "--tokenizer", "char", "--num_proc", "1",
            "--data_root", str(tmp_path / "data"), "--out_dir", str(tmp_path / "out")]
    train.main(argv)
    assert "test NLL" in capsys.readouterr().out
    (name,) = os.listdir(tmp_path / "data")
    d = data.Data(str(tmp_path / "data" / name))
    ck = torch.load(tmp_path / "out" / "ckpt_best.pt", map_location="cpu", weights_only=True)
    assert name.endswith("-char") and ck["data"]["itos"] == d.itos and ck["config"]["vocab_size"] == d.vocab_size
    assert d.vocab_size == len(set("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(60)))) + 2


def test_char_single_file_by_position_and_max_tokens(tmp_path):
    text = "".join(f"The quick brown fox {i} jumps.\n" for i in range(200))
    (tmp_path / "book.txt").write_text(text)
    out = str(tmp_path / "out")
    d = data.Data(data.prepare(str(tmp_path / "book.txt"), out_root=out, tokenizer="char"))
    n = len(text) + 1
    assert d.meta["splits"] == dict(train=int(n * 0.9), dev=int(n * 0.95) - int(n * 0.9), test=n - int(n * 0.95))
    assert d.meta["split_rule"] == data.BY_POSITION and d.itos[:-2] == sorted(set(text[:int(n * 0.9)]) | {"\n"})
    assert d.decode(np.concatenate([d.tokens(s) for s in ("train", "dev", "test")])) == text + "<|endoftext|>"
    cut = data.Data(data.prepare(str(tmp_path / "book.txt"), out_root=out, tokenizer="char", max_tokens=500))
    assert cut.folder.endswith("-char-max500") and sum(cut.meta["splits"].values()) == 500
    assert cut.decode(np.concatenate([cut.tokens(s) for s in ("train", "dev", "test")])) == text[:500]
    with pytest.raises(UsageError, match=r"split 'dev' .* has only 25 tokens \(need block_size\+1\); --max_tokens 500 "
                                         r"kept the source's first 500 tokens, too few for every split"):
        cut.check_block_size(25)  # the split too short for the context names the cut that made it so


def test_worker_processes_write_the_same_bins(gpt2_bpe, tmp_path, monkeypatch):
    """Worker processes (batches of 200 characters here, so there are many) write the bins one
    process writes; text of one batch is tokenized in this process (no workers to start)."""
    files = {f"f{i:02d}.py": f"def f{i}(x):\n    return x * {i}  # é\n" * (i + 1) for i in range(40)}
    write_files(tmp_path / "src", files)
    pools, context, batches = [], text_data._pool_context, text_data._batches
    monkeypatch.setattr(text_data, "_pool_context", lambda: pools.append(1) or context())
    monkeypatch.setattr(text_data, "_batches", lambda docs, n: batches(docs, 200))
    monkeypatch.setattr(text_data.os, "cpu_count", lambda: 2)  # the same on any machine
    one = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "a"), num_proc=1))
    assert pools == []
    two = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "b"), num_proc=2))
    assert pools == [1]
    assert one.meta == two.meta
    for s in ("train", "dev", "test"):
        assert np.array_equal(one.tokens(s), two.tokens(s)) and len(one.tokens(s)) > 0
    monkeypatch.setattr(text_data, "_batches", batches)  # all of it one batch: no workers
    data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "c"), num_proc=2)
    assert pools == [1]


def test_more_workers_than_cpus_are_lowered_to_the_cpus(gpt2_bpe, tmp_path, monkeypatch, capsys):
    """--num_proc above the machine's CPUs only adds processes (2**62 would make Pool fail): the
    tokenizer uses the CPUs' count, says so, and writes the bins one process writes."""
    write_files(tmp_path / "src", {f"f{i}.py": f"x = {i}\n" * 50 for i in range(20)})
    pools, context, batches = [], text_data._pool_context, text_data._batches
    monkeypatch.setattr(text_data, "_pool_context", lambda: pools.append(1) or context())
    monkeypatch.setattr(text_data, "_batches", lambda docs, n: batches(docs, 100))  # many batches
    monkeypatch.setattr(text_data.os, "cpu_count", lambda: 1)
    one = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "a"), num_proc=1))
    capsys.readouterr()
    many = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "b"), num_proc=2**62))
    assert f"note: --num_proc {2**62}: more than this machine's CPUs (1); tokenizing with 1\n" in capsys.readouterr().out
    assert pools == [] and one.meta == many.meta  # one worker: this process, as with --num_proc 1
    for s in ("train", "dev", "test"):
        assert np.array_equal(one.tokens(s), many.tokens(s))


def test_tokenizer_errors(tmp_path):
    with pytest.raises(UsageError, match=r"--tokenizer gpt2: dmmath is read as characters; choose auto or char"):
        data.prepare("dmmath", tokenizer="gpt2", out_root=str(tmp_path))
    with pytest.raises(UsageError, match="--tokenizer bpe: choose one of auto, gpt2, char"):
        data.prepare("stdlib", tokenizer="bpe", out_root=str(tmp_path))
    with pytest.raises(UsageError, match="--max_tokens -1"):
        data.prepare("stdlib", max_tokens=-1, out_root=str(tmp_path))


# ----------------------------------------------------------------------------- command line

def test_cli_prepares_and_prints_counts(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world, " * 300)
    data.main(["--dataset", str(tmp_path / "a.txt"), "--data_root", str(tmp_path / "out"), "--tokenizer", "char"])
    out = capsys.readouterr().out.splitlines()
    d = data.Data(os.path.join(tmp_path, "out", os.listdir(tmp_path / "out")[0]))
    counts = ", ".join(f"{k} {v:,}" for k, v in d.meta["splits"].items())
    assert out == [f"{tmp_path / 'a.txt'}: read 1 files, kept 1, dropped 0 (binary, empty or no UTF-8 text)",
                   f"prepared {d.folder}: {counts} tokens", f"{d.folder}: char vocab 12, {counts} tokens",
                   f"source {d.meta['source']}; split {d.meta['split_rule']}"]
    assert sum(d.meta["splits"].values()) == len("hello world, ") * 300 + 1


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        data.main(["--help"])
    entries = {" ".join(e.split()).split()[0]: " ".join(e.split())
               for e in re.split(r"\n  (?=--)", capsys.readouterr().out)[1:]}  # one per flag
    assert e.value.code == 0
    for flag, default in [("--dataset", "stdlib"), ("--tokenizer", "auto"), ("--data_root", "data"),
                          ("--max_tokens", "0"), ("--hf_split", "train"), ("--hf_text_field", "text"),
                          ("--hf_split_key", "auto")]:
        assert entries[flag].endswith(f"(default: {default})"), entries[flag]
    assert entries["--num_proc"].endswith("; default: this machine's CPU count")  # (the docs' tables hold no number of it)
    assert "../shared/data/dmmath" in entries["--data_dir"]
    for argv, needle in [(["--max_tokens", "1.5"], "--max_tokens: '1.5' is not a whole number from 0 to 2**63 - 1"),
                         (["--max_tokens", "1e30"], "--max_tokens: '1e30' is not a whole number from 0 to 2**63 - 1"),
                         (["--tokenizer", "bpe"], "--tokenizer: invalid choice"),
                         (["--dataset", "nope"], "--dataset: unknown dataset 'nope'"),
                         (["--dataset", "dmmath", "--max_tokens", "300000"],
                          "error: --max_tokens 300000: not used with --dataset dmmath (dmmath is prepared whole)")]:
        with pytest.raises(SystemExit) as e:
            data.main(argv + ["--data_root", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not (tmp_path / "out").exists()
    assert data._count("1.5e9") == 1_500_000_000 and data._count("1_000") == 1000
    assert data._count("9007199254740993") == 2**53 + 1 and data._count(str(2**63 - 1)) == 2**63 - 1  # not floats


def test_cli_checks_a_folder_prepared_earlier(tmp_path, capsys):
    """python data.py on a folder prepared earlier checks its files against meta.json, as train.py
    does (check_data): a byte changed since is one line naming the file, exit code 2."""
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    argv = ["--dataset", str(tmp_path / "src"), "--tokenizer", "char", "--data_root", str(tmp_path / "out")]
    data.main(argv)
    folder = re.search(r"^(\S+): char vocab", capsys.readouterr().out, re.M).group(1)
    data.main(argv)  # found prepared and unchanged
    assert capsys.readouterr().out.startswith(folder + ": char vocab")
    dev = os.path.join(folder, "dev.bin")
    a = np.fromfile(dev, np.uint8)
    i = int(np.flatnonzero(a[:-1] != a[1:])[0])
    a[i], a[i + 1] = a[i + 1], a[i]  # every id stays in the vocabulary: only the hash can tell
    a.tofile(dev)
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"error: {dev}: its SHA-256 is not meta.json's (the file changed after it "
                                         f"was prepared); delete {folder} to prepare it again"]


def test_two_preparations_of_one_folder_at_once(tmp_path, monkeypatch):
    """Two processes that prepare the same data at once (two train.py started together on a new
    --data_root): the one that finishes second finds the folder in place and keeps it, the first
    one's files that it may be reading (it replaced them, or failed with "Directory not empty"
    when the other finished between its check and its rename); a stale folder is still replaced."""
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    build, first = text_data._build_text, []

    def other_process_first(*a, **k):  # the other preparation puts its folder in place meanwhile
        if not first:
            first.append(None)
            first[0] = data.prepare(src, out_root=out, tokenizer="char")
            first.append(os.stat(os.path.join(first[0], "meta.json")).st_ino)
        return build(*a, **k)
    monkeypatch.setattr(text_data, "_build_text", other_process_first)
    folder = data.prepare(src, out_root=out, tokenizer="char")
    assert first[0] == folder and sorted(os.listdir(out)) == [os.path.basename(folder)]
    assert os.stat(os.path.join(folder, "meta.json")).st_ino == first[1]  # the first one's, which it may be reading
    data.check_data(data.Data(folder))
    monkeypatch.setattr(text_data, "_build_text", build)
    os.utime(tmp_path / "src" / "f0.txt", ns=(1, 1))  # the sources changed: the folder is stale
    (tmp_path / "src" / "f0.txt").write_text("new text\n")
    assert data.prepare(src, out_root=out, tokenizer="char") == folder
    assert "new text" in "".join(data.Data(folder).decode(data.Data(folder).tokens(s)) for s in ("train", "dev", "test"))
    assert sorted(os.listdir(out)) == [os.path.basename(folder)]


@pytest.mark.parametrize("other", ["moves the stale folder", "puts its folder in place", "replaces the stale folder"])
def test_two_preparations_replacing_one_stale_folder_at_once(other, tmp_path, monkeypatch):
    """Two processes replacing the same stale folder at once: the other one's step lands between this
    one's moves (it moved the stale folder out first; it put its own in place after this one moved the
    stale folder out; it replaced the stale folder with its own between this one's check and its
    move); this one ends with the fresh tokens in place, not a FileNotFoundError or "Directory not
    empty" traceback, and keeps the other one's folder where that one is in place (it may be reading
    it)."""
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    folder = data.prepare(src, out_root=out, tokenizer="char")
    (tmp_path / "src" / "f0.txt").write_text("new text\n")  # the sources changed: the folder is stale
    real, fired = os.replace, []

    def racing(a, b):
        moving_stale_out = a == folder and ".old-" in b
        if not fired and moving_stale_out and other == "moves the stale folder":
            fired.append(real(folder, str(tmp_path / "elsewhere")))
        if not fired and moving_stale_out and other == "replaces the stale folder":
            fired.append(None)  # this one saw the stale folder; the other one replaces it now, before this one moves it
            assert data.prepare(src, out_root=out, tokenizer="char") == folder
            fired.append(os.stat(os.path.join(folder, "meta.json")).st_ino)
        if not fired and a != folder and b == folder and not os.path.exists(folder) and other == "puts its folder in place":
            fired.append(None)  # this one moved the stale folder out; the other one finishes now
            assert data.prepare(src, out_root=out, tokenizer="char") == folder
            fired.append(os.stat(os.path.join(folder, "meta.json")).st_ino)
        return real(a, b)
    monkeypatch.setattr(os, "replace", racing)
    assert data.prepare(src, out_root=out, tokenizer="char") == folder and fired
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == [os.path.basename(folder)]
    if other != "moves the stale folder":  # kept: the other one may be reading it
        assert os.stat(os.path.join(folder, "meta.json")).st_ino == fired[1]
    d = data.Data(folder)
    data.check_data(d)
    assert "new text" in "".join(d.decode(d.tokens(s)) for s in ("train", "dev", "test"))


def test_files_read_kept_and_dropped_are_counted(tmp_path, capsys):
    """A folder source drops binary and empty files: the files read, kept and dropped are printed and
    recorded in meta.json (as Hugging Face rows are), not dropped without a word."""
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(6)})
    (tmp_path / "src" / "empty.txt").write_text("")
    (tmp_path / "src" / "blob.bin").write_bytes(b"\0\1\2")
    d = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "out"), tokenizer="char"))
    said = capsys.readouterr().out
    assert f"{tmp_path / 'src'}: read 8 files, kept 6, dropped 2 (binary, empty or no UTF-8 text)" in said
    assert d.meta["files"] == {"read": 8, "kept": 6, "dropped": 2, "not_utf8": 0, "not_utf8_bytes": 0}


def test_a_split_left_empty_is_refused_and_nothing_is_written(tmp_path, capsys):
    """A split without tokens (`--max_tokens 200000` on stdlib as characters would leave test
    empty, and train.py would fail on it later) is refused by prepare, naming --max_tokens and the
    split, with no folder left (here a file cut 90/5/5 by position: 10 tokens leave dev empty); so
    is it by tools.sweep run."""
    (tmp_path / "book.txt").write_text("The quick brown fox jumps.\n" * 20)
    out = tmp_path / "new" / "data"
    argv = ["--dataset", str(tmp_path / "book.txt"), "--tokenizer", "char", "--max_tokens", "10", "--data_root", str(out)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: --max_tokens 10: split 'dev' got no tokens (train 9, dev 0, test 1); the source's first "
        "10 tokens are too few for every split (raise --max_tokens)\n")
    assert sorted(os.listdir(tmp_path)) == ["book.txt"]  # not even --data_root's new parent
    # train.py's data (allow_empty_splits): kept, and train.py names the split and the cut (check_block_size)
    d = data.Data(data.prepare(str(tmp_path / "book.txt"), out_root=str(out), tokenizer="char", max_tokens=10))
    with pytest.raises(UsageError, match=r"split 'dev' .* has only 0 tokens .*; --max_tokens 10 kept the source's"):
        d.check_block_size(4)
    with pytest.raises(SystemExit) as e:  # data.py refuses that folder too when it finds it prepared
        data.main(argv)
    assert e.value.code == 2 and "split 'dev' got no tokens" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"^--dataset stdlib: split 'test' got no tokens \(train 5, dev 3, test 0\); "
                                         r"every split needs text"):
        data.check_splits({"splits": {"train": 5, "dev": 3, "test": 0}}, "stdlib")
    data.check_splits({"splits": {"train": 5, "dev": 3, "test": 1}}, "stdlib", max_tokens=9)  # none empty: fine


def test_cli_refuses_a_data_root_that_is_a_file(tmp_path, monkeypatch, capsys):
    """data.py --data_root FILE is one line naming the flag, as in train.py (not a FileExistsError)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    for root, message in [("afile", "--data_root afile: exists and is not a folder"),
                          ("afile/sub", f"--data_root afile/sub: {tmp_path / 'afile'} is a file, not a folder")]:
        with pytest.raises(SystemExit) as e:
            data.main(["--dataset", "stdlib", "--data_root", root])
        assert e.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    assert os.listdir(tmp_path) == ["afile"]


def test_a_dataset_folder_holds_neither_the_runs_outputs_nor_the_prepared_data(tmp_path, capsys):
    """--dataset FOLDER reads every file under it: a --data_root or --out_dir inside it is refused
    (a second run, or a resume, would have read the first run's log and bins as training text)."""
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    with pytest.raises(UsageError, match=re.escape(f"--data_root {tmp_path / 'src' / 'data'}: inside --dataset "
                                                   f"{tmp_path / 'src'}, whose every file is training text; give a "
                                                   "--data_root outside it")):
        data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "src" / "data"), tokenizer="char")
    assert sorted(os.listdir(tmp_path / "src")) == [f"f{i}.txt" for i in sorted(range(30), key=str)]
    import train
    for out_dir, ok in ((tmp_path / "src", False), (tmp_path / "src" / "sub" / "out", False),
                        (tmp_path / "src-out", True)):  # a sibling whose name starts with the folder's
        argv = ["--dataset", str(tmp_path / "src"), "--tokenizer", "char", "--size", "tiny", "--out_dir", str(out_dir),
                "--data_root", str(tmp_path / "data")]
        if ok:
            train.check_flags(train.parse_args(argv), set())
        else:
            with pytest.raises(UsageError, match=r"^--out_dir .*: inside --dataset .*; give a --out_dir outside it$"):
                train.check_flags(train.parse_args(argv), set())


def test_names_that_are_not_utf8_and_files_that_cannot_be_read(tmp_path, monkeypatch, capsys):
    """A file name that is not UTF-8 is a file like any other (its bytes choose its split); bytes
    that are not UTF-8 read as U+FFFD, and the files that hold them are counted (printed and in
    meta.json); a file or folder that cannot be read is one line naming it, not a traceback nor a
    silent skip."""
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    odd = os.path.join(os.fsencode(tmp_path / "src"), b"caf\xe9.txt")
    with open(odd, "wb") as f:
        f.write(b"the odd one\n")
    d = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "out"), tokenizer="char"))
    assert d.meta["files"] == {"read": 31, "kept": 31, "dropped": 0, "not_utf8": 0, "not_utf8_bytes": 0}
    assert "not valid UTF-8" not in capsys.readouterr().out
    rel = os.fsdecode(b"caf\xe9.txt")
    assert data.split_of(rel) in ("train", "dev", "test")
    assert "the odd one" in "".join(d.decode(d.tokens(s)) for s in ("train", "dev", "test"))
    with open(os.path.join(os.fsencode(tmp_path / "src"), b"f3.txt"), "wb") as f:
        f.write(b"latin-1 caf\xe9\n")
    d = data.Data(data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "out"), tokenizer="char"))
    assert d.meta["files"] == {"read": 31, "kept": 31, "dropped": 0, "not_utf8": 1, "not_utf8_bytes": 1}
    total = sum(os.path.getsize(p) for p in (tmp_path / "src").iterdir())
    assert (f": 1 of them not valid UTF-8: 1 bytes read as U+FFFD, {100 / total:.3g}% of the {total:,} bytes read, "
            "e.g. f3.txt\n") in capsys.readouterr().out
    assert "latin-1 caf\ufffd\n" in "".join(d.decode(d.tokens(s)) for s in ("train", "dev", "test"))

    (tmp_path / "src" / "sub").mkdir()
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", scandir)
        with pytest.raises(UsageError, match=re.escape(f"--dataset: cannot list the folder {tmp_path / 'src' / 'sub'} "
                                                       "(Permission denied); make it readable or move it out of the "
                                                       "dataset")):
            data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "out2"), tokenizer="char")

    def unreadable(path, *a, **k):  # the dataset's files only (the bins are written with open too)
        if os.fspath(path).startswith(str(tmp_path / "src")):
            raise PermissionError(13, "Permission denied", path)
        return open(path, *a, **k)
    monkeypatch.setattr(text_data, "open", unreadable, raising=False)
    with pytest.raises(UsageError, match=r"^--dataset: cannot read " + re.escape(str(tmp_path / "src")) +
                       r"/\S+ \(Permission denied\); make it readable or move it out of the dataset$"):
        data.prepare(str(tmp_path / "src"), out_root=str(tmp_path / "out3"), tokenizer="char")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_a_source_without_readable_text_is_refused_like_an_empty_one(tmp_path, capsys):
    """A file of 200,000 bytes that are not UTF-8 (every one read as U+FFFD) has no readable
    character: it is dropped as an empty file is, so a source of only such files is refused (one
    line, exit code 2, nothing written) by data.py and train.py, not prepared as a vocabulary of
    U+FFFD. Where some text is readable, the bytes read as U+FFFD and their share are said."""
    import train
    junk = bytes(0x80 + i % 64 for i in range(200_000))
    for name, content in (("empty", b""), ("junk", junk)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.txt").write_bytes(content)
        src, out = tmp_path / name, tmp_path / "out"
        for main, extra in ((data.main, []), (train.main, ["--size", "tiny", "--out_dir", str(tmp_path / "run")])):
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                main(["--dataset", str(src), "--tokenizer", "char", "--data_root", str(out), *extra])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err == (f"error: --dataset {src}: no readable text (1 files read, all binary, "
                                                 "empty or no UTF-8 text)\n"), (name, main)
            assert not out.exists() and not (tmp_path / "run").exists()
    (tmp_path / "junk" / "g.txt").write_text("readable text\n" * 10)  # 140 bytes
    d = data.Data(data.prepare(str(tmp_path / "junk"), out_root=str(tmp_path / "out"), tokenizer="char"))
    said = capsys.readouterr().out
    assert f"{tmp_path / 'junk'}: read 2 files, kept 1, dropped 1 (binary, empty or no UTF-8 text)\n" in said
    assert (f"{tmp_path / 'junk'}: 1 of them not valid UTF-8: 200,000 bytes read as U+FFFD, 99.9% of the 200,140 "
            "bytes read, e.g. f.txt\n") in said
    assert d.meta["files"] == {"read": 2, "kept": 1, "dropped": 1, "not_utf8": 1, "not_utf8_bytes": 200_000}
    assert "\ufffd" not in "".join(d.decode(d.tokens(s)) for s in ("train", "dev", "test"))


# data.py run with a SIGTERM sent to itself at a chosen moment (no sleeping, whatever the load):
# "start": as the forkserver starts the pool's first worker; "tokenize": after the first batch came back
SIGTERM_AT = """
import os, runpy, signal, sys
moment, repo, root = sys.argv[1:4]
sys.path.insert(0, repo)
from multiprocessing import forkserver
from harness import text_data
sent = []

def stop(real):
    def wrapped(*a, **k):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real(*a, **k)
    return wrapped

if moment == "start":
    forkserver.read_signed = stop(forkserver.read_signed)
else:
    real_map = text_data._ordered_map
    text_data._ordered_map = lambda *a, **k: (stop(lambda r: r)(r) for r in real_map(*a, **k))
sys.argv = ["data.py", "--dataset", "stdlib", "--tokenizer", "char", "--num_proc", "2", "--data_root", root]
runpy.run_path(os.path.join(repo, "data.py"), run_name="__main__")
"""


@pytest.mark.parametrize("moment", ["start", "tokenize"])
def test_sigterm_while_preparing_leaves_nothing(moment, tmp_path):
    """SIGTERM (a scheduler's stop) during a preparation with worker processes: one line, exit code
    143, and neither the temporary folder nor the --data_root it created is left behind. Sent while
    the pool starts its workers (what a loaded machine made likely), a worker the pool did not know
    yet outlived this process and printed a FileNotFoundError traceback (SemLock._rebuild) once
    this process's exit had removed the pool's semaphores; the output is read to its end, so such a
    worker's lines are in it."""
    import subprocess
    import sys
    root = tmp_path / "root"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", SIGTERM_AT, moment, repo, str(root)], cwd=repo, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert (p.returncode, p.stderr) == (143, "terminated\n"), p.stderr
    assert not root.exists(), list(root.iterdir())


# The tokenizing pool's end when a stop leaves its body (a process of its own: the old end hung). Both
# workers are busy; the task-handler thread holds a batch larger than the pipe and, as a loaded machine
# can schedule it, writes it only after Pool.terminate drained the pipe (or after 5 s).
POOL_STOP = """
import sys, threading, time
from multiprocessing import connection, pool as mp_pool
sys.path.insert(0, sys.argv[1])
from harness import text_data
drained = threading.Event()
help_finish = mp_pool.Pool._help_stuff_finish
def helped(*a):
    help_finish(*a)
    drained.set()
mp_pool.Pool._help_stuff_finish = staticmethod(helped)
send = connection.Connection.send
def late(self, obj):
    if "_handle_tasks" in threading.current_thread().name and obj and obj[2] is len:
        drained.wait(5)
    return send(self, obj)
connection.Connection.send = late
try:
    with text_data._pool(2) as pool:
        for _ in range(2):
            pool.apply_async(time.sleep, (3,))
        pool.apply_async(len, (b"x" * (1 << 22),))
        time.sleep(1)  # the workers have their sleeps
        raise KeyboardInterrupt
except KeyboardInterrupt:
    print("stopped")
"""


def test_a_stop_ends_the_tokenizing_pool_by_closing_and_joining_it():
    """A stop leaving the pool's body lets the batches it was given finish (close, join) instead of
    Pool.terminate, which hung when its task handler wrote a batch after terminate's one drain of the
    pipe (seen once in about ten SIGTERM tests on a loaded machine)."""
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", POOL_STOP, repo], capture_output=True, text=True, timeout=90)
    assert (p.returncode, p.stdout) == (0, "stopped\n"), p.stderr[-2000:]


def test_a_stop_while_the_pool_starts_is_taken_once_it_is_whole():
    """SIGTERM and Ctrl-C sent while the pool starts (text_data._stops_held) reach the handlers
    found after the body, once each, and those handlers are back in place."""
    import signal
    calls = []
    mine = lambda signum, frame: calls.append(signum)
    previous = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with text_data._stops_held():
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), s)
            calls.append("body")
        calls.append("after")
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is mine
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert calls == ["body", signal.SIGTERM, signal.SIGINT, "after"]


def test_preparation_workers_start_without_this_process_s_signal_handlers():
    """The tokenizing workers are not forked from the preparing process: a forked worker inherited
    its threads' held locks and its SIGTERM handler (run_command's), so one could hang at start and
    then ignore the pool's SIGTERM at the end, and the preparation hung with it (seen in the suite).
    A worker started while this process has a handler has SIGTERM's default."""
    import signal
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        with text_data._pool_context().Pool(1) as pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("where", ["tokens", "meta.json", "numpy", "numpy 2.4"])
def test_a_full_disk_while_preparing_is_one_line_and_keeps_the_earlier_folder(where, tmp_path, monkeypatch, capsys):
    """A write that finds the device full (ENOSPC while writing the tokens or meta.json; numpy's
    tofile, which says "N requested and M written" without an errno, on a full device): one line
    naming the folder and "no space left on device", exit code 2, the earlier prepared folder as
    it was and no temporary folder left."""
    import errno
    import shutil
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    out = tmp_path / "out"
    folder = data.prepare(str(tmp_path / "src"), out_root=str(out), tokenizer="char")
    before = {f: (out / os.path.basename(folder) / f).read_bytes() for f in os.listdir(folder)}
    (tmp_path / "src" / "f0.txt").write_text("changed text\n")  # the sources changed: prepared again

    def full(*a, **k):
        if where == "numpy":
            raise OSError("4096 requested and 0 written")
        if where == "numpy 2.4":  # numpy 2.4's tofile on a full device (no errno either)
            raise OSError("Not enough free space to write 49894004 bytes after offset 0")
        raise OSError(errno.ENOSPC, "No space left on device")
    if where == "tokens":
        monkeypatch.setattr(text_data, "_char_vocab", full)
    elif where == "meta.json":
        monkeypatch.setattr(data.json, "dump", full)
    else:  # numpy's messages
        monkeypatch.setattr(text_data, "_split_by_position", full)
        monkeypatch.setattr(text_data, "_char_vocab", full)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        data.main(["--dataset", str(tmp_path / "src"), "--tokenizer", "char", "--data_root", str(out)])
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: {folder}: no space left on device while preparing it; nothing of it was written (an earlier copy, "
        "if any, is as it was); free some space or give a --data_root on another disk\n")
    assert os.listdir(out) == [os.path.basename(folder)]
    assert {f: (out / os.path.basename(folder) / f).read_bytes() for f in os.listdir(folder)} == before
    monkeypatch.undo()
    with pytest.raises(OSError, match="Permission denied"):  # any other failed write is not a full disk
        with data._full_disk(folder):
            raise PermissionError(errno.EACCES, "Permission denied")


def test_a_killed_preparations_and_saves_leftovers_are_removed(tmp_path):
    """What kill -9 leaves (a preparation's temporary folder, a checkpoint's temporary file, named
    after pid and host) is removed by the next preparation of that folder / save of that file once
    unchanged for an hour; a live process's, a recent one's and another host's are kept (a host
    whose name extends this one's too)."""
    import socket
    import subprocess
    import sys
    import torch
    from harness.checkpoint import save_atomic
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid whose process has ended
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    old = time.time() - 7200
    try:
        host = socket.gethostname()
        write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
        out = tmp_path / "out"
        name = os.path.basename(data.prepare(str(tmp_path / "src"), out_root=str(out), tokenizer="char"))
        dead, recent, live, other, longer = (
            f".{name}.tmp-{gone.pid}-{host}-abcd1234", f".{name}.tmp-{gone.pid}-{host}-recent12",
            f".{name}.tmp-{alive.pid}-{host}-efgh5678", f".{name}.old-{gone.pid}-otherhost-ijkl9012",
            f".{name}.tmp-{gone.pid}-{host}-7-mnop3456")
        for d in (dead, recent, live, other, longer):
            (out / d).mkdir()
            (out / d / "train.cp").write_bytes(b"\0" * 64)
            if d != recent:
                os.utime(out / d / "train.cp", (old, old))
                os.utime(out / d, (old, old))
        os.utime(tmp_path / "src" / "f0.txt", ns=(1, 1))  # the sources changed: prepared again
        data.prepare(str(tmp_path / "src"), out_root=str(out), tokenizer="char")
        assert sorted(os.listdir(out)) == sorted([name, recent, live, other, longer])
        leftovers = [f"ckpt_latest.pt.tmp-{gone.pid}-{host}", f"ckpt_latest.pt.tmp-{alive.pid}-{host}",
                     f"ckpt_latest.pt.tmp-{gone.pid}-{host}-7"]
        for n in leftovers:
            (tmp_path / n).write_bytes(b"half")
            os.utime(tmp_path / n, (old, old))
        save_atomic({"x": torch.ones(2)}, str(tmp_path / "ckpt_latest.pt"))
        kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt"))
        assert kept == sorted(["ckpt_latest.pt", *leftovers[1:]])
    finally:
        alive.kill()


def test_a_read_only_data_root_serves_a_prepared_dataset_and_refuses_to_prepare_one(tmp_path, monkeypatch, capsys):
    """A --data_root that cannot be written (a shared read-only copy) serves the datasets prepared
    there, to data.py and train.py; a dataset not prepared there is one line naming the flag, exit
    code 2, before any tokenizing, and nothing is written. (Root may write anywhere, so the folder
    is read-only here by every folder creation under it failing as on a read-only mount.)"""
    import errno
    import tempfile
    import train
    from harness.config import resolve_args
    write_files(tmp_path / "src", {f"f{i}.txt": f"text of file {i}\n" * 3 for i in range(30)})
    write_files(tmp_path / "other", {f"g{i}.txt": f"other text {i}\n" * 3 for i in range(30)})
    ro = tmp_path / "ro"
    folder = data.prepare(str(tmp_path / "src"), out_root=str(ro), tokenizer="char")
    before = sorted(os.listdir(ro))
    real = tempfile.mkdtemp

    def read_only(*a, dir=None, **k):
        if dir is not None and os.path.abspath(dir).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **k)
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert data.main(["--dataset", str(tmp_path / "src"), "--tokenizer", "char", "--data_root", str(ro)]) in (0, None)
    assert folder in capsys.readouterr().out
    resolve_args(train.parse_args(["--dataset", str(tmp_path / "src"), "--tokenizer", "char", "--size", "tiny",
                                   "--data_root", str(ro), "--out_dir", str(tmp_path / "out"), "--device", "cpu"]))
    with pytest.raises(SystemExit) as e:
        data.main(["--dataset", str(tmp_path / "other"), "--tokenizer", "char", "--data_root", str(ro)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: --data_root {ro}: cannot create folders in {ro} (Read-only file system)\n"
    assert sorted(os.listdir(ro)) == before
