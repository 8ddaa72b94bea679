"""Datasets: tokenize once to flat token files, then serve training batches and eval windows.

SPEC.md section 8 names the paper's datasets; this repo runs the CPU-scale stand-ins:

- ``stdlib``: the Python standard library's ``*.py`` files, GPT-2 BPE, split by file
  (a code corpus in the spirit of The Stack: no file is in two splits).
- ``dmmath``: DeepMind Mathematics in the official layout, character vocabulary, loss only on
  the answers; ``interpolate`` is the test split (NLL and exact match), ``extrapolate`` is
  exact match only (SPEC section 8).
- a path to a text file or a folder of text files: GPT-2 BPE.

``prepare`` writes ``<out_root>/<name>/``: one ``<split>.bin`` per split (raw uint16 token ids,
uint32 if the vocabulary is larger than 65536), ``meta.json`` and, for masked datasets,
``<split>.mask.bin`` (uint8, 1 = the token counts as a target) and ``<split>.problems.npy``.
``Data`` memory-maps such a folder. Bad input raises ``common.UsageError`` (exit code 2).
"""
import base64
import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import threading

import numpy as np
import torch

from common import UsageError

DATASETS = ("stdlib", "dmmath")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DMMATH = os.path.join(HERE, "..", "shared", "data", "dmmath")
FORMAT = 1  # bump when the on-disk layout changes; stale folders are then re-prepared
EOT = 50256
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NO_VOCAB = ("no GPT-2 vocabulary: set GPT2_BPE_FILE=/path/to/gpt2.tiktoken "
            "(e.g. ../shared/data/gpt2.tiktoken) or allow tiktoken to download it")
DMMATH_REQUIRED = ("train-easy", "train-medium", "train-hard", "interpolate", "extrapolate")

_encoders = {}  # GPT2_BPE_FILE value (or None) -> tiktoken.Encoding or the UsageError it gave


def gpt2_encoder():
    """GPT-2 BPE as a ``tiktoken.Encoding`` (50257 ids, ``<|endoftext|>`` = 50256).

    With env var ``GPT2_BPE_FILE`` set, the ranks come from that file (tiktoken's format:
    ``base64(token) rank`` per line; parsed here rather than with ``tiktoken.load`` because that
    one copies the file into a cache folder). Otherwise ``tiktoken.get_encoding("gpt2")``,
    given 10 s in a background thread so that an offline machine fails fast instead of hanging.
    Raises UsageError naming GPT2_BPE_FILE when neither works.
    """
    path = os.environ.get("GPT2_BPE_FILE") or None
    if path not in _encoders:
        try:
            _encoders[path] = _load_bpe_file(path) if path else _download_gpt2()
        except UsageError as e:
            _encoders[path] = e
    if isinstance(_encoders[path], UsageError):
        raise _encoders[path]
    return _encoders[path]


def _load_bpe_file(path):
    import tiktoken
    try:
        with open(path, "rb") as f:
            ranks = {base64.b64decode(tok): int(rank)
                     for tok, rank in (line.split() for line in f if line.strip())}
    except (OSError, ValueError) as e:
        raise UsageError(f"GPT2_BPE_FILE={path}: cannot read a tiktoken BPE file ({e})") from None
    if len(ranks) != EOT:
        raise UsageError(f"GPT2_BPE_FILE={path}: has {len(ranks)} ranks, GPT-2 needs {EOT}")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


def _download_gpt2(timeout=10.0):
    import tiktoken
    box = []
    thread = threading.Thread(target=lambda: box.append(_try(tiktoken.get_encoding, "gpt2")),
                              daemon=True)
    thread.start()
    thread.join(timeout)
    if not box or isinstance(box[0], Exception):
        raise UsageError(NO_VOCAB)
    return box[0]


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure means "no vocabulary"
        return e


# ----------------------------------------------------------------------------- low-level files

def bin_dtype(vocab_size):
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def write_bin(path, ids, vocab_size):
    """Write token ids as a raw little-endian array; returns the dtype name used."""
    dtype = bin_dtype(vocab_size)
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{path}: token id out of range [0, {vocab_size})")
    ids.astype(dtype.newbyteorder("<")).tofile(path)
    return dtype.name


def read_bin(path, dtype, n=None):
    """Read-only memmap of a raw token file (a plain empty array for an empty file)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    n = os.path.getsize(path) // dtype.itemsize if n is None else n
    if n == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def split_of(relpath, dev=90, test=95):
    """Stable split of a document by its relative path: ~90% train, 5% dev, 5% test."""
    h = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "train" if h < dev else "dev" if h < test else "test"


def _fingerprint(root, relpaths, *extra):
    """Hash of (path, size, mtime) of the sources: a reused folder must match it."""
    h = hashlib.sha256(repr((FORMAT, os.path.abspath(root)) + extra).encode())
    for rel in relpaths:
        st = os.stat(os.path.join(root, rel))
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _walk(root, keep=lambda rel: True, skip_dir=lambda name: False):
    """Sorted relative paths of the regular, non-hidden files under root."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".") and not skip_dir(x)]
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if not f.startswith(".") and os.path.isfile(os.path.join(d, f)) and keep(rel):
                out.append(rel)
    return sorted(out)


# ----------------------------------------------------------------------------- prepare

def prepare(dataset="stdlib", data_dir=None, out_root="data"):
    """Tokenize ``dataset`` once into ``<out_root>/<name>/`` and return that folder.

    dataset: "stdlib", "dmmath" or a path to a text file / folder of text files.
    data_dir: the dmmath folder (default ../shared/data/dmmath next to this repo).
    A complete folder whose meta matches the sources (path, sizes, mtimes) is reused as is;
    otherwise everything is written into a temporary sibling folder and renamed into place,
    so an interrupted prepare leaves nothing half-written. Raises UsageError for bad input.
    """
    if data_dir is not None and dataset != "dmmath":
        raise UsageError("--data_dir: only used with --dataset dmmath")
    if dataset == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        rels = _walk(root, keep=lambda r: r.endswith(".py"), skip_dir=lambda n: n == "site-packages")
        name, build = "stdlib", lambda tmp: _build_gpt2(tmp, root, rels, "stdlib", by_file_only=True)
    elif dataset == "dmmath":
        root = os.path.abspath(data_dir or DEFAULT_DMMATH)
        missing = [d for d in DMMATH_REQUIRED if not os.path.isdir(os.path.join(root, d))]
        if missing:
            raise UsageError(f"--data_dir {root}: not a DeepMind Mathematics folder; needs "
                             f"{', '.join(DMMATH_REQUIRED)} (+ optional dev), missing {', '.join(missing)}")
        rels = _walk(root, keep=lambda r: r.endswith(".txt")
                     and r.split(os.sep)[0] in DMMATH_REQUIRED + ("dev",))
        default = os.path.samefile(root, DEFAULT_DMMATH) if os.path.isdir(DEFAULT_DMMATH) else False
        name = "dmmath" if default else "dmmath-" + hashlib.sha256(root.encode()).hexdigest()[:8]
        build = lambda tmp: _build_dmmath(tmp, root)
    elif os.path.exists(dataset):
        path = os.path.abspath(dataset)
        if os.path.isdir(path):
            root, rels = path, _walk(path)
        else:
            root, rels = os.path.dirname(path), [os.path.basename(path)]
        if not rels:
            raise UsageError(f"--dataset {dataset}: no files in this folder")
        name = os.path.basename(path.rstrip(os.sep)) + "-" + hashlib.sha256(path.encode()).hexdigest()[:8]
        build = lambda tmp: _build_gpt2(tmp, root, rels, path, by_file_only=False)
    else:
        raise UsageError(f"--dataset: unknown dataset '{dataset}'; "
                         "use stdlib, dmmath or a path to a text file or folder")

    fp = _fingerprint(root, rels, dataset if dataset in DATASETS else "path")
    folder = os.path.join(out_root, name)
    if _matches(folder, fp):
        return folder
    created = _missing_ancestors(out_root)
    os.makedirs(out_root, exist_ok=True)
    tmp, old = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out_root), None
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    ok = False
    try:
        meta = build(tmp)
        meta["fingerprint"] = fp
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(folder):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=out_root)
            os.replace(folder, os.path.join(old, name))
        os.replace(tmp, folder)
        ok = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        for d in created if not ok else ():  # a failed prepare leaves no folder it made (if still empty)
            with contextlib.suppress(OSError):
                os.rmdir(d)
    print(f"prepared {folder}: " + ", ".join(f"{k} {v:,}" for k, v in meta["splits"].items()) + " tokens",
          flush=True)
    return folder


def _missing_ancestors(path):
    """The folders os.makedirs(path) would create, deepest first."""
    out, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _matches(folder, fp):
    try:
        return Data(folder).meta.get("fingerprint") == fp
    except UsageError:
        return False


def _read_text(path):
    with open(path, "rb") as f:
        raw = f.read()
    return None if b"\0" in raw else raw.decode("utf-8", errors="replace")  # NUL byte: binary


def _build_gpt2(tmp, root, rels, source, by_file_only):
    """GPT-2 BPE documents, each followed by <|endoftext|>, split by file (stable path hash).

    If that leaves dev or test empty (a single file, few files) and by_file_only is False,
    the concatenated token stream is split by position 90/5/5 instead.
    """
    enc = gpt2_encoder()
    docs = [(rel, _read_text(os.path.join(root, rel))) for rel in rels]
    docs = [(rel, text) for rel, text in docs if text]
    if not docs:
        raise UsageError(f"--dataset {source}: no readable text")
    ids = enc.encode_ordinary_batch([text for _, text in docs], num_threads=2)
    arrays = [np.array(x + [EOT], dtype=np.uint16) for x in ids]
    which = [split_of(rel) for rel, _ in docs]
    names = ("train", "dev", "test")
    n_files = {s: which.count(s) for s in names}
    rule = "by file: sha256(relative path)[:8] as int % 100 <90 train, <95 dev, else test"
    if min(n_files.values()) > 0 or by_file_only:
        splits = {s: np.concatenate([a for a, w in zip(arrays, which) if w == s] or [np.zeros(0, np.uint16)])
                  for s in names}
    else:
        stream = np.concatenate(arrays)
        a, b = int(len(stream) * 0.90), int(len(stream) * 0.95)
        splits = dict(train=stream[:a], dev=stream[a:b], test=stream[b:])
        n_files = {"all": len(docs)}
        rule = ("by position: too few files to split by file, so the concatenated token stream "
                "(files in path order) is cut 90% train / 5% dev / 5% test")
    for s, arr in splits.items():
        dtype = write_bin(os.path.join(tmp, f"{s}.bin"), arr, EOT + 1)
    return dict(tokenizer="gpt2", vocab_size=EOT + 1, dtype=dtype,
                splits={s: int(len(a)) for s, a in splits.items()}, split_rule=rule,
                source=source, n_files=n_files, test_split="test", em_splits=[])


def _read_problems(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = [line.rstrip("\r") for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 2:
        raise UsageError(f"{path}: malformed, {len(lines)} lines (needs question/answer line pairs)")
    return list(zip(lines[0::2], lines[1::2]))


def _build_dmmath(tmp, root):
    """Character-level DeepMind Mathematics with a loss mask on the answers (see module doc)."""
    def folder(d):
        return [p for f in sorted(os.listdir(os.path.join(root, d))) if f.endswith(".txt")
                for p in _read_problems(os.path.join(root, d, f))]

    train = [p for d in DMMATH_REQUIRED[:3] for p in folder(d)]
    if os.path.isdir(os.path.join(root, "dev")):
        dev, dev_rule = folder("dev"), "dev/ folder"
    else:
        held = [split_of(q + "\n" + a, dev=98, test=100) == "dev" for q, a in train]
        dev = [p for p, h in zip(train, held) if h]
        train = [p for p, h in zip(train, held) if not h]
        dev_rule = "~2% of train-* problems held out (sha256 of the problem text % 100 >= 98)"
    if not train:
        raise UsageError(f"--data_dir {root}: no training problems in train-easy/medium/hard")
    train = [train[i] for i in np.random.default_rng(0).permutation(len(train))]
    splits = dict(train=train, dev=dev, interpolate=folder("interpolate"), extrapolate=folder("extrapolate"))

    chars = sorted(set("".join(q + a for q, a in train)) | {"\n"})
    unk = len(chars)
    itos = chars + ["\ufffd"]  # the unknown id decodes as U+FFFD
    lut = np.full(max(map(ord, chars)) + 1, unk, dtype=np.int64)
    lut[[ord(c) for c in chars]] = np.arange(len(chars))
    meta = dict(tokenizer="char", vocab_size=len(itos), itos=itos, unk_id=unk, splits={},
                n_problems={}, masked=True, test_split="interpolate",
                em_splits=["interpolate", "extrapolate"], source=root,
                split_rule=f"official folders: train = train-easy+medium+hard (shuffled, seed 0), "
                           f"dev = {dev_rule}, interpolate = test, extrapolate = exact match only")
    for s, probs in splits.items():
        text = "".join(q + "\n" + a + "\n" for q, a in probs)
        cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        ids = np.where(cps < len(lut), lut[np.minimum(cps, len(lut) - 1)], unk)
        qlen = np.array([len(q) for q, _ in probs], dtype=np.int64)
        alen = np.array([len(a) for _, a in probs], dtype=np.int64)
        q0 = np.concatenate([[0], np.cumsum(qlen + alen + 2)[:-1]]).astype(np.int64)[:len(probs)]
        offsets = np.stack([q0, q0 + qlen + 1, q0 + qlen + 1 + alen], axis=1)
        edges = np.zeros(len(ids) + 1, dtype=np.int64)  # mask = answer chars + their "\n"
        np.add.at(edges, offsets[:, 1], 1)
        np.add.at(edges, offsets[:, 2] + 1, -1)
        meta["dtype"] = write_bin(os.path.join(tmp, f"{s}.bin"), ids, len(itos))
        np.cumsum(edges[:-1]).astype(np.uint8).tofile(os.path.join(tmp, f"{s}.mask.bin"))
        np.save(os.path.join(tmp, f"{s}.problems.npy"), offsets)
        meta["splits"][s], meta["n_problems"][s] = int(len(ids)), len(probs)
    return meta


# ----------------------------------------------------------------------------- loading

class Data:
    """A prepared dataset folder (see ``prepare``), memory-mapped read-only.

    Raises UsageError naming the file when meta.json is missing or unparseable, or a token or
    mask file is missing or has the wrong size (n_tokens * itemsize bytes).
    """

    def __init__(self, folder):
        self.folder = folder
        path = os.path.join(folder, "meta.json")
        try:
            with open(path) as f:
                self.meta = json.load(f)
            self.vocab_size, self.tokenizer = int(self.meta["vocab_size"]), self.meta["tokenizer"]
            self.dtype = np.dtype(self.meta["dtype"])
            splits = dict(self.meta["splits"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: missing or unreadable dataset meta ({e}); run prepare again") from None
        if self.dtype != bin_dtype(self.vocab_size) or self.tokenizer not in ("gpt2", "char"):
            raise UsageError(f"{path}: dtype {self.dtype} / tokenizer {self.tokenizer} "
                             f"do not fit vocab_size {self.vocab_size}")
        self.masked = bool(self.meta.get("masked"))
        self.test_split = self.meta.get("test_split", "test")
        for s, n in splits.items():
            files = [(f"{s}.bin", n * self.dtype.itemsize)] + ([(f"{s}.mask.bin", n)] if self.masked else [])
            for fname, size in files:
                p = os.path.join(folder, fname)
                if not os.path.isfile(p) or os.path.getsize(p) != size:
                    raise UsageError(f"{p}: missing or not {size} bytes (meta says {n} tokens); "
                                     "run prepare again")
        self._tok, self._mask, self._enc = {}, {}, None
        if self.tokenizer == "char":
            try:
                self.itos = list(self.meta["itos"])
                self.stoi = {c: i for i, c in enumerate(self.itos[:self.meta["unk_id"]])}
                self.eot = self.stoi["\n"]
            except (KeyError, TypeError, ValueError) as e:
                raise UsageError(f"{path}: a character vocabulary needs itos with a newline and unk_id "
                                 f"({type(e).__name__}: {e}); run prepare again") from None
        else:
            self.eot = EOT

    def _split(self, split):
        if split not in self.meta["splits"]:
            raise UsageError(f"split '{split}' not in {self.folder}; it has {', '.join(self.meta['splits'])}")
        return split

    def tokens(self, split):
        """The split's token ids, shape (n_tokens,), read-only memmap."""
        if split not in self._tok:
            self._tok[split] = read_bin(os.path.join(self.folder, f"{self._split(split)}.bin"),
                                        self.dtype, self.meta["splits"][split])
        return self._tok[split]

    def mask(self, split):
        """uint8 (n_tokens,): 1 where the token counts as a target; None for unmasked datasets."""
        if not self.masked:
            return None
        if split not in self._mask:
            self._mask[split] = read_bin(os.path.join(self.folder, f"{self._split(split)}.mask.bin"),
                                         np.uint8, self.meta["splits"][split])
        return self._mask[split]

    def problems(self, split):
        """int64 (n_problems, 3): [question_start, answer_start, answer_end) token offsets; None if absent."""
        p = os.path.join(self.folder, f"{self._split(split)}.problems.npy")
        return np.load(p) if os.path.exists(p) else None

    def check_block_size(self, block_size, splits=None):
        """UsageError unless every split (default train, dev, test) has >= block_size + 1 tokens."""
        for s in splits or ("train", "dev", self.test_split):
            n = len(self.tokens(s))
            if n < block_size + 1:
                raise UsageError(f"--block_size {block_size} is too large: split '{s}' of {self.folder} "
                                 f"has only {n} tokens (need block_size+1)")

    def train_batch(self, rng, batch_size, block_size):
        """Random windows of the train split: x, y int64 (B, T); starts drawn from ``rng``."""
        n = len(self.tokens("train"))
        return self.window_batch("train", rng.integers(0, n - block_size, size=batch_size), block_size)

    def eval_windows(self, split, block_size, max_windows=None):
        """Start offsets of consecutive non-overlapping windows (T inputs + 1 target) from the start
        of the split, evenly subsampled to at most max_windows. Depends only on its arguments."""
        n_win = max(0, (len(self.tokens(split)) - 1) // block_size)
        k = n_win if max_windows is None else min(n_win, max_windows)
        return (np.arange(k, dtype=np.int64) * n_win // max(k, 1)) * block_size

    def window_batch(self, split, starts, block_size):
        """x = tokens[s : s+T], y = tokens[s+1 : s+T+1] (int64, (B, T)); y = -1 where masked out."""
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(block_size + 1)
        buf = self.tokens(split)[idx].astype(np.int64)
        x, y = buf[:, :-1], buf[:, 1:].copy()
        if self.masked:
            y[self.mask(split)[idx[:, 1:]] == 0] = -1
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)

    def encode(self, text):
        """str -> list of ids (GPT-2: no special tokens; char: unseen chars -> unk_id)."""
        if self.tokenizer == "char":
            return [self.stoi.get(c, self.meta["unk_id"]) for c in text]
        return self._gpt2().encode_ordinary(text)

    def decode(self, ids):
        """list/array of ids -> str."""
        ids = [int(i) for i in ids]
        if self.tokenizer == "char":
            return "".join(self.itos[i] for i in ids)
        return self._gpt2().decode(ids)

    def _gpt2(self):
        if self._enc is None:
            self._enc = gpt2_encoder()
        return self._enc


def unigram_entropy(data, split="dev"):
    """Entropy (nats/token) of the split's own empirical unigram distribution over its counted
    targets (tokens 1..n-1; only mask==1 ones for masked datasets). A model's NLL on the split
    should beat it; it is a slightly optimistic baseline since it is fitted to the split itself."""
    tok = np.asarray(data.tokens(split)[1:])
    if data.masked:
        tok = tok[np.asarray(data.mask(split)[1:]) == 1]
    counts = np.bincount(tok, minlength=data.vocab_size)
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())
