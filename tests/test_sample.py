"""Tests for sample.py (sampling from a checkpoint) and train.py --eval_only (a checkpoint's dev and
test NLL without training). The checkpoints come from real train.py runs of two updates at the tiny
tier with a 32-token context, one per registered model, on the mini DeepMind Mathematics dataset of
tests/conftest.py (a 22-symbol character vocabulary), and on a small text folder (char and GPT-2
tokenizers); train.main and sample.run are called in this process.
"""
import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import data as data_mod
import sample
import train
from harness.checkpoint import load_checkpoint, merge_resume_args
from harness.datacheck import same_data
from harness.token_files import EOT_SYMBOL
from models import REGISTRY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MDM_SIZE = (60, 20)  # problems per train-* folder, extrapolate problems (tests/conftest.py's mdm)
PROMPT = "What is 3 + 4?"  # 14 characters, all in the mini dataset's vocabulary
TINY = ["--size", "tiny", "--depth", "2", "--block_size", "32", "--batch_size", "2", "--max_iters", "2",
        "--eval_interval", "2", "--warmup_iters", "1", "--eval_windows", "3", "--eval_batch_size", "2",
        "--sample_tokens", "0", "--quiet"]
# the flags of a full forward that is a parallel approximation of an exact sequential recurrence
# (cached decoding is that recurrence), at settings that make it exact at 32 tokens: T - 1 Jacobi
# refinements (ponder.py), at least as many subsets as rows, 2T with thought slots
# (latent_recurrence.py); so cached greedy decoding must equal full-forward greedy decoding
EXACT_FLAGS = {"jacobi": "31", "lrt_subsets": "64"}
EXACT = {name: [x for f, v in EXACT_FLAGS.items() if f in spec.flags for x in (f"--{f}", v)]
         for name, spec in REGISTRY.items() if set(EXACT_FLAGS) & set(spec.flags)}

pytestmark = pytest.mark.usefixtures("one_thread")


def train_main(argv):
    """train.main in this process; returns its stdout (AssertionError on a non-zero exit)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            train.main([str(a) for a in argv])
        except SystemExit as e:
            raise AssertionError(f"train.py exited with {e.code}: {out.getvalue()[-2000:]}") from None
    return out.getvalue()


def tiny_run(model, data_flags, out_dir, *extra):
    depth = str(max(2, REGISTRY[model].min_depth))
    argv = [*TINY, "--model", model, *data_flags, "--out_dir", out_dir, *extra]
    argv[argv.index("--depth") + 1] = depth
    return train_main(argv)


@pytest.fixture(scope="module")
def mdm_flags(mdm, data_root):
    return ["--em_samples", "2", "--dataset", "dmmath", "--data_dir", str(mdm), "--data_root", str(data_root)]


@pytest.fixture(scope="module")
def ckpts(mdm_flags, tmp_path_factory):
    """{name: out_dir} of a two-update run of every registered model, and of EXACT's settings
    (as name + "-exact")."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name in REGISTRY:
        out[name] = root / name
        tiny_run(name, mdm_flags, out[name])
    for name, extra in EXACT.items():
        out[name + "-exact"] = root / (name + "-exact")
        tiny_run(name, mdm_flags, out[name + "-exact"], *extra)
    return out


def run_sample(argv):
    """sample.run in this process; returns (samples, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    texts = sample.run(sample.build_parser().parse_args([str(a) for a in argv]), out=out, err=err)
    return texts, out.getvalue(), err.getvalue()


def call_main(argv, capsys):
    """sample.main in this process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        sample.main([str(a) for a in argv])
    except SystemExit as e:
        got = capsys.readouterr()
        return e.code, got.out, got.err
    got = capsys.readouterr()
    return 0, got.out, got.err


def printed(texts):
    return "".join(f"{t}\n{sample.SEPARATOR}\n" for t in texts)


def greedy_reference(out_dir, prompt_ids, n):
    """n greedy tokens after prompt_ids by the full forward pass over the whole sequence at every
    step (no cache), from the checkpoint's own weights; returns the ids, prompt included."""
    path = os.path.join(out_dir, "ckpt_best.pt")
    model = sample.load_model(load_checkpoint(path), path, "cpu")
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat((ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)), 1)
    return ids[0].tolist()


# ----------------------------------------------------------------------------- every model

@pytest.mark.parametrize("name", list(REGISTRY))
def test_three_samples_from_every_model(ckpts, name):
    argv = ["--out_dir", ckpts[name], "--start", PROMPT, "--num_samples", "3", "--max_new_tokens", "20",
            "--temperature", "0.8", "--top_k", "200"]
    texts, out, err = run_sample(argv)
    assert out == printed(texts) and len(texts) == 3
    for t in texts:  # a character vocabulary without an end-of-text symbol: one character per token
        assert t.startswith(PROMPT) and len(t) == len(PROMPT) + 20
    assert len(set(texts)) > 1  # the three rows are drawn independently
    assert err.startswith(f"{ckpts[name] / 'ckpt_best.pt'}: {name} depth ") and "char tokenizer, vocab 22" in err
    assert run_sample(argv)[0] == texts  # --seed (1337) makes it repeatable
    assert run_sample(argv + ["--seed", "7"])[0] != texts


@pytest.mark.parametrize("name", [n for n in REGISTRY if n not in EXACT] + [n + "-exact" for n in EXACT])
def test_cached_greedy_sample_equals_full_forward_greedy(ckpts, name):
    # top_k 1 is greedy whatever the temperature; 14 + 18 tokens = the trained context of 32
    texts, _, _ = run_sample(["--out_dir", ckpts[name], "--start", PROMPT, "--num_samples", "2",
                              "--max_new_tokens", "18", "--top_k", "1"])
    tok = sample.CheckpointTokenizer(load_checkpoint(ckpts[name] / "ckpt_best.pt")["data"], "")
    ref = tok.decode(greedy_reference(ckpts[name], tok.encode(PROMPT), 18))
    assert texts == [ref, ref]


def test_past_the_trained_context_a_note_and_cache_still_equals_full_forward(ckpts):
    texts, _, err = run_sample(["--out_dir", ckpts["tango"], "--start", PROMPT, "--num_samples", "1",
                                "--max_new_tokens", "30", "--temperature", "0"])
    assert "note: 14 prompt + 30 new tokens exceed the trained context of 32 by more than the last token" in err
    for n, note in ((19, False), (20, True)):  # 14 + 19 - 1: the last sampled token's logits come from position 31
        err = run_sample(["--out_dir", ckpts["tango"], "--start", PROMPT, "--max_new_tokens", str(n)])[2]
        assert ("exceed the trained context" in err) == note, (n, err)
    tok = sample.CheckpointTokenizer(load_checkpoint(ckpts["tango"] / "ckpt_best.pt")["data"], "")
    assert texts == [tok.decode(greedy_reference(ckpts["tango"], tok.encode(PROMPT), 30))]


def test_latest_checkpoint_prompt_file_and_device_flags(ckpts, tmp_path):
    (tmp_path / "prompt.txt").write_text(PROMPT, encoding="utf-8")
    base = ["--out_dir", ckpts["loop"], "--num_samples", "2", "--max_new_tokens", "5", "--device", "cpu",
            "--dtype", "float32"]
    from_text, _, _ = run_sample(base + ["--start", PROMPT])
    from_file, _, _ = run_sample(base + ["--start", f"FILE:{tmp_path / 'prompt.txt'}"])
    assert from_file == from_text
    _, _, err = run_sample(base + ["--start", PROMPT, "--ckpt", "latest"])
    assert err.startswith(f"{ckpts['loop'] / 'ckpt_latest.pt'}: loop depth 2, update 2, dev NLL ")


# ----------------------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    """A few Python-like text files (too few to split by file: split by position)."""
    root = tmp_path_factory.mktemp("text")
    for i in range(4):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40))
        (root / f"m{i}.py").write_text(body)
    return root


def text_run(text_folder, tmp_path_factory, tokenizer):
    data_root = tmp_path_factory.mktemp(f"data-{tokenizer}")
    out = tmp_path_factory.mktemp(f"run-{tokenizer}")
    tiny_run("loop", ["--dataset", str(text_folder), "--tokenizer", tokenizer, "--data_root", str(data_root)], out)
    return out


def test_char_text_checkpoint_new_document_and_unknown_characters(text_folder, tmp_path_factory, capsys):
    out = text_run(text_folder, tmp_path_factory, "char")
    sig = load_checkpoint(out / "ckpt_best.pt")["data"]
    assert sig["itos"][-2:] == [EOT_SYMBOL, "\ufffd"]  # a text dataset's char vocabulary
    tok = sample.CheckpointTokenizer(sig, "")
    assert tok.eot == len(sig["itos"]) - 2 and tok.encode("def ") == [sig["itos"].index(c) for c in "def "]
    # no --start: a new document, the end-of-text token as the prompt, not printed
    texts, out_text, _ = run_sample(["--out_dir", out, "--num_samples", "2", "--max_new_tokens", "12", "--top_k", "1"])
    ref = greedy_reference(out, [tok.eot], 12)
    assert texts == [tok.decode(ref[1:])] * 2 and out_text == printed(texts)
    code, stdout, err = call_main(["--out_dir", out, "--start", "def é€(x):"], capsys)
    assert (code, stdout) == (2, "")
    assert err == (f"error: --start: 2 character(s) not in the checkpoint's vocabulary of {len(sig['itos'])} "
                   "symbols: 'é' '€'\n")


def test_gpt2_checkpoint_samples_start_with_the_prompt(gpt2_bpe, text_folder, tmp_path_factory):
    out = text_run(text_folder, tmp_path_factory, "gpt2")
    argv = ["--out_dir", out, "--start", "def ", "--num_samples", "3", "--max_new_tokens", "8"]
    texts, out_text, err = run_sample(argv)
    assert len(texts) == 3 and all(t.startswith("def ") for t in texts) and out_text == printed(texts)
    assert "gpt2 tokenizer, vocab 50257" in err
    tok = sample.CheckpointTokenizer(load_checkpoint(out / "ckpt_best.pt")["data"], "")
    greedy, _, _ = run_sample(argv + ["--top_k", "1"])
    assert greedy == [tok.decode(greedy_reference(out, tok.encode("def "), 8))] * 3


def test_the_nanogpt_command_line_in_a_real_process(ckpts):
    """nanoGPT's sample command line, verbatim but for the prompt (the mini dataset has no 'f')."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, os.path.join(REPO, "sample.py"), "--out_dir", str(ckpts["tango"]),
                        "--start", "What ", "--num_samples", "3", "--max_new_tokens", "200", "--temperature", "0.8",
                        "--top_k", "200"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    parts = p.stdout.split(f"\n{sample.SEPARATOR}\n")
    assert len(parts) == 4 and parts[3] == "" and all(s.startswith("What ") and len(s) == 205 for s in parts[:3])


def closed_pipe(argv):
    """Run a command whose stdout pipe is closed before it writes (python CMD | head, once head has
    quit): (exit code, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=REPO)
    p.stdout.close()
    err = p.stderr.read()
    return p.wait(timeout=120), err


def test_a_closed_pipe_ends_every_command_quietly(ckpts):
    """sample.py | head (a reader that closes the pipe) ends quietly, without a BrokenPipeError traceback."""
    for argv in (["sample.py", "--out_dir", str(ckpts["loop"]), "--num_samples", "2", "--max_new_tokens", "8"],
                 ["flops.py", "--size", "cpu", "--depth", "4"],
                 ["-m", "tools.sweep", "report", "--root", "results/cpugrid"]):
        code, err = closed_pipe(argv)
        assert (code, "Traceback" in err) == (1, False), (argv, err)


def test_a_console_without_the_characters_gets_their_escapes():
    """A console whose encoding lacks a sampled character (PYTHONIOENCODING=ascii, a cp1252 console;
    the char vocabulary's unknown symbol is U+FFFD) prints its escape, not a UnicodeEncodeError
    traceback: every command's run_command sets stdout's errors to backslashreplace."""
    code = "from harness.cli import run_command; run_command(lambda: print('caf\\xe9 \\ufffd'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env={**os.environ, "PYTHONIOENCODING": "ascii"},
                       cwd=REPO, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (0, b"caf\\xe9 \\ufffd\n", b"")


# ----------------------------------------------------------------------------- bad input

BAD = [  # (flags, the one-line error's start)
    (["--num_samples", "0"], "error: --num_samples 0: must be >= 1"),
    (["--max_new_tokens", "-1"], "error: --max_new_tokens -1: must be an int >= 0"),
    (["--temperature", "-0.5"], "error: --temperature -0.5: must be a finite number >= 0"),
    (["--temperature", "nan"], "error: --temperature nan: must be a finite number >= 0"),
    (["--top_k", "-1"], "error: --top_k -1: must be >= 0 (0: all tokens)"),
    (["--seed", "-1"], "error: --seed -1: must be >= 0"),
    (["--seed", str(2 ** 64)], f"error: --seed {2 ** 64}: must be < 2**64"),  # torch.manual_seed's range
    (["--ckpt", "final"], "error: argument --ckpt: invalid choice: 'final'"),
    (["--num_samples", "x"], "error: argument --num_samples: invalid int value: 'x'"),
    (["--device", "tpu"], "error: --device tpu: use auto, cpu, cuda or cuda:N"),
    (["--start", "FILE:/nonexistent/prompt.txt"], "error: --start FILE:/nonexistent/prompt.txt: cannot read the "
     "prompt file (No such file or directory)"),
    (["--start", "What is 3 ~ 4?"], "error: --start: 1 character(s) not in the checkpoint's vocabulary of 22 "
     "symbols: '~'"),
    (["--out_dir", "/nonexistent"], "error: --out_dir: no checkpoint at /nonexistent/ckpt_best.pt"),
    (["--out_dir", sample.__file__], f"error: --out_dir {sample.__file__}: a file; give the run's folder"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_is_one_line_exit_2(ckpts, capsys, flags, message):
    code, out, err = call_main(["--out_dir", ckpts["loop"], *flags], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(message) and err.count("\n") == 1, err


def test_damaged_checkpoint_is_one_line_exit_2(ckpts, tmp_path, capsys):
    (tmp_path / "ckpt_best.pt").write_bytes((ckpts["loop"] / "ckpt_best.pt").read_bytes()[:1000])
    code, out, err = call_main(["--out_dir", tmp_path], capsys)
    assert (code, out) == (2, "")
    assert err == (f"error: {tmp_path / 'ckpt_best.pt'}: not a readable checkpoint (RuntimeError); "
                   "it may be truncated or corrupted\n")
    ck = load_checkpoint(ckpts["loop"] / "ckpt_best.pt")
    windowed = load_checkpoint(ckpts["tango-windowed"] / "ckpt_best.pt")
    for base, key, value, why in (  # a damaged config names the file, not a flag
            (ck, "model", "nope", "--model: unknown model 'nope'"), (ck, "depth", 0, "--depth 0"),
            (ck, "depth", "2", "'<' not supported"), (ck, "block_size", -1, "block_size -1: must be an int >= 1"),
            (ck, "width", 0, "width 0: must be an int >= 1"), (windowed, "window", 0, "--window 0")):
        torch.save({**base, "config": {**base["config"], key: value}}, tmp_path / "ckpt_best.pt")
        code, out, err = call_main(["--out_dir", tmp_path], capsys)
        assert (code, out, err.count("\n")) == (2, "", 1)
        assert err.startswith(f"error: {tmp_path / 'ckpt_best.pt'}: not a readable model config ({why}"), err
    torch.save({**ck, "args": argparse.Namespace(**ck["args"])}, tmp_path / "ckpt_best.pt")  # whole, but refused
    assert call_main(["--out_dir", tmp_path], capsys) == (2, "", (
        f"error: {tmp_path / 'ckpt_best.pt'}: not a readable checkpoint (UnpicklingError); it holds objects that "
        "torch.load(weights_only=True) refuses (not written by train.py)\n"))


def test_a_prompt_file_is_read_as_it_is(tmp_path):
    """--start FILE:path: the file's text with its line endings ("\r" is a symbol of text vocabularies)."""
    (tmp_path / "p.txt").write_bytes("a\r\nb\rc\n\u00e9".encode())
    assert sample.read_prompt(f"FILE:{tmp_path / 'p.txt'}") == "a\r\nb\rc\n\u00e9"
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")  # not "(UnicodeDecodeError)": what is wrong, and where
    with pytest.raises(sample.UsageError, match=re.escape(f"--start FILE:{tmp_path / 'latin1.txt'}: cannot read the "
                                                          "prompt file (not UTF-8: byte 0xe9 at offset 3)")):
        sample.read_prompt(f"FILE:{tmp_path / 'latin1.txt'}")


# ----------------------------------------------------------------------------- train.py --eval_only

def report_numbers(stdout):
    """The NLL, exact-match and depth-sweep lines of train.py's report, as printed."""
    keep = ("dev NLL (best", "test NLL (", "exact match ", "dev NLL by test-time depth", "non-embedding params ",
            "unigram entropy", "unigram NLL")
    return [line for line in stdout.splitlines() if line.startswith(keep)]


def files(folder):
    return {p: (os.path.getmtime(folder / p), (folder / p).read_bytes()) for p in sorted(os.listdir(folder))}


@pytest.mark.parametrize("name,extra,override", [("loop", ["--eval_depths", "1,2,3"], []),
                                                  ("parcae", [], ["--eval_batch_size", "3"])])
def test_eval_only_prints_the_training_runs_numbers_and_writes_nothing(mdm_flags, tmp_path, name, extra, override):
    out = tmp_path / "run"
    trained = tiny_run(name, mdm_flags, out, "--max_iters", "6", "--eval_interval", "2", "--em_samples", "3", *extra)
    expected = report_numbers(trained)
    assert len(expected) == 7 + bool(extra)  # params, 2 unigram, dev, test, exact match of 2 splits (+ sweep)
    best_line = [line for line in trained.splitlines() if line.endswith("(best)")][-1]  # "update N: dev NLL x (best)"
    before, folder = files(out), os.stat(out).st_mtime_ns  # the folder's time: nothing made in it, even briefly
    evaluated = train_main(["--eval_only", "--out_dir", out, "--data_root", mdm_flags[-1], *override])
    assert report_numbers(evaluated) == expected  # (the NLL does not depend on the evaluation batch size)
    upd, dev = re.fullmatch(r"update (\d+): dev NLL (\S+) \(best\)", best_line).groups()
    assert f"{f'dev NLL (best, upd {upd})':<25}{dev} nats/char" in evaluated.splitlines()  # dmmath: characters
    assert f"evaluating {out / 'ckpt_best.pt'} (update {upd};" in evaluated
    assert ("; --eval_batch_size 2 -> 3\n" in evaluated) == bool(override)
    assert "throughput" not in evaluated and files(out) == before and os.stat(out).st_mtime_ns == folder


def test_eval_only_bad_input(ckpts, mdm_flags, tmp_path, capsys, monkeypatch):
    def call(argv):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main([str(a) for a in argv])
        return e.value.code, capsys.readouterr().err

    root = ["--data_root", mdm_flags[-1]]
    assert call(["--eval_only", "--out_dir", tmp_path, *root]) == (
        2, f"error: --eval_only: no checkpoint at {tmp_path / 'ckpt_best.pt'}\n")
    assert call(["--eval_only", "--resume", "--out_dir", ckpts["loop"], *root]) == (
        2, "error: --eval_only: evaluates the run's best checkpoint without training; drop --resume\n")
    assert call(["--eval_only", "--depth", "3", "--out_dir", ckpts["loop"], *root]) == (
        2, f"error: --depth 3: the checkpoint in {ckpts['loop']} was trained with --depth 2; drop the flag to "
        "evaluate it\n")
    with monkeypatch.context() as m:  # rank 0 of two under torchrun
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():
            m.setenv(k, v)
        assert call(["--eval_only", "--out_dir", ckpts["loop"], *root]) == (
            2, "error: --eval_only: runs in one process; start it with python, not torchrun\n")
    assert not (tmp_path / "log.jsonl").exists() and os.listdir(tmp_path) == []


def test_data_module_reads_the_char_vocabulary_as_sample_does(data_root, ckpts):
    """sample.CheckpointTokenizer agrees with data.Data on the dataset the checkpoint was trained on."""
    data = data_mod.Data(str(next(data_root.iterdir())))
    tok = sample.CheckpointTokenizer(load_checkpoint(ckpts["loop"] / "ckpt_best.pt")["data"], "")
    assert tok.eot == data.eot and tok.encode(PROMPT) == data.encode(PROMPT)
    ids = list(range(data.vocab_size))
    assert tok.decode(ids) == data.decode(ids)


def test_eval_only_and_resume_read_the_runs_prepared_data_without_data_root(ckpts, mdm_flags, tmp_path, monkeypatch):
    """Without --data_root, --eval_only (and --resume, through the same merge) reads the bins the run
    was trained on where they are on this machine, instead of preparing the dataset again under ./data."""
    monkeypatch.chdir(tmp_path)  # a ./data here would be the default root
    out = train_main(["--eval_only", "--out_dir", ckpts["loop"]])
    assert "prepared" not in out and "dev NLL (best" in out and not (tmp_path / "data").exists()
    args = train.parse_args(["--out_dir", "x"])
    merge_resume_args(args, set(), {"data_root": str(tmp_path / "gone"), "depth": 3})
    assert args.data_root == "data" and args.depth == 3  # a root that is not here: the default stays


# ----------------------------------------------------------------------------- flags against the checkpoint

def eval_only_call(argv, capsys):
    """train.main(--eval_only ...) in this process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        train.main(["--eval_only", *[str(a) for a in argv]])
    except SystemExit as e:
        got = capsys.readouterr()
        return e.code, got.out, got.err
    got = capsys.readouterr()
    return 0, got.out, got.err


def test_eval_only_data_flags_against_the_checkpoint_before_any_preparation(ckpts, mdm_flags, tmp_path, capsys):
    """A data flag that contradicts the checkpoint is refused before a dataset is prepared (it used
    to prepare the other dataset, then say "another model ... use a fresh --out_dir"); --tokenizer
    auto is the checkpoint's tokenizer; a model flag the checkpoint's model ignores says so."""
    run, root = ckpts["tango"], tmp_path / "root"
    base = ["--out_dir", run, "--data_root", root]
    for flag, value, saved in (("--tokenizer", "gpt2", "auto"), ("--dataset", "stdlib", "dmmath")):
        code, out, err = eval_only_call([*base, flag, value], capsys)
        assert (code, out) == (2, "")
        assert err == (f"error: {flag} {value}: the checkpoint in {run} was trained with {flag} {saved}; "
                       "drop the flag to evaluate it\n")
    assert not root.exists()  # nothing prepared
    code, out, err = eval_only_call(["--out_dir", run, "--tokenizer", "auto", "--data_root", mdm_flags[-1]], capsys)
    assert code == 0 and report_numbers(out) == report_numbers(eval_only_call(["--out_dir", run], capsys)[1])
    code, out, err = eval_only_call(["--out_dir", run, "--window", "16"], capsys)
    assert (code, err) == (2, "error: --window: only used with --model tango-windowed; --model tango ignores it "
                              "(drop the flag)\n")


def test_eval_only_width_is_the_solved_width(ckpts, mdm_flags, capsys):
    run = ckpts["loop"]
    solved = load_checkpoint(run / "ckpt_best.pt")["config"]["width"]
    code, out, _ = eval_only_call(["--out_dir", run, "--width", solved, "--data_root", mdm_flags[-1]], capsys)
    assert code == 0 and "dev NLL (best" in out
    code, _, err = eval_only_call(["--out_dir", run, "--width", solved + 8], capsys)
    assert (code, err) == (2, f"error: --width {solved + 8}: the checkpoint in {run} was trained with --width 0 "
                              f"(solved: {solved}); drop the flag to evaluate it\n")


def test_eval_only_names_the_flags_it_does_not_use(ckpts, mdm_flags, capsys):
    code, out, _ = eval_only_call(["--out_dir", ckpts["loop"], "--max_iters", "20", "--learning_rate", "0.1",
                                   "--eval_depths", "1,2", "--dtype", "bfloat16", "--data_root", mdm_flags[-1]], capsys)
    head = next(line for line in out.splitlines() if line.startswith("evaluating "))
    assert code == 0 and "; cpu bfloat16; " in head  # --dtype is an evaluation flag: used, not "not used"
    assert head.endswith("; --eval_depths (none) -> 1,2; --dtype float32 -> bfloat16; not used without training: "
                         "--learning_rate, --max_iters")


@pytest.fixture(scope="module")
def jsonl_file(tmp_path_factory):
    """A JSONL file of 160 short Python-like documents (enough for every hash split)."""
    path = tmp_path_factory.mktemp("jsonl") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 6}) + "\n" for i in range(160)))
    return path


@pytest.mark.parametrize("spelling", ["path", "hf:PATH", "--hf_data_files"])
def test_a_local_dataset_is_found_from_another_folder(spelling, text_folder, jsonl_file, tmp_path, monkeypatch,
                                                     capsys):
    """A --dataset path, an hf:PATH or an --hf_data_files entry given relative to the training
    folder is recorded absolute, so --eval_only (and --resume, the same merge) works from any folder
    and the relative spelling is the same setting; a recorded path that is not here is one line
    naming its flag."""
    if spelling != "path":
        pytest.importorskip("datasets", reason="hf: data needs the optional extra: pip install datasets")
    src = text_folder if spelling == "path" else jsonl_file
    flag, flags = {"path": ("dataset", ["--dataset", src.name]),
                   "hf:PATH": ("dataset", ["--dataset", "hf:" + src.name]),
                   "--hf_data_files": ("hf_data_files", ["--dataset", "hf:json", "--hf_data_files", src.name])}[spelling]
    monkeypatch.chdir(src.parent)
    run = tmp_path / "run"
    trained = tiny_run("loop", [*flags, "--tokenizer", "char", "--data_root", tmp_path / "data"], run)
    code, out, err = eval_only_call(["--out_dir", run, *flags], capsys)  # the relative spelling: the same data
    assert (code, err) == (0, "") and report_numbers(out) == report_numbers(trained)
    monkeypatch.chdir(tmp_path)
    code, out, err = eval_only_call(["--out_dir", run], capsys)
    assert (code, err) == (0, "") and report_numbers(out) == report_numbers(trained)
    ck = load_checkpoint(run / "ckpt_best.pt")
    recorded = ("hf:" if spelling == "hf:PATH" else "") + str(src)
    assert ck["args"][flag] == recorded
    ck["args"][flag] = moved = recorded.replace(str(src), "moved-away" if spelling == "path" else str(tmp_path / "gone"))
    torch.save(ck, tmp_path / "ckpt_best.pt")
    code, _, err = eval_only_call(["--out_dir", tmp_path], capsys)
    assert (code, err) == (2, f"error: {tmp_path / 'ckpt_best.pt'}: trained on --{flag} {moved}, which is not "
                              f"found from {tmp_path}; run from the folder it was trained in, or give --{flag} "
                              "with the data's path\n")


def test_nan_weights_are_a_damaged_file_for_sample_and_eval_only(ckpts, tmp_path, capsys):
    """A checkpoint with NaN weights is a damaged file for sample.py and --eval_only: one line,
    exit 2 (not a traceback, nor a dev NLL of nan with exit 0)."""
    ck = load_checkpoint(ckpts["loop"] / "ckpt_best.pt")
    ck["model"]["norm_f.weight"][0] = float("nan")
    torch.save(ck, tmp_path / "ckpt_best.pt")
    message = f"error: {tmp_path / 'ckpt_best.pt'}: non-finite weights (norm_f.weight); the file is damaged\n"
    assert call_main(["--out_dir", tmp_path], capsys) == (2, "", message)
    code, out, err = eval_only_call(["--out_dir", tmp_path], capsys)
    assert (code, err) == (2, message)


def test_eval_only_damaged_folders(ckpts, mdm_flags, tmp_path, capsys):
    """A best checkpoint whose config disagrees with its own flags is damaged (not "use a fresh
    --out_dir": nothing is trained); a latest checkpoint of another model than the best, or a
    truncated one, is named."""
    ck = load_checkpoint(ckpts["loop"] / "ckpt_best.pt")
    width = ck["config"]["width"]
    torch.save({**ck, "config": {**ck["config"], "width": width + 8}}, tmp_path / "ckpt_best.pt")
    code, out, err = eval_only_call(["--out_dir", tmp_path, "--data_root", mdm_flags[-1]], capsys)
    assert (code, out) == (2, "")
    assert err == (f"error: {tmp_path / 'ckpt_best.pt'}: another model: width {width + 8} (now {width}); its model "
                   "config and its flags disagree (a damaged checkpoint, or one another version of train.py wrote)\n")
    torch.save(ck, tmp_path / "ckpt_best.pt")
    torch.save(load_checkpoint(ckpts["tango"] / "ckpt_latest.pt"), tmp_path / "ckpt_latest.pt")
    code, out, err = eval_only_call(["--out_dir", tmp_path, "--data_root", mdm_flags[-1]], capsys)
    assert (code, out) == (2, "")
    assert err == (f"error: {tmp_path / 'ckpt_latest.pt'}: another model than {tmp_path / 'ckpt_best.pt'}; "
                   "--eval_only reads the run's evaluation flags from it (move it away to use the best "
                   "checkpoint's)\n")
    latest = tmp_path / "ckpt_latest.pt"  # read mapped (its args, not its optimizer state): damage is still one line
    latest.write_bytes((ckpts["loop"] / "ckpt_latest.pt").read_bytes()[:5000])
    code, out, err = eval_only_call(["--out_dir", tmp_path, "--data_root", mdm_flags[-1]], capsys)
    assert (code, out) == (2, "")
    assert re.fullmatch(f"error: {re.escape(str(latest))}: not a readable checkpoint \\(\\w+\\); it may be truncated or "
                        "corrupted\n", err)


def test_a_given_auto_is_the_checkpoints_choice(tmp_path):
    """--tokenizer auto against a checkpoint trained with --tokenizer char (at the tiny tier auto
    would mean gpt2): the checkpoint's char, not a conflict."""
    args = train.parse_args(["--out_dir", "x", "--tokenizer", "auto"])
    assert merge_resume_args(args, {"tokenizer"}, {"tokenizer": "char", "model": "loop"}) == {}
    assert args.tokenizer == "char"


def own_text_run(tmp_path):
    """(folder, run): a four-file text dataset under tmp_path that the test may edit (text_folder is
    shared by the module), and a tiny loop run trained on it as characters."""
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(4):
        (folder / f"m{i}.py").write_text("".join(f"def area{i}_{j}(x):\n    return x * {j}\n\n" for j in range(40)))
    run = tmp_path / "run"
    tiny_run("loop", ["--dataset", folder, "--tokenizer", "char", "--data_root", tmp_path / "data"], run)
    return folder, run


def test_the_same_sizes_of_other_tokens_are_other_data(tmp_path, capsys):
    """A dataset folder edited after training (a and e swapped: the same characters, the same split
    sizes) is prepared again and refused by the splits' SHA-256; a signature without them (an older
    checkpoint) still compares tokenizer, vocabulary and sizes."""
    folder, run = own_text_run(tmp_path)
    ck = load_checkpoint(run / "ckpt_best.pt")
    data = data_mod.Data(data_mod.prepare(str(folder), None, str(tmp_path / "data"), tokenizer="char"))
    assert ck["data"]["sha256"] == data.meta["sha256"] and set(data.meta["sha256"]) == {"train", "dev", "test"}
    assert same_data({k: v for k, v in ck["data"].items() if k != "sha256"}, data)
    text = (folder / "m1.py").read_text()
    (folder / "m1.py").write_text(text.replace("a", "\0").replace("e", "a").replace("\0", "e"))
    code, out, err = eval_only_call(["--out_dir", run], capsys)
    assert code == 2 and err.startswith(f"error: {run / 'ckpt_best.pt'}: trained on other data (char tokenizer")
    assert err.endswith("; the same sizes, other tokens\n") and err.count("\n") == 1


@pytest.mark.parametrize("mode", ["--eval_only", "--resume"])
def test_a_character_set_that_grew_is_other_data(mode, tmp_path, capsys):
    """Characters added to a dataset folder after training change its char vocabulary, and so the
    model's vocab_size: --eval_only and --resume name the data ("trained on other data"), not
    another model or a damaged checkpoint."""
    folder, run = own_text_run(tmp_path)
    with open(folder / "m1.py", "a") as f:
        f.write("# \u00fc\u00ef\n")
    capsys.readouterr()
    argv = [mode, "--out_dir", str(run)] + (["--max_iters", "4"] if mode == "--resume" else [])
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert ": trained on other data (char tokenizer" in err and "another model" not in err and "damaged" not in err, err


def test_endoftext_in_a_prompt_is_the_end_of_text_token():
    """As in nanoGPT's sample.py: the text <|endoftext|> in --start is the token, for a text
    dataset's characters (whose vocabulary has the symbol); dmmath's has none (its end of text is
    the newline), so there the characters are refused as unknown."""
    itos = ["\n", "a", "b", EOT_SYMBOL, "\ufffd"]
    tok = sample.CheckpointTokenizer({"tokenizer": "char", "itos": itos}, "x")
    assert tok.encode(f"a{EOT_SYMBOL}b{EOT_SYMBOL}") == [1, 3, 2, 3] and tok.encode(EOT_SYMBOL) == [3]
    assert tok.decode(tok.encode(f"ab{EOT_SYMBOL}a")) == f"ab{EOT_SYMBOL}a"
    with pytest.raises(sample.UsageError, match="not in the checkpoint's vocabulary"):
        tok.encode("a\ufffd")  # the unknown id's symbol is no character of the vocabulary
    math = sample.CheckpointTokenizer({"tokenizer": "char", "itos": ["\n", "1", "<", "\ufffd"]}, "x")
    with pytest.raises(sample.UsageError, match="not in the checkpoint's vocabulary"):
        math.encode(EOT_SYMBOL)


def test_endoftext_in_a_gpt2_prompt_is_the_token(gpt2_bpe):
    bpe = sample.CheckpointTokenizer({"tokenizer": "gpt2"}, "x")
    assert bpe.encode(f"a{EOT_SYMBOL}b") == [64, 50256, 65]


def test_top_k_0_samples_among_all_tokens(tmp_path):
    """--top_k 0 means every token: the same draws as a k above the vocabulary's size (not a top_k
    of 0 handed to the model, which refuses it)."""
    _, run = own_text_run(tmp_path)
    argv = ["--out_dir", run, "--start", "def ", "--num_samples", "3", "--max_new_tokens", "16", "--temperature", "1.5"]
    every, _, _ = run_sample(argv + ["--top_k", "0"])
    assert every == run_sample(argv + ["--top_k", "100000"])[0]
    assert every != run_sample(argv + ["--top_k", "1"])[0] and len(every) == 3 and every[0].startswith("def ")
