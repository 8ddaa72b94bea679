"""The run folder (--out_dir) while a run writes it: one training run holds it (a second is refused,
readers are not), a full disk stops the run in one line with the last good checkpoint intact, and
under torchrun every rank's stop line is true. The runs are train.py's tiny loop model on the mini
DeepMind Mathematics set of tests/conftest.py (mdm, data_root)."""
import errno
import glob
import io
import os
import subprocess
import sys

import pytest
import torch

import harness.cli
import train
from harness.cli import FolderLock

from test_train import REPO, flags  # noqa: E402  (train.py's tiny run of the train tests)

pytestmark = pytest.mark.usefixtures("one_thread")


def main(argv, capsys):
    """train.main in this process: (exit code, stderr)."""
    try:
        train.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def refused(holder):
    return RuntimeError(f"held by {holder}")


# ----------------------------------------------------------------------------- one writer at a time

def test_a_second_training_run_into_a_held_folder_is_refused_before_writing(mdm, data_root, tmp_path, capsys):
    """Another process holds out/x (a live run): a training run into it, fresh or --resume, is one line
    naming the folder and the holder, exit 2, and the folder is left as it was (no file removed, none
    written). Before the hold a fresh run into a live run's folder removed the live run's checkpoints."""
    out = tmp_path / "x"
    assert main(flags(mdm, data_root, out, "--max_iters", "4", "--eval_interval", "2"), capsys)[0] == 0
    before = sorted(os.listdir(out))
    lock = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                             "from harness.cli import FolderLock; FolderLock(sys.argv[2]).acquire(RuntimeError); "
                             "print('held', flush=True); time.sleep(60)", REPO, str(out)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert lock.stdout.readline() == "held\n"
        for extra in (["--max_iters", "4", "--seed", "2"], ["--resume", "--max_iters", "6"]):
            code, err = main(flags(mdm, data_root, out, "--eval_interval", "2", *extra), capsys)
            assert code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"error: --out_dir {out}: another training run is writing there (pid {lock.pid} on ")
            assert err.endswith("; wait for it to end, or give another --out_dir (reading it, --eval_only and "
                                "sample.py, needs no wait)\n")
            assert sorted(set(os.listdir(out)) - {FolderLock.NAME}) == before  # (.lock: the holder's)
        # readers need no hold
        assert main(["--eval_only", "--out_dir", str(out)], capsys)[0] == 0
    finally:
        lock.kill()
        lock.wait()
    # the holder is gone (killed: its lock file stays, stale): the next run takes the folder over
    assert os.path.exists(out / FolderLock.NAME)
    assert main(flags(mdm, data_root, out, "--resume", "--max_iters", "6", "--eval_interval", "2"), capsys)[0] == 0
    assert not os.path.exists(out / FolderLock.NAME)  # released at the end


def test_a_held_folder_is_released_and_a_created_one_removed_when_the_run_fails(mdm, data_root, tmp_path, capsys):
    """A run that stops before its first update (here a bad --eval_windows for the split) leaves no
    folder it created and no lock file; the hold itself is exclusive within one host."""
    out = tmp_path / "new" / "run"
    code, err = main(flags(mdm, data_root, out, "--max_iters", "2", "--block_size", "100000"), capsys)
    assert code == 2 and not (tmp_path / "new").exists(), err
    held = FolderLock(str(tmp_path / "f")).acquire(refused)
    with pytest.raises(RuntimeError, match=r"^held by pid \d+ on "):
        FolderLock(str(tmp_path / "f")).acquire(refused)
    held.release()
    assert not (tmp_path / "f").exists()  # created by the hold, nothing else written: removed
    FolderLock(str(tmp_path / "f")).acquire(refused).release()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)")
def test_a_second_torchrun_job_into_a_held_folder_is_refused_on_every_rank(mdm, data_root, tmp_path):
    """Under torchrun rank 0 takes the hold and every rank learns the refusal (one error line, from
    rank 0; exit 2), instead of ranks waiting for a rank that stopped."""
    out = tmp_path / "x"
    held = FolderLock(str(out)).acquire(refused)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            os.path.join(REPO, "train.py"), *flags(mdm, data_root, out, "--max_iters", "2",
                                                                     "--gradient_accumulation_steps", "2")],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    finally:
        held.release()
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr
    assert errors[0].startswith(f"error: --out_dir {out}: another training run is writing there (pid {os.getpid()} on ")


# ----------------------------------------------------------------------------- a full disk

class FullDisk(io.RawIOBase):
    """A file that takes `room` bytes, then fails every write with ENOSPC, as a full device does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.f.write(b)

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()
        super().close()


@pytest.mark.parametrize("failing_save", [2, 1])
def test_a_full_disk_under_a_checkpoint_is_one_line_and_keeps_the_last_one(failing_save, mdm, data_root, tmp_path,
                                                                            monkeypatch, capsys):
    """The disk fills while the update-4 checkpoint is written: torch.save's zip writer then raises
    a RuntimeError while the ENOSPC unwinds (the 44-line double traceback). The run stops in one line
    naming the folder, "no space left on device" and the last good checkpoint, exit 1; that
    checkpoint (update 2) still loads, and no temporary file is left. When the first latest checkpoint
    fails, the line says that the best one (written just before) holds the weights, and none resumes."""
    out = tmp_path / "x"
    real_open, writes = open, []

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if "ckpt_latest.pt.tmp-" in str(path):
            writes.append(path)
            if len(writes) == failing_save:  # the second (update 4) or the first (update 2) latest checkpoint
                return FullDisk(f, room=4096)
        return f
    monkeypatch.setattr(harness.cli, "open", fake_open, raising=False)
    code, err = main(flags(mdm, data_root, out, "--max_iters", "6", "--eval_interval", "2"), capsys)
    if failing_save == 1:
        assert code == 1 and err == (f"error: {out}: no space left on device; stopped after update 2; no checkpoint "
                                     f"to resume from yet; {out}/ckpt_best.pt (update 2) holds the best weights "
                                     "(--eval_only and sample.py read it)\n"), err
        assert not os.path.exists(out / "ckpt_latest.pt") and glob.glob(str(out / "*.tmp-*")) == []
        return
    assert code == 1 and err == (f"error: {out}: no space left on device; stopped after update 4; the last good "
                                 f"checkpoint is {out}/ckpt_latest.pt (update 2)\n"), err
    assert torch.load(out / "ckpt_latest.pt", weights_only=True)["iter"] == 2
    assert glob.glob(str(out / "*.tmp-*")) == [] and not os.path.exists(out / FolderLock.NAME)


def test_every_command_says_a_full_disk_in_one_line(capsys):
    """run_command, under every command: a write on a full disk, however deep the exceptions it
    raised while unwinding, is one line with the file and exit code 1."""
    def main_():
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out/x.bin")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    with pytest.raises(SystemExit) as e:
        harness.cli.run_command(main_)
    assert e.value.code == 1
    assert capsys.readouterr().err == ("error: /data/out/x.bin: no space left on device; free some space and run the "
                                       "command again\n")


# ----------------------------------------------------------------------------- a stop under torchrun

@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)")
def test_sigterm_under_torchrun_prints_only_true_lines(mdm, data_root, tmp_path):
    """SIGTERM to a torchrun job after its first checkpoint: rank 0 names the last good checkpoint and
    how to resume; rank 1, which does not write checkpoints, says only that it stopped and that rank
    0 names the checkpoint (it said "no checkpoint exists yet" beside rank 0's checkpoint)."""
    import signal
    import time
    out = tmp_path / "x"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          os.path.join(REPO, "train.py"), *flags(mdm, data_root, out, "--max_iters", "100000",
                                                                   "--eval_interval", "2",
                                                                   "--gradient_accumulation_steps", "2")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.time() + 240
        while not (out / "ckpt_latest.pt").exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert (out / "ckpt_latest.pt").exists(), p.communicate(timeout=60)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    stops = [line for line in err.splitlines() if line.startswith("terminated: ")]
    assert len(stops) == 2, err
    rank0 = next(s for s in stops if "the last good checkpoint is" in s)
    assert rank0.startswith("terminated: stopped after update ") and f"--resume --out_dir {out} continues" in rank0
    rank1 = next(s for s in stops if s is not rank0)
    assert rank1.startswith("terminated: rank 1 stopped after update ")
    assert rank1.endswith("; rank 0 names the checkpoint left") and "no checkpoint exists yet" not in err


def test_a_second_sweep_into_a_held_root_is_refused(tmp_path, monkeypatch):
    """One sweep at a time in a --root: a second `sweep run` into it (here the root is held by this
    process) is one line naming the root and the holder, before any run starts or any line is logged;
    once released, the same command runs."""
    from common import UsageError
    from tools import sweep
    started = []
    monkeypatch.setattr(sweep, "prepare_data", lambda resolved: None)
    monkeypatch.setattr(sweep, "run_process", lambda cmd, stdout, env: started.append(cmd) or 0)
    argv = ["run", "--root", str(tmp_path / "grid"), "--models", "loop", "--depths", "2", "--", "--size", "tiny"]
    held = FolderLock(str(tmp_path / "grid")).acquire(refused)
    try:
        with pytest.raises(UsageError, match=rf"^--root {tmp_path / 'grid'}: another sweep is running there \(pid "
                                             rf"{os.getpid()} on .*\); wait for it to end"):
            sweep.main(argv)
        assert started == [] and os.listdir(tmp_path / "grid") == [FolderLock.NAME]
    finally:
        held.release()
    assert sweep.main(argv) == 0 and len(started) == 1 and not os.path.exists(tmp_path / "grid" / FolderLock.NAME)


def test_a_latent_token_study_into_a_held_folder_is_refused(tmp_path, capsys):
    """The latent-token study's pretrain and sweep write their --out_dir: a second one there is one
    line naming the folder and its holder, exit 2, before any work."""
    from studies import latent_experiments
    held = FolderLock(str(tmp_path / "base")).acquire(refused)
    try:
        with pytest.raises(SystemExit) as e:
            latent_experiments.main(["pretrain", "--out_dir", str(tmp_path / "base"), "--steps", "1"])
    finally:
        held.release()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --out_dir {tmp_path / 'base'}: another run is writing there (pid {os.getpid()} on ")


def test_a_hold_that_cannot_write_its_holder_leaves_nothing(tmp_path, monkeypatch):
    """On a full disk the lock file's holder text fails to write: the hold is not taken and neither
    the lock file nor the folder it created is left behind (a later run would find them)."""
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(harness.cli.os, "write", full)
    with pytest.raises(OSError, match="No space left on device"):
        FolderLock(str(tmp_path / "new" / "run")).acquire(refused)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
