"""`fastckpt inspect/verify/convert` with URL arguments (moto's real S3 server)."""

import json

import torch

import fastckpt
from fastckpt.cli import command as cli

from states import same_state


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_accepts_urls(s3, tmp_path, capsys):
    url, opts, _, srv = s3
    sd = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3)}
    fastckpt.save(sd, url + "/c.pt", storage_options=opts)
    so = json.dumps(opts)
    rc, out, err = _run(capsys, "inspect", url + "/c.pt", "--storage-options", so, "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert url + "/c.pt" in out and "fastckpt-cli-" not in out
    assert "w" in json.dumps(rep)
    rc, out, err = _run(capsys, "verify", url + "/c.pt", "--storage-options", so)
    assert rc == 0 and url + "/c.pt" in out, (out, err)
    rc, out, err = _run(capsys, "convert", url + "/c.pt", url + "/c.safetensors", "--storage-options", so)
    assert rc == 0, err
    rc, out, err = _run(capsys, "convert", url + "/c.pt", url + "/c.safetensors", "--storage-options", so)
    assert rc == 2 and "exists" in err  # no --force
    from safetensors.torch import load
    b, k = url.split("://")[1].split("/", 1)
    blob = srv.boto3_client().get_object(Bucket=b, Key=k + "/c.safetensors")["Body"].read()
    assert same_state(load(blob), sd)
    # a damaged remote object: verify fails and names the URL
    blob = bytearray(srv.boto3_client().get_object(Bucket=b, Key=k + "/c.pt")["Body"].read())
    at = bytes(blob).find(sd["w"].numpy().tobytes()[:64])
    blob[at + 100] ^= 0xFF
    srv.boto3_client().put_object(Bucket=b, Key=k + "/c.pt", Body=bytes(blob))
    rc, out, err = _run(capsys, "verify", url + "/c.pt", "--storage-options", so)
    assert rc == 1 and url + "/c.pt" in out + err and "fastckpt-cli-" not in out + err, (out, err)
    rc, out, err = _run(capsys, "inspect", url + "/missing.pt", "--storage-options", so)
    assert rc == 1 and url + "/missing.pt" in err, err
