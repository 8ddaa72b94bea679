"""Text datasets to token bins: the part of data.prepare that turns documents (split key, text) into
train/dev/test token files. Files are read as text (_read_text, _file_docs; stdlib and local
paths), tokenized in order by worker processes (GPT-2 BPE ids, or code points for the char
tokenizer), each document whole into its split (data.split_of) or, for a few files, the stream cut
by position, and char tokenization's vocabulary built from the train split (_char_vocab). data.py
keeps what a reader opens it for (prepare's dispatch, the on-disk format, Data serving batches);
this pipeline, shared by the stdlib, local-path and Hugging Face (hf_data.py) datasets, lives here.
"""
import collections
import contextlib
import functools
import itertools
import multiprocessing
import os
import signal
import sys
import threading

import numpy as np

if not __package__:  # run as python harness/x.py, not python -m harness.x: find the project's modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import UsageError
from harness.cli import not_a_command
from harness.token_files import BY_POSITION, CHAR_EOT, EOT, EOT_SYMBOL, bin_dtype, gpt2_encoder, read_bin, split_of


class NotUtf8:
    """What _file_docs found of bytes that are not UTF-8: the files holding some (relative paths),
    how many such bytes (each read as part of a U+FFFD) and how many bytes were read in all."""

    def __init__(self):
        self.files, self.bytes, self.read = [], 0, 0

    def line(self, source):
        """The line said of them: how many files, how many bytes and their share of the bytes read."""
        share = 100 * self.bytes / max(1, self.read)
        share = f"{share:.3g}%" if share >= 0.001 else "under 0.001%"
        return (f"{source}: {len(self.files):,} of them not valid UTF-8: {self.bytes:,} bytes read as U+FFFD, "
                f"{share} of the {self.read:,} bytes read, e.g. {self.files[0]}")


def _read_text(path):
    """(text, bad, size): a file's text, how many of its bytes are not UTF-8 (read as U+FFFD) and
    its size in bytes; text None for a binary file (a NUL byte), "" for one without a single UTF-8
    character (no readable text: dropped as an empty file is). UsageError naming a file that
    cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"--dataset: cannot read {path} ({e.strerror or type(e).__name__}); "
                         "make it readable or move it out of the dataset") from None
    if b"\0" in raw:  # binary
        return None, 0, len(raw)
    try:
        return raw.decode("utf-8"), 0, len(raw)
    except UnicodeDecodeError:
        # surrogateescape keeps each bad byte as one lone surrogate, which encoding with "ignore" drops
        bad = len(raw) - len(raw.decode("utf-8", errors="surrogateescape").encode("utf-8", errors="ignore"))
        return (raw.decode("utf-8", errors="replace") if bad < len(raw) else ""), bad, len(raw)


def _file_docs(root, rels, not_utf8):
    """(relative path, text) per file: the path decides the split. The bytes read, and the files
    with bytes that are not UTF-8 (read as U+FFFD) and those bytes, are counted in not_utf8 (a
    NotUtf8)."""
    for rel in rels:
        text, bad, size = _read_text(os.path.join(root, rel))
        not_utf8.read += size
        if bad:
            not_utf8.files.append(rel)
            not_utf8.bytes += bad
        yield rel, text


# ----------------------------------------------------------------------------- text datasets

def _build_text(tmp, docs, source, rule, by_key_only, tokenizer, max_tokens=0, num_proc=1, count="n_files",
                unit="files", empty="binary, empty or no UTF-8 text", not_utf8=None):
    """Tokenize documents ``(split_key, text)`` in order into train/dev/test bins under ``tmp``.

    A document whose text is None or "" is dropped (a binary or empty file, or one without a
    UTF-8 character; a row whose text is null or empty: `empty` says which). The documents read,
    kept and dropped are printed ("SOURCE: read N UNIT, kept K, dropped D (EMPTY)") and recorded as
    meta[unit] = {"read", "kept", "dropped"} (read: taken from the source; with max_tokens, reading
    stops about a batch after the last token written). not_utf8: the NotUtf8 that _file_docs fills;
    the files with bytes that are not UTF-8, those bytes and their share of the bytes read are
    printed (NotUtf8.line), the files and bytes recorded as meta[unit]["not_utf8"] and
    ["not_utf8_bytes"]. UsageError ("no readable text") when no document is kept.

    Each document is followed by an end-of-text token and goes whole into split_of(split_key)
    (the text itself when split_key is None). With max_tokens, writing stops at exactly that many
    tokens (the last document cut). If dev or test stays empty and by_key_only is False (a single
    file, few files), the token stream (documents in order) is cut by position 90/5/5 instead.
    gpt2: GPT-2 BPE ids. char: the characters of the train split, in code point order, then the
    end-of-text symbol, then the unknown id (decoded as U+FFFD) for characters unseen in train;
    the first pass writes code points (uint32) and ``_char_vocab`` maps them. num_proc: worker
    processes, at most this machine's CPUs (a larger value is lowered, with a note). Returns the
    meta dict.
    """
    from tqdm import tqdm
    cpus = os.cpu_count() or 1
    if num_proc > cpus:  # more workers than CPUs only add processes (and no Pool starts 2**62 of them)
        print(f"note: --num_proc {num_proc}: more than this machine's CPUs ({cpus}); tokenizing with {cpus}", flush=True)
        num_proc = cpus
    if tokenizer == "gpt2":
        gpt2_encoder()  # fails fast (UsageError) without a vocabulary, before any worker starts
    names, ext = ("train", "dev", "test"), ".bin" if tokenizer == "gpt2" else ".cp"
    wide = np.dtype("<u2") if tokenizer == "gpt2" else np.dtype("<u4")
    n_tok, n_docs, order, total = dict.fromkeys(names, 0), dict.fromkeys(names, 0), [], 0
    seen = dict(read=0, kept=0, dropped=0)

    def counted(docs):
        for key, text in docs:
            seen["read"] += 1
            seen["kept" if text else "dropped"] += 1
            if text:
                yield key, text
    with contextlib.ExitStack() as stack:
        out = {s: stack.enter_context(open(os.path.join(tmp, s + ext), "wb")) for s in names}
        bar = stack.enter_context(tqdm(total=max_tokens or None, unit="tok", unit_scale=True, disable=None,
                                       desc=f"tokenizing {source} ({tokenizer}, num_proc {num_proc})"))
        pieces = stack.enter_context(contextlib.closing(_tokenize(counted(docs), tokenizer, num_proc)))
        for split, ids in pieces:
            ids = ids[:max_tokens - total] if max_tokens else ids
            out[split].write(ids.astype(wide).tobytes())
            n_tok[split] += len(ids)
            n_docs[split] += 1
            order.append((split, len(ids)))
            total += len(ids)
            bar.update(len(ids))
            if total == max_tokens:
                break
    print(f"{source}: read {seen['read']:,} {unit}, kept {seen['kept']:,}, dropped {seen['dropped']:,} ({empty})",
          flush=True)
    if not_utf8 is not None and not_utf8.files:
        print(not_utf8.line(source), flush=True)
    if not_utf8 is not None:
        seen.update(not_utf8=len(not_utf8.files), not_utf8_bytes=not_utf8.bytes)
    if not total:
        raise UsageError(f"--dataset {source}: no readable text ({seen['read']:,} {unit} read, all {empty})")
    if min(n_docs.values()) == 0 and not by_key_only:
        n_tok, n_docs, rule = _split_by_position(tmp, ext, wide, order), {"all": len(order)}, BY_POSITION
    meta = dict(tokenizer="gpt2", vocab_size=EOT + 1, dtype="uint16") if tokenizer == "gpt2" \
        else _char_vocab(tmp, n_tok)
    meta.update(splits=n_tok, split_rule=rule, source=source, test_split="test", em_splits=[])
    meta[count] = n_docs
    meta[unit] = seen
    if max_tokens:
        meta.update(max_tokens=max_tokens, truncated=total == max_tokens)
    return meta


def _tokenize(docs, tokenizer, num_proc, batch_chars=1 << 20):
    """Yield (split, token ids incl. the end-of-text marker) per non-empty document, in order.
    Batches of about batch_chars characters go to num_proc worker processes (_pool_context; in
    this process when num_proc <= 1 or the text is one batch, which the workers' start-up would
    only slow down), at most 2 * num_proc batches ahead, so a streamed source is read only as far
    as needed."""
    fn = functools.partial(_tokenize_batch, tokenizer)
    batches = _batches(((k, t) for k, t in docs if t), batch_chars)
    first = list(itertools.islice(batches, 2))
    batches = itertools.chain(first, batches)
    with contextlib.ExitStack() as stack:
        with _stops_held():  # the pool is whole, and in the stack that ends it, before a stop unwinds
            pool = stack.enter_context(_pool(num_proc)) if num_proc > 1 and len(first) > 1 else None
        for splits, lengths, flat in _ordered_map(pool, fn, batches, ahead=2 * num_proc) if pool else map(fn, batches):
            yield from zip(splits, np.split(flat, np.cumsum(lengths)[:-1]))


@contextlib.contextmanager
def _pool(num_proc):
    """A pool of num_proc workers (_pool_context) that is closed and joined when the body ends, however
    it ends: the batches already given to it (at most _ordered_map's `ahead`) finish first. A stop
    that ended the body by Pool.terminate hung: its task-handler thread, writing a batch larger than
    the pipe after terminate had drained it once, waited forever for workers it had killed."""
    with _pool_context().Pool(num_proc) as pool:
        try:
            yield pool
        finally:
            pool.close()
            pool.join()


def _pool_context():
    """The workers' start method: forkserver (spawn where there is none), not fork. A process forked
    from this one inherits its threads' held locks (torch's, tqdm's monitor) and its SIGTERM handler
    (harness.cli.run_command), so a worker could hang at start and then ignore the pool's SIGTERM at its
    end, and the preparation with it."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


@contextlib.contextmanager
def _stops_held(signals=(signal.SIGTERM, signal.SIGINT)):
    """SIGTERM and Ctrl-C held back while the body runs (in the main thread), then delivered to the
    handlers it found. A stop that raised inside Pool() left its workers unterminated (one being
    started by the forkserver was not even known to the pool): they outlived this process's exit,
    which removes the pool's named semaphores, and each printed a FileNotFoundError traceback from
    SemLock._rebuild (likely on a loaded machine, where starting a worker takes long)."""
    found = {s: signal.getsignal(s) for s in signals}
    if threading.current_thread() is not threading.main_thread() or None in found.values():
        yield  # only the main thread sets handlers; None: one set outside Python, which cannot be put back
        return
    held = []
    for s in signals:
        signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for s, handler in found.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):
            signal.raise_signal(s)  # the handler found (run_command's SIGTERM: Terminated) takes it now


def _batches(docs, batch_chars):
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _ordered_map(pool, fn, items, ahead):
    """pool.imap without reading items more than `ahead` results ahead of the consumer."""
    pending = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _tokenize_batch(tokenizer, batch):
    """Worker: [(split_key, text)] -> (splits, lengths, all ids concatenated as uint32).
    gpt2: BPE ids + <|endoftext|>; char: Unicode code points + CHAR_EOT."""
    if tokenizer == "gpt2":
        enc, eot = gpt2_encoder(), EOT
        ids = [np.array(x, np.uint32) for x in enc.encode_ordinary_batch([t for _, t in batch], num_threads=1)]
    else:
        eot = CHAR_EOT
        ids = [np.frombuffer(t.encode("utf-32-le", "replace"), "<u4") for _, t in batch]
    splits = [split_of(t if key is None else key) for key, t in batch]
    return splits, [len(x) + 1 for x in ids], np.concatenate([np.append(x, np.uint32(eot)) for x in ids])


def _split_by_position(tmp, ext, wide, order):
    """Rewrite the split files as the document stream (in order) cut 90/5/5; returns the counts."""
    arrays = {s: np.fromfile(os.path.join(tmp, s + ext), wide) for s in ("train", "dev", "test")}
    at, parts = dict.fromkeys(arrays, 0), []
    for s, n in order:
        parts.append(arrays[s][at[s]:at[s] + n])
        at[s] += n
    stream = np.concatenate(parts)
    a, b = int(len(stream) * 0.90), int(len(stream) * 0.95)
    for s, piece in dict(train=stream[:a], dev=stream[a:b], test=stream[b:]).items():
        piece.tofile(os.path.join(tmp, s + ext))
    return dict(train=a, dev=b - a, test=len(stream) - b)


def _char_vocab(tmp, n_tok, chunk=1 << 24):
    """Map the code-point files <split>.cp to <split>.bin with the train split's characters
    (plus the newline, always) as the vocabulary; returns the tokenizer part of the meta."""
    counts = np.zeros(CHAR_EOT + 1, np.int64)
    train = read_bin(os.path.join(tmp, "train.cp"), "<u4")
    for i in range(0, len(train), chunk):
        counts += np.bincount(train[i:i + chunk], minlength=CHAR_EOT + 1)
    counts[ord("\n")] += 1
    cps = np.flatnonzero(counts[:CHAR_EOT])
    itos = [chr(c) for c in cps] + [EOT_SYMBOL, "\ufffd"]
    eot_id, unk = len(cps), len(cps) + 1
    lut = np.full(CHAR_EOT + 1, unk, np.int64)
    lut[cps], lut[CHAR_EOT] = np.arange(len(cps)), eot_id
    dtype = bin_dtype(len(itos))
    for s in n_tok:
        src = read_bin(os.path.join(tmp, f"{s}.cp"), "<u4")
        with open(os.path.join(tmp, f"{s}.bin"), "wb") as f:
            for i in range(0, len(src), chunk):
                f.write(lut[src[i:i + chunk]].astype(dtype.newbyteorder("<")).tobytes())
        del src
        os.remove(os.path.join(tmp, f"{s}.cp"))
    return dict(tokenizer="char", vocab_size=len(itos), dtype=dtype.name, itos=itos, unk_id=unk, eot_id=eot_id)


if __name__ == "__main__":  # a part of another command: say which, instead of exiting silently
    not_a_command("harness/text_data.py", "python data.py --dataset PATH (python data.py --help)")
