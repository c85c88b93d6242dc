"""Local outputs are written with O_DIRECT where the file system allows it and through the page cache
where it refuses (``storage/localfile.py``): either way the file holds exactly the bytes written,
seeks back to patch a header included. The refusing file system is a real one: ramfs (no O_DIRECT
at all), mounted in a user namespace of a child process."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest

from ckpttool.storage import LocalFile, localfile, resolve


def _direct_allowed(directory) -> bool:
    try:
        fd = os.open(os.path.join(directory, ".probe"), os.O_WRONLY | os.O_CREAT | localfile.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.remove(os.path.join(directory, ".probe"))
    return bool(localfile.O_DIRECT)


def _random_writes(f, seed: int, count: int) -> bytes:
    """Writes of many sizes with a patch of earlier bytes now and then (as the archive writers
    patch a header), some below the buffer, some inside it; returns what the file must hold."""
    rng = random.Random(seed)
    expected = bytearray()
    for i in range(count):
        block = rng.randbytes(rng.choice([1, 100, 4096, 5000, 70000, 300000]))
        f.write(block)
        expected += block
        if i % 7 == 0:
            _patch(f, expected, rng)
    return bytes(expected)


def _patch(f, expected: bytearray, rng: random.Random) -> None:
    """Rewrite a few bytes already written (as an archive writer patches a header), then go on at the end."""
    at = rng.randrange(len(expected))
    patch = rng.randbytes(min(3, len(expected) - at))
    f.seek(at)
    f.write(patch)
    expected[at:at + len(patch)] = patch
    f.seek(0, os.SEEK_END)


@pytest.mark.parametrize("direct", [True, False])
def test_every_byte_lands_whatever_the_writes(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(localfile, "BUFFER", 64 << 10)  # many buffers, and patches below the buffer
    path = str(tmp_path / "out.bin")
    f = LocalFile(path, direct=direct)
    try:
        expected = _random_writes(f, seed=1, count=400)
        f.finish()
        used = f.direct
    finally:
        f.close()
    with open(path, "rb") as got:
        assert got.read() == expected
    if direct and _direct_allowed(tmp_path):
        assert used is True  # the direct path itself was taken (this file system allows it)
    if not direct:
        assert used is False


def test_a_file_under_one_buffer_is_never_direct_and_loses_no_byte(tmp_path):
    loc = resolve(str(tmp_path / "small.json"))
    loc.write_bytes(b'{"a": 1}')
    assert (tmp_path / "small.json").read_bytes() == b'{"a": 1}'


def test_a_direct_write_the_kernel_refuses_goes_on_through_the_page_cache(tmp_path, monkeypatch):
    """A file system may accept O_DIRECT when it is turned on and refuse the write (EINVAL): the
    buffer is then written through the page cache and the rest of the file too."""
    if not _direct_allowed(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT altogether (the ramfs test covers that)")
    monkeypatch.setattr(localfile, "BUFFER", 64 << 10)
    path = str(tmp_path / "out.bin")
    refused = []

    def misaligned_first(fd, view, offset):  # the first direct write from memory O_DIRECT cannot take
        if f.direct and not refused:
            odd = memoryview(bytearray(view.nbytes + 1))[1:]
            odd[:] = view
            try:
                return os.pwrite(fd, odd, offset)
            except OSError as exc:
                refused.append(exc.errno)
                raise
        return os.pwrite(fd, view, offset)

    f = LocalFile(path, direct=True, pwrite=misaligned_first)
    try:
        expected = _random_writes(f, seed=2, count=100)
        f.finish()
        assert f.direct is False and refused == [errno.EINVAL]  # the kernel's refusal, taken
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & localfile.O_DIRECT
    finally:
        f.close()
    with open(path, "rb") as got:
        assert got.read() == expected


_IN_RAMFS = textwrap.dedent("""
    import json, os, subprocess, sys
    import torch
    from ckpttool import Checkpointer
    from ckpttool.storage import LocalFile, localfile
    mnt = sys.argv[1]
    subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], check=True)
    try:
        try:
            os.close(os.open(os.path.join(mnt, "probe"), os.O_WRONLY | os.O_CREAT | localfile.O_DIRECT))
            refused = False
        except OSError:
            refused = True
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))  # 16 MiB: full buffers
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        ckpt = Checkpointer(os.path.join(mnt, "run"))
        ckpt.save(1, model, opt, extra={"step": 1})
        f = LocalFile(os.path.join(mnt, "big.bin"))
        f.write(bytes(range(256)) * (3 * localfile.BUFFER // 256 + 5))
        f.finish()
        used = f.direct
        f.close()
        fresh = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
        fopt = torch.optim.AdamW(fresh.parameters())
        Checkpointer(os.path.join(mnt, "run")).load(fresh, fopt)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        same = same and all(torch.equal(opt.state[p]["exp_avg_sq"], fopt.state[q]["exp_avg_sq"])
                            for p, q in zip(model.parameters(), fresh.parameters()))
        with open(os.path.join(mnt, "big.bin"), "rb") as got:
            big_ok = got.read() == bytes(range(256)) * (3 * localfile.BUFFER // 256 + 5)
        print(json.dumps({"refused": refused, "direct": used, "same": same, "big_ok": big_ok}))
    finally:
        subprocess.run(["umount", mnt], check=True)
""")


def _in_a_mount_namespace(script: str, mnt) -> dict:
    """Run ``script`` (argv[1]: ``mnt``) as root of a new user and mount namespace, where it may
    mount a file system; its last line of output, as JSON."""
    if not localfile.O_DIRECT or shutil.which("unshare") is None:
        pytest.skip("no O_DIRECT on this platform, or no unshare(1)")
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no user namespaces here to mount a file system in: {probe.stderr.strip()}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["unshare", "-Urm", sys.executable, "-c", script, str(mnt)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_file_system_that_refuses_o_direct_gets_every_byte_through_the_page_cache(tmp_path):
    """ramfs has no O_DIRECT: a save, its load and a large file written there are whole and exact."""
    result = _in_a_mount_namespace(_IN_RAMFS, tmp_path / "ramfs")
    assert result == {"refused": True, "direct": False, "same": True, "big_ok": True}, result


_FULL_DISK = textwrap.dedent("""
    import errno, json, os, subprocess, sys
    import torch
    from ckpttool import Checkpointer
    from ckpttool.errors import CkptError
    from ckpttool.storage import LocalFile, localfile
    mnt = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
    try:
        f = LocalFile(os.path.join(mnt, "big.bin"))
        raised = None
        try:
            for _ in range(3 * localfile.BUFFER // (1 << 20)):
                f.write(bytes(1 << 20))
            f.finish()
        except OSError as exc:
            raised = errno.errorcode.get(exc.errno)
        finally:
            f.close()
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
        try:
            Checkpointer(os.path.join(mnt, "run")).save(1, model, torch.optim.AdamW(model.parameters()))
            said = "saved"
        except CkptError as exc:
            said = str(exc)
        print(json.dumps({"raised": raised, "said": said, "left": sorted(os.listdir(os.path.join(mnt, "run")))}))
    finally:
        subprocess.run(["umount", mnt], check=True)
""")


def test_a_full_disk_mid_file_is_an_error_and_no_step(tmp_path):
    """A write of a full buffer fails (ENOSPC on a 4 MiB tmpfs): the file's
    writer gets the error, and a save there fails with one line and commits nothing."""
    result = _in_a_mount_namespace(_FULL_DISK, tmp_path / "small")
    assert result["raised"] == "ENOSPC", result
    assert "no space left on device while writing" in result["said"], result
    assert not [name for name in result["left"] if name.startswith("step-")], result


def _memory(nbytes: int, seed: int) -> mmap.mmap:
    """Page-aligned memory holding random bytes (as a staged buffer is)."""
    m = mmap.mmap(-1, nbytes)
    m[:] = random.Random(seed).randbytes(nbytes)
    return m


@pytest.mark.parametrize("buffered", [False, True], ids=["raw", "buffered"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_large_writes_go_from_the_callers_memory_where_they_can_and_every_byte_lands(tmp_path, direct, buffered):
    """A write of 1 MiB or more whose address agrees with the file offset modulo a page (or any, to a
    file that is not direct) goes to the file from the caller's memory: its head through the buffer,
    its middle straight, its tail into the buffer; mixed with small writes, patches and writes that
    do not agree, through io.BufferedWriter (which hands them on as read-only views) or not."""
    if direct and not _direct_allowed(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = str(tmp_path / "out.bin")
    f = LocalFile(path, direct=direct)
    out = io.BufferedWriter(f, buffer_size=64 << 10) if buffered else f
    source = _memory(8 << 20, seed=3)
    view = memoryview(source)
    rng = random.Random(4)
    expected = bytearray()
    agreeing = 0
    try:
        for i in range(60):
            kind = rng.choice(["small", "agrees", "disagrees"])
            if kind == "small":
                block = rng.randbytes(rng.choice([1, 100, 5000]))
            else:
                at = len(expected) % localfile.ALIGN + rng.randrange(4) * localfile.ALIGN + (kind == "disagrees")
                block = view[at:at + rng.choice([1 << 20, (2 << 20) + 123, (3 << 20) + 4096])]
                agreeing += kind == "agrees"
            out.write(block)
            expected += block
            if i % 9 == 0:
                _patch(out, expected, rng)
        out.flush()
        f.finish()
        assert f.direct is direct
    finally:
        del view, block
        f.close()
    with open(path, "rb") as r:
        assert r.read() == bytes(expected)
    assert agreeing > 0 and f.from_source > 0
    if direct:  # (at most a page of each head and tail went through the buffer)
        assert f.from_source >= len(expected) - (60 - agreeing) * (3 << 20 + 4096 + 5000) - agreeing * 2 * localfile.ALIGN


def test_a_large_write_whose_address_disagrees_with_the_offset_is_copied_into_the_buffer(tmp_path):
    if not _direct_allowed(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    source = _memory(12 << 20, seed=5)
    path = str(tmp_path / "out.bin")
    f = LocalFile(path, direct=True)
    try:
        f.write(b"x" * 100)
        f.write(memoryview(source))  # from a page, at offset 100: no direct write can take it from there
        f.finish()
        assert f.from_source == 0 and f.direct  # (direct all the same, from the buffer)
    finally:
        f.close()
    with open(path, "rb") as r:
        assert r.read() == b"x" * 100 + source[:]
