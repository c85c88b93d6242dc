"""Every command and the Checkpointer against a real S3-API server on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import fsspec
import pytest
import torch

from ckpttool import convert
from ckpttool.formats import open_source
from ckpttool.offline.reshard import reshard
from ckpttool.offline.verify import verify_against, verify_path

from ..dist.harness import run_ranks
from ..dist.workloads import assert_same, load_into_fresh, train_run
from ..helpers import assert_same_nested
from ..helpers import reference_state


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ckpttool.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_checkpointer_save_on_2_load_on_3_and_async(s3_server, bucket):
    root = f"s3://{bucket}/run"
    trained = run_ranks(train_run, 2, steps=3, ckpt_dir=root, save_every=3, env=s3_server.env)[0]
    for r in run_ranks(load_into_fresh, 3, root, env=s3_server.env):
        assert r["step"] == 3
        assert_same(trained["state"], r["state"], "s3: saved on 2, loaded on 3")
    root2 = f"s3://{bucket}/async"
    trained = run_ranks(train_run, 2, steps=2, ckpt_dir=root2, save_every=1, async_save=True, env=s3_server.env)[0]
    r = run_ranks(load_into_fresh, 2, root2, env=s3_server.env)[0]
    assert r["step"] == 2
    assert_same(trained["state"], r["state"], "s3 async")
    assert cli("verify", root2).returncode == 0
    listing = cli("inspect", root2, "--json")
    assert listing.returncode == 0 and '"step": 2' in listing.stdout


def test_convert_both_ways_reshard_verify_inspect(s3_server, bucket, ref_pt, tmp_path):
    remote = f"s3://{bucket}/ck"
    convert(str(ref_pt), remote)  # local -> s3 DCP
    convert(remote, str(tmp_path / "m.safetensors"))  # s3 -> local safetensors
    with open_source(str(tmp_path / "m.safetensors")) as src:
        for k, v in reference_state()["model"].items():
            assert torch.equal(src.read_tensor(f"model.{k}").view(-1).view(torch.uint8) if v.numel() else src.read_tensor(f"model.{k}"),
                               v.contiguous().view(-1).view(torch.uint8) if v.numel() else v)
    reshard(remote, f"s3://{bucket}/r3", world_size=3)  # s3 -> s3
    assert verify_against(f"s3://{bucket}/r3", str(ref_pt)).ok
    assert verify_path(f"s3://{bucket}/r3").ok
    out = tmp_path / "back.pt"
    convert(f"s3://{bucket}/r3", str(out))
    assert_same_nested(torch.load(out, weights_only=True), reference_state())
    result = cli("inspect", f"s3://{bucket}/r3")
    assert result.returncode == 0 and "__2_0.distcp" in result.stdout


def test_reads_are_ranged(s3_server, bucket, tmp_path):
    big = tmp_path / "big.pt"
    torch.save({"a": torch.zeros(4 << 20), "b": torch.ones(16)}, big)  # 16 MiB + 64 bytes
    fs = fsspec.filesystem("s3")
    fs.put(str(big), f"{bucket}/big.pt")
    before = s3_server.log_text().count(f"/{bucket}/big.pt")
    with open_source(f"s3://{bucket}/big.pt") as src:
        assert torch.equal(src.read_tensor("b"), torch.ones(16))
        assert src.read_tensor("a", ((100,), (10,))).sum() == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", s3_server.log_text())  # the server colours its log
    lines = [ln for ln in text.splitlines() if f"/{bucket}/big.pt" in ln][before:]
    gets = [ln for ln in lines if '"GET ' in ln]
    assert gets and all('" 206 ' in ln for ln in gets), gets  # partial content only, never the whole object
    assert len(gets) < 12, len(gets)


def test_a_large_read_is_split_into_concurrent_ranged_requests(s3_server, bucket, tmp_path):
    """A 48 MiB tensor is read from s3 as ranged GETs of at most PART_BYTES, several in flight at
    once (s3fs sends a batch concurrently), and arrives bit for bit. botocore's event hooks on the
    client of an s3fs instance of the test's own see each GET leave (its Range) and its answer
    arrive; the requests go to the real server."""
    from ckpttool.storage import PARALLEL_PARTS, PART_BYTES, Fsspec, Location

    torch.manual_seed(0)
    a = torch.randn(12 << 20)  # 48 MiB: three parts
    torch.save({"a": a}, tmp_path / "big.pt")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put(str(tmp_path / "big.pt"), f"{bucket}/parts.pt")
    seen = {"now": 0, "most": 0, "ranges": []}

    def sent(request, **kwargs):
        first, last = re.fullmatch(r"bytes=(\d+)-(\d+)", request.headers["Range"].decode()).groups()
        seen["ranges"].append((int(first), int(last) + 1))
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])

    def answered(**kwargs):
        seen["now"] -= 1

    fs.s3.meta.events.register("before-send.s3.GetObject", sent)
    fs.s3.meta.events.register("after-call.s3.GetObject", answered)
    with open_source(Location(Fsspec(fs), f"{bucket}/parts.pt")) as src:
        assert torch.equal(src.read_tensor("a").view(torch.int32), a.view(torch.int32))
    ranges = seen["ranges"]  # in the order sent (the zip CRC check reads the record first, in its own blocks)
    assert ranges and all(0 < e - s <= PART_BYTES for s, e in ranges), ranges
    runs = [ranges[i:j] for i in range(len(ranges)) for j in range(i + 2, len(ranges) + 1)
            if all(x[1] == y[0] for x, y in zip(ranges[i:j], ranges[i + 1:j]))]
    assert any(run[-1][1] - run[0][0] == a.numel() * 4 for run in runs), ranges  # requests sent back to back tile the tensor
    assert 1 < seen["most"] <= PARALLEL_PARTS, seen


def test_bad_remote_input_exits_2_naming_the_url(s3_server, s3_server_with_auth, bucket, ref_pt):
    missing_bucket = cli("inspect", "s3://no-such-bucket-xyz/ck")
    assert missing_bucket.returncode == 2 and "s3://no-such-bucket-xyz/ck" in missing_bucket.stderr
    missing_key = cli("convert", f"s3://{bucket}/nothing-here", "/tmp/never-written.pt")
    assert missing_key.returncode == 2 and f"s3://{bucket}/nothing-here" in missing_key.stderr
    wrong = cli("inspect", f"s3://{bucket}/ck", env={"AWS_ENDPOINT_URL": s3_server_with_auth.endpoint, "AWS_ACCESS_KEY_ID": "nobody"})
    assert wrong.returncode == 2 and "permission denied" in wrong.stderr and f"s3://{bucket}/ck" in wrong.stderr
    for r in (missing_bucket, missing_key, wrong):
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_dcp_records_on_s3_cost_less_than_one_request_each(s3_server, bucket, tmp_path):
    """A record fetched whole (head, pickle, data) answers its tensor data read too, and the records
    that follow it in the file come in the same span: converting a DCP checkpoint off s3 makes
    fewer ranged GETs than it has records (it used to be three per record: head, tail, data)."""
    torch.manual_seed(0)
    n = 8
    state = {"model": {f"w{i}": torch.randn(3 << 18) for i in range(n)}}  # 3 MiB each: past the 1 MiB "small" records
    torch.save(state, tmp_path / "s.pt")
    url = f"s3://{bucket}/onereq"
    convert(str(tmp_path / "s.pt"), url)
    before = s3_server.log_text().count("/onereq/__0_0.distcp")
    convert(url, str(tmp_path / "back.safetensors"))
    text = re.sub(r"\x1b\[[0-9;]*m", "", s3_server.log_text())
    lines = [ln for ln in text.splitlines() if "/onereq/__0_0.distcp" in ln][before:]
    gets = [ln for ln in lines if '"GET ' in ln]
    assert all('" 206 ' in ln for ln in gets), gets
    assert len(gets) < n, len(gets)
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "back.safetensors"))
    assert all(torch.equal(back[f"model.w{i}"], state["model"][f"w{i}"]) for i in range(n))


def test_a_missing_bucket_is_never_created(s3_server, bucket, ref_pt):
    """convert, reshard and the Checkpointer refuse a bucket that does not exist (exit 2, one line)
    instead of creating it, as `aws s3 cp` refuses."""
    import torch

    from ckpttool import Checkpointer
    from ckpttool.errors import NotFoundError

    s3 = fsspec.filesystem("s3", skip_instance_cache=True)
    for args in (("convert", ref_pt, "s3://no-such-bucket-abc/x"), ("convert", ref_pt, "s3://no-such-bucket-abc/x.safetensors"),
                 ("convert", ref_pt, "s3://no-such-bucket-abc/x.pt"), ("clean", "s3://no-such-bucket-abc/run")):
        r = cli(*args)
        assert r.returncode == 2 and "no-such-bucket-abc" in r.stderr and "does not exist" in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotFoundError, match="bucket no-such-bucket-abc does not exist"):
        Checkpointer("s3://no-such-bucket-abc/run").save(1, model)
    assert not s3.exists("no-such-bucket-abc")


def test_a_listing_shows_what_another_process_wrote_since(s3_server, bucket):
    """Rank 0 polls storage for the other ranks' indexes at commit: a listing cached by fsspec
    (s3fs's dircache) must not hide a file another process wrote after the first listing (a CI
    run hung there, waiting for an index that was present)."""
    from ckpttool.storage import resolve

    step = resolve(f"s3://{bucket}/run/.step-1.tmp-0")
    step.child("__0_0.distcp").write_bytes(b"rank 0")
    assert step.listdir() == ["__0_0.distcp"]  # listed (and cached) before the other rank's file
    other = fsspec.filesystem("s3", skip_instance_cache=True)  # another process's view
    with other.open(f"{bucket}/run/.step-1.tmp-0/.ckpttool-rank-1.json", "wb") as f:
        f.write(b"{}")
    assert step.listdir() == [".ckpttool-rank-1.json", "__0_0.distcp"]
