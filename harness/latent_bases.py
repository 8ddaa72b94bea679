"""The frozen bases latent tokens run on, and how a base is loaded with its tokenizer.

Latent tokens need three things of a base (*Enhancing Latent Computation in Transformers with
Latent Tokens*, arXiv 2505.12629, §3.1): input embeddings instead of ids, explicit position ids
(latents repeat a verbal token's id) and a decoding cache. A backend gives them one interface,
forward(x (B, L, d) embeddings, positions (B, L), cache) -> (logits (B, L, V), cache):

    OwnBackend   this project's common.LM (any models.REGISTRY model): forward_embeds, a dict cache
    HFBackend    a Hugging Face causal LM (Llama, GPT-2, ...): inputs_embeds, position_ids, a
                 DynamicCache; `transformers` is imported only when such a base is used

load_base(path) reads a train.py-format checkpoint (task, char or GPT-2 BPE vocabulary) or
'hf:FOLDER', a local Hugging Face model folder (never downloads). Bad input raises UsageError.
"""
import inspect

import torch

from harness.checkpoint import load_checkpoint, load_weights
from common import LM, UsageError
from harness.tasks import CharTokenizer, Tokenizer


class OwnBackend:
    """This project's LM: forward(x (B, L, d) embeddings, positions (B, L), dict cache) -> logits."""

    def __init__(self, lm):
        self.lm = lm
        self.d = lm.cfg.n_embd
        self.vocab_size = lm.cfg.vocab_size
        self.context = lm.cfg.block_size  # the positions it was trained on

    def embedding(self):
        return self.lm.wte

    def forward(self, x, positions, cache=None):
        logits, _ = self.lm.forward_embeds(x, None, positions, cache)
        return logits, cache

    def new_cache(self):
        return {}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UsageError("a Hugging Face base needs the transformers package: pip install transformers") from None
    return transformers


class HFBackend:
    """forward(x (B, L, d) embeddings, positions (B, L), cache) -> (logits (B, L, V), cache)."""

    def __init__(self, model):
        _transformers()
        self.lm = model
        self.d = model.get_input_embeddings().weight.shape[1]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        # transformers >= 5.2x names the cache argument `cache` (past_key_values is deprecated and
        # its output field stays empty); older versions only know past_key_values
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def embedding(self):
        return self.lm.get_input_embeddings()

    def forward(self, x, positions, cache=None):
        kw = {self.cache_kw: cache} if cache is not None else {}
        # An explicit all-ones mask is required: without one, recent transformers read position ids
        # that do not step by 1 (our repeated latent ids) as *packed sequences* and silently switch
        # to a block-diagonal mask. Right padding needs no mask entries (causal).
        past = cache.get_seq_length() if cache is not None else 0
        mask = torch.ones(x.shape[0], past + x.shape[1], dtype=torch.long, device=x.device)
        out = self.lm(inputs_embeds=x, position_ids=positions, attention_mask=mask,
                      use_cache=cache is not None, return_dict=True, **kw)
        return out.logits, cache  # a DynamicCache is updated in place

    def new_cache(self):
        DynamicCache = _transformers().DynamicCache
        try:
            return DynamicCache(config=self.lm.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()


def make_backend(base):
    if isinstance(base, LM):
        return OwnBackend(base)
    if hasattr(base, "get_input_embeddings") and hasattr(base, "config"):
        return HFBackend(base)
    raise UsageError(f"latent tokens need this project's LM or a Hugging Face causal LM, not {type(base).__name__}")


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, t):
        self.t = t
        self.bos = t.bos_token_id if t.bos_token_id is not None else t.eos_token_id
        self.eos = t.eos_token_id
        self.vocab_size = len(t)

    def encode(self, text):
        return self.t.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.t.decode([i for i in ids if i != self.eos])


def load_hf_base(folder):
    """(model, HFTokenizer) from a local model folder (never downloads); UsageError otherwise."""
    transformers = _transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever fails, the folder is not a usable model
        raise UsageError(f"--base hf:{folder}: cannot load a Hugging Face model ({type(e).__name__})") from None
    return model, HFTokenizer(tok)


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE (train.py's stdlib checkpoints); <|endoftext|> begins and ends a sample."""

    kind = "gpt2"

    def __init__(self):
        import data as data_mod
        self.enc = data_mod.gpt2_encoder()
        self.bos = self.eos = data_mod.EOT
        self.vocab_size = data_mod.EOT + 1

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i != self.eos])


def load_base(path):
    """(frozen base, tokenizer) from a checkpoint in train.py's format, or 'hf:FOLDER' for a local
    Hugging Face model folder (needs transformers). UsageError for anything unusable."""
    if path.startswith("hf:"):
        return load_hf_base(path[3:])
    ck = load_checkpoint(path, flag="--base")
    from models import build_model, checkpoint_config
    cfg = checkpoint_config(ck["config"], f"--base {path}")
    model = build_model(cfg)
    load_weights(ck, f"--base {path}", model)
    info = ck.get("data", {})
    if info.get("tokenizer") in ("char", "task"):
        if "itos" not in info:
            raise UsageError(f"--base {path}: {info['tokenizer']} checkpoint without its vocabulary (data.itos)")
        tok = CharTokenizer(info["itos"], info["tokenizer"])
    elif info.get("tokenizer") == "gpt2":
        tok = GPT2Tokenizer()
    else:
        raise UsageError(f"--base {path}: unknown tokenizer {info.get('tokenizer')!r}")
    if tok.vocab_size != cfg.vocab_size:
        raise UsageError(f"--base {path}: vocabulary {tok.vocab_size} != model vocab {cfg.vocab_size}")
    return model, tok
