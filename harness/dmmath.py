"""DeepMind Mathematics for data.py: the official layout, a character vocabulary, loss on the answers.

The TANGO paper ("TANGO: Treating Tokens as Operators", section 3) trains on it with a character
vocabulary built from the training data, selects checkpoints on the dev split, reports test NLL
on ``interpolate`` and exact match on ``interpolate`` and ``extrapolate``. The official release
("Analysing Mathematical Reasoning Abilities of Neural Models", arXiv 1904.01557) has one folder
per split with one ``<module>.txt`` per module: question and answer on alternate lines.
"""
import hashlib
import os

import numpy as np

from harness import token_files
from common import UsageError
from harness.cli import check_not_empty

REQUIRED = ("train-easy", "train-medium", "train-hard", "interpolate", "extrapolate")
DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "dmmath")


def source(data_dir=None):
    """(root, relative paths of its problem files, prepared folder name) of a dmmath folder
    (default: ../shared/data/dmmath next to this repo). UsageError unless the layout is there."""
    check_not_empty("--data_dir", data_dir, "the DeepMind Mathematics folder")
    # one folder, one fingerprint, however the path is spelled
    root = os.path.realpath(DEFAULT if data_dir is None else data_dir)
    missing = [d for d in REQUIRED if not os.path.isdir(os.path.join(root, d))]
    if missing:
        raise UsageError(f"--data_dir {root}: not a DeepMind Mathematics folder; needs "
                         f"{', '.join(REQUIRED)} (+ optional dev), missing {', '.join(missing)}")
    rels = token_files._walk(root, keep=lambda r: r.endswith(".txt") and r.split(os.sep)[0] in REQUIRED + ("dev",))
    default = os.path.samefile(root, DEFAULT) if os.path.isdir(DEFAULT) else False
    return root, rels, "dmmath" if default else "dmmath-" + hashlib.sha256(os.fsencode(root)).hexdigest()[:8]


def _read_problems(path):
    """[(question, answer)] of a module file; UsageError naming the file when it is not UTF-8 (a
    byte read as U+FFFD would change a question or its answer) or its lines do not pair up."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); the "
                         "DeepMind Mathematics files are UTF-8 text") from None
    lines = [line.rstrip("\r") for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 2:
        raise UsageError(f"{path}: malformed, {len(lines)} lines (needs question/answer line pairs)")
    return list(zip(lines[0::2], lines[1::2]))


def build(tmp, root):
    """Character-level DeepMind Mathematics with a loss mask on the answers (see module doc)."""
    def folder(d):
        return [p for f in sorted(os.listdir(os.path.join(root, d))) if f.endswith(".txt")
                for p in _read_problems(os.path.join(root, d, f))]

    train = [p for d in REQUIRED[:3] for p in folder(d)]
    if os.path.isdir(os.path.join(root, "dev")):
        dev, dev_rule = folder("dev"), "dev/ folder"
    else:
        held = [token_files.split_of(q + "\n" + a, dev=98, test=100) == "dev" for q, a in train]
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
        meta["dtype"] = token_files.write_bin(os.path.join(tmp, f"{s}.bin"), ids, len(itos))
        np.cumsum(edges[:-1]).astype(np.uint8).tofile(os.path.join(tmp, f"{s}.mask.bin"))
        np.save(os.path.join(tmp, f"{s}.problems.npy"), offsets)
        meta["splits"][s], meta["n_problems"][s] = int(len(ids)), len(probs)
    return meta
