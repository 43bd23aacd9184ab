"""A model file changed in place under a running model (kvcore/loaders/watched.py): requests fail with
ModelFileChangedError (HTTP 503), ``/health`` says which file and how, and a truncated mapped cache entry does not
kill the server with SIGBUS, since nothing reads its pages any more. The same holds for the entry of a draft
model that speculative decoding loaded. The truncation runs in a subprocess: were
the check missing, the next forward would fault on the mapped pages and take the test process down with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcore.errors import ModelFileChangedError
from kvcore.loaders.watched import WatchedFile
from kvcore.paths import cache_root

pytest.importorskip("transformers")
TESTS = Path(__file__).parents[1]


def test_a_watched_file_tells_replaced_written_and_truncated_apart(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(bytes(4096))
    watched = WatchedFile(path)
    assert watched.problem() is None
    (tmp_path / "new").write_bytes(b"\1" * 100)
    os.replace(tmp_path / "new", path)  # a new file at the path: the open one is unchanged
    assert watched.problem() is None

    path.write_bytes(bytes(4096))
    watched = WatchedFile(path)
    with open(path, "r+b") as f:  # the same size, written in place
        f.write(b"\1")
        os.utime(f.fileno(), ns=(0, 0))
    assert "was written to while in use" in watched.problem()
    os.truncate(path, 1000)
    assert "was truncated while in use (4096 -> 1000 bytes)" in watched.problem()
    with pytest.raises(ModelFileChangedError, match="truncated"):
        watched.check()


_SERVE_AND_CHANGE = """
import http.client, json, os, shutil, sys
from tiny_checkpoints import build_hf, write_gguf
from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.serving import AsyncEngine, build_app
from kvcore.serving.server import ServerThread

gguf = write_gguf(build_hf("llama"), "llama", os.path.join(sys.argv[1], "m.gguf"))
draft = shutil.copy(gguf, os.path.join(sys.argv[1], "draft.gguf"))  # a file, and an entry, of its own
config = EngineConfig(backend="sdpa", max_model_len=64, max_num_seqs=2, **SPECULATION)
Engine.from_pretrained(str(gguf), config)  # writes the prepared-model cache entries
engine = Engine.from_pretrained(str(gguf), config)  # maps them
(entry,) = [f.path for f in WATCHED.mapped_files]
params = SamplingParams(max_new_tokens=4, ignore_eos=True)
assert engine.generate([[5, 6, 7]], params)[0].error is None

def call(srv, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request(method, path, body=json.dumps(body) if body else None, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out

with ServerThread(build_app(AsyncEngine(engine), model_name="m")) as srv:
    completion = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}
    assert call(srv, "GET", "/health")[0] == 200
    assert call(srv, "POST", "/v1/completions", completion)[0] == 200
    CHANGE
    status, body = call(srv, "GET", "/health")
    print("health", status, body.get("error", {}).get("message", body))
    status, body = call(srv, "POST", "/v1/completions", completion)
    print("completion", status, body.get("error", {}).get("message", body))
"""


@pytest.mark.parametrize("model, speculation", [
    ("engine.model", "{}"),
    ("engine.speculator.proposer.model", "dict(proposer='draft', proposer_options={'draft': {'model': draft}})"),
], ids=["target", "draft"])
@pytest.mark.parametrize("change, how", [
    ("os.truncate(entry, os.path.getsize(entry) // 2)", "was truncated while in use"),
    ("f = open(entry, 'r+b'); f.seek(4096); f.write(b'x'); f.close()", "was written to while in use"),
], ids=["truncated", "written"])
def test_a_mapped_entry_changed_in_place_fails_health_and_requests_not_the_server(tmp_path, change, how, model,
                                                                                  speculation):
    script = (_SERVE_AND_CHANGE.replace("CHANGE", change).replace("WATCHED", model)
              .replace("**SPECULATION", f"**{speculation}"))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if (cache_root() / "kernels").is_dir():  # a draft runs on cpu_decode: its kernels, not built a second time
        shutil.copytree(cache_root() / "kernels", cache / "kernels")
    env = {**os.environ, "KVCORE_CACHE_DIR": str(cache), "KVCORE_MODEL_CACHE": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # -7: killed by SIGBUS
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines["health"].startswith("503 model file '") and how in lines["health"], lines
    assert lines["completion"].startswith("503 model file '") and how in lines["completion"], lines
    assert "model.pt" in lines["health"]
