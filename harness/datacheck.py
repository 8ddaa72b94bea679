"""The data side of train.py's set-up: prepare the dataset once (rank 0 under torchrun), check the
prepared files against their meta.json, and the data signature a checkpoint must agree with.

Every problem is a one-line UsageError naming the file and saying how to fix it (exit code 2).
"""
import datetime
import os

import numpy as np
import torch.distributed as tdist

import data as data_mod
from common import UsageError

PREPARE_TIMEOUT = datetime.timedelta(hours=24)  # how long other ranks wait for rank 0 to prepare the data


def load_data(args, dist):
    """Prepare and validate the dataset of the flags; returns data.Data. Under DDP rank 0 prepares
    it and sends the folder (or its error) to the others, which wait up to PREPARE_TIMEOUT, so no
    two processes write the same folder; the folder must then be on a file system all ranks see
    (always so with --standalone)."""
    folder = error = None
    # the wait runs over gloo with a long timeout (NCCL's 10-minute watchdog would abort the waiting
    # ranks); the group is made before rank 0 prepares, as making it is a collective too
    group = tdist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT) if dist.ddp else None
    if dist.main:
        try:
            folder = data_mod.prepare(args.dataset, args.data_dir, args.data_root, **data_mod.flag_options(args))
        except UsageError as e:
            error = str(e)
    if dist.ddp:
        box = [folder, error]
        tdist.broadcast_object_list(box, src=0, group=group)
        folder, error = box
    if error is not None:
        raise UsageError(error)
    data = data_mod.Data(folder)
    check_data(data)
    data.check_block_size(args.block_size)
    return data


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
        if s in digests and data_mod.sha256_file(path) != digests[s]:
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


def data_signature(data):
    """What a checkpoint must agree with the data on: tokenizer, vocabulary (the symbols of a
    character vocabulary), the token count of each split and, for data prepared since meta.json
    records it, each split's SHA-256 (data.prepare), so equal sizes of other text do not pass."""
    sig = {"tokenizer": data.tokenizer, "vocab_size": data.vocab_size,
           "splits": {k: int(v) for k, v in data.meta["splits"].items()}}
    if data.tokenizer == "char":
        sig["itos"] = list(data.meta["itos"])
    if "sha256" in data.meta:
        sig["sha256"] = dict(data.meta["sha256"])
    return sig


def same_data(saved, data):
    """True when a checkpoint's data signature (saved) is that of data; the SHA-256s count when both
    have them (a checkpoint or a prepared folder without that record has none)."""
    now = data_signature(data)
    if not (isinstance(saved, dict) and "sha256" in saved and "sha256" in now):
        saved = {k: v for k, v in saved.items() if k != "sha256"} if isinstance(saved, dict) else saved
        now.pop("sha256", None)
    return saved == now
