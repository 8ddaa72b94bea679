"""Sample from a train.py checkpoint (any registered model, cached decoding), as nanoGPT does.

Decoding is LM.generate with its cache; the tokenizer is the one the checkpoint was trained with.

    python sample.py --out_dir out --start "def " --num_samples 3 --max_new_tokens 200 --temperature 0.8 --top_k 200
    python sample.py --out_dir out --start FILE:prompt.txt    # the prompt is the file's text (UTF-8)
    python sample.py --out_dir out --ckpt latest              # ckpt_latest.pt instead of ckpt_best.pt

Each sample is the prompt followed by --max_new_tokens sampled tokens, printed on stdout and
followed by a line of 15 dashes; a one-line description of the checkpoint goes to stderr. Without
--start a sample starts a new document (the prompt is the end-of-text token, not printed). The
--num_samples samples are drawn as one batch, seeded by --seed. The checkpoint is read with
``torch.load(weights_only=True)``; its data signature gives the tokenizer (GPT-2 BPE, or the
character vocabulary it stores). Decoding past the trained context (block_size) continues the
positions: the model never saw them in training, so a note says so on stderr.

Bad input (a flag, a missing or damaged checkpoint, prompt characters outside a character
vocabulary) prints one line "error: ..." on stderr and exits 2.
"""
import os
import sys

import torch

from common import UsageError, check_sampling
from harness.cli import UsageParser, check_not_empty, check_seed, nll_unit, past_context_note, run_command, seed_flag
from harness.checkpoint import BEST, LATEST, RUN_FOLDER, load_checkpoint, load_weights
from harness.config import Dist, auto_dtype, autocast_ctx, resolve_device
from harness.evaluation import eval_mode
from harness.token_files import EOT, EOT_SYMBOL, gpt2_encoder
from models import build_model, checkpoint_config

SEPARATOR = "-" * 15  # between samples, as nanoGPT prints them
CKPT_FILES = {"best": BEST, "latest": LATEST}


def build_parser():
    p = UsageParser(prog="sample.py", description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", default="out", help="train.py's --out_dir: the folder of the checkpoints")
    p.add_argument("--ckpt", default="best", choices=list(CKPT_FILES),
                   help="ckpt_best.pt (lowest dev NLL) or ckpt_latest.pt (the last evaluation)")
    p.add_argument("--start", default="", help='the prompt text, or FILE:path to read it from a file; '
                   '"": a new document (the end-of-text token); <|endoftext|> in it is that token where '
                   'the vocabulary has that symbol (GPT-2, text datasets; not dmmath)')
    p.add_argument("--num_samples", type=int, default=10, help="samples to draw (one batch)")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens sampled after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens; 0: all")
    p.add_argument("--seed", type=seed_flag, default=1337, help="torch seed of the draws")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="autocast dtype; auto: bfloat16 on a GPU that computes it natively, float32 otherwise")
    return p


class CheckpointTokenizer:
    """The tokenizer of a checkpoint, from its data signature ``ck["data"]`` (harness.datacheck.
    data_signature): GPT-2 BPE (``GPT2_BPE_FILE`` or tiktoken), or a character vocabulary
    ``itos`` whose last symbol is the unknown id (U+FFFD) and whose end-of-text is the
    ``<|endoftext|>`` symbol (text datasets) or the newline (dmmath), as in data.Data.
    UsageError (naming path) for a signature that fits neither."""

    def __init__(self, sig, path):
        self.kind = sig.get("tokenizer") if isinstance(sig, dict) else None
        if self.kind == "gpt2":
            self.enc, self.eot, self.vocab_size = gpt2_encoder(), EOT, EOT + 1
        elif self.kind == "char" and isinstance(sig.get("itos"), list) and len(sig["itos"]) > 1:
            self.itos = [str(s) for s in sig["itos"]]
            self.stoi = {c: i for i, c in enumerate(self.itos[:-1]) if len(c) == 1}
            self.eot = self.itos.index(EOT_SYMBOL) if EOT_SYMBOL in self.itos else self.stoi.get("\n")
            self.vocab_size = len(self.itos)
            if self.eot is None:
                raise UsageError(f"{path}: the character vocabulary has no end-of-text symbol or newline")
        else:
            raise UsageError(f"{path}: no usable tokenizer in its data signature (needs gpt2, or char with itos)")

    def encode(self, text, flag="--start"):
        """str -> list of ids, the text ``<|endoftext|>`` as the end-of-text token where the vocabulary
        has that symbol (GPT-2, text datasets' characters; nanoGPT's sample.py does the same);
        UsageError naming flag for characters outside a character vocabulary."""
        if self.kind == "gpt2":
            return self.enc.encode(text, allowed_special={EOT_SYMBOL})
        if EOT_SYMBOL in self.itos[:-1] and EOT_SYMBOL in text:
            first, *rest = text.split(EOT_SYMBOL)
            ids = self.encode(first, flag)
            for piece in rest:
                ids += [self.eot] + self.encode(piece, flag)
            return ids
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            shown = " ".join(repr(c) for c in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise UsageError(f"{flag}: {len(unknown)} character(s) not in the checkpoint's vocabulary of "
                             f"{self.vocab_size} symbols: {shown}")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        ids = [int(i) for i in ids]
        return self.enc.decode(ids) if self.kind == "gpt2" else "".join(self.itos[i] for i in ids)


def read_prompt(start):
    """--start: the text itself, or the UTF-8 text of the file after FILE: as it is (line endings
    kept: "\r" is a symbol of text vocabularies); UsageError if unreadable."""
    if not start.startswith("FILE:"):
        return start
    try:
        with open(start[5:], encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = (f"not UTF-8: byte {e.object[e.start]:#04x} at offset {e.start}" if isinstance(e, UnicodeDecodeError)
               else e.strerror or type(e).__name__)
        raise UsageError(f"--start {start}: cannot read the prompt file ({why})") from None


def check_args(args):
    """UsageError naming the flag for a value outside its range."""
    if args.num_samples < 1:
        raise UsageError(f"--num_samples {args.num_samples}: must be >= 1")
    if args.top_k < 0:
        raise UsageError(f"--top_k {args.top_k}: must be >= 0 (0: all tokens)")
    for flag in ("max_new_tokens", "temperature"):
        try:
            check_sampling(**{flag: getattr(args, flag)})
        except ValueError as e:
            raise UsageError(f"--{e}") from None
    check_seed("--seed", args.seed)


def load_model(ck, path, device):
    """The checkpoint's model (models.build_model from its config, its weights) on device, in eval mode."""
    model = build_model(checkpoint_config(ck["config"], path), device=device)
    load_weights(ck, path, model)
    return model.eval()


@torch.no_grad()
def sample(model, prompt, num_samples, max_new_tokens, temperature, top_k, ctx):
    """num_samples continuations of prompt (list of ids) drawn as one batch with the decoding cache
    (LM.generate); returns a list of num_samples lists of prompt + max_new_tokens ids."""
    device = model.wte.weight.device
    idx = torch.tensor([prompt], dtype=torch.long, device=device).expand(num_samples, -1).contiguous()
    with eval_mode(model), ctx:
        out = model.generate(idx, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or None)
    return out.tolist()


def run(args, out=None, err=None):
    """Load, sample and print (samples on out, default stdout; the description on err, default
    stderr); returns the printed samples (strings, prompt included)."""
    out, err = out or sys.stdout, err or sys.stderr
    check_args(args)
    resolve_device(args, Dist())
    if args.dtype == "auto":
        args.dtype = auto_dtype(args.device)
    check_not_empty("--out_dir", args.out_dir, RUN_FOLDER)  # (not ./ckpt_best.pt)
    if os.path.isfile(args.out_dir):  # (not "no checkpoint at FILE/ckpt_best.pt")
        raise UsageError(f"--out_dir {args.out_dir}: a file; give the run's folder (train.py's --out_dir)")
    path = os.path.join(args.out_dir, CKPT_FILES[args.ckpt])
    ck = load_checkpoint(path, keys=("format", "model", "config", "data"), flag="--out_dir")
    tok = CheckpointTokenizer(ck["data"], path)
    text = read_prompt(args.start)
    prompt = tok.encode(text, flag="--start") if text else [tok.eot]
    model = load_model(ck, path, args.device)
    cfg = model.cfg
    if cfg.vocab_size != tok.vocab_size:
        raise UsageError(f"{path}: its model has {cfg.vocab_size} tokens, its {tok.kind} tokenizer {tok.vocab_size}")
    dev = ck.get("dev_nll")
    print(f"{path}: {cfg.model} depth {cfg.depth}, update {ck.get('iter')}"
          + (f", dev NLL {dev:.4f} {nll_unit(tok.kind)}" if isinstance(dev, float) else "")
          + f"; {tok.kind} tokenizer, vocab {tok.vocab_size}; {args.device} {args.dtype}", file=err)
    note = past_context_note(len(prompt), args.max_new_tokens, cfg.block_size)
    if note:
        print(note, file=err)
    torch.manual_seed(args.seed)
    rows = sample(model, prompt, args.num_samples, args.max_new_tokens, args.temperature, args.top_k,
                  autocast_ctx(args))
    texts = [tok.decode(ids if text else ids[1:]) for ids in rows]  # a new document: no end-of-text printed
    for t in texts:
        print(t, file=out)
        print(SEPARATOR, file=out)
    return texts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        run(build_parser().parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# the flags that set how much memory the command takes: its out-of-memory line names them
SIZE_FLAGS = ("--num_samples", "--max_new_tokens")


if __name__ == "__main__":
    run_command(main, sizes=SIZE_FLAGS)
