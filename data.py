"""Datasets: tokenize once to flat token files, then serve training batches and eval windows.

    python data.py --dataset stdlib [--tokenizer char]   # prepare, print the token counts

The TANGO paper ("TANGO: Treating Tokens as Operators", section 3) trains on FineWeb-Edu, The
Stack, Lean and DeepMind Mathematics. Here: ``stdlib`` (the Python standard library's ``*.py``
files, split by file: a code corpus in the spirit of The Stack), ``dmmath`` (DeepMind Mathematics,
dmmath.py), a path to a text file or folder (split by file), and ``hf:NAME[:CONFIG]`` (a Hugging
Face dataset, hf_data.py, split by document). Text datasets (all but dmmath) take either
tokenizer: ``gpt2`` (BPE, default) or ``char`` (the train split's characters + end-of-text + an
unknown id).

``prepare`` writes ``<out_root>/<name>/``: one ``<split>.bin`` per split (raw uint16 token ids,
uint32 if the vocabulary is larger than 65536), ``meta.json`` and, for masked datasets,
``<split>.mask.bin`` (uint8, 1 = the token counts as a target) and ``<split>.problems.npy``.
``Data`` memory-maps such a folder and ``check_data`` checks it against its meta.json (train.py
and this command run it on every folder they use). Bad input raises ``common.UsageError`` (one
line, exit 2).
Text documents become token files in text_data.py (reading, tokenizing in worker processes, the
char vocabulary), shared by the stdlib, local-path and Hugging Face datasets.
"""
import argparse
import contextlib
import errno
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile

import numpy as np
import torch

from common import UsageError
from harness.cli import (INT64_RANGE, UsageParser, check_output_folder, disk_full, owner_tag, remove_orphans,
                         run_command)
from harness import text_data
from harness.token_files import (  # noqa: F401 (callers read them as data.X)
    BY_FILE, BY_POSITION, EOT, _download_gpt2, _fingerprint, _try, _walk, bin_dtype, gpt2_encoder, read_bin,
    split_of, write_bin)

TOKENIZERS = ("auto", "gpt2", "char")

# ----------------------------------------------------------------------------- prepare

def is_path(dataset):
    """True when --dataset names a text file or folder (anything but stdlib, dmmath and hf:NAME),
    whether or not it exists here: the rule prepare() dispatches by."""
    return dataset not in ("stdlib", "dmmath") and not dataset.startswith("hf:")


def local_path(dataset):
    """(PATH, REST) for a --dataset that may name a local file or folder: (dataset, "") for a path,
    (NAME, ":CONFIG" or "") for hf:NAME[:CONFIG] (NAME may be a hub id); None for stdlib and dmmath."""
    if is_path(dataset):
        return dataset, ""
    if dataset.startswith("hf:"):
        name, sep, config = dataset[3:].partition(":")
        return name, sep + config
    return None


def absolute_paths(dataset, hf_data_files):
    """--dataset and --hf_data_files with every local path made absolute (a dataset path, hf:PATH's
    PATH, each comma-separated --hf_data_files entry that matches files here), so a checkpoint's
    flags name the same data from any folder (--resume, --eval_only). Hub ids, stdlib, dmmath and
    paths not found here are returned as given. Returns (dataset, hf_data_files)."""
    local = local_path(dataset)
    if local and local[0] and os.path.exists(local[0]):
        dataset = ("hf:" if dataset.startswith("hf:") else "") + os.path.abspath(local[0]) + local[1]
    if hf_data_files:
        hf_data_files = ",".join(os.path.abspath(f) if f and glob.glob(f, recursive=True) else f
                                 for f in hf_data_files.split(","))
    return dataset, hf_data_files


def check_outside_dataset(dataset, flag, folder):
    """UsageError when folder (--data_root, --out_dir) is the --dataset folder or inside it: every
    file under a dataset folder is training text, so a run's logs and prepared bins would become
    training data (and change the data a checkpoint records)."""
    if not (is_path(dataset) and os.path.isdir(dataset)):
        return
    inside, outer = os.path.realpath(folder), os.path.realpath(dataset)
    if os.path.commonpath([inside, outer]) == outer:
        raise UsageError(f"--{flag} {folder}: inside --dataset {dataset}, whose every file is training text; "
                         f"give a --{flag} outside it")


def check_dataset(dataset):
    """UsageError for a --dataset that is none of stdlib, dmmath, hf:NAME[:CONFIG] or a path that
    exists here; cheap (reads nothing), so a command can check its datasets before any work."""
    if is_path(dataset) and not os.path.exists(dataset):
        raise UsageError(f"--dataset: unknown dataset '{dataset}'; "
                         "use stdlib, dmmath, a path to a text file or folder, or hf:NAME[:CONFIG]")


def check_splits(meta, dataset, max_tokens=0):
    """UsageError naming the first split of meta["splits"] without tokens (train.py needs at least
    block_size + 1 in train, dev and the test split): with max_tokens, the cut that left it empty."""
    empty = [s for s, n in meta["splits"].items() if n == 0]
    if not empty:
        return
    counts = ", ".join(f"{k} {v:,}" for k, v in meta["splits"].items())
    if max_tokens:
        raise UsageError(f"--max_tokens {max_tokens}: split '{empty[0]}' got no tokens ({counts}); the source's "
                         f"first {max_tokens:,} tokens are too few for every split (raise --max_tokens)")
    raise UsageError(f"--dataset {dataset}: split '{empty[0]}' got no tokens ({counts}); every split needs text "
                     "(train.py trains on train, selects on dev and reports test)")


def prepare(dataset="stdlib", data_dir=None, out_root="data", tokenizer="auto", max_tokens=0, num_proc=1,
            hf_split="train", hf_text_field="text", hf_split_key="auto", hf_data_files=None,
            allow_empty_splits=True):
    """Tokenize ``dataset`` once into ``<out_root>/<name>/`` and return that folder.

    dataset: "stdlib", "dmmath", a path to a text file / folder of text files, or
    "hf:NAME[:CONFIG]" (a Hugging Face dataset, see hf_data.py; the ``hf_*`` arguments).
    tokenizer: "gpt2", "char" or "auto" (char for dmmath, gpt2 otherwise).
    data_dir: the dmmath folder (default ../shared/data/dmmath next to this repo).
    max_tokens: keep only the first N tokens of the source, all splits together (0: all); num_proc: workers.
    A complete folder whose meta matches the sources (path, sizes, mtimes; for the hub: the
    arguments) is reused as is; otherwise everything is written into a temporary sibling folder
    and renamed into place, so a failed or interrupted prepare leaves nothing half-written (and
    removes out_root again if it created it); a read-only out_root serves a dataset prepared there
    and is refused, before any tokenizing, for one that is not. Raises UsageError for bad input, and for a device
    that fills up while writing (one line naming the folder: _full_disk). A split that got no
    tokens is kept with allow_empty_splits (train.py then names it and --max_tokens:
    Data.check_block_size); without, it is a UsageError and nothing is written (check_splits; the
    command lines of data.py and tools.sweep).
    """
    if tokenizer not in TOKENIZERS:
        raise UsageError(f"--tokenizer {tokenizer}: choose one of {', '.join(TOKENIZERS)}")
    if dataset == "dmmath" and tokenizer == "gpt2":
        raise UsageError("--tokenizer gpt2: dmmath is read as characters; choose auto or char")
    if tokenizer == "auto":
        tokenizer = "char" if dataset == "dmmath" else "gpt2"
    if data_dir is not None and dataset != "dmmath":
        raise UsageError("--data_dir: only used with --dataset dmmath")
    if max_tokens < 0:
        raise UsageError(f"--max_tokens {max_tokens}: must be >= 0 (0: every token)")
    if max_tokens and dataset == "dmmath":
        raise UsageError(f"--max_tokens {max_tokens}: not used with --dataset dmmath (dmmath is prepared whole)")
    if num_proc < 1:
        raise UsageError(f"--num_proc {num_proc}: must be >= 1")
    if not dataset.startswith("hf:"):  # the hub options would be silently ignored
        given = dict(hf_split=hf_split != "train", hf_text_field=hf_text_field != "text",
                     hf_split_key=hf_split_key != "auto", hf_data_files=bool(hf_data_files))
        for flag in (f for f, on in given.items() if on):
            raise UsageError(f"--{flag}: only used with --dataset hf:NAME")
    suffix = ("-char" if tokenizer == "char" else "") + (f"-max{max_tokens}" if max_tokens else "")
    text = dict(tokenizer=tokenizer, max_tokens=max_tokens, num_proc=num_proc)
    not_utf8 = text_data.NotUtf8()  # the bytes that are not UTF-8 and the files holding them (_file_docs)
    if dataset == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        rels = _walk(root, keep=lambda r: r.endswith(".py"), skip_dir=lambda n: n == "site-packages")
        name, fp = "stdlib" + suffix, _fingerprint(root, rels, dataset, tokenizer, max_tokens)
        build = lambda tmp: text_data._build_text(tmp, text_data._file_docs(root, rels, not_utf8), "stdlib", BY_FILE,
                                                  by_key_only=True, not_utf8=not_utf8, **text)
    elif dataset == "dmmath":
        from harness import dmmath
        root, rels, name = dmmath.source(data_dir)
        fp, build = _fingerprint(root, rels, dataset), lambda tmp: dmmath.build(tmp, root)
    elif dataset.startswith("hf:"):
        from harness import hf_data  # the optional `datasets` extra: only on this path
        hf = hf_data.spec(dataset, hf_split, hf_text_field, hf_split_key, hf_data_files)
        fp = _fingerprint(os.sep, hf["local_files"], repr(sorted(hf.items())), tokenizer, max_tokens)
        name = hf_data.folder_name(hf) + suffix + "-" + fp[:8]
        build = lambda tmp: hf_data.build(tmp, hf, **text)
    elif os.path.exists(dataset):
        check_outside_dataset(dataset, "data_root", out_root)
        path = os.path.realpath(dataset)  # one folder, one prepared copy, however the path is spelled
        if os.path.isdir(path):
            root, rels = path, _walk(path)
        else:
            root, rels = os.path.dirname(path), [os.path.basename(path)]
        if not rels:
            raise UsageError(f"--dataset {dataset}: no files in this folder")
        name = os.path.basename(path.rstrip(os.sep)) + "-" + hashlib.sha256(os.fsencode(path)).hexdigest()[:8] + suffix
        fp = _fingerprint(root, rels, "path", tokenizer, max_tokens)
        build = lambda tmp: text_data._build_text(tmp, text_data._file_docs(root, rels, not_utf8), path, BY_FILE,
                                                  by_key_only=False, not_utf8=not_utf8, **text)
    else:
        check_dataset(dataset)

    folder = os.path.join(out_root, name)
    if _matches(folder, fp):  # read only: a read-only --data_root with the dataset prepared serves
        if not allow_empty_splits:
            check_splits(Data(folder).meta, dataset, max_tokens)
        return folder
    check_output_folder("--data_root", out_root)  # before any tokenizing
    with _full_disk(folder):  # a write that found the device full: one line, the earlier state kept
        created = _first_missing(out_root)
        os.makedirs(out_root, exist_ok=True)
        for kind in ("tmp", "old"):  # what a killed preparation of this folder left
            remove_orphans(out_root, f".{name}.{kind}-", random_suffix=True)
        tmp, old = tempfile.mkdtemp(prefix=f".{name}.tmp-{owner_tag()}-", dir=out_root), None  # (remove_orphans)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            meta = build(tmp)
            if not allow_empty_splits:  # before the rename: a refused folder is never in place
                check_splits(meta, dataset, max_tokens)
            meta["fingerprint"] = fp
            # checkpoints record it
            meta["sha256"] = {s: sha256_file(os.path.join(tmp, f"{s}.bin")) for s in meta["splits"]}
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
            for attempt in range(10):  # other processes may be replacing the same stale folder at once
                try:
                    os.replace(tmp, folder)  # fails when folder exists: a stale one, or one another process prepared
                    break
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    if _matches(folder, fp):  # another process prepared the same tokens meanwhile: keep its folder
                        shutil.rmtree(tmp, ignore_errors=True)
                        break
                    old = old or tempfile.mkdtemp(prefix=f".{name}.old-{owner_tag()}-", dir=out_root)
                    moved = os.path.join(old, f"{name}-{attempt}")
                    try:
                        os.replace(folder, moved)  # the stale folder out of the way
                    except FileNotFoundError:  # another process moved it first: try again
                        continue
                    if _matches(moved, fp):  # it was another process's fresh one, put in place since the check
                        with contextlib.suppress(OSError):  # (unless a third one is in place by now)
                            os.replace(moved, folder)
                        shutil.rmtree(tmp, ignore_errors=True)
                        break
            else:
                raise OSError(f"{folder}: could not replace it (other processes kept writing it); "
                              "delete it and run again")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if created and not any(files for _, _, files in os.walk(created)):
                shutil.rmtree(created, ignore_errors=True)
            raise
        finally:
            if old:
                shutil.rmtree(old, ignore_errors=True)
    print(f"prepared {folder}: " + ", ".join(f"{k} {v:,}" for k, v in meta["splits"].items()) + " tokens",
          flush=True)
    return folder


@contextlib.contextmanager
def _full_disk(folder):
    """UsageError naming folder when the body's writing finds no space left on the device
    (harness.cli.disk_full, numpy's messages too), after the body's own cleanup: nothing of the
    preparation is left, an earlier folder is as it was."""
    try:
        yield
    except OSError as e:
        if disk_full(e, folder) is None:
            raise
        raise UsageError(f"{folder}: no space left on device while preparing it; nothing of it was written (an "
                         "earlier copy, if any, is as it was); free some space or give a --data_root on another "
                         "disk") from None


def _first_missing(path):
    """The outermost folder that os.makedirs(path) would create (None if path exists)."""
    path, top = os.path.abspath(path), None
    while not os.path.exists(path):
        path, top = os.path.dirname(path), path
    return top


def _matches(folder, fp):
    try:
        return Data(folder).meta.get("fingerprint") == fp
    except UsageError:
        return False


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
                self.eot = int(self.meta["eot_id"]) if "eot_id" in self.meta else self.stoi["\n"]  # dmmath: "\n"
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
                cut = self.meta.get("max_tokens")
                hint = (f"; --max_tokens {cut} kept the source's first {cut:,} tokens, too few for every split "
                        "(raise it)") if cut else ""
                raise UsageError(f"--block_size {block_size} is too large: split '{s}' of {self.folder} "
                                 f"has only {n} tokens (need block_size+1){hint}")

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


def check_data(data, chunk=1 << 24):
    """UsageError unless the prepared files agree with meta.json: the splits train, dev and the test
    split exist, each split's bin has meta.json's SHA-256 (a byte changed after preparation), every
    token id is < vocab_size, masks are 0/1, problem offsets lie inside their split. Reads every
    token twice (the hash, the id range: about 0.5 GB/s together)."""
    meta, where = data.meta, os.path.join(data.folder, "meta.json")
    again = f"delete {data.folder} to prepare it again"
    splits = meta["splits"]
    needed = ["train", "dev", data.test_split] + list(meta.get("em_splits", []))
    missing = [s for s in needed if s not in splits]
    if missing:
        raise UsageError(f"{where}: no split {', '.join(missing)} (it has {', '.join(splits)}); {again}")
    if data.tokenizer == "char" and len(meta.get("itos", [])) != data.vocab_size:
        raise UsageError(f"{where}: itos has {len(meta.get('itos', []))} symbols, vocab_size is {data.vocab_size}")
    digests = meta.get("sha256", {})  # (folders prepared before it was recorded have none)
    for s, n in splits.items():
        path = os.path.join(data.folder, s + ".bin")
        if s in digests and sha256_file(path) != digests[s]:
            raise UsageError(f"{path}: its SHA-256 is not meta.json's (the file changed after it was prepared); {again}")
        tok = data.tokens(s)
        top = max((int(tok[i:i + chunk].max()) for i in range(0, n, chunk)), default=-1)
        if top >= data.vocab_size:
            raise UsageError(f"{os.path.join(data.folder, s + '.bin')}: token id {top} >= vocab_size "
                             f"{data.vocab_size} of meta.json; {again}")
        mask = data.mask(s)
        if mask is not None and max((int(mask[i:i + chunk].max()) for i in range(0, n, chunk)), default=0) > 1:
            raise UsageError(f"{os.path.join(data.folder, s + '.mask.bin')}: values other than 0/1; {again}")
        check_problems(data, s, n, again)


def check_problems(data, split, n, again):
    """UsageError unless <split>.problems.npy (if any) holds (question, answer, end) offsets
    0 <= q <= a <= e <= n."""
    path = os.path.join(data.folder, f"{split}.problems.npy")
    if not os.path.exists(path):
        return
    try:
        p = data.problems(split)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise UsageError(f"{path}: unreadable ({type(e).__name__}); {again}") from None
    ok = p.ndim == 2 and p.shape[1] == 3 and np.issubdtype(p.dtype, np.integer)
    if ok and len(p):
        ok = bool((p[:, 0] >= 0).all() and (p[:, 0] <= p[:, 1]).all() and (p[:, 1] <= p[:, 2]).all()
                  and (p[:, 2] <= n).all())
    if not ok:
        raise UsageError(f"{path}: problem offsets do not fit the split's {n} tokens; {again}")


def target_counts(data, split, chunk=1 << 24):
    """How often each token id is a counted target of split (tokens 1..n-1; only mask==1 ones for
    masked datasets), (vocab_size,) int64; read in chunks, so a split need not fit in memory."""
    tok, mask = data.tokens(split), data.mask(split) if data.masked else None
    counts = np.zeros(data.vocab_size, dtype=np.int64)
    for i in range(1, len(tok), chunk):
        part = np.asarray(tok[i:i + chunk])
        counts += np.bincount(part if mask is None else part[np.asarray(mask[i:i + chunk]) == 1],
                              minlength=data.vocab_size)
    return counts


def unigram_entropy(data, split="dev"):
    """Entropy (nats/token) of the split's own empirical unigram distribution over its counted
    targets (target_counts): how predictable the whole split is from token frequencies alone.
    The baseline for an NLL on evaluation windows is unigram_nll."""
    counts = target_counts(data, split)
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())


def unigram_nll(data, split, starts, block_size, chunk=1 << 24):
    """The NLL (nats/token) of a unigram model on the scored targets of split's windows at starts
    (Data.window_batch: the targets a model's NLL on those windows averages, evaluation.evaluate):
    the baseline that NLL must beat. The unigram is fitted on train's counted targets, add-one
    smoothed over the vocabulary, so every token has a probability and the split is not peeked at.
    nan when the windows score no target."""
    counts = target_counts(data, "train", chunk)
    log_p = np.log((counts + 1) / (counts.sum() + data.vocab_size))
    _, y = data.window_batch(split, starts, block_size)
    y = y.numpy()[y.numpy() != -1]
    return float(-log_p[y].mean()) if y.size else math.nan


# ----------------------------------------------------------------------------- command line

def add_arguments(add):
    """The data flags, shared by data.py's and train.py's command lines; add: a parser's add_argument."""
    add("--dataset", default="stdlib", help="stdlib, dmmath, a path to a text file or folder, or hf:NAME[:CONFIG] "
        "(a Hugging Face hub dataset, a save_to_disk folder, or json/csv/parquet/text with --hf_data_files)")
    add("--tokenizer", default="auto", choices=TOKENIZERS,
        help="gpt2 (BPE) or char (the train split's characters + an unknown id); auto: char for dmmath and for "
        "train.py's cpu tier, else gpt2")
    add("--data_dir", default=None,  # %(default).0s: the help names the real default, not None
        help="dmmath: folder in the official layout (when not given: ../shared/data/dmmath beside this repo)%(default).0s")
    add("--data_root", default="data", help="where prepared token bins are cached")
    add("--max_tokens", type=_count, default=0, help="keep the first N tokens of the source, all splits "
        "together (e.g. 1.7e9); 0: all")
    add("--num_proc", type=int, default=os.cpu_count() or 1, help="tokenizer worker processes for text "
        "datasets (at most this machine's CPUs; dmmath's characters are tokenized in one); default: this "
        "machine's CPU count")
    add("--hf_split", default="train", help="hf: the source split to read (this repo splits it by document)")
    add("--hf_text_field", default="text", help="hf: the column holding each document's text")
    add("--hf_split_key", default="auto", help="hf: column whose value picks the split; equal values share one "
        "(e.g. dump: FineWeb-Edu by crawl date); text: the text; auto: id if present, else the text")
    add("--hf_data_files", default=None, help="hf: data files or globs, comma-separated; several are read "
        "interleaved, one document each in turn")


def sha256_file(path):
    """The SHA-256 of a file, read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 24), b""):
            h.update(piece)
    return h.hexdigest()


def _count(s):
    """A token count: 1500000000, 1_500_000_000 or 1.5e9, below 2**63 (every flag's int64 range;
    1e30 named the data folder with the float's rounding error). Written out, exactly that number."""
    t = s.replace("_", "")
    v = _try(int, t)
    if not isinstance(v, int):
        f = _try(float, t)
        v = int(f) if isinstance(f, float) and math.isfinite(f) and f == int(f) else -1
    if not 0 <= v <= INT64_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{s!r} is not a whole number from 0 to 2**63 - 1 "
                                         "(e.g. 1500000000 or 1.5e9)")
    return v


def flag_options(args):
    """prepare()'s keyword arguments from the flags of add_arguments (--dataset, --data_dir and
    --data_root are its positional ones)."""
    return {k: getattr(args, k) for k in ("tokenizer", "max_tokens", "num_proc", "hf_split", "hf_text_field",
                                          "hf_split_key", "hf_data_files")}


def main(argv=None):
    """python data.py --dataset NAME ...: prepare the dataset (or find it prepared) and print its
    folder, tokenizer and token counts per split. Bad input: one line on stderr, exit code 2."""
    p = UsageParser(prog="data.py", description="Tokenize a dataset once into <data_root>/<name>/{<split>.bin, meta.json}.")
    add_arguments(p.add_argument)
    try:
        args = p.parse_args(argv)
        check_output_folder("--data_root", args.data_root, probe=False)  # prepare probes it before writing
        d = Data(prepare(args.dataset, args.data_dir, args.data_root, **flag_options(args), allow_empty_splits=False))
        check_data(d)  # a folder prepared earlier may have changed since
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{d.folder}: {d.tokenizer} vocab {d.vocab_size}, "
          + ", ".join(f"{k} {v:,}" for k, v in d.meta["splits"].items()) + " tokens")
    print(f"source {d.meta['source']}; split {d.meta['split_rule']}")


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--max_tokens",)


if __name__ == "__main__":
    run_command(main, sizes=SIZE_FLAGS)
