"""Checkpoints and --resume for train.py: writing, reading, validating and restoring.

<out_dir>/ckpt_latest.pt (every evaluation) and <out_dir>/ckpt_best.pt (lowest dev NLL so far) are
written to a temporary file, flushed to disk and renamed into place (save_atomic), so a crash
leaves the previous file whole. They hold plain types and CPU tensors only, so
``torch.load(path, weights_only=True, map_location="cpu")`` reads them on any machine; parameter
names carry no ``_orig_mod.``/``module.`` prefixes. ckpt_latest.pt also holds the optimizer, the
update count (the learning-rate schedule's position), the RNG states of python, numpy (the data
sampler) and torch, the best dev NLL so far, seed and data_seed.

--resume (resume_args, then check_resume and restore) continues ckpt_latest.pt exactly: flags not
given are taken from the checkpoint; IDENTITY_FLAGS must agree with it; other flags given
explicitly override it and the change is printed and logged. Every bad file or conflicting flag
is a one-line UsageError before anything is written. --eval_only (eval_only_args) takes the flags
of ckpt_best.pt the same way.
"""
import glob
import json
import os
import random

import torch

import data as data_mod
from common import ModelConfig, UsageError
from harness.cli import check_not_empty, write_atomic, write_text
from harness.datacheck import data_signature, same_data

CKPT_FORMAT = 2  # bump when the checkpoint layout changes
LATEST, BEST = "ckpt_latest.pt", "ckpt_best.pt"
RUN_FOLDER = 'the run\'s folder ("." for this one)'  # what an empty --out_dir of a reading command is told to give
TRAINING_KEYS = ("format", "model", "config", "data", "iter", "best_dev", "optimizer", "rng", "args",
                 "seed", "data_seed")
# --resume: these must agree with the checkpoint (they define the model, its data order or the
# meaning of "best dev"); MACHINE_FLAGS are never taken from it (but --data_root, when not given,
# is the run's if that folder exists here: merge_resume_args); every other flag, --dtype included
# (the run's numerics), is taken from the checkpoint unless given explicitly, in which case the
# given value wins and the change is logged.
IDENTITY_FLAGS = ("model", "depth", "size", "window", "chunk", "gau_s", "block_size", "seed", "data_seed",
                  "eval_windows", "mu_rec", "mu_bwd", "n_prelude", "n_core", "n_coda",
                  "da_stride", "da_recent", "n_thoughts", "jacobi", "width",
                  "plt_window", "plt_shift", "fold", "fold_rank", "fold_layout")
IDENTITY_FLAGS += ("lrt_src", "lrt_tgt", "lrt_kv", "lrt_subsets", "lrt_detach_init")  # LRT (latent_recurrence.py)
# the data flags (data.add_arguments) that choose the tokens: checked here, before any preparation
DATA_FLAGS = ("dataset", "tokenizer", "max_tokens", "hf_split", "hf_text_field", "hf_split_key", "hf_data_files")
IDENTITY_FLAGS += DATA_FLAGS
MACHINE_FLAGS = ("out_dir", "data_root", "num_proc", "resume", "eval_only", "quiet", "device", "compile")
# the flags of the end-of-training evaluation that a resumed run may change: --eval_only reads them
# from the last run (ckpt_latest.pt), whose report it repeats, and lets explicit ones override
EVAL_FLAGS = ("dtype", "eval_batch_size", "em_samples", "eval_depths")


# ----------------------------------------------------------------------------- writing

def save_checkpoints(r, dev, improved):
    """The best checkpoint first (if improved), then the latest (see check_resume for the order)."""
    args = r.args
    state = {"format": CKPT_FORMAT, "model": clean_state_dict(r.model), "config": r.cfg.to_dict(),
             "data": data_signature(r.data), "iter": r.it, "best_dev": r.best_dev, "dev_nll": dev,
             "seed": args.seed, "data_seed": args.data_seed, "args": vars(args), "wall_s": r.wall_s()}
    if improved:
        save_atomic(state, os.path.join(args.out_dir, BEST))
        r.best_saved_at = r.it
    save_atomic(dict(state, optimizer=to_cpu(r.optimizer.state_dict()), rng=rng_state(r.rng, args.device)),
                os.path.join(args.out_dir, LATEST))
    r.saved_at = r.it


def save_atomic(obj, path):
    """torch.save to a temporary file beside path, flushed to disk, then os.replace
    (harness.cli.write_atomic): a crash or an error at any point leaves the previous file at path whole."""
    write_atomic(path, lambda f: torch.save(obj, f), binary=True)


def strip_prefixes(sd):
    """Parameter names without torch.compile (_orig_mod.) / DDP (module.) wrapper prefixes."""
    out = {}
    for k, v in sd.items():
        changed = True
        while changed:
            changed = False
            for prefix in ("_orig_mod.", "module."):
                if k.startswith(prefix):
                    k, changed = k[len(prefix):], True
        out[k] = v
    return out


def clean_state_dict(model):
    """state_dict on the CPU without wrapper prefixes."""
    return {k: v.detach().cpu() for k, v in strip_prefixes(model.state_dict()).items()}


def to_cpu(obj):
    """obj with every tensor moved to the CPU (dicts, lists and tuples walked)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rng_state(rng, device):
    """The RNG states as plain Python values and CPU tensors (weights_only-loadable)."""
    state = {"python": _listify(random.getstate()), "numpy": rng.bit_generator.state,
             "torch": torch.get_rng_state()}
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, (list, tuple)) else x


def _tuplify(x):
    """random.setstate needs tuples; checkpoints store them as lists."""
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def remove_stale(out_dir):
    """A fresh run replaces the checkpoints and summary of an earlier run in its out_dir (its log is
    rewritten): removes them and returns their names."""
    stale = [f for f in (LATEST, BEST, "summary.json") if os.path.exists(os.path.join(out_dir, f))]
    for f in stale:
        os.remove(os.path.join(out_dir, f))
    return stale


FINISH_EVENTS = ("summary", "depth_sweep")  # what train.finish writes: a resumed run writes its own


def trim_log(path, it):
    """Drop the records of updates after it, and an earlier finish's records (FINISH_EVENTS), from
    a log being resumed: a run that died after its last checkpoint leaves records the resumed run
    will write again, and a finished run's summary and depth sweep are of its old best checkpoint."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(rec, dict) and rec.get("event") not in FINISH_EVENTS and rec.get("iter", 0) <= it:
                keep.append(json.dumps(rec) + "\n")
    write_text(path, "".join(keep))


# ----------------------------------------------------------------------------- reading and resuming

def no_checkpoint(flag, path):
    """The UsageError for a checkpoint path that is not a file; a run's folder given for its
    checkpoint (--base runs/x) names the file to give instead (its best checkpoint, else its
    latest: a run stopped before its first evaluation), a checkpoint given for its run's
    folder (--resume --out_dir runs/x/ckpt_latest.pt) the folder."""
    check_not_empty(flag, path, "a checkpoint file")  # (raises, as check_output_file does for an output path)
    if os.path.isdir(path):
        best, latest = os.path.join(path, BEST), os.path.join(path, LATEST)
        return UsageError(f"{flag} {path}: a folder, not a checkpoint file"
                          + (f"; give its best checkpoint, {best}" if os.path.isfile(best) else
                             f"; give its latest checkpoint, {latest}" if os.path.isfile(latest) else ""))
    folder = os.path.dirname(path)
    if os.path.isfile(folder):  # --resume/--eval_only --out_dir runs/x/ckpt_latest.pt: the file for its folder
        return UsageError(f"{flag}: {folder} is a file; give the run's folder, {os.path.dirname(folder) or '.'}")
    return UsageError(f"{flag}: no checkpoint at {path}")


def load_checkpoint(path, keys=("model", "config"), flag="--resume", mmap=False):
    """Load a checkpoint with weights_only=True on the CPU; UsageError if it is missing (naming
    flag), unreadable (truncated, corrupted, not a checkpoint) or lacks one of keys. mmap: map the
    file instead of reading it, for a caller that reads a few entries of a large checkpoint."""
    if not os.path.isfile(path):
        raise no_checkpoint(flag, path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - whatever the damage, it is a bad file
        why = ("it holds objects that torch.load(weights_only=True) refuses (not written by train.py)"
               if "Weights only load failed" in str(e) else "it may be truncated or corrupted")
        raise UsageError(f"{path}: not a readable checkpoint ({type(e).__name__}); {why}") from None
    if not isinstance(ck, dict) or any(k not in ck for k in keys):
        have = sorted(ck) if isinstance(ck, dict) else type(ck).__name__
        raise UsageError(f"{path}: not a training checkpoint of this train.py (needs {', '.join(keys)}; has {have})")
    if "format" in keys and ck["format"] != CKPT_FORMAT:
        raise UsageError(f"{path}: checkpoint format {ck['format']}, this train.py reads {CKPT_FORMAT}")
    return ck


def resume_args(args, given):
    """--resume: load <out_dir>/ckpt_latest.pt and fill args from the flags it was trained with.
    Returns (checkpoint, the explicit overrides as {flag: [checkpoint value, new value]});
    UsageError for a bad file or a conflicting identity flag."""
    check_not_empty("--out_dir", args.out_dir, RUN_FOLDER)
    path = os.path.join(args.out_dir, LATEST)
    ckpt = load_checkpoint(path, keys=TRAINING_KEYS)
    saved = saved_args(ckpt, path)
    changed = merge_resume_args(args, given, saved, path=path, config=ckpt["config"])
    check_sequences_per_update(args, saved)
    return ckpt, changed


def check_sequences_per_update(args, saved):
    """UsageError when --batch_size x --gradient_accumulation_steps (sequences per update) differs
    from the checkpoint's: the run's token counts (summary tokens, the curves' x axis) are updates
    x tokens per update. Another split of the same product is allowed (a smaller GPU)."""
    was = [saved.get(k) for k in ("batch_size", "gradient_accumulation_steps")]
    if not all(isinstance(v, int) for v in was) or min(args.batch_size, args.gradient_accumulation_steps) < 1:
        return  # a malformed entry or a value below 1: reported where the flags are checked
    if args.batch_size * args.gradient_accumulation_steps != was[0] * was[1]:
        raise UsageError(f"--batch_size {args.batch_size} x --gradient_accumulation_steps "
                         f"{args.gradient_accumulation_steps}: the checkpoint in {args.out_dir} was trained with "
                         f"{was[0]} x {was[1]} = {was[0] * was[1]} sequences per update; keep that product to resume it")


def eval_only_args(args, given):
    """--eval_only: load <out_dir>/ckpt_best.pt and fill args from the flags it was trained with, as
    --resume does (explicit flags override, IDENTITY_FLAGS must agree), the EVAL_FLAGS from
    ckpt_latest.pt where it exists: the last run's, which its report used (a resumed run may change
    them after the best checkpoint was written). Returns (the best checkpoint, the explicit
    overrides); UsageError for a bad file, a latest checkpoint of another model or a conflicting
    identity flag."""
    check_not_empty("--out_dir", args.out_dir, RUN_FOLDER)
    path, latest = os.path.join(args.out_dir, BEST), os.path.join(args.out_dir, LATEST)
    ckpt = load_checkpoint(path, keys=("format", "model", "config", "data", "iter", "dev_nll", "args"),
                           flag="--eval_only")
    saved = saved_args(ckpt, path)
    if os.path.exists(latest):
        # mapped: its args are read, not its optimizer state
        last = load_checkpoint(latest, keys=("config", "args"), flag="--eval_only", mmap=True)
        if _live(last["config"]) != _live(ckpt["config"]):
            raise UsageError(f"{latest}: another model than {path}; --eval_only reads the run's "
                             "evaluation flags from it (move it away to use the best checkpoint's)")
        saved.update({k: v for k, v in saved_args(last, latest).items() if k in EVAL_FLAGS})
    changed = merge_resume_args(args, given, saved, path=path, action="evaluate it", config=ckpt["config"])
    return ckpt, changed


def _live(config):
    """A saved model config without ModelConfig.DEAD_FIELDS (written by an older train.py)."""
    return {k: v for k, v in config.items() if k not in ModelConfig.DEAD_FIELDS} if isinstance(config, dict) else config


def saved_args(ckpt, path):
    """The flags a checkpoint was trained with, as a dict; UsageError for a malformed entry."""
    if not isinstance(ckpt["args"], dict):
        raise UsageError(f"{path}: malformed args entry")
    saved = dict(ckpt["args"])
    for k in ("chunk", "gau_s"):  # not flags before these became tier defaults: the model config has them
        if k not in saved and isinstance(ckpt["config"], dict) and k in ckpt["config"]:
            saved[k] = ckpt["config"][k]
    return saved


def merge_resume_args(args, given, saved, path=None, action="resume it, or use a fresh --out_dir", config=None):
    """Fill args from a checkpoint's args (at path, default <out_dir>/ckpt_latest.pt) for --resume
    or --eval_only (see IDENTITY_FLAGS; --data_root, when not given, is the run's if that folder
    exists here). A given "auto" (--tokenizer auto, ...) is the checkpoint's choice; a model flag
    the checkpoint's model ignores is left to check_model_flags; --width equal to the solved width
    (config: the checkpoint's model config) and another path of the same --dataset are the same
    setting. Returns the explicit overrides as {flag: [checkpoint value, new value]}; UsageError
    for a conflicting identity flag ("drop the flag to <action>") or a --dataset path of the
    checkpoint that is not found here (unless --dataset gives another)."""
    from models import model_flags  # (models imports no harness module)
    changed, where = {}, path or os.path.join(args.out_dir, LATEST)
    root = saved.get("data_root")
    if "data_root" not in given and isinstance(root, str) and os.path.isdir(root):
        args.data_root = root  # the run's prepared bins, where they are on this machine: not prepared again
    unread = {f for f, users in model_flags().items() if saved.get("model") not in users}
    solved = config.get("width") if isinstance(config, dict) else None
    gone = {k for k in ("dataset", "hf_data_files") if _data_not_here(k, saved.get(k))}
    for k, v in saved.items():
        if k in MACHINE_FLAGS or not hasattr(args, k):  # saved flags this train.py does not have are skipped
            continue
        if not isinstance(v, (type(None), bool, int, float, str)):
            raise UsageError(f"{where}: malformed args entry {k}={v!r}")
        new = getattr(args, k)
        if k not in given or new == "auto" or new == v or _same_value(k, v, new, solved):
            setattr(args, k, v)
        elif k in gone:
            continue  # a copy of the data elsewhere: the data signature decides, once prepared
        elif k in unread:
            continue  # check_model_flags says "only used with --model ..."
        elif k in IDENTITY_FLAGS:
            was = f"--{k} {v}" + (f" (solved: {solved})" if k == "width" and v == 0 and solved else "")
            raise UsageError(f"--{k} {new}: the checkpoint in {args.out_dir} was trained with {was}; "
                             f"drop the flag to {action}")
        else:
            changed[k] = [v, new]
    if gone - given:
        k = min(gone - given)  # --dataset first
        raise UsageError(f"{where}: trained on --{k} {saved[k]}, which is not found from {os.getcwd()}; "
                         f"run from the folder it was trained in, or give --{k} with the data's path")
    return changed


def _same_value(flag, saved, new, solved):
    """Two spellings of one setting: --width equal to the width solved for --width 0, or two paths
    of one local file or folder in --dataset (a path, hf:PATH) or in each --hf_data_files entry."""
    if flag == "width":
        return saved == 0 and new == solved
    if flag == "dataset":
        a, b = data_mod.local_path(saved), data_mod.local_path(new)
        return bool(a and b) and a[1] == b[1] and _same_file(a[0], b[0])
    if flag == "hf_data_files" and saved and new:
        a, b = saved.split(","), new.split(",")
        return len(a) == len(b) and all(x == y or _same_file(x, y) for x, y in zip(a, b))
    return False


def _same_file(a, b):
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def _data_not_here(flag, value):
    """True when a checkpoint's --dataset path (or hf:PATH, recorded absolute) or an absolute
    --hf_data_files entry does not exist here: the data was moved, or the run trained elsewhere."""
    if not isinstance(value, str) or not value:
        return False
    if flag == "hf_data_files":
        return any(os.path.isabs(f) and not glob.glob(f, recursive=True) for f in value.split(","))
    local = data_mod.local_path(value)
    return bool(local) and (data_mod.is_path(value) or os.path.isabs(local[0])) and not os.path.exists(local[0])


def check_resume(ckpt, cfg, data, args):
    """Validate a resumed run's checkpoints; returns the best dev NLL so far, the lower of the
    latest checkpoint's record and the best checkpoint's own (a crash between writing the best and
    the latest checkpoint leaves the best one newer), so a better best is never overwritten."""
    latest_path, best_path = os.path.join(args.out_dir, LATEST), os.path.join(args.out_dir, BEST)
    check_compatible(ckpt, latest_path, cfg, data)
    if not isinstance(ckpt["iter"], int) or ckpt["iter"] < 0:
        raise UsageError(f"{latest_path}: bad update count {ckpt['iter']!r}")
    if not isinstance(ckpt["best_dev"], float) or not isinstance(ckpt["rng"], dict):
        raise UsageError(f"{latest_path}: malformed best_dev or rng entries")
    if ckpt["iter"] > args.max_iters:
        raise UsageError(f"--max_iters {args.max_iters}: below the checkpoint's update {ckpt['iter']}; "
                         "give a larger --max_iters")
    best = load_checkpoint(best_path, keys=("format", "model", "config", "data", "iter", "dev_nll"))
    check_compatible(best, best_path, cfg, data)
    if not isinstance(best["dev_nll"], float):
        raise UsageError(f"{best_path}: malformed dev_nll {best['dev_nll']!r}")
    return min(ckpt["best_dev"], best["dev_nll"])


def check_unfinished(ckpt, args):
    """UsageError when the checkpoint's run is finished (its last update done and summary.json
    written): resuming it would only evaluate again and replace summary.json without its throughput.
    Called after every other check of the checkpoint, so a damaged one is reported as such."""
    if ckpt["iter"] == args.max_iters and os.path.exists(os.path.join(args.out_dir, "summary.json")):
        raise UsageError(f"--resume: the run in {args.out_dir} is finished (update {ckpt['iter']} of --max_iters "
                         f"{args.max_iters}, summary.json written); give --max_iters > {ckpt['iter']} "
                         "to train it further")


def check_compatible(ck, path, cfg, data, fix="use a fresh --out_dir"):
    """UsageError unless the checkpoint holds this model config and was trained on this data
    (ModelConfig.DEAD_FIELDS of older checkpoints are ignored); fix ends the model message."""
    if not same_data(ck["data"], data):  # first: other data explains another vocab_size (a char set that grew)
        saved = ck["data"] if isinstance(ck["data"], dict) else {}
        raise UsageError(f"{path}: trained on other data ({saved.get('tokenizer')} tokenizer, vocab "
                         f"{saved.get('vocab_size')}, splits {saved.get('splits')}); this dataset has "
                         f"{data.tokenizer}, vocab {data.vocab_size}, splits {data.meta['splits']}"
                         + ("; the same sizes, other tokens" if saved.get("splits") == data.meta["splits"] else ""))
    saved = _live(ck["config"]) if isinstance(ck["config"], dict) else {}
    if not isinstance(ck["config"], dict) or saved != cfg.to_dict():
        diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in cfg.to_dict().items() if saved.get(k) != v]
        raise UsageError(f"{path}: another model: {', '.join(diff) or 'unknown config fields'}; {fix}")


def load_weights(ck, path, model):
    """Load a checkpoint's weights into model; UsageError if its tensors do not fit or are not all
    finite (a damaged file: train.py stops at a non-finite dev NLL before saving)."""
    try:
        model.load_state_dict(strip_prefixes(ck["model"]))
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(f"{path}: does not fit this model ({why})") from None
    bad = [n for n, t in model.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise UsageError(f"{path}: non-finite weights ({bad[0]}{more}); the file is damaged")


def restore(ck, path, model, optimizer, rng, device):
    """Load the training state of a checkpoint (weights, optimizer moments, RNG states); the
    optimizer keeps this run's hyperparameters (--weight_decay given on --resume, the fused kernel
    of this device), not the checkpoint's. UsageError if its tensors do not fit or its weights are
    not finite."""
    load_weights(ck, path, model)
    mine = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        saved = ck["optimizer"]
        # this run's settings go in before loading: load_state_dict would bring back the saved
        # groups' ones, and it places each state tensor by them (fused: the step counts on the GPU)
        groups = [{**g, **hyper} for g, hyper in zip(saved["param_groups"], mine, strict=True)]
        optimizer.load_state_dict({**saved, "param_groups": groups})  # moves the state to the parameters' device
        random.setstate(_tuplify(ck["rng"]["python"]))
        rng.bit_generator.state = ck["rng"]["numpy"]
        torch.set_rng_state(ck["rng"]["torch"])
        if "cuda" in ck["rng"] and device.startswith("cuda"):
            torch.cuda.set_rng_state(ck["rng"]["cuda"], device)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(f"{path}: does not fit this model ({why})") from None


def overrides(changed):
    """'; --flag old -> new' for each explicit override of a checkpoint's flag (changed: {flag: [old, new]})."""
    return "".join(f"; --{k} {a if a not in (None, '') else '(none)'} -> {b}" for k, (a, b) in changed.items())
