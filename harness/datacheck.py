"""The data side of train.py's set-up: prepare the dataset once (rank 0 under torchrun), check the
prepared files against their meta.json (data.check_data), and the data signature a checkpoint
must agree with.

Every problem is a one-line UsageError naming the file and saying how to fix it (exit code 2).
"""
import datetime

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
    data_mod.check_data(data)
    data.check_block_size(args.block_size)
    return data


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
