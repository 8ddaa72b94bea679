"""Token files: the GPT-2 and char tokenizers' constants, the GPT-2 encoder, the raw ``.bin`` format
and the split rule, shared by data.py and the dataset sources (text_data, dmmath, hf_data).
Bad input raises ``common.UsageError`` (one line, exit 2)."""
import base64
import hashlib
import os
import threading

import numpy as np

from common import UsageError

FORMAT = 1  # bump when the on-disk layout changes; stale folders are then re-prepared
EOT = 50256
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NO_VOCAB = ("no GPT-2 vocabulary: set GPT2_BPE_FILE=/path/to/gpt2.tiktoken "
            "(e.g. ../shared/data/gpt2.tiktoken) or allow tiktoken to download it")
EOT_SYMBOL = "<|endoftext|>"  # the end-of-text symbol of both tokenizers (GPT-2 id 50256)
CHAR_EOT = 0x110000  # char tokenization's end-of-document marker in code-point space (past Unicode)
BY_FILE = "by file: sha256(relative path)[:8] as int % 100 <90 train, <95 dev, else test"
BY_POSITION = ("by position: too few files to split by file, so the concatenated token stream "
               "(files in path order) is cut 90% train / 5% dev / 5% test")

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
    h = int(hashlib.sha256(os.fsencode(relpath)).hexdigest()[:8], 16) % 100  # a name's bytes, UTF-8 or not
    return "train" if h < dev else "dev" if h < test else "test"


def _fingerprint(root, relpaths, *extra):
    """Hash of (path, size, mtime) of the sources: a reused folder must match it."""
    h = hashlib.sha256(repr((FORMAT, os.path.abspath(root)) + extra).encode("utf-8", "surrogateescape"))
    for rel in relpaths:
        st = os.stat(os.path.join(root, rel))
        h.update(os.fsencode(rel) + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _walk(root, keep=lambda rel: True, skip_dir=lambda name: False):
    """Sorted relative paths of the regular, non-hidden files under root; UsageError naming a
    folder under it that cannot be listed (os.walk would skip it, and its files, silently)."""
    def unreadable(e):
        raise UsageError(f"--dataset: cannot list the folder {e.filename} ({e.strerror}); "
                         "make it readable or move it out of the dataset")
    out = []
    for d, dirs, files in os.walk(root, onerror=unreadable):
        dirs[:] = [x for x in dirs if not x.startswith(".") and not skip_dir(x)]
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if not f.startswith(".") and os.path.isfile(os.path.join(d, f)) and keep(rel):
                out.append(rel)
    return sorted(out)
